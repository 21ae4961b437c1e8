"""Hand-written peer loops on the same pixel task: what a user writes without a collector.

* ``run_async_vector``: ``gymnasium.vector.AsyncVectorEnv`` over the same Pong envs
  (one process each, same-step autoreset, so every step is a transition) and the same
  policy, stepped in lockstep: act on all observations, step all envs, repeat.
* ``run_atari_vector``: ale-py's native ``AtariVectorEnv`` (C++ threads in this
  process) driven asynchronously with ``send``/``recv`` and ``batch_size = num_envs /
  2``: the policy acts on whichever half of the envs is ready while the other half
  steps. Its Pong is the same game and observation shape (4x105x80 grayscale, frame
  skip 4, no sticky actions, no no-op starts) but preprocessed in C++ (area resize and
  max-pooling of the last two frames) instead of by the Python wrappers.
* ``run_envpool``: EnvPool's own asynchronous loop over its pool of the same Pong
  (``vectors.pong_pool``): ``recv`` the first ``batch`` sub-envs to finish, act on
  them, ``send`` the actions to those sub-envs (``info["env_id"]``), as EnvPool's
  documentation and CleanRL's EnvPool examples drive it. The vector series only.

Both use :class:`benchmarks.suite.acting.FixedBatchStep`: eager on the CPU (one intra-op
thread, these loops' faster setting on few cores), a CUDA graph on a GPU.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import gymnasium as gym
import torch

from benchmarks.common import make_pong
from benchmarks.suite.acting import FixedBatchStep, acting_policy
from benchmarks.suite.measure import measure
from benchmarks.suite.vectors import pong_pool, pong_vector


def _threads(config: dict[str, Any]) -> None:
    if config["device"] == "cpu":
        torch.set_num_threads(1)


def run_async_vector(config: dict[str, Any]) -> dict[str, Any]:
    _threads(config)
    n = config["num_envs"]

    def steps() -> Iterator[int]:
        # forkserver: the env processes never inherit this process's CUDA state.
        envs = gym.vector.AsyncVectorEnv(
            [make_pong] * n,
            autoreset_mode=gym.vector.AutoresetMode.SAME_STEP,
            context="forkserver",
        )
        try:
            act = _acting_step(config, n)
            obs, _ = envs.reset(seed=0)
            while True:
                obs, *_ = envs.step(act(obs))
                yield n
        finally:
            envs.close()

    return _measured(steps(), config)


def run_atari_vector(config: dict[str, Any]) -> dict[str, Any]:
    _threads(config)
    # The peers series: half the envs per recv, one C++ stepping thread per core; the
    # vector_throughput series names its layout (vectors.py).
    if "layout" in config:
        _, n, batch, threads = config["layout"]
    else:
        n = config["num_envs"]
        batch, threads = max(1, n // 2), len(os.sched_getaffinity(0))

    def steps() -> Iterator[int]:
        envs = pong_vector(n, batch, threads)
        try:
            act = _acting_step(config, batch)
            obs, _ = envs.reset(seed=0)
            while True:
                envs.send(act(obs))
                obs, *_ = envs.recv()
                yield batch
        finally:
            envs.close()

    return _measured(steps(), config, batch_size=batch, env_threads=threads)


def _acting_step(config: dict[str, Any], batch: int) -> FixedBatchStep:
    """The series' acting policy as a fixed-batch step of ``batch`` rows (a CUDA graph
    where ``config["graph"]``): every loop of this module alike."""
    return FixedBatchStep(
        acting_policy(config["policy"], config["device"]),
        batch,
        config["device"],
        graph=config["graph"],
    )


def run_envpool(config: dict[str, Any]) -> dict[str, Any]:
    _threads(config)
    _, n, batch, threads = config["layout"]

    def steps() -> Iterator[int]:
        envs = pong_pool(n, batch, threads)
        try:
            act = _acting_step(config, batch)
            envs.async_reset()
            while True:
                obs, *_, info = envs.recv()
                envs.send(act(obs), info["env_id"])
                yield batch
        finally:
            envs.close()

    return _measured(steps(), config, batch_size=batch, env_threads=threads)


def _measured(steps: Iterator[int], config: dict[str, Any], **recorded: Any) -> dict[str, Any]:
    """The loop's figures over the config's windows, with ``recorded`` (its layout)."""
    try:
        result = measure(steps, config["warmup_s"], config["measure_s"])
    finally:
        steps.close()
    result.update(recorded)
    return result
