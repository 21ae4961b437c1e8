"""Turning handed-over chunks into batches of exactly ``frames_per_batch`` transitions.

Every row is copied once, from the ring straight into the tensor that is yielded: a
chunk fills the batch being built, and what does not fit starts the next one. The ring
slot goes back to its worker as soon as it is copied. Chunks of one worker arrive in
order and are consumed in order, and a chunk's rows are laid out step-major, so a batch
boundary (or the end of ``total_frames``) cuts every env's stream at one point: no gap,
no duplicate.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from rlcollect.collector.builder import ChunkBuilder
from rlcollect.transports.layout import Key, RingLayout

__all__ = ["BatchBuilder"]


class BatchBuilder(ChunkBuilder):
    """Copies chunks out of the ring into batches of the sizes the budget calls for."""

    def __init__(
        self,
        layout: RingLayout,
        ring: Mapping[Key, np.ndarray],
        *,
        frames_per_batch: int,
        total_frames: int,
    ) -> None:
        super().__init__(layout, ring)
        self._rows_per_chunk = layout.chunk_steps * layout.envs_per_worker
        self._fpb = frames_per_batch
        self._remaining = total_frames  # rows still to assign to batches; -1: endless
        self._size = 0
        self._filled = 0
        self._new_batch()

    @property
    def exhausted(self) -> bool:
        """True once every row of ``total_frames`` has been assigned to a batch."""
        return self._size == 0

    def add_chunk(self, worker: int, slot: int) -> None:
        rows = self._rows_per_chunk
        start = slot * self._steps
        taken = 0
        while taken < rows and self._size:
            n = min(rows - taken, self._size - self._filled)
            for field in self._fields:
                src = self._ring[field.key][worker, start : start + self._steps]
                src = src.reshape(rows, *field.shape)
                dst = self._arrays[field.key]
                np.copyto(dst[self._filled : self._filled + n], src[taken : taken + n])
            taken += n
            self._filled += n
            if self._filled == self._size:
                self._queue((self._size,))
                self._new_batch()
        # Rows past total_frames (taken < rows here) are the end of every stream: dropped.

    def _new_batch(self) -> None:
        size = self._fpb if self._remaining < 0 else min(self._fpb, self._remaining)
        if self._remaining > 0:
            self._remaining -= size
        self._size = size
        self._filled = 0
        self._allocate(size)
