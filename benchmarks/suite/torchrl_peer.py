"""TorchRL's ``AsyncBatchedCollector`` on the same pixel task, at its documented fast path.

Runs only in a process whose ``PYTHONPATH`` starts with the separate install of
torchrl 0.14 and its tensordict 0.14 (the suite's ``--peers-path``), so rlcollect's own
environment is never touched. The settings are the fast configuration TorchRL's
docstring gives for many process-backed envs: process env workers reaching a dedicated
inference process directly (``transport="auto"`` with a ``policy_factory``), dense
chunks of ``transition_chunk_size`` transitions to the driver, a server batch of up to
every env with a 1 ms timeout, outputs and storage on the CPU. ``graph`` adds TorchRL's
static-batch CUDA graph (``static_batch_size`` = number of envs).
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from benchmarks.common import make_pong
from benchmarks.suite.acting import acting_policy
from benchmarks.suite.measure import measure


class _ActionAndLogProb(nn.Module):
    """The same acting policy; returns a tuple, as ``TensorDictModule`` wants."""

    def __init__(self, policy: str, device: str) -> None:
        super().__init__()
        self.net = acting_policy(policy, device)

    def forward(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.net(obs)
        return out["action"], out["log_prob"]


def make_policy(policy: str, device: str) -> Any:
    from tensordict.nn import TensorDictModule

    return TensorDictModule(
        _ActionAndLogProb(policy, device), in_keys=["observation"], out_keys=["action", "log_prob"]
    )


def make_env() -> Any:
    from torchrl.envs import GymWrapper

    return GymWrapper(make_pong(), categorical_action_encoding=True)


def run_torchrl(config: dict[str, Any]) -> dict[str, Any]:
    from torchrl.collectors import AsyncBatchedCollector
    from torchrl.modules.inference_server import InferenceDeviceConfig, InferenceServerConfig

    n, device = config["num_envs"], config["device"]
    held: dict[str, Any] = {}

    def batches() -> Iterator[int]:
        collector = AsyncBatchedCollector(
            [make_env] * n,
            policy_factory=functools.partial(make_policy, config["policy"], device),
            frames_per_batch=config["frames_per_batch"],
            total_frames=-1,
            env_backend="multiprocessing",
            transport="auto",
            transition_chunk_size=config["chunk"],
            server_config=InferenceServerConfig(
                max_batch_size=n,
                min_batch_size=1,
                timeout=1e-3,
                static_batch_size=n if config["graph"] else None,
            ),
            device_config=InferenceDeviceConfig(
                policy_device=device, output_device="cpu", storing_device="cpu"
            ),
        )
        held["collector"] = collector
        try:
            for batch in collector:
                yield batch.numel()
        finally:
            collector.shutdown()

    steps = batches()
    try:
        result = measure(steps, config["warmup_s"], config["measure_s"])
        result["server_backend"] = held["collector"].server_backend
    finally:
        steps.close()
    return result
