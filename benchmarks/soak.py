"""Soak test: long background collection with a learner, weight pushes and checkpoints.

Runs ``--minutes`` of ``collector.start()`` into a small ``rlcollect.ReplayBuffer``
(it wraps around every few seconds), while this process trains a Q-network on batches
sampled from it, pushes new weights every ``--push-every`` seconds and, every
``--checkpoint-every`` seconds, takes a consistent checkpoint inside
``collector.pause()``. Every ``--sample-every`` seconds it records the resident memory
(RSS) of the driver, the workers and (with ``--backend process``) the inference
process, frames collected, updates and versions. At the end it checks that the
collector shut down cleanly (no process, no shared-memory segment left) and writes
``benchmarks/results/soak.json``. An error anywhere ends the run and is recorded.

    python benchmarks/soak.py [--minutes 10] [--env pong] [--backend thread]
"""

from __future__ import annotations

import argparse
import io
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from background_training import BATCH, q_network
from common import ENVS, machine
from policies import policy_for

from rlcollect import AsyncBatchedCollector, ReplayBuffer

RESULTS = Path(__file__).resolve().parent / "results" / "soak.json"


def rss_mib(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except (FileNotFoundError, ProcessLookupError):  # gone before the open, or before the read
        pass
    return 0.0


def child_pids(parent: int) -> list[int]:
    """Process ids whose parent is ``parent`` (read from /proc)."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # ended meanwhile
            continue
        if int(fields[1]) == parent:
            out.append(int(stat.parent.name))
    return out


def rss_growth(samples: list[dict[str, Any]], warmup: float) -> dict[str, Any]:
    """RSS change from the first sample after ``warmup`` seconds to the last one.

    The warm-up covers filling the buffer and the first checkpoint, whose copies the
    allocator keeps for the next ones; growth after it is what a leak would show.
    """
    steady = [s for s in samples if s["seconds"] >= warmup]
    if len(steady) < 2:
        return {"rss_growth_window_seconds": None}
    first, last = steady[0], steady[-1]
    out: dict[str, Any] = {"rss_growth_window_seconds": [first["seconds"], last["seconds"]]}
    for part in ("driver", "workers", "inference"):
        key = f"{part}_rss_mib"
        out[f"{part}_rss_growth_mib"] = last[key] - first[key]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description="soak: long background collection with a learner")
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--env", default="pong", choices=sorted(ENVS))
    p.add_argument("--num-envs", type=int, default=4)
    p.add_argument("--backend", default="thread", choices=["thread", "process"])
    p.add_argument("--capacity", type=int, default=5_000)
    p.add_argument("--push-every", type=float, default=2.0)
    p.add_argument("--checkpoint-every", type=float, default=60.0)
    p.add_argument("--sample-every", type=float, default=10.0)
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args()

    torch.set_num_threads(1)
    rb = ReplayBuffer(args.capacity, seed=0)
    acting = policy_for(args.env)
    q = q_network(args.env)
    optimizer = torch.optim.Adam(q.parameters(), lr=1e-4)
    samples: list[dict[str, Any]] = []
    errors: list[str] = []
    updates = pushes = checkpoints = 0
    start = time.monotonic()
    collector = AsyncBatchedCollector(
        [ENVS[args.env]] * args.num_envs,
        acting,
        frames_per_batch=256,
        total_frames=-1,
        policy_device="cpu",
        inference_backend=args.backend,
        replay_buffer=rb,
    )
    pids = list(getattr(collector.transport, "pids", []))
    # The driver's other children: the inference process with --backend process.
    others = [pid for pid in child_pids(os.getpid()) if pid not in pids]
    shm = getattr(collector.transport, "shm_name", None)
    try:
        with collector:
            collector.start()
            next_push = next_checkpoint = next_sample = time.monotonic()
            end = start + 60 * args.minutes
            while (now := time.monotonic()) < end:
                if len(rb) < BATCH[args.env]:
                    collector.join(timeout=0.01)
                    continue
                batch = rb.sample(BATCH[args.env])
                q_taken = q(batch["observation"].float()).gather(1, batch["action"][:, None])
                loss = (q_taken.squeeze(1) - batch["next", "reward"]).pow(2).mean()
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                updates += 1
                if now >= next_push:
                    collector.update_policy_weights_(acting)
                    pushes += 1
                    next_push = now + args.push_every
                if now >= next_checkpoint:
                    with collector.pause():
                        buffer = io.BytesIO()
                        torch.save({"rb": rb.state_dict(), "q": q.state_dict()}, buffer)
                    checkpoints += 1
                    next_checkpoint = now + args.checkpoint_every
                if now >= next_sample:
                    stats = collector.stats()
                    samples.append(
                        {
                            "seconds": now - start,
                            "frames": stats["frames"],
                            "updates": updates,
                            "policy_version": stats["policy_version"],
                            "driver_rss_mib": rss_mib(os.getpid()),
                            "workers_rss_mib": sum(rss_mib(pid) for pid in pids),
                            "inference_rss_mib": sum(rss_mib(pid) for pid in others),
                        }
                    )
                    s = samples[-1]
                    print(
                        f"{s['seconds']:6.0f} s  frames {s['frames']:9,d}  updates {updates:7,d}"
                        f"  driver {s['driver_rss_mib']:7.1f} MiB  workers "
                        f"{s['workers_rss_mib']:7.1f} MiB  inference "
                        f"{s['inference_rss_mib']:6.1f} MiB",
                        flush=True,
                    )
                    next_sample = now + args.sample_every
            final = collector.stats()
    except Exception:
        errors.append(traceback.format_exc())
        final = {}
    seconds = time.monotonic() - start
    left = [pid for pid in pids + others if os.path.exists(f"/proc/{pid}")]
    shm_left = shm is not None and os.path.exists(f"/dev/shm/{shm}")

    growth = rss_growth(samples, warmup=1.5 * args.checkpoint_every)
    result = {
        "benchmark": "soak",
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "machine": machine(),
        "config": {k: str(v) for k, v in vars(args).items()},
        "seconds": seconds,
        "frames": final.get("frames"),
        "frames_per_second": final.get("frames_per_second"),
        "updates": updates,
        "weight_pushes": pushes,
        "checkpoints": checkpoints,
        "errors": errors,
        "processes_left": left,
        "segment_left": shm_left,
        **growth,
        "samples": samples,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k != "samples"}, indent=1))
    if errors or left or shm_left:
        sys.exit(1)


if __name__ == "__main__":
    main()
