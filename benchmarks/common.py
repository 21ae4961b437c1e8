"""Envs and policies the benchmarks share; imports no torch (env factories run in workers)."""

from __future__ import annotations

import gymnasium as gym
import numpy as np


class HalfResolution(gym.ObservationWrapper):
    """Keep every second row and column: 210x160 → 105x80, no image library needed."""

    def __init__(self, env: gym.Env) -> None:
        super().__init__(env)
        h, w = env.observation_space.shape
        self.observation_space = gym.spaces.Box(0, 255, (h // 2, w // 2), np.uint8)

    def observation(self, observation: np.ndarray) -> np.ndarray:
        return observation[::2, ::2]


def make_pong() -> gym.Env:
    """Pong, grayscale, every second pixel, 4 stacked frames: 4x105x80 uint8."""
    import ale_py

    gym.register_envs(ale_py)
    env = gym.make("ALE/Pong-v5", obs_type="grayscale", repeat_action_probability=0.0)
    return gym.wrappers.FrameStackObservation(HalfResolution(env), 4)


def make_cartpole() -> gym.Env:
    return gym.make("CartPole-v1")


ENVS = {"cartpole": make_cartpole, "pong": make_pong}


def make_atari_vector(num_envs: int, batch_size: int, num_threads: int) -> gym.vector.VectorEnv:
    """ale-py's AtariVectorEnv: Pong, 84x84 grayscale, 4 stacked frames, frameskip 4;
    driven with send/recv when ``batch_size < num_envs``."""
    from ale_py.vector_env import AtariVectorEnv

    return AtariVectorEnv(
        "pong", num_envs, batch_size=batch_size, num_threads=num_threads, stack_num=4
    )
