"""Collection in a background thread, its pause, and the train-ratio throttle.

::

    learner thread                         background thread ("rlcollect-collector")
    ──────────────                         ─────────────────────────────────────────
    start() ─────────── starts ──────────▶ loop: produce() → one batch into the buffer
    pause():  pause_requested.set() ─────▶   quiet_point(): quiet.set(), holds while
              waits for quiet, pauses the     pause_requested is set
              server, yields, resumes ──────▶ goes on
    join(t): waits for finished ◀───────── finished.set() when the budget is met,
                                            on an error (kept for the caller), or on stop
    shutdown(): stopping.set(), joins ────▶ the next quiet point raises Stopping

The background thread never raises into the caller's thread by itself: its error is kept
and raised at the caller's next call into the collector (:meth:`Background.raise_error`).
Every wait is bounded (``POLL`` seconds between checks of ``stopping``).
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, Protocol

from rlcollect.errors import CollectorError
from rlcollect.replay.counting import CountsSamples

__all__ = ["POLL", "Background", "Pausable", "Stopping", "Throttle", "wait_to_sample"]

POLL = 0.1  # seconds between checks of the stop flag in every wait


class Stopping(CollectorError):
    """Raised inside the collector's own threads when it is shut down under them."""

    def __init__(self) -> None:
        super().__init__("the collector was shut down")


class Pausable(Protocol):
    """What :meth:`Background.paused` holds: an inference backend, or every collector
    of a ``RayCollector``."""

    def pause(self, timeout: float) -> None: ...

    def resume(self) -> None: ...


