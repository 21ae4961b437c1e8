"""Pixel envs for the frame_stack tests: every frame tells its env, episode and step, so
the stack a row should hold follows from its ``env_index``, ``episode`` and ``step``.
This module imports no torch: the process transport's workers import it."""

from __future__ import annotations

import functools
import os
from typing import Any

import gymnasium as gym
import numpy as np

FRAME = (3, 4)
PADDINGS = ("reset", "zero")  # gymnasium's FrameStackObservation: first frame, or zeros


def episode_steps(env_id: int, episode: int) -> int:
    """1 to 9 steps: episodes end often, some after one step."""
    return 1 + (env_id * 5 + episode * 3) % 9


def pixel(env_id: int, episode: int, step: int) -> np.ndarray:
    """The frame of ``step`` (0: the reset's) of an env's episode; never all zeros."""
    frame = np.zeros(FRAME, np.uint8)
    frame[0] = [env_id % 255 + 1, env_id // 255, episode % 256, episode // 256]
    frame[1] = [step % 256, step // 256, 0x5A, (env_id * 31 + episode * 7 + step) % 256]
    frame[2] = 255 - frame[0]
    return frame


def padding_of(env_id: int) -> str:
    """The padding ``stacked`` gives env ``env_id`` by default: odd ids pad with zeros."""
    return PADDINGS[env_id % 2]


def expected(env_id: int, episode: int, step: int, k: int, padding: str) -> np.ndarray:
    """The stack ``[k, *FRAME]`` an env gives at ``step`` of ``episode``."""
    frames = []
    for s in range(step - k + 1, step + 1):
        if s >= 0:
            frames.append(pixel(env_id, episode, s))
        elif padding == "zero":
            frames.append(np.zeros(FRAME, np.uint8))
        else:
            frames.append(pixel(env_id, episode, 0))
    return np.stack(frames)


class PixelCounting(gym.Env[np.ndarray, np.int64]):
    """Frames ``[3, 4]`` uint8 of :func:`pixel`; episodes of :func:`episode_steps`,
    terminated when even, truncated when odd. With ``marker`` it raises once (per marker
    file, in whichever process) in step ``at`` = (episode, step) of its own count."""

    metadata: dict[str, Any] = {"render_modes": []}  # noqa: RUF012

    def __init__(self, env_id: int, marker: str | None = None, at: tuple[int, int] = (1, 1)):
        self.env_id, self.marker, self.at = env_id, marker, at
        self.observation_space = gym.spaces.Box(0, 255, FRAME, np.uint8)
        self.action_space = gym.spaces.Discrete(3)
        self.episode, self.t = -1, 0

    def reset(self, *, seed: int | None = None, options: Any = None) -> tuple[np.ndarray, dict]:
        super().reset(seed=seed)
        self.episode, self.t = self.episode + 1, 0
        return pixel(self.env_id, self.episode, 0), {}

    def step(self, action: Any) -> tuple[np.ndarray, float, bool, bool, dict]:
        if self.marker is not None and (self.episode, self.t) == self.at:
            try:
                os.close(os.open(self.marker, os.O_CREAT | os.O_EXCL))
            except FileExistsError:
                pass
            else:
                raise RuntimeError(f"PixelCounting {self.env_id} crashed on purpose")
        self.t += 1
        end = self.t >= episode_steps(self.env_id, self.episode)
        even = self.episode % 2 == 0
        return pixel(self.env_id, self.episode, self.t), 1.0, end and even, end and not even, {}


def stacked(env_id: int, k: int = 4, padding: str | None = None, **kwargs: Any) -> gym.Env:
    """A PixelCounting whose observations are gymnasium's stacks of its last ``k`` frames."""
    padding = padding or padding_of(env_id)
    return gym.wrappers.FrameStackObservation(
        PixelCounting(env_id, **kwargs), k, padding_type=padding
    )


def stacked_vector(first: int, n: int, k: int = 4, mode: str = "NextStep") -> gym.vector.VectorEnv:
    """``stacked`` envs ``first … first + n - 1`` in a gymnasium SyncVectorEnv."""
    fns = [functools.partial(stacked, first + j, k) for j in range(n)]
    return gym.vector.SyncVectorEnv(fns, autoreset_mode=mode)


class LastAxis(gym.ObservationWrapper):
    """Stacks of 4 frames ``[4, 4]`` moved to the last axis: ``[4 (columns), 4 (frames)]``,
    the first axis of the right length but not the stack's."""

    def __init__(self, env: gym.Env) -> None:
        super().__init__(env)
        self.observation_space = gym.spaces.Box(0, 255, (4, 4), np.uint8)

    def observation(self, observation: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(observation[:, 0, :].T)


class Fading(gym.ObservationWrapper):
    """Halves each older frame once more: a wrapper that changes old frames."""

    def observation(self, observation: np.ndarray) -> np.ndarray:
        k = len(observation)
        return np.stack([frame >> (k - 1 - i) for i, frame in enumerate(observation)])


def last_axis(env_id: int) -> gym.Env:
    return LastAxis(stacked(env_id, 4))


def fading(env_id: int) -> gym.Env:
    return Fading(stacked(env_id, 4))
