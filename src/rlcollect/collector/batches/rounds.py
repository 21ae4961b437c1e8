"""On-policy rollouts (``on_policy=True``): rounds of ``T`` steps, gated by the consumer.

Each batch is ``[num_envs, T]``: row ``e`` holds env ``e``'s next ``T`` transitions, all
of them computed with the weights current when the batch was asked for. The ring does
the gating, with the credits it already has:

* Every worker owns one slot of ``T`` steps (``chunk_steps = T``): one round.
* A worker takes one credit (``wait_slot``) before each round, the first included, on
  top of the one the ring starts with (which it takes at once). The consumer gives that
  credit (``release``) only when a batch is asked for: :meth:`RoundGate.open`, at the
  start of the collector's ``next()``. A worker therefore never starts a round, sends
  no request and receives no action of it, before the batch is asked for.
* ``open`` first makes sure the weights handed over so far serve the next inference
  batch (the ``"process"`` backend applies them asynchronously: it waits until they
  are applied; the ``"thread"`` backend applies them before ``update_policy_weights_``
  returns). No request is pending meanwhile (every worker waits for its credit), so
  every action of the round is computed with those weights: ``policy_version`` is one
  value in the whole batch, and it is the version current when the batch was asked for.
* A round's chunk is copied into the batch as soon as it arrives, but its slot is not
  given back (that credit would start the next round): :meth:`RoundGate.hold` keeps
  it for the next ``open``. The worker loops reorder the round's boundary so that no
  group waits for that credit before the last group has stepped and the slot is
  handed over (``worker/loop.py``, ``worker/vector_loop.py``).
* An update made while a round runs (only possible from another thread, e.g. with
  ``start()``) waits for the round's end (:meth:`RoundGate.between_rounds`), so it
  lands between two batches and never splits one. With ``policy_lag=1`` the round
  collected ahead is claimed (:meth:`RoundGate.claim`) in the caller's thread as its
  batch's predecessor is handed out, before the helper thread that runs it is
  scheduled: an update made then waits for that round, which is the lag of one.
* A round that fails (an env raised, a worker died or stalled, the server failed)
  ends the wait of every update (:meth:`RoundGate.fail`): the update never lands on a
  broken round; it waits, bounded, until ``alive`` raises the failure, which the
  consuming thread hands on (``collector.py``).

:class:`RolloutBuilder` places each worker's ``[T, envs]`` chunk as rows of the
``[num_envs, T]`` batch: the chunk's rows sorted by ``env_index``, stably, are each env's
transitions in step order (the plain loop writes them step-major; the vector loop in
the order transitions finish, which is each env's own step order). With ``time_major``
the same rows go to columns of a ``[T, num_envs]`` batch instead (CleanRL's layout),
built so by the same one ``np.take`` per field: contiguous, no transpose later.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator, Mapping

import numpy as np

from rlcollect.collector.batches.builder import ChunkBuilder
from rlcollect.errors import CollectorError
from rlcollect.inference.base import InferenceBackend
from rlcollect.transports.base import ServerEnd
from rlcollect.transports.layout import Key, RingLayout

__all__ = ["RolloutBuilder", "RoundGate"]

_POLL = 0.1  # seconds between checks while waiting (errors, shutdown)


class RolloutBuilder(ChunkBuilder):
    """Copies each worker's round into the ``[num_envs, T]`` batch being built."""

    def __init__(
        self,
        layout: RingLayout,
        ring: Mapping[Key, np.ndarray],
        *,
        num_envs: int,
        total_frames: int,
        time_major: bool = False,
    ) -> None:
        super().__init__(layout, ring)
        self._k = layout.columns
        self._num_envs = num_envs
        self._time_major = time_major
        self._workers = layout.num_workers
        # Batches still to build: total_frames is a multiple of frames_per_batch (checked).
        per_batch = num_envs * layout.chunk_steps
        self._remaining = -1 if total_frames < 0 else total_frames // per_batch
        self._copied = 0
        self._new_batch()

    @property
    def exhausted(self) -> bool:
        """True once every batch of ``total_frames`` has been built."""
        return self._remaining == 0

    @property
    def time_major(self) -> bool:
        return self._time_major

    def add_chunk(self, worker: int, slot: int) -> list[tuple[int, int]]:
        """Copy worker ``worker``'s round (slot ``slot``) into its rows of the batch."""
        t, k = self._steps, self._k
        start = slot * t
        env_index = self._ring[("env_index",)][worker, start : start + t].reshape(t * k)
        # Stable: each env's rows keep their order, which is its step order.
        order = np.argsort(env_index, kind="stable")
        first = worker * k
        counts = np.bincount(env_index - first, minlength=k)
        if counts.shape[0] != k or not (counts == t).all():
            raise CollectorError(
                f"worker {worker}'s round does not hold {t} transitions of each of envs "
                f"{first}-{first + k - 1} (counts {counts.tolist()}): on-policy rounds broke"
            )
        rows = slice(first * t, (first + k) * t)
        if self._time_major:  # [t, k]: step s of env first + j at (s, j)
            order = order.reshape(k, t).T
        for field in self._fields:
            src = self._ring[field.key][worker, start : start + t].reshape(t * k, *field.shape)
            if self._time_major:
                out = self._arrays[field.key].reshape(t, self._num_envs, *field.shape)
                np.take(src, order, axis=0, out=out[:, first : first + k], mode="clip")
            else:
                np.take(src, order, axis=0, out=self._arrays[field.key][rows], mode="clip")
        self._copied += 1
        if self._copied == self._workers:
            shape = (t, self._num_envs) if self._time_major else (self._num_envs, t)
            self._queue(shape)
            if self._remaining > 0:
                self._remaining -= 1
            self._new_batch()
        return [(worker, slot)]

    def _new_batch(self) -> None:
        self._copied = 0
        self._allocate(0 if self._remaining == 0 else self._num_envs * self._steps)


