"""PPO on CartPole-v1, CleanRL style, on rlcollect's on-policy batches.

One file, read top to bottom: CleanRL's ``ppo.py`` with its hyperparameters (4 envs,
128 steps per rollout, Adam at 2.5e-4 annealed to 0, gamma 0.99, GAE lambda 0.95,
4 minibatches, 4 epochs, clip 0.2, entropy 0.01, value 0.5, gradient norm 0.5). The
rollout comes from ``AsyncBatchedCollector(on_policy=True)``: each batch is
``[num_envs, num_steps]``, row ``e`` env ``e``'s next 128 steps, all computed with the
weights of the last update (the envs wait while the learner learns), so the rollout
is exactly CleanRL's. Episodic returns come from ``("next", "episode_return")`` at done
rows.

``--loop sync`` runs the same algorithm on the original's own rollout loop, a plain
synchronous ``gymnasium.vector.SyncVectorEnv`` stepped from this process, so that both
can be timed and compared in one run (``--loop rlcollect sync``).

The collector is given no layout arguments: it measures the envs and the agent when it
is built and chooses where they run (``collector.describe()``, printed at the start:
for CartPole, one worker thread that steps the four envs and runs the agent for all of
them, since a CartPole step is far cheaper than the agent's forward). ``--inference``
and ``--workers`` give a layout by hand instead.

``--overlap`` (rlcollect only) collects the next rollout while the learner learns
(``policy_lag=1``): the collector starts round ``k+1`` as soon as it hands out round
``k``, so the envs step with the weights of update ``k-1`` while update ``k`` runs, on
another core. The lag is then exactly one update (each rollout's ``policy_version``
against the learner's count of updates, logged as ``policy_lag``); PPO's ratio uses the
stored log-probability of the behaviour policy, so its clip bounds how far the stale
rows move the policy.

    python examples/ppo_cartpole.py                                # 500k steps, seed 1
    python examples/ppo_cartpole.py --seeds 1 2 3 --loop rlcollect sync
    python examples/ppo_cartpole.py --overlap --loop rlcollect sync  # collection beside learning
    python examples/ppo_cartpole.py --total-timesteps 4096         # a quick smoke run
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import torch
from torch import nn
from torch.distributions import Categorical
from tqdm import tqdm

from rlcollect import AsyncBatchedCollector


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[1])
    p.add_argument("--loop", nargs="+", choices=["rlcollect", "sync"], default=["rlcollect"])
    p.add_argument("--total-timesteps", type=int, default=500_000)
    p.add_argument("--num-envs", type=int, default=4)
    p.add_argument("--num-steps", type=int, default=128, help="steps of each env per rollout")
    p.add_argument("--learning-rate", type=float, default=2.5e-4)
    p.add_argument("--no-anneal-lr", dest="anneal_lr", action="store_false")
    p.add_argument("--gamma", type=float, default=0.99)
    p.add_argument("--gae-lambda", type=float, default=0.95)
    p.add_argument("--num-minibatches", type=int, default=4)
    p.add_argument("--update-epochs", type=int, default=4)
    p.add_argument("--clip-coef", type=float, default=0.2)
    p.add_argument("--ent-coef", type=float, default=0.01)
    p.add_argument("--vf-coef", type=float, default=0.5)
    p.add_argument("--max-grad-norm", type=float, default=0.5)
    # The layout by hand (default: the collector chooses; docs/tuning.md)
    p.add_argument("--inference", choices=["auto", "worker", "thread", "process"], default="auto")
    p.add_argument(
        "--workers",
        type=int,
        help="worker processes, the envs split evenly over them (default: the collector chooses)",
    )
    p.add_argument(
        "--overlap",
        action="store_true",
        help="rlcollect: collect the next rollout while the learner learns (a lag of one update)",
    )
    p.add_argument("--out", type=Path, default=Path("runs"), help="where results go")
    args = p.parse_args(argv)
    if args.overlap and "rlcollect" not in args.loop:
        p.error("--overlap is a way of running the collector: it needs --loop rlcollect")
    return args


def make_env() -> gym.Env:
    return gym.make("CartPole-v1")


def layer_init(layer: nn.Linear, std: float = np.sqrt(2), bias: float = 0.0) -> nn.Linear:
    nn.init.orthogonal_(layer.weight, std)
    nn.init.constant_(layer.bias, bias)
    return layer


class Agent(nn.Module):
    """CleanRL's: separate tanh MLPs for the value and the action logits."""

    def __init__(self) -> None:
        super().__init__()
        self.critic = nn.Sequential(
            layer_init(nn.Linear(4, 64)), nn.Tanh(),
            layer_init(nn.Linear(64, 64)), nn.Tanh(),
            layer_init(nn.Linear(64, 1), std=1.0),
        )  # fmt: skip
        self.actor = nn.Sequential(
            layer_init(nn.Linear(4, 64)), nn.Tanh(),
            layer_init(nn.Linear(64, 64)), nn.Tanh(),
            layer_init(nn.Linear(64, 2), std=0.01),
        )  # fmt: skip

    def value(self, obs: torch.Tensor) -> torch.Tensor:
        return self.critic(obs).squeeze(-1)

    def evaluate(self, obs: torch.Tensor, action: torch.Tensor) -> tuple[torch.Tensor, ...]:
        dist = Categorical(logits=self.actor(obs))
        return dist.log_prob(action), dist.entropy(), self.value(obs)

    def forward(self, obs: torch.Tensor) -> dict[str, torch.Tensor]:
        """The acting step (what the collector serves): a sampled action, its
        log-probability and the value of the observation."""
        dist = Categorical(logits=self.actor(obs))
        action = dist.sample()
        return {"action": action, "logprob": dist.log_prob(action), "value": self.value(obs)}


