"""Errors of a collector actor, carried to the driver and raised there by name.

An exception does not always survive pickling (``WorkerError`` takes keyword-only
arguments), and Ray's wrapper around a remote exception hides its type behind its own.
So the actor sends a :class:`Failure` (plain strings, and the exception itself where it
pickles), and the driver raises from it the error the caller would get from a local
collector, naming the collector and its envs (:meth:`Failure.error`):

* a ``WorkerError`` or ``InferenceError`` of the actor's collector: the same type, its
  ``env_index`` translated to the driver's numbering;
* anything else (a ``ValueError`` from a bad argument, found when the actor built its
  collector): the exception itself, with a note saying where.

A collector actor that *dies* (its process killed, its node lost) is
:func:`lost_error`, a ``WorkerError``.

This module imports no Ray.
"""

from __future__ import annotations

import pickle
import traceback
from dataclasses import dataclass

from rlcollect.errors import CollectorError, InferenceError, RemoteTraceback, WorkerError

__all__ = ["Failure", "describe", "envs_of", "lost_error"]


def envs_of(first: int, count: int) -> str:
    """``"envs 4-7"`` (or ``"env 4"``): how messages name a collector's envs."""
    return f"env {first}" if count == 1 else f"envs {first}-{first + count - 1}"


@dataclass(frozen=True)
class Failure:
    """An exception raised in a collector actor, as it crosses to the driver."""

    type_name: str
    message: str
    env_index: int  # within the actor's envs; -1 when no single env was at fault
    traceback: str
    notes: tuple[str, ...]
    pickled: bytes | None  # the exception itself, where it pickles and unpickles

    def error(self, collector: int, env_offset: int, num_envs: int) -> BaseException:
        """The exception to raise in the driver for collector ``collector``."""
        where = f"collector {collector} ({envs_of(env_offset, num_envs)})"
        cause = RemoteTraceback(self.traceback)
        error: BaseException
        if self.type_name == "WorkerError":
            env = -1 if self.env_index < 0 else env_offset + self.env_index
            error = WorkerError(f"{where}: {self.message}", worker_index=collector, env_index=env)
            error.add_note(
                f"rlcollect: env and worker numbers in the message count within {where}: "
                f"its env i is env {env_offset} + i of env_fns"
            )
        elif self.type_name == "InferenceError":
            error = InferenceError(f"{where}: {self.message}")
        elif self.pickled is not None:
            error = pickle.loads(self.pickled)  # its notes travelled with it
            error.add_note(f"rlcollect: raised in {where}")
            return error
        else:
            error = CollectorError(f"{where} raised {self.type_name}: {self.message}")
        for note in self.notes:
            error.add_note(note)
        if cause is not None:
            error.__cause__ = cause
        return error


def describe(exc: BaseException) -> Failure:
    """``exc`` as it can cross to the driver."""
    pickled: bytes | None = None
    try:
        pickled = pickle.dumps(exc)
        pickle.loads(pickled)
    except Exception:
        pickled = None
    env = getattr(exc, "env_index", -1)
    return Failure(
        type_name=type(exc).__name__,
        message=str(exc),
        env_index=env if isinstance(env, int) else -1,
        traceback="".join(traceback.format_exception(exc)),
        notes=tuple(getattr(exc, "__notes__", ())),
        pickled=pickled,
    )


def lost_error(
    collector: int, env_offset: int, num_envs: int, host: str, why: str, restarts: int, limit: int
) -> WorkerError:
    """The error for collector actor ``collector``, lost for ``why``, not restarted."""
    error = WorkerError(
        f"collector {collector} ({envs_of(env_offset, num_envs)}, on {host}) was lost: {why}",
        worker_index=collector,
    )
    error.add_note(
        f"rlcollect: not restarted: {restarts} collector restarts were made, "
        f"max_collector_restarts={limit}"
    )
    return error
