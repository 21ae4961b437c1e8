"""Worker processes, the ring in one shared-memory segment, doorbells on pipes.

Data flow::

    worker process i (numpy only)        shared memory (one segment)        driver process
    ┌─────────────────────────────┐     ┌───────────────────────────┐     ┌──────────────────────┐
    │ writes obs at position p ───┼────▶│ ring[field][i, p, col]    │◀────┼ inference thread:     │
    │ request:  (i, p) ───────────┼─ requests pipe (shared) ───────────-─▶│  gathers, runs policy,│
    │                             │     │                           │◀────┼  writes action at p   │
    │ wait_response ◀─────────────┼─ responses[i] pipe ─────────────────-─┼  respond: 1 byte      │
    │ steps envs, writes reward,  │     │                           │     │                      │
    │ next obs … chunk full:      │     │                           │     │ consuming thread:     │
    │ hand_over: (i, slot) ───────┼─ chunks pipe (shared) ─────────────-─▶│  copies slot out ◀────┤
    │ wait_slot ◀─────────────────┼─ credits[i] pipe ───────────────────-─┼  release: 2 bytes     │
    │ on failure: report ─────────┼─ reports[i] pipe ──────────────────-─▶│  WorkerError          │
    └─────────────────────────────┘     └───────────────────────────┘     └──────────────────────┘

Worker processes are started, handed their program and stopped with
:mod:`rlcollect.processes` (which also says how the segment is created, mapped and
unlinked), and run as ``SCHED_BATCH`` (``processes.batch_scheduling`` says why). The
worker's end is in ``process_worker.py``, the driver's ends in ``process_server.py``;
this module starts, restarts and stops the workers.

The ring protocol (who writes what, in what order, why it is safe):

* A worker writes the observations of its request ``q`` (in place: the observation
  fields of one split of its columns at one position; staged, for vector envs: one of
  the two staging cells of each column it names and the request index
  ``("staged", "rows")[i, q]``) and only then writes the 8-byte message ``(i, q)`` to
  the requests pipe. The server reads those cells only after it has read that message.
  A pipe ``write``/``read`` pair orders memory like a lock release/acquire (the kernel
  takes the pipe's lock on both sides), so the server sees every byte written before
  the message. Messages are 8 bytes, below ``PIPE_BUF``, so writes from many workers
  never interleave, and one worker's messages arrive in the order it wrote them.
* The server writes the action fields (and policy outputs, version) of request
  ``(i, q)`` and then one byte to ``responses[i]``; the worker reads them after that
  byte. Worker ``i`` has at most ``splits`` requests outstanding, each naming cells no
  other outstanding request names (another split's columns, or other columns' staging
  cells: an env is in one request at a time), so nobody else writes those cells
  meanwhile. The server answers in arrival order, so the worker's ``n``-th byte is the
  answer to its ``n``-th request.
* A worker writes the rest of a step (reward, flags, next observation; for vector envs
  whole transitions, their observation and outputs copied from each env's other
  staging cell, which no outstanding request names, while the server may be serving
  the new one) into a slot it owns, then ``(i, slot)`` to the chunks pipe; it does not
  touch the slot again until it has read a credit from ``credits[i]`` naming it, which
  the driver writes after it has copied the slot out (or, for a batch lent to the
  caller, once the caller let go of it: ``collector/batches/loans.py``). A credit is the
  slot's number in two bytes (``process_server.CREDIT``), and the driver writes whole credits
  in one write of at most ``PIPE_BUF`` bytes, which a pipe never splits, so the worker
  never reads half of one. ``credits[i]`` starts with one credit per slot, 0 up, and
  the worker writes the slot its credit names next (where nothing is lent the driver
  gives slots back in the order they came, which is the order they were written in).
  In a pooled ring (``transports/slots.py``) a credit names any slot of the whole ring
  instead (up to 65,536 slots), which the worker maps whole
  (``RingLayout.worker_spans_ring``): it starts with ``RingLayout.first_credits(i)``,
  and the driver gives each slot to one worker at a time, once the slot is copied out
  or let go of (``collector/batches/pooled.py``), so the same rule holds: nobody else
  writes a slot between a worker's credit for it and its ``(i, slot)`` message, and
  the driver reads it only after that message.
* Closing is the stop signal: the driver closes its ends of ``responses[i]`` and
  ``credits[i]``; a worker's blocking read then returns end-of-file and it exits,
  unlinking the segment in case the driver died without doing so (its envs closed and
  its exit handlers run, but no interpreter teardown: ``process_worker._exit_now``).
  The same happens when the driver dies, however it dies; a worker inside a long env
  call then is ended by its lifeline (``rlcollect/lifeline.py``: the driver writes its
  byte before it closes anything, so a worker tells a stop from a death). A worker's
  death closes its end of ``reports[i]``, which wakes the driver's poll at once; the
  driver kills the worker's process group (whatever its envs started) before it reaps
  it (``processes.reap``). The driver's own read ends (requests, chunks, reports) are
  closed last, once every wait of another driver thread that reads them has returned
  (``ProcessServerEnd.close_fds``): ``abort()`` wakes such a wait at once, and a thread
  that is not scheduled in time must not read a closed descriptor, or one reused since.
* With ``inference_backend="process"`` (``request_channel``) the server runs in another
  process: it maps the segment, reads the requests pipe and writes the response pipes
  itself (``process_server._RequestEnd``), by the rules above; chunks still go to the
  driver. The driver keeps its copies of the response pipes only so that closing the
  transport still stops the workers (end-of-file needs every copy closed).

Restarting worker ``i`` (``restart_worker``, for ``max_worker_restarts``), and why it is
safe (how the new worker tells its answers from its predecessor's: ``generations.py``):

* The driver keeps its copies of the pipe ends a new worker needs (``requests`` and
  ``chunks`` write ends, ``responses[i]`` read end) for the collector's lifetime.
* A worker's failure is raised from ``wait_chunks`` only after the chunks pipe has been
  read empty once the failure was seen: the worker wrote every ``(i, slot)`` message
  before it reported or died, so all its handed-over chunks reach the driver first.
* The driver waits for the old process to exit (and kills it after two seconds), so
  nothing of it writes to the ring or reads a pipe any more. Its slots are all free
  again: the new worker gets a fresh ``credits[i]`` pipe holding its first credits
  (``RingLayout.first_credits``) and a fresh ``reports[i]`` pipe; the driver releases
  none of the old worker's slots after the restart. The rows the old worker was
  writing are simply overwritten.
* ``responses[i]`` and the requests pipe are shared with the inference server, which
  may still hold requests of the old worker and will answer them; each message carries
  the worker's generation, so the new worker skips those answers (``generations.py``).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
import weakref
from collections.abc import Sequence
from typing import Any

import cloudpickle

from rlcollect.errors import CollectorError
from rlcollect.lifeline import Lifeline
from rlcollect.processes import (
    child_env,
    create_segment,
    kill,
    process_stopped,
    reap,
    spawn,
    stop_processes,
    unlink_segment,
)
from rlcollect.transports.base import ServerEnd, Transport, WorkerProgram
from rlcollect.transports.first_worker import FirstWorker
from rlcollect.transports.layout import RingLayout
from rlcollect.transports.process_server import (
    MAX_FIRST_CREDITS,
    ProcessServerEnd,
    ProcessSlotChannel,
    credit_bytes,
)
from rlcollect.transports.process_worker import WorkerHeader

__all__ = ["ProcessSlotTransport"]

_STOP_WAIT = 2.0  # seconds a worker gets to exit once its pipes close, before a kill
_STACK_WAIT = 1.0  # seconds a stalled worker gets to write its stack (worker_stack)
# A worker runs this, with the descriptor of the file holding its header and program.
_CHILD = "from rlcollect.transports.process_worker import worker_main; worker_main()"


class ProcessSlotTransport(Transport):
    """Workers are processes; the ring is one POSIX shared-memory segment.

    Worker processes run a few lines of rlcollect that import numpy and the env
    factories only: never torch, never the caller's ``__main__`` (scripts need no ``if
    __name__ == "__main__"`` guard); their programs travel with cloudpickle
    (:mod:`rlcollect.processes` says how). :meth:`close` closes the workers' pipes,
    waits up to two seconds for them to exit and kills the rest; a transport
    garbage-collected unclosed, or open at interpreter exit, kills its workers and
    unlinks its segment.

    Pass ``transport="process_slots"`` (the default) to the collector, or an instance
    to keep a handle on it.

    Examples:
        >>> import functools
        >>> import os
        >>> import gymnasium as gym
        >>> import torch
        >>> from rlcollect import AsyncBatchedCollector
        >>> from rlcollect.transports import ProcessSlotTransport
        >>> transport = ProcessSlotTransport()
        >>> with AsyncBatchedCollector(
        ...     [functools.partial(gym.make, "Pendulum-v1")] * 4,
        ...     torch.nn.Linear(3, 1),
        ...     frames_per_batch=32,
        ...     transport=transport,
        ...     envs_per_worker=2,
        ... ) as collector:
        ...     segment = f"/dev/shm/{transport.shm_name}"
        ...     during = len(transport.pids), os.path.exists(segment)
        ...     batch = next(collector)
        >>> during  # two worker processes, one shared-memory segment
        (2, True)
        >>> [code is not None for code in transport.exit_codes], os.path.exists(segment)
        ([True, True], False)
    """

    def __init__(self) -> None:
        self._started = False
        self._closed = False
        self._server: ProcessServerEnd | None = None
        self._procs: list[subprocess.Popen[bytes]] = []
        self._shm_name: str | None = None
        self._layout: RingLayout | None = None
        self._finalizer: weakref.finalize[Any, Any] | None = None
        # What restart_worker needs: the pipe ends a new worker inherits, per worker the
        # responses read end and generation, and the environment workers run with.
        self._shared_w: tuple[int, int] | None = None  # requests, chunks write ends
        self._responses_r: list[int] = []
        self._generations: list[int] = []
        # Per worker, an anonymous file the worker dumps its stack into (worker_stack);
        # a restarted worker inherits its predecessor's.
        self._stack_fds: list[int] = []
        self._child_env: dict[str, str] = {}
        # Every worker's read end: its driver's death reaches it (lifeline.py).
        self._lifeline: Lifeline | None = None
        self._first: FirstWorker | None = None  # worker 0, started before (first_worker.py)

    supports_restart = True
    pickles_programs = True
    supports_request_channel = True
    names_slots = True
    pool_slots = 2**16  # a credit is two bytes (process_server.CREDIT)
    adopts_first_worker = True

    def adopt_first_worker(self, first: FirstWorker) -> None:
        if self._started or self._closed:
            raise CollectorError("a ProcessSlotTransport adopts worker 0 before it starts")
        self._first = first  # its process becomes worker 0; its lifeline the workers'

    @property
    def pids(self) -> list[int]:
        """Process ids of the workers (empty before ``start``)."""
        return [p.pid for p in self._procs]

    @property
    def exit_codes(self) -> list[int | None]:
        """Each worker's exit code (negative: killed by that signal), None while running."""
        return [reap(p) for p in self._procs]

    @property
    def shm_name(self) -> str | None:
        """Name of the shared-memory segment, or None before ``start``."""
        return self._shm_name

    def segments(self) -> tuple[str, ...]:
        """The ring's segment (:attr:`shm_name`) once started; unlinked by :meth:`close`."""
        return () if self._shm_name is None else (self._shm_name,)

    def request_channel(self) -> ProcessSlotChannel:
        """The request side, for a server in another process (see the module docstring).

        Raises:
            CollectorError: before ``start``, or after ``close``.
        """
        if self._server is None or self._shm_name is None or self._layout is None or self._closed:
            raise CollectorError(
                "request_channel() needs a running ProcessSlotTransport: call it after start() "
                "and before close()"
            )
        return ProcessSlotChannel(
            self._shm_name,
            self._layout,
            self._server.requests_fd,
            tuple(self._server.responses_fds),
        )

    def start(self, layout: RingLayout, programs: Sequence[WorkerProgram]) -> ServerEnd:
        if self._started:
            raise CollectorError("a ProcessSlotTransport serves one collector; create a new one")
        if len(programs) != layout.num_workers:
            raise ValueError(f"{len(programs)} programs for {layout.num_workers} workers")
        _check_credits(layout, self.pool_slots)
        self._started = True
        payloads = []
        for i, program in enumerate(programs):
            try:
                payloads.append(cloudpickle.dumps(program))
            except Exception as exc:
                raise TypeError(
                    f"worker {i}'s program cannot be pickled for a worker process: {exc}"
                ) from exc

        name, ring = create_segment("rlc_", layout.nbytes)
        self._shm_name = name
        self._layout = layout
        self._finalizer = weakref.finalize(self, _emergency_cleanup, name, self._procs)
        self._lifeline = Lifeline() if self._first is None else self._first.lifeline

        # Until the server end owns the driver's ends, every descriptor is in `opened`,
        # closed if anything fails (a low fd limit fails here, half-way through).
        opened: list[int] = []

        def pipe() -> tuple[int, int]:
            ends = os.pipe()
            opened.extend(ends)
            return ends

        try:
            requests_r, requests_w = pipe()
            chunks_r, chunks_w = pipe()
            pipes = [(pipe(), pipe(), pipe()) for _ in programs]
            for _ in programs:
                self._stack_fds.append(_stack_file())
            child_fds = [requests_w, chunks_w]
            for i, (responses, credits, reports) in enumerate(pipes):
                child_fds += [responses[0], credits[0], reports[1]]
                os.write(credits[1], credit_bytes(layout.first_credits(i)))  # the ring starts free
            self._server = ProcessServerEnd(
                layout,
                ring,
                self._procs,
                requests_r,
                chunks_r,
                responses_w=[p[0][1] for p in pipes],
                credits_w=[p[1][1] for p in pipes],
                reports_r=[p[2][0] for p in pipes],
                lifeline=self._lifeline,
            )
        except BaseException:
            for fd in opened:
                os.close(fd)
            del ring  # its mapping holds a descriptor too
            self.close()  # unlinks the segment, closes the stack files
            raise
        self._child_env = child_env(single_threaded=True)
        try:
            for i, (payload, (resp, cred, rep)) in enumerate(zip(payloads, pipes, strict=True)):
                header = WorkerHeader(
                    i,
                    name,
                    layout,
                    requests_w,
                    chunks_w,
                    resp[0],
                    cred[0],
                    rep[1],
                    stack_fd=self._stack_fds[i],
                )
                self._procs.append(self._spawn(header, payload))
        except BaseException:
            for fd in child_fds:
                os.close(fd)
            self.close()
            raise
        # The driver keeps its own ends, and of the workers' only those a restarted
        # worker shares with the one it replaces (requests, chunks, responses[i]); a
        # worker's exit still shows up as end-of-file on its reports pipe.
        self._shared_w = (requests_w, chunks_w)
        self._responses_r = [p[0][0] for p in pipes]
        self._generations = [0] * len(pipes)
        for _, credits, reports in pipes:
            os.close(credits[0])
            os.close(reports[1])
        return self._server

    def _spawn(self, header: WorkerHeader, payload: bytes) -> subprocess.Popen[bytes]:
        h = header
        fds: tuple[int, ...] = (h.requests_w, h.chunks_w, h.responses_r, h.credits_r, h.reports_w)
        if h.stack_fd >= 0:
            fds += (h.stack_fd,)
        assert self._lifeline is not None  # made in start(), before any worker
        if h.index == 0 and self._first is not None:
            first, self._first = self._first, None
            return first.hand_over(header, payload)
        return spawn(
            _CHILD, header, payload, pass_fds=fds, env=self._child_env, lifeline=self._lifeline
        )

    def restart_worker(self, worker: int, program: WorkerProgram) -> None:
        """Start a new process for ``worker`` after its old one failed or died (the
        protocol is in the module docstring).

        Raises:
            CollectorError: the transport was not started, or is closed.
            TypeError: ``program`` cannot be pickled.
        """
        server, layout, name = self._server, self._layout, self._shm_name
        if self._closed:
            raise CollectorError(
                f"cannot restart worker {worker}: the ProcessSlotTransport is closed"
            )
        if server is None or layout is None or name is None or self._shared_w is None:
            raise CollectorError(
                f"cannot restart worker {worker}: the ProcessSlotTransport was not started"
            )
        try:
            payload = cloudpickle.dumps(program)
        except Exception as exc:
            raise TypeError(f"worker {worker}'s program cannot be pickled: {exc}") from exc
        stop_processes([self._procs[worker]], timeout=_STOP_WAIT)
        credits_r, credits_w = os.pipe()
        try:
            reports_r, reports_w = os.pipe()
        except OSError:  # out of descriptors, say: none of the new ones stays open
            os.close(credits_r)
            os.close(credits_w)
            raise
        os.write(credits_w, credit_bytes(layout.first_credits(worker)))  # every slot is free again
        try:
            server.replace_worker(worker, credits_w, reports_r)
            self._generations[worker] += 1
            header = WorkerHeader(
                worker,
                name,
                layout,
                *self._shared_w,
                self._responses_r[worker],
                credits_r,
                reports_w,
                generation=self._generations[worker],
                stack_fd=self._stack_fds[worker],
            )
            self._procs[worker] = self._spawn(header, payload)
        finally:
            os.close(credits_r)
            os.close(reports_w)

    def worker_stack(self, worker: int) -> str | None:
        """The worker's Python stack (every thread of it), which it writes when sent
        SIGUSR1; None when it is stopped, has exited, or writes nothing within a second."""
        if self._closed or worker >= len(self._procs) or reap(self._procs[worker]) is not None:
            return None
        proc, fd = self._procs[worker], self._stack_fds[worker]
        if fd < 0 or process_stopped(proc.pid):
            return None  # the signal would wait until it runs again
        # The worker shares this file's offset (one open file description): rewind it.
        os.ftruncate(fd, 0)
        os.lseek(fd, 0, os.SEEK_SET)
        os.kill(proc.pid, signal.SIGUSR1)
        deadline = time.monotonic() + _STACK_WAIT
        size = 0
        while time.monotonic() < deadline:
            # Bounded polling: the handler writes the whole dump at once, in C.
            time.sleep(0.02)
            now = os.fstat(fd).st_size
            if now and now == size:
                break
            size = now
        data = os.pread(fd, os.fstat(fd).st_size, 0)
        return data.decode(errors="replace") or None

    def worker_pid(self, worker: int) -> int | None:
        """The process id of ``worker``'s process now (a restarted worker's new one)."""
        if worker >= len(self._procs):
            return None
        return self._procs[worker].pid

    def stop_worker(self, worker: int) -> bool:
        """Kill the worker's process and whatever it started (SIGKILL also ends a stopped
        one); its death then reaches ``wait_chunks`` as any worker's does."""
        if self._closed or worker >= len(self._procs):
            return False
        kill(self._procs[worker])
        return True

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._first is not None:  # adopted, never handed its program
            self._first.close()
        if self._lifeline is not None:
            self._lifeline.orderly()  # the workers stop in order (lifeline.py)
        if self._server is not None:
            self._server.abort()
        if self._shm_name is not None:
            unlink_segment(self._shm_name)
        stop_processes(self._procs, timeout=_STOP_WAIT)  # each with its process group
        if self._server is not None:
            self._server.close_all()
        if self._lifeline is not None:
            self._lifeline.close()
        stacks = [fd for fd in self._stack_fds if fd >= 0]
        for fd in (*(self._shared_w or ()), *self._responses_r, *stacks):
            os.close(fd)
        self._shared_w, self._responses_r, self._stack_fds = None, [], []
        if self._finalizer is not None:
            self._finalizer.detach()


