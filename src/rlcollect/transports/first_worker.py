"""Worker 0's process, started before the plan: env 0 built once, where it will run.

The plan learns what every factory builds from env 0 (``collector/probe.py``). Where
``env_fns[0]`` says it builds a vector env (``worker/source.py``: ``declares_vector``),
whose construction may take seconds, and worker 0 will be a process of the
:class:`~rlcollect.transports.ProcessSlotTransport`, the plan does not build env 0 in
the driver: it starts worker 0's process first, with ``env_fns[0]`` alone, and that
process builds env 0, tells the plan what the probe needs, keeps the env
(``worker/built.py``) and waits for its worker's program. The plan is made from its
report; the transport then adopts the process as worker 0 (``adopt_first_worker``)
instead of starting another one. Env 0 is built once, not in the driver and again in
its worker.

The protocol, on one Unix socket pair (the driver's end here, the child's inherited):

* The driver starts the child with :func:`rlcollect.processes.spawn` (its own process
  group, SIGINT ignored, a lifeline: the driver's death ends it, even inside the
  factory), ``env_fns[0]``, the ``info_keys`` and the step-timing budget as its payload.
* The child writes one byte (``_BUILDING``) as it calls the factory: from then on the
  driver waits at most ``stall_timeout`` for its report, as for an env built in the
  driver; before it, the interpreter's start and imports, at most ``_START_WAIT``.
* The report: an 8-byte length and a pickle of ``("ok", ProbedEnv)`` or of a failure
  (what failed, the exception's type name, message and traceback, the exception
  pickled where it pickles), raised in the driver as the same error the probe raises
  for an env built there. The env is kept unless the probe stepped it (``info_keys``,
  a plain env's timing): then it is closed, and worker 0 builds its own.
* Adoption: the driver writes a handed-off file holding the worker's header and
  program, as :func:`~rlcollect.processes.spawn` does, and sends its descriptor with
  the ring's pipe ends the header names (``SCM_RIGHTS``) in one message; the child
  puts the descriptors it received in place of the driver's numbers and runs as every
  worker does (``process_worker.run_worker_process``). End-of-file instead (the plan
  failed, or the layout chosen has no worker processes): the child exits, and the
  driver kills its group in any case (:meth:`FirstWorker.close`).
* A child that dies is end-of-file on the socket: a :class:`~rlcollect.errors.WorkerError`
  with its exit status, whether before its report or after (then its reports pipe
  closes, as any worker's).
"""

from __future__ import annotations

import dataclasses
import pickle
import select
import socket
import struct
import subprocess
import sys
import tempfile
import time
import traceback
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

import cloudpickle

from rlcollect.errors import RemoteTraceback, WorkerError, WorkerFailure
from rlcollect.lifeline import Lifeline, exit_child, watch_driver
from rlcollect.processes import (
    batch_scheduling,
    child_env,
    describe_exit,
    kill,
    read_handoff,
    spawn,
    wait_exit,
)
from rlcollect.transports.process_worker import WorkerHeader, run_worker_process
from rlcollect.worker.built import keep
from rlcollect.worker.env_probe import ProbedEnv, build_stalled, factory_failed, probe_built

__all__ = ["FirstWorker", "first_main"]

_CHILD = "from rlcollect.transports.first_worker import first_main; first_main()"
_START_WAIT = 120.0  # seconds the child may take to start calling the factory
_BUILDING = b"B"
_LENGTH = struct.Struct("<Q")
# The header's descriptors, in the order they are sent (the handed-off file first).
_FDS = ("requests_w", "chunks_w", "responses_r", "credits_r", "reports_w", "stack_fd")


@dataclass(frozen=True)
class _FirstHeader:
    socket_fd: int


class FirstWorker:
    """Worker 0's process, building env 0 (module docstring); started on construction.

    The driver reads its :meth:`report`, then either a transport adopts it
    (:meth:`hand_over` gives it worker 0's program) or :meth:`close` ends it. Its
    :attr:`lifeline` becomes the adopting transport's. Ended too when
    garbage-collected, or at interpreter exit, unadopted."""

    def __init__(self, env_fn: Any, info_keys: tuple[str, ...], time_steps: float) -> None:
        payload = cloudpickle.dumps((env_fn, tuple(info_keys), time_steps))
        self.lifeline = Lifeline()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self.proc = spawn(
                _CHILD,
                _FirstHeader(theirs.fileno()),
                payload,
                pass_fds=(theirs.fileno(),),
                env=child_env(single_threaded=True),
                lifeline=self.lifeline,
            )
        except BaseException:
            ours.close()
            self.lifeline.close()
            raise
        finally:
            theirs.close()
        self._socket = ours
        self._finalizer = weakref.finalize(self, _end, self.proc, ours, self.lifeline)

    def report(self, stall_timeout: float | None) -> ProbedEnv:
        """What building env 0 told, once the child reports it.

        Raises:
            ValueError, TypeError: as the probe of an env built in the driver raises them
                (a factory that raised; an env that is not one; a bad ``info_keys``).
            WorkerError: the child died, did not start building within ``_START_WAIT``,
                or its factory has not returned within ``stall_timeout``.
        """
        started = self._read(1, time.monotonic() + _START_WAIT)
        if started is None:
            raise WorkerError(
                f"worker 0's process has not started building env 0 (env_fns[0]) in "
                f"{_START_WAIT:g} s",
                worker_index=0,
                env_index=0,
            )
        if started != _BUILDING:
            raise self._died()
        deadline = None if stall_timeout is None else time.monotonic() + stall_timeout
        head = self._read(_LENGTH.size, deadline)
        if head is None:
            assert stall_timeout is not None
            raise build_stalled(stall_timeout)
        if len(head) < _LENGTH.size:
            raise self._died()
        size = _LENGTH.unpack(head)[0]
        body = self._read(size, time.monotonic() + _START_WAIT)  # written whole, at once
        if body is None or len(body) < size:
            raise self._died()
        kind, *rest = pickle.loads(body)
        if kind == "ok":
            probed: ProbedEnv = rest[0]
            return probed
        raise _failure(kind, *rest)

    def hand_over(self, header: WorkerHeader, payload: bytes) -> subprocess.Popen[bytes]:
        """Make the child worker ``header.index`` running the pickled program ``payload``
        (module docstring); returns its process, from now on the caller's to stop."""
        fds = [getattr(header, name) for name in _FDS if getattr(header, name) >= 0]
        with tempfile.TemporaryFile() as handed:
            handed.write(cloudpickle.dumps(header))
            handed.write(payload)
            handed.flush()
            handed.seek(0)  # the child shares the open file, offset included
            try:
                socket.send_fds(self._socket, [b"W"], [handed.fileno(), *fds])
            except OSError:
                pass  # it died: its reports pipe, which it never got, reads end-of-file
        self._finalizer.detach()
        self._socket.close()
        return self.proc

    def close(self) -> None:
        """End the child and its group, unless a transport adopted it. Idempotent."""
        self._finalizer()

    def _read(self, size: int, deadline: float | None) -> bytes | None:
        """``size`` bytes from the child, fewer at end-of-file, None past ``deadline``."""
        data = b""
        while len(data) < size:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not select.select([self._socket], [], [], left)[0]:
                return None
            chunk = self._socket.recv(size - len(data))
            if not chunk:
                break
            data += chunk
        return data

    def _died(self) -> WorkerError:
        code = wait_exit(self.proc, 2.0)
        return WorkerError(
            "worker 0's process died while it built env 0 (env_fns[0]) for the probe: "
            + describe_exit(code, "socket"),
            worker_index=0,
            env_index=0,
        )


