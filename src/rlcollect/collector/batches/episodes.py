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
or a subclass of the replay buffer. The batch's own thread keeps each batch's finished
episodes as a few columns; the caller's ``drain`` turns them into records, so the
consuming thread builds no Python object per episode. Past :data:`KEPT` undrained
records the oldest are dropped, a batch's at a time (the latest batch's are always kept;
``dropped`` counts them).
"""

from __future__ import annotations

import threading
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
        # Each batch's finished episodes as columns (its frames, then tensors of one row
        # per episode), turned into Episode records only when drained: the consuming
        # thread pays a few gathers per batch, the caller of drain() the records. The
        # lock keeps _held (records in _pending) right between the two threads.
        self._pending: deque[tuple[int, dict[str, np.ndarray]]] = deque()
        self._held = 0
        self._lock = threading.Lock()

    def record(self, batch: TensorDict, frames: int = 0) -> None:
        """Count the episodes that end in ``batch`` (any batch shape), delivered with
        ``frames`` transitions in all, and keep their records."""
        # numpy on the batch's (CPU) tensors, and no nested-key lookups: a few
        # microseconds each, where torch indexing and TensorDict's nested get cost tens
        nxt = batch.get("next")
        done = nxt.get("done").numpy().reshape(-1)
        if not done.any():
            return
        rows = done.nonzero()[0]

        def column(td: Any, key: str) -> np.ndarray:
            value: np.ndarray = td.get(key).numpy()
            picked: np.ndarray = value.reshape(done.shape[0], *value.shape[batch.ndim :])[rows]
            return picked

        columns = {name: column(nxt if name in _NEXT else batch, name) for name in _COLUMNS}
        if "info" in nxt.keys():  # noqa: SIM118 (a TensorDict)
            info = nxt.get("info")
            for name in info.keys():  # noqa: SIM118
                columns[f"info/{name}"] = column(info, name)
        returns = columns["episode_return"].tolist()
        self.count += len(returns)
        self._returns.extend(returns)
        self._lengths.extend(columns["episode_length"].tolist())
        with self._lock:
            self._pending.append((frames, columns))
            self._held += len(returns)
            while self._held > KEPT and len(self._pending) > 1:
                _, oldest = self._pending.popleft()  # a batch's records at a time, oldest
                self._held -= len(oldest["env_index"])
                self.dropped += len(oldest["env_index"])

    def drain(self) -> list[Episode]:
        """The records kept so far, oldest first; they are gone from the queue."""
        with self._lock:
            pending, self._pending = self._pending, deque()
            self._held = 0
        out = []
        for frames, columns in pending:
            values = {name: column.tolist() for name, column in columns.items()}
            infos = {name[5:]: columns[name] for name in columns if name[:5] == "info/"}
            for i in range(len(values["env_index"])):
                out.append(
                    Episode(
                        env_index=values["env_index"][i],
                        episode=values["episode"][i],
                        episode_return=float(values["episode_return"][i]),
                        episode_length=int(values["episode_length"][i]),
                        frames=frames,
                        terminated=bool(values["terminated"][i]),
                        info={name: _python(array[i]) for name, array in infos.items()},
                    )
                )
        return out

    def stats(self) -> dict[str, Any]:
        """``count``, ``return_mean`` and ``length_mean`` (None before the first end)."""
        n = len(self._returns)
        return {
            "count": self.count,
            "return_mean": sum(self._returns) / n if n else None,
            "length_mean": sum(self._lengths) / n if n else None,
        }


#: A record's fields read from the batch, those of them under ``"next"``.
_COLUMNS = ("env_index", "episode", "episode_return", "episode_length", "terminated")
_NEXT = frozenset({"episode_return", "episode_length", "terminated"})


def _python(value: np.ndarray) -> Any:
    """A scalar entry as a Python number; an array as it is."""
    return value.item() if value.ndim == 0 else value
