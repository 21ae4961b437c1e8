"""Finished episodes, read from the batches as they are delivered: ``stats()["episodes"]``
and the records ``collector.episodes()`` drains.

Every transition carries its episode's running return and length
(``("next", "episode_return" | "episode_length")``, written by the worker loops); at a
``done`` row they are the finished episode's. The collector reads them there, from
each batch it delivers, so the figures describe exactly the episodes the learner (or
the replay buffer) has received: ``count`` in all, and the mean return and length of
the last :data:`WINDOW` (None while no episode has finished).

Each finished episode is also kept as an :class:`Episode` record (its env, return,
length, the frames delivered with it, and the last step's ``info_keys`` entries) in a
bounded queue, which the caller drains from any thread while collection runs in the
background: gymnasium's ``RecordEpisodeStatistics`` habit, without a wrapper in the env
or a subclass of the replay buffer. The batch's own thread appends, the caller's pops:
each is one atomic ``deque`` operation, so the two need no lock. Past :data:`KEPT`
undrained records the oldest are dropped (``dropped`` counts them).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rlcollect._tensordict import TensorDict

__all__ = ["KEPT", "WINDOW", "Episode", "EpisodeStats"]

#: Finished episodes the means are taken over (the most recent ones).
WINDOW = 100
#: Records kept for ``collector.episodes()`` until drained; older ones are dropped.
KEPT = 10_000


@dataclass(frozen=True)
class Episode:
    """One finished episode, as ``collector.episodes()`` returns it.

    Attributes:
        env_index: the env it ran in.
        episode: its number among that env's episodes (0 first).
        episode_return: the sum of its rewards.
        episode_length: its steps.
        frames: transitions the collector had delivered once the batch holding its last
            step was delivered (a learning curve's x-axis, to the batch).
        terminated: it ended by ``terminated`` (else it was truncated).
        info: the ``info_keys`` entries of its last step (``("next", "info", name)``):
            a Python number for a scalar entry, else a numpy array.

    Examples:
        >>> from rlcollect.collector.batches.episodes import Episode
        >>> e = Episode(env_index=3, episode=0, episode_return=21.0, episode_length=21,
        ...             frames=256, terminated=True, info={})
        >>> e.env_index, e.episode_return
        (3, 21.0)
    """

    env_index: int
    episode: int
    episode_return: float
    episode_length: int
    frames: int
    terminated: bool
    info: dict[str, Any] = field(default_factory=dict)


class EpisodeStats:
    """Returns and lengths of the episodes finished in delivered batches, and their
    records until drained."""

    def __init__(self) -> None:
        self.count = 0
        self.dropped = 0  # records pushed out of a full queue, never drained
        self._returns: deque[float] = deque(maxlen=WINDOW)
        self._lengths: deque[int] = deque(maxlen=WINDOW)
        self._records: deque[Episode] = deque()

    def record(self, batch: TensorDict, frames: int = 0) -> None:
        """Count the episodes that end in ``batch`` (any batch shape), delivered with
        ``frames`` transitions in all, and keep their records."""
        done = batch.get(("next", "done")).reshape(-1)
        if not bool(done.any()):
            return
        rows = done.nonzero().squeeze(-1)

        def column(key: Any) -> Any:
            value = batch.get(key)
            return value.reshape(done.shape[0], *value.shape[batch.ndim :])[rows]

        returns = column(("next", "episode_return")).tolist()
        lengths = column(("next", "episode_length")).tolist()
        self.count += len(returns)
        self._returns.extend(returns)
        self._lengths.extend(lengths)
        infos = {}
        if ("next", "info") in batch.keys(include_nested=True):
            infos = {
                str(name): column(("next", "info", name)).numpy()
                for name in batch.get(("next", "info")).keys()  # noqa: SIM118 (a TensorDict)
            }
        envs, episodes = column("env_index").tolist(), column("episode").tolist()
        terminated = column(("next", "terminated")).tolist()
        for i in range(len(returns)):
            self._keep(
                Episode(
                    env_index=envs[i],
                    episode=episodes[i],
                    episode_return=float(returns[i]),
                    episode_length=int(lengths[i]),
                    frames=frames,
                    terminated=bool(terminated[i]),
                    info={name: _python(values[i]) for name, values in infos.items()},
                )
            )

    def _keep(self, record: Episode) -> None:
        self._records.append(record)
        if len(self._records) > KEPT:
            try:
                self._records.popleft()
                self.dropped += 1
            except IndexError:  # drained meanwhile by the caller
                pass

    def drain(self) -> list[Episode]:
        """The records kept so far, oldest first; they are gone from the queue."""
        out = []
        while True:
            try:
                out.append(self._records.popleft())
            except IndexError:
                return out

    def stats(self) -> dict[str, Any]:
        """``count``, ``return_mean`` and ``length_mean`` (None before the first end)."""
        n = len(self._returns)
        return {
            "count": self.count,
            "return_mean": sum(self._returns) / n if n else None,
            "length_mean": sum(self._lengths) / n if n else None,
        }


def _python(value: np.ndarray) -> Any:
    """A scalar entry as a Python number; an array as it is."""
    return value.item() if value.ndim == 0 else value
