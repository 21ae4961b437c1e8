"""The driver's bookkeeping: collectors' batches in order, exact global batches out.

::

    actor k's results, any order ─▶ InOrder (by the actor's own batch number)
        ─▶ HoldBack (with restarts: each env's latest row kept back)
        ─▶ Assembler (rows of every actor, first come first served)
        ─▶ TensorDict [frames_per_batch], the last one what remains of total_frames

Per-env order: an env belongs to one actor; that actor numbers its batches in the order
its collector produced them, and :class:`InOrder` passes them on in that order, so each
env's rows reach the assembler in step order. The assembler keeps the order of what it is
given and cuts it only at batch boundaries.

Exact accounting: only rows handed to the assembler count, and it hands out exactly
``total_frames`` of them; rows past the budget are the end of every stream (as in
``collector/batches/copied.py``).

Restarts (:class:`HoldBack`): an actor that dies leaves its envs in the middle of an
episode, and the rows it already sent may be in batches the caller holds, too late to
mark. So with ``max_collector_restarts`` the driver keeps back the latest row of each
env, releasing it when the env's next row arrives; when the actor dies, each held row
that did not end its episode is marked ``truncated`` (so ``done``) and released: every
episode of the stream ends with ``done``, as with ``max_worker_restarts``.

This module imports no Ray.
"""

from __future__ import annotations

from collections import deque

import numpy as np

from rlcollect._tensordict import TensorDict
from rlcollect.distributed.rows import Rows, concat, length, take, to_tensordict

__all__ = ["Assembler", "HoldBack", "InOrder"]


class InOrder:
    """One actor's batches, put back in the order the actor numbered them."""

    def __init__(self) -> None:
        self._waiting: dict[int, Rows] = {}
        self._next = 0

    def add(self, number: int, rows: Rows) -> list[Rows]:
        """Take batch ``number``; returns the batches now due, in order."""
        if number < self._next or number in self._waiting:
            raise AssertionError(f"batch {number} of this actor arrived twice")
        self._waiting[number] = rows
        due = []
        while self._next in self._waiting:
            due.append(self._waiting.pop(self._next))
            self._next += 1
        return due

    @property
    def waiting(self) -> int:
        """Batches that arrived ahead of an earlier one (dropped if the actor dies)."""
        return len(self._waiting)


class HoldBack:
    """Keeps back the latest row of each of an actor's envs (``env_offset`` onwards)."""

    def __init__(self, env_offset: int, num_envs: int) -> None:
        self._offset = env_offset
        self._num_envs = num_envs
        self._held: Rows | None = None  # one row per env, valid where _present
        self._present = np.zeros(num_envs, dtype=bool)

    def pass_on(self, rows: Rows) -> Rows | None:
        """The rows that may go on now: the held rows of the envs in ``rows``, then
        ``rows`` without each env's last one, which is held instead."""
        n = length(rows)
        env = rows[("env_index",)] - self._offset
        last = np.full(self._num_envs, -1, dtype=np.int64)
        np.maximum.at(last, env, np.arange(n))  # each env's last position in rows
        seen = last >= 0
        is_last = np.zeros(n, dtype=bool)
        is_last[last[seen]] = True
        parts = []
        if self._held is not None:
            released = self._present & seen
            if released.any():
                parts.append(take(self._held, released))
        if not is_last.all():
            parts.append(take(rows, ~is_last))
        if self._held is None:
            self._held = {
                key: np.zeros((self._num_envs, *value.shape[1:]), dtype=value.dtype)
                for key, value in rows.items()
            }
        envs = np.flatnonzero(seen)
        for key, value in rows.items():
            self._held[key][envs] = value[last[envs]]
        self._present |= seen
        return concat(parts) if parts else None

    def release_ended(self) -> Rows | None:
        """Every held row, each ending its episode (``truncated`` where it was not
        ``terminated``): the actor that sent them is gone."""
        if self._held is None or not self._present.any():
            return None
        rows = take(self._held, self._present)
        rows[("next", "truncated")] |= ~rows[("next", "terminated")]
        rows[("next", "done")] = rows[("next", "terminated")] | rows[("next", "truncated")]
        self._present[:] = False
        return rows

    def last_episodes(self) -> np.ndarray:
        """Each env's latest episode number, -1 for an env that sent no row."""
        if self._held is None:
            return np.full(self._num_envs, -1, dtype=np.int64)
        return np.where(self._present, self._held[("episode",)], -1)


class Assembler:
    """Cuts the rows it is given into batches of exactly ``frames_per_batch``."""

    def __init__(self, frames_per_batch: int, total_frames: int) -> None:
        self._fpb = frames_per_batch
        self._left = total_frames  # rows still to hand out; -1: endless
        self._parts: deque[Rows] = deque()
        self._start = 0  # rows of _parts[0] already handed out
        self.queued = 0  # rows given and not yet handed out

    @property
    def next_size(self) -> int:
        """Rows of the next batch; 0 once ``total_frames`` are handed out."""
        return self._fpb if self._left < 0 else min(self._fpb, self._left)

    @property
    def exhausted(self) -> bool:
        return self.next_size == 0

    @property
    def ready(self) -> bool:
        """A whole batch is queued."""
        return not self.exhausted and self.queued >= self.next_size

    def add(self, rows: Rows) -> None:
        if length(rows):
            self._parts.append(rows)
            self.queued += length(rows)

    def pop(self) -> TensorDict:
        """The next batch; only when :attr:`ready`. Each row is copied once, from the
        arrays it arrived in (read-only object-store memory) into the batch's own."""
        size = self.next_size
        first = self._parts[0]
        out = {
            key: np.empty((size, *value.shape[1:]), dtype=value.dtype)
            for key, value in first.items()
        }
        filled = 0
        while filled < size:
            part = self._parts[0]
            n = min(size - filled, length(part) - self._start)
            for key, value in part.items():
                out[key][filled : filled + n] = value[self._start : self._start + n]
            filled += n
            self._start += n
            if self._start == length(part):
                self._parts.popleft()
                self._start = 0
        self.queued -= size
        if self._left > 0:
            self._left -= size
        return to_tensordict(out)
