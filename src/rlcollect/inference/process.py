"""The ``"process"`` inference backend: the server in a process of its own.

::

    driver process                                  inference process (torch)
    ┌──────────────────────────────┐               ┌──────────────────────────────────┐
    │ collector (consumes chunks)  │               │ InferenceServer thread:           │
    │                              │               │  requests pipe ◀── workers        │
    │ update_weights(state):       │  weights shm  │  responses ──▶ workers            │
    │  copy into slot v % 2 ───────┼──────────────▶│ control thread:                   │
    │  ("weights", v) ─────────────┼── control ───▶│  copy slot into the policy        │
    │                              │               │  between batches, version = v     │
    │ status thread ◀──────────────┼── status ─────┤  ("applied", v) / errors / stats  │
    └──────────────────────────────┘               └──────────────────────────────────┘

Workers talk to the inference process directly (it serves the transport's request side,
handed over as a :class:`~rlcollect.transports.base.RequestChannel`), so the learner's
threads in the driver never hold up a batch by holding the GIL. The process is started,
handed its header and policy, and stopped with :mod:`rlcollect.processes`, which also
says how the weights segment is created and unlinked.

The weights protocol (who writes what, in what order, why it is safe):

* The weights segment has two slots, each holding every tensor of the policy's
  ``state_dict`` at a fixed offset. Only the driver writes slots; only the inference
  process reads them. Both unlink it when they are done.
* Update ``v`` (1, 2, ...) goes into slot ``v % 2``. That slot last held version
  ``v - 2``, so the driver first waits for the ``("applied", v - 2)`` message: after it,
  the inference process never reads that slot again. Then it copies the tensors in and
  sends ``("weights", v)`` on the control pipe. A pipe write/read pair orders memory like
  a lock release/acquire, so the inference process sees the whole slot.
* The inference process applies versions in order: it copies slot ``v % 2`` into the
  served policy under the server's weights lock (between two batches, never during
  one), sets the server's version to ``v``, so every transition whose action these
  weights choose carries ``v``, and answers ``("applied", v)``.

An update thus costs the driver one host copy and one message, waits only when two
updates are still in flight, and is atomic: a batch runs entirely on one version.

Failures never hang: the driver reads the status pipe in a thread, so an error (sent
with its traceback) or the process's death (end-of-file) is known at once and surfaces
through :attr:`ProcessInference.error`. The inference process exits when the control
pipe reaches end-of-file, which is also what happens when the driver dies.
"""

from __future__ import annotations

import mmap
import os
import select
import subprocess
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import torch

from rlcollect.errors import InferenceError, RemoteTraceback
from rlcollect.inference.base import InferenceBackend
from rlcollect.inference.build import build_server
from rlcollect.inference.checks import check_weights
from rlcollect.inference.config import InferenceConfig, WeightsLayout
from rlcollect.lifeline import Lifeline, exit_child, watch_driver
from rlcollect.processes import (
    attach_segment,
    child_env,
    create_segment,
    describe_exit,
    kill,
    process_stopped,
    read_handoff,
    reap,
    spawn,
    stop_processes,
    unlink_segment,
    wait_exit,
)
from rlcollect.transports.base import RequestChannel, text_of, traceback_of

__all__ = ["ProcessInference"]

_CHILD = "from rlcollect.inference.process import _inference_main; _inference_main()"
_STOP_WAIT = 5.0  # seconds for the inference process to exit once told
_REPLY_WAIT = 10.0  # seconds for an answer to stats / pause
_WEIGHTS_WAIT = 60.0  # seconds an update may wait for the slot it reuses


@dataclass(frozen=True)
class _Header:
    channel: RequestChannel
    config: InferenceConfig
    weights_shm: str
    control_fd: int
    status_fd: int
    policy_is_factory: bool


