"""The worker: build the envs, then step them, writing each step into the ring.

This module imports numpy and nothing of torch: it runs inside worker processes, which
start in a fraction of a second because of that. :func:`run_worker` builds the
worker's envs, checks each against what the collector expects, and runs one of two
loops: the vector-env loop (``vector_loop.py``) or the loop below, for envs stepped
one by one.

The worker's envs split into ``groups`` groups of equal size. Each group has a request
of its own, at most one outstanding, so that one group steps while the others wait for
their actions (double buffering: the policy's latency hides behind env steps). One
round of the loop visits the groups in order, at ring position ``p``::

    wait     the response to group g's request: its actions are written at p
    step     step group g's envs; write reward, flags and the next observation at p;
             an episode's end writes its true final observation, then resets
    advance  when p was a chunk's last position: the last group hands the chunk over,
             the first group first takes the next slot (backpressure): the one the
             transport gives back where it names it (``names_slots``; a batch lent to
             the caller gives its slots back whenever the caller lets go of it:
             ``collector/batches/loans.py``), else the next in turn
    write    group g's current observations at p + 1, then request them

Requests are numbered ``q = p * groups + g`` (the ring's in-place request layout), and
the server answers them in the order they were made, so waiting for "the next
response" is waiting for group g's. A chunk is complete once the last group has
stepped its last position; the first group enters the next slot before that, which is
why double buffering needs two slots.

Every transition also carries the episode's running return and length (this step
included), and the ``info`` entries named by ``info_keys`` (``infos.py``).

On-policy (``spec.on_policy``, ``collector/batches/rounds.py``): one slot of ``chunk_steps``
steps is one round, and a round starts only on the consumer's go-ahead (a credit,
taken with ``wait_slot``), which it gives when the next batch is asked for. So at a
round's last position the boundary is reordered: every group steps first, then the
worker hands the round over, waits for the go-ahead, and only then writes (and
requests) the next round's first observations. No request of the next round, and so
no action, comes before the weights that round must use. The worker also waits for
the go-ahead of the first round before its first request.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

from rlcollect.errors import EnvError
from rlcollect.transports.base import WorkerEnd
from rlcollect.transports.layout import PROGRESS
from rlcollect.worker.infos import InfoWriter
from rlcollect.worker.progress import Progress, Stage
from rlcollect.worker.source import Source, describe
from rlcollect.worker.spec import IS_INIT, Path, WorkerSpec, observation_key
from rlcollect.worker.vector_loop import vector_loop

__all__ = ["run_worker"]

_FLAG = (bool, np.bool_, int, np.integer)  # what terminated and truncated may be


@contextmanager
def _blame(env_index: int, during: str) -> Iterator[None]:
    try:
        yield
    except Exception as exc:
        raise EnvError(env_index, during) from exc


class _ObservationWriter:
    """Copies one (possibly dict) observation into its ring fields, checking shapes."""

    def __init__(self, end: WorkerEnd, paths: tuple[Path, ...], *, nxt: bool) -> None:
        self._fields = [
            (path, dst, dst.shape[2:], dst.dtype)
            for path in paths
            for dst in (end.buffers[observation_key(path, nxt=nxt)],)
        ]

    def write(self, position: int, env: int, obs: Any, env_index: int) -> None:
        for path, dst, shape, dtype in self._fields:
            value = obs
            for name in path:
                value = value[name]
            arr = np.asarray(value)
            if arr.shape != shape:
                where = "observation" + "".join(f"[{n!r}]" for n in path)
                raise EnvError(env_index, "the observation check") from ValueError(
                    f"env {env_index} returned an {where} of shape {arr.shape}; its "
                    f"observation_space says {shape}"
                )
            if arr.dtype == dtype:  # the usual case: a plain copy, half copyto's cost
                dst[position, env] = arr
                continue
            try:
                # `[position, env, ...]` stays a (0-d) view for scalar observations (Discrete)
                np.copyto(dst[position, env, ...], arr, casting="same_kind")
            except TypeError as exc:
                raise EnvError(env_index, "the observation check") from exc


def run_worker(end: WorkerEnd, spec: WorkerSpec) -> None:
    """Run the worker loop until the transport closes (``ChannelClosed`` propagates)."""
    envs = []
    per_factory = spec.source.envs
    progress = Progress(end.buffers[PROGRESS])  # every env call marked: stall_timeout
    for j, fn in enumerate(spec.env_fns):
        env_index = spec.env_offset + j * per_factory
        with _blame(env_index, "construction"):
            progress.enter(Stage.CONSTRUCTION, env_index)
            env = fn()
            progress.leave()
            _check_source(describe(env, f"env_fns[{env_index // per_factory}]"), spec, env_index)
        envs.append(env)
    try:
        if spec.source.vector:
            vector_loop(end, spec, envs, progress)
        else:
            _loop(end, spec, envs, progress)
    finally:
        for env in envs:
            try:
                env.close()
            except Exception:
                pass  # closing is best effort; the loop's own error matters more


def _check_source(got: Source, spec: WorkerSpec, env_index: int) -> None:
    expected = spec.source
    what = f"env {env_index}" if not expected.vector else f"the vector env of env {env_index}"
    for name in ("observation_space", "action_space"):
        if getattr(got, name) != getattr(expected, name):
            raise ValueError(
                f"{what} has {name} {getattr(got, name)}, but env 0 has "
                f"{getattr(expected, name)}; every env of a collector must have the same spaces"
            )
    for name, meaning in (
        ("sub_envs", "sub-envs (0: not a vector env)"),
        ("batch_size", "sub-envs per result (batch_size)"),
        ("autoreset", "autoreset mode"),
    ):
        if getattr(got, name) != getattr(expected, name):
            raise ValueError(
                f"{what} has {getattr(got, name)} {meaning}, but env_fns[0] built one with "
                f"{getattr(expected, name)}; every factory must build the same kind of env"
            )


def _loop(end: WorkerEnd, spec: WorkerSpec, envs: list[Any], progress: Progress) -> None:
    k = len(envs)
    groups = spec.splits
    width = k // groups
    members = [range(g * width, (g + 1) * width) for g in range(groups)]
    columns = [slice(g * width, (g + 1) * width) for g in range(groups)]
    steps = spec.chunk_steps
    positions = steps * spec.slots
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
    # Only with a recurrent policy: the server resets an env's state where it is set.
    is_init_field = buf.get(IS_INIT.key)
    return_field = buf[("next", "episode_return")]
    length_field = buf[("next", "episode_length")]
    infos = InfoWriter(buf, spec.info_keys)

    env_ids = spec.env_offset + np.arange(k, dtype=np.int64)
    ids = env_ids.tolist()  # as Python ints, for the per-step calls that name an env
    episode = np.zeros(k, dtype=np.int64)
    if spec.first_episode is not None:
        episode[:] = spec.first_episode
    step = np.zeros(k, dtype=np.int64)
    returns = np.zeros(k, dtype=np.float64)  # the episode's rewards so far, per env
    current: list[Any] = []
    for j, env in enumerate(envs):
        seed = None if spec.seed is None else spec.seed + int(env_ids[j])
        with _blame(int(env_ids[j]), "reset"):
            progress.enter(Stage.RESET, int(env_ids[j]))
            obs, _ = env.reset(seed=seed)
            progress.leave()
        current.append(obs)

    # Each group's columns of the per-env counters, as views made once (they follow the
    # counters' in-place updates): a request's writes, without slicing per request.
    group_ids = [env_ids[cols] for cols in columns]
    group_episodes = [episode[cols] for cols in columns]
    group_steps = [step[cols] for cols in columns]

    def write(p: int, g: int) -> None:
        for j in members[g]:
            obs_writer.write(p, j, current[j], ids[j])
        cols = columns[g]
        env_index_field[p, cols] = group_ids[g]
        episode_field[p, cols] = group_episodes[g]
        step_field[p, cols] = group_steps[g]
        end.request(p * groups + g)

    def write_flagged(p: int, g: int) -> None:
        assert is_init_field is not None
        cols = columns[g]
        np.equal(group_steps[g], 0, out=is_init_field[p, cols])  # before the request goes out
        write(p, g)

    # Chosen once: a feed-forward policy's loop is exactly what it was without the flag.
    emit = write if is_init_field is None else write_flagged

    enter, leave, STEP, RESET = progress.enter, progress.leave, Stage.STEP, Stage.RESET
    discrete = spec.discrete_actions
    given = end.wait_slot()
    p = 0 if given is None or spec.on_policy else given * steps
    if spec.on_policy:
        end.wait_slot()  # the first round's go-ahead: weights set before it are used
    for g in range(groups):
        emit(p, g)
    while True:
        nxt = p + 1 if p + 1 < positions else 0
        new_slot = nxt % steps == 0
        for g in range(groups):
            end.wait_response()
            actions = action[p]
            for j in members[g]:
                env = envs[j]
                a = int(actions[j]) if discrete else actions[j]
                # try/except, not a context manager: this runs once per env step.
                try:
                    enter(STEP, ids[j])
                    obs, r, term, trunc, info = env.step(a)
                    leave()
                except Exception as exc:
                    raise EnvError(ids[j], "step") from exc
                next_writer.write(p, j, obs, ids[j])
                try:
                    reward[p, j] = r
                    # numpy would take any object as a bool ("no" is True): only flags
                    # that are bools (or integers, as some older envs return) are flags
                    if not isinstance(term, _FLAG) or not isinstance(trunc, _FLAG):
                        raise TypeError("a flag is not a bool")
                    terminated[p, j] = term
                    truncated[p, j] = trunc
                    returns[j] += reward[p, j]
                except (TypeError, ValueError) as exc:
                    raise EnvError(ids[j], "the step results check") from TypeError(
                        f"env {ids[j]} returned reward={r!r}, terminated={term!r}, "
                        f"truncated={trunc!r}: a reward must be a real number and the flags "
                        f"bools ({exc})"
                    )
                return_field[p, j] = returns[j]
                length_field[p, j] = step[j] + 1
                infos.write(p, j, info, ids[j])
                if term or trunc:
                    try:
                        enter(RESET, ids[j])
                        obs, _ = env.reset()
                        leave()
                    except Exception as exc:
                        raise EnvError(ids[j], "reset") from exc
                    episode[j] += 1
                    step[j] = 0
                    returns[j] = 0.0
                else:
                    step[j] += 1
                current[j] = obs
            if not new_slot:
                emit(nxt, g)
            elif not spec.on_policy:
                if g == groups - 1:
                    end.hand_over(p // steps)
                if g == 0:
                    given = end.wait_slot()
                    if given is not None:  # the slot given back (where credits name it)
                        nxt = given * steps
                emit(nxt, g)
        if new_slot and spec.on_policy:
            # The round's end: every group has stepped; the next round's requests wait
            # for the consumer's go-ahead (its weights are set by then).
            end.hand_over(p // steps)
            end.wait_slot()
            for g in range(groups):
                emit(nxt, g)
        p = nxt
