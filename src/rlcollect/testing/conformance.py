"""The transport conformance suite: :func:`check_transport` and its :data:`CHECKS`.

:func:`check_transport` runs the suite against any
:class:`~rlcollect.transports.Transport` subclass, driving it with real worker loops
over CountingEnvs and a numpy stand-in for the inference server (``AssertionError``
naming the failed check if one fails).
"""

from __future__ import annotations

from collections.abc import Callable

from rlcollect.testing._checks import (
    _check_abort,
    _check_backpressure,
    _check_close_unblocks_workers,
    _check_double_buffered_round_trip,
    _check_named_slots,
    _check_pooled_ring,
    _check_restart,
    _check_round_trip,
    _check_segments,
    _check_staged_round_trip,
    _check_worker_error,
)
from rlcollect.transports.base import Transport

__all__ = ["CHECKS", "check_transport"]

CHECKS: dict[str, Callable[[Callable[[], Transport]], None]] = {
    "round_trip": _check_round_trip,
    "double_buffered_round_trip": _check_double_buffered_round_trip,
    "staged_round_trip": _check_staged_round_trip,
    "backpressure": _check_backpressure,
    "worker_error": _check_worker_error,
    "abort": _check_abort,
    "close_unblocks_workers": _check_close_unblocks_workers,
    "restart": _check_restart,
    "named_slots": _check_named_slots,
    "pooled_ring": _check_pooled_ring,
    "segments": _check_segments,
}
"""The conformance checks by name, in the order :func:`check_transport` runs them; run
one alone as ``CHECKS[name](make_transport)`` (each raises ``AssertionError`` saying
what went wrong). What each one checks:

* ``round_trip``: one request per worker at a time; every env's stream arrives whole
  and in order, each action reaches the env whose observation it was computed from,
  and each worker hands its slots over in order.
* ``double_buffered_round_trip``: the same with two requests per worker outstanding
  (two splits of its columns): a worker's requests reach the server in the order it made
  them, one response each.
* ``staged_round_trip``: the same with vector envs that return arbitrary subsets of
  their sub-envs (staged requests).
* ``backpressure``: a worker stops once every slot of its ring is full, and goes on
  by one chunk per released slot.
* ``worker_error``: an env that raises reaches ``wait_chunks`` as a
  :class:`~rlcollect.errors.WorkerError` naming the env, the remote traceback as its
  cause.
* ``abort``: ``abort()`` ends both driver waits promptly; ``close()`` twice is harmless.
* ``close_unblocks_workers``: ``close()`` ends workers blocked on a response or on a
  full ring, and returns.
* ``restart``: (transports with ``supports_restart`` only) every chunk a failing
  worker handed over comes before its failure; after ``restart_worker`` the new worker
  starts with every slot free and takes only the answers to its own requests.
* ``named_slots``: (transports with ``names_slots`` only) ``wait_slot`` returns every
  slot once from 0 up, then the slots ``release`` gives back, in the order it gives
  them, however that differs from the order they were handed over.
* ``pooled_ring``: (transports with ``pool_slots`` only) in a pooled ring, each worker
  starts with ``RingLayout.first_credits`` and writes the slot each credit names, in
  the whole ring its ``buffers`` show, whichever worker wrote the slot before.
* ``segments``: every shared-memory segment ``Transport.segments()`` names is in
  ``/dev/shm`` while the transport runs, and gone once it is closed.
"""


def check_transport(make_transport: Callable[[], Transport]) -> None:
    """Run every check of the conformance suite on transports from ``make_transport``.

    The checks (:data:`CHECKS`, in order) start a fresh transport each, drive it with
    real worker loops over CountingEnvs and a numpy stand-in for the inference server,
    and check routing, stream order, backpressure, error reporting, ``abort`` and
    ``close``. A check that would hang fails after a 60-second deadline instead.

    Args:
        make_transport: builds a new, unstarted transport (a class works).

    Raises:
        AssertionError: a check failed; the message names it and what went wrong.

    Examples:
        >>> from rlcollect.testing import CHECKS, check_transport
        >>> from rlcollect.transports import ThreadQueueTransport
        >>> list(CHECKS)[:3]
        ['round_trip', 'double_buffered_round_trip', 'staged_round_trip']
        >>> check_transport(ThreadQueueTransport)
    """
    for name, check in CHECKS.items():
        try:
            check(make_transport)
        except AssertionError as exc:
            raise AssertionError(f"transport check {name!r} failed: {exc}") from exc
