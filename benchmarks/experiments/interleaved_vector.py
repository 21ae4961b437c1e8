"""One vector env's three ways, in interleaved windows: the env alone, the hand loop and
the collector, built once and run in turn. An experiment for issue 18's AtariVectorEnv
target on a host whose speed drifts by more than the effects being looked for.

``atari_throughput.py`` and ``profile_vector_worker.py`` run each configuration once for
several seconds, one after the other; on the shared H200 host the env alone then ranges
over 25-42k frames/s between runs of one call, and a ratio of two runs moves by ±15%.
Here the three are set up once and kept (``atari_throughput``'s configuration: one
``AtariVectorEnv`` driven with send/recv, a graphed Nature CNN):

``env_only``
    random actions, in this process;
``hand_loop``
    recv, the graphed network, send (``atari_throughput.GraphedStep``), in this process;
``collector``
    ``AsyncBatchedCollector`` with one worker process (``--backend``: the server thread
    or the policy in the worker).

Each cycle runs every one for ``--lead`` seconds untimed, then ``--window`` seconds
timed, in an order that rotates from cycle to cycle; while one runs, the others idle
(the two in this process wait on their last ``send``; the collector's worker blocks
once the batches nobody takes fill its ring, which the next lead-in covers). The
collector's frames are the rows its policy answered in the window (``stats()``), so
batches already made before the window do not count. Ratios are taken per cycle: a
drift slower than a cycle cancels. Reported: each cycle's frames/s and ratios, their
medians, and the cycles in which the collector was ahead of the hand loop::

    python benchmarks/experiments/interleaved_vector.py --envs 64 --batch 32 --threads 16 \
        --cycles 10 --window 1.5 --lead 0.5 --out DIR
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import atari_throughput as at
from common import machine, make_atari_vector

from rlcollect import AsyncBatchedCollector
from rlcollect.transports import ProcessSlotTransport

NAMES = ("env_only", "hand_loop", "collector")


def window(step: Callable[[], int], lead: float, seconds: float) -> float:
    """Frames/s of ``step`` (which returns the frames it made) over ``seconds``, after
    ``lead`` seconds of it untimed."""
    t_end = time.perf_counter() + lead
    while time.perf_counter() < t_end:
        step()
    frames, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        frames += step()
    return frames / (time.perf_counter() - t0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--envs", type=int, default=64)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--threads", type=int, default=16)
    p.add_argument("--cycles", type=int, default=10)
    p.add_argument("--window", type=float, default=1.5, help="timed seconds per run")
    p.add_argument("--lead", type=float, default=0.5, help="untimed seconds before each")
    p.add_argument("--frames-per-batch", type=int, default=1024)
    p.add_argument("--backend", choices=["thread", "worker"], default="worker")
    p.add_argument("--policy", choices=["nature_cnn", "noop"], default="nature_cnn")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu":
        torch.set_num_threads(1)  # as the collector's server thread runs a CPU policy
    n, b, t = args.envs, args.batch, args.threads

    alone, hand = make_atari_vector(n, b, t), make_atari_vector(n, b, t)
    try:
        actions = alone.single_action_space.n
        rng = np.random.default_rng(0)
        alone.reset(seed=0)
        alone.send(rng.integers(0, actions, b))
        act = at.GraphedStep(at._policy(actions, args.policy).to(device), b, device)
        obs, _ = hand.reset(seed=1)
        hand.send(act(obs))

        def step_alone() -> int:
            alone.recv()
            alone.send(rng.integers(0, actions, b))
            return b

        def step_hand() -> int:
            hand.send(act(hand.recv()[0]))
            return b

        transport = ProcessSlotTransport()
        with AsyncBatchedCollector(
            [functools.partial(make_atari_vector, n, b, t)],
            at._policy(actions, args.policy),
            frames_per_batch=args.frames_per_batch,
            total_frames=-1,
            transport=transport,
            policy_device=device,
            cuda_graph=device.type == "cuda",
            inference_backend=args.backend,
        ) as c:
            batches = iter(c)
            next(batches)

            def collector_fps(lead: float, seconds: float) -> float:
                t_end = time.perf_counter() + lead
                while time.perf_counter() < t_end:
                    next(batches)
                rows0, t0 = c.stats()["server"]["rows"], time.perf_counter()
                while time.perf_counter() - t0 < seconds:
                    next(batches)
                return (c.stats()["server"]["rows"] - rows0) / (time.perf_counter() - t0)

            runs: dict[str, Callable[[], float]] = {
                "env_only": lambda: window(step_alone, args.lead, args.window),
                "hand_loop": lambda: window(step_hand, args.lead, args.window),
                "collector": lambda: collector_fps(args.lead, args.window),
            }
            cycles = []
            for k in range(args.cycles):
                order = NAMES[k % 3 :] + NAMES[: k % 3]
                fps = {name: runs[name]() for name in order}
                cycle = {"order": list(order), "fps": fps, "ratios": ratios(fps)}
                cycles.append(cycle)
                print(json.dumps(cycle), flush=True)
    finally:
        for env in (alone, hand):
            env.close()
    report = {
        "config": vars(args),
        "machine": machine(),
        "cycles": cycles,
        "summary": summary(cycles),
    }
    print(json.dumps(report["summary"], indent=1))
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "interleaved_vector.json").write_text(json.dumps(report, indent=1))


def ratios(fps: dict[str, float]) -> dict[str, float]:
    return {
        "collector/hand_loop": fps["collector"] / fps["hand_loop"],
        "collector/env_only": fps["collector"] / fps["env_only"],
        "hand_loop/env_only": fps["hand_loop"] / fps["env_only"],
    }


def summary(cycles: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians and ranges of frames/s and of the per-cycle ratios; cycles ahead."""
    out: dict[str, Any] = {}
    for group in ("fps", "ratios"):
        for key in cycles[0][group]:
            values = [c[group][key] for c in cycles]
            out[key] = {"median": statistics.median(values), "min": min(values), "max": max(values)}
    out["collector_ahead_of_hand_loop"] = sum(
        c["ratios"]["collector/hand_loop"] > 1 for c in cycles
    )
    out["cycles"] = len(cycles)
    return out


if __name__ == "__main__":
    main()
