"""Cheap envs on a small machine: the collector against the loop it replaces.

For each case (1, 4 and 16 CartPole envs with a small MLP sampling by Gumbel-max; 4 Pong
envs with a small sampling CNN), with torch on one thread everywhere, in one run, interleaved,
``--repeats`` times, each for ``--seconds``:

* ``sync_vector``: a hand-written loop over ``gymnasium.vector.SyncVectorEnv``, the
  envs and the policy in this process (the strongest plain loop for cheap envs); for
  one env also ``plain_env``, the env itself stepped in a loop (no vector wrapper);
* ``async_vector``: the same over ``AsyncVectorEnv`` (envs in processes);
* ``rlcollect[thread]``: the collector with its batching server (a thread of this
  process), one env per worker process;
* ``rlcollect[worker]``: ``inference_backend="worker"``, the policy in each worker,
  the envs split over one worker per core.

Reported per case: frames/s (median), each collector's ratio to the best plain loop of
the same repeat (then the median), the server's request round trip (p50, from a
request's arrival to its response; for ``worker``, a request's time in its worker), and
the driver's CPU per frame. Results: ``benchmarks/results/cheap_envs.json`` and
``cheap_envs.png``.

    python benchmarks/cheap_envs.py [--repeats 3] [--seconds 4] [--cases cartpole1 ...]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ENVS, machine
from policies import GumbelMLP, policy_for

from rlcollect import AsyncBatchedCollector

CASES = {"cartpole1": ("cartpole", 1), "cartpole4": ("cartpole", 4)}
CASES |= {"cartpole16": ("cartpole", 16), "pong4": ("pong", 4)}
OUT = Path(__file__).resolve().parent / "results"


def policy(env: str) -> torch.nn.Module:
    return GumbelMLP(4, 2) if env == "cartpole" else policy_for(env)


def timed(step: Callable[[], int], seconds: float) -> float:
    """Frames/s of calling ``step`` (which returns the frames it stepped) for ``seconds``."""
    frames, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        frames += step()
    return frames / (time.perf_counter() - start)


def plain_loop(vector: type, env: str, n: int, seconds: float) -> float:
    """Frames/s of a hand-written loop: policy on the batch, then one vector step."""
    envs = vector([ENVS[env]] * n)
    acting = policy(env)
    obs = envs.reset(seed=0)[0]

    def step() -> int:
        nonlocal obs
        with torch.inference_mode():
            action = acting(torch.from_numpy(np.asarray(obs))).numpy()
        obs = envs.step(action)[0]  # the vector env resets finished envs itself
        return n

    try:
        return timed(step, seconds)
    finally:
        envs.close()


def single_loop(env: str, seconds: float) -> float:
    """Frames/s of the plainest loop: one env, the policy on its observation, a step."""
    instance = ENVS[env]()
    acting = policy(env)
    obs = instance.reset(seed=0)[0]

    def step() -> int:
        nonlocal obs
        with torch.inference_mode():
            action = acting(torch.from_numpy(np.asarray(obs))[None]).numpy()[0]
        obs, _, terminated, truncated, _ = instance.step(action)
        if terminated or truncated:
            obs = instance.reset()[0]
        return 1

    try:
        return timed(step, seconds)
    finally:
        instance.close()


def collector_run(env: str, n: int, seconds: float, backend: str) -> dict[str, Any]:
    """Frames/s of the collector, timed from its first batch, and its figures."""
    cores = os.cpu_count() or 1
    kwargs: dict[str, Any] = {}
    if backend == "worker":
        workers = min(n, cores)
        kwargs = {"inference_backend": "worker", "envs_per_worker": n // workers}
    fpb = 1024 if env == "cartpole" else 256
    with AsyncBatchedCollector(
        [ENVS[env]] * n, policy(env), frames_per_batch=fpb, policy_device="cpu", **kwargs
    ) as collector:
        frames, start = 0, None
        for batch in collector:
            if start is None:  # worker start-up excluded
                start, cpu0 = time.perf_counter(), time.process_time()
                continue
            frames += batch.numel()
            if time.perf_counter() - start >= seconds:
                break
        elapsed = time.perf_counter() - start
        cpu = time.process_time() - cpu0
        server = collector.stats()["server"]
    return {
        "fps": frames / elapsed,
        "round_trip_p50_us": 1e6 * server["request_latency_p50"],
        "mean_batch": server["mean_batch_size"],
        "driver_cpu_ms_per_frame": 1e3 * cpu / frames,
        "phase_seconds": server["phase_seconds"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--cases", nargs="+", choices=list(CASES), default=list(CASES))
    parser.add_argument("--out", type=Path, default=OUT / "cheap_envs.json")
    args = parser.parse_args()
    torch.set_num_threads(1)  # the user's script, as docs/tuning.md asks

    runs: dict[str, dict[str, list[Any]]] = {}
    for repeat in range(args.repeats):
        for case in args.cases:
            env, n = CASES[case]
            row = runs.setdefault(case, {})
            seconds = args.seconds
            measures: dict[str, Callable[[], Any]] = {
                "sync_vector": functools.partial(
                    plain_loop, gym.vector.SyncVectorEnv, env, n, seconds
                ),
                "async_vector": functools.partial(
                    plain_loop, gym.vector.AsyncVectorEnv, env, n, seconds
                ),
                **({"plain_env": functools.partial(single_loop, env, seconds)} if n == 1 else {}),
                "rlcollect[thread]": functools.partial(collector_run, env, n, seconds, "thread"),
                "rlcollect[worker]": functools.partial(collector_run, env, n, seconds, "worker"),
            }
            for name, measure in measures.items():
                result = measure()
                row.setdefault(name, []).append(result)
                fps = result if isinstance(result, float) else result["fps"]
                print(f"repeat {repeat} {case:11s} {name:18s} {fps:9.0f} frames/s", flush=True)

    summary: dict[str, Any] = {}
    for case, row in runs.items():
        loops = [name for name in ("plain_env", "sync_vector", "async_vector") if name in row]
        best_plain = [max(fps) for fps in zip(*(row[name] for name in loops), strict=True)]
        out: dict[str, Any] = {f"{name}_fps": statistics.median(row[name]) for name in loops}
        out["best_plain_loop"] = max(loops, key=lambda name: statistics.median(row[name]))
        for name in ("rlcollect[thread]", "rlcollect[worker]"):
            results = row[name]
            out[name] = {
                "fps": statistics.median(r["fps"] for r in results),
                "vs_best_plain_loop": statistics.median(
                    r["fps"] / b for r, b in zip(results, best_plain, strict=True)
                ),
                "vs_sync_vector": statistics.median(
                    r["fps"] / s for r, s in zip(results, row["sync_vector"], strict=True)
                ),
                "vs_async_vector": statistics.median(
                    r["fps"] / a for r, a in zip(results, row["async_vector"], strict=True)
                ),
                "round_trip_p50_us": statistics.median(r["round_trip_p50_us"] for r in results),
                "driver_cpu_ms_per_frame": statistics.median(
                    r["driver_cpu_ms_per_frame"] for r in results
                ),
                "phase_seconds": results[len(results) // 2]["phase_seconds"],
            }
        summary[case] = out
        print(case, json.dumps(out, indent=1))
    result = {
        "machine": machine(),
        "repeats": args.repeats,
        "seconds": args.seconds,
        "summary": summary,
        "runs": runs,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    plot(summary, args.out.with_suffix(".png"))


def plot(summary: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = list(summary)
    names = ["sync_vector", "async_vector", "rlcollect[thread]", "rlcollect[worker]"]
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.2
    for k, name in enumerate(names):
        values = [
            summary[c][f"{name}_fps"] if f"{name}_fps" in summary[c] else summary[c][name]["fps"]
            for c in cases
        ]  # for one env, sync_vector stands for the plain loops (plain_env is in the JSON)
        ax.bar(np.arange(len(cases)) + (k - 1.5) * width, values, width, label=name)
    ax.set_xticks(np.arange(len(cases)), cases)
    ax.set_ylabel("frames/s (median)")
    ax.set_yscale("log")
    ax.set_title("Cheap envs: the collector against the plain loops, torch on one thread")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
