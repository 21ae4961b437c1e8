"""The acting policy every pixel series serves, and a hand loop's fixed-batch action step."""

from __future__ import annotations

import numpy as np
import torch

from benchmarks.policies import NatureCNN, SmallCNN

OBS_SHAPE = (4, 105, 80)
NUM_ACTIONS = 6
POLICIES = ("nature_cnn", "small_cnn")


def acting_policy(name: str, device: str = "cpu") -> NatureCNN:
    """The policy a pixel run serves, seeded, in eval mode, on ``device``.

    ``"nature_cnn"``: the DQN Nature CNN. ``"small_cnn"``: the two-layer CNN of the
    CPU benchmarks (a Nature CNN forward alone takes most of a 2-core machine). Both
    sample by Gumbel-max and return ``action`` and ``log_prob``, so every run of a
    series serves the same network with the same outputs.
    """
    if name not in POLICIES:
        raise ValueError(f"unknown policy {name!r}; choose from {POLICIES}")
    torch.manual_seed(0)
    policy = NatureCNN(NUM_ACTIONS)
    if name == "small_cnn":
        # NatureCNN.forward is Gumbel-max over self.net's logits, whatever the layers.
        policy.net = SmallCNN(NUM_ACTIONS).net
    return policy.to(device).eval()


class FixedBatchStep:
    """A hand-written loop's action step for batches of exactly ``batch`` observations.

    Observations go up from a page-locked staging tensor and actions come back into
    another, as a careful hand loop does it. With ``graph`` the forward and sampling
    are captured once as a CUDA graph and replayed, the same execution the collector's
    ``cuda_graph=True`` gives, so the two compare like for like.
    """

    def __init__(self, policy: torch.nn.Module, batch: int, device: str, *, graph: bool) -> None:
        self.device = torch.device(device)
        self.batch = batch
        cuda = self.device.type == "cuda"
        if graph and not cuda:
            raise ValueError("a CUDA graph needs a CUDA device")
        self.policy = policy
        self.host_in = torch.zeros((batch, *OBS_SHAPE), dtype=torch.uint8, pin_memory=cuda)
        self.host_action = torch.zeros(batch, dtype=torch.int64, pin_memory=cuda)
        self.graph: torch.cuda.CUDAGraph | None = None
        if graph:
            self.static_in = torch.zeros((batch, *OBS_SHAPE), dtype=torch.uint8, device=device)
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side), torch.inference_mode():
                for _ in range(3):  # warm-up: cuDNN picks its kernels outside the capture
                    policy(self.static_in)
            torch.cuda.current_stream().wait_stream(side)
            self.graph = torch.cuda.CUDAGraph()
            with torch.inference_mode(), torch.cuda.graph(self.graph):
                self.static_action = policy(self.static_in)["action"]

    @torch.inference_mode()
    def __call__(self, obs: np.ndarray) -> np.ndarray:
        """Actions for ``obs`` ``[batch, 4, 105, 80]`` uint8, as an int64 array (reused)."""
        self.host_in.numpy()[...] = obs
        if self.graph is not None:
            self.static_in.copy_(self.host_in, non_blocking=True)
            self.graph.replay()
            self.host_action.copy_(self.static_action, non_blocking=True)
            torch.cuda.current_stream().synchronize()
        else:
            obs_t = self.host_in.to(self.device, non_blocking=True)
            self.host_action.copy_(self.policy(obs_t)["action"])
        return self.host_action.numpy()
