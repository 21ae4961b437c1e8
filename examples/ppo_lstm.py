"""Recurrent PPO (an LSTM policy) on CartPole without its velocities, with a feed-forward
control run.

The observation keeps the cart's position and the pole's angle and drops both
velocities, so one observation does not say where the pole is going: a policy must
remember the previous ones. The LSTM policy is recurrent in rlcollect's sense (it has
``initial_state()``), so the collector's inference server keeps each env's LSTM state,
resets it exactly where an episode starts, and stores in every transition the state its
action was computed from (``recurrent_state``) and whether it started an episode
(``is_init``). The learner never replays a rollout from its beginning: each training
sequence starts from the state stored in its first transition.

The rollouts are on-policy (``on_policy=True``): each batch is ``[envs, rollout]``, row
``e`` env ``e``'s next ``--rollout`` steps in order, every action computed with the
weights pushed after the previous update (the envs wait while the learner learns), so
PPO's ratio starts at 1. Finished episodes come from ``collector.episodes()``.

    python examples/ppo_lstm.py                    # the LSTM policy, 500k env steps
    python examples/ppo_lstm.py --feed-forward     # the control: the same net, no memory
    python examples/ppo_lstm.py --steps 4096       # a quick smoke run
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import gymnasium as gym
import numpy as np
import torch
from tensordict import TensorDict
from torch import nn

from rlcollect import AsyncBatchedCollector


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--feed-forward", action="store_true", help="the control: no recurrence")
    p.add_argument("--steps", type=int, default=500_000, help="env steps in all")
    p.add_argument("--envs", type=int, default=8)
    p.add_argument("--rollout", type=int, default=128, help="steps of each env per update")
    # sequences of the rollout trained on, each from the state stored in its first row
    p.add_argument("--seq-len", type=int, default=16)
    p.add_argument("--minibatches", type=int, default=4)
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-3, help="annealed linearly to 0")
    # returns of up to ~100 would make the critic's gradient swamp the actor's in the
    # shared trunk once clipped to --max-grad-norm; scaled, both are of one size
    p.add_argument("--reward-scale", type=float, default=0.01, help="for the critic only")
    p.add_argument("--gamma", type=float, default=0.99)
    p.add_argument("--gae-lambda", type=float, default=0.95)
    p.add_argument("--clip", type=float, default=0.2)
    p.add_argument("--ent-coef", type=float, default=0.01)
    p.add_argument("--vf-coef", type=float, default=0.5)
    p.add_argument("--max-grad-norm", type=float, default=0.5)
    p.add_argument("--eval-episodes", type=int, default=20)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--out", type=Path, default=Path("runs"), help="JSON and curves (PNG)")
    return p.parse_args()


# ---------------------------------------------------------------- the task


class NoVelocities(gym.ObservationWrapper):
    """CartPole's observation without the cart's and the pole's velocities."""

    def __init__(self, env: gym.Env) -> None:
        super().__init__(env)
        self.observation_space = gym.spaces.Box(-np.inf, np.inf, (2,), np.float32)

    def observation(self, observation: np.ndarray) -> np.ndarray:
        return observation[[0, 2]].astype(np.float32)


def make_env() -> gym.Env:
    return NoVelocities(gym.make("CartPole-v1"))


# ---------------------------------------------------------------- the policies