class ProcessInference(InferenceBackend):
    """Runs the inference server in a dedicated process (``inference_backend="process"``).

    Args:
        channel: the request side of a started transport (its ``request_channel()``).
        config: how to build the server there.
        policy: a cloudpickle-able policy (``policy_is_factory=False``) or a
            zero-argument callable that builds it there.
        policy_is_factory: which of the two ``policy`` is.

    Raises:
        ValueError: the policy failed to load, compile, capture or warm up in the
            inference process (its traceback is the ``__cause__``).
        InferenceError: the inference process died while starting.
    """

    def __init__(
        self,
        channel: RequestChannel,
        config: InferenceConfig,
        policy: Any,
        *,
        policy_is_factory: bool,
    ) -> None:
        import cloudpickle

        self._config = config
        self._payload = cloudpickle.dumps(policy)
        self._channel = channel
        self._is_factory = policy_is_factory
        self._version = 0
        self._applied = 0
        self._cond = threading.Condition()
        self._replies: dict[str, Any] = {}
        self._error: InferenceError | None = None
        self._last_stats: dict[str, Any] = {}
        self._proc: subprocess.Popen[bytes] | None = None
        self._reader: threading.Thread | None = None
        self._control: Connection | None = None
        self._stopped = False
        self._send_lock = threading.Lock()
        self._next_look = 0.0
        self._stopped_since: float | None = None  # when the process was first seen stopped
        self._lifeline: Lifeline | None = None  # its end, once started (lifeline.py)
        self._reported = False  # the process sent its error (else: it died)
        self._shm_name, self._weights = create_segment("rlcw_", 2 * config.weights.slot_bytes)

    # ------------------------------------------------------------------ interface

    @property
    def policy_version(self) -> int:
        return self._version

    @property
    def error(self) -> InferenceError | None:
        """The process's failure, if any. Looking also checks the process itself, at most
        every 0.25 s: its death is found even where its status pipe stays open (a child
        of it holding a copy), and stopped (SIGSTOP, a debugger) for longer than
        ``stall_timeout`` it is killed, and that is its error."""
        if self._error is None:
            self._look_at_the_process(self._config.stall_timeout)
        return self._error

    def _look_at_the_process(self, timeout: float | None) -> None:
        now = time.monotonic()
        if now < self._next_look or self._proc is None or self._stopped:
            return
        self._next_look = now + 0.25
        code = reap(self._proc)
        if code is not None:
            with self._cond:
                if self._error is None and not self._stopped:
                    self._error = InferenceError(
                        f"the inference process (pid {self._proc.pid}) died"
                        f"{self._when()}: {describe_exit(code, 'status pipe')}"
                    )
                self._cond.notify_all()
            return
        if timeout is None or not process_stopped(self._proc.pid):
            self._stopped_since = None
            return
        if self._stopped_since is None:
            self._stopped_since = now
        elif now - self._stopped_since > timeout:
            with self._cond:
                if self._error is None:
                    self._error = InferenceError(
                        f"the inference process (pid {self._proc.pid}) has been stopped "
                        f"(SIGSTOP or a debugger) for {now - self._stopped_since:.1f}"
                        f" s: stalled (stall_timeout={timeout:g} s); it was killed"
                    )
                self._cond.notify_all()
            kill(self._proc)

    def _when(self) -> str:
        """Where a death leaves the process: serving, or not yet (its start)."""
        return "" if "ready" in self._replies else " while it started (before it served)"

    @property
    def pid(self) -> int | None:
        """Process id of the inference process (None before :meth:`start`)."""
        return None if self._proc is None else self._proc.pid

    @property
    def shm_name(self) -> str:
        """Name of the weights segment (under ``/dev/shm``)."""
        return self._shm_name

    def segments(self) -> tuple[str, ...]:
        """The weights segment (:attr:`shm_name`)."""
        return (self._shm_name,)

    def start(self) -> None:
        """Start the inference process; returns once it serves (after any compile or
        capture), or raises what stopped it."""
        control_r, control_w = os.pipe()
        status_r, status_w = os.pipe()
        header = _Header(
            self._channel,
            self._config,
            self._shm_name,
            control_r,
            status_w,
            self._is_factory,
        )
        fds = (control_r, status_w, *self._channel.pass_fds)
        self._lifeline = Lifeline()
        try:
            self._proc = spawn(
                _CHILD,
                header,
                self._payload,
                pass_fds=fds,
                env=child_env(),
                lifeline=self._lifeline,
            )
        except BaseException:
            os.close(control_w)
            os.close(status_r)
            raise
        finally:
            os.close(control_r)
            os.close(status_w)
        self._control = Connection(control_w)
        status = Connection(status_r)
        self._reader = threading.Thread(
            target=self._read_status, args=(status,), name="rlcollect-inference-status", daemon=True
        )
        self._reader.start()
        with self._cond:
            while "ready" not in self._replies and self._error is None:
                self._cond.wait(_REPLY_WAIT)
        if self._error is not None:
            self.stop()
            if not self._reported:  # it died: killed, or out of memory; no fault found
                raise self._error
            cause = self._error.__cause__
            raise ValueError(f"the policy failed in the inference process: {self._error}") from (
                cause
            )

    def update_weights(self, state_dict: Mapping[str, torch.Tensor]) -> int:
        layout = self._config.weights
        check_weights(state_dict, layout.weights())
        self._raise_error()
        version = self._version + 1
        with self._cond:  # the slot is free once version - 2 is applied
            deadline = time.monotonic() + _WEIGHTS_WAIT
            while self._applied < version - 2 and self._error is None:
                if not self._cond.wait(max(0.0, deadline - time.monotonic())):
                    raise InferenceError(
                        f"the inference process did not apply weights version {version - 2} "
                        f"within {_WEIGHTS_WAIT} s"
                    )
        self._raise_error()
        slot = layout.views(self._weights, version % 2)
        with torch.no_grad():
            for name, value in state_dict.items():
                slot[name].copy_(value.detach())
        self._send(("weights", version))
        self._version = version
        return version

    def pause(self, timeout: float) -> None:
        self._request("paused", ("pause", timeout), timeout + _REPLY_WAIT)

    def resume(self) -> None:
        self._send(("resume",))

    def stats(self) -> dict[str, Any]:
        if self._error is not None or self._stopped:
            return dict(self._last_stats)  # as the process left them (or none)
        reply: dict[str, Any] = self._request("stats", ("stats",), _REPLY_WAIT)
        reply["applied_version"] = self._applied
        self._last_stats = reply
        return dict(reply)

    def wait_applied(self, version: int, timeout: float) -> bool:
        """Block until weights ``version`` serve batches (or ``timeout`` passes)."""
        with self._cond:
            return self._cond.wait_for(
                lambda: self._applied >= version or self._error is not None, timeout
            )

    def stop(self) -> None:
        if self._stopped:
            return
        if self._error is None and self._control is not None and "ready" in self._replies:
            # Keep the final figures readable after shutdown, as the thread backend's. Not
            # before "ready": a process still building its policy reads no request, and
            # asking would hold a Ctrl-C during start-up for _REPLY_WAIT seconds.
            try:
                self.stats()
            except InferenceError:
                pass
        self._stopped = True
        if self._lifeline is not None:
            self._lifeline.orderly()  # stopped in order (lifeline.py)
        if self._control is not None:
            self._control.close()  # end-of-file: the inference process exits
        if self._proc is not None:
            stop_processes([self._proc], _STOP_WAIT)  # with its process group
        if self._reader is not None:
            self._reader.join(_STOP_WAIT)
        if self._lifeline is not None:
            self._lifeline.close()
        self._weights.close()
        unlink_segment(self._shm_name)

    # ------------------------------------------------------------------ plumbing

    def _raise_error(self) -> None:
        if self._error is not None:
            raise self._error
        if self._stopped:
            raise InferenceError("the inference process is stopped")

    def _send(self, message: tuple[Any, ...]) -> None:
        self._raise_error()
        assert self._control is not None
        try:
            with self._send_lock:
                self._control.send(message)
        except OSError as exc:
            raise InferenceError("the inference process is gone") from exc

    def _request(self, kind: str, message: tuple[Any, ...], timeout: float) -> Any:
        with self._cond:
            self._replies.pop(kind, None)
        self._send(message)
        with self._cond:
            if not self._cond.wait_for(
                lambda: kind in self._replies or self._error is not None, timeout
            ):
                raise InferenceError(f"the inference process did not answer {kind!r} in time")
            self._raise_error()
            return self._replies.pop(kind)

    def _read_status(self, status: Connection) -> None:
        try:
            while True:
                try:
                    message = status.recv()
                except (EOFError, OSError):
                    break
                with self._cond:
                    if message[0] == "applied":
                        self._applied = message[1]
                    elif message[0] == "error":
                        err = InferenceError(message[1])
                        err.__cause__ = RemoteTraceback(message[2])
                        self._error = err
                        self._reported = True
                    else:
                        self._replies[message[0]] = message[1] if len(message) > 1 else None
                    self._cond.notify_all()
        finally:
            status.close()
            code = None
            if self._proc is not None and self._error is None and not self._stopped:
                code = wait_exit(self._proc, _STOP_WAIT)  # its pipe closed: it is exiting
            with self._cond:
                if self._error is None and not self._stopped:
                    how = describe_exit(code, "status pipe")
                    self._error = InferenceError(
                        f"the inference process (pid {self.pid}) died{self._when()}: {how}"
                    )
                self._cond.notify_all()