class RoundGate:
    """Starts each round when its batch is asked for, and keeps updates out of rounds."""

    def __init__(self, end: ServerEnd, server: InferenceBackend, num_workers: int) -> None:
        self._end = end
        self._server = server
        self._num_workers = num_workers
        # Slot 0 of every worker: the first round's go-ahead (the ring's own credit was
        # taken by the worker when it started).
        self._held: list[tuple[int, int]] = [(w, 0) for w in range(num_workers)]
        self._cond = threading.Condition()
        self._in_round = False
        self._claimed = False  # the next round is claimed already (policy_lag=1)
        self._failed = False  # a round failed: no update may land any more
        self._waiting = 0  # updates waiting for the round to end
        self._landing = 0  # updates past that wait, being applied

    def hold(self, worker: int, slot: int) -> None:
        """Keep ``slot`` (copied) from ``worker`` until the next batch is asked for."""
        self._held.append((worker, slot))

    def open(self, idle: Callable[[], None]) -> None:
        """Start the next round: once the weights handed over serve, give every worker
        its go-ahead. ``idle`` runs between bounded waits (shutdown, server errors)."""
        if len(self._held) != self._num_workers:
            raise CollectorError(
                f"on-policy round started with {len(self._held)} of {self._num_workers} "
                "workers' slots held back: the previous round is incomplete"
            )
        with self._cond:
            # An update waits for this boundary: let it land first, unless the round
            # was claimed before that update came (policy_lag=1). One landing already
            # lands first in any case.
            while self._landing or (self._waiting and not self._claimed):
                self._cond.wait(_POLL)
                idle()
            self._in_round = True
            self._claimed = False
        version = self._server.policy_version
        while not self._server.wait_applied(version, _POLL):
            idle()
        idle()  # the server's error, if it failed instead of applying them
        for worker, slot in self._held:
            self._end.release(worker, slot)
        self._held.clear()

    def close(self) -> None:
        """The round's batch is complete: updates may land."""
        with self._cond:
            self._in_round = False
            self._cond.notify_all()

    def claim(self) -> None:
        """Claim the next round now, in the thread that hands out the batch before it
        (``policy_lag=1``): an update made from here on waits for that round's end,
        however late the thread that opens it runs."""
        with self._cond:
            self._in_round = self._claimed = True

    def fail(self) -> None:
        """The round (open, or claimed) ended by a failure: nothing waits for it any
        more, and no update lands after it."""
        with self._cond:
            self._in_round = self._claimed = False
            self._failed = True
            self._cond.notify_all()

    @contextlib.contextmanager
    def between_rounds(self, alive: Callable[[], None]) -> Iterator[None]:
        """Hold the next round back for the ``with`` block, after the one running ends.
        ``alive`` raises when waiting is pointless (the collector shut down or failed);
        after a failed round it must raise, and the update waits until it does."""
        with self._cond:
            self._waiting += 1
        landing = False
        try:
            started = time.monotonic()
            while not landing:
                with self._cond:
                    failed = self._failed
                    if not (self._in_round or failed):
                        self._waiting -= 1
                        self._landing += 1  # in the same hold: no round opens now
                        landing = True
                        continue
                    self._cond.wait(_POLL)
                if failed or time.monotonic() - started > _POLL:
                    alive()  # without the lock: it may shut the collector down
            yield
        finally:
            with self._cond:
                if landing:
                    self._landing -= 1
                else:
                    self._waiting -= 1
                self._cond.notify_all()
