"""The lifeline: a child of the driver notices the driver's death, even inside a long call.

Each driver object that starts children (the process transport, the inference process)
holds a pipe (:class:`Lifeline`) whose read end every child it starts inherits
(``processes.spawn`` passes it, and names it in the child's environment) and whose
write end only the driver has (``os.pipe`` descriptors are not inherited by other
children). Nothing is ever read from it; a thread of the child waits until it polls
readable (:func:`watch_driver`):

* The driver writes one byte before it stops its children in order (``orderly``: a
  ``close()``, or an abort of the ring). The byte stays, readable for every child.
* The driver's death closes the write end, however it dies (SIGKILL included): the
  pipe polls end-of-file, with no byte.

End-of-file with no byte is the driver's death. A child inside a long env call or
policy call would not see its other pipes close until the call returns; the thread
waits a grace for the child to end by itself (a child blocked on a pipe sees it close
at once, and ends in order), then runs its clean-up (unlinking every segment it knows
of, which nobody else will: the ring, and what its program named, registered with
:func:`at_driver_death`) and sends SIGKILL to the child's process group: the child and
whatever it started (``processes.py``: every child leads a group of its own). A child
that ends in order after its driver died ends its group the same way
(:func:`exit_child`), since no driver is left to; with its driver alive, it just exits,
and the driver kills the group as it reaps the child (``processes.reap``).

A worker starts its thread once it has loaded its program, not before: until then it
does not know every segment its program names (the in-worker policy's weights board),
and a worker still importing reaches its pipes by itself, finds them closed and ends
in order, unlinking them all.

Why not ``PR_SET_PDEATHSIG``: it fires when the *thread* that started the child exits,
and a collector may be built, or restart a worker, in a thread that ends long before
the driver does. Imports no torch: worker processes import it.
"""

from __future__ import annotations

import os
import select
import signal
import threading
import time
import weakref
from collections.abc import Callable
from typing import NoReturn

__all__ = ["Lifeline", "at_driver_death", "exit_child", "watch_driver"]

_GRACE = 2.0  # seconds a child whose driver died gets to end in order before it is ended
_ORDER_WAIT = 1.0  # seconds an ending child waits to learn whether its driver lives


# The environment variable that names a child's lifeline descriptor.
_FD_VARIABLE = "RLCOLLECT_LIFELINE_FD"


class Lifeline:
    """The driver's end of a lifeline (module docstring): one pipe, its read end passed
    to every child the owner starts, its write end held here until :meth:`close`."""

    def __init__(self) -> None:
        self.read_fd, self._write_fd = os.pipe()
        self._ordered = False
        # Closed with its owner too where that is garbage-collected unclosed.
        self._close = weakref.finalize(self, _close_both, self.read_fd, self._write_fd)

    def child_env(self) -> dict[str, str]:
        """What a child's environment says of its lifeline (the descriptor it inherits)."""
        return {_FD_VARIABLE: str(self.read_fd)}

    def orderly(self) -> None:
        """Say that the children are stopped in order from here on (once; never blocks:
        an empty pipe takes a byte)."""
        if self._ordered or not self._close.alive:
            return
        self._ordered = True
        os.write(self._write_fd, b"!")

    def close(self) -> None:
        """Close both ends (once every child has exited, or been killed); idempotent."""
        self._close()


def _close_both(read_fd: int, write_fd: int) -> None:
    os.close(read_fd)
    os.close(write_fd)


# What a child must undo if its driver dies (unlink the segments it knows of), in order.
_CLEANUPS: list[Callable[[], None]] = []


def watch_driver(cleanup: Callable[[], None]) -> None:
    """In a child started by ``processes.spawn``: a daemon thread that, if the driver
    dies, waits a grace for this child to end by itself, then runs ``cleanup`` (unlink
    the segments) and what :func:`at_driver_death` added, and kills the child's process
    group, the child included."""
    if _lifeline_fd() < 0:
        return  # not started with a lifeline
    _CLEANUPS.append(cleanup)
    threading.Thread(target=_watch, name="rlcollect-lifeline", daemon=True).start()


def at_driver_death(cleanup: Callable[[], None]) -> None:
    """Run ``cleanup`` too before this child ends itself for its driver's death (a
    segment it learnt of from its program, say); nothing where it has no lifeline."""
    if _lifeline_fd() >= 0:
        _CLEANUPS.append(cleanup)


def _watch() -> None:
    if _driver_alive(None):
        return  # stopped in order: the driver ends this child and its group
    time.sleep(_GRACE)  # bounded: the child's own way out first
    try:
        for cleanup in list(_CLEANUPS):
            try:
                cleanup()
            except Exception:  # the rest still runs; there is no one to tell
                pass
    finally:
        _end_group(1)


def exit_child(code: int) -> NoReturn:
    """End this child (started by ``processes.spawn``) with ``code``, without the interpreter's
    teardown; with its whole process group if its driver has died (no one else will)."""
    if not _driver_alive(_ORDER_WAIT):
        _end_group(code)
    os._exit(code)


def _driver_alive(timeout: float | None) -> bool:
    """Whether the driver is alive (no orderly byte, no end of file yet within
    ``timeout`` s), or stopping this child in order (the byte); False once it died."""
    fd = _lifeline_fd()
    if fd < 0:
        return True  # not started with a lifeline: nothing says otherwise
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    ready = poller.poll(None if timeout is None else int(timeout * 1000))
    return not ready or bool(ready[0][1] & select.POLLIN)


_fd: int | None = None


def _lifeline_fd() -> int:
    """This child's lifeline descriptor, or -1; read once, and taken out of the
    environment, so that the processes the child starts do not take it for theirs."""
    global _fd
    if _fd is None:
        value = os.environ.pop(_FD_VARIABLE, "")
        _fd = int(value) if value.isdigit() else -1
    return _fd


def _end_group(code: int) -> NoReturn:
    """SIGKILL to this child's process group, the child last of all; only where the child
    leads its group (as ``processes.spawn`` starts it), else just its own exit."""
    if os.getpgid(0) == os.getpid():
        os.killpg(0, signal.SIGKILL)
    os._exit(code)
