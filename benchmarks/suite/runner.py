"""Runs a suite: every run in a fresh process, repeats interleaved, one JSON per series.

Each run is ``python -m benchmarks child CONFIG`` in the repository root; the child
prints its result as one marked JSON line. Repeat r of every run of a series happens
before repeat r + 1 of any (every other repeat in the reverse order), so slow drift of a
shared machine hits every run alike, and ratios are computed between runs of the same
repeat, then summarised. The JSON is rewritten after every repeat, so a run cut short
keeps what it measured (``complete: false``). A run that fails is recorded with its
error and left out of the summaries; TorchRL runs are skipped with the reason when the
peer install is missing, EnvPool runs where EnvPool does not import, and Sample Factory
runs where its virtual environment (``--sf-python``) is missing: they run under that
interpreter.
"""

from __future__ import annotations

import importlib
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from tqdm import tqdm

from benchmarks.suite.environment import ROOT, environment
from benchmarks.suite.plans import Series
from benchmarks.suite.stats import summarise

MARK = "@@suite-result "
KINDS = {
    "rlcollect": "benchmarks.suite.pixels:run_rlcollect",
    "env_only": "benchmarks.suite.pixels:run_env_only",
    "async_vector": "benchmarks.suite.peers:run_async_vector",
    "atari_vector": "benchmarks.suite.peers:run_atari_vector",
    "envpool_loop": "benchmarks.suite.peers:run_envpool",
    "vector_env_only": "benchmarks.suite.vectors:run_env_only",
    "vector_rlcollect": "benchmarks.suite.vectors:run_rlcollect",
    "torchrl": "benchmarks.suite.torchrl_peer:run_torchrl",
    "dqn_blocking": "benchmarks.suite.dqn_loop:run_blocking",
    "dqn_rlcollect": "benchmarks.suite.dqn_loop:run_rlcollect",
    "async_training": "benchmarks.suite.async_training:run",
    "tuning": "benchmarks.tuning:run",
    "defaults_collector": "benchmarks.suite.defaults:run_collector",
    "plain_loop": "benchmarks.suite.defaults:run_loop",
    "ppo": "benchmarks.suite.defaults:run_ppo",
    "sample_factory": "benchmarks.suite.sf_peer:run_sample_factory",
}
METRICS = (
    "frames_per_second",
    "driver_cpu_ms_per_frame",
    "driver_thread_cpu_ms_per_frame",
    "updates_per_second",
    "startup_seconds",
    "mean_batch_size",
)
_BUSY_NOTE = "Measured beside {} CPU-busy processes (`--busy`), every run alike."
PEER_VERSION = "0.14."  # torchrl and tensordict releases the peer series is written for
SF_VERSION = "2.1.1"  # the Sample Factory release benchmarks/suite/sf_peer.py is written for


def child(config_json: str) -> None:
    """Run one configuration in this (fresh) process and print its result line."""
    config = json.loads(config_json)
    module, function = KINDS[config["kind"]].split(":")
    result = getattr(importlib.import_module(module), function)(config)
    print(MARK + json.dumps(result), flush=True)


def _child_env(config: dict[str, Any], peers_path: str | None) -> dict[str, str]:
    env = dict(os.environ)
    if config["kind"] == "sample_factory":
        # Its own interpreter and packages: nothing of rlcollect's path (its src/ in a
        # development checkout) may shadow them.
        env.pop("PYTHONPATH", None)
        return env
    if config["kind"] == "torchrl" and peers_path:
        # First on the path: its tensordict 0.14 shadows rlcollect's, in this child only.
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(Path(peers_path).resolve()), env.get("PYTHONPATH")) if p
        )
    return env


