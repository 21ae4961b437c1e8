"""Timers around a vector worker's steps, in whichever process runs the worker.

``benchmarks/profile_vector_worker.py`` uses them in its own process for thread workers,
and hands :class:`TimedAtariVector` to worker processes as their env factory: building
the env there installs the timers in that process and starts a thread that writes their
running totals to a JSON file every 0.1 s, which the profiler reads at the start and the
end of its timed window. Imports no torch (worker processes import this module).
"""

from __future__ import annotations

import collections
import functools
import json
import os
import threading
import time
from pathlib import Path
from typing import Any

from common import make_atari_vector

import rlcollect.collector.vector_worker as vw

TIMES: dict[str, float] = collections.defaultdict(float)
CALLS: collections.Counter[str] = collections.Counter()
_installed = False


def _wrap(f: Any, label: str) -> Any:
    @functools.wraps(f)
    def timed(*args: Any, **kwargs: Any) -> Any:
        t = time.perf_counter()
        try:
            return f(*args, **kwargs)
        finally:
            TIMES[label] += time.perf_counter() - t
            CALLS[label] += 1

    return timed


def instrument() -> None:
    """Wrap the loop's steps and its transport calls in timers (once per process)."""
    global _installed
    if _installed:
        return
    _installed = True
    vw._VectorLoop.receive = _wrap(vw._VectorLoop.receive, "receive")  # type: ignore[method-assign]
    vw._VectorLoop.finish = _wrap(vw._VectorLoop.finish, "finish")  # type: ignore[method-assign]
    vw._VectorEnvDriver.act = _wrap(vw._VectorEnvDriver.act, "act")  # type: ignore[method-assign]
    init = vw._VectorLoop.__init__

    def patched(self: Any, end: Any, *args: Any, **kwargs: Any) -> None:
        init(self, end, *args, **kwargs)  # whatever else the loop takes
        for name in ("wait_response", "wait_slot", "request", "hand_over"):
            setattr(end, name, _wrap(getattr(end, name), name))

    vw._VectorLoop.__init__ = patched  # type: ignore[method-assign]


def totals() -> dict[str, dict[str, float]]:
    return {"seconds": dict(TIMES), "calls": {k: float(v) for k, v in CALLS.items()}}


def per_batch(start: dict[str, Any], end: dict[str, Any]) -> dict[str, float]:
    """Microseconds per batch (per ``act``) of each step between two :func:`totals`."""
    batches = max(end["calls"].get("act", 0) - start["calls"].get("act", 0), 1)
    return {
        k: 1e6 * (v - start["seconds"].get(k, 0.0)) / batches for k, v in end["seconds"].items()
    }


class TimedAtariVector:
    """An env factory for worker processes: ``make_atari_vector`` with timers installed,
    their totals written to ``<report_dir>/worker-<pid>.json`` every 0.1 s."""

    def __init__(self, n: int, b: int, t: int, nice: int, report_dir: str) -> None:
        self.args = (n, b, t, nice)
        self.report_dir = report_dir

    def __call__(self) -> Any:
        instrument()
        path = Path(self.report_dir) / f"worker-{os.getpid()}.json"

        def report() -> None:
            while True:
                data = json.dumps(totals())  # a snapshot under the GIL
                tmp = path.with_suffix(".tmp")
                tmp.write_text(data)
                tmp.replace(path)  # readers never see a half-written file
                time.sleep(0.1)

        threading.Thread(target=report, name="timer-report", daemon=True).start()
        return make_atari_vector(*self.args)


def read_workers(report_dir: str) -> dict[str, Any]:
    """The worker processes' latest totals, summed."""
    out: dict[str, Any] = {"seconds": collections.Counter(), "calls": collections.Counter()}
    for path in Path(report_dir).glob("worker-*.json"):
        data = json.loads(path.read_text())
        out["seconds"].update(data["seconds"])
        out["calls"].update(data["calls"])
    return {k: dict(v) for k, v in out.items()}
