"""Worker processes, the ring in one shared-memory segment, doorbells on pipes.

Data flow::

    worker process i (numpy only)        shared memory (one segment)        driver process
    ┌─────────────────────────────┐     ┌───────────────────────────┐     ┌──────────────────────┐
    │ writes obs at position p ───┼────▶│ ring[field][i, p, env]    │◀────┼ inference thread:     │
    │ request:  (i, p) ───────────┼─ requests pipe (shared) ───────────-─▶│  gathers, runs policy,│
    │                             │     │                           │◀────┼  writes action at p   │
    │ wait_response ◀─────────────┼─ responses[i] pipe ─────────────────-─┼  respond: 1 byte      │
    │ steps envs, writes reward,  │     │                           │     │                      │
    │ next obs … chunk full:      │     │                           │     │ consuming thread:     │
    │ hand_over: (i, slot) ───────┼─ chunks pipe (shared) ─────────────-─▶│  copies slot out ◀────┤
    │ wait_slot ◀─────────────────┼─ credits[i] pipe ───────────────────-─┼  release: 1 byte      │
    │ on failure: report ─────────┼─ reports[i] pipe ──────────────────-─▶│  WorkerError          │
    └─────────────────────────────┘     └───────────────────────────┘     └──────────────────────┘

The shared-memory protocol (who writes what, in what order, why it is safe):

* The driver creates the segment (owner-only, a random name) before any worker starts
  and is the only one to unlink it, except that a worker which finds the driver gone
  unlinks it too (``shm_unlink`` of a removed name is harmless), so that a driver
  killed with SIGKILL leaves no segment behind.
* A worker writes the observations of its request ``q`` (in place: the observation
  fields of one group of its envs at one position; staged, for vector envs: one of the
  two staging cells of each env it names and the request index
  ``("staged", "rows")[i, q]``) and only then writes the 8-byte message ``(i, q)`` to
  the requests pipe. The server reads those cells only after it has read that message.
  A pipe ``write``/``read`` pair orders memory like a lock release/acquire (the kernel
  takes the pipe's lock on both sides), so the server sees every byte written before
  the message. Messages are 8 bytes, below ``PIPE_BUF``, so writes from many workers
  never interleave, and one worker's messages arrive in the order it wrote them.
* The server writes the action fields (and policy outputs, version) of request
  ``(i, q)`` and then one byte to ``responses[i]``; the worker reads them after that
  byte. Worker ``i`` has at most ``groups`` requests outstanding, each naming cells no
  other outstanding request names (another group's columns, or other envs' staging
  cells: an env is in one request at a time), so nobody else writes those cells
  meanwhile. The server answers in arrival order, so the worker's ``n``-th byte is the
  answer to its ``n``-th request.
* A worker writes the rest of a step (reward, flags, next observation; for vector envs
  whole transitions, their observation and outputs copied from each env's other
  staging cell, which no outstanding request names, while the server may be serving
  the new one) into a slot it owns, then ``(i, slot)`` to the chunks pipe; it does not
  touch the slot again until it has read a byte from ``credits[i]``, which the driver
  writes after it has copied the slot out. ``credits[i]`` starts with one byte per
  slot.
* A worker's program (its header, then the pickled env factories and spec) reaches it
  in an unnamed temporary file (owner-only) whose descriptor it inherits, not through
  a pipe: a program can be larger than a pipe holds (the bounds of an image
  observation space alone are ~70 KB for Pong), and a pipe write would then wait for
  the worker's interpreter to start and read it, so worker processes would start one
  after another instead of all at once.
* Closing is the stop signal: the driver closes its ends of ``responses[i]`` and
  ``credits[i]``; a worker's blocking read then returns end-of-file and it exits. The
  same happens when the driver dies, however it dies. A worker's death closes its end
  of ``reports[i]``, which wakes the driver's poll at once.

Restarting worker ``i`` (``restart_worker``, for ``max_worker_restarts``), and why it is
safe:

* The driver keeps its copies of the pipe ends a new worker needs (``requests`` and
  ``chunks`` write ends, ``responses[i]`` read end) for the collector's lifetime.
* A worker's failure is raised from ``wait_chunks`` only after the chunks pipe has been
  read empty once the failure was seen: the worker wrote every ``(i, slot)`` message
  before it reported or died, so all its handed-over chunks reach the driver first.
* The driver waits for the old process to exit (and kills it after two seconds), so
  nothing of it writes to the ring or reads a pipe any more. Its slots are all free
  again: the new worker gets a fresh ``credits[i]`` pipe holding ``slots`` bytes and a
  fresh ``reports[i]`` pipe; the driver releases none of the old worker's slots after
  the restart. The rows the old worker was writing are simply overwritten.
* ``responses[i]`` and the requests pipe are shared with the inference server, which
  may still hold requests of the old worker and will answer them. Each worker writes
  its generation into the worker field of its messages (``generations.py``) and each
  response byte echoes the generation of the request it answers; the new worker skips
  bytes of another generation. Such a stale request arrived before every request of
  the new worker, so the server serves it first (or in the same batch), and its writes
  land in cells the new worker overwrites before it reads them.
"""

