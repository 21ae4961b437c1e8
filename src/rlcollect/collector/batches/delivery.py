"""How batches are delivered: decided once by the plan, then used without branching.

A collector delivers its batches one of four ways (:class:`Delivery`); the plan picks
one with :func:`choose_delivery` from what the run is, and every part that differs by
it asks the :class:`Delivery` instead of the run's flags:

============  =====================================================  =============
kind          batches                                                slots/worker
============  =====================================================  =============
``copy``      rows copied out of the ring into memory of their own   2 (3 with
                                                                     restarts)
``chunk``     one worker's chunk is exactly a batch: lent, a view    4
              of its slot until the caller lets go (``loans.py``)
``pool``      a block of a pooled ring is exactly a batch: lent      6 blocks
              (``loans.py``, ``pooled.py``)
``rounds``    on-policy ``[num_envs, T]`` rounds, gated by the       1
              consumer (``rounds.py``)
============  =====================================================  =============

Why these slot counts:

* ``copy``: one slot being filled while the driver copies the other; with worker
  restarts a third, as the latest chunk of each worker is held back
  (``restarts.py``).
* ``chunk``: a lent slot is the caller's until it lets go, and the loop
  ``for batch in collector`` holds two batches (the previous one while the next is
  built); two more keep the worker writing (``loans.py``).
* ``pool``: the workers' slots span three blocks (a slot is given a chunk ahead), the
  loop holds two, and one more lets the oldest block wait for its slowest slot
  (``loans.py``; the measurements behind the number: ``docs/decisions/``).
* ``rounds``: a worker's one round; the next round starts when its slot comes back.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

import numpy as np

from rlcollect.collector.batches.builder import ChunkBuilder
from rlcollect.collector.batches.copied import BatchBuilder
from rlcollect.collector.batches.loans import Lending
from rlcollect.collector.batches.pooled import PoolBatchBuilder
from rlcollect.collector.batches.restarts import RESTART_SLOTS
from rlcollect.collector.batches.rounds import RolloutBuilder, RoundGate
from rlcollect.inference.base import InferenceBackend
from rlcollect.transports.base import ServerEnd
from rlcollect.transports.layout import Key, RingLayout

__all__ = ["POOL_BLOCKS", "Delivery", "DeliveryKind", "choose_delivery"]

DeliveryKind = Literal["copy", "chunk", "pool", "rounds"]

POOL_BLOCKS = 6  # blocks of a pooled ring (see the module docstring)
_SLOTS: Mapping[DeliveryKind, int] = {"copy": 2, "chunk": 4, "pool": POOL_BLOCKS, "rounds": 1}


@dataclass(frozen=True)
class Delivery:
    """How this collector's batches are built; see the module docstring."""

    kind: DeliveryKind
    #: Ring slots per worker (a pooled ring: blocks).
    slots: int

    @property
    def pooled(self) -> bool:
        """The ring is pooled: any worker writes any slot (``RingLayout.pooled``)."""
        return self.kind == "pool"

    @property
    def rounds(self) -> bool:
        """Workers run on-policy rounds (``RingLayout.rounds``)."""
        return self.kind == "rounds"

    @property
    def lending(self) -> Lending:
        """How batches view the ring, as the builders take it."""
        return "chunk" if self.kind == "chunk" else "pool" if self.kind == "pool" else ""

    def builder(
        self,
        layout: RingLayout,
        ring: Mapping[Key, np.ndarray],
        *,
        num_envs: int,
        frames_per_batch: int,
        total_frames: int,
        time_major: bool = False,
    ) -> ChunkBuilder:
        """What the chunk loop fills with the chunks of ``ring`` (``time_major``: rounds
        as ``[T, num_envs]``)."""
        if self.kind == "rounds":
            return RolloutBuilder(
                layout, ring, num_envs=num_envs, total_frames=total_frames, time_major=time_major
            )
        kind = PoolBatchBuilder if self.kind == "pool" else BatchBuilder
        return kind(
            layout,
            ring,
            frames_per_batch=frames_per_batch,
            total_frames=total_frames,
            lend=self.lending,
        )

    def gate(self, end: ServerEnd, server: InferenceBackend, num_workers: int) -> RoundGate | None:
        """What decides when slots go back: on-policy rounds' gate, else None (at once)."""
        return RoundGate(end, server, num_workers) if self.kind == "rounds" else None


def choose_delivery(
    *,
    on_policy: bool,
    restarts: bool,
    vector: bool,
    names_slots: bool,
    lends_pooled_blocks: bool,
    recurrent: bool,
    worker_rows: int,
    block_rows: int,
    frames_per_batch: int,
    num_workers: int,
    pool_slots: int,
) -> Delivery:
    """The delivery of a run.

    Args:
        on_policy: batches are on-policy rounds.
        restarts: workers may be restarted: a restart rewrites a worker's slots, so
            nothing is lent.
        vector: the envs are vector envs: their requests read staging cells, so the
            transition fields are never page-locked for the GPU, and a caller's
            ``batch.to("cuda", non_blocking=True)`` from a lent batch is staged (done
            when it returns): a lent chunk is safe with every backend.
        names_slots: the transport's credits name the slot they give back (lent slots
            come back in any order).
        lends_pooled_blocks: the inference backend lets a pooled ring's blocks be lent
            (``BackendChoice.lends_pooled_blocks_with``).
        recurrent: the policy is recurrent: the server keys each env's state by the rows
            its requests name, which a pooled ring does not tie to an env.
        worker_rows: rows of one worker's chunk.
        block_rows: rows of one chunk of every worker (a block of a pooled ring).
        frames_per_batch: rows of a batch.
        num_workers: the workers.
        pool_slots: the most slots of a pooled ring the transport serves
            (``Transport.pool_slots``).
    """
    kind: DeliveryKind = "copy"
    if on_policy:
        kind = "rounds"
    elif restarts or not names_slots:
        kind = "copy"
    elif vector:
        kind = "chunk" if worker_rows == frames_per_batch else "copy"
    elif (
        lends_pooled_blocks
        and not recurrent
        and num_workers * POOL_BLOCKS <= pool_slots
        and block_rows == frames_per_batch
    ):
        kind = "pool"
    slots = RESTART_SLOTS if kind == "copy" and restarts else _SLOTS[kind]
    return Delivery(kind, slots)
