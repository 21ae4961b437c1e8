"""The one-call GPU check (issue 59): what anyone who gets a GPU machine runs first.

``benchmarks/gpu_check.sh OUT`` installs the missing packages (wheels in ``.whl/``), then
runs ``python -m benchmarks.check --out OUT``, which runs four parts one after the
other, each in a process group of its own, cut (the whole group killed) when its budget
runs out; a part cut or failed is reported as such and the next one still runs; the
summary is always written, with the measured commit:

1. ``tests``: ``pytest -m cuda tests`` (``-n 4`` where pytest-xdist is installed).
2. ``rows``: the key rows of the throughput, vector and defaults series as one series
   (``series()`` below), each run a fresh process, repeats interleaved, ratios within a
   repeat (``benchmarks/suite/runner.py``): Pong 4x105x80 with 16 and 64 envs (the
   defaults, the best documented layout, the envs alone with a process per core) and
   ale-py's ``AtariVectorEnv`` 64/32 (the env alone, the hand send/recv loop, the
   defaults, ``process_slots`` with the policy in the worker).
3. ``ppo``: ``examples/ppo_atari.py --overlap`` for ``--max-seconds`` from process start:
   Pong training's steps/s, start-up included and after it.
4. ``replay``: ``benchmarks/frame_replay.py --device cuda`` at 100k transitions (issue
   60's GPU sample times; skipped where the tree has no such script).

Budget arithmetic (GPU, a 16-CPU H100 host; ``--deadline-s`` 540, so the call ends
well inside a 10-minute device command):

====================  ========  ==========================================================
part                  budget    expected
====================  ========  ==========================================================
install (the shell)   60 s      about 10 s (7 wheels into ``.site``)
tests                 150 s     about 80 s with ``-n 4``
rows                  the rest  about 170 s a repeat: Pong 5 runs of 9-15 s, the vector
                                env alone and hand loop 17 s each, the two collectors
                                35-40 s each (the vector env is built twice)
ppo                   65 s      ``--max-seconds 50``: about 11 s start-up, then training
replay                45 s      about 25 s: a 1M frame layout, 2 x 100k rows filled, 5
                                rounds of sample(32) and sample(256)
summary               10 s      reserved at the end
====================  ========  ==========================================================

With the tests at 80 s the rows get 540 - 10 - 80 - 65 - 45 - 10 = 330 s (their runs
end 10 s before, for the JSON): about two repeats (the second may lack its last runs)
at windows of 0.3 s warm-up and 1.5 s measured (``--scale 0.6``). A run starts only
where it is expected to end in the part's budget (its last repeat's time), so the
rows' JSON always holds whole runs; three repeats need a second call of the rows alone
(``--only rows --resume OUT/rows.json``: 530 s, three repeats), which measures only the
repeats the first call lacks.

``--dry-run`` runs the same plumbing on a CPU machine: the rows at 2 and 4 Pong envs and
a vector env of 4 sub-envs with the small CNN, tiny windows and two repeats, a tiny PPO
on the CPU, the frame replay at a few thousand rows, and only the CUDA tests of one file
(skipped without a GPU).

Files written to ``OUT`` (at most 8, flat, as a device call brings back):
``summary.md`` (the table, also printed), ``gpu_check.json`` (everything parsed: parts,
the rows' series document, the PPO summary, the replay result), ``rows.json`` (the
series, for ``--resume`` and ``python -m benchmarks report``), ``tests.log``,
``rows.log``, ``ppo.log``, ``replay.log`` and the shell's ``install.log``.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from benchmarks.suite.environment import ROOT

PARTS = ("tests", "rows", "ppo", "replay")
SERIES_NAME = "gpu_check"


@dataclass(frozen=True)
class Budgets:
    """Seconds per part; ``rows`` takes what the others leave."""

    total: float
    tests: float
    ppo: float
    replay: float
    summary: float
    ppo_train: float  # examples/ppo_atari.py --max-seconds
    repeats: int
    scale: float  # of the GPU suite's windows (0.5 s warm-up, 2.5 s measured)


GPU_BUDGETS = Budgets(
    total=540, tests=150, ppo=65, replay=45, summary=10, ppo_train=50, repeats=3, scale=0.6
)
DRY_BUDGETS = Budgets(
    total=480, tests=120, ppo=90, replay=60, summary=10, ppo_train=60, repeats=2, scale=1.0
)


# ------------------------------------------------------------------ the rows


def series(dry: bool, scale: float) -> Any:
    """The check's rows as one series: the defaults series' runs of the GPU workloads
    (``benchmarks/suite/defaults.py``), their loops run by the other series' kinds on
    any device, one envs-alone run for Pong (a process per core: the machine's CPU
    ceiling, the reference of the throughput series), and every ratio the summary shows."""
    from dataclasses import replace

    from benchmarks.suite import plans
    from benchmarks.suite.defaults import (
        _LOOP_KINDS,
        GPU_PONG_DOCUMENTED,
        GPU_VECTOR_DOCUMENTED,
        _workload,
    )

    if dry:
        m = replace(plans.QUICK, warmup_s=0.2 * scale, measure_s=0.5 * scale)
        pong, vector = (2, 4), 4
    else:
        m = plans.machine("gpu", False, scale)
        pong, vector = (16, 64), 64
    layouts = list(GPU_PONG_DOCUMENTED.values())
    workloads = [
        _workload(m, "pong", pong[0], {**layouts[0], "transport": "process_slots"}, ("env_only",)),
        _workload(m, "pong", pong[1], {**layouts[1], "transport": "process_slots"}, ()),
        _workload(
            m, "atari_vector", vector, GPU_VECTOR_DOCUMENTED, ("vector_env_only", "hand_loop")
        ),
    ]
    runs: dict[str, dict[str, Any]] = {}
    ratios: list[tuple[str, str]] = []
    for _, workload_runs, workload_ratios in workloads:
        runs.update(workload_runs)
        ratios += workload_ratios
    for config in runs.values():
        if "loop" in config:  # _workload gives the CPU's plain loops on a CPU
            config["kind"] = _LOOP_KINDS[config["loop"]]
    env_only = f"env_only[pong x{pong[0]}]"
    for kind in ("defaults", "documented"):
        ratios.append((f"{kind}[pong x{pong[1]}]", env_only))
    label = f"atari_vector x{vector}"
    ratios.append((f"hand_loop[{label}]", f"vector_env_only[{label}]"))
    return plans.Series(
        SERIES_NAME,
        "The one-call GPU check's rows: the defaults, the documented layouts, the loops",
        runs,
        tuple(ratios),
        notes=(
            "The defaults series' GPU workloads (benchmarks/suite/defaults.py) without the "
            "AsyncVectorEnv loop; the Pong envs alone once, a process per env at the "
            "smaller count (one per core on the GPU host), against both env counts.",
        ),
    )


def run_rows(args: argparse.Namespace) -> None:
    """The ``rows`` part, in a process of its own: the series within ``--seconds``."""
    from benchmarks.suite.runner import run_series

    stop_at = time.monotonic() + args.seconds
    path = run_series(
        series(args.dry_run, args.scale),
        suite="cpu" if args.dry_run else "gpu",
        repeats=args.repeats,
        out_dir=Path(args.out),
        peers_path=None,
        deadline=None,
        resume=Path(args.resume) if args.resume else None,
        stop_at=stop_at,
    )
    print(f"wrote {path}", flush=True)


# ------------------------------------------------------------------ running a part


def _copy(stream: IO[str], log: IO[str], name: str) -> None:
    for line in stream:
        log.write(line)
        log.flush()
        sys.stdout.write(f"[{name}] {line}")
        sys.stdout.flush()


def _kill_group(proc: subprocess.Popen[str]) -> None:
    """End the part's process group: SIGTERM, then SIGKILL to whatever is left once the
    part's own process has ended (or 5 s have passed)."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        return  # nothing is left of the group
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=5)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=5)


