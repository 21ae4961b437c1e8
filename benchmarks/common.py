"""Envs and policies the benchmarks share; imports no torch (env factories run in workers)."""

from __future__ import annotations

import os
import platform
import threading
import time
from importlib import metadata
from typing import Any

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


def make_atari_vector(
    num_envs: int, batch_size: int, num_threads: int, nice: int = 0
) -> gym.vector.VectorEnv:
    """ale-py's AtariVectorEnv: Pong, 84x84 grayscale, 4 stacked frames, frameskip 4;
    driven with send/recv when ``batch_size < num_envs``.

    ``nice`` > 0 (Linux): the env's C++ threads run at that niceness, the caller's thread
    keeps its own. A thread's niceness is its own on Linux and the threads it starts
    inherit it, so the env is built in a short-lived thread that raised its niceness
    first. An experiment for issue 5: do the collector's threads (the worker's loop, the
    server, the consumer) lose time to sixteen busy env threads?"""
    from ale_py.vector_env import AtariVectorEnv

    def build() -> gym.vector.VectorEnv:
        return AtariVectorEnv(
            "pong", num_envs, batch_size=batch_size, num_threads=num_threads, stack_num=4
        )

    if nice == 0:
        return build()
    built: list[gym.vector.VectorEnv] = []
    failed: list[BaseException] = []

    def build_niced() -> None:
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
            built.append(build())
        except BaseException as exc:  # handed to the caller below
            failed.append(exc)

    builder = threading.Thread(target=build_niced, name="env-builder")
    builder.start()
    builder.join(timeout=120)
    if failed:
        raise failed[0]
    if not built:
        raise RuntimeError("building the AtariVectorEnv did not finish within 120 s")
    return built[0]


def step_vector_env_randomly(
    num_envs: int,
    batch_size: int,
    num_threads: int,
    warmup: float,
    seconds: float,
    start: Any,
    steps: Any,
    nice: int = 0,
) -> None:
    """One process of the env-only ceiling: ``send``/``recv`` with random actions.

    Waits at ``start`` (a barrier shared with the other processes, so their timed windows
    overlap), then counts ``recv`` calls over ``seconds`` into ``steps`` (a shared int).
    Imports no torch: the process starts in a moment."""
    env = make_atari_vector(num_envs, batch_size, num_threads, nice)
    try:
        env.reset(seed=0)
        rng = np.random.default_rng(0)
        n = env.single_action_space.n
        t_end = time.perf_counter() + warmup
        while time.perf_counter() < t_end:
            env.send(rng.integers(0, n, batch_size))
            env.recv()
        start.wait(timeout=120)
        calls, t_end = 0, time.perf_counter() + seconds
        while time.perf_counter() < t_end:
            env.send(rng.integers(0, n, batch_size))
            env.recv()
            calls += 1
        steps.value = calls
    finally:
        env.close()


def machine() -> dict[str, Any]:
    """The machine and package versions a standalone benchmark records beside its results
    (imports torch here only: worker processes import this module for its env factories)."""
    import torch

    versions = {}
    for name in ("torch", "numpy", "gymnasium", "ale-py", "tensordict"):
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return {
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "torch_threads": torch.get_num_threads(),
        "versions": versions,
        "load_average": os.getloadavg(),
        "vector_worker_nice": vector_worker_nice(),
    }


def vector_worker_nice() -> int:
    """The niceness the thread of a vector env's worker that runs its own policy takes
    here: ``DRIVER_NICE`` (-10) where allowed, else as low as ``RLIMIT_NICE`` allows, else
    its own. Its throughput depends on it, so results record it."""
    import resource

    from rlcollect.worker.vector_priority import DRIVER_NICE

    own = os.getpriority(os.PRIO_PROCESS, 0)
    if may_lower_niceness(DRIVER_NICE):
        return min(own, DRIVER_NICE)
    limit = getattr(resource, "RLIMIT_NICE", None)
    if limit is None:
        return own  # not Linux: nothing is raised
    soft, _ = resource.getrlimit(limit)
    return min(own, 20 - soft)


def may_lower_niceness(nice: int) -> bool:
    """Whether this process (and the workers it starts) may set a thread's niceness as
    low as ``nice``: an ``RLIMIT_NICE`` of ``20 - nice`` or more, or ``CAP_SYS_NICE``."""
    import resource

    if nice >= os.getpriority(os.PRIO_PROCESS, 0):
        return True  # not lower than this thread's own: anyone may
    limit = getattr(resource, "RLIMIT_NICE", None)
    if limit is None:
        return False  # not Linux: no niceness per thread to raise
    soft, _ = resource.getrlimit(limit)
    if soft == resource.RLIM_INFINITY or soft >= 20 - nice:
        return True
    try:
        with open("/proc/self/status") as f:
            caps = next(line for line in f if line.startswith("CapEff:"))
    except (OSError, StopIteration):
        return False  # not Linux
    return bool(int(caps.split()[1], 16) >> 23 & 1)  # bit 23: CAP_SYS_NICE
