"""The worker loop: step envs, write each step into the ring, hand over full chunks.

This module imports numpy and nothing of torch: it runs inside worker processes, which
start in a fraction of a second because of that. One loop iteration is four named
steps::

    write    the current observations of the worker's envs at position p
    request  ring the doorbell, wait for the actions the server writes at p
    step     step every env; write reward, flags and the next observation at p;
             an episode's end writes its true final observation, then resets
    advance  p += 1; a full chunk is handed over, and the next slot awaited (backpressure)
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np

from rlcollect.errors import EnvError
from rlcollect.transports.base import WorkerEnd
from rlcollect.transports.layout import Field, Key

__all__ = ["WorkerSpec", "observation_key", "run_worker", "transition_fields"]

Path = tuple[str, ...]


def observation_key(path: Path, *, nxt: bool = False) -> Key:
    """Ring key of the observation leaf at ``path`` (``()`` for a non-dict observation)."""
    return (("next", "observation") if nxt else ("observation",)) + path


def transition_fields(
    observations: tuple[Field, ...], action: Field, extras: tuple[Field, ...] = ()
) -> tuple[Field, ...]:
    """Every ring field of a transition, given the observation leaves and policy outputs.

    ``observations`` are keyed ``("observation", *path)``; their ``("next", ...)``
    twins, the bookkeeping fields and the step results are added here.
    """
    return (
        *observations,
        *(Field(("next", *f.key), f.shape, f.dtype) for f in observations),
        action,
        *extras,
        Field(("policy_version",), (), np.dtype(np.int64)),
        Field(("env_index",), (), np.dtype(np.int64)),
        Field(("episode",), (), np.dtype(np.int64)),
        Field(("step",), (), np.dtype(np.int64)),
        Field(("next", "reward"), (), np.dtype(np.float32)),
        Field(("next", "terminated"), (), np.dtype(np.bool_)),
        Field(("next", "truncated"), (), np.dtype(np.bool_)),
    )


@dataclass(frozen=True)
class WorkerSpec:
    """Everything one worker needs; pickled into worker processes with cloudpickle."""

    env_fns: tuple[Callable[[], Any], ...]
    env_offset: int
    seed: int | None
    chunk_steps: int
    slots: int
    observation_space: Any
    action_space: Any
    observation_paths: tuple[Path, ...]
    discrete_actions: bool


@contextmanager
def _blame(env_index: int, during: str) -> Iterator[None]:
    try:
        yield
    except Exception as exc:
        raise EnvError(env_index, during) from exc


class _ObservationWriter:
    """Copies one (possibly dict) observation into its ring fields, checking shapes."""

    def __init__(self, end: WorkerEnd, paths: tuple[Path, ...], *, nxt: bool) -> None:
        self._fields = [(path, end.buffers[observation_key(path, nxt=nxt)]) for path in paths]

    def write(self, position: int, env: int, obs: Any, env_index: int) -> None:
        for path, dst in self._fields:
            value = obs
            for name in path:
                value = value[name]
            arr = np.asarray(value)
            if arr.shape != dst.shape[2:]:
                where = "observation" + "".join(f"[{n!r}]" for n in path)
                raise EnvError(env_index, "the observation check") from ValueError(
                    f"env {env_index} returned an {where} of shape {arr.shape}; its "
                    f"observation_space says {dst.shape[2:]}"
                )
            try:
                # `[position, env, ...]` stays a (0-d) view for scalar observations (Discrete)
                np.copyto(dst[position, env, ...], arr, casting="same_kind")
            except TypeError as exc:
                raise EnvError(env_index, "the observation check") from exc


def run_worker(end: WorkerEnd, spec: WorkerSpec) -> None:
    """Run the worker loop until the transport closes (``ChannelClosed`` propagates)."""
    envs = []
    for j, fn in enumerate(spec.env_fns):
        env_index = spec.env_offset + j
        with _blame(env_index, "construction"):
            env = fn()
            _check_spaces(env, spec, env_index)
        envs.append(env)
    try:
        _loop(end, spec, envs)
    finally:
        for env in envs:
            try:
                env.close()
            except Exception:
                pass  # closing is best effort; the loop's own error matters more


def _check_spaces(env: Any, spec: WorkerSpec, env_index: int) -> None:
    for name, expected in (
        ("observation_space", spec.observation_space),
        ("action_space", spec.action_space),
    ):
        got = getattr(env, name, None)
        if got != expected:
            raise ValueError(
                f"env {env_index} has {name} {got}, but env 0 has {expected}; every env of a "
                "collector must have the same spaces"
            )


def _loop(end: WorkerEnd, spec: WorkerSpec, envs: list[Any]) -> None:
    k = len(envs)
    steps = spec.chunk_steps
    buf = end.buffers
    obs_writer = _ObservationWriter(end, spec.observation_paths, nxt=False)
    next_writer = _ObservationWriter(end, spec.observation_paths, nxt=True)
    action = buf[("action",)]
    reward = buf[("next", "reward")]
    terminated = buf[("next", "terminated")]
    truncated = buf[("next", "truncated")]
    env_index_field = buf[("env_index",)]
    episode_field = buf[("episode",)]
    step_field = buf[("step",)]

    env_ids = spec.env_offset + np.arange(k, dtype=np.int64)
    episode = np.zeros(k, dtype=np.int64)
    step = np.zeros(k, dtype=np.int64)
    current: list[Any] = []
    for j, env in enumerate(envs):
        seed = None if spec.seed is None else spec.seed + int(env_ids[j])
        with _blame(int(env_ids[j]), "reset"):
            obs, _ = env.reset(seed=seed)
        current.append(obs)

    slot, t = 0, 0
    end.wait_slot()
    while True:
        # write
        p = slot * steps + t
        for j in range(k):
            obs_writer.write(p, j, current[j], int(env_ids[j]))
        env_index_field[p] = env_ids
        episode_field[p] = episode
        step_field[p] = step

        # request
        end.request(p)
        end.wait_response()

        # step
        actions = action[p]
        for j, env in enumerate(envs):
            a = int(actions[j]) if spec.discrete_actions else actions[j]
            # try/except, not a context manager: this runs once per env step.
            try:
                obs, r, term, trunc, _ = env.step(a)
            except Exception as exc:
                raise EnvError(int(env_ids[j]), "step") from exc
            next_writer.write(p, j, obs, int(env_ids[j]))
            reward[p, j] = r
            terminated[p, j] = term
            truncated[p, j] = trunc
            if term or trunc:
                try:
                    obs, _ = env.reset()
                except Exception as exc:
                    raise EnvError(int(env_ids[j]), "reset") from exc
                episode[j] += 1
                step[j] = 0
            else:
                step[j] += 1
            current[j] = obs

        # advance
        t += 1
        if t == steps:
            end.hand_over(slot)
            slot = (slot + 1) % spec.slots
            t = 0
            end.wait_slot()