def run_part(name: str, cmd: list[str], seconds: float, log_path: Path) -> dict[str, Any]:
    """Run ``cmd`` in the repository root, in a session of its own, its output to
    ``log_path`` and to this process's stdout; the whole group killed after ``seconds``.

    Returns:
        ``status`` ("ok", "failed" or "cut"), ``returncode``, ``seconds`` and
        ``budget_s``.
    """
    env = dict(os.environ, PYTHONUNBUFFERED="1", TQDM_DISABLE="1")
    started = time.monotonic()
    print(f"== {name}: budget {seconds:.0f} s: {shlex.join(cmd)}", flush=True)
    with log_path.open("w") as log:
        log.write(f"$ {shlex.join(cmd)}\n")
        log.flush()
        proc = subprocess.Popen(
            cmd,
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            text=True,
            errors="replace",
            start_new_session=True,
        )
        assert proc.stdout is not None
        reader = threading.Thread(target=_copy, args=(proc.stdout, log, name), daemon=True)
        reader.start()
        cut = False
        try:
            proc.wait(timeout=max(1.0, seconds))
        except subprocess.TimeoutExpired:
            cut = True
        # Also after a clean exit: a run the suite's runner timed out leaves its workers.
        _kill_group(proc)
        reader.join(timeout=10)
        elapsed = time.monotonic() - started
        if cut:
            log.write(f"\n== cut at its budget of {seconds:.0f} s\n")
    status = "cut" if cut else ("ok" if proc.returncode == 0 else "failed")
    print(f"== {name}: {status} after {elapsed:.0f} s", flush=True)
    return {
        "status": status,
        "returncode": proc.returncode,
        "seconds": elapsed,
        "budget_s": seconds,
    }


