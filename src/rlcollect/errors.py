"""The one error vocabulary of rlcollect.

Every failure that reaches the caller is a :class:`CollectorError`. A failure that
happened somewhere else (a worker process, the inference thread) carries the remote
traceback as its ``__cause__``, in the manner of ``concurrent.futures``.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "ChannelClosed",
    "CollectorError",
    "EnvError",
    "InferenceError",
    "RemoteTraceback",
    "WorkerError",
    "WorkerFailure",
    "WorkerRestartWarning",
]


class CollectorError(RuntimeError):
    """Base class of every error rlcollect raises while collecting."""


class RemoteTraceback(Exception):
    """Holds a traceback formatted in another thread or process; used as ``__cause__``."""

    def __init__(self, tb: str) -> None:
        super().__init__(tb)
        self.tb = tb

    def __str__(self) -> str:
        return f'\n"""\n{self.tb}"""'


@dataclass(frozen=True)
class WorkerFailure:
    """What a worker reports when it fails; plain strings so it crosses any process boundary.

    ``env_index`` is the collector-wide index of the env that raised, or -1 when the
    failure was not inside one env (the worker itself, or an env factory that could not
    be unpickled).
    """

    worker_index: int
    env_index: int
    exc_type: str
    message: str
    traceback: str


class WorkerError(CollectorError):
    """A worker failed: an env raised, or the worker process died.

    ``worker_index`` and ``env_index`` name where (``env_index`` is -1 when no single
    env was at fault); the remote traceback is the ``__cause__``.
    """

    def __init__(self, message: str, *, worker_index: int, env_index: int = -1) -> None:
        super().__init__(message)
        self.worker_index = worker_index
        self.env_index = env_index

    @classmethod
    def from_failure(cls, failure: WorkerFailure) -> WorkerError:
        where = f"worker {failure.worker_index}"
        if failure.env_index >= 0:
            where = f"env {failure.env_index} (worker {failure.worker_index})"
        err = cls(
            f"{where} raised {failure.exc_type}: {failure.message}",
            worker_index=failure.worker_index,
            env_index=failure.env_index,
        )
        err.__cause__ = RemoteTraceback(failure.traceback)
        return err


class WorkerRestartWarning(RuntimeWarning):
    """A crashed worker was restarted (``max_worker_restarts``); the message names the
    worker, its envs, the cause and how many restarts the collector has made."""


class InferenceError(CollectorError):
    """The inference server failed: the policy raised or returned something unusable."""


class ChannelClosed(Exception):
    """A transport endpoint was closed (shutdown, or the other side died).

    Raised by transport waits so that no wait can outlive the collector; the worker loop
    treats it as the signal to exit quietly.
    """


class EnvError(Exception):
    """Raised inside a worker when the env ``env_index`` raised; the original is ``__cause__``.

    Transports turn it into a :class:`WorkerFailure` that names the env and carries the
    env's own exception and traceback.
    """

    def __init__(self, env_index: int, during: str) -> None:
        super().__init__(f"env {env_index} raised during {during}")
        self.env_index = env_index
        self.during = during
