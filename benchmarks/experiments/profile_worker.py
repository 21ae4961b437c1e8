"""Where a Pong worker process spends its CPU beside the env: an experiment, not a figure.

One worker process (``process_slots``) steps ``--envs`` Pong envs (4x105x80 uint8,
``benchmarks/common.py``) in ``--splits`` groups; the policy answers action 0 at once (no
network), so the server's answer comes as fast as it can and the worker's own loop is
what is left. Prints the worker's CPU per frame against the same env stepped alone in a
process of its own (``rlcollect.envspeed.env_throughput``: one busy core per env, so
CPU per frame is 1 / frames per second) and the server's phases per batch. With
``py-spy`` on ``PATH`` it also samples the worker (``--native``) and
prints the share of samples under each function (inclusive), the first ``--top``, from a
second window (sampling slows the worker, so the CPU figures come from the first)::

    python benchmarks/experiments/profile_worker.py [--envs 2] [--splits 2] [--seconds 8]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import make_pong

from rlcollect import AsyncBatchedCollector
from rlcollect.envspeed import env_throughput
from rlcollect.transports import ProcessSlotTransport

_TICK = os.sysconf("SC_CLK_TCK")


class ActionZero(torch.nn.Module):
    def forward(self, observation: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"action": torch.zeros(observation.shape[0], dtype=torch.int64)}


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` (every thread)."""
    with open(f"/proc/{pid}/stat") as f:
        stat = f.read()
    fields = stat[stat.rfind(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / _TICK


def shares(raw: Path, top: int) -> list[tuple[str, float]]:
    """Inclusive share of samples per function from py-spy's ``--format raw`` output."""
    total, under = 0, collections.Counter[str]()
    for line in raw.read_text().splitlines():
        stack, count = line.rsplit(" ", 1)
        total += int(count)
        for name in {frame.split(" (")[0] for frame in stack.split(";")}:
            under[name] += int(count)
    return [(name, n / total) for name, n in under.most_common(top)] if total else []


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--envs", type=int, default=2)
    parser.add_argument("--splits", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--top", type=int, default=30)
    args = parser.parse_args()
    torch.set_num_threads(1)
    alone = env_throughput([make_pong], seconds=args.seconds)
    spy_bin = shutil.which("py-spy")
    transport = ProcessSlotTransport()
    with (
        tempfile.TemporaryDirectory() as tmp,
        AsyncBatchedCollector(
            [make_pong] * args.envs,
            ActionZero(),
            frames_per_batch=64 * args.envs,
            total_frames=-1,
            transport=transport,
            envs_per_worker=args.envs,
            worker_splits=args.splits,
            policy_device="cpu",
        ) as collector,
    ):
        batches = iter(collector)
        for _ in range(3):  # past start-up
            next(batches)
        (pid,) = transport.pids
        # The window first, then the profile: py-spy's sampling slows the worker down.
        server0, cpu0, t0, frames = (
            collector.stats()["server"],
            cpu_seconds(pid),
            time.perf_counter(),
            0,
        )
        while time.perf_counter() - t0 < args.seconds:
            frames += next(batches).numel()
        wall, cpu = time.perf_counter() - t0, cpu_seconds(pid) - cpu0
        server = collector.stats()["server"]
        raw = Path(tmp) / "worker.raw"
        if spy_bin is not None:
            command = [spy_bin, "record", "--pid", str(pid), "--native", "--rate", "400"]
            command += ["--duration", str(int(args.seconds)), "--format", "raw", "-o", str(raw)]
            spy = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            while spy.poll() is None:  # keep collecting while it samples
                next(batches)
        profile = shares(raw, args.top) if raw.exists() else []
    served = server["batches"] - server0["batches"]
    phases = server["phase_seconds"]
    result = {
        "frames_per_second": frames / wall,
        "worker_cpu_ms_per_frame": 1e3 * cpu / frames,
        "env_alone_cpu_ms_per_frame": 1e3 / alone,
        "vs_env_alone": (cpu / frames) * alone,
        "rows_per_batch": (server["rows"] - server0["rows"]) / served,
        "server_us_per_batch": {
            k: 1e6 * (v - server0["phase_seconds"][k]) / served for k, v in phases.items()
        },
    }
    print(json.dumps(result))
    for name, share in profile:
        print(f"{100 * share:5.1f}%  {name}")
    if spy_bin is None:
        print("(py-spy is not on PATH: no profile)")


if __name__ == "__main__":
    main()
