"""The eager policy on a real GPU (skipped where CUDA is absent; run on the device)."""

import pytest
import torch
from helpers import CountingPolicy, check_counting_streams, collect, counting_envs

from rlcollect import AsyncBatchedCollector

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


class DevicePolicy(CountingPolicy):
    """Records the device it ran on, so the test sees the forward happen on the GPU."""

    def forward(self, obs):
        assert obs.is_cuda, f"observations arrived on {obs.device}"
        out = super().forward(obs)
        out["on_cuda"] = torch.full_like(out["value"], float(self.scale.is_cuda))
        return out


def test_cuda_policy_keeps_every_invariant(transport):
    with AsyncBatchedCollector(
        counting_envs(6),
        DevicePolicy(),
        frames_per_batch=60,
        total_frames=1200,
        transport=transport,
        policy_device="cuda",
        envs_per_worker=2,
    ) as c:
        data = collect(c)
    assert data["observation"].device.type == "cpu"
    assert bool((data["on_cuda"] == 1).all())
    check_counting_streams(data)


def test_default_device_is_cuda_when_present():
    with AsyncBatchedCollector(
        counting_envs(2), CountingPolicy(), frames_per_batch=8, total_frames=16, transport="thread"
    ) as c:
        assert c.policy_device.type == "cuda"
        list(c)
