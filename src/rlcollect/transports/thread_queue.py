"""Workers as threads of the driver process, messages through ``queue.SimpleQueue``.

::

    worker thread i ──(i, position)──▶ requests ──▶ inference thread
    worker thread i ◀──── token ─────  responses[i] ◀─┘
    worker thread i ──(i, slot)─────▶ chunks ──▶ consuming thread
    worker thread i ◀──(slot, 0)─────  credits[i] ◀──┘   (the slot given back)

The ring is an ordinary numpy array. Use it to debug (everything is in one process,
so a debugger and ``print`` see the workers), and for environments whose step releases
the GIL (native vector envs), which then run at native speed without any process
boundary. ``None`` in a queue means "closed": it is put back after being read so that
every later wait sees it too.

Restarts (``restart_worker``; the generation tags are ``generations.py``'s): a failing
worker puts ``(worker, -1)`` on the chunks queue after every chunk it handed over, and
the consumer raises the failure only once it reaches that marker, so no chunk handed
over before the failure is lost.
"""

from __future__ import annotations

import mmap
import queue
import sys
import threading
import traceback
from collections.abc import Sequence

from rlcollect.errors import ChannelClosed, CollectorError, WorkerError, WorkerFailure
from rlcollect.processes import release_mapping
from rlcollect.transports.base import (
    ServerEnd,
    Transport,
    WorkerEnd,
    WorkerProgram,
    failure_from_exception,
)
from rlcollect.transports.generations import Generations, tag, wrap
from rlcollect.transports.layout import RingLayout

__all__ = ["ThreadQueueTransport"]

_JOIN_TIMEOUT = 2.0

_Token = tuple[int, int] | None


class _Server(ServerEnd):
    def __init__(self, layout: RingLayout) -> None:
        # Anonymous mmap rather than np.zeros: page-aligned (zeroed) memory, so the
        # fields can be page-locked one by one for a GPU-side gather.
        self.storage = mmap.mmap(-1, layout.nbytes)
        self.buffers = layout.views(self.storage)
        self.requests: queue.SimpleQueue[_Token] = queue.SimpleQueue()
        self.chunks: queue.SimpleQueue[_Token] = queue.SimpleQueue()
        self.responses: list[queue.SimpleQueue[_Token]] = []
        self.credits: list[queue.SimpleQueue[_Token]] = []
        for _ in range(layout.num_workers):
            self.responses.append(queue.SimpleQueue())
            credits: queue.SimpleQueue[_Token] = queue.SimpleQueue()
            for slot in layout.first_credits(len(self.credits)):
                credits.put((slot, 0))
            self.credits.append(credits)
        self.failures: list[WorkerFailure] = []  # reached by the consumer: raised
        self.reported: dict[int, WorkerFailure] = {}  # reported, marker not yet reached
        self.generations = Generations(layout.num_workers)
        self.layout = layout
        self.aborted = False

    def wait_requests(self, timeout: float) -> list[tuple[int, int]]:
        return self.generations.split(_drain(self.requests, timeout))

    def respond(self, workers: Sequence[int]) -> None:
        for w in workers:
            self.responses[w].put((0, self.generations.answer(w)))

    def wait_chunks(self, timeout: float) -> list[tuple[int, int]]:
        self._check()
        try:
            items = _drain(self.chunks, timeout)
        except ChannelClosed:
            self.failures.extend(self.reported.values())
            self.reported.clear()
            self._check()
            raise
        out = []
        for w, s in items:
            if s < 0:  # the failure marker: every chunk of w before it is in `out`
                self.failures.append(self.reported.pop(w))
            else:
                out.append((w, s))
        if not out:
            self._check()
        return out

    def _check(self) -> None:
        if self.failures:
            raise WorkerError.from_failure(self.failures[0])

    def release(self, worker: int, slot: int) -> None:
        self.credits[worker].put((slot, 0))

    def abort(self) -> None:
        self.aborted = True
        for q in (self.requests, self.chunks, *self.responses, *self.credits):
            q.put(None)


def _drain(q: queue.SimpleQueue[_Token], timeout: float) -> list[tuple[int, int]]:
    """First item within ``timeout``, then every item already queued."""
    try:
        item = q.get(timeout=max(timeout, 0.0))
    except queue.Empty:
        return []
    out: list[tuple[int, int]] = []
    while True:
        if item is None:
            q.put(None)
            raise ChannelClosed("transport aborted")
        out.append(item)
        try:
            item = q.get_nowait()
        except queue.Empty:
            return out


class _Worker(WorkerEnd):
    def __init__(self, index: int, server: _Server, generation: int = 0) -> None:
        self.index = index
        self.buffers = server.layout.worker_buffers(server.buffers, index)
        self._server = server
        self._generation = wrap(generation)  # as the server echoes it
        self._tag = tag(index, generation)

    def request(self, position: int) -> None:
        self._server.requests.put((self._tag, position))

    def wait_response(self) -> None:
        # Skips answers to requests of a worker this one replaced (generations.py).
        while _take(self._server.responses[self.index])[1] != self._generation:
            pass

    def hand_over(self, slot: int) -> None:
        self._server.chunks.put((self.index, slot))

    def wait_slot(self) -> int:
        return _take(self._server.credits[self.index])[0]

    def report(self, failure: WorkerFailure) -> None:
        self._server.reported[self.index] = failure
        self._server.chunks.put((self.index, -1))  # after every chunk this worker handed over