# ------------------------------------------------------------------ the parts' commands


def _commands(args: argparse.Namespace, b: Budgets, work: Path) -> dict[str, list[str] | str]:
    """Each part's command, or why it does not run here."""
    py = sys.executable
    commands: dict[str, list[str] | str] = {}
    xdist = importlib.util.find_spec("xdist") is not None
    tests = ["-m", "pytest", "-m", "cuda", "-q", "-p", "no:cacheprovider"]
    if xdist and not args.dry_run:
        tests += ["-n", "4"]
    # the dry run: the plumbing on one file, whose CUDA tests skip without a GPU
    commands["tests"] = [py, *tests, "tests/inference/test_rng.py" if args.dry_run else "tests"]
    rows = [py, "-m", "benchmarks.check", "rows", "--out", str(work / "rows")]
    rows += ["--repeats", str(args.repeats or b.repeats), "--scale", str(args.scale or b.scale)]
    rows += ["--dry-run"] * args.dry_run + ["--resume", args.resume] * bool(args.resume)
    commands["rows"] = rows
    ppo = [py, "examples/ppo_atari.py", "--overlap", "--seed", "1", "--out", str(work / "ppo")]
    ppo += ["--max-seconds", str(b.ppo_train)]
    if args.dry_run:
        ppo += ["--num-envs", "2", "--num-steps", "16", "--num-minibatches", "2"]
        ppo += ["--update-epochs", "1", "--max-episode-frames", "100", "--device", "cpu"]
        ppo += ["--total-timesteps", "256", "--log-every", "0"]
    else:
        ppo += ["--log-every", "5"]
    commands["ppo"] = ppo
    script = ROOT / "benchmarks" / "frame_replay.py"
    if not script.exists():
        commands["replay"] = "benchmarks/frame_replay.py is not in this tree (issue 60)"
    else:
        replay = [py, str(script.relative_to(ROOT)), "--out", str(work / "replay")]
        if args.dry_run:
            replay += ["--device", "cpu", "--capacity", "2048", "--full-capacity", "8192"]
            replay += ["--envs", "4", "--batch", "256", "--rounds", "2", "--seconds", "0.05"]
        else:
            replay += ["--device", "cuda", "--capacity", "100000", "--rounds", "5"]
            replay += ["--seconds", "0.2"]
        commands["replay"] = replay
    return commands


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _results(name: str, work: Path, log: Path) -> Any:
    """What a part left behind, parsed (None where it left nothing)."""
    if name == "tests":
        lines = [line for line in _tail(log) if " in " in line and line[:1].isdigit()]
        return {"summary_line": lines[-1].strip("= \n")} if lines else None
    if name == "rows":
        return _read_json(work / "rows" / f"{SERIES_NAME}.json")
    if name == "ppo":
        found = sorted((work / "ppo").glob("ppo_atari_*.json"))
        run = _read_json(found[-1]) if found else None
        return None if run is None else {"summary": run["summary"], "config": run["config"]}
    return _read_json(work / "replay" / "frame_replay.json")


