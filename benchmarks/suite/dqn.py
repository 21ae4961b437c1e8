"""DQN's parts shared by the training-loop series: Q-network, acting policy, learner."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from tensordict import TensorDict
from torch import nn

from benchmarks.policies import NatureCNN
from benchmarks.suite.acting import NUM_ACTIONS


class EpsilonGreedy(nn.Module):
    """Acts epsilon-greedily on a Nature-CNN Q-network, without a host synchronisation.

    The random branch draws on the device (``torch.rand``), so the whole action step can
    be captured as a CUDA graph, as the collector's ``cuda_graph=True`` does.
    """

    def __init__(self, epsilon: float) -> None:
        super().__init__()
        self.q = NatureCNN(NUM_ACTIONS).net  # the Nature CNN's layers, output = Q-values
        self.epsilon = epsilon

    def q_values(self, obs: torch.Tensor) -> torch.Tensor:
        return self.q(obs.float() / 255.0)  # type: ignore[no-any-return]

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        greedy = self.q_values(obs).argmax(-1)
        n = obs.shape[0]
        explore = torch.rand(n, device=obs.device) < self.epsilon
        uniform = (
            (torch.rand(n, device=obs.device) * NUM_ACTIONS).long().clamp_(max=NUM_ACTIONS - 1)
        )
        return torch.where(explore, uniform, greedy)


class Learner:
    """One DQN update per call: Huber loss against a target network, Adam.

    Nothing here reads a value back to the host, so on a GPU the updates queue up
    behind each other like the real thing's.
    """

    def __init__(
        self, device: str, *, epsilon: float = 0.05, gamma: float = 0.99, target_every: int = 1000
    ) -> None:
        torch.manual_seed(0)
        self.online = EpsilonGreedy(epsilon).to(device)
        self.target = copy.deepcopy(self.online).requires_grad_(False)
        self.optimizer = torch.optim.Adam(self.online.parameters(), lr=1e-4)
        self.gamma = gamma
        self.target_every = target_every
        self.updates = 0

    def update(self, batch: TensorDict) -> None:
        with torch.no_grad():
            next_q = self.target.q_values(batch["next", "observation"]).max(-1).values
            alive = (~batch["next", "terminated"]).float()
            target = batch["next", "reward"] + self.gamma * alive * next_q
        q = self.online.q_values(batch["observation"])
        taken = q.gather(-1, batch["action"][:, None]).squeeze(-1)
        loss = F.smooth_l1_loss(taken, target)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()
        self.updates += 1
        if self.updates % self.target_every == 0:
            self.target.load_state_dict(self.online.state_dict())
