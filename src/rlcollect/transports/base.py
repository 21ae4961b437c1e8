"""The transport contract: the smallest set of messages a worker and the driver exchange.

::

    worker                                    driver
    ──────                                    ──────
    writes the observations of request q
    request(q) ───────────────────────────▶  wait_requests() → [(worker, q), ...]
                                             (server writes the actions of q)
    wait_response() ◀──────────────────────  respond([worker, ...])
    ... chunk slot s full ...
    hand_over(s) ─────────────────────────▶  wait_chunks() → [(worker, s), ...]
                                             (driver copies slot s out)
    wait_slot() ◀──────────────────────────  release(worker, s)

Data never travels in these messages: it lives in the ring buffers that both ends see
(``buffers``, laid out by :class:`~rlcollect.transports.layout.RingLayout`); messages
carry indices only. What a request number ``q`` names in the ring is the layout's
business (``layout.request_rows``), not the transport's.

A worker holds at most ``layout.splits`` outstanding requests (one per split of its
columns: double buffering), and at most ``layout.slots`` chunks it has not had back; a transport
may rely on both bounds. Each ``wait_response`` consumes one response, and responses are
not labelled: a transport must deliver one worker's requests to ``wait_requests`` in
the order the worker made them, and wake it once per entry in ``respond`` (a worker
may appear more than once in one call). The inference server answers requests in the
order they arrive, so the ``n``-th response a worker waits for is the one to its
``n``-th request.

A :class:`Transport` allocates the ring, starts one worker per program and returns the
driver's :class:`ServerEnd`. Every wait on either end must end when the other side goes
away: worker waits raise :class:`~rlcollect.errors.ChannelClosed` once the driver
closes or dies, and :meth:`ServerEnd.wait_chunks` raises
:class:`~rlcollect.errors.WorkerError` once a worker has failed or died.

Optional capabilities are class attributes of :class:`Transport`, each documented
where it is defined: restarting a failed worker (``supports_restart``; the protocol is
in ``transports/generations.py``), workers in other processes (``pickles_programs``),
the request side served from another process (``supports_request_channel``), credits
that name their slot (``names_slots``) and pooled rings (``pool_slots``).
"""

from __future__ import annotations

import traceback
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, ClassVar

import numpy as np

from rlcollect.errors import CollectorError, EnvError, WorkerFailure
from rlcollect.transports.layout import Key, RingLayout

if TYPE_CHECKING:  # it imports this module
    from rlcollect.transports.first_worker import FirstWorker

__all__ = [
    "RequestEnd",
    "ServerEnd",
    "Transport",
    "WorkerEnd",
    "WorkerProgram",
    "failure_from_exception",
]


