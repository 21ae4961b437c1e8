"""The DQN training loop two ways: a blocking ``step()`` loop, and the same loop fed by rlcollect.

Both act with the same epsilon-greedy Nature CNN, write every transition to the same
``rlcollect.ReplayBuffer`` on the policy's device, and run one DQN update on a batch of
32 sampled from it every 4 steps (a step being one transition per env: ``num_envs``
frames), so both do the same learning per frame.

* ``run_blocking``: ``gymnasium.vector.AsyncVectorEnv`` (one process per env,
  same-step autoreset): act on every env's observation, ``step()`` and wait for all
  envs, write the step to the buffer, train every 4th step. Envs idle while the policy
  and the learner run, and the learner waits for the slowest env.
* ``run_rlcollect``: ``AsyncBatchedCollector`` with ``frames_per_batch=num_envs`` and
  the buffer as its ``replay_buffer``; every 4th batch one update, then the new weights
  go to the collector. Envs keep stepping while the learner trains, each up to two
  chunks ahead: ``transition_chunk_size=CHUNK`` (the "auto" chunk would be one step
  here, ``frames_per_batch // num_envs``, which lets an env run only two steps ahead).

Throughput is env frames per second including the learning. On a CPU both loops train
and act with one intra-op thread, so the learner and the envs share the cores
predictably.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import gymnasium as gym
import numpy as np
import torch
from tensordict import TensorDict

from benchmarks.common import make_pong
from benchmarks.suite.dqn import Learner
from benchmarks.suite.measure import measure
from rlcollect import AsyncBatchedCollector, ReplayBuffer

TRAIN_EVERY = 4
BATCH = 32
# Steps per env and message. The ring holds 2 chunks per env, observation and next
# observation (2 x 33.6 kB) per step: at 256 envs, 138 MB of shared memory, as much as
# the 32-env runs with 32-step chunks of the earlier device benchmarks used.
CHUNK = 4


def _threads(config: dict[str, Any]) -> None:
    if config["device"] == "cpu":
        torch.set_num_threads(1)


def _measured(steps: Iterator[int], config: dict[str, Any]) -> dict[str, Any]:
    try:
        return measure(steps, config["warmup_s"], config["measure_s"])
    finally:
        steps.close()


def run_blocking(config: dict[str, Any]) -> dict[str, Any]:
    _threads(config)
    n, device = config["num_envs"], torch.device(config["device"])

    def steps() -> Iterator[int]:
        envs = gym.vector.AsyncVectorEnv(
            [make_pong] * n,
            autoreset_mode=gym.vector.AutoresetMode.SAME_STEP,
            context="forkserver",  # the env processes never inherit CUDA state
        )
        try:
            learner = Learner(config["device"])
            rb = ReplayBuffer(config["capacity"], device=device, seed=0)
            obs_np, _ = envs.reset(seed=0)
            obs = torch.from_numpy(obs_np).to(device)
            step = 0
            while True:
                with torch.no_grad():
                    action = learner.online(obs)
                next_np, reward, terminated, truncated, info = envs.step(action.cpu().numpy())
                next_obs = torch.from_numpy(next_np).to(device)
                stored_next = next_obs
                done = terminated | truncated
                if done.any():  # same-step autoreset: the true last frame is in info
                    stored_next = next_obs.clone()
                    ended = np.flatnonzero(done)
                    final = np.stack([info["final_obs"][i] for i in ended])
                    stored_next[torch.from_numpy(ended)] = torch.from_numpy(final).to(device)
                rb.extend(
                    TensorDict(
                        {
                            "observation": obs,
                            "action": action,
                            "next": {
                                "observation": stored_next,
                                "reward": torch.from_numpy(reward.astype(np.float32)),
                                "terminated": torch.from_numpy(terminated),
                                "truncated": torch.from_numpy(truncated),
                                "done": torch.from_numpy(done),
                            },
                        },
                        batch_size=[n],
                        device=device,
                    )
                )
                obs = next_obs
                step += 1
                if step % TRAIN_EVERY == 0 and len(rb) >= config["learning_starts"]:
                    learner.update(rb.sample(BATCH))
                yield n
        finally:
            envs.close()

    return _measured(steps(), config)


def run_rlcollect(config: dict[str, Any]) -> dict[str, Any]:
    _threads(config)
    n, device = config["num_envs"], config["device"]
    held: dict[str, Any] = {}

    def steps() -> Iterator[int]:
        learner = Learner(device)
        rb = ReplayBuffer(config["capacity"], device=device, seed=0)
        with AsyncBatchedCollector(
            [make_pong] * n,
            learner.online,
            frames_per_batch=n,
            total_frames=-1,
            transport="process_slots",
            transition_chunk_size=CHUNK,
            policy_device=device,
            cuda_graph=config["graph"],
            replay_buffer=rb,
            seed=0,
        ) as collector:
            held["collector"] = collector
            for i, batch in enumerate(collector, start=1):
                if i % TRAIN_EVERY == 0 and len(rb) >= config["learning_starts"]:
                    learner.update(rb.sample(BATCH))
                    collector.update_policy_weights_(learner.online)
                yield batch.numel()

    it = steps()
    try:
        result = measure(it, config["warmup_s"], config["measure_s"])
        server = held["collector"].stats().get("server", {})
        result["mean_batch_size"] = server.get("mean_batch_size")
    finally:
        it.close()
    return result
