"""Batches of one slot of every worker, viewed in the ring where they can be.

Where one slot of every worker holds exactly ``frames_per_batch`` rows (``"slot"`` in
``loans.py``), the ring is laid out position-major (``transports/layout.py``) and that
slot of every worker is one contiguous block: the batch, rows ordered by step, then
worker, then env. So the workers' chunks of a slot wait for each other, and the slot
goes out whole::

    (w, s) handed over ──▶ waiting ──▶ the oldest open slot has every worker's chunk,
                                       and no batch is half built?
                                          │ yes                      │ no
                                          ▼                          ▼
                               RingLoans.can_lend?         a worker has at most one
                                 │ yes       │ no          slot it may still write, and
                                 ▼           ▼             the waiting chunks fill the
                     the batch views   one copy of the     batch? yes: copy them in the
                     the block: lent   block                order they came (a straggler
                                                            holds no rows back)

    slot s goes back to every worker at once: once each worker's chunk of it is copied,
    or the batch lent from it is let go of

Why a slot's chunks are each worker's chunk of the same turn: a worker writes the slot
its credit names (``names_slots``), and every worker's credits come back in the same
order, since a slot goes back only as a slot of every worker, at once. Credits start as
``0, 1, ...`` for every worker. So all workers hand their chunks over in one shared
sequence of slots, the ``n``-th chunk of each in its ``n``-th entry, and the oldest open
slot (the first of the sequence not yet lent or copied whole) holds each worker's oldest
chunk not yet taken: lending it, or copying chunks in the order they came, keeps every
env's stream in order. A chunk out of that sequence (a transport whose credits do not
name the slot they give back) is a ``CollectorError``, never a batch of mixed steps.

Why nothing waits for good: a slot is lent only whole, so it waits for the slowest
worker's chunk. While every worker can still go on writing, that costs the caller
latency only. Once a worker is down to its last slot (the first group of a worker with
``worker_splits`` takes the next slot before the last group hands the current one
over), the waiting chunks are copied as soon as they fill the batch being built, in the
order they came, as an ordinary copying collector would. Their slots still go back only
once every worker's chunk of the slot is in: a worker ahead of the slowest by ``slots -
1`` chunks (fewer while the caller holds lent batches) waits for its credit. That is the
price of lending: envs of one kind keep pace, and a stalled env is reported by
``stall_timeout``; for envs of very different speeds, a ``transition_chunk_size`` below
``frames_per_batch // num_envs`` copies every batch and ties no worker to another.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping

import numpy as np
import torch

from rlcollect.collector.batches import BatchBuilder
from rlcollect.errors import CollectorError
from rlcollect.transports.layout import Key, RingLayout

__all__ = ["SlotBatchBuilder"]


class SlotBatchBuilder(BatchBuilder):
    """Lends (or copies) one slot of every worker as one batch, in a position-major ring."""

    def __init__(
        self,
        layout: RingLayout,
        ring: Mapping[Key, np.ndarray],
        *,
        frames_per_batch: int,
        total_frames: int,
    ) -> None:
        if layout.num_workers > 1 and not layout.position_major:
            raise ValueError("a slot of every worker is one batch only in a position_major ring")
        super().__init__(
            layout, ring, frames_per_batch=frames_per_batch, total_frames=total_frames, lend="slot"
        )
        self._layout = layout
        self._workers = layout.num_workers
        self._slots = layout.slots
        # The shared sequence of credits, from the oldest one a worker may still hand
        # over (``_passed`` entries before it are dropped), and each worker's place in it.
        self._credits: deque[int] = deque(range(layout.slots))
        self._passed = 0
        self._place = [0] * self._workers
        self._open: deque[int] = deque(range(layout.slots))  # neither lent nor copied whole
        self._waiting: deque[tuple[int, int]] = deque()  # handed over, not taken: (w, s)
        self._waiting_in = {s: 0 for s in range(layout.slots)}  # waiting chunks per slot
        self._copied_in = {s: 0 for s in range(layout.slots)}  # chunks copied, per slot
        self._held = [0] * self._workers  # each worker's slots the driver holds

    def returned(self) -> list[tuple[int, int]]:
        back = super().returned()
        for slot in dict.fromkeys(s for _, s in back):  # in the order they are released
            self._give_back(slot)
        return back

    def add_chunk(self, worker: int, slot: int) -> list[tuple[int, int]]:
        if not self._size:  # total_frames are all in batches: nothing more is taken
            return [(worker, slot)]
        self._check_turn(worker, slot)
        self._waiting.append((worker, slot))
        self._waiting_in[slot] += 1
        self._held[worker] += 1
        released: list[tuple[int, int]] = []
        while self._size:
            oldest = self._open[0] if self._open else None
            if (
                self._filled == 0
                and oldest is not None
                and self._waiting_in[oldest] == self._workers
            ):
                self._open.popleft()
                released += self._take_slot(oldest)
            elif self._must_copy():
                released += self._copy_waiting()
            else:
                break
        return released

    def _check_turn(self, worker: int, slot: int) -> None:
        place = self._place[worker] - self._passed
        expected = self._credits[place] if place < len(self._credits) else None
        if slot != expected:
            raise CollectorError(
                f"worker {worker} handed over slot {slot} where slot {expected} was next: "
                "its transport's credits do not name the slots they give back (names_slots)"
            )
        self._place[worker] += 1
        while min(self._place) > self._passed:  # every worker is past the oldest credit
            self._credits.popleft()
            self._passed += 1

    def _must_copy(self) -> bool:
        """The waiting chunks fill the batch being built, and a worker may be about to
        wait for a slot: copy rather than hold its rows back."""
        missing = self._size - self._filled
        if len(self._waiting) * self._rows_per_chunk < missing:
            return False
        return max(self._held) >= self._slots - 1

    def _take_slot(self, slot: int) -> list[tuple[int, int]]:
        """The whole slot is the batch: lent where the loans allow, else one copy."""
        self._waiting = deque(pair for pair in self._waiting if pair[1] != slot)
        self._waiting_in[slot] = 0
        assert self._loans is not None
        blocks = [self._layout.slot_block(self._ring, f.key, slot) for f in self._fields]
        if all(self._loans.can_lend(w) for w in range(self._workers)):
            # New views: only the batch's tensors hold them (the weak-reference rule).
            arrays = [block[: self._size] for block in blocks]
            for w in range(self._workers):
                self._loans.lend(w, slot, arrays)
            self._tensors = {
                f.key: torch.from_numpy(a) for f, a in zip(self._fields, arrays, strict=True)
            }
            self._batches_lent += 1
            self._queue((self._size,))
            self._new_batch()
            return []
        self._allocate(self._size)
        for f, block in zip(self._fields, blocks, strict=True):
            np.copyto(self._arrays[f.key], block[: self._size])
        self._queue((self._size,))
        self._new_batch()
        return self._give_back(slot)

    def _copy_waiting(self) -> list[tuple[int, int]]:
        """Copy waiting chunks, in the order they came, until the batch being built is
        full; the slots every worker's chunk of which is now copied go back."""
        released: list[tuple[int, int]] = []
        batches = self.ready
        while self._waiting and self.ready == batches and self._size:
            worker, slot = self._waiting.popleft()
            self._waiting_in[slot] -= 1
            self._copy_chunk(worker, slot)
            self._copied_in[slot] += 1
            if self._copied_in[slot] == self._workers:
                assert self._open[0] == slot  # slots are copied whole in sequence order
                self._open.popleft()
                self._copied_in[slot] = 0
                released += self._give_back(slot)
        return released

    def _give_back(self, slot: int) -> list[tuple[int, int]]:
        """Slot ``slot`` of every worker is free: its next turn in the shared sequence."""
        self._credits.append(slot)
        self._open.append(slot)
        for w in range(self._workers):
            self._held[w] -= 1
        return [(w, slot) for w in range(self._workers)]
