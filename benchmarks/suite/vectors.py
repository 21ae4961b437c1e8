"""Native vector envs against their own speed: ale-py's ``AtariVectorEnv`` Pong.

A run's ``layout`` is ``[vector_envs, envs, batch, threads]``: ``vector_envs`` vector envs
of ``envs`` sub-envs each, ``batch`` of them per ``recv`` (first-k-of-N asynchrony; equal
to ``envs``: stepped whole) and ``threads`` C++ stepping threads each. The game and
observation are the peers series' ``atari_vector_loop``'s (4x105x80 grayscale, frame
skip 4, no sticky actions, no no-op starts), so the same acting policy serves them.

* ``run_env_only``: one vector env in this process, ``send``/``recv`` with random
  actions, no policy: the ceiling of the layout.
* ``run_rlcollect``: ``AsyncBatchedCollector`` over the layout's vector envs, one per
  worker, workers as threads or processes (``transport``).

The hand-written loop over the same vector env is ``peers.run_atari_vector``.
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


class _Factory:
    """A picklable ``pong_vector`` call (worker processes are spawned)."""

    def __init__(self, envs: int, batch: int, threads: int) -> None:
        self.args = (envs, batch, threads)

    def __call__(self) -> gym.vector.VectorEnv:
        return pong_vector(*self.args)


def run_env_only(config: dict[str, Any]) -> dict[str, Any]:
    vector_envs, envs, batch, threads = config["layout"]
    if vector_envs != 1:
        raise ValueError(f"env_only steps one vector env, got layout {config['layout']}")

    def steps() -> Iterator[int]:
        env = pong_vector(envs, batch, threads)
        try:
            env.reset(seed=0)
            rng = np.random.default_rng(0)
            n = int(env.single_action_space.n)
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
            [_Factory(envs, batch, threads)] * vector_envs,
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
