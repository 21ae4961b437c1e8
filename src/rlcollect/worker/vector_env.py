"""One vector env of a worker: how the vector loop acts on it, and what its results mean.

A worker's vector env ``g`` of ``n`` sub-envs holds the worker's columns ``g * n`` to
``g * n + n - 1``, collector envs ``env_offset + g * n + j``. :class:`VectorEnvDriver`
drives it the one way its source allows: ``send`` + ``recv`` when driven asynchronously
(``batch_size < num_envs``: ``recv`` returns the first ``batch_size`` sub-envs to
finish, named by ``info["env_id"]``), ``step`` otherwise. An EnvPool pool
(``source.envpool``) is always driven with ``send`` + ``recv``, its ``send`` given the
sub-envs of the last result (it would send to every sub-env without them, in sub-env
order, not in the result's), and it resets with ``async_reset`` + ``recv`` (its
``reset`` is not defined for a pool driven asynchronously, and takes no seed: a pool's
seeds are fixed when it is built). Every call is marked in the
worker's progress record (``progress.py``, read by ``collector/batches/stall.py``), and
every failure is raised as an ``EnvError`` naming the vector env's envs.

A result is a :data:`Result`: the sub-env of each row (checked: a wrong id would route
actions to the wrong env), the observations, rewards and flags, and the info.

This module imports no torch: it runs in worker processes.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from rlcollect.errors import EnvError
from rlcollect.transports.base import text_of
from rlcollect.worker.actions import action_bounds, outside, outside_error
from rlcollect.worker.progress import Progress, Stage
from rlcollect.worker.spec import Path, WorkerSpec

__all__ = ["Result", "VectorEnvDriver", "leaf"]

#: A vector env's result: sub-env of each row, observations, rewards, terminated,
#: truncated, info.
Result = tuple[np.ndarray, Any, np.ndarray, np.ndarray, np.ndarray, dict[str, Any]]


def leaf(obs: Any, path: Path) -> Any:
    """The leaf of a (possibly dict) observation at ``path``."""
    for name in path:
        obs = obs[name]
    return obs


class VectorEnvDriver:
    """One vector env of the worker (the ``index``-th): how to act on it, and what its
    results mean."""

    def __init__(self, env: Any, spec: WorkerSpec, index: int, progress: Progress) -> None:
        source = spec.source
        self.env = env
        self.progress = progress
        self.n = source.sub_envs
        self.first = spec.env_offset + index * self.n  # collector index of sub-env 0
        self.base = index * self.n  # worker column of sub-env 0
        self.asynchronous = source.asynchronous
        self.envpool = source.envpool
        self.ids = np.arange(self.n)  # the sub-env of each row of the last result
        self.batch = source.batch_size
        self.mode = source.autoreset
        self.paths = spec.observation_paths
        self.seed = None if spec.seed is None else spec.seed + self.first
        self.space = source.action_space  # each sub-env's
        self.bounds = action_bounds(self.space)  # actions.py: checked before a step

    def fail(self, during: str) -> EnvError:
        """The error to raise (``from`` its cause) for a failure ``during`` a call."""
        last = self.first + self.n - 1
        return EnvError(self.first, f"{during} of the vector env of envs {self.first}-{last}")

    def reset(self) -> Result:
        if self.envpool:
            return self._reset_pool()
        try:
            self.progress.enter(Stage.RESET, self.first)
            obs, info = self.env.reset(seed=self.seed)
            self.progress.leave()
        except Exception as exc:
            raise self.fail("reset") from exc
        rows = len(leaf(obs, self.paths[0]))
        zeros = np.zeros(rows, dtype=bool)
        self.ids = self._ids(info, rows)
        return self.ids, obs, np.zeros(rows, np.float32), zeros, zeros, info

    def _reset_pool(self) -> Result:
        """EnvPool: reset every sub-env; the result holds the first ``batch_size``."""
        try:
            self.progress.enter(Stage.RESET, self.first)
            self.env.async_reset()
            obs, reward, term, trunc, info = self.env.recv()
            self.progress.leave()
        except Exception as exc:
            raise self.fail("reset") from exc
        return self._result(obs, reward, term, trunc, info)

    def act(self, actions: np.ndarray) -> Result:
        if self.asynchronous or self.envpool:
            self.send(actions)
            return self.recv()
        self._check(actions)
        try:
            self.progress.enter(Stage.STEP, self.first)
            obs, reward, term, trunc, info = self.env.step(actions)
            self.progress.leave()
        except Exception as exc:
            raise self.fail("step") from exc
        return self._result(obs, reward, term, trunc, info)

    def send(self, actions: np.ndarray) -> None:
        """Driven asynchronously: hand the sub-envs of the last result their actions."""
        self._check(actions)
        try:
            self.progress.enter(Stage.STEP, self.first)
            if self.envpool:
                self.env.send(actions, self.ids)
            else:
                self.env.send(actions)
            self.progress.leave()
        except Exception as exc:
            raise self.fail("step") from exc

    def recv(self) -> Result:
        """Driven asynchronously: the next ``batch_size`` sub-envs to finish their step."""
        try:
            self.progress.enter(Stage.STEP, self.first)
            obs, reward, term, trunc, info = self.env.recv()
            self.progress.leave()
        except Exception as exc:
            raise self.fail("step") from exc
        return self._result(obs, reward, term, trunc, info)

    def _check(self, actions: np.ndarray) -> None:
        """Every action lies within the action space (row ``i`` is the last result's
        row ``i``: sub-env ``i`` when stepped whole, but for an EnvPool pool)."""
        if self.bounds is None:
            return
        bad = outside(actions, self.bounds)
        if bad.any():
            row = int(np.flatnonzero(bad)[0])
            last = self.first + self.n - 1
            where = (
                f"env {self.first + int(self.ids[row])}"
                if not self.asynchronous
                else f"envs {self.first}-{last}"
            )
            raise self.fail("the action check") from outside_error(actions[row], where, self.space)

    def _result(self, obs: Any, reward: Any, term: Any, trunc: Any, info: dict[str, Any]) -> Result:
        rows = len(reward)
        rewards = np.asarray(reward)
        if rewards.dtype.kind not in "biuf":  # None would be stored as NaN, strings parsed
            raise self.fail("the step results check") from TypeError(
                f"the vector env of envs {self.first}-{self.first + self.n - 1} returned "
                f"rewards {text_of(reward, quoted=True)} ({rewards.dtype}): rewards must be "
                "real numbers"
            )
        self.ids = self._ids(info, rows)
        return (
            self.ids,
            obs,
            rewards,
            np.asarray(term, dtype=bool),
            np.asarray(trunc, dtype=bool),
            info,
        )

    def reset_some(self, sub_envs: np.ndarray) -> tuple[np.ndarray, Any]:
        """``Disabled`` mode: reset ``sub_envs``. Returns the sub-env of each row of the
        reset's observations (every sub-env's, reset or not), and the observations."""
        mask = np.zeros(self.n, dtype=bool)
        mask[sub_envs] = True
        try:
            self.progress.enter(Stage.RESET, self.first)
            new, info = self.env.reset(options={"reset_mask": mask})
            self.progress.leave()
        except Exception as exc:
            raise self.fail("reset") from exc
        return self._ids(info, len(leaf(new, self.paths[0]))), new

    def _ids(self, info: dict[str, Any], rows: int) -> np.ndarray:
        """Sub-env of each result row: ``info["env_id"]``, or ``0 … n-1`` when stepped whole
        without it. Checked: a wrong id would route actions to the wrong env."""
        ids = info.get("env_id") if isinstance(info, dict) else None
        if ids is None:
            if self.asynchronous:
                raise self.fail("the result check") from KeyError(
                    "a vector env driven with send/recv must name the sub-env of each result "
                    "row in info['env_id']"
                )
            if rows != self.n:
                raise self.fail("the result check") from ValueError(
                    f"a step returned {rows} rows for {self.n} sub-envs"
                )
            return np.arange(self.n, dtype=np.int64)
        out = np.asarray(ids, dtype=np.int64).reshape(-1)
        if (
            len(out) != rows
            or len(out) != self.batch
            or (out.size and (out.min() < 0 or out.max() >= self.n))
        ):
            raise self.fail("the result check") from ValueError(
                f"info['env_id'] = {out.tolist()} does not name {rows} sub-envs of {self.n}"
            )
        return out
