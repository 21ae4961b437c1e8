"""``policy_lag=1``: the next on-policy round runs while the learner learns on this one.

::

    caller's thread                              helper thread ("rlcollect-next-round")
    ───────────────                              ──────────────────────────────────────
    next() → batch k  ── starts, unless k was ──▶ produce(): opens round k+1 with the
    learns on batch k      the last batch          weights current now (the update made
    update_policy_weights_(k) waits for round      on batch k-1), copies its chunks
      k+1 to end, then lands (rollouts.py)         into batch k+1, closes the round
    next() ◀──────────── batch k+1, or its error ─ ends

Without it (``policy_lag=0``) a round starts only when its batch is asked for, so the
envs wait while the learner learns and every batch reflects every update made before
it was asked for. With it, batch ``k+1`` is acted by the weights before the update on
batch ``k``: a lag of exactly one update from the second batch on, never more, since a
round starts only when the batch before it is handed out. The round's own rules hold
(``rounds.py``): one weights version per batch, updates land between rounds.

The helper is started only while the budget has batches left (``exhausted``), so it
never asks past the last batch: the collector stays up after handing it out, and the
caller's last ``update_policy_weights_`` lands as in a plain loop. Its round is claimed
(``claim``: ``RoundGate.claim`` in ``rounds.py``) before the helper starts, in the
caller's thread: an update made after ``next()`` returned waits for that round however
late the helper is scheduled.

The helper keeps its error for the caller's next call: ``next()``, or the
``update_policy_weights_`` that waits for the failed round (:meth:`RoundAhead.take_error`;
the round's watchdog, stalls, worker deaths and the server's health, runs in the
helper, in ``produce``). Whichever comes first raises it, once. A shutdown ends the
helper's round (every wait in ``produce`` is bounded and checks for it), and
:meth:`RoundAhead.stop` joins it.

``pause()`` holds collection between two rounds, as it does without a lag (where no
round runs between two ``next()`` calls): :class:`PauseBetweenRounds` lets the helper's
round end before it pauses the server, so that an update made inside the pause, which
waits for the round running to end, cannot wait for a round the pause holds.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from rlcollect._tensordict import TensorDict
from rlcollect.collector.background import POLL, Pausable
from rlcollect.errors import CollectorError

__all__ = ["PauseBetweenRounds", "RoundAhead"]


class RoundAhead:
    """Produces the next batch in a helper thread as soon as one is handed out."""

    def __init__(
        self,
        produce: Callable[[], TensorDict | None],
        exhausted: Callable[[], bool],
        claim: Callable[[], None],
    ) -> None:
        # No callable may hold the collector: its garbage collection shuts it down.
        self._produce = produce
        self._exhausted = exhausted
        self._claim = claim
        self._thread: threading.Thread | None = None
        self._done = threading.Event()
        self._batch: TensorDict | None = None
        self._error: BaseException | None = None
        self._error_lock = threading.Lock()  # next() and take_error() may race for it
        self._taken = False  # take_error() raised the helper's error already

    def next(self) -> TensorDict | None:
        """The next batch (the helper's, once it has one); None once the budget is met."""
        if self._thread is None:
            batch = self._produce()
        else:
            # produce() bounds its own waits and ends at shutdown or on any failure.
            while not self._done.wait(POLL):
                pass
            self._thread.join()
            self._thread = None
            batch, self._batch = self._batch, None
            with self._error_lock:
                error, self._error = self._error, None
                taken, self._taken = self._taken, False
            if error is not None:
                raise error
            if taken:  # raised by an update, which shut the collector down
                raise CollectorError("the collector is shut down")
        if batch is not None and not self._exhausted():
            self._claim()
            self._done.clear()
            self._thread = threading.Thread(
                target=self._run, name="rlcollect-next-round", daemon=True
            )
            self._thread.start()
        return batch

    def wait_idle(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for the helper's round; True once none runs.
        Only the caller's thread starts a round (in :meth:`next`), so it stays so while
        that thread is elsewhere, e.g. in ``pause()``."""
        return self._thread is None or self._done.wait(timeout)

    def _run(self) -> None:
        try:
            self._batch = self._produce()
        except BaseException as error:  # kept for the caller's next call
            with self._error_lock:
                self._error = error
        finally:
            self._done.set()

    def take_error(self) -> BaseException | None:
        """The helper's error, once it ended with one, for a call other than ``next()``
        to raise (``next()`` then says the collector is shut down); None otherwise."""
        with self._error_lock:
            error, self._error = self._error, None
            if error is not None:
                self._taken = True
            return error

    def stop(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for the helper (the collector is shut down)."""
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)


class PauseBetweenRounds:
    """What ``pause()`` holds with ``policy_lag=1``: the server, once the round collected
    ahead has ended."""

    def __init__(self, ahead: RoundAhead, server: Pausable) -> None:
        self._ahead = ahead
        self._server = server

    def pause(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        if not self._ahead.wait_idle(timeout):
            raise CollectorError(
                f"the round collected ahead (policy_lag=1) did not end within {timeout} s; "
                "pause() holds collection between two rounds"
            )
        self._server.pause(max(0.0, deadline - time.monotonic()))

    def resume(self) -> None:
        self._server.resume()
