"""What a collector shows its caller, once for both: iteration, background collection, pause.

``AsyncBatchedCollector`` (this package) and ``rlcollect.distributed.RayCollector`` make
their batches differently and hand them over the same way; :class:`CollectorFacade`
holds that way, so that the two cannot drift apart:

* the lifecycle is one stage (``lifecycle.py``: starting, open, background, closed),
  and what a stage refuses is refused from one table;
* ``next()`` is refused while collecting in the background, paused or iterated by
  another thread (``background.py``); an error shuts the collector down, and so does
  the end of the budget, before ``StopIteration``;
* ``start()`` runs the same production in the background thread;
* a collector shut down after its budget was met ends iteration; any other refuses.

A collector provides the batch (``_next_batch``), what it has
delivered (``_frames``), its ``train_ratio`` throttle, what ``pause()`` holds, and
``_release`` (its parts stopped, once, from any thread).

The API reference shows these methods under each collector (``inherited_members``), so
their docstrings name each other as plain code: a cross-reference would have two
targets, one per collector, and the site could not choose.
"""

from __future__ import annotations

import abc
import contextlib
import time
import weakref
from collections.abc import Callable, Iterator
from typing import TypeVar

from rlcollect._tensordict import TensorDict
from rlcollect.collector.background import Background, Pausable, Throttle, wait_to_sample
from rlcollect.collector.lifecycle import Lifecycle, Stage
from rlcollect.errors import CollectorError
from rlcollect.replay.counting import CountsSamples
from rlcollect.replay.sink import SupportsExtend

__all__ = ["CollectorFacade"]

_JOIN_TIMEOUT = 10.0  # seconds shutdown() waits for the background thread's last write


def _weakly(method: Callable[[], None]) -> Callable[[], None]:
    """``method`` called through a weak reference to its object (nothing once it is gone)."""
    ref = weakref.WeakMethod(method)

    def call() -> None:
        bound = ref()
        if bound is not None:
            bound()

    return call


# typing.Self is Python 3.11; the package supports 3.10.
_Collector = TypeVar("_Collector", bound="CollectorFacade")


