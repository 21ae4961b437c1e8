"""How long workers of a pooled ring wait for a place, simulated: the real builder, a
clock of its own, workers whose chunks take random times.

A pooled ring (``collector/pool_batches.py``) ties a block to its slowest place: the
written places of a block held back are copied so the batch goes on, but none of them is
free again until the slow one is in. Whether that costs the workers time depends on how
much their chunk times vary, which a 2-core machine cannot show and a GPU host shows
only as frames/s. So this drives the real ``PoolBatchBuilder`` from a discrete-event
simulation: ``W`` workers, each writing the places it is given in order, a chunk taking
``S x E x step_ms`` times a log-normal factor (``--cv``), and now and then (``--stall-p``)
a stall of ``--stall-ms`` on top (a reset, a worker descheduled for a time slice). The
loop pops each batch as soon as it is ready and holds it until the next one, as ``for
batch in collector`` does. The builder's own ``place_wait_seconds`` (read by the
simulated clock) over ``W x`` the simulated time is the share of the workers' time lost;
a copying ring loses none (each worker writes its own slots, given back at once).

    python benchmarks/experiments/pool_sim.py --workers 16 --envs 4 --steps 16 \\
        --cv 0.1 0.3 0.6 --stall-p 0 0.02 --blocks 4 6 8 --out pool_sim.json
"""

from __future__ import annotations

import argparse
import dataclasses
import heapq
import itertools
import json
import sys
from collections import deque
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))

from rlcollect.collector import pool_batches  # noqa: E402
from rlcollect.testing import counting_layout  # noqa: E402


def simulate(
    workers: int,
    envs: int,
    steps: int,
    blocks: int,
    step_ms: float,
    cv: float,
    stall_p: float,
    stall_ms: float,
    batches: int,
    seed: int,
) -> dict[str, Any]:
    """One run: the share of worker time spent without a place, and what was lent."""
    rng = np.random.default_rng(seed)
    now = [0.0]
    pool_batches._now = lambda: now[0]  # the builder's clock is the simulation's
    layout = dataclasses.replace(
        counting_layout(num_workers=workers, envs_per_worker=envs, chunk_steps=steps, slots=blocks),
        pooled=True,
    )
    ring = layout.views(bytearray(layout.nbytes))
    fpb = workers * envs * steps
    builder = pool_batches.PoolBatchBuilder(
        layout, ring, frames_per_batch=fpb, total_frames=-1, lend="pool"
    )
    sigma = float(np.sqrt(np.log1p(cv * cv)))
    mean_ms = steps * envs * step_ms

    def chunk_time() -> float:
        t = mean_ms * float(rng.lognormal(-sigma * sigma / 2, sigma))
        if rng.random() < stall_p:
            t += stall_ms
        return t / 1e3

    held = [deque(layout.first_credits(w)) for w in range(workers)]
    writing = [False] * workers
    events: list[tuple[float, int, int]] = []  # (done at, tie-break, worker)
    order = itertools.count()

    def start(w: int) -> None:
        writing[w] = True
        heapq.heappush(events, (now[0] + chunk_time(), next(order), w))

    def give(pairs: list[tuple[int, int]]) -> None:
        for w, place in pairs:
            held[w].append(place)
            if not writing[w]:
                start(w)

    for w in range(workers):
        start(w)
    kept = None  # the loop's batch, held until the next one is ready
    popped = 0
    while popped < batches:
        now[0], _, w = heapq.heappop(events)
        writing[w] = False
        place = held[w].popleft()
        give(builder.add_chunk(w, place))  # may give w a place, and start it
        if held[w] and not writing[w]:
            start(w)
        while builder.ready:
            kept = builder.pop()  # the previous batch is let go of here
            popped += 1
            give(builder.returned())
    del kept
    elapsed = now[0]
    return {
        "workers": workers,
        "envs": envs,
        "steps": steps,
        "blocks": blocks,
        "cv": cv,
        "stall_p": stall_p,
        "stall_ms": stall_ms,
        "batches": popped,
        "lent": builder.lent,
        "seconds": elapsed,
        "wait_share": builder.place_wait_seconds / (workers * elapsed),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workers", type=int, default=16)
    p.add_argument("--envs", type=int, default=4)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--step-ms", type=float, default=0.5, help="one env step, policy included")
    p.add_argument("--cv", type=float, nargs="+", default=[0.1, 0.3, 0.6])
    p.add_argument("--stall-p", type=float, nargs="+", default=[0.0, 0.02])
    p.add_argument("--stall-ms", type=float, default=20.0)
    p.add_argument("--blocks", type=int, nargs="+", default=[4, 6, 8])
    p.add_argument("--batches", type=int, default=2000)
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--out")
    args = p.parse_args()
    rows = []
    for cv, stall_p, blocks in itertools.product(args.cv, args.stall_p, args.blocks):
        shape = (args.workers, args.envs, args.steps, blocks, args.step_ms)
        stalls = (cv, stall_p, args.stall_ms, args.batches)
        runs = [simulate(*shape, *stalls, seed) for seed in range(args.seeds)]
        share = float(np.median([r["wait_share"] for r in runs]))
        lent = float(np.median([r["lent"] / r["batches"] for r in runs]))
        rows.append({**runs[0], "wait_share": share, "lent_share": lent, "seeds": args.seeds})
        print(
            f"cv {cv:.2f}  stalls {stall_p:.2f} x {args.stall_ms:.0f} ms  {blocks} blocks: "
            f"workers without a place {100 * share:5.2f}% of their time, "
            f"{100 * lent:5.1f}% of batches lent",
            flush=True,
        )
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
