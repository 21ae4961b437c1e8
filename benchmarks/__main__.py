"""The benchmark suite's entry point: ``python -m benchmarks cpu|gpu|report``.

::

    python -m benchmarks cpu                  # the CPU suite (about 14 minutes on 2 cores)
    python -m benchmarks cpu --quick          # every series, tiny budgets, one repeat
    python -m benchmarks gpu --part 1 --peers-path .peers --out DIR   # one device call
    python -m benchmarks gpu --part 3 --resume benchmarks/results/suite_gpu --out DIR  # the rest
    python -m benchmarks cpu --series sample_factory --sf-python .peers-sf/bin/python
    python -m benchmarks report               # docs/results.md and its plots from the JSON

Results go to ``benchmarks/results/suite_<suite>/<series>.json`` (``--quick`` writes to
``build/`` instead, so a smoke test never overwrites measured results).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.suite import plans
from benchmarks.suite.environment import ROOT

RESULTS = ROOT / "benchmarks" / "results"
# A GPU call must end within 9 minutes: no run starts after 8, the longest takes < 40 s.
GPU_DEADLINE_S = 480.0
SF_PYTHON = ROOT / ".peers-sf" / "bin" / "python"  # make peers-sf builds it


def _suite(args: argparse.Namespace) -> None:
    from benchmarks.suite.runner import run_series

    names = list(args.series or plans.SERIES)
    if args.part:
        if args.suite != "gpu":
            sys.exit("--part splits the GPU suite into device calls; the CPU suite has none")
        names = list(plans.GPU_PARTS[args.part])
    unknown = sorted(set(names) - set(plans.SERIES))
    if unknown:
        sys.exit(f"unknown series {unknown}; choose from {sorted(plans.SERIES)}")
    if args.suite == "gpu" and not args.quick:
        import torch

        if not torch.cuda.is_available():
            sys.exit("the GPU suite needs a CUDA device (try: python -m benchmarks gpu --quick)")
    machine = plans.machine(args.suite, args.quick, args.scale)
    if args.quick and args.suite == "gpu":
        import torch

        if not torch.cuda.is_available():  # smoke-test the GPU series' code on the CPU
            machine = plans.machine("cpu", True, args.scale)
    repeats = args.repeats if args.repeats is not None else (1 if args.quick else 3)
    default_out = (
        (ROOT / "build" / f"suite_{args.suite}_quick")
        if args.quick
        else (RESULTS / f"suite_{args.suite}")
    )
    if args.busy and not args.out:
        default_out = default_out.with_name(default_out.name + "_busy")
    out = Path(args.out) if args.out else default_out
    peers = args.peers_path
    if peers is None and (ROOT / ".peers").is_dir():
        peers = str(ROOT / ".peers")
    sf_python = args.sf_python
    if sf_python is None and SF_PYTHON.is_file():
        sf_python = str(SF_PYTHON)
    deadline_s = args.deadline_s
    if deadline_s is None and args.suite == "gpu" and not args.quick:
        deadline_s = GPU_DEADLINE_S
    deadline = time.monotonic() + deadline_s if deadline_s else None
    started = time.monotonic()
    busy = _busy(args.busy)
    try:
        for name in names:
            series = plans.SERIES[name](machine)
            path = run_series(
                series,
                suite=args.suite,
                repeats=repeats,
                out_dir=out,
                peers_path=peers or None,
                deadline=deadline,
                resume=(Path(args.resume) / f"{name}.json") if args.resume else None,
                busy=args.busy,
                sf_python=sf_python or None,
            )
            print(f"wrote {path}", flush=True)
    finally:
        for proc in busy:
            proc.kill()
            proc.wait(timeout=10)
    print(f"suite done in {time.monotonic() - started:.0f} s", flush=True)


def _busy(count: int) -> list[subprocess.Popen[bytes]]:
    """``count`` processes that keep a core busy each until killed: the suite measured
    beside other work, both sides of every ratio in the same conditions."""
    spin = "while True: pass"
    return [subprocess.Popen([sys.executable, "-c", spin]) for _ in range(count)]


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks", description=__doc__.split("\n")[0]
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for suite in ("cpu", "gpu"):
        p = sub.add_parser(suite, help=f"run the {suite.upper()} suite")
        p.set_defaults(suite=suite)
        p.add_argument("--quick", action="store_true", help="tiny budgets, one repeat")
        p.add_argument("--series", nargs="+", help=f"a subset of {list(plans.SERIES)}")
        p.add_argument(
            "--part",
            choices=sorted(plans.GPU_PARTS),
            help=f"GPU suite only: one device call's series {plans.GPU_PARTS}",
        )
        p.add_argument("--repeats", type=int, help="fresh-process repeats (default 3)")
        p.add_argument("--out", help="directory for the JSON (default benchmarks/results/...)")
        p.add_argument(
            "--peers-path",
            help="separate install of torchrl 0.14 + tensordict "
            "0.14 (default: .peers if present; '' to skip the TorchRL peer)",
        )
        p.add_argument(
            "--sf-python",
            help="the interpreter of a virtual environment holding sample-factory 2.1.1 "
            "(default: .peers-sf/bin/python if present, built by make peers-sf; '' to skip "
            "the Sample Factory runs)",
        )
        p.add_argument("--scale", type=float, default=1.0, help="multiply the time windows")
        p.add_argument(
            "--busy",
            type=int,
            default=0,
            help="run beside this many CPU-busy processes (results in suite_<suite>_busy/)",
        )
        p.add_argument(
            "--deadline-s",
            type=float,
            help="start no run after this many seconds (JSON marks it incomplete); "
            f"GPU default {GPU_DEADLINE_S:.0f}, 0 for none",
        )
        p.add_argument(
            "--resume",
            metavar="DIR",
            help="keep the runs of each series' JSON in DIR (e.g. benchmarks/results/"
            "suite_gpu) and measure only the repeats it lacks (a series cut short by the "
            "deadline)",
        )
    report = sub.add_parser("report", help="write docs/results.md and its plots from the JSON")
    report.add_argument("--results", default=str(RESULTS), help="directory of suite_* folders")
    report.add_argument("--docs", default=str(ROOT / "docs"), help="the docs directory")
    child = sub.add_parser("child", help=argparse.SUPPRESS)
    child.add_argument("config")
    args = parser.parse_args()

    if args.command == "child":
        from benchmarks.suite.runner import child as run_child

        run_child(args.config)
    elif args.command == "report":
        from benchmarks.suite.report import write_report

        write_report(Path(args.results), Path(args.docs))
    else:
        _suite(args)


if __name__ == "__main__":
    main()
