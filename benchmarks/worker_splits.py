"""Double buffering: collection throughput by envs_per_worker and worker_splits.

For each env (CartPole-v1, ale-py Pong 4x105x80) with ``--num-envs`` envs and the small
sampling policy of ``cpu_collection.py`` on ``--device`` (the CPU by default),
process-slot workers, in one run, interleaved, ``--repeats`` times: the collector with
``(envs_per_worker, worker_splits)``
in ``(1, 1)`` (one env per worker process, the default layout), ``(2, 1)``, ``(2, 2)``,
``(4, 1)``, ``(4, 2)`` and ``(4, 4)``, timed from its first batch. Reported: frames/s
(median and range) and the ratio to ``(1, 1)`` within each repeat, then its median.
Results go to ``benchmarks/results/worker_splits.json``; they chose the default of
``worker_splits``.

    python benchmarks/worker_splits.py [--repeats 3] [--envs cartpole pong]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ENVS, machine
from policies import policy_for

from rlcollect import AsyncBatchedCollector

FRAMES = {"cartpole": 60_000, "pong": 12_000}
LAYOUTS = [(1, 1), (2, 1), (2, 2), (4, 1), (4, 2), (4, 4)]


def measure(env: str, n: int, envs_per_worker: int, splits: int, device: str) -> dict[str, float]:
    total = FRAMES[env]
    with AsyncBatchedCollector(
        [ENVS[env]] * n,
        policy_for(env),
        frames_per_batch=512,
        total_frames=total,
        transport="process_slots",
        envs_per_worker=envs_per_worker,
        worker_splits=splits,
        policy_device=device,
    ) as collector:
        it = iter(collector)
        first = next(it).numel()
        t0, c0 = time.perf_counter(), time.process_time()
        frames = sum(batch.numel() for batch in it)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        server = collector.stats()["server"]
    assert first + frames == total
    return {
        "fps": frames / wall,
        "driver_cpu_ms_per_frame": 1e3 * cpu / frames,
        "mean_batch_size": server["mean_batch_size"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--num-envs", type=int, default=4)
    parser.add_argument("--envs", nargs="+", default=list(ENVS), choices=list(ENVS))
    parser.add_argument("--frames-scale", type=float, default=1.0)
    parser.add_argument("--device", default="cpu", help="policy device (cpu or cuda)")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results/worker_splits.json"))
    args = parser.parse_args()
    for env in FRAMES:
        FRAMES[env] = int(FRAMES[env] * args.frames_scale)
    n = args.num_envs
    layouts = [(k, g) for k, g in LAYOUTS if n % k == 0]
    names = [f"envs_per_worker={k},worker_splits={g}" for k, g in layouts]
    runs: dict[str, dict[str, list[dict[str, float]]]] = {
        env: {name: [] for name in names} for env in args.envs
    }
    rounds = [(rep, env) for rep in range(args.repeats) for env in args.envs]
    for _, env in tqdm(rounds, desc="repeats x envs", unit="round"):
        for name, (k, g) in zip(names, layouts, strict=True):
            runs[env][name].append(measure(env, n, k, g, args.device))

    summary: dict[str, Any] = {}
    for env in args.envs:
        base = runs[env][names[0]]
        rows = {}
        for name, reps in runs[env].items():
            fps = [r["fps"] for r in reps]
            rows[name] = {
                "fps_median": statistics.median(fps),
                "fps_range": [min(fps), max(fps)],
                "ratio_to_one_env_per_worker_median": statistics.median(
                    r["fps"] / b["fps"] for r, b in zip(reps, base, strict=True)
                ),
                "driver_cpu_ms_per_frame_median": statistics.median(
                    r["driver_cpu_ms_per_frame"] for r in reps
                ),
                "mean_batch_size_median": statistics.median(r["mean_batch_size"] for r in reps),
            }
        summary[env] = rows

    result = {
        "benchmark": "worker_splits",
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "machine": machine(),
        "config": {
            "num_envs": n,
            "repeats": args.repeats,
            "frames": {env: FRAMES[env] for env in args.envs},
            "frames_per_batch": 512,
            "transport": "process_slots",
            "policy_device": args.device,
            "policy": "MLP 4-64-64-2 (cartpole), SmallCNN (pong); Categorical sampling",
        },
        "runs": runs,
        "summary": summary,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")

    print("\n| env | layout | frames/s | range | / (1, 1) | drv ms/f | mean batch |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: |")
    for env, rows in summary.items():
        for name, row in rows.items():
            lo, hi = row["fps_range"]
            print(
                f"| {env} | {name} | {row['fps_median']:,.0f} | {lo:,.0f}-{hi:,.0f} | "
                f"{row['ratio_to_one_env_per_worker_median']:.2f} | "
                f"{row['driver_cpu_ms_per_frame_median']:.3f} | "
                f"{row['mean_batch_size_median']:.1f} |"
            )
    print(f"\nwritten to {out}")


if __name__ == "__main__":
    main()