def peers_problem(peers_path: str | None) -> str | None:
    """Why the TorchRL peer cannot run from ``peers_path``, or None when it can."""
    if not peers_path:
        return "torchrl is not installed: no --peers-path given and no .peers directory"
    probe = "import tensordict, torchrl; print(torchrl.__version__, tensordict.__version__)"
    env = _child_env({"kind": "torchrl"}, peers_path)
    done = subprocess.run(
        [sys.executable, "-c", probe],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    if done.returncode != 0:
        return f"torchrl does not import from {peers_path}: {done.stderr.strip()[-300:]}"
    versions = done.stdout.split()
    if not all(v.startswith(PEER_VERSION) for v in versions):
        return f"torchrl/tensordict {versions} found, the peer series needs {PEER_VERSION}x"
    return None


def sf_problem(sf_python: str | None) -> str | None:
    """Why Sample Factory's runs cannot run under ``sf_python`` (the interpreter of its
    virtual environment), or None when they can."""
    if not sf_python:
        return (
            "sample-factory is not installed: no --sf-python given and no .peers-sf "
            "(make peers-sf builds it)"
        )
    if not Path(sf_python).is_file():
        return f"--sf-python {sf_python} is not a file (make peers-sf builds .peers-sf)"
    probe = (
        "import ale_py, gymnasium, sample_factory; from importlib.metadata import version; "
        "print(version('sample-factory'))"
    )
    try:
        done = subprocess.run(
            [sf_python, "-c", probe],
            cwd=ROOT,
            env=_child_env({"kind": "sample_factory"}, None),
            capture_output=True,
            text=True,
            timeout=120,
        )
    except OSError as exc:
        return f"--sf-python {sf_python} does not run: {exc}"
    if done.returncode != 0:
        return f"sample_factory does not import under {sf_python}: {done.stderr.strip()[-300:]}"
    found = done.stdout.strip().splitlines()[-1:] or ["nothing"]
    if found[0] != SF_VERSION:
        return f"sample-factory {found[0]} found, the series needs {SF_VERSION}"
    return None


def needs_envpool(config: dict[str, Any]) -> bool:
    """True for a run over EnvPool's pools (``vectors.py``: ``vector_source``): optional."""
    return config["kind"] == "envpool_loop" or config.get("vector_source") == "envpool"


def envpool_problem() -> str | None:
    """Why EnvPool cannot run here (it does not import), or None when it can. Asked of a
    fresh process, as a run would import it, and only where a series has such runs."""
    probe = "import envpool; print(envpool.__version__)"
    done = subprocess.run(
        [sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    if done.returncode != 0:
        why = done.stderr.strip().splitlines()[-1:] or [f"exit status {done.returncode}"]
        return f"envpool does not import (pip install rlcollect[envpool]): {why[0][-300:]}"
    return None


def _machine_busy_seconds() -> float:
    """CPU seconds the whole machine has been busy (user, nice, system, irq, softirq)."""
    values = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:8]]
    return (values[0] + values[1] + values[2] + values[5] + values[6]) / os.sysconf("SC_CLK_TCK")


def _children_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def fresh(
    config: dict[str, Any], peers_path: str | None, timeout: float, sf_python: str | None = None
) -> dict[str, Any]:
    """Run ``config`` in a fresh process; its result, or ``{"error": ...}``. Sample
    Factory's runs (``kind`` "sample_factory") run under ``sf_python``, the others under
    this interpreter.

    Also records how much of the machine other work took meanwhile: the machine's busy
    CPU time over the run minus the run's own (the child and every descendant it
    reaped), as a share of the run's wall time on all CPUs. On a shared machine that
    share says how far to trust the figure.
    """
    python = sf_python if config["kind"] == "sample_factory" and sf_python else sys.executable
    cmd = [python, "-m", "benchmarks", "child", json.dumps(config)]
    load = os.getloadavg()[0]
    busy0, own0 = _machine_busy_seconds(), _children_seconds()
    started = time.perf_counter()
    result: dict[str, Any]
    try:
        done = subprocess.run(
            cmd,
            cwd=ROOT,
            env=_child_env(config, peers_path),
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired as exc:
        result = {"error": f"timed out after {timeout:.0f} s", "stderr": str(exc.stderr)[-2000:]}
    else:
        result = {"error": f"exit status {done.returncode}, no result line"}
        for line in done.stdout.splitlines():
            if line.startswith(MARK):
                result = json.loads(line[len(MARK) :])
        if "error" in result:
            result["stderr"] = done.stderr[-2000:]
    wall = time.perf_counter() - started
    others = (_machine_busy_seconds() - busy0) - (_children_seconds() - own0)
    result["process_seconds"] = wall
    result["loadavg_1min_before"] = load
    result["other_cpu_share"] = max(0.0, others) / (wall * (os.cpu_count() or 1))
    return result


def _summary(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    summary: dict[str, Any] = {}
    for name, results in runs.items():
        ok = [r for r in results if "error" not in r]
        row: dict[str, Any] = {"repeats": len(ok), "failures": len(results) - len(ok)}
        for metric in METRICS:
            values = [r[metric] for r in ok if r.get(metric) is not None]
            if values:
                row[metric] = summarise(values)
        summary[name] = row
    return summary


def _ratios(series: Series, runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for top, bottom in series.ratios:
        if top not in runs or bottom not in runs:
            continue
        per_repeat = [
            a["frames_per_second"] / b["frames_per_second"]
            for a, b in zip(runs[top], runs[bottom], strict=False)
            if "error" not in a and "error" not in b
        ]
        if per_repeat:
            out[f"{top} / {bottom}"] = {
                "numerator": top,
                "denominator": bottom,
                "per_repeat": per_repeat,
                **summarise(per_repeat),
            }
    return out


def _expected_seconds(runs: dict[str, list[dict[str, Any]]], name: str) -> float:
    """How long the next run of ``name`` is expected to take: its last run's seconds, or
    the longest run so far where it has none (0 before the first)."""
    if runs[name]:
        return float(runs[name][-1]["process_seconds"])
    return max((r["process_seconds"] for rs in runs.values() for r in rs), default=0.0)


def run_series(
    series: Series,
    *,
    suite: str,
    repeats: int,
    out_dir: Path,
    peers_path: str | None,
    deadline: float | None,
    resume: Path | None = None,
    busy: int = 0,
    stop_at: float | None = None,
    sf_python: str | None = None,
) -> Path:
    """Measure ``series`` and write ``out_dir / <name>.json``; returns its path.

    With ``resume`` (an earlier, incomplete JSON of the same series), the runs it holds
    are kept and only the missing repeats are measured, in the same interleaved order;
    its environment stays the record's and this call's is added under ``resumed``.
    ``busy``: how many CPU-busy processes ran beside it (recorded, and said in a note).
    ``stop_at`` (a ``time.monotonic()`` time): no run may end after it. A run starts only
    where it is expected to end before it (its own duration in the previous repeat; in
    the first, the longest run so far) and is killed there, so the JSON is written in
    time (the one-call GPU check, ``benchmarks/check.py``). ``sf_python``: the
    interpreter of Sample Factory's virtual environment, for its runs.
    """
    skipped: dict[str, str] = {}
    configs = dict(series.runs)
    if any(c["kind"] == "torchrl" for c in configs.values()):
        problem = peers_problem(peers_path)
        if problem:
            for name in [n for n, c in configs.items() if c["kind"] == "torchrl"]:
                skipped[name] = problem
                del configs[name]
    if any(c["kind"] == "sample_factory" for c in configs.values()):
        problem = sf_problem(sf_python)
        if problem:
            for name in [n for n, c in configs.items() if c["kind"] == "sample_factory"]:
                skipped[name] = problem
                del configs[name]
    if any(needs_envpool(c) for c in configs.values()):
        problem = envpool_problem()
        if problem:
            for name in [n for n, c in configs.items() if needs_envpool(c)]:
                skipped[name] = problem
                del configs[name]
    env = environment(peers_path)
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in configs}
    resumed: list[dict[str, Any]] = []
    seconds_before = 0.0
    if resume is not None:
        earlier = json.loads(resume.read_text())
        same = earlier["configs"] == json.loads(json.dumps(configs))  # tuples read as lists
        if earlier["series"] != series.name or not same:
            raise ValueError(f"{resume} holds another series or configuration than {series.name}")
        runs = {name: list(earlier["runs"].get(name, [])) for name in configs}
        resumed = [*earlier.get("resumed", []), env]
        env = earlier["environment"]
        seconds_before = earlier["seconds"]
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{series.name}.json"
    started = time.time()
    complete = True
    bar = tqdm(total=repeats * len(configs), desc=series.name, unit="run")
    for rep in range(repeats):
        # Every other repeat in reverse: no run always follows the same neighbour (a
        # machine warmed or loaded by the run before would favour one side of a ratio).
        order = list(configs.items())
        for name, config in order if rep % 2 == 0 else order[::-1]:
            bar.update()
            if len(runs[name]) > rep:
                continue  # measured by the call this one resumes
            if deadline is not None and time.monotonic() > deadline:
                complete = False
                break
            timeout = config["warmup_s"] + config["measure_s"] + 300
            if stop_at is not None:
                left = stop_at - time.monotonic()
                if left < _expected_seconds(runs, name):
                    complete = False
                    break
                timeout = min(timeout, left)
            result = fresh(config, peers_path, timeout, sf_python)
            runs[name].append(result)
            shown = result.get("error") or f"{result['frames_per_second']:,.0f} frames/s"
            tqdm.write(
                f"[{series.name} {rep + 1}/{repeats}] {name}: {shown} "
                f"({result['process_seconds']:.1f} s)"
            )
        document = {
            "suite": suite,
            "series": series.name,
            "title": series.title,
            "notes": list(series.notes) + [_BUSY_NOTE.format(busy)] * bool(busy),
            "busy_processes": busy,
            "environment": env,
            "resumed": resumed,
            "loadavg_at_end": list(os.getloadavg()),
            "seconds": seconds_before + time.time() - started,
            "repeats": repeats,
            "complete": complete and rep == repeats - 1,
            "configs": configs,
            "skipped": skipped,
            "summary": _summary(runs),
            "ratios": _ratios(series, runs),
            "runs": runs,
        }
        path.write_text(json.dumps(document, indent=1) + "\n")
        if not complete:
            break
    bar.close()
    return path
