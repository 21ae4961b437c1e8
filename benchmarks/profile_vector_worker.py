"""Where a vector-env worker's time goes: its loop's steps timed, beside the hand loop.

Runs ``benchmarks/atari_throughput.py``'s configuration with the thread transport and
wraps the vector worker's steps (``act`` = send + recv, ``receive``, ``finish``,
``request``, ``wait_response``, ``wait_slot``) in timers, so the critical path from a
``recv`` returning to the next ``send`` can be read off per batch. The wrapping costs
a few microseconds per call; the figures are for finding the cost, not for quoting
throughput (``atari_throughput.py`` does that)::

    python benchmarks/profile_vector_worker.py --envs 64 --batch 32 --threads 16 --out DIR
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import atari_throughput as at

import rlcollect.collector.vector_worker as vw

TIMES: dict[str, float] = collections.defaultdict(float)
CALLS: collections.Counter[str] = collections.Counter()


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
    vw._VectorLoop.receive = _wrap(vw._VectorLoop.receive, "receive")  # type: ignore[method-assign]
    vw._VectorLoop.finish = _wrap(vw._VectorLoop.finish, "finish")  # type: ignore[method-assign]
    vw._VectorEnvDriver.act = _wrap(vw._VectorEnvDriver.act, "act")  # type: ignore[method-assign]
    init = vw._VectorLoop.__init__

    def patched(self: Any, end: Any, spec: Any, envs: Any) -> None:
        init(self, end, spec, envs)
        for name in ("wait_response", "wait_slot", "request", "hand_over"):
            setattr(end, name, _wrap(getattr(end, name), name))

    vw._VectorLoop.__init__ = patched  # type: ignore[method-assign]


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
    instrument()
    report: dict[str, Any] = {"config": vars(args)}
    report["env_only"] = at.env_only(args, 1)
    report["hand_loop"] = at.hand_loop(args, device, 1)
    for interval in [float(x) for x in args.switch_intervals.split(",")]:
        sys.setswitchinterval(interval)
        TIMES.clear()
        CALLS.clear()
        result = at.collector(args, device, "thread", 1, one_worker=False)
        total = max(CALLS["act"], 1)
        result["worker_us_per_batch"] = {k: 1e6 * v / total for k, v in TIMES.items()}
        result["worker_calls"] = dict(CALLS)
        report[f"thread-1x switch={interval}"] = result
        print(json.dumps({k: result[k] for k in ("fps", "worker_us_per_batch")}, indent=1))
    sys.setswitchinterval(0.005)
    print(json.dumps(report, indent=1, default=str))
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "profile_vector_worker.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
