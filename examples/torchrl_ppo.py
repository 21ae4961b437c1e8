"""PPO on CartPole-v1 with TorchRL's actor, GAE and loss, on rlcollect's on-policy batches.

One file, read top to bottom: the recipe of ``docs/torchrl.md`` run long enough to
learn. The collector serves the ``ProbabilisticActor`` itself: it acts under
``exploration_type="random"`` (the default, as TorchRL's own collectors act), so it
samples its actions and writes ``action_log_prob``, which ``ClipPPOLoss`` reads back.
Each batch is ``[num_envs, T]`` (``on_policy=True``), every row computed with the
weights pushed after the previous update; ``rlcollect.interop.to_torchrl`` adds the
trailing dimension TorchRL's estimators read rewards and done flags with. Finished
episodes come from ``collector.episodes()``.

The hyperparameters are the usual ones for PPO on CartPole (8 envs, 32 steps each per
rollout, 20 epochs over the rollout as one minibatch, Adam at 1e-3 annealed to 0, gamma
0.98, GAE lambda 0.8, clip 0.2, no entropy bonus), picked to learn within 200k frames.
After the run an evaluation collector (``exploration_type="deterministic"``: the
argmax) plays a few episodes with the final weights.

    python examples/torchrl_ppo.py                     # 200k frames, seed 1
    python examples/torchrl_ppo.py --seeds 1 2 3       # the figure of docs/torchrl.md
    python examples/torchrl_ppo.py --frames 4096       # a quick smoke run
"""

from __future__ import annotations

import argparse
import functools
import json
import time
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import torch
from tensordict.nn import TensorDictModule
from torchrl.modules import ProbabilisticActor, ValueOperator
from torchrl.objectives import ClipPPOLoss
from torchrl.objectives.value import GAE

from rlcollect import AsyncBatchedCollector
from rlcollect.interop import to_torchrl


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[1])
    p.add_argument("--frames", type=int, default=200_000, help="env steps in all")
    p.add_argument("--num-envs", type=int, default=8)
    p.add_argument("--num-steps", type=int, default=32, help="steps of each env per rollout")
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--minibatch", type=int, default=256, help="rows per gradient step")
    p.add_argument("--lr", type=float, default=1e-3, help="annealed linearly to 0")
    p.add_argument("--gamma", type=float, default=0.98)
    p.add_argument("--lmbda", type=float, default=0.8)
    p.add_argument("--clip", type=float, default=0.2)
    p.add_argument("--entropy", type=float, default=0.0)
    p.add_argument("--max-grad-norm", type=float, default=0.5)
    p.add_argument("--eval-episodes", type=int, default=5)
    # "deterministic" trains from argmax actions: what serving the actor without an
    # exploration type did (docs/decisions/exploration-type.md)
    p.add_argument("--exploration-type", default="random", help="what the actor acts under")
    # "worker": each env worker runs the actor itself (docs/tuning.md, "Cheap envs"), but
    # then imports TorchRL too; one server thread in this process costs less here
    p.add_argument("--inference", choices=["thread", "worker"], default="thread")
    p.add_argument("--out", type=Path, default=Path("runs"), help="JSON and curve (PNG)")
    return p.parse_args()


make_env = functools.partial(gym.make, "CartPole-v1")


# --8<-- [start:modules]
def mlp(out: int) -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Linear(4, 64), torch.nn.Tanh(),
        torch.nn.Linear(64, 64), torch.nn.Tanh(),
        torch.nn.Linear(64, out),
    )  # fmt: skip


def build(args: argparse.Namespace) -> tuple[Any, ...]:
    """The actor (served by the collector as it is), the critic, GAE, the loss."""
    actor = ProbabilisticActor(
        TensorDictModule(mlp(2), in_keys=["observation"], out_keys=["logits"]),
        in_keys=["logits"],
        distribution_class=torch.distributions.Categorical,
        return_log_prob=True,  # writes action_log_prob: the loss's old log-probability
    )
    critic = ValueOperator(mlp(1), in_keys=["observation"])
    advantage = GAE(gamma=args.gamma, lmbda=args.lmbda, value_network=critic)
    loss_fn = ClipPPOLoss(
        actor,
        critic,
        clip_epsilon=args.clip,
        entropy_coeff=args.entropy,
        critic_coeff=0.5,
        loss_critic_type="l2",
        normalize_advantage=True,
    )
    return actor, critic, advantage, loss_fn


# --8<-- [end:modules]


