"""The in-process path's own cost: the worker thread's CPU time per frame.

A do-nothing env (a constant observation, an episode of 500 steps) and the suite's
MLP (4-64-64-2, sampling by Gumbel-max), every env in one worker thread that runs the
policy (``transport="thread"``, ``inference_backend="worker"``), torch on one thread.
The worker thread's CPU time is read every 256 of its requests; on a shared machine
the quietest window is the figure (other work only adds to a window's time), with the
tenth percentile and the median beside it. Run it once per source tree, alternating::

    PYTHONPATH=src python -m benchmarks.worker_loop_cpu --envs 1 4 16
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import gymnasium as gym
import numpy as np
import torch

from benchmarks.policies import GumbelMLP
from rlcollect import AsyncBatchedCollector
from rlcollect.inference import in_worker_policy

WINDOW = 256  # requests per window


class Nothing(gym.Env[np.ndarray, int]):
    """Steps in a fraction of a microsecond: what is left is the loop's and the policy's."""

    observation_space = gym.spaces.Box(-1.0, 1.0, (4,), np.float32)
    action_space = gym.spaces.Discrete(2)

    def __init__(self) -> None:
        self._obs = np.zeros(4, np.float32)
        self._t = 0

    def reset(self, *, seed: int | None = None, options: Any = None) -> tuple[np.ndarray, dict]:
        self._t = 0
        return self._obs, {}

    def step(self, action: int) -> tuple[np.ndarray, float, bool, bool, dict]:
        self._t += 1
        return self._obs, 1.0, False, self._t >= 500, {}


def measure(n: int, seconds: float) -> dict[str, float]:
    marks: list[float] = []
    request = in_worker_policy.InWorkerEnd.request
    count = 0

    def timed(self: Any, position: int) -> None:
        nonlocal count
        count += 1
        if count % WINDOW == 0:
            marks.append(time.thread_time())
        request(self, position)

    in_worker_policy.InWorkerEnd.request = timed  # type: ignore[method-assign]
    try:
        torch.manual_seed(0)
        collector = AsyncBatchedCollector(
            [Nothing] * n,
            GumbelMLP(4, 2),
            frames_per_batch=1024,
            transport="thread",
            inference_backend="worker",
            envs_per_worker=n,
        )
        started = time.perf_counter()
        for _ in collector:
            if time.perf_counter() - started > seconds:
                break
        collector.shutdown()
    finally:
        in_worker_policy.InWorkerEnd.request = request  # type: ignore[method-assign]
    per_frame = np.sort(np.diff(marks[4:]) / (WINDOW * n) * 1e6)  # the first windows: warm-up
    return {
        "min_us": float(per_frame[0]),
        "p10_us": float(per_frame[len(per_frame) // 10]),
        "median_us": float(np.median(per_frame)),
        "windows": len(per_frame),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--envs", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--seconds", type=float, default=3.0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    for n in args.envs:
        r = measure(n, args.seconds)
        print(
            f"{n} envs: worker thread CPU per frame {r['min_us']:.2f} us (quietest window), "
            f"p10 {r['p10_us']:.2f}, median {r['median_us']:.2f} ({r['windows']} windows)"
        )


if __name__ == "__main__":
    main()
