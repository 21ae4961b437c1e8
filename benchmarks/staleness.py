"""How stale are the weights behind the rows a learner trains on, in each mode?

A row is *stale* when the weights that chose its action are older than the learner's
weights at the moment the row reaches it. The learner here is PPO-shaped: per batch it
takes ``--learn-steps`` gradient steps of a 64x64 MLP on minibatches of the batch (a
learning time of the order of the rollout's), then pushes its weights. Measured, with
8 CartPole envs in worker processes and the policy on the CPU:

* ``off_policy_rows``: iterating the collector as by default (``transition_chunk_size=
  "auto"``): staleness of a row = updates made before its batch was asked for minus
  its ``policy_version``. The workers keep stepping while the learner learns, so a
  batch holds rows chosen by the weights of one or more updates ago.
* ``on_policy``: the same loop with ``on_policy=True``: the envs wait while the
  learner learns; every row of a batch is chosen by the newest weights.
* ``background``: ``start()`` into a ReplayBuffer; the learner samples minibatches as
  fast as it can and pushes weights every ``--learn-steps`` steps; staleness of a
  sampled row = updates made before it was sampled minus its ``policy_version``.

Reported per mode: the fraction of stale rows, the mean and the largest staleness (in
updates), and the wall time; JSON to ``benchmarks/results/staleness.json``.

    python benchmarks/staleness.py [--batches 40] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import gymnasium as gym
import torch
from torch import nn
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine

from rlcollect import AsyncBatchedCollector, ReplayBuffer


def make_env() -> gym.Env:
    return gym.make("CartPole-v1")


class Policy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(),
                                 nn.Linear(64, 2))  # fmt: skip

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        return torch.distributions.Categorical(logits=self.net(obs)).sample()


class Learner:
    """Gradient steps of the policy on minibatches (the cost of learning, for real)."""

    def __init__(self, policy: Policy, steps: int) -> None:
        self.policy = policy
        self.steps = steps
        self.optimizer = torch.optim.Adam(policy.parameters(), lr=1e-4)

    def learn(self, rows: Any) -> None:
        obs, action = rows["observation"], rows["action"]
        for i in range(self.steps):
            mb = torch.arange(i % 4, obs.shape[0], 4)
            logits = self.policy.net(obs[mb])
            loss = nn.functional.cross_entropy(logits, action[mb])
            self.optimizer.zero_grad()
            loss.backward()
            self.optimizer.step()


def figures(staleness: torch.Tensor, seconds: float) -> dict[str, float]:
    s = staleness.float()
    return {
        "rows": int(s.numel()),
        "stale_fraction": float((s > 0).float().mean()),
        "mean_staleness": float(s.mean()),
        "max_staleness": float(s.max()),
        "seconds": seconds,
    }


def iterate(args: argparse.Namespace, on_policy: bool) -> dict[str, float]:
    policy = Policy()
    learner = Learner(policy, args.learn_steps)
    fpb = args.envs * args.steps
    stale = []
    with AsyncBatchedCollector(
        [make_env] * args.envs, policy, frames_per_batch=fpb,
        total_frames=fpb * args.batches, policy_device="cpu", on_policy=on_policy,
    ) as collector:  # fmt: skip
        start = time.perf_counter()
        for updates, batch in enumerate(tqdm(collector, total=args.batches, desc=str(on_policy))):
            stale.append(updates - batch["policy_version"].reshape(-1))
            learner.learn(batch.reshape(-1))
            collector.update_policy_weights_(policy)
        seconds = time.perf_counter() - start
    return figures(torch.cat(stale), seconds)


def background(args: argparse.Namespace) -> dict[str, float]:
    policy = Policy()
    learner = Learner(policy, 1)
    fpb = args.envs * args.steps
    buffer = ReplayBuffer(fpb * args.batches)
    stale = []
    with AsyncBatchedCollector(
        [make_env] * args.envs, policy, frames_per_batch=fpb,
        total_frames=fpb * args.batches, policy_device="cpu", replay_buffer=buffer,
    ) as collector:  # fmt: skip
        collector.start()
        start = time.perf_counter()
        steps = updates = 0
        with tqdm(total=fpb * args.batches, desc="background") as bar:
            while collector.wait_to_sample(timeout=60.0):
                rows = buffer.sample(fpb // 4)
                stale.append(updates - rows["policy_version"])
                learner.learn(rows)
                steps += 1
                if steps % args.learn_steps == 0:
                    updates = collector.update_policy_weights_(policy)
                bar.n = buffer.written
                bar.refresh()
        collector.join(timeout=60.0)
        seconds = time.perf_counter() - start
    return figures(torch.cat(stale), seconds)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--envs", type=int, default=8)
    p.add_argument("--steps", type=int, default=32, help="steps of each env per batch")
    p.add_argument("--batches", type=int, default=40)
    p.add_argument("--learn-steps", type=int, default=16, help="gradient steps per batch")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = p.parse_args()
    torch.set_num_threads(1)
    results = {
        "off_policy_rows": iterate(args, on_policy=False),
        "on_policy": iterate(args, on_policy=True),
        "background": background(args),
    }
    doc = {"machine": machine(), "args": {k: str(v) for k, v in vars(args).items()}, **results}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "staleness.json").write_text(json.dumps(doc, indent=1) + "\n")
    print("| mode | stale rows | mean staleness (updates) | max | seconds |")
    print("| --- | --- | --- | --- | --- |")
    for mode, r in results.items():
        print(
            f"| {mode} | {100 * r['stale_fraction']:.1f}% | {r['mean_staleness']:.2f} | "
            f"{r['max_staleness']:.0f} | {r['seconds']:.1f} |"
        )


if __name__ == "__main__":
    main()