# Rollouts: [num_envs, num_steps] of observation, action, logprob, value, reward, done,
# next observation, episode return.


def rlcollect_rollouts(agent: Agent, args: argparse.Namespace, seed: int) -> Iterator[Any]:
    """Rollouts from rlcollect; after each, the caller's updated ``agent`` is pushed."""
    batch_size = args.num_envs * args.num_steps
    iterations = args.total_timesteps // batch_size
    layout: dict[str, Any] = {"inference_backend": args.inference}  # "auto" by default
    if args.workers is not None:  # by hand: that many worker processes
        layout.update(
            transport="process_slots",
            envs_per_worker=envs_per_worker(args.num_envs, args.workers),
        )
    with AsyncBatchedCollector(
        [make_env] * args.num_envs,
        agent,
        frames_per_batch=batch_size,
        total_frames=iterations * batch_size,
        policy_device="cpu",
        on_policy=True,
        # Overlap: round k+1 starts as soon as round k is handed out, so it runs with the
        # weights of update k-1 while update k is computed. The push of update k waits
        # for round k+1 to end (an on-policy batch holds one version), and round k+2
        # starts with it: a lag of one.
        policy_lag=1 if args.overlap else 0,
        seed=seed,  # env i is first reset with seed + i, as SyncVectorEnv does
        **layout,
    ) as collector:
        if seed == args.seeds[0]:
            print(collector.describe())  # the layout it chose, and why
        for batch in collector:
            yield as_rollout(batch)
            collector.update_policy_weights_(agent)  # the next round to start acts with these


def as_rollout(batch: Any) -> dict[str, Any]:
    return {
        "obs": batch["observation"],
        "action": batch["action"],
        "logprob": batch["logprob"],
        "value": batch["value"],
        "reward": batch["next", "reward"],
        "done": batch["next", "done"],
        "next_obs": batch["next", "observation"],
        "episode_return": batch["next", "episode_return"],
        "version": int(batch["policy_version"][0, 0]),  # one version per on-policy batch
    }


