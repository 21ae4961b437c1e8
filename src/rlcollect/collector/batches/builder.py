"""What the chunk loop fills: batches built out of the ring's chunks, handed out in order.

Two builders share it: ``copied.py`` (batches of exactly ``frames_per_batch`` rows)
and ``rounds.py`` (on-policy ``[num_envs, T]`` rounds). ``loop.py`` drives either
through this interface alone: a chunk in (:meth:`ChunkBuilder.add_chunk`), finished
batches out (:attr:`ChunkBuilder.ready`, :meth:`ChunkBuilder.pop`) until the budget is
spent (:attr:`ChunkBuilder.exhausted`), and the slots lent to batches back
(:meth:`ChunkBuilder.returned`).

Each batch gets tensors of its own, allocated when the previous one is handed out: the
caller keeps a batch as long as it likes, and the ring's rows are copied once, straight
into them. Their memory is reused once the caller has let go of an earlier batch
(``memory.py``).
"""

from __future__ import annotations

import abc
import mmap
from collections import deque
from collections.abc import Mapping

import numpy as np
import torch

from rlcollect._tensordict import TensorDict
from rlcollect.collector.batches.memory import BatchMemory
from rlcollect.transports.layout import Field, Key, RingLayout

__all__ = ["ChunkBuilder"]


class ChunkBuilder(abc.ABC):
    """Copies chunks out of the ring into batches; finished batches wait in order."""

    def __init__(self, layout: RingLayout, ring: Mapping[Key, np.ndarray]) -> None:
        self._fields: tuple[Field, ...] = layout.fields
        self._ring = ring
        self._steps = layout.chunk_steps
        self._ready: deque[TensorDict] = deque()
        self._tensors: dict[Key, torch.Tensor] = {}  # the batch being built
        self._arrays: dict[Key, np.ndarray] = {}  # the same memory, for numpy's copies
        self.memory = BatchMemory(self._fields)

    @property
    def ready(self) -> int:
        """Number of finished batches waiting to be taken."""
        return len(self._ready)

    @property
    @abc.abstractmethod
    def exhausted(self) -> bool:
        """True once ``total_frames`` are all in batches, finished or being filled."""

    def pop(self) -> TensorDict:
        """The oldest finished batch."""
        return self._ready.popleft()

    @abc.abstractmethod
    def add_chunk(self, worker: int, slot: int) -> list[tuple[int, int]]:
        """Take chunk ``slot`` of ``worker`` towards the batches: the ``(worker, slot)``
        pairs copied out of the ring by now (their slots may be reused). A chunk not
        among them was lent to a batch (``loans.py``: :meth:`returned` says when its
        slot may be reused). A pooled ring's pairs are the places given out next, to
        whichever workers (``pooled.py``)."""

    @property
    def time_major(self) -> bool:
        """Batches are on-policy rounds laid out ``[T, num_envs]`` (``rounds.py``)."""
        return False

    @property
    def lent(self) -> int:
        """Batches handed out as views of the ring so far."""
        return 0

    @property
    def slot_wait_seconds(self) -> float:
        """Seconds workers have had no place of a pooled ring to write, summed over the
        workers, as the driver sees it (``pooled.py``); 0 for other rings."""
        return 0.0

    def returned(self) -> list[tuple[int, int]]:
        """The ``(worker, slot)`` pairs lent to batches nothing can reach any more."""
        return []

    def prefault(self) -> None:
        """Map every page of the batch being built now, before its rows arrive.

        A batch's tensors may be fresh memory (:meth:`_allocate`), and the kernel maps a
        page of it only when it is first written: for a large round (about 230 MB of
        Atari frames for 32 envs and 128 steps) those faults cost about as much as the
        copy itself. On-policy, every env waits for the round's copy before its next
        round starts, while the consumer has nothing to do during the round (chunks
        arrive at its end): so the chunk loop calls this then. One byte is written per
        page, each later overwritten by the copy; numpy writes them without the GIL.
        """
        for array in self._arrays.values():
            array.reshape(-1).view(np.uint8)[:: mmap.PAGESIZE] = 0

    def _allocate(self, rows: int) -> None:
        """Tensors of ``rows`` rows for the next batch, in memory no earlier batch still
        in use can reach; none once the budget is spent."""
        if rows == 0:
            self._tensors, self._arrays = {}, {}
            return
        arrays = self.memory.take(rows)
        self._tensors = {
            f.key: torch.from_numpy(a) for f, a in zip(self._fields, arrays, strict=True)
        }
        # Views through the tensors: only the tensors' storages hold the arrays themselves.
        self._arrays = {key: t.numpy() for key, t in self._tensors.items()}

    def _queue(self, shape: tuple[int, ...]) -> None:
        """Queue the batch built (its rows viewed as ``shape``), with ``("next", "done")``."""
        tensors = self._tensors
        done = tensors[("next", "terminated")] | tensors[("next", "truncated")]
        td = TensorDict(batch_size=list(shape))
        for key, value in tensors.items():
            td.set(key, value.view(*shape, *value.shape[1:]))
        td.set(("next", "done"), done.view(shape))
        self._ready.append(td)
