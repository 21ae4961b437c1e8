"""The env workers' CPU per frame against the env's own: what the worker loop adds.

Collects ``--envs`` Pong envs (4x105x80 uint8, ``benchmarks/common.py``) in worker
processes (``process_slots``), the policy (the small CNN, on the CPU) in a process of its
own (``inference_backend="process"``), so that the worker processes' CPU time (user +
system, from ``/proc/<pid>/stat``) over a window is theirs alone. Beside it, the same env
stepped alone in this process with random actions (``time.process_time``). Prints one
JSON line: CPU ms per frame of each, and their ratio. For an A/B, run it once per tree,
interleaved (``PYTHONPATH=<tree>/src``)::

    python benchmarks/experiments/worker_cpu.py [--envs 4] [--envs-per-worker 2] [--splits 2]

With ``--device cuda`` the policy is the Nature CNN as a CUDA graph, served by the
driver's inference thread. ``env_procs_cpu_ms_per_frame`` is the env's CPU per frame when
``min(envs, cores)`` envs run alone in processes of their own
(``rlcollect.envspeed.env_throughput``, every core busy: cores / frames per second),
which shares the machine as the workers do; ``env_alone`` is one env on an idle machine.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import ENVS
from pong_collector import pong_collector  # beside this script

from rlcollect.envspeed import env_throughput

_TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICK  # utime, stime


def env_alone(frames: int) -> float:
    """CPU ms per frame of one env stepped in this process with random actions."""
    env = ENVS["pong"]()
    env.reset(seed=0)
    env.action_space.seed(0)
    start = time.process_time()
    for _ in range(frames):
        _, _, terminated, truncated, _ = env.step(env.action_space.sample())
        if terminated or truncated:
            env.reset()
    return 1e3 * (time.process_time() - start) / frames


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--envs", type=int, default=4)
    p.add_argument("--envs-per-worker", type=int, default=2)
    p.add_argument("--splits", type=int, default=2)
    p.add_argument("--frames", type=int, default=8192)
    p.add_argument("--device", default="cpu")
    args = p.parse_args()
    torch.set_num_threads(1)
    gpu = args.device != "cpu"
    with pong_collector(
        args.envs,
        args.device,
        "thread" if gpu else "process",
        1024 if gpu else 256,
        envs_per_worker=args.envs_per_worker,
        worker_splits=args.splits,
    ) as collector:
        pids = collector.transport.pids
        batches = iter(collector)
        next(batches)  # start-up left out
        frames, before = 0, sum(cpu_seconds(pid) for pid in pids)
        wall = time.perf_counter()
        while frames < args.frames:
            frames += next(batches).numel()
        workers = sum(cpu_seconds(pid) for pid in pids) - before
        wall = time.perf_counter() - wall
    alone = env_alone(2048)
    procs = min(args.envs, os.cpu_count() or 1)
    shared = 1e3 * procs / env_throughput([ENVS["pong"]] * procs, seconds=5.0)
    worker_ms = 1e3 * workers / frames
    result = {
        "envs": args.envs,
        "envs_per_worker": args.envs_per_worker,
        "splits": args.splits,
        "device": args.device,
        "frames_per_second": frames / wall,
        "worker_cores_busy": workers / wall,
        "worker_cpu_ms_per_frame": worker_ms,
        "env_alone_cpu_ms_per_frame": alone,
        "env_procs_cpu_ms_per_frame": shared,
        "vs_env_alone": worker_ms / alone,
        "vs_env_procs": worker_ms / shared,
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