class CollectorFacade(abc.ABC):
    """Iteration, background collection, pause and shutdown over a collector's batches."""

    total_frames: int
    _replay_buffer: SupportsExtend | None
    _throttle: Throttle | None  # the train_ratio wait, if there is one
    _started: float  # perf_counter() and process_time() when collection started
    _cpu_started: float

    def __init__(self) -> None:
        # STARTING until everything is up: shutdown() must work at any point.
        self._lifecycle = Lifecycle()
        self._background = Background()

    # ------------------------------------------------------------------ provided by each

    @property
    @abc.abstractmethod
    def _frames(self) -> int:
        """Transitions delivered so far."""

    @abc.abstractmethod
    def _next_batch(self) -> TensorDict | None:
        """The next batch, already written to the replay buffer and counted in
        ``_frames``; None once ``total_frames`` are delivered."""

    @abc.abstractmethod
    def _pausable(self) -> Pausable | None:
        """What ``pause()`` holds besides the background thread; None once shut down."""

    @abc.abstractmethod
    def _release(self) -> None:
        """Stop every part and free what it holds; idempotent, from any thread."""

    # ------------------------------------------------------------------ iteration

    def __iter__(self: _Collector) -> _Collector:
        return self

    def __next__(self) -> TensorDict:
        self._background.raise_error()
        self._lifecycle.refuse("iterate")
        with self._background.iterating():
            try:
                batch = self._produce()
            except BaseException as exc:
                # Shut down under this call, by shutdown() from another thread: whatever
                # the closing parts raised (the stop signal, a closed transport) is that.
                shut_down = self._background.stopping.is_set() and isinstance(exc, Exception)
                self.shutdown()
                if shut_down:
                    raise CollectorError(
                        "the collector was shut down (by shutdown() from another thread) "
                        "while next() waited for its batch"
                    ) from exc
                raise
        if batch is None:
            self.shutdown()
            raise StopIteration
        return batch

    def _produce(self) -> TensorDict | None:
        """The next batch, already written to the replay buffer; None once the budget is met."""
        if self._lifecycle.closed:
            if self.total_frames != -1 and self._frames >= self.total_frames:
                return None
            raise CollectorError("the collector is shut down")
        # Even after the last batch the collector stays up until the next call finds the
        # budget met: the caller may still push weights for that batch.
        return self._next_batch()

    # ------------------------------------------------------------------ statistics

    def _throughput(self, frames: int) -> dict[str, float]:
        """The statistics both collectors measure alike: time and driver CPU per frame."""
        elapsed = time.perf_counter() - self._started
        cpu = time.process_time() - self._cpu_started
        return {
            "seconds": elapsed,
            "frames_per_second": frames / elapsed if elapsed > 0 else 0.0,
            "driver_cpu_ms_per_frame": 1e3 * cpu / frames if frames else 0.0,
        }

    # ------------------------------------------------------------------ background

    def start(self) -> None:
        """Collect into the replay buffer in a background thread until ``total_frames``
        are written or ``shutdown()``; its error is raised at the caller's next call.

        Raises:
            CollectorError: without a ``replay_buffer``, when already started or shut
                down; the background error if an earlier collection failed.

        Example: ``docs/usage.md``, *Background collection*.
        """
        self._background.raise_error()
        self._lifecycle.refuse("start")
        if self._replay_buffer is None:
            raise CollectorError(
                "start() collects into the replay buffer, and this collector has none: "
                "pass replay_buffer= or iterate over the collector instead"
            )
        self._lifecycle.enter("start", Stage.BACKGROUND)
        # Weakly: the thread must not keep its collector alive, so that dropping the
        # collector collects it (its finalizer stops the thread and every part).
        self._background.start(self._production(), _weakly(self._release))

    def _production(self) -> Callable[[], TensorDict | None]:
        """What the background thread calls for each batch (None: the budget is met).
        Here ``_produce`` through a weak reference: the thread holds the collector only
        while a batch is made, and ends once it is gone. A collector whose batches come
        from parts that never refer back to it returns their producer instead, so that
        the thread never holds it, even while a batch waits (a ``train_ratio`` wait for a
        learner that dropped the collector)."""
        produce = weakref.WeakMethod(self._produce)

        def production() -> TensorDict | None:
            bound = produce()
            return None if bound is None else bound()

        return production

    def join(self, timeout: float | None = None) -> bool:
        """Wait up to ``timeout`` seconds (None: no limit) for background collection to
        end; True once it has, False if the time ran out first.

        Raises:
            CollectorError: when ``start()`` was not called; the background error if
                collection failed.
        """
        if not self._background.started:
            raise CollectorError("join() waits for background collection; call start() first")
        return self._background.join(timeout)

    def wait_to_sample(self, timeout: float | None = None) -> bool:
        """The learner's wait in background collection: True once it may sample (with a
        ``train_ratio``: while it has sampled less than its share of the rows collected;
        without: once the buffer holds a row); False if ``timeout`` seconds pass first,
        or collection has ended and nothing is left to sample (``background_done``
        tells which). Example: ``docs/off-policy.md``, *Train ratio*.

        Raises:
            CollectorError: before ``start()``, or without a buffer that counts its
                rows; the background error.
        """
        self._background.raise_error()
        if not self._background.started:
            raise CollectorError("wait_to_sample() waits for background collection; call start()")
        if not isinstance(self._replay_buffer, CountsSamples):
            raise CollectorError(
                "wait_to_sample() needs replay_buffer= an rlcollect.ReplayBuffer or a buffer "
                "that counts its rows (rlcollect.replay.CountingBuffer)"
            )
        return wait_to_sample(self._background, self._replay_buffer, self._throttle, timeout)

    @property
    def background_done(self) -> bool:
        """Whether background collection has ended (budget met, failed or shut down);
        never waits or raises (a failure is raised by the next call into the collector)."""
        return self._background.finished.is_set()

    @contextlib.contextmanager
    def pause(self, timeout: float = 10.0) -> Iterator[None]:
        """Hold collection at a quiet point for the ``with`` block: no batch is written
        and no inference batch runs (a ``RayCollector``'s collectors each hold once the
        batch they were making is finished), a consistent moment for a checkpoint.

        Raises:
            CollectorError: when shut down or already paused, or when the quiet point is
                not reached within ``timeout`` seconds.

        Example: ``docs/usage.md``, *Background collection*.
        """
        self._background.raise_error()
        self._lifecycle.refuse("pause")
        held = self._pausable()
        if held is None:
            raise CollectorError("the collector is shut down")
        with self._background.paused(held, timeout):
            yield

    # ------------------------------------------------------------------ shutting down

    def shutdown(self) -> None:
        """Stop background collection and everything the collector started: workers,
        inference servers (a ``RayCollector``: every collector actor), shared memory.
        Idempotent; the ``with`` block, the end of iteration and garbage collection call it.

        Raises:
            CollectorError: the background error, if collection failed and it was not
                raised yet.

        Example: ``docs/usage.md``, *Shutting down*.
        """
        self._background.stop(_JOIN_TIMEOUT)
        self._release()
        self._background.raise_error()

    def __enter__(self: _Collector) -> _Collector:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: object
    ) -> None:
        try:
            self.shutdown()
        except BaseException as error:
            if exc is None:
                raise
            exc.add_note(f"rlcollect: background collection had failed too: {error!r}")
