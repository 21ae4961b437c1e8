"""Two source trees of rlcollect, A/B, on the cheap-env cases: did a change cost speed?

Runs ``cheap_envs.collector_run`` (``benchmarks/cheap_envs.py``) for each case in fresh
processes, alternating the ``rlcollect`` imported (``--before DIR``: a tree holding
``src/rlcollect``, e.g. ``git archive HEAD src | tar -x -C DIR``; after: this checkout),
the order swapped every round, so both trees see the same machine. Prints each run, then
per case each tree's median frames/s and the median of the per-round after/before ratios.

    python benchmarks/experiments/ab_cheap.py --before .before --rounds 4 \\
        --cases cartpole1 cartpole4 --backend worker
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RUN = """
import json, sys
import torch
sys.path.insert(0, sys.argv[1])
torch.set_num_threads(1)
import cheap_envs
import rlcollect
assert rlcollect.__file__.startswith(sys.argv[2]), rlcollect.__file__
env, n = cheap_envs.CASES[sys.argv[3]]
print(json.dumps(cheap_envs.collector_run(env, n, float(sys.argv[5]), sys.argv[4])))
"""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--before", required=True, help="a tree holding src/rlcollect")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--cases", nargs="+", default=["cartpole1", "cartpole4"])
    p.add_argument("--backend", choices=["thread", "worker"], default="worker")
    p.add_argument("--seconds", type=float, default=3.0)
    args = p.parse_args()
    trees = {"before": Path(args.before).resolve() / "src", "after": ROOT / "src"}
    fps: dict[str, dict[str, list[float]]] = {c: {"before": [], "after": []} for c in args.cases}
    for r in range(args.rounds):
        for case in args.cases:
            order = list(trees.items()) if r % 2 == 0 else list(reversed(trees.items()))
            for name, src in order:
                argv = [str(ROOT / "benchmarks"), str(src), case, args.backend, str(args.seconds)]
                out = subprocess.run(
                    [sys.executable, "-c", RUN, *argv],
                    env={**os.environ, "PYTHONPATH": str(src)},
                    capture_output=True,
                    text=True,
                    timeout=300,
                    check=True,
                )
                result = json.loads(out.stdout.strip().splitlines()[-1])
                fps[case][name].append(result["fps"])
                print(f"round {r} {case:10s} {name:6s} {result['fps']:9.0f} frames/s", flush=True)
    for case, runs in fps.items():
        ratios = [a / b for a, b in zip(runs["after"], runs["before"], strict=True)]
        print(
            f"{case}: before {statistics.median(runs['before']):.0f}, after "
            f"{statistics.median(runs['after']):.0f} frames/s; after/before "
            f"{statistics.median(ratios):.3f} (median of {len(ratios)} rounds)"
        )


if __name__ == "__main__":
    main()
