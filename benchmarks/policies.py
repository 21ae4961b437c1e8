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
