"""The consuming thread's loop: the workers' full chunks in, exact batches out.

::

    transport ── wait_chunks() → [(worker, slot), ...] ──▶ (restarts: hold the latest
                                                            chunk of each worker back)
                                                       ──▶ BatchBuilder.add_chunk (one copy)
              ◀── release(worker, slot) ──────────────────  the slot is the worker's again

A worker's failure arrives from ``wait_chunks`` as a ``WorkerError`` after every chunk
it handed over (the transport's contract); with ``max_worker_restarts`` it is handled
here (``restarts.py``), otherwise raised.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from tensordict import TensorDict

from rlcollect.collector.background import POLL
from rlcollect.collector.batches import BatchBuilder
from rlcollect.collector.plan import Plan
from rlcollect.collector.restarts import WorkerRestarts
from rlcollect.errors import ChannelClosed, CollectorError, WorkerError
from rlcollect.inference.base import InferenceBackend
from rlcollect.transports.base import ServerEnd

__all__ = ["ChunkLoop"]


class ChunkLoop:
    """Waits for chunks, copies them into batches, restarts failed workers."""

    def __init__(
        self,
        end: ServerEnd,
        builder: BatchBuilder,
        restarts: WorkerRestarts | None,
        server: InferenceBackend,
    ) -> None:
        self._end = end
        self._builder = builder
        self.restarts = restarts
        self._server = server
        self.wait_seconds = 0.0  # time the consumer waited for chunks

    @classmethod
    def for_plan(cls, plan: Plan, end: ServerEnd, server: InferenceBackend) -> ChunkLoop:
        """The loop for ``plan``'s ring, started as ``end``, served by ``server``."""
        restarts = None
        if plan.max_worker_restarts:
            restarts = WorkerRestarts(
                plan.max_worker_restarts,
                plan.transport,
                plan.layout,
                end.buffers,
                list(plan.specs),
                num_envs=plan.num_envs,
            )
        builder = BatchBuilder(
            plan.layout,
            end.buffers,
            frames_per_batch=plan.frames_per_batch,
            total_frames=plan.total_frames,
        )
        return cls(end, builder, restarts, server)

    @property
    def exhausted(self) -> bool:
        """``total_frames`` are all in batches already handed out."""
        return self._builder.exhausted and not self._builder.ready

    def next_batch(self, quiet_point: Callable[[], None]) -> TensorDict | None:
        """The next batch, or None once ``total_frames`` are delivered; ``quiet_point``
        runs between bounded waits."""
        builder, end, restarts = self._builder, self._end, self.restarts
        if self.exhausted:
            return None
        t0 = time.perf_counter()
        while not builder.ready:
            quiet_point()
            try:
                chunks = end.wait_chunks(POLL)
            except ChannelClosed:
                self._check_server()
                raise CollectorError("the transport closed while collecting") from None
            except WorkerError as error:
                if restarts is None:
                    raise
                try:
                    restarts.restart(error, builder)
                except ChannelClosed:  # shut down or aborted meanwhile
                    self._check_server()
                    raise error from error.__cause__
                continue
            for worker, slot in chunks:
                if restarts is not None:
                    held = restarts.hold(worker, slot)
                    if held is None:
                        continue
                    slot = held
                builder.add_chunk(worker, slot)
                end.release(worker, slot)
            self._check_server()
        self.wait_seconds += time.perf_counter() - t0
        return builder.pop()

    def _check_server(self) -> None:
        """Raise the inference backend's error, if it has one."""
        if self._server.error is not None:
            raise self._server.error