def train(seed: int, args: argparse.Namespace) -> dict[str, Any]:
    torch.manual_seed(seed)
    actor, _, advantage, loss_fn = build(args)
    optimizer = torch.optim.Adam(loss_fn.parameters(), lr=args.lr)
    frames_per_batch = args.num_envs * args.num_steps
    iterations = args.frames // frames_per_batch
    curve: list[tuple[int, float]] = []  # (frames delivered, return) per finished episode
    start = time.perf_counter()
    # --8<-- [start:loop]
    with AsyncBatchedCollector(
        [make_env] * args.num_envs,
        actor,  # a deep copy is served; it samples (exploration_type="random")
        frames_per_batch=frames_per_batch,  # T = num_steps steps of each env
        total_frames=iterations * frames_per_batch,
        policy_device="cpu",
        inference_backend=args.inference,
        on_policy=True,
        seed=seed,
        exploration_type=args.exploration_type,
    ) as collector:
        for iteration, batch in enumerate(collector):
            optimizer.param_groups[0]["lr"] = args.lr * (1 - iteration / iterations)
            data = to_torchrl(batch)  # rewards and flags as [num_envs, T, 1]
            with torch.no_grad():
                advantage(data)  # advantage and value_target along each env's row
            rows = data.reshape(-1)
            for _ in range(args.epochs):
                for index in torch.randperm(len(rows)).split(args.minibatch):
                    losses = loss_fn(rows[index])
                    loss = losses["loss_objective"] + losses["loss_critic"]
                    loss = loss + losses["loss_entropy"]
                    optimizer.zero_grad()
                    loss.backward()
                    torch.nn.utils.clip_grad_norm_(loss_fn.parameters(), args.max_grad_norm)
                    optimizer.step()
            collector.update_policy_weights_(actor)  # the next batch acts with these
            curve += [(e.frames, e.episode_return) for e in collector.episodes()]
    # --8<-- [end:loop]
    seconds = time.perf_counter() - start
    returns = [r for _, r in curve]
    return {
        "seed": seed,
        "exploration_type": args.exploration_type,
        "frames": iterations * frames_per_batch,
        "wall_seconds": seconds,
        "episodes": len(curve),
        "mean_return_last_100": float(np.mean(returns[-100:])) if returns else 0.0,
        "eval_returns": evaluate(actor, args, seed),
        "curve": curve,
    }


def evaluate(actor: torch.nn.Module, args: argparse.Namespace, seed: int) -> list[float]:
    """Episodes of the final weights, acting by the argmax: an evaluation collector."""
    # --8<-- [start:evaluate]
    finished: list[float] = []
    with AsyncBatchedCollector(
        [make_env] * args.eval_episodes,
        actor,
        frames_per_batch=args.eval_episodes * 50,
        policy_device="cpu",
        transport="thread",
        exploration_type="deterministic",  # the distribution's mode: no sampling
        seed=10_000 + seed,
    ) as collector:
        for _ in collector:
            finished += [e.episode_return for e in collector.episodes() if e.episode == 0]
            if len(finished) >= args.eval_episodes:
                break
    # --8<-- [end:evaluate]
    return finished[: args.eval_episodes]


def plot(runs: list[dict[str, Any]], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no learning-curve PNG")
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    for run in runs:
        if not run["curve"]:
            continue
        frames, rets = zip(*run["curve"], strict=True)
        smooth = [np.mean(rets[max(0, i - 99) : i + 1]) for i in range(len(rets))]
        ax.plot(frames, smooth, label=f"seed {run['seed']} ({run['wall_seconds']:.0f} s)")
    ax.axhline(400, color="grey", linestyle="--", linewidth=1)
    ax.set_xlabel("frames")
    ax.set_ylabel("episodic return (mean of the last 100)")
    ax.set_title("PPO on CartPole-v1: TorchRL modules, rlcollect on-policy batches")
    ax.legend(loc="lower right", fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"learning curves: {path}")


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)  # the cores belong to the env workers
    runs = [train(seed, args) for seed in args.seeds]
    for run in runs:
        print(
            f"seed {run['seed']}: mean return (last 100) {run['mean_return_last_100']:.1f} "
            f"at {run['frames']} frames, {run['wall_seconds']:.1f} s; "
            f"evaluation (argmax) {run['eval_returns']}"
        )
    summary = {
        "mean_return_last_100": [r["mean_return_last_100"] for r in runs],
        "mean_over_seeds": float(np.mean([r["mean_return_last_100"] for r in runs])),
    }
    print(json.dumps(summary))
    args.out.mkdir(parents=True, exist_ok=True)
    doc = {"args": {k: str(v) for k, v in vars(args).items()}, "summary": summary, "runs": runs}
    (args.out / "torchrl_ppo.json").write_text(json.dumps(doc, indent=1))
    plot(runs, args.out / "torchrl_ppo.png")


if __name__ == "__main__":
    main()
