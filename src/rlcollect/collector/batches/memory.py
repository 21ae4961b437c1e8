"""Batch memory: every batch gets memory of its own, reused once nothing can reach it.

A batch's tensors stay valid as long as the caller keeps any of them (a training step, a
replay buffer holding views, a list of past batches), so the next batch may never be
written over them. Fresh memory for every batch is correct but not free: the kernel maps
it page by page on first write, and for pixel batches those faults cost about as much as
the copy that fills them (measured: ``docs/decisions/``). So a batch's memory goes
round::

    ChunkBuilder._allocate ── BatchMemory.take(rows) ──▶ one buffer: a free one of this
            ▲                                            size, else a new one; one array
            │                                            per field, each a view of it
            │                                              │ torch.from_numpy(array): the
            │                                              ▼ tensor's storage holds it
    the free list ◀── take() finds every weak reference ◀── the caller lets go of the
    (at most KEEP)    to the buffer's arrays dead            whole batch (and the builder,
                                                             once the batch is queued)

Why this never hands out memory still in use: the field arrays are referenced only by
their tensors' storages (``torch.from_numpy`` holds its array until the storage is freed)
and by the builder while it fills them. Everything that can read a batch holds a storage:
a tensor and its views, a TensorDict, ``tensor.numpy()`` (its base is the tensor). Nothing
else is given the arrays, so no numpy view can outlive them by pointing at the buffer
directly. ``take`` reuses a buffer only once a weak reference to each of its arrays is
dead, that is once no storage, and so no view, of it is left; reference counting frees
them the moment the last one goes (a batch caught in a reference cycle waits for the
garbage collector, and its buffer is only reused later). Only the consuming thread calls
``take``; the references die in whatever thread drops a batch, and reading a weak
reference is atomic.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import numpy as np

from rlcollect.transports.layout import Field

__all__ = ["BatchMemory"]

KEEP = 2  # free buffers kept for reuse; more are given back to the allocator
_ALIGN = 64  # each field starts on a cache line


class BatchMemory:
    """Hands out each batch's field arrays, in buffers reused once let go."""

    def __init__(self, fields: Sequence[Field]) -> None:
        self._fields = tuple(fields)
        self._row_bytes = [int(np.prod(f.shape, dtype=np.int64)) * f.dtype.itemsize for f in fields]
        self._out: list[tuple[np.ndarray, list[weakref.ref[np.ndarray]]]] = []
        self._free: list[np.ndarray] = []
        self.reused = 0  # buffers handed out again (statistics, tests)

    def take(self, rows: int) -> list[np.ndarray]:
        """One array per field of ``rows`` rows, in memory no earlier batch can reach."""
        offsets, size = self._offsets(rows)
        self._collect()
        buffer = next((b for b in self._free if b.nbytes == size), None)
        if buffer is None:
            buffer = np.empty(size, dtype=np.uint8)
        else:
            self._free.remove(buffer)
            self.reused += 1
        arrays = [
            buffer[start : start + rows * n].view(f.dtype).reshape(rows, *f.shape)
            for f, n, start in zip(self._fields, self._row_bytes, offsets, strict=True)
        ]
        self._out.append((buffer, [weakref.ref(a) for a in arrays]))
        return arrays

    def _collect(self) -> None:
        """Move the buffers nothing can reach any more to the free list."""
        out = []
        for buffer, refs in self._out:
            if all(ref() is None for ref in refs):
                self._free.append(buffer)
            else:
                out.append((buffer, refs))
        self._out = out
        del self._free[:-KEEP]  # the most recently freed are kept

    def _offsets(self, rows: int) -> tuple[list[int], int]:
        offsets, size = [], 0
        for n in self._row_bytes:
            offsets.append(size)
            size += -(-rows * n // _ALIGN) * _ALIGN
        return offsets, size
