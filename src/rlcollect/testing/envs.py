"""Envs that tell on themselves: CountingEnv, CountingVectorEnv and their policy.

:class:`CountingEnv` writes its id, episode and step (and the last action it received)
into its observation, so a test can check routing, order, gaps and episode ends row by
row. :class:`CountingVectorEnv` is a vector env of CountingEnvs driven with
``send``/``recv`` that returns an arbitrary (seeded) subset of its sub-envs each time,
as native asynchronous vector envs do. :func:`counting_actions` is the policy the tests
answer them with.

This module imports no torch: ``CountingEnv`` runs inside worker processes.
"""

from __future__ import annotations

from typing import Any, ClassVar

import gymnasium as gym
import numpy as np
from gymnasium.vector import AutoresetMode, VectorEnv
from gymnasium.vector.utils import batch_space

__all__ = [
    "CountingEnv",
    "CountingVectorEnv",
    "counting_actions",
    "counting_info",
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


def counting_info(env_id: int, episode: int, step: int) -> dict[str, Any]:
    """A CountingEnv's ``info`` after the step that reached ``step`` (``with_info=True``):
    ``lives`` (int, 3 down to 1, then again), ``progress`` (float, the share of the
    episode done) and ``name`` (a string, never a number).

    Args:
        env_id: the CountingEnv's id.
        episode: its episode.
        step: the step reached (the observation's step after it).

    Returns:
        The info dict.

    Examples:
        >>> from rlcollect.testing import counting_info
        >>> counting_info(0, 0, 3)  # episode 0 of env 0 lasts 3 steps
        {'lives': 3, 'progress': 1.0, 'name': 'counting'}
    """
    return {
        "lives": 3 - step % 3,
        "progress": step / episode_length(env_id, episode),
        "name": "counting",
    }


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
    when ``e`` is even, truncated when odd. The reward of a step is ``step + 1``, so the
    return of an episode after ``s`` steps is ``s * (s + 1) / 2``.
    ``fail_at`` ``(episode, step)`` makes ``step`` raise there; ``fail_in_reset`` makes
    the reset that would start that episode raise instead. ``with_info`` fills each
    step's ``info`` from the step reached (:func:`counting_info`).

    Args:
        env_id: the id written into every observation.
        num_actions: size of the Discrete action space.
        fail_at: ``(episode, step)`` at which to raise ``RuntimeError``, or None.
        fail_in_reset: raise in the reset that starts episode ``fail_at[0]`` instead.
        with_info: return :func:`counting_info` of each step as its ``info``.

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
        with_info: bool = False,
    ) -> None:
        self.env_id = env_id
        self.with_info = with_info
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
        info = counting_info(self.env_id, self.episode, self.t) if self.with_info else {}
        return self._obs(), reward, terminated, truncated, info


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
