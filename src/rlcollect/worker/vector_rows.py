"""The vector loop's chunk rows: finished transitions copied in, in the order they finish.

A vector env's result finishes the transitions of the sub-envs it names; each is
written whole into the next free row of the worker's current slot, seen as rows
``[slot * chunk_steps * k, ...)`` (``k``: the worker's columns): its observation,
action, policy outputs and version from the staging cell of its previous step
(``vector_staging.py``), the returned observation as ``next.observation``, reward,
flags, running return and length, env index, episode, step and ``info_keys`` entries
(``infos.py``). A sub-env's transitions finish in its own step order, so a chunk (and
every batch) holds each env's stream in order, without gaps; the envs' rows
interleave as their results came.

A full slot is handed over at once, and the next slot taken (:class:`Rows`): the one
the transport gives back, where it names it (a slot lent to the caller as a batch comes
back whenever the caller lets go of it: ``collector/batches/loans.py``), else the next
in turn.

This module imports no torch: it runs in worker processes.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from gymnasium.vector import AutoresetMode

from rlcollect.transports.base import WorkerEnd
from rlcollect.transports.layout import PROGRESS, STAGED, Key
from rlcollect.worker.infos import VectorInfoWriter
from rlcollect.worker.spec import WorkerSpec, observation_key
from rlcollect.worker.vector_autoreset import Episodes, write_final_observation
from rlcollect.worker.vector_env import VectorEnvDriver

__all__ = ["Rows", "TransitionWriter"]


class Rows:
    """Hands out the chunk's rows in order; hands a full slot over, takes the next."""

    def __init__(self, end: WorkerEnd, rows_per_slot: int, slots: int) -> None:
        self._end = end
        self._per_slot = rows_per_slot
        self._slots = slots
        self._slot = 0
        self._filled = 0  # rows of the slot written

    def begin(self) -> None:
        """Wait for the first slot to write."""
        given = self._end.wait_slot()
        self._slot = 0 if given is None else given

    def take(self, wanted: int) -> tuple[int, int]:
        """Start and length of the next run of free rows (at most ``wanted``)."""
        start = self._slot * self._per_slot + self._filled
        return start, min(wanted, self._per_slot - self._filled)

    def written(self, count: int) -> None:
        """``count`` rows from the start :meth:`take` gave are written."""
        self._filled += count
        if self._filled == self._per_slot:
            self._end.hand_over(self._slot)
            self._filled = 0
            given = self._end.wait_slot()
            self._slot = (self._slot + 1) % self._slots if given is None else given


class TransitionWriter:
    """Copies finished transitions into the chunk's rows (see the module docstring)."""

    def __init__(
        self,
        end: WorkerEnd,
        spec: WorkerSpec,
        staged: dict[Key, np.ndarray],
        episodes: Episodes,
    ) -> None:
        k = spec.num_envs
        positions = spec.chunk_steps * spec.slots
        # Every transition field seen as [positions * k, *shape]: rows in chunk order.
        self.chunk = {
            key: a.reshape(positions * k, *a.shape[2:])
            for key, a in end.buffers.items()
            if key[0] != STAGED and key != PROGRESS
        }
        self.staged = staged
        self.copied: list[Key] = list(staged)  # the observations and the outputs
        paths = spec.observation_paths
        self.next_keys = [observation_key(p, nxt=True) for p in paths]
        # SameStep's final observations: each leaf's path, key and chunk field.
        self.finals = [
            (path, key, self.chunk[key]) for path, key in zip(paths, self.next_keys, strict=True)
        ]
        self.episodes = episodes
        self.offset = spec.env_offset
        self.rows = Rows(end, spec.chunk_steps * k, spec.slots)
        self.infos = VectorInfoWriter(self.chunk, spec.info_keys, spec.env_offset)
        self.with_infos = bool(spec.info_keys)

    def write(
        self,
        driver: VectorEnvDriver,
        cols: np.ndarray,
        cells: np.ndarray,
        rows_in_result: np.ndarray,
        next_obs: tuple[list[np.ndarray], np.ndarray],
        reward: np.ndarray,
        term: np.ndarray,
        trunc: np.ndarray,
        info: dict[str, Any],
    ) -> np.ndarray:
        """Write the transitions that a result's rows ``rows_in_result`` finish, of the
        worker's columns ``cols``: their observations are in the staging cells ``cells``
        of the step before, their rewards and flags in those rows of the result, their
        next observations in rows ``next_obs[1]`` of the arrays ``next_obs[0]`` (the
        result's leaves, or the cells they were just staged in). Returns the indices
        (into ``cols``) of those that end an episode."""
        leaves, next_rows = next_obs
        chunk, staged = self.chunk, self.staged
        episode, step, returns = self.episodes.episode, self.episodes.step, self.episodes.returns
        done_at = np.flatnonzero(term[rows_in_result] | trunc[rows_in_result])
        same_step = driver.mode is AutoresetMode.SAME_STEP
        final_obs = info.get("final_obs") if same_step else None
        if same_step and done_at.size and final_obs is None:
            raise driver.fail("the result check") from KeyError(
                "a SameStep vector env ended an episode without info['final_obs']"
            )
        taken = 0
        while taken < len(cols):
            start, count = self.rows.take(len(cols) - taken)
            dst = slice(start, start + count)
            c = cols[taken : taken + count]
            r = rows_in_result[taken : taken + count]
            # mode="clip": the indices are valid, and the default ("raise") copies twice.
            for key in self.copied:
                np.take(
                    staged[key],
                    cells[taken : taken + count],
                    axis=0,
                    out=chunk[key][dst],
                    mode="clip",
                )
            n = next_rows[taken : taken + count]
            for key, leaf in zip(self.next_keys, leaves, strict=True):
                np.take(leaf, n, axis=0, out=chunk[key][dst], mode="clip")
            chunk[("env_index",)][dst] = self.offset + c
            chunk[("episode",)][dst] = episode[c]
            chunk[("step",)][dst] = step[c]
            chunk[("next", "reward")][dst] = reward[r]
            chunk[("next", "terminated")][dst] = term[r]
            chunk[("next", "truncated")][dst] = trunc[r]
            returns[c] += reward[r]
            chunk[("next", "episode_return")][dst] = returns[c]
            chunk[("next", "episode_length")][dst] = step[c] + 1
            returns[c[term[r] | trunc[r]]] = 0.0
            if self.with_infos:
                envs = (driver.first, driver.first + driver.n - 1)
                self.infos.write(
                    dst, c, r, term[r] | trunc[r], info, same_step=same_step, envs=envs
                )
            if final_obs is not None:
                local = done_at[(done_at >= taken) & (done_at < taken + count)]
                for i in local:
                    row = start + i - taken
                    write_final_observation(driver, self.finals, row, final_obs[r[i - taken]])
            taken += count
            self.rows.written(count)
        return done_at
