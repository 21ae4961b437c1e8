"""How fast the envs are by themselves: the ceiling a collector is measured against.

:func:`env_throughput` steps each env in its own process with random actions, with no
policy and no communication, all processes measured over the same window. A
collector's frames/s divided by this number is the share of the envs' own speed that
it delivers.
"""

from __future__ import annotations

import multiprocessing as mp
import time
from collections.abc import Callable, Sequence
from typing import Any

import cloudpickle

__all__ = ["env_throughput"]


def _run(payload: bytes, seconds: float, barrier: Any, out: Any, index: int) -> None:
    env_fn, seed = cloudpickle.loads(payload)
    env = env_fn()
    env.reset(seed=seed)
    env.action_space.seed(seed)
    barrier.wait()
    steps = 0
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        _, _, terminated, truncated, _ = env.step(env.action_space.sample())
        steps += 1
        if terminated or truncated:
            env.reset()
    out[index] = steps
    env.close()


def env_throughput(env_fns: Sequence[Callable[[], Any]], seconds: float = 3.0) -> float:
    """Steps per second of ``env_fns``, one process each, random actions, no policy.

    Args:
        env_fns: env factories (pickled with cloudpickle), one process each.
        seconds: length of the measured window, which starts once every env is built.

    Returns:
        Total env steps per second over the window.

    Raises:
        RuntimeError: an env process failed (its traceback is on its stderr).

    Examples:
        The ceiling to hold a collector's ``stats()["frames_per_second"]`` against:

        >>> import functools
        >>> import gymnasium as gym
        >>> from rlcollect.envspeed import env_throughput
        >>> make_env = functools.partial(gym.make, "CartPole-v1")
        >>> steps_per_second = env_throughput([make_env] * 2, seconds=0.2)
        >>> steps_per_second > 0
        True
    """
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(len(env_fns))
    out = ctx.Array("q", len(env_fns))
    procs = [
        ctx.Process(
            target=_run,
            args=(cloudpickle.dumps((fn, i)), seconds, barrier, out, i),
            daemon=True,
        )
        for i, fn in enumerate(env_fns)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(seconds + 120)
    failed = [i for i, p in enumerate(procs) if p.exitcode != 0]
    for p in procs:
        if p.is_alive():
            p.kill()
    if failed:
        raise RuntimeError(f"env-throughput processes {failed} failed; see their stderr")
    return float(sum(out[:])) / seconds
