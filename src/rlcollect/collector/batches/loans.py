"""Lent batches: a batch that lies whole in the ring goes out as a view of it.

Two kinds of batch lie whole in the ring (the plan's delivery, ``delivery.py``, says
whether a collector lends, and which):

* ``"chunk"``: one chunk holds exactly ``frames_per_batch`` rows (a single worker, such
  as one vector env holding every env, with the default ``transition_chunk_size=
  "auto"``): the chunk's rows are the batch, in order, one contiguous block of each
  field.
* ``"pool"``: envs stepped one by one, where one chunk of each worker, times the
  number of workers, is exactly ``frames_per_batch`` rows. The ring is then pooled
  (``transports/layout.py``): any worker writes any slot, and every ``num_workers``
  consecutive slots are one contiguous block, a batch; ``pooled.py`` says who gets
  which slot.

Copying a batch out (``copied.py``) costs the consuming thread CPU time per frame in
proportion to the observation's size, and on a machine whose cores all step envs that
time is taken from the envs. So the batch's tensors view the ring itself, and its slots
go back to their workers only once the caller lets go of the batch (a chunk's lending
is drawn; a block's is the same, its slots given out again at once)::

    worker hands over (w, s) ──▶ BatchBuilder.add_chunk: a slot of a whole batch, and
                                 RingLoans.can_lend(w)? ── no ──▶ copied, released now
                                        │ yes
                                        ▼
                                 torch.from_numpy(view of slot s): the batch
                                 RingLoans.lend(w, s, views)
                                        │ the caller drops the batch (every tensor,
                                        ▼ view and TensorDict of it)
    release(w, s) ◀── ChunkLoop ◀── RingLoans.returned(): every weak reference to the
                                    slot's arrays is dead

Why the slot is never written while the caller can still read it: the loan's arrays are
referenced only by their tensors' storages (``torch.from_numpy`` holds its array until
the storage is freed), and everything that can read the batch holds such a storage (a
tensor and its views, a TensorDict, ``tensor.numpy()``, whose base is the tensor). The
worker writes slot ``s`` again only after ``release(w, s)``, which follows the death of
the last of them: the same rule as ``memory.py``. A batch caught in a reference cycle
keeps its slot until the garbage collector frees it.

Why the worker never stalls on a caller who keeps batches: at most ``slots - 2`` slots
of a worker (or blocks of a pooled ring) are lent at once. The worker always has one
slot to write and one more to go on with once that one is full, as with copied batches
(the ring has more slots where it lends: ``delivery.py``); a batch that would exceed
the limit is copied into memory of its own and its slots released at once. The common
loop, ``for batch in collector``, holds the previous batch while the next one is built,
so it holds two. A pooled ring has more blocks than a worker's ring has slots: the slots
its workers hold and write span three blocks, and a block is free again only once its
every slot is in (``delivery.py`` says how many; ``docs/decisions/`` how that was
measured). The loans still go up to ``slots - 2``: a burst of chunks can finish a third
or fourth block while the loop holds two, and those are lent too; the workers are short
of slots only while that lasts.

Why a caller's batch survives ``close()``: the transport gives the ring's memory back at
once (``processes.release_mapping``) unless a lent batch is still alive (:meth:`alive`,
registered with ``processes.lend_pages`` by ``copied.py``); then the pages go when the
last view does.
"""

from __future__ import annotations

import mmap
import weakref
from collections.abc import Mapping, Sequence
from typing import Literal

import numpy as np

from rlcollect.transports.layout import Key

__all__ = ["Lending", "RingLoans", "ring_mapping"]

Lending = Literal["", "chunk", "pool"]
"""How batches view the ring: ``"chunk"``, a worker's chunk is a batch; ``"pool"``, a
block of a pooled ring is; ``""``, every batch is copied out."""


class RingLoans:
    """Ring slots lent out as batches, until the caller lets go of them."""

    def __init__(self, num_workers: int, slots: int) -> None:
        if slots < 3:
            raise ValueError(f"lending needs at least 3 slots per worker, got {slots}")
        self._limit = slots - 2
        self._lent = [0] * num_workers  # slots of each worker out as batches
        self._out: list[tuple[int, int, list[weakref.ref[np.ndarray]]]] = []
        self.count = 0  # batches lent so far (statistics, tests)

    def can_lend(self, worker: int) -> bool:
        """True if one more of ``worker``'s slots may go out as a batch."""
        return self._lent[worker] < self._limit

    def lend(self, worker: int, slot: int, arrays: Sequence[np.ndarray]) -> None:
        """Lend ``slot`` of ``worker`` as a batch whose tensors hold ``arrays``."""
        self._out.append((worker, slot, [weakref.ref(a) for a in arrays]))
        self._lent[worker] += 1
        self.count += 1

    def returned(self) -> list[tuple[int, int]]:
        """The lent ``(worker, slot)`` pairs nothing can reach any more; they are the
        workers' again once the caller of this releases them."""
        back, out = [], []
        for worker, slot, refs in self._out:
            if all(ref() is None for ref in refs):
                back.append((worker, slot))
                self._lent[worker] -= 1
            else:
                out.append((worker, slot, refs))
        self._out = out
        return back

    def alive(self) -> bool:
        """True while a lent batch can still be read."""
        return any(ref() is not None for _, _, refs in self._out for ref in refs)


def ring_mapping(views: Mapping[Key, np.ndarray]) -> mmap.mmap | None:
    """The mmap under a ring's arrays (both built-in transports map one), or None."""
    base: object = next(iter(views.values()))
    while isinstance(base, (np.ndarray, memoryview)):
        base = base.base if isinstance(base, np.ndarray) else base.obj
    return base if isinstance(base, mmap.mmap) else None