def _end(proc: subprocess.Popen[bytes], sock: socket.socket, lifeline: Lifeline) -> None:
    lifeline.orderly()
    kill(proc)  # nothing of it needs an orderly end: no segment is its yet
    try:
        proc.wait(2.0)
    except subprocess.TimeoutExpired:
        pass  # unkillable (stuck in the kernel); nothing more can be done
    sock.close()
    lifeline.close()


def _failure(kind: str, exc_type: str, message: str, tb: str, pickled: bytes | None) -> Exception:
    """The error the driver raises for the child's failure report."""
    if kind == "load":  # the payload did not unpickle there: as a worker reports it
        failure = WorkerFailure(
            worker_index=0, env_index=-1, exc_type=exc_type, message=message, traceback=tb
        )
        return WorkerError.from_failure(failure)
    exc: Exception | None = None
    if pickled is not None:
        try:
            exc = pickle.loads(pickled)
        except Exception:
            exc = None
    if not isinstance(exc, Exception):
        exc = RuntimeError(f"{exc_type}: {message}")
    exc.__cause__ = RemoteTraceback(tb)
    if kind == "factory":
        error = factory_failed(exc)
        error.__cause__ = exc
        return error
    return exc  # the probe's own ValueError or TypeError


# ------------------------------------------------------------------ the child's side


def first_main() -> None:
    """Entry point of worker 0's process started before the plan (``_CHILD``); imports no
    torch until its program does."""
    batch_scheduling()
    first: _FirstHeader
    first, payload = read_handoff()
    sock = socket.socket(fileno=first.socket_fd)
    watch_driver(lambda: None)  # no segment is its yet: the driver's death just ends it
    try:
        env_fn, info_keys, time_steps = pickle.loads(payload)
    except BaseException as exc:
        _report_failure(sock, "load", exc)
    sock.sendall(_BUILDING)
    try:
        env = env_fn()
    except BaseException as exc:
        _report_failure(sock, "factory", exc)
    try:
        probed = probe_built(env, info_keys, time_steps)
    except BaseException as exc:
        _close(env)
        _report_failure(sock, "probe", exc)
    if probed.stepped:
        _close(env)  # not as its factory built it: worker 0 builds its own
    else:
        keep(env)
    _send(sock, ("ok", probed))
    message, fds, _, _ = socket.recv_fds(sock, 1, len(_FDS) + 1)
    sock.close()
    if not message or not fds:  # given up: the plan failed, or chose no processes
        _close(env)
        _exit(0)
    header, program = read_handoff(fds[0])
    received = dict(zip(_FDS, fds[1:], strict=False))
    header = dataclasses.replace(header, **{"stack_fd": -1, **received})
    run_worker_process(header, program, watching=True)


def _report_failure(sock: socket.socket, kind: str, exc: BaseException) -> NoReturn:
    try:
        pickled: bytes | None = cloudpickle.dumps(exc)
    except Exception:
        pickled = None
    tb = "".join(traceback.format_exception(exc))
    _send(sock, (kind, type(exc).__name__, str(exc), tb, pickled))
    _exit(1)


def _send(sock: socket.socket, message: Sequence[Any]) -> None:
    data = cloudpickle.dumps(tuple(message))
    try:
        sock.sendall(_LENGTH.pack(len(data)) + data)
    except OSError:
        _exit(1)  # the driver gave this process up


def _close(env: Any) -> None:
    close = getattr(env, "close", None)
    if callable(close):
        try:
            close()
        except Exception:
            pass  # closing is best effort


def _exit(code: int) -> NoReturn:
    """Exit without the interpreter's teardown (as a worker does), output flushed."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (AttributeError, OSError, ValueError):
            pass  # no stream, or a closed one: nothing to flush
    exit_child(code)
