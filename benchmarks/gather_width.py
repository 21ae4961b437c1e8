"""The GPU gather out of the page-locked ring, by the width of the integers it reads.

The inference server gathers a batch's observations on the GPU straight out of the
ring in host memory (``rlcollect/inference/step.py``): one ``index_select`` reading
rows over the bus. This times that kernel for Pong frame stacks (4x84x84 uint8) read
as 1-, 2-, 4- and 8-byte integers, beside the alternative of gathering on the CPU into
page-locked memory and copying that up in one transfer. Each gather is timed on rows
at rest and on rows the CPU has just rewritten ("fresh"), as a worker writes its
request's observations just before the server gathers them. Per batch size, the median
of ``--iterations`` calls: GPU time between events, and for the host gather also its
CPU time (``np.take``), which the server thread spends on the critical path::

    python benchmarks/gather_width.py --out DIR   # needs CUDA
"""

from __future__ import annotations

import argparse
import functools
import json
import mmap
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine

SHAPE = (4, 84, 84)
ROW_BYTES = int(np.prod(SHAPE))


class MappedHostArray:
    """A page-locked, mapped host array presented to torch as CUDA memory (unified
    addressing), as the inference server views the ring: ``torch.as_tensor`` of it on
    the GPU reads the host rows over the bus."""

    def __init__(self, array: np.ndarray) -> None:
        self.__cuda_array_interface__ = {
            "shape": array.shape,
            "typestr": array.dtype.str,
            "data": (array.ctypes.data, False),
            "version": 3,
        }


def gpu_ms(fn: Any, iterations: int, stream: torch.cuda.Stream, before: Any = None) -> float:
    """Median GPU milliseconds of ``fn`` on ``stream`` (``before`` runs untimed first)."""
    times = []
    for _ in range(iterations):
        if before is not None:
            before()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(stream):
            start.record()
            fn()
            end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=256, help="rows of the ring")
    p.add_argument("--batches", default="8,32,128")
    p.add_argument("--iterations", type=int, default=300)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    device = torch.device("cuda")
    storage = mmap.mmap(-1, args.rows * ROW_BYTES)
    ring = np.frombuffer(storage, dtype=np.uint8).reshape(args.rows, ROW_BYTES)
    ring[...] = np.random.default_rng(0).integers(0, 256, ring.shape, dtype=np.uint8)
    cudart = torch.cuda.cudart()
    if int(cudart.cudaHostRegister(ring.ctypes.data, ring.nbytes, 0x03)) != 0:
        raise SystemExit("cudaHostRegister refused the ring")
    stream = torch.cuda.Stream(device)
    rng = np.random.default_rng(1)
    results: dict[str, Any] = {"config": vars(args), "machine": machine(), "rows": []}
    try:
        for batch in [int(b) for b in args.batches.split(",")]:
            flat = np.sort(rng.choice(args.rows, batch, replace=False))
            index = torch.from_numpy(flat).to(device)
            row: dict[str, Any] = {"batch": batch, "bytes": batch * ROW_BYTES}
            expected = torch.from_numpy(ring[flat]).to(device)
            saved = ring[flat]
            rewrite = functools.partial(ring.__setitem__, flat, saved)
            for width in (1, 2, 4, 8):
                dtype = np.dtype(f"<i{width}") if width > 1 else np.dtype(np.uint8)
                view = torch.as_tensor(MappedHostArray(ring.view(dtype)), device=device)
                out = torch.empty((batch, ROW_BYTES // width), dtype=view.dtype, device=device)
                gather = functools.partial(torch.index_select, view, 0, index, out=out)
                row[f"index_select_{width}B_us"] = 1e3 * gpu_ms(gather, args.iterations, stream)
                assert torch.equal(out.view(torch.uint8), expected)
                # The rows just written by the CPU, as a worker does before its request.
                row[f"index_select_{width}B_fresh_us"] = 1e3 * gpu_ms(
                    gather, args.iterations, stream, before=rewrite
                )
            pinned = torch.empty((batch, ROW_BYTES), dtype=torch.uint8, pin_memory=True)
            dev = torch.empty((batch, ROW_BYTES), dtype=torch.uint8, device=device)
            cpu = []
            for _ in range(args.iterations):
                t0 = time.perf_counter()
                np.take(ring, flat, axis=0, out=pinned.numpy())
                cpu.append(time.perf_counter() - t0)
            row["host_take_cpu_us"] = 1e6 * statistics.median(cpu)
            row["pinned_copy_up_us"] = 1e3 * gpu_ms(
                functools.partial(dev.copy_, pinned, non_blocking=True), args.iterations, stream
            )
            results["rows"].append(row)
    finally:
        cudart.cudaHostUnregister(ring.ctypes.data)
    header = ["batch", "MB", *(f"{w} B" for w in (1, 2, 4, 8))]
    header += [f"{w} B fresh" for w in (1, 2, 4, 8)] + ["host take (CPU)", "copy up (GPU)"]
    print("| " + " | ".join(header) + " |\n|" + "---:|" * len(header))
    for r in results["rows"]:
        cells = [f"{r['batch']}", f"{r['bytes'] / 1e6:.2f}"]
        cells += [f"{r[f'index_select_{w}B_us']:.0f} us" for w in (1, 2, 4, 8)]
        cells += [f"{r[f'index_select_{w}B_fresh_us']:.0f} us" for w in (1, 2, 4, 8)]
        cells += [f"{r['host_take_cpu_us']:.0f} us", f"{r['pinned_copy_up_us']:.0f} us"]
        print("| " + " | ".join(cells) + " |")
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "gather_width.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