def envs_per_worker(num_envs: int, workers: int) -> int:
    """The fewest envs per worker that divide ``num_envs`` and need at most ``workers``."""
    return next(k for k in range(-(-num_envs // workers), num_envs + 1) if num_envs % k == 0)


def sync_rollouts(agent: Agent, args: argparse.Namespace, seed: int) -> Iterator[Any]:
    """The original's loop: a SyncVectorEnv stepped from here, the agent acting in turn.

    ``SameStep`` autoreset (gymnasium 0.29's behaviour, which CleanRL's ppo.py was
    written for): a finished env's observation is already the next episode's first."""
    envs = gym.vector.SyncVectorEnv(
        [make_env] * args.num_envs, autoreset_mode=gym.vector.AutoresetMode.SAME_STEP
    )
    n, t = args.num_envs, args.num_steps
    obs_np, _ = envs.reset(seed=seed)
    running = np.zeros(n)
    for iteration in range(args.total_timesteps // (n * t)):
        rollout = {k: [] for k in ("obs", "action", "logprob", "value", "reward", "done")}
        rollout["episode_return"] = []
        for _ in range(t):
            obs = torch.as_tensor(obs_np, dtype=torch.float32)
            with torch.no_grad():
                out = agent(obs)
            obs_np, reward, term, trunc, _ = envs.step(out["action"].numpy())
            done = term | trunc
            running += reward
            for key, value in (("obs", obs), *((k, out[k]) for k in ("action", "logprob"))):
                rollout[key].append(value)
            rollout["value"].append(out["value"])
            rollout["reward"].append(torch.as_tensor(reward, dtype=torch.float32))
            rollout["done"].append(torch.as_tensor(done))
            rollout["episode_return"].append(torch.as_tensor(running, dtype=torch.float32))
            running[done] = 0.0
        data = {k: torch.stack(v, dim=1) for k, v in rollout.items()}  # [n, t, ...]
        # Only the last step's next observation is read (to bootstrap); at a done row it
        # is the reset one, and the done flag cuts the bootstrap there anyway.
        data["next_obs"] = torch.as_tensor(obs_np, dtype=torch.float32)[:, None].expand(-1, t, -1)
        data["version"] = iteration  # acted with the weights of every update so far
        yield data
    envs.close()


def train(loop: str, seed: int, args: argparse.Namespace) -> dict[str, Any]:
    torch.manual_seed(seed)
    np.random.seed(seed)
    agent = Agent()
    optimizer = torch.optim.Adam(agent.parameters(), lr=args.learning_rate, eps=1e-5)
    batch_size = args.num_envs * args.num_steps
    minibatch_size = batch_size // args.num_minibatches
    iterations = args.total_timesteps // batch_size
    rollouts = rlcollect_rollouts if loop == "rlcollect" else sync_rollouts
    curve: list[tuple[int, float]] = []  # (global step at the episode's end, its return)
    lags: list[int] = []  # updates made before each rollout's, after the weights it acted with
    start = time.perf_counter()
    overlap = loop == "rlcollect" and args.overlap
    desc = f"{loop}{' --overlap' if overlap else ''} seed {seed}"
    bar = tqdm(total=iterations * batch_size, desc=desc, unit="step")
    for iteration, data in enumerate(rollouts(agent, args, seed), 1):
        lags.append(iteration - 1 - data["version"])
        # learning rate annealed linearly to 0 over the run
        if args.anneal_lr:
            frac = 1.0 - (iteration - 1.0) / iterations
            optimizer.param_groups[0]["lr"] = frac * args.learning_rate

        # episodic returns, logged at done rows, in step order
        step0 = (iteration - 1) * batch_size
        envs_done, steps_done = torch.nonzero(data["done"], as_tuple=True)
        order = torch.argsort(steps_done * args.num_envs + envs_done)
        for e, s in zip(envs_done[order].tolist(), steps_done[order].tolist(), strict=True):
            curve.append((step0 + (s + 1) * args.num_envs, float(data["episode_return"][e, s])))

        # GAE along each env's row; CleanRL cuts the bootstrap at every done
        with torch.no_grad():
            next_value = agent.value(data["next_obs"][:, -1])
            values, rewards = data["value"], data["reward"]
            not_done = 1.0 - data["done"].float()
            advantages = torch.zeros_like(rewards)
            last = torch.zeros(args.num_envs)
            for t in reversed(range(args.num_steps)):
                following = next_value if t == args.num_steps - 1 else values[:, t + 1]
                delta = rewards[:, t] + args.gamma * following * not_done[:, t] - values[:, t]
                last = delta + args.gamma * args.gae_lambda * not_done[:, t] * last
                advantages[:, t] = last
            returns = advantages + values

        # the update: epochs of shuffled minibatches, clipped surrogate and value loss
        b_obs, b_actions = data["obs"].reshape(batch_size, -1), data["action"].reshape(-1)
        b_logprobs, b_values = data["logprob"].reshape(-1), values.reshape(-1)
        b_adv, b_returns = advantages.reshape(-1), returns.reshape(-1)
        for _ in range(args.update_epochs):
            for mb in torch.randperm(batch_size).split(minibatch_size):
                newlogprob, entropy, newvalue = agent.evaluate(b_obs[mb], b_actions[mb])
                ratio = (newlogprob - b_logprobs[mb]).exp()
                adv = b_adv[mb]
                adv = (adv - adv.mean()) / (adv.std() + 1e-8)
                pg_loss = torch.max(
                    -adv * ratio, -adv * ratio.clamp(1 - args.clip_coef, 1 + args.clip_coef)
                ).mean()
                v_clipped = b_values[mb] + (newvalue - b_values[mb]).clamp(
                    -args.clip_coef, args.clip_coef
                )
                v_loss = (
                    0.5
                    * torch.max(
                        (newvalue - b_returns[mb]) ** 2, (v_clipped - b_returns[mb]) ** 2
                    ).mean()
                )
                loss = pg_loss - args.ent_coef * entropy.mean() + args.vf_coef * v_loss
                optimizer.zero_grad()
                loss.backward()
                nn.utils.clip_grad_norm_(agent.parameters(), args.max_grad_norm)
                optimizer.step()

        bar.update(batch_size)
        recent = [r for _, r in curve[-20:]]
        if recent:
            bar.set_postfix(mean_return=f"{np.mean(recent):.1f}")
    bar.close()
    seconds = time.perf_counter() - start
    returns_only = [r for _, r in curve]
    steps = iterations * batch_size
    return {
        "loop": loop,
        "overlap": overlap,
        "seed": seed,
        "env_steps": steps,
        "wall_seconds": seconds,
        "steps_per_second": steps / seconds,
        "episodes": len(curve),
        "mean_return_last_100": float(np.mean(returns_only[-100:])) if curve else 0.0,
        "steps_to_mean_475": steps_to_mean(curve, 475.0),
        "policy_lag": {str(lag): lags.count(lag) for lag in sorted(set(lags))},
        "curve": curve,
    }


def steps_to_mean(curve: list[tuple[int, float]], target: float, window: int = 100) -> int | None:
    """The env step at which the mean return of the last ``window`` episodes first
    reached ``target`` (None if it never did)."""
    returns = [r for _, r in curve]
    for i in range(window - 1, len(curve)):
        if np.mean(returns[i - window + 1 : i + 1]) >= target:
            return curve[i][0]
    return None


def plot(runs: list[dict[str, Any]], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no learning-curve PNG")
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    colors = {"rlcollect": "tab:blue", "sync": "tab:orange"}
    for run in runs:
        if not run["curve"]:
            continue
        steps, rets = zip(*run["curve"], strict=True)
        smooth = [np.mean(rets[max(0, i - 99) : i + 1]) for i in range(len(rets))]
        loop = f"{run['loop']}{', overlap' if run['overlap'] else ''}"
        label = f"{loop} seed {run['seed']} ({run['wall_seconds']:.0f} s)"
        ax.plot(steps, smooth, color=colors[run["loop"]], alpha=0.8, label=label)
    ax.axhline(475, color="grey", linestyle="--", linewidth=1)
    ax.set_xlabel("env steps")
    ax.set_ylabel("episodic return (mean of the last 100)")
    ax.set_title("PPO on CartPole-v1 (CleanRL hyperparameters)")
    ax.legend(loc="lower right", fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"learning curves: {path}")


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)  # CleanRL's torch_deterministic runs use one thread too
    runs = [train(loop, seed, args) for seed in args.seeds for loop in args.loop]
    for run in runs:
        print(
            f"{run['loop']:9s} seed {run['seed']}: mean return (last 100) "
            f"{run['mean_return_last_100']:6.1f}, {run['wall_seconds']:6.1f} s, "
            f"{run['steps_per_second']:6.0f} steps/s, policy lag {run['policy_lag']}"
        )
    args.out.mkdir(parents=True, exist_ok=True)
    summary = {
        loop: {
            "mean_return_last_100": float(
                np.mean([r["mean_return_last_100"] for r in runs if r["loop"] == loop])
            ),
            "wall_seconds_mean": float(
                np.mean([r["wall_seconds"] for r in runs if r["loop"] == loop])
            ),
            "steps_to_mean_475": [r["steps_to_mean_475"] for r in runs if r["loop"] == loop],
        }
        for loop in args.loop
    }
    doc = {"args": {k: str(v) for k, v in vars(args).items()}, "summary": summary, "runs": runs}
    name = "ppo_cartpole_overlap" if args.overlap else "ppo_cartpole"
    (args.out / f"{name}.json").write_text(json.dumps(doc, indent=1))
    print(json.dumps(summary, indent=2))
    plot(runs, args.out / f"{name}.png")


if __name__ == "__main__":
    main()
