"""What a worker is given: its spec, and the ring fields every transition has.

Shared by the worker loops (``loop.py`` for envs stepped one by one,
``vector_loop.py`` for vector envs) and the collector that builds the ring. Imports
no torch: worker processes unpickle a :class:`WorkerSpec`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from rlcollect.transports.layout import Field, Key, Path
from rlcollect.worker.source import Source

__all__ = ["IS_INIT", "Path", "WorkerSpec", "info_key", "observation_key", "transition_fields"]


def observation_key(path: Path, *, nxt: bool = False) -> Key:
    """Ring key of the observation leaf at ``path`` (``()`` for a non-dict observation)."""
    return (("next", "observation") if nxt else ("observation",)) + path


#: Ring field a worker writes next to each observation for a recurrent policy: ``step == 0``.
IS_INIT = Field(("is_init",), (), np.dtype(np.bool_))


def info_key(name: str) -> Key:
    """Ring key of the ``info`` entry ``name`` carried with ``info_keys``."""
    return ("next", "info", name)


def transition_fields(
    observations: tuple[Field, ...],
    action: Field,
    extras: tuple[Field, ...] = (),
    infos: tuple[Field, ...] = (),
    *,
    recurrent: bool = False,
) -> tuple[Field, ...]:
    """Every ring field of a transition, given the observation leaves, policy outputs and
    carried ``info`` entries.

    ``observations`` are keyed ``("observation", *path)``; their ``("next", ...)``
    twins, the bookkeeping fields, the step results and the episode's running return
    and length are added here; ``infos`` are keyed ``("next", "info", name)``, and
    ``is_init`` for a ``recurrent`` policy (the server reads it to reset an env's state).
    """
    return (
        *observations,
        *(Field(("next", *f.key), f.shape, f.dtype) for f in observations),
        action,
        *extras,
        Field(("policy_version",), (), np.dtype(np.int64)),
        Field(("env_index",), (), np.dtype(np.int64)),
        Field(("episode",), (), np.dtype(np.int64)),
        Field(("step",), (), np.dtype(np.int64)),
        Field(("next", "reward"), (), np.dtype(np.float32)),
        Field(("next", "terminated"), (), np.dtype(np.bool_)),
        Field(("next", "truncated"), (), np.dtype(np.bool_)),
        Field(("next", "episode_return"), (), np.dtype(np.float32)),
        Field(("next", "episode_length"), (), np.dtype(np.int64)),
        *infos,
        *((IS_INIT,) if recurrent else ()),
    )


@dataclass(frozen=True)
class WorkerSpec:
    """Everything one worker needs; pickled into worker processes with cloudpickle.

    ``env_fns`` are the worker's factories, each building what ``source`` describes;
    the worker's envs are numbered from ``env_offset`` (a vector env's sub-envs count
    one by one). ``splits`` is the number of splits its columns fall into, each with a
    request of its own outstanding (for vector envs: one split per vector env).
    ``slots`` is the number of chunk buffers its credits may name
    (``RingLayout.credited_slots``: a pooled ring's are every worker's). ``first_episode``
    numbers the first episode of each env (a restarted worker goes on from where the
    one it replaces stopped); None: every env starts at episode 0.
    """

    env_fns: tuple[Callable[[], Any], ...]
    env_offset: int
    seed: int | None
    chunk_steps: int
    slots: int
    source: Source
    observation_paths: tuple[Path, ...]
    discrete_actions: bool
    splits: int = 1
    first_episode: tuple[int, ...] | None = None
    on_policy: bool = False
    info_keys: tuple[str, ...] = ()

    @property
    def num_envs(self) -> int:
        """Collector envs this worker steps."""
        return len(self.env_fns) * self.source.envs
