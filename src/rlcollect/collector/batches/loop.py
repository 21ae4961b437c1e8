"""The consuming thread's loop: the workers' full chunks in, exact batches out.

::

    transport ── wait_chunks() → [(worker, slot), ...] ──▶ (restarts: hold the latest
                                                            chunk of each worker back)
                                                       ──▶ builder.add_chunk (one copy, or
                                                            lent: loans.py, pooled.py)
              ◀── release(worker, slot) ──────────────────  the slot is the worker's again
              ◀── release(worker, slot) ◀── builder.returned(): lent, now let go of
    batch ready ──▶ train_ratio throttle ──▶ quiet point ──▶ replay_buffer.extend ──▶ caller

It runs in the caller's thread while iterating, or in the background thread after
``start()``; between bounded waits it passes the background's quiet point (pause,
shutdown), checks the inference backend's health and looks for stalled workers
(``stall.py``). A stalled worker is stopped by the transport where it can be, and its
death then arrives like any other, as the stall's error; where it cannot (threads), the
stall is raised at once.

A worker's failure arrives from ``wait_chunks`` as a ``WorkerError`` after every chunk
it handed over (the transport's contract); with ``max_worker_restarts`` it is handled
here (``restarts.py``), otherwise raised.

The loop sees its builder only as a :class:`~rlcollect.collector.batches.builder.ChunkBuilder`:
a :class:`~rlcollect.collector.batches.copied.BatchBuilder`, or on-policy (``rounds.py``) a
:class:`~rlcollect.collector.batches.rounds.RolloutBuilder`, where a
:class:`~rlcollect.collector.batches.rounds.RoundGate` decides when slots go back: a
batch's round starts when the batch is asked for, and the copied slots are held until
the next one is. Inside a round only shutdown is checked, never a pause: an update
waits for the round's end, and a pause held inside it would wait for that update.

Every delivered batch's finished episodes are counted (``episodes.py``).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from rlcollect._tensordict import TensorDict
from rlcollect.collector.background import POLL, Background, Throttle
from rlcollect.collector.batches.builder import ChunkBuilder
from rlcollect.collector.batches.copied import BatchBuilder
from rlcollect.collector.batches.episodes import EpisodeStats
from rlcollect.collector.batches.restarts import WorkerRestarts
from rlcollect.collector.batches.rounds import RoundGate
from rlcollect.collector.batches.stall import Stalls
from rlcollect.errors import ChannelClosed, CollectorError, WorkerError
from rlcollect.inference.base import InferenceBackend
from rlcollect.replay.sink import SupportsExtend
from rlcollect.transports.base import ServerEnd

__all__ = ["ChunkLoop"]


class ChunkLoop:
    """Waits for chunks, copies them into batches, restarts failed workers."""

    def __init__(
        self,
        end: ServerEnd,
        builder: ChunkBuilder,
        restarts: WorkerRestarts | None,
        server: InferenceBackend,
        background: Background,
        throttle: Throttle | None,
        replay_buffer: SupportsExtend | None,
        gate: RoundGate | None = None,
        stalls: Stalls | None = None,
    ) -> None:
        self._end = end
        self._stalls = stalls
        self._builder = builder
        self.gate = gate
        self.episodes = EpisodeStats()
        self.restarts = restarts
        self._server = server
        self._background = background
        self.throttle = throttle
        self._replay_buffer = replay_buffer
        self.frames = self.batches = 0  # delivered
        self.wait_seconds = 0.0  # time the consumer waited for chunks

    @property
    def lent_batches(self) -> int:
        """Batches handed out as views of their ring slot (``loans.py``)."""
        return self._builder.lent

    @property
    def slot_wait_seconds(self) -> float:
        """Seconds workers had no place of a pooled ring to write (``pooled.py``)."""
        return self._builder.slot_wait_seconds

    @property
    def batch_memory_reuses(self) -> int:
        """Batches built in the memory of an earlier batch already let go
        (``memory.py``)."""
        return self._builder.memory.reused

    @property
    def exhausted(self) -> bool:
        """``total_frames`` are all in batches already handed out."""
        return self._builder.exhausted and not self._builder.ready

    def produce(self) -> TensorDict | None:
        """The next batch, already written to the replay buffer; None once
        ``total_frames`` are delivered."""
        quiet_point = self._background.quiet_point
        batch = self._next_batch(quiet_point)
        if batch is None:
            return None
        if self.throttle is not None:
            self.throttle.wait(self.frames, self._idle)
        quiet_point()
        if self._replay_buffer is not None:
            # On-policy batches go in as rows, env by env ([num_envs * T]): every buffer
            # takes rows, and each env's T steps stay contiguous (slice samplers).
            rows = batch.transpose(0, 1) if self._builder.time_major else batch
            self._replay_buffer.extend(rows if rows.ndim == 1 else rows.reshape(-1))
        self.frames += batch.numel()
        self.batches += 1
        self.episodes.record(batch, self.frames)
        return batch

    def _idle(self) -> None:
        self._background.quiet_point()
        self._check_server()

    def _next_batch(self, quiet_point: Callable[[], None]) -> TensorDict | None:
        if self.exhausted:
            return None
        if self.gate is None:
            return self._build(quiet_point)
        try:
            return self._build(quiet_point)
        except BaseException:
            self.gate.fail()  # an update waiting for this round learns why, never lands
            raise

    def _build(self, quiet_point: Callable[[], None]) -> TensorDict:
        builder, end, restarts, gate = self._builder, self._end, self.restarts, self.gate
        t0 = time.perf_counter()
        self._give_back_returned()
        if gate is not None:
            quiet_point()
            quiet_point = self._background.check_stopping  # inside the round
            gate.open(self._in_round)
            # The round runs now, and its chunks come at its end: the batch's first-touch
            # page faults are paid meanwhile instead of at the round's barrier.
            builder.prefault()
        while not builder.ready:
            quiet_point()
            self._give_back_returned()
            if self._stalls is not None:
                self._stalls.look()
            try:
                chunks = end.wait_chunks(POLL)
            except ChannelClosed:
                self._check_server()
                raise CollectorError("the transport closed while collecting") from None
            except WorkerError as error:
                self._check_server()  # a failed server stops every worker: it is the cause
                if self._stalls is not None:
                    error = self._stalls.explain(error)
                if restarts is None:
                    raise error from error.__cause__
                assert isinstance(builder, BatchBuilder)  # on-policy refuses restarts
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
                for copied in builder.add_chunk(worker, slot):
                    if gate is not None:
                        gate.hold(*copied)  # given back when the next batch is asked for
                    else:
                        end.release(*copied)
            self._check_server()
        if gate is not None:
            gate.close()
        self.wait_seconds += time.perf_counter() - t0
        return builder.pop()

    def _give_back_returned(self) -> None:
        """Release the slots of lent batches the caller has let go of. Called before
        every wait: a worker that wants one of them hands a chunk over first, and that
        ends the wait."""
        for worker, slot in self._builder.returned():
            self._end.release(worker, slot)

    def _in_round(self) -> None:
        self._background.check_stopping()
        self._check_server()

    def _check_server(self) -> None:
        """Raise the inference backend's error, if it has one."""
        if self._server.error is not None:
            raise self._server.error
