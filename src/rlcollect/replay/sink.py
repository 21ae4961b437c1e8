"""What a collector writes its batches into: anything with ``extend(batch)``."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from rlcollect._tensordict import TensorDict

__all__ = ["SupportsExtend"]


@runtime_checkable
class SupportsExtend(Protocol):
    """The type of a collector's ``replay_buffer=``: an object with ``extend(batch)``.

    The collector calls ``extend`` once per batch, from the thread that produces the
    batch, before it yields the batch (or, collecting in the background, instead). An
    :class:`~rlcollect.replay.buffer.ReplayBuffer` is one; so is a TorchRL replay
    buffer, or a class of one's own. What ``extend`` returns is ignored.

    Examples:
        >>> from rlcollect import ReplayBuffer
        >>> from rlcollect.replay import SupportsExtend
        >>> isinstance(ReplayBuffer(100), SupportsExtend)
        True
        >>> class CountFrames:  # keeps nothing, counts what it is given
        ...     def __init__(self):
        ...         self.frames = 0
        ...     def extend(self, batch):
        ...         self.frames += batch.numel()
        >>> isinstance(CountFrames(), SupportsExtend)
        True
    """

    def extend(self, batch: TensorDict, /) -> object:
        """Take ``batch`` (a TensorDict of batch size ``[frames_per_batch]``)."""
