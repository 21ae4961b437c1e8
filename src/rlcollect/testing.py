"""Tools to test collectors and transports: envs that tell on themselves, and a suite.

:class:`CountingEnv` writes its id, episode and step (and the last action it received)
into its observation, so a test can check routing, order, gaps and episode ends row by
row. :class:`CountingVectorEnv` is a vector env of CountingEnvs driven with
``send``/``recv`` that returns an arbitrary (seeded) subset of its sub-envs each time,
as native asynchronous vector envs do. :func:`check_transport` runs the transport
conformance suite against any :class:`~rlcollect.transports.Transport` subclass,
driving it with real worker loops over these envs and a numpy stand-in for the
inference server (``AssertionError`` naming the failed check if one fails).

This module imports no torch: ``CountingEnv`` runs inside worker processes.

Examples:
    >>> from rlcollect.testing import check_transport
    >>> from rlcollect.transports import ThreadQueueTransport
    >>> check_transport(ThreadQueueTransport)  # returns None when every check passes
"""

from __future__ import annotations

import functools
import itertools
import threading
import time
from collections.abc import Callable
from typing import Any, ClassVar

import gymnasium as gym
import numpy as np
from gymnasium.vector import AutoresetMode, VectorEnv
from gymnasium.vector.utils import batch_space

from rlcollect.collector.source import Source
from rlcollect.collector.spec import WorkerSpec, transition_fields
from rlcollect.collector.worker import run_worker
from rlcollect.errors import ChannelClosed, WorkerError
from rlcollect.transports.base import ServerEnd, Transport
from rlcollect.transports.layout import Field, RingLayout, Staging, request_rows

__all__ = [
    "CHECKS",
    "CountingEnv",
    "CountingVectorEnv",
    "check_transport",
    "counting_actions",
    "counting_layout",
    "counting_programs",
    "episode_length",
]

#: Columns of a CountingEnv observation.
ENV_ID, EPISODE, STEP, LAST_ACTION = 0, 1, 2, 3


def episode_length(env_id: int, episode: int) -> int:
    """Steps in episode ``episode`` of CountingEnv ``env_id``: 3 to 9, varying.

    Args:
        env_id: the CountingEnv's id.
        episode: the episode number, from 0.

    Returns:
        The episode's length in steps.

    Examples:
        >>> from rlcollect.testing import episode_length
        >>> [episode_length(0, e) for e in range(4)]
        [3, 6, 9, 5]
    """
    return 3 + (env_id * 5 + episode * 3) % 7


def counting_actions(obs: np.ndarray, num_actions: int = 5) -> np.ndarray:
    """The deterministic policy the tests use: a function of an observation's own row.

    Since each action depends on the env id, episode and step of the observation it
    answers, a test can tell from ``("next", "observation")[..., LAST_ACTION]`` whether
    an env received the action meant for it.

    Args:
        obs: CountingEnv observations ``[..., 4]``.
        num_actions: the size of the Discrete action space.

    Returns:
        int64 actions ``[...]``.

    Examples:
        >>> import numpy as np
        >>> from rlcollect.testing import counting_actions
        >>> counting_actions(np.array([[0, 0, 0, 0], [1, 0, 2, 0]]))
        array([0, 4])
    """
    o = np.asarray(obs, dtype=np.int64)
    out: np.ndarray = (o[..., ENV_ID] * 7 + o[..., EPISODE] * 3 + o[..., STEP]) % num_actions
    return out


