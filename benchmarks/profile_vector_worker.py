"""Where a vector-env worker's time goes: its loop's steps timed, beside the hand loop.

Runs ``benchmarks/atari_throughput.py``'s configuration with one worker and wraps the
vector worker's steps (``act`` = send + recv, ``receive``, ``finish``, ``request``,
``wait_response``, ``wait_slot``, ``hand_over``) in timers
(``benchmarks/vector_worker_timers.py``), so the critical path from a ``recv``
returning to the next ``send`` can be read off per batch: a thread worker at each
``--switch-intervals`` value, then a worker process (its env factory installs the
timers there and reports their totals through a file). The wrapping costs a few
microseconds per call; the figures are for finding the cost, not for quoting
throughput (``atari_throughput.py`` does that)::

    python benchmarks/profile_vector_worker.py --envs 64 --batch 32 --threads 16 --out DIR
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import atari_throughput as at
import vector_worker_timers as timers


class Marks:
    """The timers' totals at the start and the end of a collector's timed window."""

    def __init__(self, read: Callable[[], dict[str, Any]]) -> None:
        self.read = read
        self.at: dict[str, Any] = {}

    def __call__(self, when: str) -> None:
        self.at[when] = self.read()

    def per_batch(self) -> dict[str, float]:
        return timers.per_batch(self.at["start"], self.at["end"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--envs", type=int, default=64)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--threads", type=int, default=16)
    p.add_argument("--seconds", type=float, default=5.0)
    p.add_argument("--warmup", type=float, default=1.5)
    p.add_argument("--frames-per-batch", type=int, default=1024)
    p.add_argument("--switch-intervals", default="0.005,0.0005")
    p.add_argument("--policy", choices=["nature_cnn", "noop"], default="nature_cnn")
    p.add_argument("--env-nice", type=int, default=0)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    args.repeats = 1
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    timers.instrument()
    report: dict[str, Any] = {"config": vars(args)}
    report["env_only"] = at.env_only(args, 1)
    report["hand_loop"] = at.hand_loop(args, device, 1)
    for interval in [float(x) for x in args.switch_intervals.split(",")]:
        sys.setswitchinterval(interval)
        marks = Marks(timers.totals)
        result = at.collector(args, device, "thread", 1, one_worker=False, on_window=marks)
        result["worker_us_per_batch"] = marks.per_batch()
        report[f"thread-1x switch={interval}"] = result
        print(json.dumps({k: result[k] for k in ("fps", "worker_us_per_batch")}, indent=1))
    sys.setswitchinterval(0.005)
    # A worker may write its last report while the collector shuts down: leftovers
    # there are of no use, and must not fail the run.
    with tempfile.TemporaryDirectory(ignore_cleanup_errors=True) as reports:
        n, b, t = at.vector_config(args, 1)
        marks = Marks(functools.partial(timers.read_workers, reports))
        factory = timers.TimedAtariVector(n, b, t, args.env_nice, reports)
        result = at.collector(
            args, device, "process_slots", 1, one_worker=False, factory=factory, on_window=marks
        )
        result["worker_us_per_batch"] = marks.per_batch()
        report["process_slots-1x"] = result
        print(json.dumps({k: result[k] for k in ("fps", "worker_us_per_batch")}, indent=1))
    print(json.dumps(report, indent=1, default=str))
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "profile_vector_worker.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
