"""Native vector envs against their own speed: ale-py's ``AtariVectorEnv`` Pong, and
EnvPool's.

A run's ``layout`` is ``[vector_envs, envs, batch, threads]``: ``vector_envs`` vector envs
of ``envs`` sub-envs each, ``batch`` of them per ``recv`` (first-k-of-N asynchrony; equal
to ``envs``: stepped whole) and ``threads`` C++ stepping threads each. The game and
observation are the peers series' ``atari_vector_loop``'s (4x105x80 grayscale, frame
skip 4, no sticky actions, no no-op starts), so the same acting policy serves them.
A run's ``env`` (absent: ``"ale"``) names the vector env: ``"ale"`` ale-py's
``AtariVectorEnv`` (:func:`pong_vector`), ``"envpool"`` an EnvPool pool of the same game
and observation (:func:`pong_pool`; EnvPool is optional: ``pip install
rlcollect[envpool]``).

* ``run_env_only``: one vector env in this process, ``send``/``recv`` with random
  actions, no policy: the ceiling of the layout.
* ``run_rlcollect``: ``AsyncBatchedCollector`` over the layout's vector envs, one per
  worker, workers as threads or processes (``transport``).

The hand-written loops over the same vector envs are ``peers.run_atari_vector`` and
``peers.run_envpool`` (EnvPool's own asynchronous loop).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import gymnasium as gym
import numpy as np

from benchmarks.suite.acting import acting_policy
from benchmarks.suite.measure import measure, measure_collector


def pong_vector(envs: int, batch: int, threads: int) -> gym.vector.VectorEnv:
    """``envs`` Pong sub-envs in one ``AtariVectorEnv``, ``batch`` per ``recv``."""
    from ale_py.vector_env import AtariVectorEnv

    return AtariVectorEnv(
        "pong",
        envs,
        batch_size=batch,
        num_threads=threads,
        img_height=105,
        img_width=80,
        stack_num=4,
        frameskip=4,
        repeat_action_probability=0.0,
        noop_max=0,
        reward_clipping=False,
        use_fire_reset=False,
    )


def pong_pool(envs: int, batch: int, threads: int) -> gym.vector.VectorEnv:
    """EnvPool's Pong as :func:`pong_vector` builds it: ``envs`` sub-envs, ``batch`` per
    ``recv``, ``threads`` C++ threads, the same game and observation (``noop_max=1``:
    no no-op starts; EnvPool 1.2.5 crashes with 0). Sub-env ``j`` is seeded ``j``."""
    import envpool

    pool: gym.vector.VectorEnv = envpool.make(
        "Pong-v5",
        env_type="gymnasium",
        num_envs=envs,
        batch_size=batch,
        num_threads=threads,
        img_height=105,
        img_width=80,
        stack_num=4,
        frame_skip=4,
        repeat_action_probability=0.0,
        noop_max=1,
        reward_clip=False,
        episodic_life=False,
        use_fire_reset=False,
        seed=0,
    )
    return pool


SOURCES = {"ale": pong_vector, "envpool": pong_pool}


class _Factory:
    """A picklable ``pong_vector`` or ``pong_pool`` call (worker processes are spawned)."""

    def __init__(self, envs: int, batch: int, threads: int, env: str = "ale") -> None:
        self.args = (envs, batch, threads)
        self.env = env

    def __call__(self) -> gym.vector.VectorEnv:
        return SOURCES[self.env](*self.args)


def run_env_only(config: dict[str, Any]) -> dict[str, Any]:
    vector_envs, envs, batch, threads = config["layout"]
    if vector_envs != 1:
        raise ValueError(f"env_only steps one vector env, got layout {config['layout']}")
    pool = config.get("vector_source", "ale") == "envpool"

    def steps() -> Iterator[int]:
        env = _Factory(envs, batch, threads, config.get("vector_source", "ale"))()
        try:
            rng = np.random.default_rng(0)
            n = int(env.single_action_space.n)
            if pool:  # EnvPool's protocol: send names the sub-envs of the last recv
                env.async_reset()
                while True:
                    *_, info = env.recv()
                    env.send(rng.integers(0, n, batch), info["env_id"])
                    yield batch
            else:
                env.reset(seed=0)
                while True:
                    env.send(rng.integers(0, n, batch))
                    env.recv()
                    yield batch
        finally:
            env.close()

    it = steps()
    try:
        return measure(it, config["warmup_s"], config["measure_s"])
    finally:
        it.close()


def run_rlcollect(config: dict[str, Any]) -> dict[str, Any]:
    from rlcollect import AsyncBatchedCollector

    vector_envs, envs, batch, threads = config["layout"]
    return measure_collector(
        lambda: AsyncBatchedCollector(
            [_Factory(envs, batch, threads, config.get("vector_source", "ale"))] * vector_envs,
            acting_policy(config["policy"]),
            frames_per_batch=config["frames_per_batch"],
            total_frames=-1,
            transport=config["transport"],
            inference_backend=config.get("backend", "thread"),
            policy_device=config["device"],
            cuda_graph=config["graph"],
            seed=0,
        ),
        config["warmup_s"],
        config["measure_s"],
    )
