"""How long the server thread waits to take the interpreter lock back.

Why: with ``inference_backend="thread"`` the inference server is a thread of the
training process and shares the interpreter lock with the training script's threads.
It lets go of the lock many times a batch (to wait for requests, to write each answer,
inside each torch call) and must take it back each time. A thread busy in pure Python
(a training loop that parses, logs or loops over rows) keeps the lock until the switch
interval runs out (``sys.getswitchinterval()``, 5 ms by default), so each take-back
costs that long and collection starves; with ``inference_backend="process"`` the server
has an interpreter of its own and does not wait (``docs/decisions/server-process.md``
has the measurement). Nothing in the collector can take the lock from such a thread; it
can tell the user.

How: now and then (``LockWatch.check``) the server lets go of the lock for no time
(``time.sleep(0)``) and times how long it took to get it back, less the time it spent
on a core and waiting for one (``/proc/thread-self/schedstat``), so a busy machine is
not taken for a busy lock. A take-back of half the switch interval or more in most of
the recent checks means another thread keeps the lock for whole intervals.
"""

from __future__ import annotations

import sys
import time
from collections import deque

__all__ = ["LockWatch"]

_SCHEDSTAT = "/proc/thread-self/schedstat"  # ns on a core, ns runnable waiting for one


def _core_seconds() -> float | None:
    """This thread's seconds on a core plus waiting for one, or None where the kernel
    does not say."""
    try:
        with open(_SCHEDSTAT, "rb") as f:
            on_core, queued = f.read().split()[:2]
    except (OSError, ValueError):
        return None
    if int(on_core) == 0:  # a kernel that keeps no scheduler statistics
        return None
    return (int(on_core) + int(queued)) / 1e9


class LockWatch:
    """Samples how long the calling thread waits to take the interpreter lock back.

    Call :meth:`due` from the thread's loop and :meth:`check` when it says so; always
    from the same thread (the one watched).
    """

    def __init__(self, every: float = 1.0, window: int = 5, strikes: int = 3) -> None:
        self._every = every
        self._next = time.perf_counter() + every
        self._strikes = strikes
        self.waits: deque[float] = deque(maxlen=window)  # seconds, the latest last

    def due(self, now: float) -> bool:
        """True once ``every`` seconds have passed since the last check."""
        return now >= self._next

    def check(self) -> None:
        """Let go of the lock for no time and record how long getting it back took
        (nothing where the kernel does not give this thread's time on a core)."""
        before = _core_seconds()
        t0 = time.perf_counter()
        time.sleep(0)  # lets go of the lock and asks for it back at once
        elapsed = time.perf_counter() - t0
        after = _core_seconds()
        self._next = time.perf_counter() + self._every
        if before is None or after is None:
            return
        # What the thread spent on a core or queued for one is not the lock's doing.
        self.waits.append(max(0.0, elapsed - (after - before)))

    def starved(self) -> bool:
        """True if, in ``strikes`` of the recent checks, taking the lock back took half
        the switch interval or more."""
        bound = sys.getswitchinterval() / 2
        return sum(w >= bound for w in self.waits) >= self._strikes