class WorkerEnd(ABC):
    """The worker's end of a transport.

    A worker program (:data:`WorkerProgram`) gets one: it writes into ``buffers``, rings
    the driver with :meth:`request` and :meth:`hand_over`, and blocks in
    :meth:`wait_response` and :meth:`wait_slot`, which raise
    :class:`~rlcollect.errors.ChannelClosed` once the driver has gone.

    Examples:
        A toy worker on the thread transport, and the driver answering it by hand (the
        collector's worker loop and inference server do this for real): the worker
        asks for an action for observation 0, 1, 2, ... and hands each full chunk over.

        >>> import itertools
        >>> import numpy as np
        >>> from rlcollect.errors import ChannelClosed
        >>> from rlcollect.transports import Field, RingLayout, ThreadQueueTransport
        >>> int64 = np.dtype(np.int64)
        >>> layout = RingLayout(
        ...     fields=(Field(("observation",), (), int64), Field(("action",), (), int64)),
        ...     num_workers=1,
        ...     columns=1,
        ...     chunk_steps=2,
        ...     slots=2,
        ... )
        >>> def program(end):
        ...     obs = end.buffers[("observation",)]  # [positions, columns]
        ...     try:
        ...         for step in itertools.count():
        ...             position = step % layout.positions
        ...             slot, t = divmod(position, layout.chunk_steps)
        ...             if t == 0:
        ...                 end.wait_slot()  # backpressure: a free slot to write
        ...             obs[position, 0] = step
        ...             end.request(position)  # one split: request number = position
        ...             end.wait_response()
        ...             if t == layout.chunk_steps - 1:
        ...                 end.hand_over(slot)
        ...     except ChannelClosed:  # the driver closed the transport
        ...         pass
        >>> transport = ThreadQueueTransport()
        >>> end = transport.start(layout, [program])
        >>> for _ in range(2):
        ...     [(worker, request)] = end.wait_requests(5.0)
        ...     observation = end.buffers[("observation",)][worker, request]
        ...     end.buffers[("action",)][worker, request] = 10 * observation
        ...     end.respond([worker])
        >>> end.wait_chunks(5.0)
        [(0, 0)]
        >>> end.buffers[("action",)][0, :2, 0]  # slot 0: the chunk's two steps
        array([ 0, 10])
        >>> end.release(0, 0)
        >>> transport.close()
    """

    #: Index of this worker, 0 … num_workers - 1.
    index: int
    #: What this worker writes (``RingLayout.worker_buffers``): its part of the ring,
    #: every array of ``RingLayout.views`` without its leading worker dimension
    #: (transition fields ``[positions, columns, ...]``); a pooled ring's transition
    #: fields whole (``[credited_slots * chunk_steps, columns, ...]``).
    buffers: Mapping[Key, np.ndarray]
    #: True where :meth:`request` itself writes the actions before it returns (the
    #: policy run by the worker: ``inference_backend="worker"``), so a worker loop may
    #: act on them at once; transports' ends leave it False.
    answers_in_request: ClassVar[bool] = False

    @abstractmethod
    def request(self, position: int) -> None:
        """Ask for actions: the observations of request ``position`` are written."""

    @abstractmethod
    def wait_response(self) -> None:
        """Block until the actions of the oldest unanswered request are written.

        Raises ChannelClosed.
        """

    @abstractmethod
    def hand_over(self, slot: int) -> None:
        """Give chunk ``slot`` (positions ``slot*chunk_steps …``) to the driver."""

    @abstractmethod
    def wait_slot(self) -> int | None:
        """Block until one more slot is free to write (the ring starts with all free).

        Returns the slot, where the transport names it (``Transport.names_slots``): the
        slots ``release`` gave back, in the order it gave them (at first
        ``RingLayout.first_credits``: every slot, from 0 up; a pooled ring's worker, its
        first two slots). Otherwise None: the worker then writes its slots in turn,
        which is right as long as the driver releases them in the order they were
        handed over.

        Raises ChannelClosed.
        """

    @abstractmethod
    def report(self, failure: WorkerFailure) -> None:
        """Tell the driver this worker failed; the worker exits right after."""


WorkerProgram = Callable[[WorkerEnd], None]
"""What a worker runs: given its end, it loops until the end raises ChannelClosed.

Process transports pickle it (with cloudpickle), so it must not hold torch objects. The
collector's programs run its worker loop; :func:`rlcollect.testing.counting_programs`
builds some for tests, and :class:`WorkerEnd` shows a toy one.
"""


class RequestEnd(ABC):
    """The request side of the driver's end: what an inference server uses.

    A :class:`ServerEnd` is one; a transport may also hand its request side to a server
    in another process, which opens a request end of its own (:class:`RequestChannel`).

    Examples:
        Answering the requests of CountingEnv workers with the action each env's own
        observation calls for (:func:`~rlcollect.testing.counting_actions`); the rows
        a request names come from :func:`~rlcollect.transports.layout.request_rows`:

        >>> import numpy as np
        >>> from rlcollect.testing import counting_actions, counting_layout, counting_programs
        >>> from rlcollect.transports import ThreadQueueTransport, request_rows
        >>> layout = counting_layout(num_workers=2, columns=2, chunk_steps=4, slots=2)
        >>> transport = ThreadQueueTransport()
        >>> end = transport.start(layout, counting_programs(layout))
        >>> obs = layout.request_sources(end.buffers, ("observation",))  # [rows, 4]
        >>> action = layout.request_sources(end.buffers, ("action",))  # [rows]
        >>> served = 0
        >>> while served < 6:
        ...     requests = end.wait_requests(5.0)  # [(worker, request number), ...]
        ...     workers = np.array([worker for worker, _ in requests], dtype=np.intp)
        ...     numbers = np.array([number for _, number in requests], dtype=np.intp)
        ...     rows = request_rows(layout, end.buffers, workers, numbers)
        ...     action[rows] = counting_actions(obs[rows])
        ...     end.respond(workers.tolist())
        ...     served += len(requests)
        >>> end.abort()  # every wait on both ends now ends
        >>> transport.close()
    """

    #: The whole ring: every array of ``RingLayout.views`` (transition fields
    #: ``[num_workers, positions, columns, ...]``).
    buffers: Mapping[Key, np.ndarray]

    @abstractmethod
    def wait_requests(self, timeout: float) -> list[tuple[int, int]]:
        """Requests ``(worker, request)`` that arrived, waiting up to ``timeout`` s for one.

        One worker's requests come in the order it made them.

        Returns an empty list on timeout. Raises ChannelClosed once aborted.
        """

    @abstractmethod
    def respond(self, workers: Sequence[int]) -> None:
        """Answer one request of each entry of ``workers`` (a worker listed twice gets two
        responses): the actions are written."""

    @abstractmethod
    def abort(self) -> None:
        """Stop the exchange: every wait on both ends ends promptly. Idempotent, any thread."""