def _check_credits(layout: RingLayout, pool_slots: int) -> None:
    """Raise ValueError where a credit (``process_server.CREDIT``) cannot name every slot
    of ``layout``, or a worker's first credits do not fit one pipe write."""
    first = max(len(layout.first_credits(i)) for i in range(layout.num_workers))
    if first > MAX_FIRST_CREDITS:  # every slot of a worker's own; a pooled ring's are 2
        raise ValueError(
            f"a ProcessSlotTransport ring holds at most {MAX_FIRST_CREDITS} slots per "
            f"worker (a worker's first credits, two bytes each, are one pipe write of at "
            f"most 4096 bytes), got {first}"
        )
    if layout.credited_slots > pool_slots:  # past the first check: only a pooled ring
        raise ValueError(
            f"a ProcessSlotTransport ring holds at most {pool_slots} slots in a pooled "
            f"ring (a credit is two bytes naming its slot), got {layout.credited_slots}"
        )


def _stack_file() -> int:
    """An anonymous in-memory file (no name to leave behind), or -1 where there is none
    (or no descriptor is left: the stack is a nicety)."""
    try:
        return os.memfd_create("rlcollect-worker-stack")
    except (AttributeError, OSError):
        return -1


def _emergency_cleanup(name: str, procs: list[subprocess.Popen[bytes]]) -> None:
    """Runs when a transport is garbage-collected or the interpreter exits unclosed."""
    unlink_segment(name)
    for proc in procs:
        kill(proc)  # each worker with whatever it started
