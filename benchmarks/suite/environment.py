"""What a result was measured on: machine, load, versions, code revision, date."""

from __future__ import annotations

import importlib.metadata
import os
import platform
import subprocess
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = (
    "rlcollect",
    "torch",
    "numpy",
    "gymnasium",
    "ale-py",
    "envpool",  # optional: None where it is not installed
    "tensordict",
    "matplotlib",
)


def _version(name: str, path: list[str] | None = None) -> str | None:
    found = importlib.metadata.distributions(name=name, path=path) if path else None
    if found is not None:
        for dist in found:
            return str(dist.version)
        return None
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _git(*args: str) -> str | None:
    try:
        done = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def _gpu() -> dict[str, Any] | None:
    import torch

    if not torch.cuda.is_available():
        return None
    return {
        "name": torch.cuda.get_device_name(),
        "count": torch.cuda.device_count(),
        "cuda": torch.version.cuda,
    }


def environment(peers_path: str | None) -> dict[str, Any]:
    """The machine, its load, the package versions and the code revision, now.

    Args:
        peers_path: the separate install directory of the peer libraries (torchrl and
            its tensordict), or None; their versions are read from there.
    """
    import torch

    versions = {name: _version(name) for name in PACKAGES}
    if peers_path:
        versions["torchrl (peers)"] = _version("torchrl", [peers_path])
        versions["tensordict (peers)"] = _version("tensordict", [peers_path])
    # A copied working tree (as on a remote benchmark machine) may carry a stale .git;
    # the caller can then name the revision it copied.
    named = os.environ.get("RLCOLLECT_BENCH_COMMIT")
    commit = named or _git("rev-parse", "HEAD")
    status = None if named else _git("status", "--porcelain", "--untracked-files=no")
    return {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_model": _cpu_model(),
        "cpus": os.cpu_count(),
        "cpu_affinity": len(os.sched_getaffinity(0)),
        "loadavg_at_start": list(os.getloadavg()),
        "torch_threads": torch.get_num_threads(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "gpu": _gpu(),
        "versions": versions,
        "git_commit": commit,
        "git_dirty": bool(status) if status is not None else None,
    }
