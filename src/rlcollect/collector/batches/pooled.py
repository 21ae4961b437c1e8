"""Batches that are blocks of a pooled ring: lent as views, and no worker waits for another.

Where one chunk of every worker makes exactly ``frames_per_batch`` rows (``"pool"`` in
``loans.py``), the ring is pooled (``transports/layout.py``): its ``num_workers *
slots`` chunk buffers are *places* that any worker may write, and every ``num_workers``
consecutive places are one contiguous *block*, the size of a batch. A worker's credit
names the place it writes next. The driver gives the places out a block at a time, in
one sequence, each to the worker that asks first (a worker asks by handing a place
over), and takes them into batches in the order of that sequence::

    worker w hands place b over ──▶ w is in line for a place
                                      │
                                      ▼
      the next num_workers places of the sequence are one block, all written?
          │ yes                                        │ no
          ▼                                            ▼
      RingLoans.can_lend?                    a batch is half copied, or more workers
        │ yes          │ no                  are in line than places are free?
        ▼              ▼                       │ yes                         │ no
      the batch      one copy of the block;    ▼                             ▼
      views the      its places free again   copy the first written place  (wait)
      block: lent    at once                 of the sequence into the batch
                                             (a block's places are free
                                             again once all are copied)

    the workers in line get the free places in turn; a block lent comes back, its
    places free again, once nothing can reach the batch

Why no worker waits for a slower one: a worker that hands a place over is given the
next free place, whichever block it is in, so fast workers write more places than slow
ones, and a block needs only the places given out for it, not a chunk of every worker.
Each worker holds two places (``RingLayout.first_credits``): the one it writes and the
next, so it does not wait for the driver while the driver keeps up. The oldest block
does wait for its slowest place (blocks are batches in order), but only while every
worker still has a place to go on with: once a worker would wait, the written places
are copied without the slow one, as a copying collector would (a stalled env is
reported by ``stall_timeout``). Blocks are lent again as soon as the sequence is back
at a block's first place with every place written, which is when the slow place has
been copied too.

What that wait costs is counted: a worker that has handed over both its places has
nothing to write until it is given one, and the seconds from its second hand-over to
then, summed over the workers, are ``stats()["slot_wait_seconds"]`` (as the driver
sees them: each end a pipe's latency late). Copying the written places lets the batch
go on, but frees no place of a block until its slow place is in too.

Why every env's stream stays in order: a worker writes its places in the order it is
given them (``names_slots``), and places are taken into batches in the order they were
given, except that a copy passes over places still being written. Those are the
writing worker's last places, so its later chunks are not taken before them. Within a
block, a worker's places are in the order it was given them too. A batch cut short by
``total_frames`` keeps its first places, so every stream is cut at one point. A chunk
handed over for a place the worker was not given is a ``CollectorError``, never a
batch of mixed steps.

Why a place is never written while a batch may still read it: a block's places are
given out again only once every one of them is copied, or once nothing can reach the
batch lent from it (``loans.py``, one loan per block: at most ``slots - 2`` of the
ring's six blocks are lent, so the workers always have two, and four or more while the
caller holds no more than the loop does).
"""

from __future__ import annotations

import time
from collections import deque

import numpy as np
import torch

from rlcollect.collector.batches.copied import BatchBuilder
from rlcollect.collector.batches.loans import Lending, RingLoans
from rlcollect.errors import CollectorError
from rlcollect.transports.layout import RingLayout

__all__ = ["PoolBatchBuilder"]

_now = time.perf_counter  # (a name of its own: the tests give the builder a clock)


