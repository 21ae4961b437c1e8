"""Episodes across a vector env's autoreset: each env's bookkeeping, by the env's mode.

``NextStep``
    The result that ends an episode carries its true final observation; the sub-env's
    next step only resets it (its action is ignored, its reward is 0). That step is
    never a transition: the sub-env takes part in the request (its action is
    discarded), and its next result starts the new episode.
``SameStep``
    The result that ends an episode carries the reset observation; the final one is in
    ``info["final_obs"]`` and becomes the last transition's ``next.observation``
    (:func:`write_final_observation`).
``Disabled`` (stepped whole only)
    The worker resets finished sub-envs itself, with ``reset(options={"reset_mask":
    ...})``, before their next request (:func:`reset_finished`).

:class:`Episodes` keeps, per column of the worker, the episode and step the next
transition belongs to, the rewards so far, whether a transition is under way (its
observation staged, its action sent) and, under ``NextStep``, whether the next result
only resets the env.

This module imports no torch: it runs in worker processes.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from gymnasium.vector import AutoresetMode

from rlcollect.transports.layout import Key
from rlcollect.worker.casts import cast_loss
from rlcollect.worker.spec import Path
from rlcollect.worker.vector_env import VectorEnvDriver, leaf
from rlcollect.worker.vector_staging import Staging

__all__ = ["Episodes", "reset_finished", "write_final_observation"]


class Episodes:
    """Each column's episode bookkeeping (``columns``: the worker's envs)."""

    def __init__(self, columns: int) -> None:
        self.episode = np.zeros(columns, np.int64)
        self.step = np.zeros(columns, np.int64)
        self.returns = np.zeros(columns, np.float64)  # each env's episode rewards so far
        self.pending = np.zeros(
            columns, bool
        )  # a transition is under way (obs staged, action sent)
        self.ended = np.zeros(columns, bool)  # NextStep: the next result only resets the env

    def starts(self, mode: AutoresetMode, cols: np.ndarray, done: np.ndarray | None) -> np.ndarray:
        """Which of the observations just returned for ``cols`` start an episode (step
        0), by the bookkeeping below: a reset result (no transition under way), or, where
        the result carries the reset observation itself (``SameStep``, ``Disabled``),
        one that ended an episode. A ``NextStep`` final observation is never a
        transition's: its env's next observation, the reset one, starts the episode."""
        starts: np.ndarray = ~self.pending[cols]
        if mode is not AutoresetMode.NEXT_STEP:
            assert done is not None  # only NextStep stages without its result's ends
            starts |= done
        return starts

    def advance(
        self, mode: AutoresetMode, cols: np.ndarray, fin_cols: np.ndarray, fin_done: np.ndarray
    ) -> None:
        """Bookkeeping for the observations of ``cols`` just staged: ``fin_cols``
        finished a transition, ``fin_done`` an episode."""
        self.step[fin_cols] += 1
        starting = cols[~self.pending[cols]]  # reset results: a new episode starts
        renewed = starting[self.ended[starting]]
        self.episode[renewed] += 1
        self.step[renewed] = 0
        self.ended[renewed] = False
        self.pending[cols] = True
        if fin_done.size:
            if mode is AutoresetMode.NEXT_STEP:
                self.ended[fin_done] = True
                self.pending[fin_done] = False  # the next result is only the reset
            else:
                self.episode[fin_done] += 1
                self.step[fin_done] = 0


def reset_finished(
    driver: VectorEnvDriver,
    staging: Staging,
    finished: np.ndarray,
    cols: np.ndarray,
    leaves: list[Any],
    paths: tuple[Path, ...],
) -> list[np.ndarray]:
    """``Disabled`` mode: reset ``finished`` (columns of ``driver``'s env); returns
    ``leaves`` (the observation leaves at ``paths`` of a result for ``cols``) with their
    rows replaced by the new episodes' observations (``leaves`` keeps the final ones)."""
    ids, new = driver.reset_some(finished - driver.base)
    row_of = np.empty(staging.k, np.intp)
    row_of[cols] = np.arange(len(cols))
    reset_rows = np.flatnonzero(np.isin(driver.base + ids, finished))
    out = []
    for i, path in enumerate(paths):
        fresh = staging.checked(driver, leaf(new, path), staging.obs_keys[i], len(ids))
        kept = leaves[i].copy()  # leaves[i] keeps the final observations
        kept[row_of[driver.base + ids[reset_rows]]] = fresh[reset_rows]
        out.append(kept)
    return out


def write_final_observation(
    driver: VectorEnvDriver,
    fields: list[tuple[Path, Key, np.ndarray]],
    row: int,
    final: Any,
) -> None:
    """``SameStep`` mode: write a finished episode's final observation ``final`` (from
    ``info["final_obs"]``) as chunk row ``row``'s ``next.observation``; ``fields``: each
    leaf's path, key and chunk field."""
    for path, key, field in fields:
        value = np.asarray(leaf(final, path))
        dst = field[row, ...]
        if value.shape != dst.shape:
            raise driver.fail("the observation check") from ValueError(
                f"info['final_obs'] holds a {'/'.join(key)} of shape {value.shape}; the "
                f"observation space says {dst.shape}"
            )
        np.copyto(dst, value, casting="same_kind")
        lost = cast_loss(value, dst)
        if lost is not None:
            raise driver.fail("the observation check") from ValueError(
                f"info['final_obs'] holds an observation {'/'.join(key)} {lost}"
            )
