"""Rings and worker programs of CountingEnv workers, to drive a transport with.

:func:`counting_layout` builds a ring for CountingEnv workers, :func:`counting_programs`
the worker programs (the collector's own worker loop over counting envs) that fill it.

This module imports no torch: its programs run inside worker processes.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium.vector import AutoresetMode

from rlcollect.testing.envs import CountingEnv, CountingVectorEnv
from rlcollect.transports.layout import Field, RingLayout, Staging
from rlcollect.worker.loop import run_worker
from rlcollect.worker.source import Source
from rlcollect.worker.spec import WorkerSpec, transition_fields

__all__ = ["counting_layout", "counting_programs"]

_ACTIONS = 5  # size of the Discrete action space of the programs' envs
_NEXT_STEP = AutoresetMode.NEXT_STEP


def counting_layout(
    *,
    num_workers: int,
    columns: int,
    chunk_steps: int,
    slots: int,
    splits: int = 1,
    vector_batch: int = 0,
) -> RingLayout:
    """A ring for CountingEnv workers (observation, action and the bookkeeping fields).

    ``splits`` requests per worker; ``vector_batch > 0``: staged requests of that many
    rows, for workers of ``splits`` CountingVectorEnvs (see :func:`counting_programs`).

    Args:
        num_workers: workers.
        columns: env columns per worker (sub-envs counted one by one).
        chunk_steps: steps of each env per chunk.
        slots: chunk slots per worker.
        splits: requests a worker may hold at once.
        vector_batch: rows of a staged request; 0 for in-place requests.

    Returns:
        The :class:`~rlcollect.transports.layout.RingLayout`.

    Raises:
        ValueError: sizes that do not fit together (see ``RingLayout``).

    Examples:
        >>> from rlcollect.testing import counting_layout
        >>> layout = counting_layout(num_workers=2, columns=3, chunk_steps=4, slots=2)
        >>> layout.positions, layout.request_columns
        (8, 3)
        >>> [f.key for f in layout.fields][:3]
        [('observation',), ('next', 'observation'), ('action',)]
    """
    obs = Field(("observation",), (4,), np.dtype(np.int64))
    action = Field(("action",), (), np.dtype(np.int64))
    fields = transition_fields((obs,), action)
    staging = None
    if vector_batch:
        staging = Staging(keys=(obs.key, action.key, ("policy_version",)), columns=vector_batch)
    return RingLayout(
        fields=fields,
        num_workers=num_workers,
        columns=columns,
        chunk_steps=chunk_steps,
        slots=slots,
        splits=splits,
        staging=staging,
    )


def counting_programs(
    layout: RingLayout, *, fail: dict[int, tuple[int, int]] | None = None
) -> list[Any]:
    """Worker programs for ``layout``; ``fail`` maps env index to CountingEnv's ``fail_at``.

    A staged layout gets ``splits`` CountingVectorEnvs per worker, each of
    ``columns // splits`` sub-envs returning ``request_columns`` at a time;
    otherwise each worker steps ``columns`` CountingEnvs.

    Args:
        layout: a ring from :func:`counting_layout`.
        fail: env index -> ``(episode, step)`` at which that env raises.

    Returns:
        One worker program per worker, ready for ``Transport.start``.

    Examples:
        >>> from rlcollect.testing import counting_layout, counting_programs
        >>> from rlcollect.transports import ThreadQueueTransport
        >>> layout = counting_layout(num_workers=2, columns=1, chunk_steps=2, slots=2)
        >>> programs = counting_programs(layout, fail={1: (0, 1)})
        >>> len(programs)
        2
        >>> transport = ThreadQueueTransport()
        >>> end = transport.start(layout, programs)
        >>> transport.close()
    """
    fail = fail or {}
    programs = []
    k = layout.columns
    space = gym.spaces.Box(0, 1 << 40, shape=(4,), dtype=np.int64)
    actions = gym.spaces.Discrete(_ACTIONS)
    for w in range(layout.num_workers):
        fns: tuple[Callable[[], Any], ...]
        if layout.staging is not None:
            n = k // layout.splits
            b = layout.request_columns
            fns = tuple(
                functools.partial(CountingVectorEnv, w * k + g * n, n, b, order_seed=w * 7 + g)
                for g in range(layout.splits)
            )
            source = Source(space, actions, sub_envs=n, batch_size=b, autoreset=_NEXT_STEP)
        else:
            fns = tuple(
                functools.partial(
                    CountingEnv, w * k + j, num_actions=_ACTIONS, fail_at=fail.get(w * k + j)
                )
                for j in range(k)
            )
            source = Source(space, actions)
        spec = WorkerSpec(
            env_fns=fns,
            env_offset=w * k,
            seed=0,
            chunk_steps=layout.chunk_steps,
            slots=layout.slots,
            source=source,
            observation_paths=((),),
            discrete_actions=True,
            splits=layout.splits,
        )
        programs.append(functools.partial(run_worker, spec=spec))
    return programs
