"""Ring batches: a batch that lies whole in the ring goes out as a view of it.

Two kinds of batch lie whole in the ring (:func:`lending` says which a collector lends):

* ``"chunk"``: one chunk holds exactly ``frames_per_batch`` rows (a single worker, such
  as one vector env holding every env, with the default ``transition_chunk_size=
  "auto"``): the chunk's rows are the batch, in order, one contiguous block of each
  field.
* ``"pool"``: envs stepped one by one, where one chunk of each worker's size, times the
  number of workers, is exactly ``frames_per_batch`` rows (``"auto"`` gives each env
  ``frames_per_batch // num_envs`` steps where that is at most 64). The ring is then
  pooled (``transports/layout.py``): any worker writes any place, and every
  ``num_workers`` consecutive places are one contiguous block, a batch;
  ``pooled.py`` says who gets which place.

Copying a batch out (``copied.py``) costs the consuming thread about 0.01 ms of CPU per
Pong frame (67 KB) on the H200 (0.02-0.04 ms on 2 cores), which on a machine whose cores
all step envs is taken from the envs. So the batch's tensors view the ring itself, and
its slots go back to their workers only once the caller lets go of the batch (a chunk's
lending is drawn; a block's is the same, its places given out again at once)::

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
the last of them: the same rule as ``memory.py``. A batch caught in a reference
cycle keeps its slot until the garbage collector frees it.

Why the worker never stalls on a caller who keeps batches: at most ``slots - 2`` slots
of a worker (or blocks of a pooled ring) are lent at once. The worker always has one
slot to write and one more to go on with once that one is full, as with copied batches
(the ring has 4 slots where it lends, against 2 otherwise: ``plan.py``); a batch that
would exceed the limit is copied into memory of its own and its slots released at once.
The common loop, ``for batch in collector``, holds the previous batch while the next one
is built, so it holds two.

A pooled ring has ``POOL_BLOCKS`` (six) blocks, not four: its workers need about four
while the loop holds two. A place is given to a worker a chunk before it starts writing
it, so the places the workers hold and write span three blocks, and a block is free
again only once every place of it is in: one more block lets the oldest wait for its
slowest place. With four blocks, 16 workers on the H100 host waited for places, about
two batches in three were copied, and frames/s fell to 0.92x the copying collector; with
six, nearly every batch was lent at 0.99x
(``benchmarks/results/archive/h100/pool_blocks/``). The loans still go up to
``slots - 2``: a burst of chunks can finish a third or fourth block while the loop holds
two, and those are lent too; the workers are short of places only while that lasts.

Why a caller's batch survives ``close()``: the transport gives the ring's memory back at
once (``processes.release_mapping``) unless a lent batch is still alive (:meth:`alive`,
registered with ``processes.lend_pages`` by ``copied.py``); then the pages go when
the last view does.
"""

from __future__ import annotations

import mmap
import weakref
from collections.abc import Mapping, Sequence
from typing import Literal

import numpy as np

from rlcollect.transports.layout import Key

__all__ = ["LEND_SLOTS", "POOL_BLOCKS", "Lending", "RingLoans", "lending", "ring_mapping"]

LEND_SLOTS = 4  # ring slots per worker where chunks are lent (see the module docstring)
POOL_BLOCKS = 6  # blocks of a pooled ring (see the module docstring)

Lending = Literal["", "chunk", "pool"]
"""How batches view the ring: ``"chunk"``, a worker's chunk is a batch; ``"pool"``, a
block of a pooled ring is; ``""``, every batch is copied out."""


def lending(
    *,
    vector: bool,
    names_slots: bool,
    copies_only: bool,
    backend: str,
    worker_rows: int,
    slot_rows: int,
    frames_per_batch: int,
    recurrent: bool,
    pool_slots: int,
    num_workers: int,
    gpu_policy: bool,
) -> Lending:
    """Whether batches may view the ring, and how.

    Args:
        vector: the envs are vector envs (their requests read staging cells).
        names_slots: the transport's credits name the slot they give back; lent slots
            come back in any order.
        copies_only: on-policy rounds or worker restarts: restarts rewrite a worker's
            slots, and rounds hold their slots until the next batch is asked for.
        backend: the inference backend.
        worker_rows: rows of one worker's chunk.
        slot_rows: rows of one chunk of every worker (a block of a pooled ring).
        frames_per_batch: rows of a batch.
        recurrent: the policy is recurrent: the server keys each env's state by the
            rows its requests name, which a pooled ring does not tie to an env.
        pool_slots: the most places of a pooled ring the transport serves
            (``Transport.pool_slots``).
        num_workers: the workers.
        gpu_policy: the policy runs on a CUDA device.
    """
    if copies_only or not names_slots:
        return ""
    if vector:
        # Requests read staging cells, so the transition fields are never page-locked for
        # the GPU, and a caller's batch.to("cuda", non_blocking=True) is staged by CUDA
        # (pageable memory) before it returns: never read from a slot written again.
        return "chunk" if worker_rows == frames_per_batch else ""
    if backend == "worker" or (backend == "thread" and not gpu_policy):
        # The policy in each worker reads its own part of the ring, not the places a
        # pooled ring gives it; a CPU policy in the driver's thread leaves the copy a
        # small part of the driver's work. The server, in its own process or in a thread
        # with a GPU policy, leaves the copy nearly all the driver's work. Neither
        # page-locks the caller's view of the ring: the inference process its own
        # mapping, the server thread a second mapping of the same pages
        # (inference/step.py, _register), so a caller's batch.to("cuda",
        # non_blocking=True) from a lent batch is staged, done when it returns.
        return ""
    if recurrent or num_workers * POOL_BLOCKS > pool_slots:
        return ""
    return "pool" if slot_rows == frames_per_batch else ""


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
