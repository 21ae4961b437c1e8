"""Env 0 built before its worker's program arrived: kept for the program to take.

Where worker 0's process builds env 0 for the plan's probe (``transports/first_worker.py``),
the env it built is kept here, in that process, and the plan hands worker 0 its first
factory as :class:`BuiltFirst`: called in that process, it returns the kept env once; called
anywhere else (a restarted worker's new process), it builds one as the factory it wraps
does. Imports no torch: it runs in worker processes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["BuiltFirst", "keep"]

_KEPT: list[Any] = []  # env 0, built by this process before its program came


def keep(env: Any) -> None:
    """Keep ``env`` (env 0, as its factory built it) for worker 0's program."""
    _KEPT[:] = [env]


def kept() -> Any | None:
    """The env kept and not yet taken, or None."""
    return _KEPT[0] if _KEPT else None


@dataclass(frozen=True)
class BuiltFirst:
    """``env_fns[0]`` as worker 0 is given it where its process built env 0 already: the
    kept env the first time it is called there, else ``fn()``."""

    fn: Callable[[], Any]

    def __call__(self) -> Any:
        if _KEPT:
            return _KEPT.pop()
        return self.fn()
