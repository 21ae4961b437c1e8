"""Ring batches: a chunk that is a whole batch goes out as a view of its ring slot.

Where one chunk holds exactly ``frames_per_batch`` rows (a single worker, such as one
vector env holding every env, with the default ``transition_chunk_size="auto"``), the
chunk's rows are the batch, in order, in one contiguous block of each field. Copying
them out (``batches.py``) costs the consuming thread about 0.01 ms of CPU per Pong frame
(67 KB), which on a machine whose cores all step envs is taken from the envs. So the
batch's tensors view the slot itself, and the slot goes back to its worker only once
the caller lets go of the batch::

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
the last of them: the same rule as ``batch_memory.py``. A batch caught in a reference
cycle keeps its slot until the garbage collector frees it.

Why the worker never stalls on a caller who keeps batches: at most ``slots - 2`` slots
of a worker are lent at once. The worker always has one slot to write and one more to
go on with once that one is full, as with copied batches (the ring has 4 slots where it
lends, against 2 otherwise: ``plan.py``); a chunk that would exceed the limit is copied
into memory of its own and its slot released at once. The common loop, ``for batch in
collector``, holds the previous batch while the next one is built, so it holds two.

Why a caller's batch survives ``close()``: the transport gives the ring's memory back at
once (``processes.release_mapping``) unless a lent batch is still alive (:meth:`alive`,
registered with ``processes.lend_pages`` by ``batches.py``); then the pages go when
the last view does.
"""

from __future__ import annotations

import mmap
import weakref
from collections.abc import Mapping, Sequence

import numpy as np

from rlcollect.transports.layout import Key

__all__ = ["LEND_SLOTS", "RingLoans", "ring_mapping"]

LEND_SLOTS = 4  # ring slots per worker where chunks are lent (see the module docstring)


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