class Background:
    """The background thread's state: started, paused, finished, stopped, its error."""

    def __init__(self) -> None:
        self.stopping = threading.Event()
        self.finished = threading.Event()  # background collection has ended
        self.pause_requested = threading.Event()
        self._quiet = threading.Event()  # the background thread holds at a quiet point
        self._iterating = threading.Lock()  # held by the thread inside next()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    @property
    def started(self) -> bool:
        return self._thread is not None

    @contextlib.contextmanager
    def iterating(self) -> Iterator[None]:
        """The caller's thread iterates for the ``with`` block: refused while paused, or
        iterated by another thread (whose batch this call would tear apart). Refused in
        the background stage too: that is the lifecycle's (``lifecycle.py``)."""
        if self.pause_requested.is_set():
            raise CollectorError("the collector is paused: iterate after the pause() block")
        if not self._iterating.acquire(blocking=False):
            raise CollectorError(
                "another thread is iterating this collector: iterate from one thread, or "
                "use start() and sample from the replay buffer in as many as you like"
            )
        try:
            yield
        finally:
            self._iterating.release()

    def start(self, produce: Callable[[], Any], release: Callable[[], None]) -> None:
        """Call ``produce`` in a thread until it returns None; on its error, ``release``."""
        self._thread = threading.Thread(
            target=self._run, args=(produce, release), name="rlcollect-collector", daemon=True
        )
        self._thread.start()

    def _run(self, produce: Callable[[], Any], release: Callable[[], None]) -> None:
        # When the budget is met the parts stay up, as after the last batch of an
        # iteration: the learner may still push weights until it calls shutdown().
        try:
            while not self.stopping.is_set() and produce() is not None:
                pass
        except Stopping:
            pass
        except BaseException as exc:
            if not self.stopping.is_set():
                self._error = exc
            release()
        finally:
            self.finished.set()

    def stop(self, timeout: float) -> None:
        """Ask the thread to stop and wait up to ``timeout`` seconds for it."""
        self.stopping.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    def raise_error(self) -> None:
        """Raise the background thread's error once, if it had one."""
        error, self._error = self._error, None
        if error is not None:
            raise error

    def join(self, timeout: float | None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.finished.wait(
            POLL if deadline is None else min(POLL, max(0.0, deadline - time.monotonic()))
        ):
            if deadline is not None and time.monotonic() >= deadline:
                return False
        self.raise_error()
        return True

    def check_stopping(self) -> None:
        """Raise Stopping once shut down (a point where a pause must not hold: inside an
        on-policy round, which an update waits for)."""
        if self.stopping.is_set():
            raise Stopping

    def quiet_point(self) -> None:
        """Raise Stopping once shut down; in the background thread, hold here while a
        pause is requested."""
        if self.stopping.is_set():
            raise Stopping
        if not self.pause_requested.is_set():
            return
        if threading.current_thread() is not self._thread:
            return
        self._quiet.set()
        try:
            while self.pause_requested.is_set():
                if self.stopping.wait(POLL):
                    raise Stopping
        finally:
            self._quiet.clear()

    @contextlib.contextmanager
    def paused(self, server: Pausable, timeout: float) -> Iterator[None]:
        """Hold the background thread (if any) at a quiet point and the server between
        two batches for the ``with`` block."""
        if self.pause_requested.is_set():
            raise CollectorError("the collector is already paused")
        self.pause_requested.set()
        try:
            deadline = time.monotonic() + timeout
            if self._thread is not None:
                while not self._quiet.wait(POLL):
                    if self.finished.is_set():
                        self.raise_error()
                        break  # collection ended: quiet for good
                    if time.monotonic() >= deadline:
                        raise CollectorError(
                            f"background collection did not pause within {timeout} s"
                        )
            server.pause(max(0.0, deadline - time.monotonic()))
            try:
                yield
            finally:
                server.resume()
        finally:
            self.pause_requested.clear()


class Throttle:
    """Holds collection back until the learner has sampled ``ratio`` rows per row
    collected past ``learning_starts`` (``train_ratio``)."""

    def __init__(self, ratio: float, buffer: CountsSamples, learning_starts: int) -> None:
        self.ratio = ratio
        self.buffer = buffer
        self.learning_starts = learning_starts
        self.sampled_at_start = buffer.sampled
        self.written_at_start = buffer.written
        self.wait_seconds = 0.0

    def learner_may_sample(self) -> bool:
        """Whether the learner is below its share: the exact complement of what
        :meth:`wait` waits for, so one side can always go on (no deadlock) and the ratio
        stays within one batch of either side."""
        collected = self.buffer.written - self.written_at_start
        sampled = self.buffer.sampled - self.sampled_at_start
        return sampled < math.ceil(self.ratio * (collected - self.learning_starts))

    def wait(self, frames: int, idle: Callable[[], None]) -> None:
        """Return once the learner has sampled enough for ``frames`` rows collected;
        ``idle`` runs between bounded waits (quiet points, error checks)."""
        ahead = frames - self.learning_starts
        if ahead <= 0:
            return
        target = self.sampled_at_start + math.ceil(self.ratio * ahead)
        t0 = time.perf_counter()
        while not self.buffer.wait_sampled(target, POLL):
            idle()
        self.wait_seconds += time.perf_counter() - t0

    def stats(self, frames: int) -> dict[str, float]:
        sampled = self.buffer.sampled - self.sampled_at_start
        return {
            "train_ratio": sampled / max(1, frames - self.learning_starts),
            "throttle_wait_seconds": self.wait_seconds,
        }


def wait_to_sample(
    background: Background, buffer: CountsSamples, throttle: Throttle | None, timeout: float | None
) -> bool:
    """The learner's wait (``AsyncBatchedCollector.wait_to_sample``): True once it may
    sample; False when ``timeout`` passes first or collection has ended with nothing
    left for it. Wakes on every write to ``buffer``, and every ``POLL`` seconds to check
    whether collection has ended."""

    def may_sample() -> bool:
        if throttle is not None:
            return throttle.learner_may_sample()
        return len(buffer) > 0 and not background.finished.is_set()

    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        written = buffer.written  # read first: a write after it ends the wait below
        if may_sample():
            return True
        if background.finished.is_set():
            background.raise_error()
            return may_sample()  # the last batch may have landed after the check above
        left = POLL if deadline is None else min(POLL, deadline - time.monotonic())
        if left <= 0:
            return False
        buffer.wait_written(written + 1, left)
