"""Background collection while a learner trains, throttled to a train ratio.

The analogue of asynchronous DreamerV3-style training: ``num_envs`` Pong envs collect in
the background (``collector.start()``) into an ``rlcollect.ReplayBuffer`` on the
policy's device, the policy is served one request at a time (``max_batch_size=1``), and
this process runs DQN updates on batches of 32 sampled from the buffer. With
``train_ratio`` r the collector lets at most one batch run ahead of the learner, so
the learner samples r rows per row collected: collection runs at the learner's pace
(updates/s x 32 / r frames/s) unless the envs are slower. New weights go to the
collector every ``push_every`` updates.

One yield per learner update, carrying the frames collected since the previous one,
so :func:`~benchmarks.suite.measure.measure` reports env frames/s and its
``steps_per_second`` is learner updates/s.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from benchmarks.common import make_pong
from benchmarks.suite.dqn import Learner
from benchmarks.suite.measure import measure
from rlcollect import AsyncBatchedCollector, ReplayBuffer

BATCH = 32


def run(config: dict[str, Any]) -> dict[str, Any]:
    device = config["device"]
    if device == "cpu":
        torch.set_num_threads(1)  # the learner's share of a small machine
    held: dict[str, Any] = {}

    def updates() -> Iterator[int]:
        learner = Learner(device)
        rb = ReplayBuffer(config["capacity"], device=device, seed=0)
        with AsyncBatchedCollector(
            [make_pong] * config["num_envs"],
            learner.online,
            frames_per_batch=config["frames_per_batch"],
            total_frames=-1,
            transport="process_slots",
            max_batch_size=1,
            policy_device=device,
            cuda_graph=config["graph"],
            replay_buffer=rb,
            train_ratio=config["train_ratio"],
            learning_starts=config["learning_starts"],
            seed=0,
        ) as collector:
            held["collector"], held["rb"] = collector, rb
            collector.start()
            while len(rb) < config["learning_starts"]:
                if collector.join(timeout=0.01):  # raises the background error, if any
                    raise RuntimeError("collection ended before learning_starts")
            written = rb.written
            while True:
                learner.update(rb.sample(BATCH))
                if learner.updates % config["push_every"] == 0:
                    collector.update_policy_weights_(learner.online)
                    collector.join(timeout=0)  # surfaces a background error promptly
                now = rb.written
                yield now - written
                written = now

    it = updates()
    try:
        result = measure(it, config["warmup_s"], config["measure_s"])
        stats = held["collector"].stats()
    finally:
        it.close()
    result["updates_per_second"] = result.pop("steps_per_second")
    result["train_ratio_achieved"] = stats.get("train_ratio")
    result["throttle_wait_seconds"] = stats.get("throttle_wait_seconds")
    result["mean_batch_size"] = stats.get("server", {}).get("mean_batch_size")
    return result
