"""The worker: build the envs, then step them, writing each step into the ring.

This module imports numpy and nothing of torch: it runs inside worker processes, which
start in a fraction of a second because of that. :func:`run_worker` builds the
worker's envs, checks each against what the collector expects, and runs one of two
loops: the vector-env loop (``vector_loop.py``) or the loop below, for envs stepped
one by one.

The worker's envs (its columns) fall into ``splits`` splits of equal size. Each split
has a request of its own, at most one outstanding, so that one split steps while the
others wait for their actions (double buffering: the policy's latency hides behind env
steps). One round of the loop visits the splits in order, at ring position ``p``; each
phase is a function below::

    wait       the response to split g's request: its actions are written at p
    step       (inline in ``_drive``) step split g's envs; write reward, flags and the
               next observation at p; an episode's end writes its true final
               observation, then resets
    hand over  (``_hand_over``) when p was a chunk's last position: the last split
               hands the chunk over, the first split first takes the next slot
               (backpressure): the one the transport gives back where it names it
               (``names_slots``; a batch lent to the caller gives its slots back
               whenever the caller lets go of it: ``collector/batches/loans.py``), else
               the next in turn
    request    (``_request_phase``) split g's current observations at p + 1, then
               request their actions

``_reset`` resets every env first, and ``_drive`` runs the rounds. Requests are
numbered ``q = p * splits + g`` (the ring's in-place request layout), and the server
answers them in the order they were made, so waiting for "the next response" is
waiting for split g's. A chunk is complete once the last split has stepped its last
position; the first split enters the next slot before that, which is why double
buffering needs two slots.

Every transition also carries the episode's running return and length (this step
included), and the ``info`` entries named by ``info_keys`` (``infos.py``).

On-policy (``spec.on_policy``, ``collector/batches/rounds.py``): one slot of ``chunk_steps``
steps is one round, and a round starts only on the consumer's go-ahead (a credit,
taken with ``wait_slot``), which it gives when the next batch is asked for. So at a
round's last position the boundary is reordered: every split steps first, then the
worker hands the round over (``_end_round``), waits for the go-ahead, and only then
writes (and requests) the next round's first observations. No request of the next
round, and so no action, comes before the weights that round must use. The worker also
waits for the go-ahead of the first round before its first request.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
from gymnasium import spaces

from rlcollect.errors import EnvError
from rlcollect.transports.base import WorkerEnd, text_of
from rlcollect.transports.layout import PROGRESS
from rlcollect.worker.actions import action_bounds, outside, outside_error
from rlcollect.worker.casts import cast_loss
from rlcollect.worker.infos import InfoWriter
from rlcollect.worker.progress import Progress, Stage
from rlcollect.worker.source import Source, describe
from rlcollect.worker.spec import IS_INIT, Path, WorkerSpec, observation_key
from rlcollect.worker.vector_loop import vector_loop

__all__ = ["run_worker"]

_FLAG = (bool, np.bool_, int, np.integer)  # what terminated and truncated may be
_REAL = (float, int, np.floating, np.integer)  # rewards, at once (else: is_real)


def is_real(value: Any) -> bool:
    """``value`` is one real number as numpy reads it (a bool, an integer, a float, a
    0-d array of one): not None, a string or a complex, which numpy would store as NaN,
    parse or refuse."""
    try:
        arr = np.asarray(value)
    except Exception:
        return False
    return arr.shape == () and arr.dtype.kind in "biuf"


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
            cell = dst[position, env, ...]  # a (0-d) view for scalar observations too
            try:
                np.copyto(cell, arr, casting="same_kind")
            except TypeError as exc:
                raise EnvError(env_index, "the observation check") from exc
            lost = cast_loss(arr, cell)
            if lost is not None:
                where = "observation" + "".join(f"[{n!r}]" for n in path)
                raise EnvError(env_index, "the observation check") from ValueError(
                    f"env {env_index} returned an {where} {lost}"
                )


class _LeafWriter:
    """An observation that is one array: the usual case, written at once where its
    shape and dtype are its field's; anything else goes through the full writer (its
    checks, casts and errors)."""

    def __init__(self, end: WorkerEnd, *, nxt: bool) -> None:
        self._full = _ObservationWriter(end, ((),), nxt=nxt)
        self._dst = end.buffers[observation_key((), nxt=nxt)]
        self._shape = self._dst.shape[2:]
        self._dtype = self._dst.dtype

    def write(self, position: int, env: int, obs: Any, env_index: int) -> None:
        arr = np.asarray(obs)
        if arr.shape == self._shape and arr.dtype == self._dtype:
            self._dst[position, env] = arr
        else:
            self._full.write(position, env, obs, env_index)


def _observation_writer(
    end: WorkerEnd, paths: tuple[Path, ...], *, nxt: bool
) -> _ObservationWriter | _LeafWriter:
    if paths == ((),):
        return _LeafWriter(end, nxt=nxt)
    return _ObservationWriter(end, paths, nxt=nxt)


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
    """Reset every env, then run the rounds of the module docstring until the transport
    closes. The request phase is a closure made once, the step phase inline in
    :func:`_drive`: the hot path reads its state from locals and cells, not from
    attributes."""
    ring = _Ring(end, spec)
    counts = _Counters(spec, len(envs))
    current = _reset(envs, spec, counts, progress)
    split = _Split(len(envs), spec.splits)
    request = _request_phase(end, ring, counts, split, current)
    _drive(end, spec, envs, ring, counts, split, current, progress, request)


class _Ring:
    """The worker's views of the ring's fields, each indexed ``[position, column, ...]``."""

    def __init__(self, end: WorkerEnd, spec: WorkerSpec) -> None:
        buf = end.buffers
        self.observation = _observation_writer(end, spec.observation_paths, nxt=False)
        self.next_observation = _observation_writer(end, spec.observation_paths, nxt=True)
        self.action = buf[("action",)]
        self.reward = buf[("next", "reward")]
        self.terminated = buf[("next", "terminated")]
        self.truncated = buf[("next", "truncated")]
        self.env_index = buf[("env_index",)]
        self.episode = buf[("episode",)]
        self.step = buf[("step",)]
        # Only with a recurrent policy: the server resets an env's state where it is set.
        self.is_init = buf.get(IS_INIT.key)
        self.episode_return = buf[("next", "episode_return")]
        self.episode_length = buf[("next", "episode_length")]
        self.infos = InfoWriter(buf, spec.info_keys)


class _Counters:
    """Each column's env index, episode, step in it, and rewards so far in it."""

    def __init__(self, spec: WorkerSpec, columns: int) -> None:
        self.env_ids = spec.env_offset + np.arange(columns, dtype=np.int64)
        self.ids: list[int] = self.env_ids.tolist()  # Python ints, for calls naming an env
        self.episode = np.zeros(columns, dtype=np.int64)
        if spec.first_episode is not None:
            self.episode[:] = spec.first_episode
        self.step = np.zeros(columns, dtype=np.int64)
        self.returns = np.zeros(columns, dtype=np.float64)


