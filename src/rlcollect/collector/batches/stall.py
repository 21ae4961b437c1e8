"""Stalls: an env call that does not return, or a worker that stopped running.

(The policy run inside a worker, ``inference_backend="worker"``, is marked as a call too,
stage ``POLICY``: a forward that never returns is found the same way. A batching
server bounds its own policy calls: ``inference/server.py``.)

A worker's progress record (the ring's :data:`~rlcollect.transports.layout.PROGRESS`
array, one row per worker, int64) says what the worker is doing::

    worker (worker/progress.py)                record       driver (StallWatch, every 0.25 s)
    before an env call: ENV, STAGE, then SINCE ─▶ ┌───────┐
    after it:           SINCE = 0 ─────────────▶ │ SINCE │ ─▶ the same SINCE != 0 seen for
    at start:           PID = os.getpid() ─────▶ │ STAGE │    > stall_timeout: the env is
                                                  │ ENV   │    stalled in STAGE
                                                  │ PID   │ ─▶ PID another process, stopped
                                                  └───────┘    (/proc state T or t) for
                                                               > stall_timeout: stalled

The protocol, and why it is safe without a lock: the worker alone writes its row, and
writes ``ENV`` and ``STAGE`` before ``SINCE``; ``SINCE != 0`` is what makes them count.
The driver reads ``SINCE`` first and the rest after; should a new call begin between
the two reads (the old one was not stalled after all), ``SINCE`` has changed by the
time the driver reads it again, and it reports nothing. ``SINCE`` is
``time.monotonic_ns()``, one clock for every process of the machine. Waiting for the
collector (for actions, for a free slot) is never a stall: the record shows no env call
then, since the wait is the learner's or the server's, not the env's.

A process that is stopped (SIGSTOP, a debugger, Ctrl-Z) shows no stall in its record if
it stopped while waiting; its process state says it, which is why the record holds the
pid. The transport knows the pid too (``Transport.worker_pid``), from the moment it
starts the process, and the watch takes it from there where it can: a worker stopped
before it wrote its record (in its imports, before its first request) is found as
well. Worker threads (the thread transport) have the driver's pid, and are never
stopped alone.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from rlcollect.errors import WorkerError
from rlcollect.processes import process_stopped
from rlcollect.transports.base import Transport
from rlcollect.worker.progress import ENV, PID, SINCE, STAGE, Stage

__all__ = ["Stall", "StallWatch", "Stalls"]

_LOOK_EVERY = 0.25  # seconds between the driver's looks: a stall is found within this


@dataclass(frozen=True)
class Stall:
    """A stalled worker, as the driver found it."""

    worker: int
    pid: int
    seconds: float
    #: The env call (or the in-worker policy's forward) that did not return; None when
    #: the process was found stopped.
    stage: Stage | None
    env: int

    def error(self, timeout: float, envs_per_call: int, stack: str | None) -> WorkerError:
        """The error the caller sees: env, worker, stage and how long, and the stack."""
        if self.stage is None:
            what = (
                f"worker {self.worker} (pid {self.pid}) has been stopped (SIGSTOP or a "
                f"debugger) for {self.seconds:.1f} s"
            )
        elif self.stage is Stage.POLICY:
            what = (
                f"the policy in worker {self.worker} has not returned from its forward in "
                f"{self.seconds:.1f} s"
            )
        else:
            env = f"env {self.env}"
            if envs_per_call > 1:
                env = f"the vector env of envs {self.env}-{self.env + envs_per_call - 1}"
            what = (
                f"{env} (worker {self.worker}) has not finished its {self.stage.name.lower()} "
                f"in {self.seconds:.1f} s"
            )
        message = f"{what}: stalled (stall_timeout={timeout:g} s)"
        if stack:
            message += f"\nthe worker's Python stack:\n{stack.rstrip()}"
        env_index = -1 if self.stage in (None, Stage.POLICY) else self.env
        return WorkerError(message, worker_index=self.worker, env_index=env_index)


class StallWatch:
    """The driver's side: looks at every worker's record, at most every 0.25 s.

    A stall is reported once; the worker's record must change (a new call, or a new
    process after a restart) before that worker can be reported again.
    """

    def __init__(
        self,
        progress: np.ndarray,
        timeout: float,
        pid_of: Callable[[int], int | None] = lambda worker: None,
    ) -> None:
        self._progress = progress
        self._pid_of = pid_of  # the transport's pid of a worker (Transport.worker_pid)
        self._timeout_ns = int(timeout * 1e9)
        self._next_look = 0.0
        self._own_pid = os.getpid()
        # Per worker: (pid, monotonic ns) when it was first seen stopped, and (pid, SINCE,
        # monotonic ns) when its env call was first seen under way. Durations count from
        # the driver's own first sighting: after the whole process group was stopped
        # (Ctrl-Z) and resumed, a call that began before holds no stale age.
        self._stopped_since: dict[int, tuple[int, int]] = {}
        self._call_seen: dict[int, tuple[int, int, int]] = {}
        self._reported: dict[int, tuple[int, int]] = {}  # worker: (pid, since) reported

    def look(self) -> Stall | None:
        """The first stalled worker found now, or None (also between looks)."""
        now_s = time.monotonic()
        if now_s < self._next_look:
            return None
        self._next_look = now_s + _LOOK_EVERY
        now = time.monotonic_ns()
        for worker, record in enumerate(self._progress):
            since = int(record[SINCE])
            pid, stage, env = int(record[PID]), int(record[STAGE]), int(record[ENV])
            stall = None
            # The process as the transport knows it, before it has written its record.
            process = self._pid_of(worker) or pid
            # A stopped process first: stopped in an env call, it is no fault of the env's.
            if process and process != self._own_pid and process_stopped(process):
                first = self._stopped_since.get(worker)
                if first is None or first[0] != process:
                    self._stopped_since[worker] = first = (process, now)
                if now - first[1] > self._timeout_ns:
                    stall = Stall(worker, process, (now - first[1]) / 1e9, None, -1)
                    key = first
            else:
                self._stopped_since.pop(worker, None)
                seen = self._call_seen.get(worker)
                if not since:
                    self._call_seen.pop(worker, None)
                elif seen is None or seen[:2] != (pid, since):
                    self._call_seen[worker] = (pid, since, now)
                elif now - seen[2] > self._timeout_ns and int(record[SINCE]) == since:
                    stall = Stall(worker, pid, (now - since) / 1e9, Stage(stage), env)
                    key = (pid, since)
            if stall is not None and self._reported.get(worker) != key:
                self._reported[worker] = key
                return stall
        return None


class Stalls:
    """What the loop does about stalls: look, stop the worker, say why it died."""

    def __init__(self, watch: StallWatch, transport: Transport, timeout: float, per_call: int):
        self._watch = watch
        self._transport = transport
        self._timeout = timeout
        self._per_call = per_call  # envs per env call: the sub-envs of a vector env
        self._stopped: dict[int, WorkerError] = {}  # worker: its stall, until it dies

    def look(self) -> None:
        """Raise a stall, or stop the stalled worker so that its death follows."""
        stall = self._watch.look()
        if stall is None:
            return
        stack = self._transport.worker_stack(stall.worker)
        error = stall.error(self._timeout, self._per_call, stack)
        if not self._transport.stop_worker(stall.worker):
            raise error
        self._stopped[stall.worker] = error

    def explain(self, error: WorkerError) -> WorkerError:
        """The stall behind a stopped worker's death, else ``error`` itself."""
        stall = self._stopped.pop(error.worker_index, None)
        return error if stall is None else stall
