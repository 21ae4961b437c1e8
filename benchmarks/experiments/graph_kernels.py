"""Where the GPU time of the graphed Nature CNN step goes, and what cuDNN's choices cost.

On the H200 the whole-step graph of the Nature CNN takes 105-140 µs at 1-4 rows
(archive ``h200/server_step``), although the network's arithmetic is a few MFLOP a row,
and the process-backend server spends most of its time waiting on it. This times a
bare captured step (page-locked input up, replay, outputs down, synchronise) per batch
size under four ways of running the convolutions, and lists the kernels of one replay:

* ``default``: as the library captures today (cuDNN's heuristic picks each algorithm);
* ``cudnn_benchmark``: ``torch.backends.cudnn.benchmark`` on while warming up and
  capturing, so cuDNN times its algorithms for each shape and the graph keeps the
  fastest;
* ``channels_last``: the network's weights in channels-last memory format (the
  convolutions then run NHWC);
* ``benchmark_channels_last``: both.

::

    python benchmarks/experiments/graph_kernels.py [--iters 200] [--out DIR]

Prints and writes ``graph_kernels.json``: median seconds end to end and of the replay
alone (CUDA events) per variant and size, and the kernel table (CUDA time per kernel,
from ``torch.profiler``) of 50 replays at ``--profile-size`` rows for two variants.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from policies import NatureCNN

SHAPE = (4, 105, 80)
SIZES = [1, 4, 8, 16, 32, 64]
VARIANTS = {  # name: (cudnn.benchmark while capturing, channels-last weights)
    "default": (False, False),
    "cudnn_benchmark": (True, False),
    "channels_last": (False, True),
    "benchmark_channels_last": (True, True),
}


class Captured:
    """One network captured at one batch size, with its page-locked host buffers."""

    def __init__(self, variant: str, size: int) -> None:
        benchmark, channels_last = VARIANTS[variant]
        torch.manual_seed(0)
        net = NatureCNN(6).cuda()
        if channels_last:
            net = net.to(memory_format=torch.channels_last)
        self.stream = torch.cuda.Stream()
        self.host_in = torch.randint(0, 256, (size, *SHAPE), dtype=torch.uint8).pin_memory()
        self.static_in = torch.zeros((size, *SHAPE), dtype=torch.uint8, device="cuda")
        self.host_action = torch.empty(size, dtype=torch.int64).pin_memory()
        self.host_logp = torch.empty(size, dtype=torch.float32).pin_memory()
        self.start, self.end = (
            torch.cuda.Event(enable_timing=True),
            torch.cuda.Event(enable_timing=True),
        )
        with (
            torch.backends.cudnn.flags(enabled=True, benchmark=benchmark),
            torch.cuda.stream(self.stream),
            torch.inference_mode(),
        ):
            for _ in range(3):
                net(self.static_in)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph, stream=self.stream):
                self.result = net(self.static_in)
        self.stream.synchronize()

    def step(self) -> float:
        """One step end to end; returns the replay's GPU time in seconds."""
        with torch.cuda.stream(self.stream):
            self.static_in.copy_(self.host_in, non_blocking=True)
            self.start.record()
            self.graph.replay()
            self.end.record()
            self.host_action.copy_(self.result["action"], non_blocking=True)
            self.host_logp.copy_(self.result["log_prob"], non_blocking=True)
        self.stream.synchronize()
        return self.start.elapsed_time(self.end) / 1e3


def time_variant(variant: str, iters: int) -> dict[str, dict[int, float]]:
    wall: dict[int, float] = {}
    gpu: dict[int, float] = {}
    for size in SIZES:
        captured = Captured(variant, size)
        walls, gpus = [], []
        for i in range(iters + 10):
            t0 = time.perf_counter()
            g = captured.step()
            if i >= 10:
                walls.append(time.perf_counter() - t0)
                gpus.append(g)
        wall[size], gpu[size] = statistics.median(walls), statistics.median(gpus)
    return {"end_to_end": wall, "replay_gpu": gpu}


def kernel_table(variant: str, size: int) -> list[dict[str, Any]]:
    captured = Captured(variant, size)
    for _ in range(10):
        captured.step()
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(50):
            captured.step()
    rows = []
    for event in prof.key_averages():
        device_us = getattr(event, "device_time_total", 0.0)
        if device_us > 0 and event.count > 0:
            rows.append(
                {"name": event.key[:120], "count": event.count, "us_per_replay": device_us / 50}
            )
    rows.sort(key=lambda r: -r["us_per_replay"])
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--profile-size", type=int, default=16)
    parser.add_argument("--out", type=Path, default=Path("."))
    args = parser.parse_args()
    result: dict[str, Any] = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name()}
    result["variants"] = {}
    for variant in VARIANTS:
        result["variants"][variant] = time_variant(variant, args.iters)
        series = result["variants"][variant]
        print(
            variant,
            {s: f"{1e6 * v:.0f}" for s, v in series["end_to_end"].items()},
            "gpu",
            {s: f"{1e6 * v:.0f}" for s, v in series["replay_gpu"].items()},
            "us",
            flush=True,
        )
    result["kernels"] = {}
    for variant in ("default", "benchmark_channels_last"):
        rows = kernel_table(variant, args.profile_size)
        result["kernels"][variant] = rows
        print(f"kernels of one replay at {args.profile_size} rows, {variant}:")
        for row in rows[:25]:
            print(f"  {row['us_per_replay']:8.1f} us  x{row['count'] / 50:.0f}  {row['name']}")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "graph_kernels.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