class CountingEnv(gym.Env[np.ndarray, np.int64]):  # type: ignore[misc]
    """Observation ``[env_id, episode, step, last_action]`` (int64); Discrete actions.

    Episode ``e`` of env ``i`` lasts :func:`episode_length` steps and ends terminated
    when ``e`` is even, truncated when odd. The reward of a step is ``step + 1``.
    ``fail_at`` ``(episode, step)`` makes ``step`` raise there; ``fail_in_reset`` makes
    the reset that would start that episode raise instead.

    Args:
        env_id: the id written into every observation.
        num_actions: size of the Discrete action space.
        fail_at: ``(episode, step)`` at which to raise ``RuntimeError``, or None.
        fail_in_reset: raise in the reset that starts episode ``fail_at[0]`` instead.

    Raises:
        ValueError: ``step`` got an action outside the action space.
        RuntimeError: at ``fail_at``, on purpose.

    Examples:
        >>> from rlcollect.testing import CountingEnv
        >>> env = CountingEnv(7)
        >>> env.reset()
        (array([7, 0, 0, 0]), {})
        >>> env.step(3)
        (array([7, 0, 1, 3]), 1.0, False, False, {})
        >>> env.step(1)[0], env.step(2)[2]  # episode 0 of env 7 lasts 3 steps
        (array([7, 0, 2, 1]), True)
    """

    metadata: ClassVar[dict[str, Any]] = {"render_modes": []}

    def __init__(
        self,
        env_id: int,
        *,
        num_actions: int = 5,
        fail_at: tuple[int, int] | None = None,
        fail_in_reset: bool = False,
    ) -> None:
        self.env_id = env_id
        self.observation_space = gym.spaces.Box(0, 1 << 40, shape=(4,), dtype=np.int64)
        self.action_space = gym.spaces.Discrete(num_actions)
        self._fail_at = fail_at
        self._fail_in_reset = fail_in_reset
        self.episode = -1
        self.t = 0
        self.last_action = 0

    def _obs(self) -> np.ndarray:
        return np.array([self.env_id, self.episode, self.t, self.last_action], dtype=np.int64)

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[np.ndarray, dict[str, Any]]:
        super().reset(seed=seed)
        self.episode += 1
        self.t = 0
        self.last_action = 0
        if self._fail_in_reset and self._fail_at is not None and self.episode == self._fail_at[0]:
            raise RuntimeError(f"CountingEnv {self.env_id} failed on purpose in reset")
        return self._obs(), {}

    def step(self, action: Any) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        if not self.action_space.contains(action):
            raise ValueError(f"CountingEnv {self.env_id} got invalid action {action!r}")
        if not self._fail_in_reset and self._fail_at == (self.episode, self.t):
            raise RuntimeError(f"CountingEnv {self.env_id} failed on purpose in step")
        reward = float(self.t + 1)
        self.t += 1
        self.last_action = int(action)
        end = self.t >= episode_length(self.env_id, self.episode)
        terminated = end and self.episode % 2 == 0
        truncated = end and self.episode % 2 == 1
        return self._obs(), reward, terminated, truncated, {}


