"""A source tree of rlcollect with one probe applied, for ``ab_trees.py --before DIR``.

A probe is a small patch in ``probes/`` that instruments or changes one thing of the
library for an experiment and is never merged: it reports a hidden time in a spare
statistic, or forces a setting everywhere. Each says in its comments what it does;
``results/archive/h200/server_step/README.txt`` has what they measured. ::

    python benchmarks/experiments/probe_tree.py step_split .probe   # HEAD's src/ + probe
    python benchmarks/experiments/ab_trees.py --before .probe --suite gpu ...

Probes:
    blocking_wait    the server's wait on the step sleeps (a blocking CUDA event)
    gpu_time         the whole-step replay's GPU time, reported as the "h2d" phase
    compiled_graph   gpu_time, and torch.compile wherever cuda_graph=True
    switch_interval  the GIL's switch interval 0.2 ms from the server thread on
    step_split       wall time of the replay call as "h2d", of the wait as "d2h"
    two_lanes        two batches in flight: whole-step graphs in two lanes (not adopted)
    gpu_nap          the wait on the GPU naps (learned per batch size), then spins (not adopted)
    no_copy          nothing copied out of the ring: batches of garbage (zero-copy's bound)
    spin_response    a worker process polls for its answer before it blocks (SPIN_US env)
    worker_phases    a vector-env worker's receive timed by phase, the request's step too, each
                     worker's sums in $RLCOLLECT_PROBE_DIR/phases-<pid>.json;
                     RLCOLLECT_PROBE_HOST_GATHER=1 has the policy in the worker gather
                     on the host (no page-locked ring)
    row_copy         a vector-env worker with its policy on a GPU has that GPU copy the
                     finished transitions' observations into the chunk (not adopted:
                     results/archive/h200/row_copy/README.txt)
    result_inputs    a vector-env worker with its policy on a GPU copies each result into
                     the policy's page-locked inputs (DMA up, no gather from the cells),
                     checks and stages while the GPU runs (not adopted:
                     results/archive/h200/result_inputs/README.txt)
    worker_sched_other  a worker process that runs its own policy goes back to
                     SCHED_OTHER, its env's threads with it (not yet measured on the H200)
    gil_writes       responses and credits written through libc's write from a
                     ctypes.PyDLL, which keeps the GIL (os.write lets go of it for
                     each answer): experiments/gil_writes.py shows the mechanism

The tree is ``git archive <commit> src`` with the patch applied; a probe that no longer
applies fails here, naming the probe, before any device time is spent. The commit is
HEAD, unless the patch's first line pins the probe to the tree it was built on
(``base: <commit> ...``): a whole feature kept as a probe, such as ``two_lanes``, is
then rebuilt as it was measured, and an A/B takes that commit's ``src/`` as the other
tree.
"""

from __future__ import annotations

import argparse
import io
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROBES = Path(__file__).resolve().parent / "probes"


def names() -> list[str]:
    return sorted(p.stem for p in PROBES.glob("*.patch"))


def base(probe: str) -> str:
    """The commit ``probe`` applies to: its pinned ``base:``, or HEAD.

    Raises:
        ValueError: no such probe.
    """
    patch = PROBES / f"{probe}.patch"
    if not patch.is_file():
        raise ValueError(f"no probe {probe!r}; choose from {names()}")
    with patch.open() as f:
        first = f.readline().split()
    return first[1] if first[:1] == ["base:"] else "HEAD"


def build(probe: str, out: Path, commit: str | None = None) -> Path:
    """Write ``out/src`` (``commit``'s ``src/``, default ``base(probe)``, with ``probe``
    applied) and return ``out``.

    Raises:
        ValueError: no such probe.
        RuntimeError: git cannot archive ``commit``, or the probe does not apply to it.
    """
    commit = base(probe) if commit is None else commit
    patch = PROBES / f"{probe}.patch"
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", "--format=tar", commit, "src"],
        capture_output=True,
        check=False,
    )
    if archive.returncode != 0:
        raise RuntimeError(f"git archive {commit} failed: {archive.stderr.decode().strip()}")
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        tar.extractall(out, filter="data")
    applied = subprocess.run(
        ["patch", "-p1", "--forward", "--batch", "--no-backup-if-mismatch", "-d", str(out)],
        input=patch.read_bytes(),
        capture_output=True,
        check=False,
    )
    if applied.returncode != 0:
        shutil.rmtree(out)
        raise RuntimeError(
            f"probe {probe!r} does not apply to {commit}: update probes/{probe}.patch\n"
            + applied.stdout.decode()
        )
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("probe", choices=names())
    p.add_argument("out", type=Path, help="directory for the tree (replaced if it exists)")
    p.add_argument("--commit", help="default: the probe's pinned base, or HEAD")
    args = p.parse_args()
    commit = base(args.probe) if args.commit is None else args.commit
    try:
        out = build(args.probe, args.out, commit)
    except (ValueError, RuntimeError) as exc:
        sys.exit(str(exc))
    print(f"wrote {out / 'src'} ({commit} + probes/{args.probe}.patch)")


if __name__ == "__main__":
    main()
