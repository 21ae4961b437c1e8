"""The page faults the worker processes take as they collect: a pooled ring against one
that is not.

A process takes a page fault on its first access to each page of a shared mapping. A
worker of a pooled ring writes places all over the ring as it is given them
(``collector/pool_batches.py``), a worker of any other ring only its own slots, so the
two differ in how many pages a worker first touches while it collects. This collects
16 ale-py Pong envs, 4 per worker, in worker processes (``process_slots``) with the
small CNN in the inference process, in batches of 1024, and every 5 batches after the
first prints the workers' minor page faults since the first (``/proc/PID/stat``, summed
over the workers), once with the default chunk size (one chunk of every worker is a
batch: the ring is pooled) and once with chunks of 32 steps (not pooled), with the
seconds from construction to the first batch. One JSON line per ring. For an A/B, run
it once per tree (``PYTHONPATH=<tree>/src``)::

    python benchmarks/experiments/worker_faults.py [--batches 30]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch
from pong_collector import pong_collector  # beside this script


def minor_faults(pid: int) -> int:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[7])  # minflt: the 10th field, the 8th after the command's ")"


def collect(chunk: int | None, batches: int) -> dict[str, Any]:
    kwargs = {} if chunk is None else {"transition_chunk_size": chunk}
    start = time.perf_counter()
    faults = []
    with pong_collector(16, "cpu", "process", 1024, envs_per_worker=4, **kwargs) as c:
        it = iter(c)
        next(it)
        first = time.perf_counter() - start
        pids = c.transport.pids
        base = sum(minor_faults(p) for p in pids)
        for n in range(1, batches + 1):
            next(it)  # dropped at once, as a training step lets go of its batch
            if n % 5 == 0:
                faults.append([n, sum(minor_faults(p) for p in pids) - base])
        stats = c.stats()
    return {
        "ring": "pooled" if chunk is None else f"chunks of {chunk}",
        "seconds_to_first_batch": round(first, 2),
        "ring_batches": stats["ring_batches"],
        "worker_faults_after_batch": faults,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", type=int, default=30)
    args = p.parse_args()
    torch.set_num_threads(1)
    for chunk in (None, 32):
        print(json.dumps(collect(chunk, args.batches)), flush=True)


if __name__ == "__main__":
    main()