class _Split:
    """The columns of each split: ``members[g]`` to visit them, ``columns[g]`` to slice."""

    def __init__(self, columns: int, splits: int) -> None:
        width = columns // splits
        self.count = splits
        self.members = [range(g * width, (g + 1) * width) for g in range(splits)]
        self.columns = [slice(g * width, (g + 1) * width) for g in range(splits)]


def _reset(envs: list[Any], spec: WorkerSpec, counts: _Counters, progress: Progress) -> list[Any]:
    """Reset every env (seeded by its collector index); returns their first observations."""
    current: list[Any] = []
    for env, env_index in zip(envs, counts.ids, strict=True):
        seed = None if spec.seed is None else spec.seed + env_index
        with _blame(env_index, "reset"):
            progress.enter(Stage.RESET, env_index)
            obs, _ = env.reset(seed=seed)
            progress.leave()
        current.append(obs)
    return current


def _request_phase(
    end: WorkerEnd, ring: _Ring, counts: _Counters, split: _Split, current: list[Any]
) -> Callable[[int, int], None]:
    """``request(p, g)``: write split ``g``'s current observations (and their env index,
    episode and step) at position ``p``, then request their actions."""
    splits, members, columns = split.count, split.members, split.columns
    observation, ids = ring.observation, counts.ids
    env_index_field, episode_field, step_field = ring.env_index, ring.episode, ring.step
    is_init_field = ring.is_init
    # Each split's columns of the counters, as views made once (they follow the counters'
    # in-place updates): a request's writes, without slicing per request.
    split_ids = [counts.env_ids[cols] for cols in columns]
    split_episodes = [counts.episode[cols] for cols in columns]
    split_steps = [counts.step[cols] for cols in columns]

    def request(p: int, g: int) -> None:
        for j in members[g]:
            observation.write(p, j, current[j], ids[j])
        cols = columns[g]
        env_index_field[p, cols] = split_ids[g]
        episode_field[p, cols] = split_episodes[g]
        step_field[p, cols] = split_steps[g]
        end.request(p * splits + g)

    def request_flagged(p: int, g: int) -> None:
        assert is_init_field is not None
        cols = columns[g]
        np.equal(split_steps[g], 0, out=is_init_field[p, cols])  # before the request goes out
        request(p, g)

    # Chosen once: a feed-forward policy's loop is exactly what it was without the flag.
    return request if is_init_field is None else request_flagged


