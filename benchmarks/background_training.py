"""Background collection with and without a learner in the same process.

For each env (CartPole-v1 with an MLP, Pong 4x105x80 with a small CNN), 4 envs in
worker processes, and each inference backend (``thread``: the server is a thread of the
driver; ``process``: a process of its own), the collector runs ``start()`` into an
``rlcollect.ReplayBuffer`` and this process either

* ``idle``: waits for the budget (collection alone), or
* ``learner``: trains a Q-network on batches sampled from the buffer as fast as it can
  (unthrottled: no ``train_ratio``), one intra-op thread, until the budget is met.

Each measurement runs in a fresh process; a run is timed from the first row in the
buffer to the last (worker start-up excluded). Reported: env frames/s, learner
updates/s and the ratio learner/idle frames/s, medians over ``--repeats`` with the run
range; results go to ``benchmarks/results/background_training.json``.

    python benchmarks/background_training.py [--repeats 3] [--envs cartpole pong]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ENVS, machine
from policies import policy_for

from rlcollect import AsyncBatchedCollector, ReplayBuffer

FRAMES = {"cartpole": 40_000, "pong": 8_000}
BATCH = {"cartpole": 256, "pong": 32}
RESULTS = Path(__file__).resolve().parent / "results" / "background_training.json"


def q_network(env: str) -> nn.Module:
    if env == "cartpole":
        return nn.Sequential(nn.Linear(4, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                             nn.Linear(256, 2))  # fmt: skip
    return nn.Sequential(
        nn.Conv2d(4, 16, 8, stride=4), nn.ReLU(), nn.Conv2d(16, 32, 4, stride=2), nn.ReLU(),
        nn.Flatten(), nn.Linear(32 * 11 * 8, 256), nn.ReLU(), nn.Linear(256, 6),
    )  # fmt: skip


@contextlib.contextmanager
def collecting(
    env: str, backend: str, envs: int, rb: ReplayBuffer, total_frames: int = -1
) -> Iterator[AsyncBatchedCollector]:
    """``envs`` copies of ``env`` collecting into ``rb`` in the background (its policy on
    the CPU, served by ``backend``), entered once the first row is in: what a measuring
    window starts from (worker start-up excluded). Shut down on leaving."""
    with AsyncBatchedCollector(
        [ENVS[env]] * envs,
        policy_for(env),
        frames_per_batch=256,
        total_frames=total_frames,
        policy_device="cpu",
        inference_backend=backend,
        replay_buffer=rb,
    ) as collector:
        collector.start()
        while len(rb) == 0:
            collector.join(timeout=0.001)
        yield collector


def one_run(env: str, backend: str, learner: bool, envs: int) -> dict[str, Any]:
    torch.set_num_threads(1)  # the learner's share of a small machine; workers get the rest
    rb = ReplayBuffer(FRAMES[env], seed=0)
    q = q_network(env)
    optimizer = torch.optim.Adam(q.parameters(), lr=1e-4)
    updates = 0
    with collecting(env, backend, envs, rb, total_frames=FRAMES[env]) as collector:
        t0, rows0 = time.perf_counter(), rb.written
        while not collector.join(timeout=0 if learner else None):
            batch = rb.sample(BATCH[env])
            obs = batch["observation"].float()
            q_taken = q(obs).gather(1, batch["action"][:, None]).squeeze(1)
            loss = (q_taken - batch["next", "reward"]).pow(2).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            updates += 1
        seconds = time.perf_counter() - t0
        server = collector.stats()["server"]
    return {
        "frames_per_second": (rb.written - rows0) / seconds,
        "updates_per_second": updates / seconds,
        "mean_batch_size": server["mean_batch_size"],
        "seconds": seconds,
    }


def fresh(env: str, backend: str, learner: bool, envs: int) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--one", env, backend, str(int(learner)), str(envs)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=600)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description="background collection with and without a learner")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--envs", nargs="+", default=["cartpole", "pong"], choices=sorted(ENVS))
    p.add_argument("--num-envs", type=int, default=4)
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--one", nargs=4, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        env, backend, learner, n = args.one
        print(json.dumps(one_run(env, backend, learner == "1", int(n))))
        return

    configs = [(e, b, lr) for e in args.envs for b in ("thread", "process") for lr in (0, 1)]
    runs: dict[str, list[dict[str, Any]]] = {}
    for r in range(args.repeats):  # interleaved, so drift hits every config alike
        for env, backend, learner in configs:
            name = f"{env}[{backend}-{'learner' if learner else 'idle'}]"
            res = fresh(env, backend, bool(learner), args.num_envs)
            runs.setdefault(name, []).append(res)
            print(f"repeat {r}: {name}: {res['frames_per_second']:,.0f} frames/s, "
                  f"{res['updates_per_second']:,.0f} updates/s", flush=True)  # fmt: skip

    table = {}
    for name, rs in runs.items():
        fps = [x["frames_per_second"] for x in rs]
        ups = [x["updates_per_second"] for x in rs]
        table[name] = {
            "frames_per_second": statistics.median(fps),
            "frames_per_second_range": [min(fps), max(fps)],
            "updates_per_second": statistics.median(ups),
            "runs": rs,
        }
    for env in args.envs:
        for backend in ("thread", "process"):
            idle = runs[f"{env}[{backend}-idle]"]
            busy = runs[f"{env}[{backend}-learner]"]
            pairs = zip(idle, busy, strict=True)  # same repeat: a ratio from one run
            ratios = [b["frames_per_second"] / i["frames_per_second"] for i, b in pairs]
            table[f"{env}[{backend}-learner]"]["ratio_to_idle"] = statistics.median(ratios)
    result = {
        "benchmark": "background_training",
        "date": time.strftime("%Y-%m-%d"),
        "machine": machine(),
        "config": {
            "num_envs": args.num_envs,
            "frames": FRAMES,
            "learner_batch": BATCH,
            "repeats": args.repeats,
            "learner_threads": 1,
        },
        "results": table,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"\n{'series':34s} {'frames/s':>10s} {'range':>19s} {'updates/s':>10s} {'vs idle':>8s}")
    for name, row in table.items():
        lo, hi = row["frames_per_second_range"]
        ratio = row.get("ratio_to_idle")
        shown = "" if ratio is None else f"{ratio:.2f}"
        print(f"{name:34s} {row['frames_per_second']:10,.0f} {lo:9,.0f}-{hi:<9,.0f} "
              f"{row['updates_per_second']:10,.0f} {shown:>8s}")  # fmt: skip
    print(f"results: {args.out}")


if __name__ == "__main__":
    main()