def _tail(path: Path, lines: int = 40) -> list[str]:
    try:
        return path.read_text(errors="replace").splitlines()[-lines:]
    except OSError:
        return []


# ------------------------------------------------------------------ the whole check


def _budget(name: str, b: Budgets, end: float, chosen: list[str]) -> float:
    """The part's seconds: its own budget (the rows: no limit of their own), within what
    the parts after it and the summary need before ``end``."""
    later = chosen[chosen.index(name) + 1 :]
    reserve = b.summary + sum(getattr(b, part) for part in later if part != "rows")
    left = end - time.monotonic() - reserve
    own = float("inf") if name == "rows" else getattr(b, name)
    return min(own, left)


def check(args: argparse.Namespace) -> int:
    """Run the chosen parts within the deadline, then write and print the summary."""
    from benchmarks.check_summary import write_summary

    b = DRY_BUDGETS if args.dry_run else GPU_BUDGETS
    total = args.deadline_s or b.total
    # The deadline counts from the shell's start (the install), where it says when.
    spent = max(0.0, time.time() - args.started) if args.started else 0.0
    end = time.monotonic() + total - spent
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="gpu_check_"))
    chosen = [p for p in PARTS if p in (args.only or PARTS) and p not in (args.skip or ())]
    commands = _commands(args, b, work)
    parts: dict[str, dict[str, Any]] = {}
    for name in PARTS:
        if name not in chosen:
            parts[name] = {"status": "skipped", "why": "not chosen (--only/--skip)"}
            continue
        command = commands[name]
        if isinstance(command, str):
            parts[name] = {"status": "skipped", "why": command}
            continue
        seconds = _budget(name, b, end, chosen)
        if seconds < (30 if name == "rows" else 5):
            why = f"no time: {max(0, seconds):.0f} s left within the deadline for it"
            parts[name] = {"status": "not run", "why": why}
            continue
        if name == "rows":  # its runs end 10 s before the part's: the JSON is written
            command = [*command, "--seconds", f"{seconds - 10:.0f}"]
        log = out / f"{name}.log"
        parts[name] = run_part(name, command, seconds, log)
        parts[name]["command"] = shlex.join(command)
        parts[name]["result"] = _results(name, work, log)
    rows = parts.get("rows", {}).get("result")
    if rows is not None:
        (out / "rows.json").write_text(json.dumps(rows, indent=1) + "\n")
    parts["install"] = {"status": "ok" if args.install_ok else "failed", "why": args.install}
    return write_summary(out, parts, b, total, dry=args.dry_run)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.check", description=__doc__)
    sub = parser.add_subparsers(dest="command")
    rows = sub.add_parser("rows", help="(internal) the rows part within --seconds")
    rows.add_argument("--out", required=True)
    rows.add_argument("--seconds", type=float, required=True)
    rows.add_argument("--repeats", type=int, required=True)
    rows.add_argument("--scale", type=float, required=True)
    rows.add_argument("--resume")
    rows.add_argument("--dry-run", action="store_true")
    parser.add_argument("--out", default=os.environ.get("OUT") or str(ROOT / "build/gpu_check"))
    parser.add_argument("--dry-run", action="store_true", help="the plumbing on a CPU machine")
    parser.add_argument("--deadline-s", type=float, help="the whole check's seconds")
    parser.add_argument("--only", nargs="+", choices=PARTS, help="run these parts only")
    parser.add_argument("--skip", nargs="+", choices=PARTS, help="leave these parts out")
    parser.add_argument("--repeats", type=int, help="the rows' repeats (3; dry run 2)")
    parser.add_argument("--scale", type=float, help="of the rows' windows (0.6; dry run 1)")
    parser.add_argument("--resume", help="an earlier check's rows.json: measure what it lacks")
    parser.add_argument("--started", type=float, help="epoch seconds the call started")
    parser.add_argument("--install", default="not done here", help="(the shell's note)")
    parser.add_argument("--install-ok", type=int, default=1, help="(the shell's status)")
    args = parser.parse_args(argv)
    if args.command == "rows":
        run_rows(args)
        return 0
    return check(args)


if __name__ == "__main__":
    sys.exit(main())
