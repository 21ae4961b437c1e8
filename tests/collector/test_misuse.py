"""Misuse is refused, or made safe, without harming a healthy collector: a transport
given to two collectors, two threads iterating one collector, weights that cannot all be
applied."""

import functools
import threading

import numpy as np
import pytest
import torch
from helpers import CountingPolicy, check_clean, counting_envs, wait_until

from rlcollect import AsyncBatchedCollector, CollectorError
from rlcollect.testing import CountingEnv
from rlcollect.transports import ProcessSlotTransport, ThreadQueueTransport


@pytest.mark.parametrize("make", [ThreadQueueTransport, ProcessSlotTransport])
def test_a_transport_given_to_a_second_collector_is_refused_and_the_first_goes_on(make):
    transport = make()
    kwargs = {"frames_per_batch": 16, "policy_device": "cpu", "transport": transport}
    with AsyncBatchedCollector(counting_envs(2), CountingPolicy(), **kwargs) as first:
        next(first)
        with pytest.raises(ValueError, match="already serves another collector"):
            AsyncBatchedCollector(counting_envs(2), CountingPolicy(), **kwargs)
        assert next(first).batch_size[0] == 16  # untouched by the refused one
    check_clean(first)


class Gated(CountingEnv):
    """Steps only once ``gate`` is set (thread transport: the test's own Event)."""

    def __init__(self, env_id, gate):
        super().__init__(env_id)
        self.gate = gate

    def step(self, action):
        assert self.gate.wait(30), "the test never opened the gate"
        return super().step(action)


def test_two_threads_iterating_one_collector_one_is_refused():
    gate = threading.Event()
    fns = [functools.partial(Gated, i, gate) for i in range(2)]
    outcomes, lock = [], threading.Lock()

    def take(c):
        try:
            result = next(c).batch_size[0]
        except CollectorError as error:
            result = str(error)
        with lock:
            outcomes.append(result)

    with AsyncBatchedCollector(
        fns, CountingPolicy(), frames_per_batch=8, transport="thread", policy_device="cpu"
    ) as c:
        # No env can step: whichever thread enters next() first waits there for a
        # batch; the other is refused at once, whatever the order they arrive in.
        threads = [threading.Thread(target=take, args=(c,)) for _ in range(2)]
        for t in threads:
            t.start()
        wait_until(lambda: len(outcomes) == 1, timeout=30, what="one thread to be refused")
        gate.set()
        for t in threads:
            t.join(30)
    assert len(outcomes) == 2 and 8 in outcomes
    refused = next(o for o in outcomes if o != 8)
    assert "another thread is iterating this collector" in refused


class TwoWeights(torch.nn.Module):
    """The action is round(a + b): an update of either weight shows in every action."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Parameter(torch.tensor(1.0))
        self.b = torch.nn.Parameter(torch.tensor(1.0))

    def forward(self, observation):
        return (self.a + self.b).round().long().expand(observation.shape[0])


@pytest.mark.parametrize("backend", ["thread", "process"])
def test_weights_that_cannot_all_be_applied_change_nothing(backend):
    with AsyncBatchedCollector(
        counting_envs(2),
        TwoWeights(),
        frames_per_batch=16,
        transport="process_slots",
        inference_backend=backend,
        policy_device="cpu",
    ) as c:
        next(c)
        bad = {"a": torch.tensor(3.0), "b": np.array(3.0)}  # "a" would be copied first
        with pytest.raises(TypeError, match=r"weight 'b' is a ndarray, not a torch\.Tensor"):
            c.update_policy_weights_(bad)
        assert c.policy_version == 0
        later = [next(c) for _ in range(3)]
        assert all(bool((b["action"] == 2).all()) for b in later)  # still round(1 + 1)
        assert all(bool((b["policy_version"] == 0).all()) for b in later)
        assert c.update_policy_weights_({"a": torch.tensor(3.0), "b": torch.tensor(3.0)}) == 1