from __future__ import annotations

import _posixshmem
import mmap
import os
import pickle
import secrets
import select
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import cloudpickle
import numpy as np

from rlcollect.errors import ChannelClosed, CollectorError, WorkerError, WorkerFailure
from rlcollect.transports.base import (
    RequestEnd,
    ServerEnd,
    Transport,
    WorkerEnd,
    WorkerProgram,
    failure_from_exception,
)
from rlcollect.transports.generations import Generations, response_token, tag
from rlcollect.transports.layout import RingLayout, worker_views

# RequestChannel, open_request_end, attach_segment and unlink_segment are the plumbing of
# the collector's inference process (rlcollect.inference.process), not API.
__all__ = ["ProcessSlotTransport"]

_MESSAGE = struct.Struct("<ii")  # (worker, position or slot), little-endian int32 pair
_READ_BYTES = 1 << 16
_REPORT_WAIT = 2.0  # seconds to read a dying worker's report and exit code
# The worker's argument: the descriptor of the file holding its header and program.
_CHILD = "from rlcollect.transports.process_slots import _worker_main; _worker_main()"


@dataclass(frozen=True)
class _Header:
    """What a worker process needs before it can unpickle its program."""

    index: int
    shm_name: str
    layout: RingLayout
    requests_w: int
    chunks_w: int
    responses_r: int
    credits_r: int
    reports_w: int
    generation: int = 0


# ---------------------------------------------------------------------------- worker side


class _ProcessWorker(WorkerEnd):
    def __init__(self, header: _Header, ring: mmap.mmap) -> None:
        self.index = header.index
        self.buffers = worker_views(header.layout.views(ring), header.index)
        self._h = header
        self._tag = tag(header.index, header.generation)
        self._token = bytes([response_token(header.generation)])

    def request(self, position: int) -> None:
        _write(self._h.requests_w, _MESSAGE.pack(self._tag, position))

    def wait_response(self) -> None:
        # Skips answers to requests of a worker this one replaced (generations.py).
        while _read_token(self._h.responses_r) != self._token:
            pass

    def hand_over(self, slot: int) -> None:
        _write(self._h.chunks_w, _MESSAGE.pack(self.index, slot))

    def wait_slot(self) -> None:
        _read_token(self._h.credits_r)

    def report(self, failure: WorkerFailure) -> None:
        try:
            data = pickle.dumps(failure)
            view = memoryview(data)
            while view:
                view = view[os.write(self._h.reports_w, view) :]
        except OSError:
            pass  # the driver is gone; nobody is left to tell


def _write(fd: int, data: bytes) -> None:
    try:
        os.write(fd, data)
    except (BrokenPipeError, OSError) as exc:
        raise ChannelClosed("the driver closed the transport") from exc


def _read_token(fd: int) -> bytes:
    try:
        token = os.read(fd, 1)
    except OSError as exc:
        raise ChannelClosed("the driver closed the transport") from exc
    if not token:
        raise ChannelClosed("the driver closed the transport")
    return token


def attach_segment(name: str, size: int) -> mmap.mmap:
    """Map the existing shared-memory segment ``name`` (without a resource tracker)."""
    # Opened by hand rather than through SharedMemory, which in Python < 3.13 would
    # register the segment with a resource tracker of this process and unlink it when
    # this worker exits, under the feet of the driver and the other workers.
    fd = _posixshmem.shm_open("/" + name, os.O_RDWR, mode=0o600)
    try:
        return mmap.mmap(fd, size)
    finally:
        os.close(fd)


def unlink_segment(name: str) -> None:
    """Remove segment ``name``; already gone is fine."""
    try:
        _posixshmem.shm_unlink("/" + name)
    except FileNotFoundError:
        pass


