"""CleanRL's layout without glue: time-major rounds, its ``dones`` convention read off
rlcollect's keys (docs/usage.md, *On-policy rollouts*), and a ``[B, 1]`` output named."""

import warnings

import pytest
import torch
from envs import cartpole
from tensordict.nn import TensorDictModule

from rlcollect import AsyncBatchedCollector
from rlcollect.errors import TrailingDimensionWarning

GAMMA, LAMBDA = 0.99, 0.95


def gae_by_cleanrls_convention(rewards, values, dones, next_value, next_done, gamma, lam):
    """The reference: [T, N] arrays where ``dones[t]`` says that ``obs[t]`` is the first
    observation of an episode (the previous step ended one) and ``next_done`` the same
    of the observation after the last step; the bootstrap from step t is cut by the
    flag of the observation that follows it."""
    steps = rewards.shape[0]
    advantages = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[0])
    for t in range(steps - 1, -1, -1):
        following_done = next_done if t == steps - 1 else dones[t + 1]
        following_value = next_value if t == steps - 1 else values[t + 1]
        keep = 1.0 - following_done
        delta = rewards[t] + gamma * following_value * keep - values[t]
        running = delta + gamma * lam * keep * running
        advantages[t] = running
    return advantages


def gae_of_batch(batch, next_value, gamma, lam):
    """The documented way on a time-major batch: ``("next", "done")[t]`` is CleanRL's
    ``dones[t + 1]`` (and its ``next_done`` at the last step), so no shift."""
    rewards, values = batch["next", "reward"], batch["value"]
    done = batch["next", "done"].float()
    advantages = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[0])
    for t in reversed(range(rewards.shape[0])):
        following = next_value if t == rewards.shape[0] - 1 else values[t + 1]
        delta = rewards[t] + gamma * following * (1.0 - done[t]) - values[t]
        running = delta + gamma * lam * (1.0 - done[t]) * running
        advantages[t] = running
    return advantages


def test_the_two_conventions_agree_on_a_case_worked_by_hand():
    # One env, three steps; the episode ends at step 1; gamma 0.5, lambda 1, values 0.
    rewards, values = torch.ones(3, 1), torch.zeros(3, 1)
    batch = {("next", "reward"): rewards, "value": values,
             ("next", "done"): torch.tensor([[False], [True], [False]])}  # fmt: skip
    # step 2: 1 + 0.5 * 2 (bootstrapped); step 1: 1 (cut); step 0: 1 + 0.5 * 1
    expected = torch.tensor([[1.5], [1.0], [2.0]])
    torch.testing.assert_close(gae_of_batch(batch, torch.tensor([2.0]), 0.5, 1.0), expected)
    cleanrl_dones = torch.tensor([[0.0], [0.0], [1.0]])  # obs[2] begins an episode
    reference = gae_by_cleanrls_convention(
        rewards, values, cleanrl_dones, torch.tensor([2.0]), torch.tensor([0.0]), 0.5, 1.0
    )
    torch.testing.assert_close(reference, expected)


class Agent(torch.nn.Module):
    """A sampling policy with a value head (the value a function of the observation)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.logits = torch.nn.Linear(4, 2)
        self.critic = torch.nn.Linear(4, 1)

    def value(self, obs):
        return self.critic(obs).squeeze(-1)

    def forward(self, obs):
        action = torch.distributions.Categorical(logits=self.logits(obs)).sample()
        return {"action": action, "value": self.value(obs)}


def test_time_major_rounds_give_cleanrls_advantages_without_a_shift():
    agent = Agent()
    num_envs, steps = 4, 64
    previous_done = torch.zeros(num_envs)  # CleanRL's next_done before the first rollout
    ended = 0
    with AsyncBatchedCollector(
        [cartpole] * num_envs,
        agent,
        frames_per_batch=num_envs * steps,
        total_frames=num_envs * steps * 3,
        transport="thread",
        policy_device="cpu",
        on_policy=True,
        time_major=True,
    ) as collector:
        for batch in collector:
            assert batch.batch_size == (steps, num_envs)
            done = batch["next", "done"]
            ended += int(done.sum())
            # the layout: step t + 1 of an env follows its step t, unless t ended an episode
            same = (batch["observation"][1:] == batch["next", "observation"][:-1]).all(-1)
            assert bool((same | done[:-1]).all())
            next_value = agent.value(batch["next", "observation"][-1]).detach()
            # CleanRL's arrays, built from the batch the way its rollout loop fills them
            dones = torch.cat([previous_done[None], done[:-1].float()])
            reference = gae_by_cleanrls_convention(
                batch["next", "reward"], batch["value"], dones, next_value,
                done[-1].float(), GAMMA, LAMBDA,
            )  # fmt: skip
            torch.testing.assert_close(gae_of_batch(batch, next_value, GAMMA, LAMBDA), reference)
            previous_done = done[-1].float()
    assert ended > 4  # episodes did end inside rollouts: the cut was exercised


class ValueColumn(torch.nn.Module):
    def __init__(self, squeeze=False):
        super().__init__()
        self.critic = torch.nn.Linear(4, 1)
        self.squeeze = squeeze

    def forward(self, obs):
        value = self.critic(obs)
        return {
            "action": (obs[:, 2] > 0).long(),
            "value": value.squeeze(-1) if self.squeeze else value,
        }


class ValueColumnPair(ValueColumn):
    def forward(self, obs):
        out = super().forward(obs)
        return out["action"], out["value"]


def build(policy, on_policy=True):
    return AsyncBatchedCollector(
        [cartpole] * 2,
        policy,
        frames_per_batch=16,
        total_frames=16,
        transport="thread",
        policy_device="cpu",
        on_policy=on_policy,
    )


def test_an_on_policy_value_column_of_one_is_named_at_construction():
    with pytest.warns(TrailingDimensionWarning, match=r"policy output 'value' has shape \[B, 1\]"):
        collector = build(ValueColumn())
    with collector:
        (batch,) = list(collector)
    assert batch["value"].shape == (2, 8, 1)  # kept as returned: the warning said so


@pytest.mark.parametrize(
    "policy, on_policy",
    [
        (ValueColumn(squeeze=True), True),
        (ValueColumn(), False),  # off-policy rows: [B, 1] against [B] rewards, no time axis
        # TorchRL's convention is [*, 1] (rlcollect.interop.to_torchrl): kept, unwarned
        (TensorDictModule(ValueColumnPair(), ["observation"], ["action", "state_value"]), True),
    ],
    ids=["squeezed", "off-policy", "tensordict-module"],
)  # fmt: skip
def test_no_warning_where_nothing_would_broadcast(policy, on_policy):
    with warnings.catch_warnings():
        warnings.simplefilter("error", TrailingDimensionWarning)
        build(policy, on_policy).shutdown()