def _drive(
    end: WorkerEnd,
    spec: WorkerSpec,
    envs: list[Any],
    ring: _Ring,
    counts: _Counters,
    split: _Split,
    current: list[Any],
    progress: Progress,
    request: Callable[[int, int], None],
) -> None:
    """The rounds: wait for split g's actions; step its envs, writing reward, flags,
    running return and length, infos and the next observation at ``p`` (an episode's
    end writes its true final observation, then resets the env); at a chunk's end hand
    the chunk over (:func:`_hand_over`, or :func:`_end_round` on-policy); request the
    split's next actions.

    The step phase stays inline, over locals: a function per split and step, even a
    closure made once, measured slower on cheap envs than this body, which runs once
    per env step."""
    splits, steps, on_policy = spec.splits, spec.chunk_steps, spec.on_policy
    positions = steps * spec.slots
    members, discrete = split.members, spec.discrete_actions
    low, high, fits = _action_check(spec.source.action_space)  # before an env sees it
    ids, episode, step_count, returns = counts.ids, counts.episode, counts.step, counts.returns
    action, next_writer, infos = ring.action, ring.next_observation, ring.infos
    reward, terminated, truncated = ring.reward, ring.terminated, ring.truncated
    return_field, length_field = ring.episode_return, ring.episode_length
    enter, leave, STEP, RESET = progress.enter, progress.leave, Stage.STEP, Stage.RESET
    given = end.wait_slot()
    p = 0 if given is None or on_policy else given * steps
    if on_policy:
        end.wait_slot()  # the first round's go-ahead: weights set before it are used
    for g in range(splits):
        request(p, g)
    while True:
        nxt = p + 1 if p + 1 < positions else 0
        new_slot = nxt % steps == 0
        for g in range(splits):
            end.wait_response()
            # Each env gets its element of the row, as gymnasium's vector envs pass it: a
            # discrete action as a numpy int64 (gymnasium's Discrete.contains, which many
            # envs assert, takes that in 1.7 us against 2.3 us for a Python int). Its
            # bounds are checked on the row read at once as Python ints.
            actions = action[p]
            values = actions.tolist() if discrete else actions
            for j in members[g]:
                env = envs[j]
                a = actions[j]
                if not (low <= values[j] <= high if discrete else fits(a)):
                    raise _outside(ids[j], a, spec.source.action_space)
                # try/except, not a context manager: this runs once per env step.
                try:
                    enter(STEP, ids[j])
                    obs, r, term, trunc, info = env.step(a)
                    leave()
                except Exception as exc:
                    raise EnvError(ids[j], "step") from exc
                next_writer.write(p, j, obs, ids[j])
                try:
                    if not isinstance(r, _REAL) and not is_real(r):  # None: NaN in numpy
                        raise TypeError(f"a reward of type {type(r).__name__} is no real number")
                    reward[p, j] = r
                    # numpy would take any object as a bool ("no" is True): only flags
                    # that are bools (or integers, as some older envs return) are flags
                    if not isinstance(term, _FLAG) or not isinstance(trunc, _FLAG):
                        raise TypeError("a flag is not a bool")
                    terminated[p, j] = term
                    truncated[p, j] = trunc
                    episode_return = returns[j] + reward[p, j]  # float64, as the counter
                    returns[j] = episode_return
                except (TypeError, ValueError) as exc:
                    raise EnvError(ids[j], "the step results check") from TypeError(
                        f"env {ids[j]} returned reward={text_of(r, quoted=True)}, "
                        f"terminated={text_of(term, quoted=True)}, "
                        f"truncated={text_of(trunc, quoted=True)}: a reward must be a real "
                        "number and the flags "
                        f"bools ({exc})"
                    )
                return_field[p, j] = episode_return
                length = step_count[j] + 1
                length_field[p, j] = length
                infos.write(p, j, info, ids[j])
                if term or trunc:
                    try:
                        enter(RESET, ids[j])
                        obs, _ = env.reset()
                        leave()
                    except Exception as exc:
                        raise EnvError(ids[j], "reset") from exc
                    episode[j] += 1
                    step_count[j] = 0
                    returns[j] = 0.0
                else:
                    step_count[j] = length
                current[j] = obs
            if not new_slot:
                request(nxt, g)
            elif not on_policy:
                nxt = _hand_over(end, g, splits, p, steps, nxt)
                request(nxt, g)
        if new_slot and on_policy:
            _end_round(end, p, steps)
            for g in range(splits):
                request(nxt, g)
        p = nxt