class RequestChannel(ABC):
    """A started transport's request side, described for a server in another process.

    :meth:`Transport.request_channel` hands one out; the collector's
    ``inference_backend="process"`` (:class:`~rlcollect.inference.process.ProcessInference`)
    sends it, cloudpickled, to its inference process, which inherits the descriptors of
    :attr:`pass_fds` under the same numbers and calls :meth:`open` there. Once a channel
    is handed out, the driver's :class:`ServerEnd` no longer serves requests (it still
    takes chunks). :class:`~rlcollect.transports.process_slots.ProcessSlotTransport`'s
    channel is one.
    """

    @property
    @abstractmethod
    def pass_fds(self) -> tuple[int, ...]:
        """Descriptors the serving process must inherit, under the same numbers."""

    @abstractmethod
    def open(self) -> RequestEnd:
        """The request end, in the serving process.

        Raises:
            FileNotFoundError: the driver has already closed the transport.
        """


class ServerEnd(RequestEnd):
    """The driver's end of a transport: the inference server and the chunk consumer.

    The inference thread calls ``wait_requests``/``respond``; the consuming thread calls
    ``wait_chunks``/``release``. The two pairs must be safe to use from two threads.

    Examples:
        The consuming side: take full chunks, copy them out, give their slots back.
        A worker whose env raises is reported here:

        >>> import threading
        >>> from rlcollect.errors import WorkerError
        >>> from rlcollect.testing import counting_layout, counting_programs
        >>> from rlcollect.transports import ThreadQueueTransport
        >>> layout = counting_layout(num_workers=1, columns=1, chunk_steps=2, slots=2)
        >>> transport = ThreadQueueTransport()
        >>> end = transport.start(layout, counting_programs(layout, fail={0: (1, 1)}))
        >>> def serve():  # every action 0, until the transport closes
        ...     try:
        ...         while True:
        ...             requests = end.wait_requests(1.0)
        ...             end.respond([worker for worker, _ in requests])
        ...     except Exception:
        ...         pass
        >>> threading.Thread(target=serve, daemon=True).start()
        >>> rewards = []
        >>> try:
        ...     while True:
        ...         for worker, slot in end.wait_chunks(5.0):
        ...             first = slot * layout.chunk_steps
        ...             steps = slice(first, first + layout.chunk_steps)
        ...             rewards.append(end.buffers[("next", "reward")][worker, steps].copy())
        ...             end.release(worker, slot)
        ... except WorkerError as error:
        ...     print(error.env_index, error.worker_index, error.__cause__ is not None)
        0 0 True
        >>> transport.close()
    """

    @abstractmethod
    def wait_chunks(self, timeout: float) -> list[tuple[int, int]]:
        """Chunks ``(worker, slot)`` handed over, waiting up to ``timeout`` s for one.

        Returns an empty list on timeout. Raises WorkerError when a worker failed or
        died (on every call, until :meth:`Transport.restart_worker` replaces it), and
        ChannelClosed once aborted. A transport that supports restarts returns every
        chunk a worker handed over before it raises that worker's failure.
        """

    @abstractmethod
    def release(self, worker: int, slot: int) -> None:
        """Give ``slot`` back to ``worker``: the driver has copied it out. (Pooled,
        ``slot`` is any slot of the ring, whichever worker wrote it last.)"""