class LSTMAgent(nn.Module):
    """Encoder, LSTM cell, actor and critic heads. Recurrent: it has ``initial_state()``,
    so the collector calls ``forward(observation, state)`` and keeps each env's state."""

    def __init__(self, obs_dim: int, num_actions: int, hidden: int) -> None:
        super().__init__()
        self.hidden = hidden
        self.encoder = nn.Sequential(nn.Linear(obs_dim, hidden), nn.Tanh())
        self.core = nn.LSTMCell(hidden, hidden)
        self.actor = nn.Linear(hidden, num_actions)
        self.critic = nn.Linear(hidden, 1)

    def initial_state(self) -> dict[str, torch.Tensor]:  # ONE env's state: no batch dim
        return {"h": torch.zeros(self.hidden), "c": torch.zeros(self.hidden)}

    def core_step(
        self, obs: torch.Tensor, state: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        h, c = self.core(self.encoder(obs), (state["h"], state["c"]))
        return h, {"h": h, "c": c}

    def forward(
        self, obs: torch.Tensor, state: dict[str, torch.Tensor]
    ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        features, new_state = self.core_step(obs, state)
        return act(self, features), new_state

    def unroll(
        self, obs: torch.Tensor, is_init: torch.Tensor, state: dict[str, torch.Tensor]
    ) -> torch.Tensor:
        """Features ``[B, L, hidden]`` of sequences ``obs [B, L, ...]`` from ``state``
        (the stored state of each sequence's first step), reset where an episode starts,
        as the collector's server did."""
        initial = self.initial_state()
        features = []
        for t in range(obs.shape[1]):
            if t > 0:  # the stored first state is already the reset one
                start = is_init[:, t, None]
                state = {k: torch.where(start, initial[k], v) for k, v in state.items()}
            h, state = self.core_step(obs[:, t], state)
            features.append(h)
        return torch.stack(features, dim=1)


class MLPAgent(nn.Module):
    """The control: the same encoder and heads, a feed-forward layer for the LSTM cell."""

    def __init__(self, obs_dim: int, num_actions: int, hidden: int) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(obs_dim, hidden), nn.Tanh())
        self.core = nn.Sequential(nn.Linear(hidden, hidden), nn.Tanh())
        self.actor = nn.Linear(hidden, num_actions)
        self.critic = nn.Linear(hidden, 1)

    def forward(self, obs: torch.Tensor) -> dict[str, torch.Tensor]:
        return act(self, self.core(self.encoder(obs)))

    def unroll(self, obs: torch.Tensor, is_init: torch.Tensor, state: object) -> torch.Tensor:
        return self.core(self.encoder(obs))


def act(agent: nn.Module, features: torch.Tensor) -> dict[str, torch.Tensor]:
    """Sample an action; keep its log-probability and the value for PPO."""
    dist = torch.distributions.Categorical(logits=agent.actor(features))
    action = dist.sample()
    value = agent.critic(features).squeeze(-1)
    return {"action": action, "log_prob": dist.log_prob(action), "value": value}


# ---------------------------------------------------------------- one update


def bootstrap_values(agent: nn.Module, rollout: TensorDict, recurrent: bool) -> torch.Tensor:
    """Value of each env's observation after the rollout's last step: one step of the
    current net from the state stored with that last step, then the critic."""
    last = rollout[:, -1]
    with torch.no_grad():
        if recurrent:
            _, state = agent.core_step(last["observation"], dict(last["recurrent_state"]))
            features, _ = agent.core_step(last["next", "observation"], state)
        else:
            features = agent.core(agent.encoder(last["next", "observation"]))
        return agent.critic(features).squeeze(-1)


def advantages(
    rollout: TensorDict, boot: torch.Tensor, gamma: float, lam: float, scale: float
) -> torch.Tensor:
    """GAE over ``[envs, steps]`` from the values stored with each action. An episode's
    end stops the sum; a truncation counts as one (CartPole truncates at 500 steps, the
    goal itself)."""
    reward, value, done = rollout["next", "reward"], rollout["value"], rollout["next", "done"]
    steps = reward.shape[1]
    adv = torch.zeros_like(reward)
    running = torch.zeros_like(boot)
    for t in reversed(range(steps)):
        next_value = boot if t == steps - 1 else value[:, t + 1]
        alive = (~done[:, t]).float()
        delta = scale * reward[:, t] + gamma * next_value * alive - value[:, t]
        running = delta + gamma * lam * alive * running
        adv[:, t] = running
    return adv


def ppo_update(
    agent: nn.Module,
    optimizer: torch.optim.Optimizer,
    rollout: TensorDict,
    adv: torch.Tensor,
    args: argparse.Namespace,
    recurrent: bool,
) -> dict[str, float]:
    """``--epochs`` passes over sequences of ``--seq-len`` steps, ``--minibatches`` each."""
    returns = adv + rollout["value"]
    envs, steps = adv.shape
    seqs = steps // args.seq_len
    data = rollout.clone()
    data["advantage"], data["return"] = adv, returns
    data = data.reshape(envs * seqs, args.seq_len)  # [sequences, seq_len]
    per_minibatch = data.shape[0] // args.minibatches
    stats: dict[str, float] = {}
    for _ in range(args.epochs):
        for idx in torch.randperm(data.shape[0]).split(per_minibatch):
            mb = data[idx]
            state = dict(mb[:, 0]["recurrent_state"]) if recurrent else None
            features = agent.unroll(mb["observation"], mb.get("is_init", None), state)
            dist = torch.distributions.Categorical(logits=agent.actor(features))
            log_prob = dist.log_prob(mb["action"])
            ratio = (log_prob - mb["log_prob"]).exp()
            a = mb["advantage"]
            a = (a - a.mean()) / (a.std() + 1e-8)
            policy_loss = torch.max(-a * ratio, -a * ratio.clamp(1 - args.clip, 1 + args.clip))
            value = agent.critic(features).squeeze(-1)
            value_loss = 0.5 * (value - mb["return"]).pow(2)
            entropy = dist.entropy()
            loss = (
                policy_loss.mean()
                + args.vf_coef * value_loss.mean()
                - args.ent_coef * entropy.mean()
            )
            optimizer.zero_grad()
            loss.backward()
            nn.utils.clip_grad_norm_(agent.parameters(), args.max_grad_norm)
            optimizer.step()
            stats = {
                "policy_loss": policy_loss.mean().item(),
                "value_loss": value_loss.mean().item(),
                "entropy": entropy.mean().item(),
                "clip_fraction": ((ratio - 1).abs() > args.clip).float().mean().item(),
            }
    return stats


# ---------------------------------------------------------------- evaluation


def evaluate(
    agent: nn.Module, episodes: int, recurrent: bool, seed: int, greedy: bool
) -> list[float]:
    """Returns of ``episodes`` fresh episodes: actions sampled as in training, or the most
    likely ones (``greedy``). The agent is stepped here by hand, one env, no collector."""
    env = make_env()
    returns = []
    with torch.no_grad():
        for e in range(episodes):
            obs, _ = env.reset(seed=seed + e)
            state = {k: v[None] for k, v in agent.initial_state().items()} if recurrent else None
            total, done = 0.0, False
            while not done:
                x = torch.as_tensor(obs)[None]
                if recurrent:
                    features, state = agent.core_step(x, state)
                else:
                    features = agent.core(agent.encoder(x))
                logits = agent.actor(features)[0]
                if greedy:
                    action = int(logits.argmax())
                else:
                    action = int(torch.distributions.Categorical(logits=logits).sample())
                obs, reward, terminated, truncated, _ = env.step(action)
                total += float(reward)
                done = terminated or truncated
            returns.append(total)
    env.close()
    return returns


# ---------------------------------------------------------------- the run


def main() -> None:
    args = parse_args()
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)  # a small net: more threads only take cores from the envs
    recurrent = not args.feed_forward
    name = "ppo_lstm" if recurrent else "ppo_lstm_control"
    agent_class = LSTMAgent if recurrent else MLPAgent
    agent = agent_class(2, 2, args.hidden)
    optimizer = torch.optim.Adam(agent.parameters(), lr=args.lr, eps=1e-5)
    frames = args.envs * args.rollout
    updates = args.steps // frames

    collector = AsyncBatchedCollector(
        [make_env] * args.envs,
        agent,
        frames_per_batch=frames,
        total_frames=updates * frames,
        policy_device="cpu",
        on_policy=True,  # [envs, rollout] batches, acted by the latest weights
        seed=args.seed,
    )
    curve: list[tuple[int, float]] = []  # (env steps so far, return) per finished episode
    start = time.perf_counter()
    steps = 0
    with collector:
        for update, batch in enumerate(collector):
            # learning rate: linear from --lr to 0 over the run
            for group in optimizer.param_groups:
                group["lr"] = args.lr * (1 - update / updates)
            steps += batch.numel()
            curve += [(e.frames, e.episode_return) for e in collector.episodes()]

            rollout = batch  # [envs, rollout], each env's row in step order
            boot = bootstrap_values(agent, rollout, recurrent)
            adv = advantages(rollout, boot, args.gamma, args.gae_lambda, args.reward_scale)
            stats = ppo_update(agent, optimizer, rollout, adv, args, recurrent)
            collector.update_policy_weights_(agent)

            if update % 10 == 0 or update == updates - 1:
                recent = [r for _, r in curve[-20:]]
                print(
                    f"steps {steps:7d}  episodes {len(curve):5d}  mean return (last 20) "
                    f"{np.mean(recent) if recent else 0.0:6.1f}  entropy "
                    f"{stats['entropy']:.3f}  {time.perf_counter() - start:5.0f} s",
                    flush=True,
                )
    seconds = time.perf_counter() - start

    seed = 10_000 + args.seed  # episodes never seen in training
    eval_returns = evaluate(agent, args.eval_episodes, recurrent, seed, greedy=False)
    greedy_returns = evaluate(agent, args.eval_episodes, recurrent, seed, greedy=True)
    final = [r for _, r in curve[-20:]]
    summary = {
        "policy": "lstm" if recurrent else "feed-forward (control)",
        "env_steps": steps,
        "updates": updates,
        "episodes": len(curve),
        "mean_return_last_20_training": float(np.mean(final)) if final else 0.0,
        "eval_mean_return": float(np.mean(eval_returns)),
        "eval_returns": eval_returns,
        "eval_greedy_mean_return": float(np.mean(greedy_returns)),
        "eval_greedy_returns": greedy_returns,
        "wall_seconds": seconds,
        "frames_per_second": steps / seconds,
        "seed": args.seed,
        "args": {k: str(v) for k, v in vars(args).items()},
    }
    print(json.dumps({k: v for k, v in summary.items() if "returns" not in k}, indent=2))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{name}.json").write_text(json.dumps({**summary, "curve": curve}, indent=1))
    plot(args.out, name)


def plot(out: Path, name: str) -> None:
    """Every run's curve in ``out`` on one figure (the LSTM and its control, if both ran)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no learning-curve PNG")
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    for run in ("ppo_lstm", "ppo_lstm_control"):
        path = out / f"{run}.json"
        if not path.exists():
            continue
        result = json.loads(path.read_text())
        if not result["curve"]:
            continue
        steps, rets = zip(*result["curve"], strict=True)
        smooth = [np.mean(rets[max(0, i - 19) : i + 1]) for i in range(len(rets))]
        label = f"{result['policy']}: eval {result['eval_mean_return']:.0f}"
        ax.plot(steps, smooth, label=label)
    ax.axhline(450, color="grey", linestyle="--", linewidth=1)
    ax.set_xlabel("env steps")
    ax.set_ylabel("return (mean of the last 20 episodes)")
    ax.set_title("PPO on CartPole-v1 without velocities (rlcollect, recurrent state)")
    ax.legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(out / "ppo_lstm.png", dpi=120)
    print(f"learning curves: {out / 'ppo_lstm.png'} ({name} added)")


if __name__ == "__main__":
    main()
