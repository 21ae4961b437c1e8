"""What building env 0 tells the plan, read from the built env: torch-free, so that it
runs wherever env 0 is built (in the driver, ``collector/probe.py``, or in worker 0's
process, ``transports/first_worker.py``).

:func:`probe_built` describes the env (``source.py``), reads the ring fields of the
``info_keys`` entries from one step's ``info`` (after a reset, a sampled action), and
times a plain env's steps for the layout's choice (``collector/figures.py``).
"""

from __future__ import annotations

import statistics
import time
from typing import Any, NamedTuple

import numpy as np

from rlcollect.errors import WorkerError
from rlcollect.transports.layout import Field
from rlcollect.worker.infos import NUMERIC_KINDS
from rlcollect.worker.source import Source, describe
from rlcollect.worker.spec import info_key

__all__ = ["ProbedEnv", "build_stalled", "factory_failed", "probe_built"]

# Timed steps of env 0 at most. The steps go on for the whole budget, not only as many
# as a median needs: the machine's load is sampled over the probe (figures.py), and
# /proc/stat counts in ticks of 10 ms.
_MOST_STEPS = 100_000


class ProbedEnv(NamedTuple):
    """What building env 0 told: what every factory builds, the ``info_keys`` fields,
    its step time (None where not timed) and the seconds timing it took; ``stepped``:
    the probe reset and stepped the env (it is no longer as its factory built it)."""

    source: Source
    info_fields: tuple[Field, ...]
    step_seconds: float | None = None
    timing_seconds: float = 0.0
    stepped: bool = False


def probe_built(env: Any, info_keys: tuple[str, ...], time_steps: float = 0.0) -> ProbedEnv:
    """What env 0 (built, not yet closed) tells: its :class:`~rlcollect.worker.source.Source`,
    the ring fields of the ``info_keys`` entries (none without ``info_keys``: the env is
    not stepped), and with ``time_steps`` (seconds) a plain env's step time: it is reset
    and stepped with sampled actions for that long (at least one step, at most
    ``_MOST_STEPS``), the median step its step time; an env that raises there is not
    timed (its worker will report it).

    Raises:
        TypeError, ValueError: as ``describe`` does; a ``ValueError`` naming the entry
            for an ``info_keys`` entry the env's info lacks or that is not a number.
    """
    source = describe(env, "env_fns[0]")
    info_fields = _info_fields(env, source, info_keys) if info_keys else ()
    if not time_steps or source.vector:
        return ProbedEnv(source, info_fields, stepped=bool(info_keys))
    started = time.perf_counter()
    step = _step_seconds(env, time_steps)
    return ProbedEnv(source, info_fields, step, time.perf_counter() - started, stepped=True)


def _step_seconds(env: Any, budget: float) -> float | None:
    """The median of a few timed steps of ``env`` with sampled actions (the sampling not
    timed), after a reset; at most ``budget`` seconds, the reset included."""
    deadline = time.perf_counter() + budget
    steps: list[float] = []
    try:
        env.reset(seed=0)
        env.action_space.seed(0)
        while not steps or (len(steps) < _MOST_STEPS and time.perf_counter() < deadline):
            action = env.action_space.sample()
            start = time.perf_counter()
            _, _, terminated, truncated, _ = env.step(action)
            steps.append(time.perf_counter() - start)
            if terminated or truncated:
                env.reset()
    except Exception:
        return None
    return statistics.median(steps) if steps else None


def _info_fields(env: Any, source: Source, names: tuple[str, ...]) -> tuple[Field, ...]:
    try:
        info = _first_step_info(env, source)
    except Exception as exc:
        raise ValueError(
            f"env 0 raised while probing its info for info_keys={names!r} (one reset and one "
            f"step with a sampled action): {type(exc).__name__}: {exc}"
        ) from exc
    fields = []
    for name in names:
        has = sorted(map(str, info)) if isinstance(info, dict) else repr(info)
        if not isinstance(info, dict) or name not in info:
            raise ValueError(
                f"info_keys names {name!r}, but env 0's info after a step has no such entry "
                f"(it holds {has})"
            )
        value = np.asarray(info[name])
        if source.vector:
            value = value[0]  # one row per sub-env
        if value.dtype.kind not in NUMERIC_KINDS:
            raise ValueError(
                f"info_keys names {name!r}, but env 0's info[{name!r}] is {info[name]!r} "
                f"({value.dtype}): only numbers (bools, integers, floats, arrays of them) "
                "are carried"
            )
        fields.append(Field(info_key(name), tuple(value.shape), value.dtype))
    return tuple(fields)


def factory_failed(exc: BaseException) -> ValueError:
    """The error of an ``env_fns[0]`` that raised ``exc`` while building env 0 for the
    probe (raised ``from`` it)."""
    return ValueError(f"env_fns[0] raised while building the probe env: {exc}")


def build_stalled(timeout: float) -> WorkerError:
    """The error of an ``env_fns[0]`` that has not returned an env within
    ``stall_timeout`` while env 0 was built for the probe."""
    return WorkerError(
        f"env_fns[0] has not returned an env in {timeout:g} s while the collector built "
        f"its probe env (or that env has not finished the probe's reset and steps): "
        f"stalled (stall_timeout={timeout:g} s)",
        worker_index=-1,  # the probe's env, before any worker runs it
        env_index=0,
    )


def _first_step_info(env: Any, source: Source) -> Any:
    """The info of ``env``'s first step with sampled actions, after a reset."""
    if not source.envpool:
        env.reset(seed=0)
        env.action_space.seed(0)
        *_, info = env.step(env.action_space.sample())
        return info
    # An EnvPool pool (worker/source.py): reset with async_reset + recv, and send the
    # actions to the sub-envs of that result; its action_space is one sub-env's.
    env.async_reset()
    *_, info = env.recv()
    ids = np.asarray(info["env_id"])
    source.action_space.seed(0)
    env.send(np.stack([source.action_space.sample() for _ in ids]), ids)
    *_, info = env.recv()
    return info
