"""Run one experiment on a given rlcollect source tree; keep its output; print one line.

Device calls compare trees (HEAD against a copy with one change, or an older commit):
each run imports ``rlcollect`` from ``--tree`` (a directory that holds ``rlcollect/``,
e.g. ``.before/src``, put first on ``PYTHONPATH``), writes its output to
``OUT/NAME.log`` and its JSON to ``OUT/NAME/``, and this prints one line: the name, the
exit status and the run's headline figures (``HEADLINES``). A call's script is then one
line per run, and what it measured is in its output at once::

    python benchmarks/experiments/on_tree.py --tree .before/src --name before_1 --out OUT \\
        --timeout 120 interleaved_vector.py --envs 64 --batch 32 --threads 16 --cycles 8

A run that fails or outlives ``--timeout`` prints its status and the end of its log,
and the next run goes on; this exits with the run's status.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def _interleaved(report: dict[str, Any]) -> str:
    s = report["summary"]
    return (
        f"collector/hand_loop {s['collector/hand_loop']['median']:.3f} "
        f"collector/env_only {s['collector/env_only']['median']:.3f} "
        f"hand_loop/env_only {s['hand_loop/env_only']['median']:.3f} "
        f"ahead {s['collector_ahead_of_hand_loop']} of {s['cycles']}"
    )


def _profile(report: dict[str, Any]) -> str:
    parts = []
    for name, runs in report.items():
        if name in ("config", "machine"):
            continue
        last = runs[-1]
        steps = last.get("worker_us_per_batch") or {}
        shown = " ".join(
            f"{k} {steps[k]:.0f}"
            for k in ("recv", "recv_queued", "recv_to_send", "send_to_recv")
            if k in steps
        )
        parts.append(f"[{name}: fps {last['fps']:.0f}{' ' + shown if shown else ''}]")
    return " ".join(parts)


def _server_nice(report: dict[str, Any]) -> str:
    ratios = next(v for k, v in report.items() if k.startswith("fps_nice"))
    waits = {n: s["server_wait_ms_per_s"] for n, s in report["summary"].items()}
    shown = " ".join(f"wait@{n} {w:.0f}ms/s" for n, w in waits.items())
    return f"pairs median {ratios['median']:.3f} {shown}"


# The JSON each experiment writes under its --out, and its figures worth a line.
HEADLINES: dict[str, tuple[str, Callable[[dict[str, Any]], str]]] = {
    "interleaved_vector.py": ("interleaved_vector.json", _interleaved),
    "profile_vector_worker.py": ("profile_vector_worker.json", _profile),
    "server_nice.py": ("server_nice.json", _server_nice),
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tree", required=True, help="a directory holding rlcollect/")
    p.add_argument("--name", required=True, help="the run's name: OUT/NAME.log, OUT/NAME/")
    p.add_argument("--out", required=True)
    p.add_argument("--timeout", type=float, default=300.0, help="seconds the run may take")
    p.add_argument("script", choices=sorted(HEADLINES), help="an experiment of this folder")
    p.add_argument("args", nargs=argparse.REMAINDER, help="the experiment's own options")
    args = p.parse_args()
    tree = Path(args.tree).resolve()
    if not (tree / "rlcollect" / "__init__.py").is_file():
        p.error(f"--tree {args.tree}: no rlcollect/__init__.py there (pass the src/ folder)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(tree), env.get("PYTHONPATH")]))
    command = [sys.executable, str(HERE / args.script), *args.args, "--out", str(out / args.name)]
    log = out / f"{args.name}.log"
    with log.open("w") as f:
        # A session of its own: on a timeout the run's worker processes go with it.
        run = subprocess.Popen(
            command, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        try:
            rc = run.wait(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            os.killpg(run.pid, signal.SIGKILL)
            run.wait(timeout=60)
            rc = 124  # as timeout(1) reports it
    if rc != 0:
        tail = log.read_text(errors="replace").splitlines()[-5:] or ["(no output)"]
        print(f"{args.name} rc={rc} (log {log}):", *tail, sep="\n  ", flush=True)
        sys.exit(rc)
    filename, headline = HEADLINES[args.script]
    report = json.loads((out / args.name / filename).read_text())
    print(f"{args.name} rc=0 {headline(report)}", flush=True)


if __name__ == "__main__":
    main()
