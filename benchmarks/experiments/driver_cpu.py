"""The driver's CPU per frame, collecting pixels off-policy: one configuration, one JSON line.

The driver process does the consumer's work only when the envs and the policy run
elsewhere (``transport="process_slots"``, ``inference_backend="process"``): waiting for
chunks and copying them into batches. This collects 4 ale-py Pong envs (4x105x80 uint8
frames, ``benchmarks/common.py``) with the small CNN on the CPU in batches of 1024, drops
each batch as a training loop would, and prints the driver's CPU milliseconds per frame
(``time.process_time``, every thread of this process) after the first batch, with
``stats()["batch_memory_reuses"]`` and ``["ring_batches"]`` (batches that viewed the
ring: with 16 envs, 4 per worker, one slot of every worker is a batch) where the
``rlcollect`` imported has them. For an A/B,
run it once per tree, interleaved (``PYTHONPATH=<tree>/src``)::

    python benchmarks/experiments/driver_cpu.py [--frames 16384] [--envs 16 --envs-per-worker 4]

On a GPU machine, issue 18's configuration (16 envs, the Nature CNN as a CUDA graph on
the GPU, either inference backend)::

    python benchmarks/experiments/driver_cpu.py --envs 16 --device cuda --backend thread
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from pong_collector import pong_collector  # beside this script


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--frames", type=int, default=16_384)
    p.add_argument("--envs", type=int, default=4)
    p.add_argument("--device", default="cpu", help="cuda: the Nature CNN as a CUDA graph")
    p.add_argument("--backend", choices=["process", "thread"], default="process")
    p.add_argument("--envs-per-worker", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(1)
    with pong_collector(
        args.envs, args.device, args.backend, 1024, envs_per_worker=args.envs_per_worker
    ) as collector:
        batches = iter(collector)
        next(batches)  # start-up left out
        frames, cpu, wall = 0, time.process_time(), time.perf_counter()
        while frames < args.frames:
            batch = next(batches)
            frames += batch.numel()
            del batch  # let go, as a training step does
        cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
        stats = collector.stats()
    result = {
        "envs": args.envs,
        "envs_per_worker": args.envs_per_worker,
        "device": args.device,
        "backend": args.backend,
        "driver_cpu_ms_per_frame": 1e3 * cpu / frames,
        "frames_per_second": frames / wall,
        "batch_memory_reuses": stats.get("batch_memory_reuses"),
        "ring_batches": stats.get("ring_batches"),
        "batches": stats.get("batches"),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