# ---------------------------------------------------------------------------- the child


def _inference_main() -> None:
    """Entry point of the inference process (see ``_CHILD``). It ignores SIGINT from its
    first line on (``processes.spawn``): the driver decides when it stops."""
    import cloudpickle

    header: _Header
    header, payload = read_handoff()
    # The driver's death ends this process and its group, even inside a long call.
    watch_driver(lambda: unlink_segment(header.weights_shm))
    status = Connection(header.status_fd)
    control = Connection(header.control_fd)
    cfg = header.config
    server = None
    ready = threading.Event()
    threading.Thread(
        target=_exit_if_abandoned,
        args=(header.control_fd, ready, header.weights_shm),
        name="rlcollect-abandoned",
        daemon=True,
    ).start()
    try:
        loaded = cloudpickle.loads(payload)
        policy: torch.nn.Module = loaded() if header.policy_is_factory else loaded
        if not isinstance(policy, torch.nn.Module):
            raise TypeError(f"the policy factory returned a {type(policy).__name__}, not a Module")
        policy = policy.to(torch.device(cfg.device))
        policy.requires_grad_(False)
        server = build_server(policy, cfg, header.channel.open())
        weights = attach_segment(header.weights_shm, 2 * cfg.weights.slot_bytes)
        server.start()
        ready.set()
        status.send(("ready",))
        _serve_control(control, status, server, weights, cfg.weights)
    except BaseException as exc:
        _send_error(status, exc)
    finally:
        if server is not None:
            server.stop()
        # The driver unlinks the segment too; this covers a driver killed outright.
        unlink_segment(header.weights_shm)
        exit_child(0)  # CUDA and daemon threads need no orderly interpreter teardown


