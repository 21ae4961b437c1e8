"""The defaults series' CartPole workloads, short: the collector with no layout
arguments from one or more source trees, against the plain loops, interleaved.

Each round runs, in fresh processes and in turn (the order reversed every other round),
the defaults collector of every ``--src`` tree and the loops a user would write instead
(the plain env loop for one env, the ``SyncVectorEnv`` and ``AsyncVectorEnv`` loops):
the same runs, policy and windows as ``python -m benchmarks cpu --series defaults``
(``suite/defaults.py``). Ratios are taken within each round against the best loop of
that round, then their median; on a shared machine only they mean anything.

::

    python benchmarks/defaults_pairs.py --envs 1 4 --rounds 5 --src /tmp/before/src src
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.suite.runner import MARK  # noqa: E402

RESULT = ROOT / "benchmarks" / "results" / "defaults_pairs.json"


def _run(config: dict[str, Any], src: str) -> dict[str, Any]:
    """One run in a fresh process, rlcollect imported from ``src``."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join((str(Path(src).resolve()), str(ROOT))))
    cmd = [sys.executable, "-m", "benchmarks", "child", json.dumps(config)]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    for line in done.stdout.splitlines():
        if line.startswith(MARK):
            result: dict[str, Any] = json.loads(line[len(MARK) :])
            result["loadavg_1min"] = os.getloadavg()[0]
            return result
    raise RuntimeError(f"{config['kind']} from {src} failed:\n{done.stderr[-3000:]}")


def _workload(n: int, rounds: int, trees: list[str]) -> dict[str, Any]:
    base = {
        "device": "cpu",
        "warmup_s": 0.5,
        "measure_s": 2.0,
        "env": "cartpole",
        "num_envs": n,
        "frames_per_batch": 1024,
        "policy": "small_cnn",
        "graph": False,
    }
    loops = ["plain_env_loop"] * (n == 1) + ["sync_vector_loop", "async_vector_loop"]
    runs = {
        f"defaults[{src}]": ({**base, "kind": "defaults_collector", "args": {}}, src)
        for src in trees
    }
    for loop in loops:
        runs[loop] = ({**base, "kind": "plain_loop", "loop": loop}, trees[-1])
    results: dict[str, list[dict[str, Any]]] = {name: [] for name in runs}
    for r in range(rounds):
        for name in list(runs)[:: -1 if r % 2 else 1]:
            config, src = runs[name]
            results[name].append(_run(config, src))
            fps = results[name][-1]["frames_per_second"]
            print(f"CartPole x{n} round {r}: {name} {fps:,.0f} frames/s", flush=True)
    best = [max(results[loop][r]["frames_per_second"] for loop in loops) for r in range(rounds)]
    summary = {}
    for name in runs:
        fps = [x["frames_per_second"] for x in results[name]]
        ratios = [f / b for f, b in zip(fps, best, strict=True)]
        summary[name] = {
            "median_frames_per_second": statistics.median(fps),
            "ratio_to_best_loop": statistics.median(ratios),
            "ratios": ratios,
            "rules": [x.get("rule") for x in results[name]],
        }
        print(f"CartPole x{n}: {name}: {statistics.median(ratios):.2f}x the best loop {ratios}")
    return {"runs": results, "summary": summary}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--envs", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--src", nargs="+", default=[str(ROOT / "src")], help="source trees")
    parser.add_argument("--out", type=Path, default=RESULT)
    args = parser.parse_args()
    started = time.strftime("%Y-%m-%d %H:%M")
    out = {
        "started": started,
        "command": " ".join(sys.argv),
        "loadavg_at_start": os.getloadavg(),
        "workloads": {f"cartpole x{n}": _workload(n, args.rounds, args.src) for n in args.envs},
    }
    args.out.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
