"""Worker processes pinned to cores against free to move: does an env resume faster on
the core whose cache it left?

On the H200 a Pong worker spent 1.19-1.21x the env's own CPU per frame
(``results/h200/worker_cpu/``), more than on 2 cores (1.09-1.21x). One suspect is the
scheduler moving a worker that wakes from its wait for actions to another core, where
its envs' emulator state and frame stacks are no longer cached. This pins each worker
process to one core from its first env factory (``os.sched_setaffinity``: worker ``w``
to core ``w % cores``; the driver stays free), and runs the same layouts pinned and
free, interleaved round by round, each run in a fresh process, beside
``rlcollect.envspeed.env_throughput`` of one env per core in each round::

    python benchmarks/experiments/pin_workers.py --device cuda [--rounds 3] [--seconds 4]

Prints one JSON line per run: frames/s (the median of three windows), the workers' CPU
per frame and cores busy (``/proc/<pid>/stat``), the ratio to the round's envs alone.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import ENVS, make_pong

_TICK = os.sysconf("SC_CLK_TCK")
LAYOUTS = {  # name: (envs, envs_per_worker, worker_splits)
    "64 envs, 4 per worker, 2 splits": (64, 4, 2),
    "64 envs, 2 per worker, 2 splits": (64, 2, 2),
    "16 envs, 1 per worker": (16, 1, 1),
    "4 envs, 2 per worker, 2 splits": (4, 2, 2),  # small enough for 2 cores (the smoke test)
}


def pinned_pong(envs_per_worker: int, env: int) -> Any:
    """Pong, after pinning this process (env ``env``'s worker) to one core."""
    cores = sorted(os.sched_getaffinity(0)) if env % envs_per_worker == 0 else None
    if cores is not None:  # the worker's first env pins it; the others find it pinned
        os.sched_setaffinity(0, {cores[(env // envs_per_worker) % len(cores)]})
    return make_pong()


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICK


def one(layout: str, pin: bool, device: str, seconds: float) -> dict[str, Any]:
    import torch
    from policies import NatureCNN, policy_for

    from rlcollect import AsyncBatchedCollector

    torch.set_num_threads(1)
    envs, epw, splits = LAYOUTS[layout]
    fns = (
        [functools.partial(pinned_pong, epw, i) for i in range(envs)]
        if pin
        else [ENVS["pong"]] * envs
    )
    gpu = device != "cpu"
    with AsyncBatchedCollector(
        fns,
        NatureCNN(6) if gpu else policy_for("pong"),
        frames_per_batch=1024 if gpu else 256,
        total_frames=-1,
        policy_device=device,
        cuda_graph=gpu,
        envs_per_worker=epw,
        worker_splits=splits,
    ) as collector:
        pids = collector.transport.pids
        batches = iter(collector)
        start = time.perf_counter()
        while time.perf_counter() - start < 1.0:  # warm-up
            next(batches)
        affinity = [sorted(os.sched_getaffinity(pid)) for pid in pids]
        cpu0 = sum(cpu_seconds(pid) for pid in pids)
        t0 = time.perf_counter()
        rates, total = [], 0
        for _ in range(3):
            frames, w = 0, time.perf_counter()
            while time.perf_counter() - w < seconds:
                frames += next(batches).numel()
            rates.append(frames / (time.perf_counter() - w))
            total += frames
        wall = time.perf_counter() - t0
        cpu = sum(cpu_seconds(pid) for pid in pids) - cpu0
    return {
        "layout": layout,
        "pinned": pin,
        "frames_per_second": statistics.median(rates),
        "windows": rates,
        "worker_cpu_ms_per_frame": 1e3 * cpu / total,
        "worker_cores_busy": cpu / wall,
        "worker_affinity": affinity,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seconds", type=float, default=4.0)
    p.add_argument("--layouts", nargs="*", default=list(LAYOUTS)[:3], choices=list(LAYOUTS))
    p.add_argument("--one", nargs=2, metavar=("LAYOUT", "PIN"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        result = one(args.one[0], args.one[1] == "1", args.device, args.seconds)
        print(json.dumps(result), flush=True)
        return
    from rlcollect.envspeed import env_throughput

    cores = len(os.sched_getaffinity(0))
    for r in range(args.rounds):
        alone = env_throughput([ENVS["pong"]] * cores, seconds=args.seconds)
        print(json.dumps({"round": r, "env_only_frames_per_second": alone}), flush=True)
        for layout in args.layouts:
            for pin in (False, True):
                cmd = [sys.executable, __file__, "--device", args.device]
                cmd += ["--seconds", str(args.seconds), "--one", layout, str(int(pin))]
                out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
                if out.returncode:
                    sys.exit(f"{layout}, pinned={pin} failed:\n{out.stderr[-3000:]}")
                result = json.loads(out.stdout.strip().splitlines()[-1])
                result["round"] = r
                result["vs_env_only"] = result["frames_per_second"] / alone
                print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