class Transport(ABC):
    """Allocates the ring, runs the workers, and carries their messages.

    Subclass it to move the doorbells or the workers somewhere else; run
    :func:`rlcollect.testing.check_transport` against the subclass to prove it keeps
    this contract. A transport instance serves one collector: ``start`` once, then
    ``close``. A worked example of a transport of one's own: ``docs/custom-transport.md``
    and ``examples/custom_transport.py``.

    Examples:
        A subclass of a built-in transport that reports its start, passed to a
        collector as an instance:

        >>> import functools
        >>> import gymnasium as gym
        >>> import torch
        >>> from rlcollect import AsyncBatchedCollector
        >>> from rlcollect.transports import ThreadQueueTransport
        >>> class Announcing(ThreadQueueTransport):
        ...     def start(self, layout, programs):
        ...         print(f"{len(programs)} workers, {layout.columns} envs each")
        ...         return super().start(layout, programs)
        >>> with AsyncBatchedCollector(
        ...     [functools.partial(gym.make, "Pendulum-v1")] * 4,
        ...     torch.nn.Linear(3, 1),
        ...     frames_per_batch=16,
        ...     total_frames=16,
        ...     transport=Announcing(),
        ...     envs_per_worker=2,
        ... ) as collector:
        ...     frames = sum(batch.numel() for batch in collector)
        2 workers, 2 envs each
        >>> frames
        16
    """

    @abstractmethod
    def start(self, layout: RingLayout, programs: Sequence[WorkerProgram]) -> ServerEnd:
        """Allocate the ring for ``layout``, start worker ``i`` running ``programs[i]``.

        Args:
            layout: the ring's shape; ``layout.num_workers == len(programs)``.
            programs: what each worker runs, given its :class:`WorkerEnd`.

        Returns:
            The driver's end.

        Raises:
            CollectorError: the transport was started before (one collector each).
            ValueError: ``len(programs)`` is not ``layout.num_workers``.
        """

    @abstractmethod
    def close(self) -> None:
        """Stop every worker and free every resource. Idempotent; never hangs."""

    #: Whether :meth:`restart_worker` is implemented (``max_worker_restarts`` needs it).
    supports_restart: ClassVar[bool] = False
    #: Whether workers run in other processes, so programs (env factories included)
    #: travel pickled: the collector then checks every env factory with cloudpickle first.
    #: Where false the workers are threads of the collector's process, and
    #: ``transition_chunk_size="auto"`` gives them a batch's steps a chunk (up to 8 MiB):
    #: each message passes the interpreter lock between threads.
    pickles_programs: ClassVar[bool] = False
    #: Whether :meth:`request_channel` is implemented (``inference_backend="process"``
    #: needs it).
    supports_request_channel: ClassVar[bool] = False
    #: Whether :meth:`WorkerEnd.wait_slot` returns the slot given back: the collector
    #: then hands some batches out as views of their ring slot, which come back in the
    #: order the caller lets go of them (``collector/batches/loans.py``).
    names_slots: ClassVar[bool] = False
    #: The most slots of a pooled ring (``transports/slots.py``) the transport serves: it
    #: gives each worker ``RingLayout.worker_buffers`` and ``RingLayout.first_credits``,
    #: and its credits name any of ``RingLayout.credited_slots`` (with ``names_slots``).
    #: 0: no pooled rings; the collector then never asks for one, nor for one of more
    #: slots than this (``num_workers`` times ``POOL_BLOCKS``: ``collector/batches/loans.py``).
    pool_slots: ClassVar[int] = 0
    #: Whether :meth:`adopt_first_worker` is implemented: the collector then builds a
    #: vector env 0 in worker 0's process, started before the plan, not in the driver.
    adopts_first_worker: ClassVar[bool] = False

    def adopt_first_worker(self, first: FirstWorker) -> None:
        """Take ``first`` (worker 0's process, started before the plan: it built env 0,
        ``transports/first_worker.py``) as worker 0 at :meth:`start`, instead of starting
        one; :meth:`close` ends it if :meth:`start` never ran. Called before
        :meth:`start`, only where :attr:`adopts_first_worker` is set.

        Raises:
            CollectorError: the transport adopts no worker (by default), or has started.
        """
        raise CollectorError(f"{type(self).__name__} adopts no worker (adopts_first_worker)")

    def segments(self) -> tuple[str, ...]:
        """Names of the shared-memory segments (``/dev/shm``) this transport created and
        :meth:`close` unlinks, for whoever must unlink them should its process be killed
        first (a Ray actor's: ``distributed/fleet.py``). None by default."""
        return ()

    def restart_worker(self, worker: int, program: WorkerProgram) -> None:
        """Replace failed worker ``worker`` by a new one running ``program``.

        Called from the consuming thread once :meth:`ServerEnd.wait_chunks` has raised
        the worker's failure (so every chunk it handed over has been returned). The
        transport makes sure the old worker has stopped (killing it if need be), gives
        every slot of the worker back to the new one (chunks the old one did not hand
        over are dropped, and the driver releases none of its slots afterwards), stops
        raising the old failure, and keeps the new worker from taking responses meant
        for the old one's requests. Transports that implement it set
        :attr:`supports_restart`.

        By default a transport cannot restart workers: the collector then refuses
        ``max_worker_restarts`` at construction, so this is never reached from it.

        Raises:
            CollectorError: the transport cannot restart workers (``supports_restart``
                is False), or is not running.
        """
        raise CollectorError(
            f"{type(self).__name__} cannot restart workers (its supports_restart is False): "
            f"worker {worker} stays failed; use max_worker_restarts=0 with this transport"
        )

    def worker_stack(self, worker: int) -> str | None:
        """The Python stack of ``worker`` now, for the error of a stalled worker
        (``stall_timeout``), or None where it cannot be had (a stopped process; by
        default). Called from the consuming thread; returns within about a second."""
        return None

    def worker_pid(self, worker: int) -> int | None:
        """The id of the process that runs ``worker`` now, for the stall watch
        (``stall_timeout``): a process stopped (SIGSTOP, a debugger) before it wrote
        anything is found from it. None where a worker is no process of its own
        (threads; by default): the watch then reads the pid the worker wrote itself."""
        return None

    def stop_worker(self, worker: int) -> bool:
        """Stop stalled worker ``worker`` at once, so that its end reaches
        :meth:`ServerEnd.wait_chunks` as any worker's death does (after every chunk it
        handed over), and the collector restarts it (``max_worker_restarts``) or raises
        the stall. Returns False where a worker cannot be stopped (by default; threads):
        the collector then raises the stall at once and leaves the worker behind."""
        return False

    def request_channel(self) -> RequestChannel:
        """Hand the request side to a server in another process (see
        :class:`RequestChannel`); the driver's end stops serving requests. Transports
        that implement it set :attr:`supports_request_channel`.

        Raises:
            CollectorError: the transport cannot (``supports_request_channel`` is False),
                or is not running.
        """
        raise CollectorError(
            f"{type(self).__name__} cannot hand its request side to another process (its "
            "supports_request_channel is False); use inference_backend='thread' with this "
            "transport"
        )


