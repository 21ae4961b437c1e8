"""``stats()["episodes"]``: finished episodes, counted from the batches as they are delivered.

Every transition carries its episode's running return and length
(``("next", "episode_return" | "episode_length")``, written by the worker loops); at a
``done`` row they are the finished episode's. The collector reads them there, from
each batch it delivers, so the figures describe exactly the episodes the learner (or
the replay buffer) has received: ``count`` in all, and the mean return and length of
the last :data:`WINDOW` (None while no episode has finished).
"""

from __future__ import annotations

from collections import deque
from typing import Any

from rlcollect._tensordict import TensorDict

__all__ = ["WINDOW", "EpisodeStats"]

#: Finished episodes the means are taken over (the most recent ones).
WINDOW = 100


class EpisodeStats:
    """Returns and lengths of the episodes finished in delivered batches."""

    def __init__(self) -> None:
        self.count = 0
        self._returns: deque[float] = deque(maxlen=WINDOW)
        self._lengths: deque[int] = deque(maxlen=WINDOW)

    def record(self, batch: TensorDict) -> None:
        """Count the episodes that end in ``batch`` (any batch shape)."""
        done = batch.get(("next", "done")).reshape(-1)
        if not bool(done.any()):
            return
        returns = batch.get(("next", "episode_return")).reshape(-1)[done]
        lengths = batch.get(("next", "episode_length")).reshape(-1)[done]
        self.count += int(returns.numel())
        self._returns.extend(returns.tolist())
        self._lengths.extend(lengths.tolist())

    def stats(self) -> dict[str, Any]:
        """``count``, ``return_mean`` and ``length_mean`` (None before the first end)."""
        n = len(self._returns)
        return {
            "count": self.count,
            "return_mean": sum(self._returns) / n if n else None,
            "length_mean": sum(self._lengths) / n if n else None,
        }
