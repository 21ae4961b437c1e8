"""What ``train_ratio`` needs of a replay buffer: counts of the rows written and sampled.

The collector's ``train_ratio`` throttle holds collection back until the learner has
sampled its share of the rows collected, so it must learn how many rows were sampled,
and be woken when that changes. It asks that of the buffer through
:class:`CountsSamples`, never through its class: an :class:`~rlcollect.ReplayBuffer` is
one, and :class:`CountingBuffer` makes one of any buffer with ``extend`` and ``sample``
(a TorchRL ``TensorDictReplayBuffer``, a class of one's own) by counting the rows that
pass through it.
"""

from __future__ import annotations

import threading
from typing import Any, Protocol, runtime_checkable

from rlcollect._tensordict import TensorDict

__all__ = ["CountingBuffer", "CountsSamples"]


@runtime_checkable
class CountsSamples(Protocol):
    """A replay buffer ``train_ratio`` can throttle on.

    ``written`` and ``sampled`` count rows (not calls) since the buffer was made; the two
    waits block until a count reaches ``target`` or ``timeout`` seconds pass, and return
    whether it did. The collector writes from its own thread while the learner samples,
    so all five must be safe to call from two threads.

    Examples:
        >>> from rlcollect import ReplayBuffer
        >>> from rlcollect.replay import CountsSamples
        >>> isinstance(ReplayBuffer(100), CountsSamples)
        True
    """

    @property
    def written(self) -> int:
        """Rows written so far."""

    @property
    def sampled(self) -> int:
        """Rows sampled so far."""

    def wait_written(self, target: int, timeout: float) -> bool:
        """Block until ``written >= target``, at most ``timeout`` seconds."""

    def wait_sampled(self, target: int, timeout: float) -> bool:
        """Block until ``sampled >= target``, at most ``timeout`` seconds."""

    def __len__(self) -> int:
        """Rows stored now."""


class CountingBuffer:
    """Wraps a replay buffer with ``extend`` and ``sample`` so that it counts the rows
    written and sampled (:class:`CountsSamples`): pass the wrapper as ``replay_buffer=``
    with a ``train_ratio``, and sample through it.

    Args:
        buffer: the buffer: ``extend(batch)`` stores a TensorDict's rows,
            ``sample(*args, **kwargs)`` returns a TensorDict (its ``numel()`` rows are
            counted as sampled), ``len()`` the rows stored.

    Attributes:
        buffer: the wrapped buffer (sampling from it directly is not counted).

    Examples:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> from rlcollect.replay import CountingBuffer
        >>> class Rows:  # the smallest buffer: keeps every row, samples the first ones
        ...     def __init__(self):
        ...         self.data = None
        ...     def extend(self, batch):
        ...         self.data = batch if self.data is None else torch.cat([self.data, batch])
        ...     def sample(self, n):
        ...         return self.data[:n]
        ...     def __len__(self):
        ...         return 0 if self.data is None else self.data.numel()
        >>> buffer = CountingBuffer(Rows())
        >>> buffer.extend(TensorDict({"x": torch.arange(10)}, batch_size=[10]))
        >>> buffer.sample(4)["x"].tolist(), buffer.written, buffer.sampled, len(buffer)
        ([0, 1, 2, 3], 10, 4, 10)
    """

    def __init__(self, buffer: Any) -> None:
        for method in ("extend", "sample"):
            if not callable(getattr(buffer, method, None)):
                raise TypeError(
                    f"CountingBuffer wraps a buffer with extend() and sample(); "
                    f"{type(buffer).__name__} has no {method}()"
                )
        self.buffer = buffer
        self._written = 0
        self._sampled = 0
        self._cond = threading.Condition()

    @property
    def written(self) -> int:
        """Rows written through :meth:`extend`."""
        return self._written

    @property
    def sampled(self) -> int:
        """Rows sampled through :meth:`sample`."""
        return self._sampled

    def __len__(self) -> int:
        return len(self.buffer)

    def extend(self, batch: TensorDict) -> Any:
        """Store ``batch`` in the wrapped buffer and count its rows as written."""
        out = self.buffer.extend(batch)
        with self._cond:
            self._written += batch.numel()
            self._cond.notify_all()
        return out

    def sample(self, *args: Any, **kwargs: Any) -> Any:
        """Sample from the wrapped buffer; the rows returned count as sampled."""
        out = self.buffer.sample(*args, **kwargs)
        rows = out.numel() if hasattr(out, "numel") else len(out)
        with self._cond:
            self._sampled += int(rows)
            self._cond.notify_all()
        return out

    def wait_written(self, target: int, timeout: float) -> bool:
        """Block until ``written >= target`` or ``timeout`` seconds pass."""
        with self._cond:
            return self._cond.wait_for(lambda: self._written >= target, max(0.0, timeout))

    def wait_sampled(self, target: int, timeout: float) -> bool:
        """Block until ``sampled >= target`` or ``timeout`` seconds pass."""
        with self._cond:
            return self._cond.wait_for(lambda: self._sampled >= target, max(0.0, timeout))
