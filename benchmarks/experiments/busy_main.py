"""Background collection while the training script's own thread is busy: does the
collector keep collecting?

``collector.start()`` (CartPole as ``background_training.py`` runs it) collects into a
``ReplayBuffer`` on threads of the training process (the consuming thread, and with
``inference_backend="thread"`` the inference server), which share the interpreter
lock with the script's thread. For ``--seconds``
the script's thread either waits (``idle``), trains on small matrix products that let
go of the lock inside each call (``torch``), or runs a loop of pure Python that never
lets go of it (``python``: parsing, logging, Python-side preprocessing). A thread that
lets go of the lock (for a pipe read, a write, a torch call) must take it back from a
thread busy in Python, which keeps it up to the switch interval (5 ms). Prints one JSON
line per (backend, load): frames/s collected and the script's iterations/s, medians
of ``--repeats`` fresh processes::

    python benchmarks/experiments/busy_main.py --seconds 6 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from background_training import collecting  # the same collector, started the same way

from rlcollect import ReplayBuffer

LOADS = ("idle", "torch", "python")


def one_run(backend: str, load: str, seconds: float, envs: int) -> dict[str, float]:
    torch.set_num_threads(1)
    rb = ReplayBuffer(10_000_000, seed=0)
    a = torch.ones(64, 64)
    with collecting("cartpole", backend, envs, rb) as collector:
        t0, rows0, iterations, x = time.perf_counter(), rb.written, 0, 0
        while time.perf_counter() - t0 < seconds:
            if load == "python":
                for i in range(1000):
                    x += i * i
            elif load == "torch":
                a = torch.tanh(a @ a * 1e-3)
            else:
                collector.join(timeout=0.01)
            iterations += 1
        elapsed = time.perf_counter() - t0
        rows = rb.written - rows0
    return {"frames_per_second": rows / elapsed, "iterations_per_second": iterations / elapsed}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=6.0)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--envs", type=int, default=4)
    p.add_argument("--backends", nargs="+", default=["thread", "process"])
    p.add_argument("--loads", nargs="+", default=list(LOADS), choices=LOADS)
    p.add_argument("--one", nargs=2, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        print(json.dumps(one_run(args.one[0], args.one[1], args.seconds, args.envs)))
        return
    for load in args.loads:
        for backend in args.backends:
            runs = []
            for _ in range(args.repeats):  # each in a fresh process
                cmd = [sys.executable, __file__, "--one", backend, load]
                cmd += ["--seconds", str(args.seconds), "--envs", str(args.envs)]
                out = subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=300)
                runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
            fps = [r["frames_per_second"] for r in runs]
            its = [r["iterations_per_second"] for r in runs]
            print(json.dumps({
                "backend": backend, "load": load,
                "frames_per_second": round(statistics.median(fps)),
                "frames_per_second_runs": [round(f) for f in fps],
                "iterations_per_second": round(statistics.median(its)),
            }), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