def failure_from_exception(worker_index: int, exc: BaseException) -> WorkerFailure:
    """Describe ``exc`` as a :class:`~rlcollect.errors.WorkerFailure` (strings only, safe
    to send anywhere).

    A transport's worker calls it on the exception that ended the worker program and
    passes the result to :meth:`WorkerEnd.report` (as ``examples/custom_transport.py``
    does). An :class:`~rlcollect.errors.EnvError` is unwrapped: the failure names its
    env and describes the env's own exception, followed by what the worker was doing
    with the env (which names the sub-envs of a vector env).

    Args:
        worker_index: the worker that caught ``exc``.
        exc: the exception that ends the worker.

    Returns:
        The failure, for :meth:`WorkerEnd.report`.

    Examples:
        A worker's way out, in a transport of one's own (``end`` is its
        :class:`WorkerEnd`)::

            try:
                program(end)
            except ChannelClosed:
                return  # the driver closed the transport: the normal way out
            except BaseException as exc:
                end.report(failure_from_exception(end.index, exc))

        What the driver then learns:

        >>> from rlcollect.transports import failure_from_exception
        >>> try:
        ...     raise OSError("no display")
        ... except OSError as exc:
        ...     failure = failure_from_exception(3, exc)
        >>> failure.worker_index, failure.env_index, failure.exc_type, failure.message
        (3, -1, 'OSError', 'no display')
        >>> failure.traceback.splitlines()[0]
        'Traceback (most recent call last):'
    """
    env_index = -1
    during = ""
    if isinstance(exc, EnvError) and exc.__cause__ is not None:
        env_index = exc.env_index
        during = f" (during {exc.during})"
        exc = exc.__cause__
    # The report must not fail on the exception it reports: without it the driver sees
    # a worker that stopped answering (a thread) or exited with status 1 (a process).
    return WorkerFailure(
        worker_index=worker_index,
        env_index=env_index,
        exc_type=type(exc).__qualname__,
        message=f"{text_of(exc)}{during}",
        traceback=traceback_of(exc),
    )


def traceback_of(exc: BaseException) -> str:
    """``exc``'s formatted traceback, for a report; never raises (see :func:`text_of`)."""
    try:
        return "".join(traceback.format_exception(exc))
    except Exception as error:
        what = type(exc).__qualname__
        return f"(the traceback of a {what} could not be formatted: {text_of(error)})\n"


def text_of(value: object, *, quoted: bool = False) -> str:
    """``str(value)`` (``repr(value)`` where ``quoted``), or, where that raises, what
    can be said without it: an error report must never fail on the object it reports
    (an exception or a value whose ``__str__`` or ``__repr__`` is broken)."""
    try:
        return repr(value) if quoted else str(value)
    except Exception as error:
        how = "repr" if quoted else "str"
        try:
            why = f"{type(error).__qualname__}: {error}"
        except Exception:
            why = type(error).__qualname__
        return f"<unprintable {type(value).__qualname__}: {how}() raised {why}>"