class CountingVectorEnv(VectorEnv):  # type: ignore[misc]
    """CountingEnvs ``first … first + num_envs - 1`` as an asynchronous vector env.

    ``recv`` returns ``batch_size`` sub-envs picked at random (seeded by ``order_seed``)
    among those with a step or reset under way, named in ``info["env_id"]``; ``send``
    gives actions to the sub-envs of the last result, in its order. ``reset`` starts
    every sub-env and returns the first result. Autoreset follows ``autoreset_mode``
    (``NextStep``: the step after an episode's end only resets; ``SameStep``: the
    result that ends an episode carries the reset observation, the final one is in
    ``info["final_obs"]``, a ``[batch_size, 4]`` array).

    Args:
        first: id of the first sub-env.
        num_envs: sub-envs.
        batch_size: sub-envs each ``recv`` returns, ``1 … num_envs``.
        autoreset_mode: ``"NextStep"`` or ``"SameStep"``.
        order_seed: seeds the choice of sub-envs each ``recv`` returns.
        num_actions: size of each sub-env's Discrete action space.

    Raises:
        ValueError: ``batch_size`` out of range, or ``send`` got another number of
            actions than the last result had sub-envs.
        RuntimeError: ``recv`` with fewer sub-envs under way than ``batch_size``.

    Examples:
        >>> from rlcollect.testing import CountingVectorEnv
        >>> envs = CountingVectorEnv(first=10, num_envs=4, batch_size=2)
        >>> obs, info = envs.reset(seed=0)
        >>> obs.shape, bool((obs[:, 0] == 10 + info["env_id"]).all())  # which sub-envs
        ((2, 4), True)
        >>> obs, reward, terminated, truncated, info = envs.step([1, 2])
        >>> obs.shape, len(info["env_id"])
        ((2, 4), 2)
    """

    def __init__(
        self,
        first: int,
        num_envs: int,
        batch_size: int,
        *,
        autoreset_mode: str = "NextStep",
        order_seed: int = 0,
        num_actions: int = 5,
    ) -> None:
        if not 1 <= batch_size <= num_envs:
            raise ValueError(f"batch_size {batch_size} must be in 1 … num_envs={num_envs}")
        self.envs = [CountingEnv(first + j, num_actions=num_actions) for j in range(num_envs)]
        self.num_envs = num_envs
        self.batch_size = batch_size
        self.single_observation_space = self.envs[0].observation_space
        self.single_action_space = self.envs[0].action_space
        self.observation_space = batch_space(self.single_observation_space, batch_size)
        self.action_space = batch_space(self.single_action_space, batch_size)
        self.autoreset_mode = AutoresetMode(autoreset_mode)
        self.metadata = {"autoreset_mode": self.autoreset_mode}
        self._rng = np.random.default_rng(order_seed)
        self._under_way: dict[int, tuple[str, Any]] = {}  # sub-env → ("reset", seed) | ("step", a)
        self._ended = np.zeros(num_envs, dtype=bool)
        self._last = np.zeros(0, dtype=np.int64)

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[np.ndarray, dict[str, Any]]:
        for j in range(self.num_envs):
            self._under_way[j] = ("reset", None if seed is None else seed + j)
        obs, _, _, _, info = self.recv()
        return obs, info

    def send(self, actions: np.ndarray) -> None:
        """Start a step (or, after an episode's end with NextStep, a reset) of each
        sub-env of the last result, with ``actions`` in that result's order."""
        actions = np.asarray(actions)
        if actions.shape[0] != len(self._last):
            raise ValueError(f"{actions.shape[0]} actions for {len(self._last)} sub-envs")
        for j, a in zip(self._last.tolist(), actions, strict=True):
            if self._ended[j] and self.autoreset_mode is AutoresetMode.NEXT_STEP:
                self._under_way[j] = ("reset", None)
            else:
                self._under_way[j] = ("step", a)

    def recv(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, dict[str, Any]]:
        """Finish ``batch_size`` of the steps or resets under way, picked at random:
        ``(obs, reward, terminated, truncated, info)``, the sub-envs in
        ``info["env_id"]``."""
        if len(self._under_way) < self.batch_size:
            raise RuntimeError(
                f"recv with {len(self._under_way)} sub-envs under way, fewer than batch_size"
            )
        ids = self._rng.choice(sorted(self._under_way), self.batch_size, replace=False)
        b = self.batch_size
        obs = np.zeros((b, 4), np.int64)
        final = np.zeros((b, 4), np.int64)
        reward = np.zeros(b, np.float64)
        term = np.zeros(b, bool)
        trunc = np.zeros(b, bool)
        for c, j in enumerate(ids.tolist()):
            op, arg = self._under_way.pop(j)
            env = self.envs[j]
            if op == "reset":
                obs[c], _ = env.reset(seed=arg)
                self._ended[j] = False
                continue
            obs[c], reward[c], term[c], trunc[c], _ = env.step(int(arg))
            self._ended[j] = term[c] or trunc[c]
            if self._ended[j] and self.autoreset_mode is AutoresetMode.SAME_STEP:
                final[c] = obs[c]
                obs[c], _ = env.reset()
                self._ended[j] = False
        info: dict[str, Any] = {"env_id": ids.astype(np.int32)}
        if self.autoreset_mode is AutoresetMode.SAME_STEP and (term | trunc).any():
            info["final_obs"] = final
        self._last = ids
        return obs, reward, term, trunc, info

    def step(
        self, actions: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, dict[str, Any]]:
        self.send(actions)
        return self.recv()


