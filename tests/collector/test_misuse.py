"""Misuse is refused, or made safe, without harming a healthy collector: a transport
given to two collectors, two threads iterating one collector, weights that cannot all be
applied."""

import functools
import threading

import numpy as np
import pytest
import torch
from envs import CrashWhen
from helpers import CountingPolicy, check_clean, counting_envs, wait_until, with_server_layout

from rlcollect import AsyncBatchedCollector, CollectorError
from rlcollect.errors import WorkerRestartWarning
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

    # the layout given: the "auto" layout's probe would step a gated env 0 itself
    layout = with_server_layout({"frames_per_batch": 8, "policy_device": "cpu"})
    with AsyncBatchedCollector(fns, CountingPolicy(), transport="thread", **layout) as c:
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


@pytest.mark.parametrize(
    ("transport", "on_policy"),
    [("thread", False), ("thread", True), ("process_slots", False), ("process_slots", True)],
)
def test_shutdown_from_another_thread_ends_a_waiting_next_with_the_public_error(
    transport, on_policy
):
    """next() under way (waiting for a batch, or between batches) when another thread
    shuts the collector down raises CollectorError itself, saying so: never the
    collector's internal stop signal, nor what the closed parts raised."""
    gate = threading.Event()  # thread transport: no env steps before the shutdown
    fns = counting_envs(2)
    if transport == "thread":
        fns = [functools.partial(Gated, i, gate) for i in range(2)]
    kwargs = {"on_policy": True, "policy_lag": 1} if on_policy else {}
    layout = with_server_layout({"frames_per_batch": 8, "policy_device": "cpu", **kwargs})
    c = AsyncBatchedCollector(fns, CountingPolicy(), transport=transport, **layout)
    outcome: dict[str, BaseException] = {}
    iterating = threading.Event()

    def take():
        iterating.set()
        try:
            for _ in range(100_000):
                next(c)
        except BaseException as error:
            outcome["error"] = error

    thread = threading.Thread(target=take)
    thread.start()
    try:
        assert iterating.wait(30)
        c.shutdown()
    finally:
        gate.set()
    thread.join(30)
    assert not thread.is_alive()
    error = outcome["error"]
    assert type(error) is CollectorError, repr(error)
    assert "shut down" in str(error)
    check_clean(c)


class TwoWeights(torch.nn.Module):
    """The action is round(a + b): an update of either weight shows in every action."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Parameter(torch.tensor(1.0))
        self.b = torch.nn.Parameter(torch.tensor(1.0))

    def forward(self, observation):
        return (self.a + self.b).round().long().expand(observation.shape[0])


def two_weights_collector(backend):
    """TwoWeights served by ``backend`` to two envs in worker processes."""
    return AsyncBatchedCollector(
        counting_envs(2),
        TwoWeights(),
        frames_per_batch=16,
        transport="process_slots",
        inference_backend=backend,
        policy_device="cpu",
    )


@pytest.mark.parametrize("backend", ["thread", "process"])
def test_weights_that_cannot_all_be_applied_change_nothing(backend):
    with two_weights_collector(backend) as c:
        next(c)
        bad = {"a": torch.tensor(3.0), "b": np.array(3.0)}  # "a" would be copied first
        with pytest.raises(TypeError, match=r"weight 'b' is a ndarray, not a torch\.Tensor"):
            c.update_policy_weights_(bad)
        assert c.policy_version == 0
        later = [next(c) for _ in range(3)]
        assert all(bool((b["action"] == 2).all()) for b in later)  # still round(1 + 1)
        assert all(bool((b["policy_version"] == 0).all()) for b in later)
        assert c.update_policy_weights_({"a": torch.tensor(3.0), "b": torch.tensor(3.0)}) == 1


# Values that pass the name, shape and type checks but cannot be copied into the policy
# as they are (no data, another layout, a dtype the policy's cannot hold).
UNCOPYABLE = [
    (lambda: torch.empty((), device="meta"), ValueError, r"weight 'b' is a meta tensor"),
    (lambda: torch.tensor(3.0).to_sparse(), ValueError, r"weight 'b' has layout torch\.sparse"),
    (lambda: torch.tensor(3 + 1j), TypeError, r"weight 'b' is torch\.complex64"),
]


@pytest.mark.parametrize("backend", ["thread", "process", "worker"])
def test_weights_that_cannot_be_copied_change_nothing_and_name_the_weight(backend):
    """Each bad value comes after a good one ("a" would be copied first): the update is
    refused whole, naming the weight, on every backend; the policy acts as before."""
    with two_weights_collector(backend) as c:
        next(c)
        for make, error, match in UNCOPYABLE:
            with pytest.raises(error, match=match):
                c.update_policy_weights_({"a": torch.tensor(3.0), "b": make()})
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


def test_too_few_file_descriptors_at_a_restart_is_a_clear_error(tmp_path):
    """A worker restart that runs out of descriptors fails as start-up does: a
    CollectorError naming the limit and the remedy, not a bare OSError; the descriptors
    the restart had opened are closed again, and so is everything else by shutdown."""
    import gc
    import os
    import resource

    armed, trigger = tmp_path / "armed", tmp_path / "crash"
    armed.touch()
    fns = [*counting_envs(1), functools.partial(CrashWhen, 1, str(trigger))]
    c = AsyncBatchedCollector(
        fns,
        CountingPolicy(),
        frames_per_batch=8,
        policy_device="cpu",
        transport="process_slots",
        max_worker_restarts=1,
        stall_timeout=None,  # the stall watch reads /proc files: nothing opens here
    )
    next(c)
    gc.collect()
    before = len(os.listdir("/proc/self/fd"))
    lowest_free = os.dup(0)  # every descriptor below it is open
    os.close(lowest_free)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (lowest_free, hard))  # none can open
    try:
        os.rename(armed, trigger)  # env 1 crashes at its next step
        expected = r"ran out of file descriptors restarting worker 1 .*ulimit -n"
        with pytest.raises(CollectorError, match=expected), pytest.warns(WorkerRestartWarning):
            for _ in range(10_000):  # the crash comes at the next step of env 1
                next(c)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    check_clean(c)
    gc.collect()
    assert len(os.listdir("/proc/self/fd")) < before  # the workers' pipes closed, none leaked


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
