"""exploration_type: a TensorDictModule acts as in TorchRL's own collectors, on every
backend; an evaluation collector acts deterministically."""

import pytest
import torch
from envs import cartpole
from helpers import biased_actor, sampled_share
from tensordict.nn import TensorDictModule, TensorDictSequential
from tensordict.nn.probabilistic import interaction_type
from torchrl.data import Categorical
from torchrl.envs.utils import ExplorationType
from torchrl.modules import EGreedyModule

from rlcollect import AsyncBatchedCollector

# (inference_backend, transport): the server in a thread or a process of its own, and the
# policy inside each env worker, as threads and as processes.
BACKENDS = [
    ("thread", "process_slots"),
    ("process", "process_slots"),
    ("worker", "thread"),
    ("worker", "process_slots"),
]


def actions(policy, backend, transport, **kwargs):
    with AsyncBatchedCollector(
        [cartpole] * 2,
        policy,
        frames_per_batch=200,
        total_frames=400,
        transport=transport,
        policy_device="cpu",
        inference_backend=backend,
        **kwargs,
    ) as collector:
        batches = list(collector)
    return torch.cat([b["action"] for b in batches]), torch.cat(
        [b["action_log_prob"] for b in batches]
    )


@pytest.mark.parametrize(("backend", "transport"), BACKENDS)
def test_a_served_probabilistic_actor_samples_by_default(backend, transport):
    action, log_prob = actions(biased_actor(), backend, transport)
    share = sampled_share(action)
    # 400 draws with p = 0.27: below 0.15 is over five standard deviations off.
    assert 0.15 < share < 0.4, share
    # the log-probability is the sampled action's own
    expected = torch.log_softmax(torch.tensor([0.0, 1.0]), -1)[action]
    torch.testing.assert_close(log_prob, expected)


@pytest.mark.parametrize(("backend", "transport"), BACKENDS)
def test_an_evaluation_collector_acts_deterministically(backend, transport):
    action, _ = actions(biased_actor(), backend, transport, exploration_type="deterministic")
    assert bool((action == 1).all())


@pytest.mark.parametrize("kind", ["mode", ExplorationType.DETERMINISTIC])
def test_mode_and_torchrls_enum_are_accepted(kind):
    action, _ = actions(biased_actor(), "thread", "thread", exploration_type=kind)
    assert bool((action == 1).all())


def test_an_exploration_module_adds_its_noise_only_when_random():
    # EGreedyModule reads the exploration type alone (it has no default of its own).
    greedy = TensorDictModule(
        lambda obs: torch.zeros(obs.shape[0], dtype=torch.int64),
        in_keys=["observation"],
        out_keys=["action"],
    )
    explore = EGreedyModule(Categorical(2), eps_init=1.0, eps_end=1.0)
    policy = TensorDictSequential(greedy, explore)
    for kind, random in (("random", True), ("deterministic", False)):
        with AsyncBatchedCollector(
            [cartpole] * 2,
            policy,
            frames_per_batch=200,
            total_frames=200,
            transport="thread",
            policy_device="cpu",
            exploration_type=kind,
        ) as collector:
            (batch,) = list(collector)
        share = (batch["action"] == 1).float().mean().item()
        assert (share > 0.3) if random else share == 0.0, (kind, share)


def test_a_plain_module_refuses_an_evaluation_type():
    class Argmax(torch.nn.Module):
        def forward(self, observation):
            return observation[:, :2].argmax(-1)

    with pytest.raises(ValueError, match="plain Argmax, which draws its own noise"):
        AsyncBatchedCollector(
            [cartpole],
            Argmax(),
            frames_per_batch=8,
            total_frames=8,
            transport="thread",
            policy_device="cpu",
            exploration_type="deterministic",
        )


def test_an_unknown_type_is_named():
    with pytest.raises(ValueError, match="exploration_type must be one of"):
        AsyncBatchedCollector(
            [cartpole],
            biased_actor(),
            frames_per_batch=8,
            transport="thread",
            exploration_type="greedy",
        )


def test_collectors_of_one_process_keep_their_own_types():
    # tensordict's interaction type is one setting per process: two server threads (a
    # training and an evaluation collector) and worker threads serving the policy each
    # set it around their calls, which must not run under one another's type, nor leave
    # the setting changed.
    def collector(kind, backend):
        return AsyncBatchedCollector(
            [cartpole] * 4,
            biased_actor(),
            frames_per_batch=100,
            total_frames=1000,
            transport="thread",
            policy_device="cpu",
            inference_backend=backend,
            exploration_type=kind,
        )

    runs = {("random", "thread"): [], ("deterministic", "thread"): [],
            ("deterministic", "worker"): []}  # fmt: skip
    collectors = {key: collector(*key) for key in runs}
    try:
        for _ in range(10):  # interleaved: every server and worker thread runs meanwhile
            for key, c in collectors.items():
                runs[key].append(next(c)["action"])
    finally:
        for c in collectors.values():
            c.shutdown()
    share = {key: sampled_share(torch.cat(actions)) for key, actions in runs.items()}
    assert 0.15 < share["random", "thread"] < 0.4, share
    assert share["deterministic", "thread"] == share["deterministic", "worker"] == 0.0, share
    assert interaction_type() is None