def _exit_if_abandoned(control_fd: int, ready: threading.Event, weights_shm: str) -> None:
    """Exit at once if the control pipe turns readable before ``ready`` is set.

    The driver sends nothing until it has read ``("ready",)`` (set just before it is
    sent), so a readable pipe before then is end-of-file: the driver stopped waiting for
    us (Ctrl-C, a failure of its own) or died. Building a policy can take long, and
    without this the driver would wait ``_STOP_WAIT`` s and then kill us. After
    ``ready``, the first message wakes this thread and it ends; the control loop reads
    that message.
    """
    select.select([control_fd], [], [])  # bounded: end-of-file at the latest
    if not ready.is_set():
        unlink_segment(weights_shm)
        exit_child(0)


def _serve_control(
    control: Connection, status: Connection, server: Any, weights: mmap.mmap, layout: WeightsLayout
) -> None:
    while True:
        if server.error is not None:
            raise server.error
        if not control.poll(0.1):
            continue
        try:
            message = control.recv()
        except EOFError:
            return  # the driver stopped us, or died
        match message:
            case ("weights", version):
                server.update_weights(layout.views(weights, version % 2), version=version)
                status.send(("applied", version))
            case ("pause", timeout):
                server.pause(timeout)
                status.send(("paused",))
            case ("resume",):
                server.resume()
            case ("stats",):
                status.send(("stats", server.stats()))
            case _:
                raise ValueError(f"unknown control message {message!r}")


def _send_error(status: Connection, exc: BaseException) -> None:
    cause = exc.__cause__ if exc.__cause__ is not None else exc
    try:
        status.send(
            (
                "error",
                text_of(exc)
                if isinstance(exc, InferenceError)
                else f"the inference process failed: {type(exc).__name__}: {text_of(exc)}",
                traceback_of(cause),
            )
        )
    except OSError:
        pass  # the driver is gone
