"""The driver's ends of :class:`~rlcollect.transports.process_slots.ProcessSlotTransport`.

:class:`ProcessServerEnd` is the :class:`ServerEnd` in the driver; ``_RequestEnd``
serves the requests from another process, opened there from a
:class:`ProcessSlotChannel`. The protocol both keep (who writes what, in what order,
why it is safe) is in ``process_slots.py``; the worker's end is in
``process_worker.py``. Not API: the transport's own parts.
"""

from __future__ import annotations

import mmap
import os
import pickle
import select
import struct
import subprocess
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from rlcollect.errors import ChannelClosed, WorkerError, WorkerFailure
from rlcollect.lifeline import Lifeline
from rlcollect.processes import attach_segment, describe_exit, reap, release_mapping, wait_exit
from rlcollect.transports.base import RequestChannel, RequestEnd, ServerEnd
from rlcollect.transports.generations import Generations, response_token
from rlcollect.transports.layout import RingLayout

__all__ = ["CREDIT", "MAX_FIRST_CREDITS", "ProcessServerEnd", "ProcessSlotChannel", "credit_bytes"]

_READ_BYTES = 1 << 16
_REPORT_WAIT = 2.0  # seconds to read a dying worker's report and exit code
_CLOSE_WAIT = 5.0  # seconds close_fds() waits for another thread's wait to return
# Seconds between looks at the worker processes themselves. A worker's death normally
# shows at once as end-of-file on its reports pipe, but not while another process holds
# a copy of that pipe's write end (a process the env started, which inherited it).
_LIVENESS_EVERY = 0.5

# A credit names the slot (in a pooled ring, any slot of the whole ring) a worker may
# write next: two bytes, little-endian, so a pooled ring may hold 65,536 slots, far more
# than a pool of many one-column workers needs (one byte would name only 256).
CREDIT = struct.Struct("<H")
# The most credits one write may carry: 4,096 bytes, PIPE_BUF on Linux. A pipe write of
# at most PIPE_BUF bytes is never split, so a reader never sees half a credit, and an
# empty pipe holds at least that much (a pipe has one page at the least), so the
# driver's first write of a worker's credits never blocks. A worker never holds more
# credits than its first ones (its slots, or a pooled ring's two), so no later write
# fills its pipe either.
MAX_FIRST_CREDITS = 4096 // CREDIT.size


def credit_bytes(slots: Sequence[int]) -> bytes:
    """Credits naming ``slots``, in order, as the bytes of one write."""
    return b"".join(CREDIT.pack(slot) for slot in slots)


class ProcessServerEnd(ServerEnd):
    """The driver's end: requests (inference thread), chunks and reports (consuming
    thread); ``abort`` from any thread."""

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
        lifeline: Lifeline | None = None,
    ) -> None:
        self.buffers = layout.views(ring)
        self._lifeline = lifeline
        self._ring = ring
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
        # The waits under way (wait_requests, wait_chunks): close_fds() closes the fds
        # they read only once none is left, so that a thread still inside one never reads
        # a closed fd, nor one the process has since reused for something else.
        self._waits = 0
        self._no_waits = threading.Condition(self._lock)
        self._failure: WorkerError | None = None
        self._generations = Generations(layout.num_workers)
        self._look_at = time.monotonic() + _LIVENESS_EVERY

    # inference thread ------------------------------------------------------------------

    def wait_requests(self, timeout: float) -> list[tuple[int, int]]:
        self._enter_wait()
        try:
            tagged = _read_requests(self._requests_r, self._request_poll, self._wake_r, timeout)
        finally:
            self._leave_wait()
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
        self._enter_wait()
        try:
            return self._wait_chunks(timeout)
        finally:
            self._leave_wait()

    def _wait_chunks(self, timeout: float) -> list[tuple[int, int]]:
        ready = self._chunk_poll.poll(_ms(timeout))
        if self._aborted:
            # Set before abort() closes the pipes that stop the workers: a worker that
            # exited since then was stopped, and its exit is no failure of its own.
            raise ChannelClosed("transport aborted")
        if time.monotonic() >= self._look_at:
            ready = self._dead_workers() + ready
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

    def _dead_workers(self) -> list[tuple[int, int]]:
        """The reports pipes of workers whose process has exited, as if they had polled
        ready (their report, if any, is read there; the exit status says the rest)."""
        self._look_at = time.monotonic() + _LIVENESS_EVERY
        if self._aborted:
            return []  # workers exit when aborted: that is no failure of theirs
        dead = {w for w, proc in enumerate(self._procs) if reap(proc) is not None}
        return [(fd, select.POLLIN) for fd, w in self._reports_r.items() if w in dead]

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
                _write_driver(self._credits_w[worker], CREDIT.pack(slot))

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
        how = describe_exit(wait_exit(proc, _REPORT_WAIT))
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

    # A wait under way, from _enter_wait() to _leave_wait() (try/finally in the waits, not
    # a context manager: the server thread waits once per batch of requests).
    def _enter_wait(self) -> None:
        with self._lock:
            if self._aborted:
                raise ChannelClosed("transport aborted")
            self._waits += 1

    def _leave_wait(self) -> None:
        with self._lock:
            self._waits -= 1
            if not self._waits:
                self._no_waits.notify_all()

    def abort(self) -> None:
        with self._lock:
            if self._aborted:
                return
            self._aborted = True
            if self._lifeline is not None:
                self._lifeline.orderly()  # before the pipes: the workers are stopped
            os.write(self._wake_w, b"\x01")
            for fd in (*self._responses_w, *self._credits_w):
                os.close(fd)

    def close_all(self) -> None:
        """Close every remaining driver fd and give the ring's memory back; only after
        abort(), with no waits running and the workers stopped."""
        self.buffers = {}
        release_mapping(self._ring)
        self.close_fds()

    def close_fds(self) -> None:
        """Close every remaining driver fd; only after abort(). A wait still under way in
        another thread returns at once (abort() woke it), unless that thread is not
        scheduled: its fds are closed once it has returned, or after ``_CLOSE_WAIT``
        seconds (close never hangs)."""
        with self._lock:
            self._no_waits.wait_for(lambda: not self._waits, timeout=_CLOSE_WAIT)
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


@dataclass(frozen=True)
class ProcessSlotChannel(RequestChannel):
    """:class:`~rlcollect.transports.process_slots.ProcessSlotTransport`'s request side:
    its segment, requests pipe and response pipes (the fds keep their numbers in the
    serving process)."""

    shm_name: str
    layout: RingLayout
    requests_fd: int
    response_fds: tuple[int, ...]

    @property
    def pass_fds(self) -> tuple[int, ...]:
        """The requests pipe and the response pipes."""
        return (self.requests_fd, *self.response_fds)

    def open(self) -> RequestEnd:
        """The request end, in the serving process (FileNotFoundError once closed)."""
        return _RequestEnd(self)


class _RequestEnd(RequestEnd):
    """The request side of the ring, served from the process that opened it; chunks
    still go to the driver."""

    def __init__(self, channel: ProcessSlotChannel) -> None:
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
