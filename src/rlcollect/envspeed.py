"""How fast the envs are by themselves: the ceiling a collector is measured against.

:func:`env_throughput` steps each env in its own process with random actions, with no
policy and no communication, all processes measured over the same window. A
collector's frames/s divided by this number is the share of the envs' own speed that
it delivers.
"""

from __future__ import annotations

import multiprocessing as mp
import threading
import time
from collections.abc import Callable, Sequence
from traceback import format_exception
from typing import Any

import cloudpickle

from rlcollect.errors import CollectorError, RemoteTraceback

__all__ = ["env_throughput"]


def _run(payload: bytes, seconds: float, barrier: Any, out: Any, errors: Any, index: int) -> None:
    try:
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
    except threading.BrokenBarrierError:
        return  # another env failed before the window opened; it reports why
    except BaseException as exc:
        # The traceback travels to the driver, which raises it as the error's cause; the
        # barrier breaks so that no other process waits for this one.
        errors.put((index, f"{type(exc).__qualname__}: {exc}", "".join(format_exception(exc))))
        barrier.abort()


def env_throughput(env_fns: Sequence[Callable[[], Any]], *, seconds: float = 3.0) -> float:
    """Steps per second of ``env_fns``, one process each, random actions, no policy.

    Args:
        env_fns: env factories (pickled with cloudpickle), one process each.
        seconds: length of the measured window, which starts once every env is built.

    Returns:
        Total env steps per second over the window.

    Raises:
        CollectorError: an env (or its factory) raised, naming the env; its traceback is
            the ``__cause__``. Also when an env process died or did not finish.

    Examples:
        The ceiling to hold a collector's ``stats()["frames_per_second"]`` against:

        >>> import functools
        >>> import gymnasium as gym
        >>> from rlcollect.envspeed import env_throughput
        >>> make_env = functools.partial(gym.make, "CartPole-v1")
        >>> steps_per_second = env_throughput([make_env] * 2, seconds=0.2)
        >>> steps_per_second > 0
        True

        An env that cannot be built:

        >>> from rlcollect.errors import CollectorError
        >>> try:
        ...     env_throughput([make_env, functools.partial(gym.make, "NoSuchEnv-v0")], seconds=0.2)
        ... except CollectorError as error:
        ...     print(error)
        env_throughput: env 1 raised NameNotFound: Environment `NoSuchEnv` doesn't exist.
    """
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(len(env_fns))
    out = ctx.Array("q", len(env_fns))
    errors = ctx.SimpleQueue()
    procs = [
        ctx.Process(
            target=_run,
            args=(cloudpickle.dumps((fn, i)), seconds, barrier, out, errors, i),
            daemon=True,
        )
        for i, fn in enumerate(env_fns)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(seconds + 120)
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    if not errors.empty():
        index, message, tb = errors.get()
        error = CollectorError(f"env_throughput: env {index} raised {message}")
        error.__cause__ = RemoteTraceback(tb)
        raise error
    failed = {i: p.exitcode for i, p in enumerate(procs) if p.exitcode != 0}
    if failed:
        raise CollectorError(
            f"env_throughput: the processes of envs {sorted(failed)} ended without a result "
            f"(exit codes {list(failed.values())}; negative: killed by that signal)"
        )
    return float(sum(out[:])) / seconds
