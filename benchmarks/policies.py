"""Small policies for the benchmarks: they sample their actions, as real ones do."""

from __future__ import annotations

import torch
from torch import nn


class MLP(nn.Module):
    def __init__(self, obs_dim: int, num_actions: int) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(obs_dim, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(),
            nn.Linear(64, num_actions),
        )  # fmt: skip

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        return torch.distributions.Categorical(logits=self.net(obs)).sample()


class GumbelMLP(MLP):
    """The same MLP, sampling by Gumbel-max (argmax of the logits plus Gumbel noise, a
    draw from the same distribution) instead of building a ``Categorical``: on a slow
    CPU the distribution object costs about 90 µs a call, more than ten CartPole steps,
    and it would be most of what a cheap-env benchmark measures."""

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        logits = self.net(obs)
        u = torch.rand_like(logits).clamp_(1e-9, 1.0)
        return (logits - torch.log(-torch.log(u))).argmax(-1)


class SmallCNN(nn.Module):
    """For 4x105x80 uint8 frames."""

    def __init__(self, num_actions: int) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(4, 16, 8, stride=4), nn.ReLU(),
            nn.Conv2d(16, 32, 4, stride=2), nn.ReLU(),
            nn.Flatten(), nn.Linear(32 * 11 * 8, 256), nn.ReLU(), nn.Linear(256, num_actions),
        )  # fmt: skip

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        logits = self.net(obs.float() / 255.0)
        return torch.distributions.Categorical(logits=logits).sample()


def policy_for(env_name: str) -> nn.Module:
    return MLP(4, 2) if env_name == "cartpole" else SmallCNN(6)


class NatureCNN(nn.Module):
    """The DQN Nature CNN for 4-frame uint8 stacks (4x105x80 by default, or
    ``frame_shape``, e.g. 84x84); samples by Gumbel-max.

    Gumbel-max (argmax of logits plus Gumbel noise) draws from the same distribution as
    ``Categorical(logits).sample()`` without a host synchronisation, so the whole action
    step can be captured in a CUDA graph.
    """

    def __init__(self, num_actions: int = 6, frame_shape: tuple[int, int] = (105, 80)) -> None:
        super().__init__()
        h, w = frame_shape
        for kernel, stride in ((8, 4), (4, 2), (3, 1)):
            h, w = (h - kernel) // stride + 1, (w - kernel) // stride + 1
        self.net = nn.Sequential(
            nn.Conv2d(4, 32, 8, stride=4), nn.ReLU(),
            nn.Conv2d(32, 64, 4, stride=2), nn.ReLU(),
            nn.Conv2d(64, 64, 3, stride=1), nn.ReLU(),
            nn.Flatten(), nn.Linear(64 * h * w, 512), nn.ReLU(), nn.Linear(512, num_actions),
        )  # fmt: skip

    def forward(self, obs: torch.Tensor) -> dict[str, torch.Tensor]:
        logits = self.net(obs.float() / 255.0)
        u = torch.rand_like(logits).clamp_(1e-9, 1.0)
        action = (logits - torch.log(-torch.log(u))).argmax(-1)
        log_prob = torch.log_softmax(logits, -1).gather(-1, action[:, None])[:, 0]
        return {"action": action, "log_prob": log_prob}