def _batch_scheduling() -> None:
    """Mark this worker a batch job (Linux ``SCHED_BATCH``): woken by its response, it
    does not preempt the driver, whose inference thread serves every worker. Measured on
    2 cores with Pong: waking a batch of workers took 220-290 µs per batch without it
    (each write let the woken worker run first), 17-19 µs with it."""
    policy = getattr(os, "SCHED_BATCH", None)
    if policy is None:
        return  # not Linux: the default policy works, only a little slower
    try:
        os.sched_setscheduler(0, policy, os.sched_param(0))
    except OSError:
        pass  # refused (some sandboxes): the default policy works, only a little slower


def _worker_main() -> None:
    """Entry point of a worker process (see ``_CHILD``); imports no torch."""
    # Ctrl-C reaches the whole process group; the driver decides how workers stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _batch_scheduling()
    with open(int(sys.argv[1]), "rb") as handed:
        header: _Header = pickle.load(handed)
        payload = handed.read()
    try:
        ring = attach_segment(header.shm_name, header.layout.nbytes)
    except FileNotFoundError:
        return  # the driver closed (and unlinked) before this worker got going
    end = _ProcessWorker(header, ring)
    try:
        program: WorkerProgram = pickle.loads(payload)
        program(end)
    except ChannelClosed:
        unlink_segment(header.shm_name)  # the driver may have died without unlinking
        return
    except BaseException as exc:
        end.report(failure_from_exception(header.index, exc))
        sys.exit(1)
    end.report(failure_from_exception(header.index, RuntimeError("worker program returned")))
    sys.exit(1)


# ---------------------------------------------------------------------------- driver side


class _ProcessServer(ServerEnd):
    def __init__(
        self,
        layout: RingLayout,
        ring: mmap.mmap,
        procs: list[subprocess.Popen[bytes]],
        requests_r: int,
        chunks_r: int,
        *,
        responses_w: list[int],
        credits_w: list[int],
        reports_r: list[int],
    ) -> None:
        self.buffers = layout.views(ring)
        self._procs = procs
        self._requests_r = requests_r
        self._chunks_r = chunks_r
        self._responses_w = responses_w
        #: The requests pipe and the response pipes, for ``request_channel``.
        self.requests_fd = requests_r
        self.responses_fds = tuple(responses_w)
        self._credits_w = credits_w
        self._reports_r = {fd: i for i, fd in enumerate(reports_r)}
        self._wake_r, self._wake_w = os.pipe()
        for fd in (requests_r, chunks_r, self._wake_r, *reports_r):
            os.set_blocking(fd, False)
        self._request_poll = select.poll()
        for fd in (requests_r, self._wake_r):
            self._request_poll.register(fd, select.POLLIN)
        self._chunk_poll = select.poll()
        for fd in (chunks_r, self._wake_r, *reports_r):
            self._chunk_poll.register(fd, select.POLLIN)
        # Guards the write ends that abort() closes against writes from other threads.
        self._lock = threading.Lock()
        self._aborted = False
        self._failure: WorkerError | None = None
        self._generations = Generations(layout.num_workers)

    # inference thread ------------------------------------------------------------------

    def wait_requests(self, timeout: float) -> list[tuple[int, int]]:
        if self._aborted:
            raise ChannelClosed("transport aborted")
        tagged = _read_requests(self._requests_r, self._request_poll, self._wake_r, timeout)
        return self._generations.split(tagged)

    def respond(self, workers: Sequence[int]) -> None:
        with self._lock:
            if self._aborted:
                return
            for w in workers:
                token = bytes([response_token(self._generations.answer(w))])
                _write_driver(self._responses_w[w], token)

    # consuming thread ------------------------------------------------------------------

    def wait_chunks(self, timeout: float) -> list[tuple[int, int]]:
        if self._failure is not None:
            raise self._failure
        if self._aborted:
            raise ChannelClosed("transport aborted")
        ready = self._chunk_poll.poll(_ms(timeout))
        for fd, _ in ready:
            worker = self._reports_r.get(fd)
            if worker is not None:
                failure = self._collect_failure(worker, fd)
                # Chunks the worker handed over before it failed come first.
                pending = self._read_chunks(drain=True)
                self._failure = failure
                if pending:
                    return pending
                raise failure
        for fd, _ in ready:
            if fd == self._wake_r:
                raise ChannelClosed("transport aborted")
        return self._read_chunks()

    def _read_chunks(self, drain: bool = False) -> list[tuple[int, int]]:
        """Chunk messages waiting now; with ``drain``, until the pipe is empty."""
        data = _read_nowait(self._chunks_r) or b""
        while drain and data:
            more = _read_nowait(self._chunks_r)
            if not more:
                break
            data += more
        if not data:
            return []
        pairs = np.frombuffer(data, dtype="<i4").reshape(-1, 2)
        return [(int(w), int(s)) for w, s in pairs]

    def release(self, worker: int, slot: int) -> None:
        with self._lock:
            if not self._aborted:
                _write_driver(self._credits_w[worker])

    def _collect_failure(self, worker: int, fd: int) -> WorkerError:
        """Read worker's report until end-of-file (it exits right after writing it)."""
        chunks = []
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        while poller.poll(_ms(_REPORT_WAIT)):
            data = _read_nowait(fd)
            if not data:
                break
            chunks.append(data)
        if chunks:
            try:
                failure: WorkerFailure = pickle.loads(b"".join(chunks))
                return WorkerError.from_failure(failure)
            except Exception:  # a torn report still means the worker failed
                pass
        proc = self._procs[worker]
        try:
            code = proc.wait(_REPORT_WAIT)
        except subprocess.TimeoutExpired:
            code = None
        how = _describe_exit(code)
        return WorkerError(
            f"worker {worker} (pid {proc.pid}) died without reporting an error: {how}",
            worker_index=worker,
        )

    def replace_worker(self, worker: int, credits_w: int, reports_r: int) -> None:
        """Serve a restarted ``worker`` through its new credits and reports pipes, and
        stop raising the old one's failure (consuming thread only)."""
        with self._lock:
            if self._aborted:
                os.close(credits_w)
                os.close(reports_r)
                raise ChannelClosed("transport aborted")
            old = self._credits_w[worker]
            self._credits_w[worker] = credits_w
            os.close(old)
        for fd, w in list(self._reports_r.items()):
            if w == worker:
                self._chunk_poll.unregister(fd)
                del self._reports_r[fd]
                os.close(fd)
        os.set_blocking(reports_r, False)
        self._reports_r[reports_r] = worker
        self._chunk_poll.register(reports_r, select.POLLIN)
        if self._failure is not None and self._failure.worker_index == worker:
            self._failure = None

    # any thread ------------------------------------------------------------------------

    def abort(self) -> None:
        with self._lock:
            if self._aborted:
                return
            self._aborted = True
            os.write(self._wake_w, b"\x01")
            for fd in (*self._responses_w, *self._credits_w):
                os.close(fd)

    def close_fds(self) -> None:
        """Close every remaining driver fd; only after abort() and with no waits running."""
        for fd in (self._requests_r, self._chunks_r, self._wake_r, self._wake_w, *self._reports_r):
            try:
                os.close(fd)
            except OSError:
                pass


