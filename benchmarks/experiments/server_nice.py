"""Does the inference server thread wait for a core? Its niceness 0 against ``--nice``, in
alternating windows of one collector: an experiment, not a figure.

With the policy in a vector env's worker, that worker's thread waited 140-170 us per
``recv`` for a core on the H200 (busy most of each cycle, it is owed no time when its
result is ready); at niceness -5 the wait fell to 40 us and throughput rose by a tenth
(``results/archive/h200/driver_nice/``). The server thread of a Pong collector is busy
much of the time too (the issue's profile: 18 of 29 s), beside worker processes that
fill every core. This runs ``--envs`` Pong envs in worker processes (``pong_collector.py``:
the Nature CNN as a CUDA graph on a GPU, the small CNN on the CPU) with the server
thread, and sets that thread's niceness to 0 and ``--nice`` in turn, one window each,
without restarting anything: each pair of windows is a before/after on the same envs,
and the pairs open with either niceness in turn.
For each window it reports frames/s and, from ``/proc/self/task/<tid>/schedstat``, the
server thread's time on a core and its time runnable but waiting for one, per second::

    python benchmarks/experiments/server_nice.py [--envs 16] [--nice -5] [--windows 10]

Lowering a niceness needs ``CAP_SYS_NICE`` (root) or an ``RLIMIT_NICE`` of 25 or more;
without either the script says so and stops. On the H200 (16 Pong envs, and 64 at 4 per
worker) the server thread's wait for a core halved at -5, without a clear gain in
frames/s (``results/archive/h200/driver_nice_10/``): the server thread stays at 0.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common
from common import machine
from pong_collector import pong_collector


def schedstat(tid: int) -> tuple[int, int, int]:
    """Nanoseconds on a core, nanoseconds runnable but waiting, and times scheduled in."""
    with open(f"/proc/self/task/{tid}/schedstat") as f:
        run_ns, wait_ns, slices = f.read().split()
    return int(run_ns), int(wait_ns), int(slices)


def server_thread() -> int:
    """The native id of this process's inference server thread."""
    for thread in threading.enumerate():
        if thread.name == "rlcollect-inference" and thread.native_id is not None:
            return thread.native_id
    raise RuntimeError("no thread named rlcollect-inference: is the server a thread?")


def window(collector: Any, it: Any, tid: int, seconds: float) -> dict[str, float]:
    """Frames/s over ``seconds`` of batches, the server thread's time on and off a core,
    and the server's mean inference batch over the window."""
    served, before = collector.stats()["server"], schedstat(tid)
    frames, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < seconds:
        frames += next(it).numel()
    after, served_after = schedstat(tid), collector.stats()["server"]
    run_ns, wait_ns, slices = (a - b for a, b in zip(after, before, strict=True))
    batches = served_after["batches"] - served["batches"]
    return {
        "fps": frames / elapsed,
        "server_run_ms_per_s": run_ns / 1e6 / elapsed,
        "server_wait_ms_per_s": wait_ns / 1e6 / elapsed,
        "server_switches_per_s": slices / elapsed,
        "server_wait_us_per_batch": wait_ns / 1e3 / max(batches, 1),
        "mean_batch": (served_after["rows"] - served["rows"]) / max(batches, 1),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--envs", type=int, default=16)
    p.add_argument("--envs-per-worker", type=int, default=1)
    p.add_argument("--worker-splits", type=int, default=1)
    p.add_argument("--nice", type=int, default=-5, help="the server thread's other niceness")
    p.add_argument("--windows", type=int, default=10, help="in pairs: 0, --nice, --nice, 0, ...")
    p.add_argument("--seconds", type=float, default=3.0, help="per window")
    p.add_argument("--warmup", type=float, default=3.0)
    p.add_argument("--settle", type=int, default=3, help="batches dropped after each switch")
    p.add_argument("--frames-per-batch", type=int, default=1024)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.set_num_threads(1)  # the cores belong to the workers' envs
    layout = {"envs_per_worker": args.envs_per_worker, "worker_splits": args.worker_splits}
    windows: list[dict[str, Any]] = []
    with pong_collector(args.envs, device, "thread", args.frames_per_batch, **layout) as c:
        it = iter(c)
        start = time.perf_counter()
        while time.perf_counter() - start < args.warmup:
            next(it)
        tid = server_thread()
        try:
            os.setpriority(os.PRIO_PROCESS, tid, args.nice)
        except OSError as exc:
            sys.exit(f"may not set the server thread's niceness to {args.nice}: {exc}")
        for w in range(args.windows):
            # Pairs open with 0 and --nice in turn (0 -5, -5 0, ...): collection that speeds
            # up or slows down through a run favours neither.
            second = w % 2 == 1
            nice = args.nice if second != (w // 2 % 2 == 1) else 0
            os.setpriority(os.PRIO_PROCESS, tid, nice)
            for _ in range(args.settle):
                next(it)
            windows.append({"nice": nice, **window(c, it, tid, args.seconds)})
            print(json.dumps(windows[-1]), flush=True)
    pairs = [
        (b["fps"] / a["fps"]) if b["nice"] != 0 else (a["fps"] / b["fps"])
        for a, b in zip(windows[::2], windows[1::2], strict=False)
    ]  # each pair: its window at --nice against its window at 0
    summary = {
        str(n): {
            key: statistics.median(w[key] for w in windows if w["nice"] == n)
            for key in windows[0]
            if key != "nice"
        }
        for n in (0, args.nice)
    }
    report = {
        "config": {**vars(args), "device": device},
        "machine": machine(),
        "windows": windows,
        "summary": summary,
        f"fps_nice{args.nice}/fps_nice0": {"pairs": pairs, "median": statistics.median(pairs)},
    }
    print(json.dumps({k: report[k] for k in list(report)[3:]}, indent=1))
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "server_nice.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
