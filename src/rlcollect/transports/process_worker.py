"""The worker's side of :class:`~rlcollect.transports.process_slots.ProcessSlotTransport`.

What runs in a worker process: :func:`worker_main` reads the :class:`WorkerHeader` and
program the driver handed off (``processes.spawn``), maps the ring and runs the program
on a ``_ProcessWorker`` end, whose messages are the pipe writes and reads of the ring
protocol. The protocol (who writes what, in what order, why it is safe) is in
``process_slots.py``'s module docstring; the driver's ends are in ``process_server.py``.
Not API: the transport's own parts.
"""

from __future__ import annotations

import atexit
import faulthandler
import mmap
import os
import pickle
import signal
import struct
import sys
from dataclasses import dataclass
from typing import NoReturn

from rlcollect.errors import ChannelClosed, WorkerFailure
from rlcollect.lifeline import at_driver_death, exit_child, watch_driver
from rlcollect.processes import (
    attach_segment,
    batch_scheduling,
    map_every_page,
    read_handoff,
    unlink_segment,
)
from rlcollect.transports.base import WorkerEnd, WorkerProgram, failure_from_exception
from rlcollect.transports.generations import response_token, tag
from rlcollect.transports.layout import RingLayout
from rlcollect.transports.process_server import CREDIT

__all__ = ["WorkerHeader", "run_worker_process", "worker_main"]

_MESSAGE = struct.Struct("<ii")  # (worker, position or slot), little-endian int32 pair


@dataclass(frozen=True)
class WorkerHeader:
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
    stack_fd: int = -1  # where SIGUSR1 makes the worker write its stack (worker_stack)


class _ProcessWorker(WorkerEnd):
    """The worker's end: doorbells on the pipes its header names, the ring mapped."""

    def __init__(self, header: WorkerHeader, ring: mmap.mmap) -> None:
        self.index = header.index
        self.buffers = header.layout.worker_buffers(header.layout.views(ring), header.index)
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

    def wait_slot(self) -> int:
        return _read_credit(self._h.credits_r)  # the slot given back

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


def _read_credit(fd: int) -> int:
    data = _read_token(fd, CREDIT.size)
    while len(data) < CREDIT.size:  # never taken: credits are written whole (CREDIT)
        data += _read_token(fd, CREDIT.size - len(data))
    return int(CREDIT.unpack(data)[0])


def _read_token(fd: int, size: int = 1) -> bytes:
    try:
        token = os.read(fd, size)
    except OSError as exc:
        raise ChannelClosed("the driver closed the transport") from exc
    if not token:
        raise ChannelClosed("the driver closed the transport")
    return token


def worker_main() -> None:
    """Entry point of a worker process (``process_slots._CHILD`` runs it); imports no torch.
    It ignores SIGINT from its first line on (``processes.spawn``): the driver decides
    how workers stop."""
    batch_scheduling()
    header: WorkerHeader
    header, payload = read_handoff()
    run_worker_process(header, payload)


def run_worker_process(header: WorkerHeader, payload: bytes, *, watching: bool = False) -> None:
    """Map the ring and run the pickled program ``payload`` as worker ``header.index``,
    until the driver stops it or the program fails (reported, exit 1). ``watching``: the
    lifeline's thread runs already (worker 0 started before the plan:
    ``first_worker.py``); the ring's segment is added to what it unlinks."""
    if header.stack_fd >= 0:
        # Written from the signal handler in C: works while the worker is stuck in a
        # native call too. The driver asks with SIGUSR1 when the worker stalled.
        faulthandler.register(signal.SIGUSR1, file=header.stack_fd, all_threads=True)
    try:
        ring = attach_segment(header.shm_name, header.layout.nbytes)
    except FileNotFoundError:
        return  # the driver closed (and unlinked) before this worker got going
    if header.layout.worker_spans_ring:
        map_every_page(ring)  # it will write slots all over the ring (processes.py)
    end = _ProcessWorker(header, ring)
    try:
        program: WorkerProgram = pickle.loads(payload)
        # From here on the driver's death ends this worker and its group, even inside a
        # long env call. Not before: a worker still importing reaches its pipes, and
        # ends in order, unlinking what its program names too (lifeline.py).
        (at_driver_death if watching else watch_driver)(lambda: unlink_segment(header.shm_name))
        program(end)
    except ChannelClosed:
        unlink_segment(header.shm_name)  # the driver may have died without unlinking
        _exit_now()
    except BaseException as exc:
        end.report(failure_from_exception(header.index, exc))
        sys.exit(1)
    end.report(failure_from_exception(header.index, RuntimeError("worker program returned")))
    sys.exit(1)


def _exit_now() -> NoReturn:
    """The end of a worker the driver stopped: exit handlers run and output is flushed,
    then the process exits without the interpreter's teardown, which is slow with torch
    imported (the ``"worker"`` inference backend), while the driver's ``close`` waits
    for every worker to exit. The worker loop has closed the envs already. Where the
    driver died instead, whatever the worker started ends with it (``exit_child``)."""
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (AttributeError, OSError, ValueError):
            pass  # no stream, or a closed one: nothing to flush
    exit_child(0)
