"""Two CUDA-graph replays of the policy at once, on two streams: do they overlap?

At 16 Pong envs on the H200 the server thread spends most of its time in the graphed
action step (replay and the one wait), while the GPU runs kernels too small to fill it.
A server with two batches in flight (launch batch n+1 while batch n's graph runs) pays
off only if two replays on two streams take less than twice one. This times, per batch
size, the Nature CNN's graph (page-locked input copied up, replay, outputs copied down,
synchronise) three ways: one replay; two on one stream, back to back; two on two
streams (each graph captured in a memory pool of its own, so they may run together)::

    python benchmarks/experiments/two_streams.py [--iters 200] [--out DIR]

Prints and writes ``two_streams.json``: the median seconds of each, and the ratio of
two streams to one replay (1.0: a second batch is free; 2.0: no overlap at all).
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


class Replay:
    """One captured step on a stream of its own, with its own static buffers and pool."""

    def __init__(self, net: torch.nn.Module, size: int) -> None:
        self.stream = torch.cuda.Stream()
        self.host_in = torch.randint(0, 256, (size, *SHAPE), dtype=torch.uint8).pin_memory()
        self.static_in = torch.zeros((size, *SHAPE), dtype=torch.uint8, device="cuda")
        self.host_action = torch.empty(size, dtype=torch.int64).pin_memory()
        with torch.cuda.stream(self.stream), torch.inference_mode():
            for _ in range(3):
                net(self.static_in)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph, stream=self.stream):
                self.out = net(self.static_in)["action"]
        self.stream.synchronize()

    def launch(self, stream: torch.cuda.Stream | None = None) -> None:
        with torch.cuda.stream(stream or self.stream):
            self.static_in.copy_(self.host_in, non_blocking=True)
            self.graph.replay()
            self.host_action.copy_(self.out, non_blocking=True)


def one(a: Replay, b: Replay) -> None:
    a.launch()
    a.stream.synchronize()


def serial(a: Replay, b: Replay) -> None:  # both on a's stream: b waits for a
    a.launch()
    b.launch(a.stream)
    a.stream.synchronize()


def concurrent(a: Replay, b: Replay) -> None:
    a.launch()
    b.launch()
    a.stream.synchronize()
    b.stream.synchronize()


def timed(fn: Any, iters: int, a: Replay, b: Replay) -> float:
    times = []
    for i in range(iters + 10):
        t0 = time.perf_counter()
        fn(a, b)
        if i >= 10:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--sizes", type=int, nargs="+", default=[1, 4, 8, 16, 32, 64])
    p.add_argument("--out", default="")
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("two_streams.py needs a CUDA device")
    torch.manual_seed(0)
    net = NatureCNN(6).cuda()
    result: dict[str, Any] = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
    for size in args.sizes:
        a, b = Replay(net, size), Replay(net, size)
        row = {name: timed(fn, args.iters, a, b) for name, fn in
               (("one", one), ("two_serial", serial), ("two_streams", concurrent))}  # fmt: skip
        row["two_streams_over_one"] = row["two_streams"] / row["one"]
        result[str(size)] = row
        print(size, {k: round(v * 1e6 if k != "two_streams_over_one" else v, 2)
                     for k, v in row.items()}, flush=True)  # fmt: skip
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "two_streams.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
