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


@pytest.mark.parametrize("backend", ["thread", "process"])
def test_too_few_file_descriptors_is_a_clear_error_and_leaks_none(backend):
    """A low fd limit fails construction half-way through opening the workers' pipes:
    a CollectorError naming the limit and the remedy, and every descriptor opened
    before the failure closed again."""
    import gc
    import os
    import resource

    def fds():
        gc.collect()  # what a failed construction left for garbage collection is no leak
        return len(os.listdir("/proc/self/fd"))

    def make():
        return AsyncBatchedCollector(
            counting_envs(8),
            CountingPolicy(),
            frames_per_batch=8,
            total_frames=16,
            policy_device="cpu",
            inference_backend=backend,
            transport="process_slots",
            envs_per_worker=1,  # eight worker processes, five descriptors each
        )

    with make() as c:  # warm up imports and lazy state
        list(c)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    before = fds()
    # Room for a few workers' pipes but not all eight workers' (each takes about 7 while
    # they start), so the failure comes half-way through.
    resource.setrlimit(resource.RLIMIT_NOFILE, (before + 20, hard))
    try:
        expected = r"ran out of file descriptors starting 8 workers .*ulimit -n"
        with pytest.raises(CollectorError, match=expected):
            make()
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert fds() == before


def resident_kib(name):
    """Resident memory (KiB) of this process's mappings of /dev/shm/``name``."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            if "-" in line.split(" ", 1)[0]:  # a mapping's header line: "start-end perms ..."
                inside = f"/dev/shm/{name}" in line
            elif inside and line.startswith("Rss:"):
                total += int(line.split()[1])
    return total


def test_shutdown_gives_the_rings_memory_back_at_once():
    """shutdown() itself frees the ring's memory, while the collector object (and the
    views its parts hold) are still referenced; the batches stay whole (copies)."""
    c = AsyncBatchedCollector(
        counting_envs(2),
        CountingPolicy(),
        frames_per_batch=64,
        total_frames=-1,
        policy_device="cpu",
        transport="process_slots",
    )
    batch = next(c)
    name = c.transport.shm_name
    assert resident_kib(name) > 0  # the ring is in use and mapped here
    expected = batch["observation"].clone()
    c.shutdown()
    assert resident_kib(name) == 0
    assert torch.equal(batch["observation"], expected)