# ---------------------------------------------------------------------------- the suite

_ACTIONS = 5
_NEXT_STEP = AutoresetMode.NEXT_STEP
_DEADLINE = 10.0  # seconds any single step of a check may take before it counts as a hang


def counting_layout(
    *,
    num_workers: int,
    envs_per_worker: int,
    chunk_steps: int,
    slots: int,
    groups: int = 1,
    vector_batch: int = 0,
) -> RingLayout:
    """A ring for CountingEnv workers (observation, action and the bookkeeping fields).

    ``groups`` requests per worker; ``vector_batch > 0``: staged requests of that many
    rows, for workers of ``groups`` CountingVectorEnvs (see :func:`counting_programs`).

    Args:
        num_workers: workers.
        envs_per_worker: env columns per worker (sub-envs counted one by one).
        chunk_steps: steps of each env per chunk.
        slots: chunk slots per worker.
        groups: requests a worker may hold at once.
        vector_batch: rows of a staged request; 0 for in-place requests.

    Returns:
        The :class:`~rlcollect.transports.layout.RingLayout`.

    Raises:
        ValueError: sizes that do not fit together (see ``RingLayout``).

    Examples:
        >>> from rlcollect.testing import counting_layout
        >>> layout = counting_layout(num_workers=2, envs_per_worker=3, chunk_steps=4, slots=2)
        >>> layout.positions, layout.request_columns
        (8, 3)
        >>> [f.key for f in layout.fields][:3]
        [('observation',), ('next', 'observation'), ('action',)]
    """
    obs = Field(("observation",), (4,), np.dtype(np.int64))
    action = Field(("action",), (), np.dtype(np.int64))
    fields = transition_fields((obs,), action)
    staging = None
    if vector_batch:
        staging = Staging(keys=(obs.key, action.key, ("policy_version",)), columns=vector_batch)
    return RingLayout(
        fields=fields,
        num_workers=num_workers,
        envs_per_worker=envs_per_worker,
        chunk_steps=chunk_steps,
        slots=slots,
        groups=groups,
        staging=staging,
    )


def counting_programs(
    layout: RingLayout, *, fail: dict[int, tuple[int, int]] | None = None
) -> list[Any]:
    """Worker programs for ``layout``; ``fail`` maps env index to CountingEnv's ``fail_at``.

    A staged layout gets ``groups`` CountingVectorEnvs per worker, each of
    ``envs_per_worker // groups`` sub-envs returning ``request_columns`` at a time;
    otherwise each worker steps ``envs_per_worker`` CountingEnvs.

    Args:
        layout: a ring from :func:`counting_layout`.
        fail: env index -> ``(episode, step)`` at which that env raises.

    Returns:
        One worker program per worker, ready for ``Transport.start``.

    Examples:
        >>> from rlcollect.testing import counting_layout, counting_programs
        >>> from rlcollect.transports import ThreadQueueTransport
        >>> layout = counting_layout(num_workers=2, envs_per_worker=1, chunk_steps=2, slots=2)
        >>> programs = counting_programs(layout, fail={1: (0, 1)})
        >>> len(programs)
        2
        >>> transport = ThreadQueueTransport()
        >>> end = transport.start(layout, programs)
        >>> transport.close()
    """
    fail = fail or {}
    programs = []
    k = layout.envs_per_worker
    space = gym.spaces.Box(0, 1 << 40, shape=(4,), dtype=np.int64)
    actions = gym.spaces.Discrete(_ACTIONS)
    for w in range(layout.num_workers):
        fns: tuple[Callable[[], Any], ...]
        if layout.staging is not None:
            n = k // layout.groups
            b = layout.request_columns
            fns = tuple(
                functools.partial(CountingVectorEnv, w * k + g * n, n, b, order_seed=w * 7 + g)
                for g in range(layout.groups)
            )
            source = Source(space, actions, sub_envs=n, batch_size=b, autoreset=_NEXT_STEP)
        else:
            fns = tuple(
                functools.partial(
                    CountingEnv, w * k + j, num_actions=_ACTIONS, fail_at=fail.get(w * k + j)
                )
                for j in range(k)
            )
            source = Source(space, actions)
        spec = WorkerSpec(
            env_fns=fns,
            env_offset=w * k,
            seed=0,
            chunk_steps=layout.chunk_steps,
            slots=layout.slots,
            source=source,
            observation_paths=((),),
            discrete_actions=True,
            groups=layout.groups,
        )
        programs.append(functools.partial(run_worker, spec=spec))
    return programs