def _read_requests(
    requests_r: int, poller: select.poll, wake_r: int, timeout: float
) -> list[tuple[int, int]]:
    """Requests waiting on ``requests_r``, waiting up to ``timeout`` for one (the poller
    watches ``requests_r`` and ``wake_r``, which abort() writes to)."""
    data = _read_nowait(requests_r)
    if data is None:
        for fd, _ in poller.poll(_ms(timeout)):
            if fd == wake_r:
                raise ChannelClosed("transport aborted")
        data = _read_nowait(requests_r)
        if data is None:
            return []
    if not data:
        raise ChannelClosed("every worker has exited")
    pairs = np.frombuffer(data, dtype="<i4").reshape(-1, 2)
    return [(int(w), int(p)) for w, p in pairs]


def _ms(timeout: float) -> int:
    return max(0, int(timeout * 1000.0 + 0.999))


def _read_nowait(fd: int) -> bytes | None:
    """Bytes waiting on non-blocking ``fd``; None if none, b"" at end-of-file."""
    try:
        return os.read(fd, _READ_BYTES)
    except BlockingIOError:
        return None


def _write_driver(fd: int, token: bytes = b"\x01") -> None:
    try:
        os.write(fd, token)
    except BrokenPipeError:
        pass  # that worker is gone; wait_chunks reports it


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "still running after its report pipe closed"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code} (its stderr may say more)"


# ------------------------------------------------------------ serving from another process


