"""Two source trees of rlcollect, A/B, interleaved in one run: did a change cost speed?

Runs configurations of a suite series (``benchmarks/suite/plans.py``) in fresh
processes, alternating the ``rlcollect`` package imported (``--before DIR``: a tree with
``src/rlcollect``, e.g. ``git archive HEAD~3 src | tar -x -C DIR``; after: this
checkout, or ``--after DIR``), round after round, so both trees see the same machine.
Reports each tree's median frames/s and the median of the per-round after/before ratios.

    python benchmarks/experiments/ab_trees.py --before .before --suite gpu \\
        --series pixels --configs 'pixels[process_slots-chunk1-graph]' --rounds 3 \\
        --out results.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.suite import plans  # noqa: E402
from benchmarks.suite.runner import fresh  # noqa: E402

_ALSO = (
    "request_latency_p50",
    "request_latency_p95",
    "mean_batch_size",
    "server_phase_seconds",
    "driver_cpu_ms_per_frame",
    "driver_thread_cpu_ms_per_frame",
    "batches",
    "overlapped_batches",
    "gpu_wait",
    "ring_batches",
    "place_wait_seconds",
)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--before", required=True, help="a tree holding src/rlcollect")
    p.add_argument("--after", help="a tree holding src/rlcollect (default: this checkout)")
    p.add_argument("--suite", choices=["cpu", "gpu"], default="cpu")
    p.add_argument("--series", default="pixels")
    p.add_argument("--configs", nargs="*", help="names in the series (default: all)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--scale", type=float, default=1.0, help="multiplies the time windows")
    p.add_argument("--out", required=True)
    args = p.parse_args()

    series = plans.SERIES[args.series](plans.machine(args.suite, False, args.scale))
    names = args.configs or list(series.runs)
    unknown = sorted(set(names) - set(series.runs))
    if unknown:
        sys.exit(f"unknown configs {unknown}; choose from {sorted(series.runs)}")
    after = Path(args.after).resolve() if args.after else ROOT
    trees = {"before": Path(args.before).resolve() / "src", "after": after / "src"}
    site = os.environ.get("PYTHONPATH", "")
    fps: dict[str, dict[str, list[float]]] = {n: {"before": [], "after": []} for n in names}
    # what else a run reports, where it does: the request's round trip, batch, driver CPU
    seen: dict[str, dict[str, list[dict[str, Any]]]] = {
        n: {"before": [], "after": []} for n in names
    }
    for r in range(args.rounds):
        for name in names:
            # Alternate which tree goes first, so neither always runs on a warmer machine.
            order = ("before", "after") if r % 2 == 0 else ("after", "before")
            for tree in order:
                os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(trees[tree]), site) if p)
                result = fresh(series.runs[name], None, timeout=300)
                value = result.get("frames_per_second")
                if value is None:
                    sys.exit(f"{name} [{tree}] failed: {result}")
                fps[name][tree].append(value)
                seen[name][tree].append({k: result.get(k) for k in _ALSO})
                p50 = result.get("request_latency_p50") or 0.0
                print(
                    f"[round {r + 1}] {name} {tree}: {value:,.0f} frames/s, "
                    f"request p50 {1e6 * p50:.0f} us",
                    flush=True,
                )
    os.environ["PYTHONPATH"] = site
    summary = {}
    for name, runs in fps.items():
        ratios = [a / b for a, b in zip(runs["after"], runs["before"], strict=True)]
        summary[name] = {
            "before_median": statistics.median(runs["before"]),
            "after_median": statistics.median(runs["after"]),
            "ratio_median": statistics.median(ratios),
            "ratios": ratios,
            "before": runs["before"],
            "after": runs["after"],
            "reported": seen[name],
        }
        print(
            f"{name}: after/before {statistics.median(ratios):.3f} (rounds: "
            + ", ".join(f"{x:.3f}" for x in ratios)
            + ")",
            flush=True,
        )
    out = {"suite": args.suite, "series": args.series, "rounds": args.rounds, "summary": summary}
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
