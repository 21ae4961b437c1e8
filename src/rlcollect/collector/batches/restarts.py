"""Restarting crashed workers (``max_worker_restarts``) without breaking any stream.

A worker that fails (an env raises, the process is killed) leaves its envs in the
middle of an episode, and the slot it was filling half written. The collector drops
that slot and ends each of its envs' interrupted episodes at the last transition it
can still change, which is why it holds one chunk back per worker:

* Each worker's latest handed-over chunk stays in the ring, uncopied, until the
  worker's next chunk arrives (the ring has three slots per worker instead of two, so
  the worker never waits for it). Chunks of one worker are copied in order, as before.
* When the worker fails, the transport first returns every chunk it handed over, then
  raises its failure (``Transport.restart_worker``'s contract; the transports' side of a
  restart is told in ``transports/generations.py``). The held chunk then holds the last
  transition of each of its envs that will ever be delivered: the collector marks each
  one that did not end its episode ``truncated`` (so ``done``), copies the chunk, and
  drops the rest.
* The new worker rebuilds and resets the envs (reseeded with ``seed + num_envs * r +
  env`` at the worker's ``r``-th restart) and numbers their episodes on from the held
  chunk's (``episode + 1``), starting at step 0. Every env's stream therefore stays whole: no
  gap, no duplicate, each episode ending with ``done``; the transitions of the dropped
  slot are never counted, and ``frames_per_batch`` and ``total_frames`` stay exact.

The warning (:class:`~rlcollect.errors.WorkerRestartWarning`) names the worker, its
envs, the cause and the restart count; past ``max_worker_restarts`` restarts in all,
the failure is raised as without restarts.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Mapping

import numpy as np

from rlcollect.collector.batches.copied import BatchBuilder
from rlcollect.errors import WorkerError, WorkerRestartWarning
from rlcollect.processes import out_of_descriptors
from rlcollect.transports.base import Transport, WorkerProgram
from rlcollect.transports.layout import Key, RingLayout
from rlcollect.worker.spec import WorkerSpec

__all__ = ["RESTART_SLOTS", "WorkerRestarts"]

#: Chunk slots per worker with restarts: one held back, one being copied, one filling.
RESTART_SLOTS = 3


class WorkerRestarts:
    """Holds back each worker's latest chunk, and restarts workers that fail."""

    def __init__(
        self,
        limit: int,
        transport: Transport,
        layout: RingLayout,
        ring: Mapping[Key, np.ndarray],
        specs: list[WorkerSpec],
        *,
        num_envs: int,
        program: Callable[[WorkerSpec], WorkerProgram],
    ) -> None:
        self.limit = limit
        self.count = 0
        self._transport = transport
        self._steps = layout.chunk_steps
        self._terminated = ring[("next", "terminated")]
        self._truncated = ring[("next", "truncated")]
        self._episode = ring[("episode",)]
        self._specs = list(specs)
        self._num_envs = num_envs
        self._program = program  # what a new worker runs, given its spec
        self._held: list[int | None] = [None] * layout.num_workers

    def hold(self, worker: int, slot: int) -> int | None:
        """Hold ``slot`` back; returns the slot to copy now (the one held before), if any."""
        held, self._held[worker] = self._held[worker], slot
        return held

    def restart(self, error: WorkerError, builder: BatchBuilder) -> None:
        """End the failed worker's episodes, copy its held chunk, start a new worker.

        Raises:
            WorkerError: ``error``, with a note, once ``limit`` restarts were made.
        """
        w = error.worker_index
        if self.count >= self.limit:
            error.add_note(
                f"rlcollect: not restarted: the collector has made {self.count} restarts, "
                f"max_worker_restarts={self.limit}"
            )
            raise error
        self.count += 1
        spec = self._specs[w]
        first = spec.first_episode or (0,) * spec.num_envs
        slot, self._held[w] = self._held[w], None
        if slot is not None:
            last = slot * self._steps + self._steps - 1  # each env's last step in the chunk
            self._truncated[w, last] |= ~self._terminated[w, last]
            first = tuple(int(e) + 1 for e in self._episode[w, last])
            builder.add_chunk(w, slot)  # never released: the restart frees every slot
        seed = None if spec.seed is None else spec.seed + self._num_envs
        self._specs[w] = dataclasses.replace(spec, first_episode=first, seed=seed)
        envs = f"{spec.env_offset}-{spec.env_offset + spec.num_envs - 1}"
        if spec.num_envs == 1:
            envs = str(spec.env_offset)
        warnings.warn(
            WorkerRestartWarning(
                f"restarting worker {w} (envs {envs}) after: {error}; restart {self.count} "
                f"of max_worker_restarts={self.limit}. Its envs' interrupted episodes end "
                "truncated; their transitions not yet handed over are dropped."
            ),
            stacklevel=2,
        )
        try:
            self._transport.restart_worker(w, self._program(self._specs[w]))
        except OSError as exc:
            named = out_of_descriptors(exc, f"restarting worker {w}")
            if named is not None:
                raise named from exc
            raise