@dataclass(frozen=True)
class RequestChannel:
    """The request side of a started :class:`ProcessSlotTransport`, for an inference
    server in another process (``inference_backend="process"``).

    The fds keep their numbers in a child started with ``pass_fds``. Once a channel is
    handed out, the driver's :class:`ServerEnd` no longer serves requests: the other
    process reads the requests pipe and writes the responses, through
    :func:`open_request_end`. The driver keeps its copies of the response pipes only so
    that closing the transport still stops the workers (end-of-file needs every copy
    closed, the other process's included).
    """

    shm_name: str
    layout: RingLayout
    requests_fd: int
    response_fds: tuple[int, ...]


class _RequestEnd(RequestEnd):
    """The request side of the ring, served from the process that opened it; chunks
    still go to the driver."""

    def __init__(self, channel: RequestChannel) -> None:
        self._ring = attach_segment(channel.shm_name, channel.layout.nbytes)
        self.buffers = channel.layout.views(self._ring)
        self._requests_r = channel.requests_fd
        self._responses_w = list(channel.response_fds)
        self._wake_r, self._wake_w = os.pipe()
        for fd in (self._requests_r, self._wake_r):
            os.set_blocking(fd, False)
        self._poll = select.poll()
        for fd in (self._requests_r, self._wake_r):
            self._poll.register(fd, select.POLLIN)
        self._lock = threading.Lock()
        self._aborted = False
        self._generations = Generations(channel.layout.num_workers)

    def wait_requests(self, timeout: float) -> list[tuple[int, int]]:
        if self._aborted:
            raise ChannelClosed("transport aborted")
        tagged = _read_requests(self._requests_r, self._poll, self._wake_r, timeout)
        return self._generations.split(tagged)

    def respond(self, workers: Sequence[int]) -> None:
        with self._lock:
            if not self._aborted:
                for w in workers:
                    token = bytes([response_token(self._generations.answer(w))])
                    _write_driver(self._responses_w[w], token)

    def abort(self) -> None:
        with self._lock:
            if self._aborted:
                return
            self._aborted = True
            os.write(self._wake_w, b"\x01")
            for fd in self._responses_w:
                os.close(fd)


def open_request_end(channel: RequestChannel) -> RequestEnd:
    """The request-serving end of ``channel``, in the process it was passed to.

    Raises:
        FileNotFoundError: the driver has already closed the transport.
    """
    return _RequestEnd(channel)