class PoolBatchBuilder(BatchBuilder):
    """Hands a pooled ring's places out, and its written blocks in as batches (built as
    a :class:`BatchBuilder` with ``lend="pool"``)."""

    def _start_lending(
        self, layout: RingLayout, lend: Lending, frames_per_batch: int
    ) -> RingLoans | None:
        if lend != "pool" or not layout.pooled:
            raise ValueError("a block of places is a batch only in a pooled ring, lend='pool'")
        self._layout = layout
        self._width = width = layout.num_workers  # places per block
        # The sequence: places given out and not yet taken into a batch, in the order
        # they were given (each worker's own places in the order it writes them).
        self._given: deque[int] = deque(range(2 * width))  # every worker's first two
        self._holder: dict[int, int] = {}  # place given out, not handed over: its worker
        for w in range(width):
            for place in layout.first_credits(w):
                self._holder[place] = w
        self._written: set[int] = set()  # handed over, not yet taken
        self._taken = [0] * layout.slots  # places of each block copied out
        self._free: deque[int] = deque(range(2 * width, layout.credited_slots))  # whole blocks
        self._wanting: deque[int] = deque()  # workers owed a place, in line
        # A worker owed as many places as it holds at the start has none left to write:
        # from then until it is given one it waits (slot_wait_seconds).
        self._holds = len(layout.first_credits(0))
        self._owed = [0] * width
        self._waiting_since: dict[int, float] = {}
        self._waited = 0.0
        return super()._start_lending(layout, lend, frames_per_batch)

    @property
    def slot_wait_seconds(self) -> float:
        now = _now()
        # (a tuple first: stats() may read this from another thread than the one adding)
        return self._waited + sum(now - t for t in tuple(self._waiting_since.values()))

    def returned(self) -> list[tuple[int, int]]:
        for _, block in super().returned():  # one loan per block, all as worker 0's
            self._free_block(block)
        return self._serve()

    def add_chunk(self, worker: int, slot: int) -> list[tuple[int, int]]:
        if not self._size:  # total_frames are all in batches: nothing more is read
            return [(worker, slot)]
        holder = self._holder.pop(slot, None)
        if holder != worker:
            raise CollectorError(
                f"worker {worker} handed over place {slot} of the pooled ring, which was "
                f"given to {'no worker' if holder is None else f'worker {holder}'}: its "
                "transport's credits do not name the places they give (names_slots)"
            )
        self._written.add(slot)
        self._wanting.append(worker)  # owed the next place
        self._owed[worker] += 1
        if self._owed[worker] == self._holds:
            self._waiting_since[worker] = _now()
        while self._size:
            block = self._whole_block() if self._filled == 0 else None
            if block is not None:
                self._take(block)
            elif self._written and (self._filled or len(self._wanting) > len(self._free)):
                # A batch half copied is finished first; and where a worker would wait
                # for a place, the written places are copied without the slowest one.
                self._copy_next()
            else:
                break
        return self._serve()

    def _whole_block(self) -> int | None:
        """The block whose places are the next ``width`` of the sequence, all written."""
        given, width = self._given, self._width
        if len(given) < width or given[0] % width or given[width - 1] != given[0] + width - 1:
            return None  # (places of a block are given in order, so these are all of it)
        first = given[0]
        if not all(place in self._written for place in range(first, first + width)):
            return None
        return first // width

    def _take(self, block: int) -> None:
        """Block ``block`` is the batch: lent where the loans allow, else one copy."""
        assert self._loans is not None
        for _ in range(self._width):
            self._written.discard(self._given.popleft())
        arrays = [self._layout.block(self._ring, f.key, block) for f in self._fields]
        if self._loans.can_lend(0):
            # New views: only the batch's tensors hold them (the weak-reference rule).
            arrays = [a[: self._size] for a in arrays]
            self._loans.lend(0, block, arrays)
            self._tensors = {
                f.key: torch.from_numpy(a) for f, a in zip(self._fields, arrays, strict=True)
            }
            self._batches_lent += 1
            self._queue((self._size,))
            self._new_batch()
            return
        self._allocate(self._size)
        for f, a in zip(self._fields, arrays, strict=True):
            np.copyto(self._arrays[f.key], a[: self._size])
        self._queue((self._size,))
        self._new_batch()
        self._free_block(block)

    def _copy_next(self) -> None:
        """Copy the first written place of the sequence into the batch being built.

        Places it passes over are being written: a worker writes its places in the
        order it was given them, so every place of that worker after them is too, and
        each worker's chunks still go out in the order it wrote them."""
        place = next(p for p in self._given if p in self._written)
        self._given.remove(place)
        self._written.discard(place)
        self._copy_chunk(*divmod(place, self._layout.slots))  # worker-major memory
        block = place // self._width
        self._taken[block] += 1
        if self._taken[block] == self._width:
            self._free_block(block)

    def _free_block(self, block: int) -> None:
        """Block ``block`` is nobody's: its places go out again, last in the sequence."""
        self._taken[block] = 0
        self._free.extend(range(block * self._width, (block + 1) * self._width))

    def _serve(self) -> list[tuple[int, int]]:
        """Give free places to the workers in line, in turn."""
        given = []
        while self._wanting and self._free:
            worker, place = self._wanting.popleft(), self._free.popleft()
            if self._owed[worker] == self._holds:
                self._waited += _now() - self._waiting_since.pop(worker)
            self._owed[worker] -= 1
            self._given.append(place)
            self._holder[place] = worker
            given.append((worker, place))
        return given