class _Responder:
    """A numpy stand-in for the inference server, in a thread."""

    def __init__(self, end: ServerEnd, layout: RingLayout) -> None:
        self.end = end
        self.layout = layout
        self.served = 0
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        views = self.end.buffers
        obs = self.layout.request_sources(views, ("observation",))
        action = self.layout.request_sources(views, ("action",))
        try:
            while not self._stop.is_set():
                requests = self.end.wait_requests(0.05)
                if requests:
                    ws, qs = np.array(requests, dtype=np.intp).T
                    rows = request_rows(self.layout, views, ws, qs)
                    action[rows] = counting_actions(obs[rows], _ACTIONS)
                self.end.respond([w for w, _ in requests])
                self.served += len(requests)
        except ChannelClosed:
            pass
        except BaseException as exc:
            self.error = exc

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(_DEADLINE)
        assert not self._thread.is_alive(), "wait_requests ignored its timeout"
        if self.error is not None:
            raise AssertionError(f"the server end failed: {self.error!r}") from self.error


_Chunk = tuple[int, int, dict[str, np.ndarray]]


def _collect(end: ServerEnd, layout: RingLayout, want: int, release: bool = True) -> list[_Chunk]:
    """Take ``want`` chunks (copies of their rows), releasing each unless told not to."""
    out: list[_Chunk] = []
    deadline = time.monotonic() + _DEADLINE
    while len(out) < want:
        assert time.monotonic() < deadline, f"only {len(out)} of {want} chunks arrived in time"
        for w, s in end.wait_chunks(0.1):
            out.append((w, s, _chunk_rows(end, layout, w, s)))
            if release:
                end.release(w, s)
    return out


def _chunk_rows(end: ServerEnd, layout: RingLayout, w: int, s: int) -> dict[str, np.ndarray]:
    sl = slice(s * layout.chunk_steps, (s + 1) * layout.chunk_steps)
    return {
        "/".join(f.key): np.array(end.buffers[f.key][w, sl]).reshape(-1, *f.shape)
        for f in layout.fields
    }


