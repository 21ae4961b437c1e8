"""The ``sample_factory`` series: Sample Factory 2.1.1's sampler beside rlcollect (issue 59).

The same Pong and network in the same run: the envs alone, rlcollect's defaults, its
``"auto"`` layout and its best hand-tuned layout (the throughput series' last
``Machine.tuned`` layout with the server in a process of its own), and Sample Factory's
sampler (``benchmarks/suite/sf_peer.py``) at the same numbers of envs: a worker process
per env (as the collector's defaults), its double buffering at two envs a worker, and
its high-throughput layout, one worker per core with the envs split between them. Every
run against the envs alone, and each rlcollect run against each Sample Factory run.

Sample Factory runs under the interpreter of its own virtual environment
(``--sf-python``; ``make peers-sf`` builds ``.peers-sf``); its runs are skipped, with
the reason, where there is none.
"""

from __future__ import annotations

import os
from typing import Any

from benchmarks.suite.plans import Machine, Series, _execution, _pixel, _rlcollect

ROLLOUT = 32  # Sample Factory's default rollout length (steps per trajectory)


def _divisor_at_most(n: int, most: int) -> int:
    return max(d for d in range(1, max(1, most) + 1) if n % d == 0)


def sf_config(m: Machine, num_envs: int, workers: int, splits: int) -> dict[str, Any]:
    """One Sample Factory run: ``workers`` rollout workers sharing ``num_envs`` envs,
    each worker's envs stepped in ``splits`` alternating halves (its double buffering);
    ``batch_size`` is the collector's ``frames_per_batch`` at that many envs (the learner
    batch the sampler would feed; the sampler alone does not use it)."""
    if num_envs % workers or (num_envs // workers) % splits:
        raise ValueError(
            f"{num_envs} envs do not split into {workers} workers of {splits} equal splits"
        )
    return _pixel(
        m,
        "sample_factory",
        num_envs=num_envs,
        num_workers=workers,
        envs_per_worker=num_envs // workers,
        worker_num_splits=splits,
        rollout=ROLLOUT,
        batch_size=64 * num_envs,
        graph=False,
    )


def sf_name(config: dict[str, Any]) -> str:
    n, w, e, s = (
        config[k] for k in ("num_envs", "num_workers", "envs_per_worker", "worker_num_splits")
    )
    return f"sample_factory[{n} envs, {w} workers x {e}, {s} split{'s' * (s > 1)}]"


def series(m: Machine) -> Series:
    cores = len(os.sched_getaffinity(0))
    n, most = m.num_envs, 4 * m.num_envs
    env_only = f"env_only[{n} procs]"
    runs: dict[str, dict[str, Any]] = {env_only: _pixel(m, "env_only")}

    def ours(name: str, envs: int, epw: int | str, splits: int | str | None, backend: str) -> None:
        _, config = _rlcollect(m, "process_slots", "auto", epw, splits=splits, backend=backend)
        runs[f"rlcollect[{envs} envs, {name}]"] = {
            **config,
            "num_envs": envs,
            "frames_per_batch": 64 * envs,
        }

    ours("defaults", n, 1, None, "thread")
    best_n, epw, splits = m.tuned[-1]
    process = 'inference_backend="process"'
    best = f"envs_per_worker={epw}, worker_splits={splits}, {process}"
    ours(best, best_n, epw, splits, "process")
    ours('envs_per_worker="auto", worker_splits="auto"', most, "auto", "auto", "thread")
    layouts = [(n, n, 1), (n, n // 2, 2), (most, _divisor_at_most(most // 2, cores), 2)]
    if m.quick:  # Sample Factory's own run once: the other series run rlcollect's
        layouts = layouts[1:2]
        runs = {env_only: runs[env_only]}
    sf_runs = [sf_config(m, *layout) for layout in layouts]
    runs.update((sf_name(c), c) for c in sf_runs)
    mine = [r for r in runs if r.startswith("rlcollect")]
    theirs = [r for r in runs if r.startswith("sample_factory")]
    ratios = tuple((r, env_only) for r in runs if r != env_only)
    ratios += tuple((r, s) for r in mine for s in theirs)
    return Series(
        "sample_factory",
        "Sample Factory's sampler beside rlcollect, against the envs' own speed",
        runs,
        ratios,
        notes=(
            f"Pong 4x105x80 uint8 (frame skip 4), {m.policy}; rlcollect "
            f"{_execution(m.graph)}, process_slots, frames_per_batch = 64 x num_envs; Sample "
            "Factory 2.1.1 eager (it has no CUDA graph), in its own virtual environment "
            "(gymnasium 0.29, ale-py 0.9), the same preprocessing rebuilt there.",
            "sample_factory: its SyncSamplingAPI, the sampler without a learner: rollout "
            "worker processes (W workers x E envs, each worker's envs in S alternating "
            f"splits), one inference worker process, {ROLLOUT}-step trajectories copied "
            "out by the driver; its encoder is the acting policy's layers, plus its action "
            "and value heads; its own defaults otherwise (workers pinned to cores).",
            f"{env_only}: each of {n} envs in a process of its own, random actions, no "
            "policy (rlcollect.envspeed.env_throughput): the CPU ceiling of this machine.",
            f"{cores} cores.",
        ),
    )
