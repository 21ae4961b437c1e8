"""What a pipe write that lets go of the GIL costs a thread whose process has another
busy thread: the mechanism behind the ``gil_writes`` probe.

The inference server thread answers each request of a batch with a one-byte write to
the worker's pipe, and the consuming thread writes a credit per chunk given back, both
with ``os.write``, which lets go of the GIL for the call. A thread that lets go must
take the GIL back from whichever thread took it meanwhile; a thread busy in Python
keeps it until the switch interval (5 ms) runs out. Here a server thread answers
``--workers`` forked processes that ping-pong with it over pipes, while a second thread
of its process is ``idle`` (sleeps 1 ms between bursts of Python), ``python`` (a loop
that never lets go) or ``torch`` (small matrix products, which let go of the GIL inside
each call, as a learner's do). Each answer goes out by ``os.write`` or by libc's write
through ``ctypes.PyDLL`` (which keeps the GIL). Prints one JSON line per pairing: the
server's seconds per answer (median of ``--repeats``) and answers per second::

    python benchmarks/experiments/gil_writes.py --workers 16 --answers 20000 --repeats 3
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import threading
import time

import torch

_pywrite = ctypes.PyDLL(None, use_errno=True).write
_pywrite.argtypes = (ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t)
_pywrite.restype = ctypes.c_ssize_t


def _companion(kind: str, stop: threading.Event) -> None:
    a = torch.ones(64, 64)
    x = 0
    while not stop.is_set():
        if kind == "torch":
            a = torch.tanh(a @ a * 1e-3)
            continue
        for _ in range(1000):
            x += 1
        if kind == "idle":
            time.sleep(0.001)


def one(
    workers: int, answers: int, companion: str, how: str, seconds: float
) -> tuple[float, float]:
    """(seconds per answer spent writing, answers per second) for one run of ``answers``
    answers or ``seconds``, whichever ends first."""
    req_r, req_w = os.pipe()
    pipes = [os.pipe() for _ in range(workers)]
    pids = []
    for i in range(workers):
        pid = os.fork()
        if pid == 0:  # a worker: ask, wait for the answer, ask again; a 0 byte ends it
            try:
                me = bytes([i])
                os.write(req_w, me)
                while os.read(pipes[i][0], 1) == b"\x01":
                    os.write(req_w, me)
            finally:
                os._exit(0)
        pids.append(pid)
    stop = threading.Event()
    thread = threading.Thread(target=_companion, args=(companion, stop), daemon=True)
    thread.start()
    ends = [w for _, w in pipes]
    answered, spent = 0, 0.0
    start = time.perf_counter()
    while answered < answers and time.perf_counter() - start < seconds:
        asked = os.read(req_r, 256)
        t0 = time.perf_counter()
        for w in asked:
            if how == "os.write":
                os.write(ends[w], b"\x01")
            elif _pywrite(ends[w], b"\x01", 1) != 1:
                raise OSError(ctypes.get_errno(), "write")
        spent += time.perf_counter() - t0
        answered += len(asked)
    wall = time.perf_counter() - start
    stop.set()
    thread.join(timeout=10)
    for w in ends:
        os.write(w, b"\x00")
    for pid in pids:
        os.waitpid(pid, 0)
    for fd in (req_r, req_w, *(fd for p in pipes for fd in p)):
        os.close(fd)
    return spent / answered, answered / wall


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, default=16)
    p.add_argument("--answers", type=int, default=20000)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seconds", type=float, default=5.0, help="at most, per run")
    p.add_argument("--companions", nargs="+", default=["idle", "torch", "python"])
    args = p.parse_args()
    if not 1 <= args.workers <= 255:
        p.error(
            f"--workers must be 1-255 (a request is a worker's index, one byte): {args.workers}"
        )
    torch.set_num_threads(1)
    for companion in args.companions:
        for how in ("os.write", "PyDLL write"):
            runs = [
                one(args.workers, args.answers, companion, how, args.seconds)
                for _ in range(args.repeats)
            ]
            print(json.dumps({
                "companion": companion, "write": how, "workers": args.workers,
                "us_per_answer": round(1e6 * statistics.median(r[0] for r in runs), 2),
                "answers_per_second": round(statistics.median(r[1] for r in runs)),
            }), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