class ProcessSlotTransport(Transport):
    """Workers are processes; the ring is one POSIX shared-memory segment.

    Worker processes are started with ``subprocess`` running a few lines of rlcollect
    that import numpy and the env factories only, never torch, and never the caller's
    ``__main__`` module (so scripts need no ``if __name__ == "__main__"`` guard). They
    run with ``OMP_NUM_THREADS=1`` and the like, since an env step gains nothing from a
    thread pool and many pools oversubscribe the cores. Programs travel with
    cloudpickle; ``sys.path`` is passed on so factories from the caller's modules import.

    :meth:`close` closes the workers' pipes, waits up to two seconds for them to exit
    and kills the rest. A transport that is garbage-collected unclosed, or still open at
    interpreter exit, kills its workers and unlinks its segment.

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
        self._server: _ProcessServer | None = None
        self._procs: list[subprocess.Popen[bytes]] = []
        self._shm_name: str | None = None
        self._layout: RingLayout | None = None
        self._finalizer: weakref.finalize[Any, Any] | None = None
        # What restart_worker needs: the pipe ends a new worker inherits, per worker the
        # responses read end and generation, and the environment workers run with.
        self._shared_w: tuple[int, int] | None = None  # requests, chunks write ends
        self._responses_r: list[int] = []
        self._generations: list[int] = []
        self._child_env: dict[str, str] = {}

    supports_restart = True

    @property
    def pids(self) -> list[int]:
        """Process ids of the workers (empty before ``start``)."""
        return [p.pid for p in self._procs]

    @property
    def exit_codes(self) -> list[int | None]:
        """Each worker's exit code (negative: killed by that signal), None while running."""
        return [p.poll() for p in self._procs]

    @property
    def shm_name(self) -> str | None:
        """Name of the shared-memory segment, or None before ``start``."""
        return self._shm_name

    def request_channel(self) -> RequestChannel:
        """Hand the request side to a server in another process (see
        :class:`RequestChannel`); the driver's end stops serving requests.

        Raises:
            CollectorError: before ``start``, or after ``close``.
        """
        if self._server is None or self._shm_name is None or self._layout is None or self._closed:
            raise CollectorError(
                "request_channel() needs a running ProcessSlotTransport: call it after start() "
                "and before close()"
            )
        return RequestChannel(
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
        self._started = True
        payloads = []
        for i, program in enumerate(programs):
            try:
                payloads.append(cloudpickle.dumps(program))
            except Exception as exc:
                raise TypeError(
                    f"worker {i}'s program cannot be pickled for a worker process: {exc}"
                ) from exc

        name = "rlc_" + secrets.token_hex(12)
        fd = _posixshmem.shm_open("/" + name, os.O_CREAT | os.O_EXCL | os.O_RDWR, mode=0o600)
        try:
            os.ftruncate(fd, layout.nbytes)
            ring = mmap.mmap(fd, layout.nbytes)
        except BaseException:
            unlink_segment(name)
            raise
        finally:
            os.close(fd)
        self._shm_name = name
        self._layout = layout
        self._finalizer = weakref.finalize(self, _emergency_cleanup, name, self._procs)

        requests_r, requests_w = os.pipe()
        chunks_r, chunks_w = os.pipe()
        pipes = [(os.pipe(), os.pipe(), os.pipe()) for _ in programs]
        child_fds = [requests_w, chunks_w]
        for responses, credits, reports in pipes:
            child_fds += [responses[0], credits[0], reports[1]]
            os.write(credits[1], b"\x01" * layout.slots)  # the ring starts all free
        self._server = _ProcessServer(
            layout,
            ring,
            self._procs,
            requests_r,
            chunks_r,
            responses_w=[p[0][1] for p in pipes],
            credits_w=[p[1][1] for p in pipes],
            reports_r=[p[2][0] for p in pipes],
        )
        child_env = dict(os.environ)
        for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
            child_env[var] = "1"
        child_env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
        self._child_env = child_env
        try:
            for i, (payload, (resp, cred, rep)) in enumerate(zip(payloads, pipes, strict=True)):
                header = _Header(i, name, layout, requests_w, chunks_w, resp[0], cred[0], rep[1])
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

    def _spawn(self, header: _Header, payload: bytes) -> subprocess.Popen[bytes]:
        h = header
        # Written in full before the process starts (see the module docstring): the
        # driver never waits for a worker to read its program.
        with tempfile.TemporaryFile() as handed:
            handed.write(pickle.dumps(header))
            handed.write(payload)
            handed.flush()
            handed.seek(0)  # the child inherits the open file, offset included
            fd = handed.fileno()
            return subprocess.Popen(
                [sys.executable, "-c", _CHILD, str(fd)],
                stdin=subprocess.DEVNULL,
                pass_fds=(h.requests_w, h.chunks_w, h.responses_r, h.credits_r, h.reports_w, fd),
                env=self._child_env,
            )

    def restart_worker(self, worker: int, program: WorkerProgram) -> None:
        """Start a new process for ``worker`` after its old one failed or died (the
        protocol is in this module's docstring).

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
        _stop_processes([self._procs[worker]], timeout=_REPORT_WAIT)
        credits_r, credits_w = os.pipe()
        reports_r, reports_w = os.pipe()
        os.write(credits_w, b"\x01" * layout.slots)  # every slot is free again
        try:
            server.replace_worker(worker, credits_w, reports_r)
            self._generations[worker] += 1
            header = _Header(
                worker,
                name,
                layout,
                *self._shared_w,
                self._responses_r[worker],
                credits_r,
                reports_w,
                generation=self._generations[worker],
            )
            self._procs[worker] = self._spawn(header, payload)
        finally:
            os.close(credits_r)
            os.close(reports_w)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._server is not None:
            self._server.abort()
        if self._shm_name is not None:
            unlink_segment(self._shm_name)
        _stop_processes(self._procs, timeout=2.0)
        if self._server is not None:
            self._server.close_fds()
        for fd in (*(self._shared_w or ()), *self._responses_r):
            os.close(fd)
        self._shared_w, self._responses_r = None, []
        if self._finalizer is not None:
            self._finalizer.detach()


def _stop_processes(procs: list[subprocess.Popen[bytes]], timeout: float) -> None:
    """Wait for workers to exit after their pipes closed; kill any that do not."""
    deadline = time.monotonic() + timeout
    for proc in procs:
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
    for proc in procs:
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pass  # unkillable (stuck in the kernel); nothing more can be done


def _emergency_cleanup(name: str, procs: list[subprocess.Popen[bytes]]) -> None:
    """Runs when a transport is garbage-collected or the interpreter exits unclosed."""
    unlink_segment(name)
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