def _action_check(space: Any) -> tuple[float, float, Callable[[Any], bool]]:
    """How the loop checks an action against ``space`` (``actions.py``): a ``Discrete``
    action by its bounds (two comparisons), any other by ``fits``."""
    bounds = action_bounds(space)
    if isinstance(space, spaces.Discrete) and bounds is not None:
        return bounds[0], bounds[1], lambda a: True
    if bounds is None:
        return -math.inf, math.inf, lambda a: True
    return -math.inf, math.inf, lambda a: not outside(np.asarray(a)[None], bounds)[0]


def _outside(env_index: int, action: Any, space: Any) -> EnvError:
    error = EnvError(env_index, "the action check")
    error.__cause__ = outside_error(action, f"env {env_index}", space)
    return error


def _hand_over(end: WorkerEnd, g: int, splits: int, p: int, steps: int, nxt: int) -> int:
    """Off-policy, split ``g`` has stepped position ``p``, a chunk's last: the last split
    hands the chunk over; the first takes the next slot before its request
    (backpressure). Returns the position to write next: the first of the slot given
    back where the transport names it, else ``nxt``."""
    if g == splits - 1:
        end.hand_over(p // steps)
    if g == 0:
        given = end.wait_slot()
        if given is not None:  # the slot given back (where credits name it)
            return given * steps
    return nxt


def _end_round(end: WorkerEnd, p: int, steps: int) -> None:
    """On-policy, every split has stepped position ``p``, a round's last: hand the round
    over and wait for the consumer's go-ahead (its weights are set by then), before any
    request of the next round."""
    end.hand_over(p // steps)
    end.wait_slot()
