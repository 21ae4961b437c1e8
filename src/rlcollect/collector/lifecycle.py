"""A collector's lifecycle: one stage at a time, its moves, and what each stage refuses.

::

    STARTING ──(parts up)──▶ OPEN ──start()──▶ BACKGROUND
        │                     │                    │
        └──────────────── shutdown() ──────────────┴──▶ CLOSED ──▶ CLOSED (idempotent)

A collector (``facade.py``) is in one stage; every public call that a stage refuses is
refused from one table (:data:`_REFUSED`), with the same message wherever it comes from.
Two holds are not stages, because they coexist with them: a ``pause()`` block (in the
OPEN or BACKGROUND stage, its refusals in ``background.py``) and the thread inside
``next()`` (one at a time, ``Background.iterating``).
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Mapping

from rlcollect.errors import CollectorError

__all__ = ["Lifecycle", "Stage"]


class Stage(enum.Enum):
    """Where a collector is."""

    STARTING = "starting"  # its parts are being started: only shutdown() works
    OPEN = "open"  # up; the caller iterates it
    BACKGROUND = "background"  # start() was called: its own thread collects
    CLOSED = "closed"  # shut down (budget met, error, shutdown(), garbage collection)


_MOVES: Mapping[Stage, frozenset[Stage]] = {
    Stage.STARTING: frozenset({Stage.OPEN, Stage.CLOSED}),
    Stage.OPEN: frozenset({Stage.BACKGROUND, Stage.CLOSED}),
    Stage.BACKGROUND: frozenset({Stage.CLOSED}),
    Stage.CLOSED: frozenset({Stage.CLOSED}),
}

_SHUT_DOWN = "the collector is shut down"

#: (what the caller does, the stage) -> why it is refused.
_REFUSED: Mapping[tuple[str, Stage], str] = {
    ("iterate", Stage.BACKGROUND): (
        "the collector is collecting in the background (start() was called): "
        "sample from its replay buffer instead of iterating"
    ),
    ("start", Stage.STARTING): _SHUT_DOWN,
    ("start", Stage.CLOSED): _SHUT_DOWN,
    ("start", Stage.BACKGROUND): "the collector is already collecting in the background",
    ("pause", Stage.STARTING): _SHUT_DOWN,
    ("pause", Stage.CLOSED): _SHUT_DOWN,
    ("update", Stage.STARTING): _SHUT_DOWN,
    ("update", Stage.CLOSED): _SHUT_DOWN,
}


class Lifecycle:
    """A collector's stage; safe to read and move from any thread."""

    def __init__(self) -> None:
        self._stage = Stage.STARTING
        self._lock = threading.Lock()

    @property
    def stage(self) -> Stage:
        return self._stage

    @property
    def closed(self) -> bool:
        """Not serving: still starting, or shut down."""
        return self._stage in (Stage.STARTING, Stage.CLOSED)

    def move(self, to: Stage) -> Stage:
        """Move to ``to``; returns the stage before (CLOSED again: already shut down)."""
        with self._lock:
            return self._move(to)

    def enter(self, action: str, to: Stage) -> None:
        """Refuse ``action`` as :meth:`refuse` does, or move to ``to``, in one step: no
        shutdown can come between the two."""
        with self._lock:
            self.refuse(action)
            self._move(to)

    def _move(self, to: Stage) -> Stage:
        before = self._stage
        if to not in _MOVES[before]:
            raise RuntimeError(f"a collector cannot move from {before.name} to {to.name}")
        self._stage = to
        return before

    def refuse(self, action: str) -> None:
        """Raise the ``CollectorError`` the current stage gives ``action``, if any
        (``"iterate"``, ``"start"``, ``"pause"``, ``"update"``)."""
        why = _REFUSED.get((action, self._stage))
        if why is not None:
            raise CollectorError(why)
