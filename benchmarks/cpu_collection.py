"""CPU collection benchmark: rlcollect against the envs' own speed and a hand-written loop.

For each env (CartPole-v1, ale-py Pong 4x105x80) with 4 envs and a small sampling
policy on the CPU, in one run, interleaved, ``--repeats`` times:

* ``env_only``: the envs alone, one process each, random actions, no policy
  (:func:`rlcollect.envspeed.env_throughput`);
* ``async_vector``: a hand-written loop over ``gymnasium.vector.AsyncVectorEnv``
  (same-step autoreset, so every step is a transition), the same policy in this process,
  with torch's default intra-op threads; ``async_vector_1thread`` the same with one
  thread, which is faster on few cores (the stronger of the two is the one to beat);
* ``rlcollect[<transport>-chunk<n>]``: the collector, timed from its first batch (so
  worker start-up is excluded) to the end of ``total_frames``.

Reported: frames/s and driver-process CPU ms per frame (medians), and the ratios
collector / env_only and collector / async_vector computed within each repeat, then
their median. Results go to ``benchmarks/results/cpu_collection.json``.

    python benchmarks/cpu_collection.py [--repeats 3] [--envs cartpole pong]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import gymnasium as gym
import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ENVS, machine
from policies import policy_for

from rlcollect import AsyncBatchedCollector
from rlcollect.envspeed import env_throughput

FRAMES = {"cartpole": 60_000, "pong": 12_000}
COLLECTORS = [("thread", "auto"), ("process_slots", "auto"), ("process_slots", 1)]


def measure_collector(env: str, n: int, transport: str, chunk: Any) -> dict[str, float]:
    frames_total = FRAMES[env]
    with AsyncBatchedCollector(
        [ENVS[env]] * n,
        policy_for(env),
        frames_per_batch=512,
        total_frames=frames_total,
        transport=transport,
        transition_chunk_size=chunk,
        policy_device="cpu",
    ) as collector:
        it = iter(collector)
        first = next(it).numel()
        t0, c0 = time.perf_counter(), time.process_time()
        frames = sum(batch.numel() for batch in it)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        mean_batch = collector.stats()["server"]["mean_batch_size"]
    assert first + frames == frames_total
    return {
        "fps": frames / wall,
        "driver_cpu_ms_per_frame": 1e3 * cpu / frames,
        "mean_batch_size": mean_batch,
    }


def measure_async_vector(env: str, n: int, threads: int | None) -> dict[str, float]:
    """The hand-written loop; ``threads`` sets torch's intra-op threads (None: default)."""
    default_threads = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        return _async_vector_loop(env, n)
    finally:
        torch.set_num_threads(default_threads)


def _async_vector_loop(env: str, n: int) -> dict[str, float]:
    policy = policy_for(env)
    envs = gym.vector.AsyncVectorEnv(
        [ENVS[env]] * n, autoreset_mode=gym.vector.AutoresetMode.SAME_STEP
    )
    try:
        obs, _ = envs.reset(seed=0)
        steps = FRAMES[env] // n
        with torch.inference_mode():
            for _ in range(20):  # warm-up
                obs, *_ = envs.step(policy(torch.from_numpy(obs)).numpy())
            t0, c0 = time.perf_counter(), time.process_time()
            for _ in range(steps):
                obs, *_ = envs.step(policy(torch.from_numpy(obs)).numpy())
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    finally:
        envs.close()
    return {"fps": steps * n / wall, "driver_cpu_ms_per_frame": 1e3 * cpu / (steps * n)}


def measure_env_only(env: str, n: int, seconds: float) -> dict[str, float]:
    return {"fps": env_throughput([ENVS[env]] * n, seconds=seconds)}


HAND_LOOPS = {"async_vector": None, "async_vector_1thread": 1}


def series_names() -> list[str]:
    return ["env_only", *HAND_LOOPS] + [f"rlcollect[{t}-chunk{c}]" for t, c in COLLECTORS]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--num-envs", type=int, default=4)
    parser.add_argument("--envs", nargs="+", default=list(ENVS), choices=list(ENVS))
    parser.add_argument("--frames-scale", type=float, default=1.0)
    parser.add_argument("--env-seconds", type=float, default=3.0)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results/cpu_collection.json"))
    args = parser.parse_args()
    for env in FRAMES:
        FRAMES[env] = int(FRAMES[env] * args.frames_scale)

    n = args.num_envs
    runs: dict[str, dict[str, list[dict[str, float]]]] = {
        env: {s: [] for s in series_names()} for env in args.envs
    }
    rounds = [(rep, env) for rep in range(args.repeats) for env in args.envs]
    for _, env in tqdm(rounds, desc="repeats x envs", unit="round"):
        runs[env]["env_only"].append(measure_env_only(env, n, args.env_seconds))
        for name, threads in HAND_LOOPS.items():
            runs[env][name].append(measure_async_vector(env, n, threads))
        for transport, chunk in COLLECTORS:
            name = f"rlcollect[{transport}-chunk{chunk}]"
            runs[env][name].append(measure_collector(env, n, transport, chunk))

    summary: dict[str, Any] = {}
    for env in args.envs:
        rows = {}
        for name, reps in runs[env].items():
            row: dict[str, Any] = {
                "fps_median": statistics.median(r["fps"] for r in reps),
                "fps_range": [min(r["fps"] for r in reps), max(r["fps"] for r in reps)],
            }
            if "driver_cpu_ms_per_frame" in reps[0]:
                row["driver_cpu_ms_per_frame_median"] = statistics.median(
                    r["driver_cpu_ms_per_frame"] for r in reps
                )
            if name.startswith("rlcollect"):
                for ref in ("env_only", *HAND_LOOPS):
                    ratios = [
                        r["fps"] / b["fps"] for r, b in zip(reps, runs[env][ref], strict=True)
                    ]
                    row[f"ratio_to_{ref}_median"] = statistics.median(ratios)
                row["mean_batch_size_median"] = statistics.median(
                    r["mean_batch_size"] for r in reps
                )
            rows[name] = row
        summary[env] = rows

    result = {
        "benchmark": "cpu_collection",
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "machine": machine(),
        "config": {
            "num_envs": n,
            "repeats": args.repeats,
            "frames": {env: FRAMES[env] for env in args.envs},
            "frames_per_batch": 512,
            "env_only_seconds": args.env_seconds,
            "policy": "MLP 4-64-64-2 (cartpole), SmallCNN (pong); Categorical sampling",
        },
        "runs": runs,
        "summary": summary,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")

    print(
        f"\n{'series':34s} {'frames/s':>10s} {'range':>17s} {'drv ms/f':>9s} "
        f"{'/env_only':>9s} {'/async_vec':>10s} {'/async_vec_1t':>13s}"
    )
    for env, rows in summary.items():
        print(f"-- {env} ({n} envs)")
        for name, row in rows.items():
            lo, hi = row["fps_range"]
            cpu = row.get("driver_cpu_ms_per_frame_median")
            print(
                f"{name:34s} {row['fps_median']:10.0f} {lo:8.0f}-{hi:<8.0f} "
                f"{'' if cpu is None else f'{cpu:9.4f}':>9s} "
                f"{row.get('ratio_to_env_only_median', float('nan')):9.2f} "
                f"{row.get('ratio_to_async_vector_median', float('nan')):10.2f} "
                f"{row.get('ratio_to_async_vector_1thread_median', float('nan')):13.2f}"
            )
    print(f"\nwritten to {out}")


if __name__ == "__main__":
    main()