def _take(q: queue.SimpleQueue[_Token]) -> tuple[int, int]:
    token = q.get()
    if token is None:
        q.put(None)
        raise ChannelClosed("transport closed")
    return token


def _run(program: WorkerProgram, end: _Worker) -> None:
    try:
        program(end)
    except ChannelClosed:
        return
    except BaseException as exc:
        end.report(failure_from_exception(end.index, exc))
        return
    if not end._server.aborted:
        end.report(failure_from_exception(end.index, RuntimeError("worker program returned early")))


class ThreadQueueTransport(Transport):
    """Workers are daemon threads of the driver process; the ring is plain memory.

    A thread cannot be killed: :meth:`close` wakes every worker and waits up to two
    seconds for each, so an env stuck inside a native call outlives the collector as
    an idle daemon thread. Use :class:`ProcessSlotTransport` where that matters.

    Pass ``transport="thread"`` to the collector, or an instance to keep a handle on it.

    Examples:
        >>> import functools
        >>> import gymnasium as gym
        >>> import torch
        >>> from rlcollect import AsyncBatchedCollector
        >>> from rlcollect.transports import ThreadQueueTransport
        >>> transport = ThreadQueueTransport()
        >>> with AsyncBatchedCollector(
        ...     [functools.partial(gym.make, "Pendulum-v1")] * 2,
        ...     torch.nn.Linear(3, 1),
        ...     frames_per_batch=16,
        ...     transport=transport,
        ...     envs_per_worker=1,  # a worker thread each
        ... ) as collector:
        ...     running = transport.alive
        ...     batch = next(collector)
        >>> running, transport.alive  # the worker threads end with the collector
        ([True, True], [False, False])
    """

    supports_restart = True
    names_slots = True
    pool_slots = sys.maxsize

    def __init__(self) -> None:
        self._server: _Server | None = None
        self._threads: list[threading.Thread] = []
        self._generations: list[int] = []
        self._closed = False

    @property
    def alive(self) -> list[bool]:
        """Whether each worker thread is still running."""
        return [t.is_alive() for t in self._threads]

    def start(self, layout: RingLayout, programs: Sequence[WorkerProgram]) -> ServerEnd:
        if self._server is not None or self._closed:
            raise CollectorError("a ThreadQueueTransport serves one collector; create a new one")
        if len(programs) != layout.num_workers:
            raise ValueError(f"{len(programs)} programs for {layout.num_workers} workers")
        self._server = _Server(layout)
        for i, program in enumerate(programs):
            self._threads.append(self._start_thread(program, _Worker(i, self._server)))
            self._generations.append(0)
        return self._server

    def _start_thread(self, program: WorkerProgram, end: _Worker) -> threading.Thread:
        thread = threading.Thread(
            target=_run, args=(program, end), name=f"rlcollect-worker-{end.index}", daemon=True
        )
        thread.start()
        return thread

    def worker_stack(self, worker: int) -> str | None:
        """The worker thread's stack, from the interpreter's frames of every thread."""
        if worker >= len(self._threads):
            return None
        frame = sys._current_frames().get(self._threads[worker].ident or -1)
        return None if frame is None else "".join(traceback.format_stack(frame))

    def restart_worker(self, worker: int, program: WorkerProgram) -> None:
        """Start a new thread for ``worker`` after its old one failed.

        Raises:
            CollectorError: the transport was not started or is closed, or the old thread
                has not ended within two seconds (an env stuck in a native call).
        """
        server = self._server
        if self._closed:
            raise CollectorError(
                f"cannot restart worker {worker}: the ThreadQueueTransport is closed"
            )
        if server is None:
            raise CollectorError(
                f"cannot restart worker {worker}: the ThreadQueueTransport was not started"
            )
        old = self._threads[worker]
        old.join(_JOIN_TIMEOUT)  # it reported its failure and is returning
        if old.is_alive():
            raise CollectorError(
                f"cannot restart worker {worker}: its thread is still running "
                f"{_JOIN_TIMEOUT} s after it failed (an env stuck in a native call?)"
            )
        # Only the consuming thread (this one) releases slots, so swapping the queue is safe.
        credits: queue.SimpleQueue[_Token] = queue.SimpleQueue()
        for slot in server.layout.first_credits(worker):
            credits.put((slot, 0))
        server.credits[worker] = credits
        if server.aborted:
            credits.put(None)
        server.failures = [f for f in server.failures if f.worker_index != worker]
        self._generations[worker] += 1
        end = _Worker(worker, server, self._generations[worker])
        self._threads[worker] = self._start_thread(program, end)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._server is not None:
            self._server.abort()
        current = threading.current_thread()
        for thread in self._threads:
            if thread is not current:
                thread.join(_JOIN_TIMEOUT)
        if self._server is not None:
            self._server.buffers = {}
            release_mapping(self._server.storage)