def _round_trip(make_transport: Callable[[], Transport], layout: RingLayout, want: int) -> None:
    """Chunks arrive in slot order per worker; every env's stream is whole and routed."""
    transport = make_transport()
    end = transport.start(layout, counting_programs(layout))
    responder = _Responder(end, layout)
    try:
        chunks = _collect(end, layout, want=want)
    finally:
        transport.close()
        responder.stop()
    next_slot = [0] * layout.num_workers
    streams: dict[int, list[np.ndarray]] = {}
    for w, s, rows in chunks:
        assert s == next_slot[w], f"worker {w} handed over slot {s}, expected {next_slot[w]}"
        next_slot[w] = (s + 1) % layout.slots
        obs, nxt = rows["observation"], rows["next/observation"]
        assert (obs[:, ENV_ID] // layout.envs_per_worker == w).all(), "rows from another worker"
        assert (rows["env_index"] == obs[:, ENV_ID]).all(), "env_index does not match the env"
        assert (rows["action"] == counting_actions(obs, _ACTIONS)).all(), "action misrouted"
        assert (nxt[:, LAST_ACTION] == rows["action"]).all(), "env received another action"
        for i in np.unique(obs[:, ENV_ID]):
            streams.setdefault(int(i), []).append(obs[obs[:, ENV_ID] == i])
    for i, parts in streams.items():
        seq = np.concatenate(parts)
        assert seq[0, EPISODE] == 0 and seq[0, STEP] == 0, f"env {i} starts at {seq[0].tolist()}"
        for a, b in itertools.pairwise(seq):
            same = a[EPISODE] == b[EPISODE] and b[STEP] == a[STEP] + 1
            new = b[EPISODE] == a[EPISODE] + 1 and b[STEP] == 0
            assert same or new, f"env {i} stream jumps from {a.tolist()} to {b.tolist()}"


def _check_round_trip(make_transport: Callable[[], Transport]) -> None:
    """One request per worker at a time: streams whole, actions routed, slots in order."""
    layout = counting_layout(num_workers=3, envs_per_worker=2, chunk_steps=4, slots=2)
    _round_trip(make_transport, layout, want=30)


def _check_double_buffered_round_trip(make_transport: Callable[[], Transport]) -> None:
    """Two requests per worker outstanding (two groups of envs): the same guarantees.

    The transport must deliver a worker's requests in the order it made them and one
    response per request.
    """
    layout = counting_layout(num_workers=2, envs_per_worker=4, chunk_steps=3, slots=2, groups=2)
    _round_trip(make_transport, layout, want=30)


def _check_staged_round_trip(make_transport: Callable[[], Transport]) -> None:
    """Vector envs returning arbitrary subsets of sub-envs (staged requests, two vector
    envs per worker): every env's stream is still whole, in order and routed."""
    layout = counting_layout(
        num_workers=2, envs_per_worker=8, chunk_steps=3, slots=2, groups=2, vector_batch=2
    )
    _round_trip(make_transport, layout, want=30)


def _check_backpressure(make_transport: Callable[[], Transport]) -> None:
    """A worker stops after filling every slot, and resumes once per released slot."""
    layout = counting_layout(num_workers=2, envs_per_worker=1, chunk_steps=3, slots=2)
    transport = make_transport()
    end = transport.start(layout, counting_programs(layout))
    responder = _Responder(end, layout)
    try:
        held = _collect(end, layout, want=4, release=False)
        assert sorted(w for w, _, _ in held) == [0, 0, 1, 1]
        extra = end.wait_chunks(0.5)
        assert extra == [], f"chunks {extra} arrived while every slot was held"
        end.release(0, 0)
        more = _collect(end, layout, want=1, release=False)
        assert more[0][:2] == (0, 0), f"after releasing (0, 0) got chunk {more[0][:2]}"
    finally:
        transport.close()
        responder.stop()


def _check_worker_error(make_transport: Callable[[], Transport]) -> None:
    """An env raising reaches wait_chunks as a WorkerError naming the env."""
    layout = counting_layout(num_workers=2, envs_per_worker=2, chunk_steps=2, slots=2)
    transport = make_transport()
    end = transport.start(layout, counting_programs(layout, fail={3: (1, 2)}))
    responder = _Responder(end, layout)
    deadline = time.monotonic() + _DEADLINE
    try:
        while True:
            assert time.monotonic() < deadline, "the env's exception never reached the driver"
            try:
                for w, s in end.wait_chunks(0.1):
                    end.release(w, s)
            except WorkerError as err:
                assert err.env_index == 3 and err.worker_index == 1, str(err)
                assert "failed on purpose in step" in str(err), str(err)
                assert "Traceback" in str(err.__cause__), "the remote traceback is missing"
                break
    finally:
        transport.close()
        responder.stop()


def _check_abort(make_transport: Callable[[], Transport]) -> None:
    """abort() ends both driver waits promptly, and close() twice is harmless."""
    layout = counting_layout(num_workers=2, envs_per_worker=1, chunk_steps=2, slots=2)
    transport = make_transport()
    end = transport.start(layout, counting_programs(layout))
    try:
        assert end.wait_chunks(0.05) == [], "a chunk arrived with no server answering"
        end.abort()
        for wait in (end.wait_requests, end.wait_chunks):
            t0 = time.monotonic()
            try:
                wait(_DEADLINE)
            except ChannelClosed:
                pass
            else:
                raise AssertionError(f"{wait.__name__} returned after abort()")
            assert time.monotonic() - t0 < _DEADLINE / 2, f"{wait.__name__} waited out its timeout"
    finally:
        transport.close()
        transport.close()


def _check_close_unblocks_workers(make_transport: Callable[[], Transport]) -> None:
    """close() ends workers blocked on a response and on a full ring, and returns."""
    layout = counting_layout(num_workers=2, envs_per_worker=1, chunk_steps=1, slots=1)
    transport = make_transport()
    end = transport.start(layout, counting_programs(layout))
    # Worker 0 ends up waiting for a free slot; worker 1 waits for a response.
    deadline = time.monotonic() + _DEADLINE
    got: list[tuple[int, int]] = []
    while not got:
        assert time.monotonic() < deadline, "no request arrived"
        for w, p in end.wait_requests(0.1):
            if w == 0:
                end.buffers[("action",)][w, p] = 0
                end.respond([w])
        got = end.wait_chunks(0.05)
    closer = threading.Thread(target=transport.close, daemon=True)
    closer.start()
    closer.join(_DEADLINE)  # a transport whose close() hangs fails here, not forever
    assert not closer.is_alive(), f"close() did not return within {_DEADLINE} s"


def _check_restart(make_transport: Callable[[], Transport]) -> None:
    """Every chunk a failing worker handed over comes before its failure; restarted with
    ``restart_worker``, it runs on with its slots free, its failure no longer raised,
    and takes only the answers to its own requests. (Transports without
    ``supports_restart`` pass trivially.)"""
    if not make_transport().supports_restart:
        return
    # Two groups: when env 3 fails, the other group's request is outstanding, and its
    # answer must not reach the new worker. Env 3 fails in its 7th step (episode 0 lasts
    # 4), the first of the 4th chunk: the worker has handed over 3 chunks by then.
    layout = counting_layout(num_workers=2, envs_per_worker=2, chunk_steps=2, slots=2, groups=2)
    transport = make_transport()
    end = transport.start(layout, counting_programs(layout, fail={3: (1, 2)}))
    responder = _Responder(end, layout)
    before: list[np.ndarray] = []  # env 3's observations handed over before it failed
    after: list[_Chunk] = []
    deadline = time.monotonic() + _DEADLINE
    try:
        restarted = False
        while len([c for c in after if c[0] == 1]) < 6:
            assert time.monotonic() < deadline, "the restarted worker handed over too little"
            try:
                ready = end.wait_chunks(0.1)
            except WorkerError as err:
                assert not restarted, f"a second failure after the restart: {err}"
                assert err.worker_index == 1, str(err)
                transport.restart_worker(1, counting_programs(layout)[1])
                restarted = True
                continue
            for w, s in ready:
                rows = _chunk_rows(end, layout, w, s)
                if restarted:
                    after.append((w, s, rows))
                elif w == 1:
                    obs = rows["observation"]
                    before.append(obs[obs[:, ENV_ID] == 3])
                end.release(w, s)  # every chunk comes before the failure, or after the restart
        last = np.concatenate(before)[-1] if before else None
        assert last is not None and (last[EPISODE], last[STEP]) == (1, 1), (
            f"env 3's last transition before the failure was {last}, not (episode 1, step 1): "
            "a chunk handed over before the failure was not returned before it"
        )
        new = [c for c in after if c[0] == 1]
        assert [s for _, s, _ in new] == [i % layout.slots for i in range(len(new))], (
            "the restarted worker did not start with every slot free"
        )
        obs = np.concatenate([rows["observation"] for _, _, rows in new])
        action = np.concatenate([rows["action"] for _, _, rows in new])
        assert (action == counting_actions(obs, _ACTIONS)).all(), "a stale answer was taken"
        for i in (2, 3):
            seq = obs[obs[:, ENV_ID] == i]
            assert seq[0, EPISODE] == 0 and seq[0, STEP] == 0, f"env {i} did not start anew"
            for a, b in itertools.pairwise(seq):
                same = a[EPISODE] == b[EPISODE] and b[STEP] == a[STEP] + 1
                assert same or (b[EPISODE] == a[EPISODE] + 1 and b[STEP] == 0), (
                    f"env {i} stream jumps from {a.tolist()} to {b.tolist()} after the restart"
                )
    finally:
        transport.close()
        responder.stop()


CHECKS: dict[str, Callable[[Callable[[], Transport]], None]] = {
    "round_trip": _check_round_trip,
    "double_buffered_round_trip": _check_double_buffered_round_trip,
    "staged_round_trip": _check_staged_round_trip,
    "backpressure": _check_backpressure,
    "worker_error": _check_worker_error,
    "abort": _check_abort,
    "close_unblocks_workers": _check_close_unblocks_workers,
    "restart": _check_restart,
}
"""The conformance checks by name, in the order :func:`check_transport` runs them; run
one alone as ``CHECKS[name](make_transport)`` (each raises ``AssertionError`` saying
what went wrong). What each one checks:

* ``round_trip``: one request per worker at a time; every env's stream arrives whole
  and in order, each action reaches the env whose observation it was computed from,
  and each worker hands its slots over in order.
* ``double_buffered_round_trip``: the same with two requests per worker outstanding
  (two groups of envs): a worker's requests reach the server in the order it made
  them, one response each.
* ``staged_round_trip``: the same with vector envs that return arbitrary subsets of
  their sub-envs (staged requests).
* ``backpressure``: a worker stops once every slot of its ring is full, and goes on
  by one chunk per released slot.
* ``worker_error``: an env that raises reaches ``wait_chunks`` as a
  :class:`~rlcollect.errors.WorkerError` naming the env, the remote traceback as its
  cause.
* ``abort``: ``abort()`` ends both driver waits promptly; ``close()`` twice is harmless.
* ``close_unblocks_workers``: ``close()`` ends workers blocked on a response or on a
  full ring, and returns.
* ``restart``: (transports with ``supports_restart`` only) every chunk a failing
  worker handed over comes before its failure; after ``restart_worker`` the new worker
  starts with every slot free and takes only the answers to its own requests.
"""


def check_transport(make_transport: Callable[[], Transport]) -> None:
    """Run every check of the conformance suite on transports from ``make_transport``.

    The checks (:data:`CHECKS`, in order) start a fresh transport each, drive it with
    real worker loops over CountingEnvs and a numpy stand-in for the inference server,
    and check routing, stream order, backpressure, error reporting, ``abort`` and
    ``close``. A check that would hang fails after a 10-second deadline instead.

    Args:
        make_transport: builds a new, unstarted transport (a class works).

    Raises:
        AssertionError: a check failed; the message names it and what went wrong.

    Examples:
        >>> from rlcollect.testing import CHECKS, check_transport
        >>> from rlcollect.transports import ThreadQueueTransport
        >>> list(CHECKS)[:3]
        ['round_trip', 'double_buffered_round_trip', 'staged_round_trip']
        >>> check_transport(ThreadQueueTransport)
    """
    for name, check in CHECKS.items():
        try:
            check(make_transport)
        except AssertionError as exc:
            raise AssertionError(f"transport check {name!r} failed: {exc}") from exc
