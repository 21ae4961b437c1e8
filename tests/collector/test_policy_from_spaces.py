"""policy_factory(observation_space, action_space): a policy sized from the env's spaces,
built wherever the backend serves it, with no env built by the caller."""

import os
import re

import gymnasium as gym
import numpy as np
import pytest
import torch
from envs import cartpole

from rlcollect import AsyncBatchedCollector
from rlcollect.collector.probe import factory_takes_spaces


class Agent(torch.nn.Module):
    """Sized from the spaces, as a CleanRL agent is from its envs; records the process
    it was built in and the spaces it was given."""

    def __init__(self, observation_space, action_space):
        super().__init__()
        self.logits = torch.nn.Linear(int(np.prod(observation_space.shape)), action_space.n)
        self.built_in = os.getpid()  # not a buffer: weights pushed from the driver keep it
        self.register_buffer("sizes", torch.tensor([observation_space.shape[0], action_space.n]))

    def forward(self, observation):
        action = self.logits(observation).argmax(-1)
        batch = observation.shape[0]
        return {
            "action": action,
            "built_in": torch.full((batch,), self.built_in),
            "sizes": self.sizes.expand(batch, 2),
        }


@pytest.mark.parametrize(
    ("backend", "transport"),
    [("thread", "thread"), ("process", "process_slots"), ("worker", "process_slots")],
)
def test_a_factory_of_the_spaces_builds_the_served_policy(backend, transport):
    with AsyncBatchedCollector(
        [cartpole] * 2,
        policy_factory=Agent,  # a class whose __init__ takes the two spaces
        frames_per_batch=32,
        total_frames=64,
        transport=transport,
        policy_device="cpu",
        inference_backend=backend,
    ) as collector:
        assert collector.observation_space == gym.make("CartPole-v1").observation_space
        assert collector.action_space == gym.spaces.Discrete(2)
        # the learner's copy, from the same spaces, no env of its own
        learner = Agent(collector.observation_space, collector.action_space)
        batches = list(collector)
    sizes = torch.cat([b["sizes"] for b in batches])
    assert sizes.unique(dim=0).tolist() == [[4, 2]]
    built_in = torch.cat([b["built_in"] for b in batches]).unique().tolist()
    if backend == "thread":
        assert built_in == [os.getpid()]
    else:  # built where it is served: the inference process, or each env worker
        assert os.getpid() not in built_in
    assert learner.logits.in_features == 4


def test_a_two_argument_function_and_a_zero_argument_one():
    def of_spaces(observation_space, action_space):
        return Agent(observation_space, action_space)

    assert factory_takes_spaces(of_spaces) and factory_takes_spaces(Agent)
    assert not factory_takes_spaces(lambda: None)
    assert not factory_takes_spaces(lambda *args: None)  # asks for none
    assert not factory_takes_spaces(lambda a=1, b=2: None)  # defaults: called with none


@pytest.mark.parametrize(
    ("factory", "required"),
    [(lambda space: None, "['space']"), (lambda a, b, c: None, "['a', 'b', 'c']")],
)
def test_a_factory_asking_for_another_number_of_arguments_is_refused(factory, required):
    message = (
        r"policy_factory must take no argument, or two positional ones \(observation_space, "
        rf"action_space\); it requires {re.escape(required)}"
    )
    with pytest.raises(TypeError, match=message):
        AsyncBatchedCollector(
            [cartpole],
            policy_factory=factory,
            frames_per_batch=8,
            transport="thread",
            policy_device="cpu",
        )


def test_a_restarted_ray_actor_builds_a_factory_of_the_spaces_with_the_newest_weights():
    from rlcollect.distributed.actor import CollectorActor  # Ray-free: the actor's class

    space = gym.make("CartPole-v1")
    weights = Agent(space.observation_space, space.action_space).state_dict()
    weights["logits.weight"].zero_()
    weights["logits.bias"].copy_(torch.tensor([0.0, 1.0]))  # always action 1
    actor = CollectorActor(
        [cartpole] * 2,
        None,
        first_fn=0,
        total_fns=2,
        generation=1,
        episode_base=None,
        weights=weights,
        policy_version=3,
        frames_per_batch=16,
        seed=0,
        cpus=None,
        collector_kwargs={"policy_factory": Agent, "transport": "thread", "policy_device": "cpu"},
    )
    assert actor.collector is not None, actor._error
    with actor.collector as collector:
        batch = next(iter(collector))
    assert bool((batch["action"] == 1).all())
