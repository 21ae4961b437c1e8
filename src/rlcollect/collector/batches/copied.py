"""Turning handed-over chunks into batches of exactly ``frames_per_batch`` transitions.

Every row is copied once, from the ring straight into the tensor that is yielded: a
chunk fills the batch being built, and what does not fit starts the next one. The ring
slot goes back to its worker as soon as it is copied. Chunks of one worker arrive in
order and are consumed in order, and a chunk's rows are laid out step-major, so a batch
boundary (or the end of ``total_frames``) cuts every env's stream at one point: no gap,
no duplicate.

Where a chunk is a whole batch and the plan lends it (``"chunk"``, ``loans.py``), no row
is copied: the batch views the chunk's slot, which goes back to its worker once the
caller lets go of the batch. Where a block of a pooled ring is a batch (``"pool"``),
``pooled.py`` builds them.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

from rlcollect.collector.batches.builder import ChunkBuilder
from rlcollect.collector.batches.loans import Lending, RingLoans, ring_mapping
from rlcollect.processes import lend_pages
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
        lend: Lending = "",
    ) -> None:
        super().__init__(layout, ring)
        self._rows_per_chunk = layout.chunk_steps * layout.columns
        self._batches_lent = 0
        self._loans = self._start_lending(layout, lend, frames_per_batch)
        self._fpb = frames_per_batch
        self._remaining = total_frames  # rows still to assign to batches; -1: endless
        self._size = 0
        self._filled = 0
        self._new_batch()

    def _start_lending(
        self, layout: RingLayout, lend: Lending, frames_per_batch: int
    ) -> RingLoans | None:
        """The loans of ``lend`` (None: every batch copied), once ``lend`` is checked
        against the layout; a builder for one kind of lending sets itself up here."""
        if not lend:
            return None
        rows = self._rows_per_chunk * (layout.num_workers if lend == "pool" else 1)
        if rows != frames_per_batch:
            raise ValueError(
                f"a {lend} of {rows} rows is not a batch of {frames_per_batch}: only "
                "whole batches are lent"
            )
        # A pooled ring's loans are blocks, all counted as worker 0's.
        loans = RingLoans(1 if lend == "pool" else layout.num_workers, layout.slots)
        mapping = ring_mapping(self._ring)
        if mapping is not None:
            # The caller's batches outlive close(): the transport must not free the
            # ring's pages under them (processes.release_mapping). The test holds weak
            # references only, never the ring.
            lend_pages(mapping, loans.alive)
        return loans

    @property
    def exhausted(self) -> bool:
        """True once every row of ``total_frames`` has been assigned to a batch."""
        return self._size == 0

    @property
    def lent(self) -> int:
        return self._batches_lent

    def returned(self) -> list[tuple[int, int]]:
        return [] if self._loans is None else self._loans.returned()

    def add_chunk(self, worker: int, slot: int) -> list[tuple[int, int]]:
        if self._loans is not None and self._size and self._loans.can_lend(worker):
            self._lend(worker, slot, self._loans)
            return []
        self._copy_chunk(worker, slot)
        return [(worker, slot)]

    def _copy_chunk(self, worker: int, slot: int) -> None:
        """Copy chunk ``slot`` of ``worker`` into the batches being built."""
        rows = self._rows_per_chunk
        start = slot * self._steps
        taken = 0
        while taken < rows and self._size:
            n = min(rows - taken, self._size - self._filled)
            if not self._arrays:
                self._allocate(self._size)  # a batch's memory is taken at its first rows
            for field in self._fields:
                src = self._ring[field.key][worker, start : start + self._steps]
                dst = self._arrays[field.key][self._filled : self._filled + n]
                if n == rows:  # the whole chunk: one copy, in any ring memory order
                    np.copyto(dst.reshape(src.shape), src)
                else:
                    np.copyto(dst, src.reshape(rows, *field.shape)[taken : taken + n])
            taken += n
            self._filled += n
            if self._filled == self._size:
                self._queue((self._size,))
                self._new_batch()
        # Rows past total_frames (taken < rows here) are the end of every stream: dropped.

    def _lend(self, worker: int, slot: int, loans: RingLoans) -> None:
        """The batch being built is the chunk ``slot`` of ``worker`` itself: its first
        ``size`` rows (fewer than the chunk only at the end of ``total_frames``, where
        the rest are the end of every stream, as in ``add_chunk``)."""
        assert self._filled == 0  # a chunk is a whole batch: batches start with chunks
        start = slot * self._steps
        rows = self._rows_per_chunk
        arrays = [
            self._ring[f.key][worker, start : start + self._steps].reshape(rows, *f.shape)
            for f in self._fields
        ]
        arrays = [a[: self._size] for a in arrays]  # new views: only the tensors hold them
        loans.lend(worker, slot, arrays)
        self._batches_lent += 1
        self._tensors = {
            f.key: torch.from_numpy(a) for f, a in zip(self._fields, arrays, strict=True)
        }
        self._queue((self._size,))
        self._new_batch()

    def _new_batch(self) -> None:
        size = self._fpb if self._remaining < 0 else min(self._fpb, self._remaining)
        if self._remaining > 0:
            self._remaining -= size
        self._size = size
        self._filled = 0
        self._tensors, self._arrays = {}, {}  # taken at the batch's first copied rows
