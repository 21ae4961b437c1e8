"""inference_backend="worker": each env worker runs the policy on its own requests.

The same guarantees as with a server (whole streams, exact batches, atomic versioned
weight updates, on-policy rounds, restarts), on real worker processes and threads, plus
what only this backend gives: a seeded run with a sampling policy repeats exactly.
"""

from __future__ import annotations

import functools
import os
import signal
import time

import gymnasium as gym
import pytest
import torch
from envs import counting_vector
from helpers import (
    ConstantPolicy,
    CountingPolicy,
    RecurrentCountingPolicy,
    UnpicklablePolicy,
    check_counting_streams,
    check_weight_update,
    collect,
    counting_collector,
    counting_envs,
    process_gone,
    shm_exists,
    streams,
    wait_until,
)

from rlcollect import AsyncBatchedCollector, WorkerError
from rlcollect.errors import WorkerRestartWarning
from rlcollect.testing import CountingVectorEnv

TRANSPORTS = ["process_slots", "thread"]


def worker_collector(transport, policy=None, **kwargs):
    kwargs.setdefault("envs_per_worker", 2)
    kwargs.pop("policy_device", None)
    return counting_collector(transport, policy, inference_backend="worker", **kwargs)


class SamplingPolicy(torch.nn.Module):
    """Draws its action from the policy's random stream: uniform over 5 actions."""

    def __init__(self) -> None:
        super().__init__()
        self.logits = torch.nn.Parameter(torch.zeros(5))

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        logits = self.logits.expand(obs.shape[0], 5)
        return torch.distributions.Categorical(logits=logits).sample()


class FailsInWorker(CountingPolicy):
    """Raises on its 20th call in a worker, never in the driver's probe."""

    def __init__(self, driver_pid: int) -> None:
        super().__init__()
        self.driver_pid = driver_pid
        self.calls = 0

    def forward(self, obs):
        self.calls += 1
        if os.getpid() != self.driver_pid and self.calls == 20:
            raise RuntimeError("the policy failed on purpose")
        return super().forward(obs)


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("splits", [1, 2])
def test_streams_are_whole_and_batches_exact(transport, splits):
    with worker_collector(transport, worker_splits=splits, total_frames=640) as c:
        board = c.server._board.name
        assert shm_exists(board)
        batches = list(c)
        stats = c.stats()
    assert all(b.batch_size[0] == 32 for b in batches) and len(batches) == 20
    check_counting_streams(collect(batches))
    # every transition's action came from its worker's own forward, two envs at a time
    assert stats["server"]["rows"] >= 640
    assert stats["server"]["batch_sizes"] == {2 // splits: stats["server"]["batches"]}
    assert 0 < stats["server"]["request_latency_p50"] <= stats["server"]["request_latency_p95"]
    assert not shm_exists(board), "the weights board is left after shutdown"


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_weight_update_reaches_every_worker_atomically(transport):
    # actions switch from 1 to 4 exactly where the stamped version goes from 0 to 1
    check_weight_update(
        lambda p: worker_collector(transport, p, n=4, total_frames=-1, frames_per_batch=16)
    )


def test_every_worker_starts_from_the_drivers_weights():
    # a factory builds a new policy in each worker; version 0 is still the driver's copy
    calls = iter(range(1, 100))
    with AsyncBatchedCollector(
        counting_envs(4),
        policy_factory=lambda: ConstantPolicy(next(calls)),
        inference_backend="worker",
        envs_per_worker=1,
        frames_per_batch=16,
        total_frames=160,
    ) as c:
        data = collect(c)
    assert bool((data["action"] == data["action"][0]).all())


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_on_policy_rounds_use_the_weights_of_every_update_before_them(transport):
    policy = ConstantPolicy(0)
    with worker_collector(
        transport, policy, n=4, on_policy=True, frames_per_batch=32, total_frames=-1
    ) as c:
        for k in range(5):  # CountingEnv takes actions 0-4
            batch = next(c)
            assert batch.batch_size == torch.Size([4, 8])
            assert bool((batch["policy_version"] == k).all())
            assert bool((batch["action"] == k).all()), "a round ran on older weights"
            with torch.no_grad():
                policy.value.fill_(k + 1)
            assert c.update_policy_weights_(policy) == k + 1


def test_a_seeded_sampling_policy_repeats_exactly():
    def run(seed):
        with worker_collector(
            "process_slots", SamplingPolicy(), seed=seed, total_frames=-1, frames_per_batch=32
        ) as c:
            batches, rows = [], torch.zeros(4, dtype=torch.long)
            while not bool((rows >= 16).all()):  # until every env delivered (no fairness)
                batches.append(next(c))
                rows += torch.bincount(batches[-1]["env_index"], minlength=4)
                assert len(batches) < 5000
            return collect(batches)

    def actions(data):
        # each env's actions in its own order; the run ends at a frame count, not at a
        # step of each env, so two runs hold different lengths of each stream
        out = {}
        for env, rows in streams(data).items():
            out[env] = rows["action"]
        return out

    first, again, other = actions(run(3)), actions(run(3)), actions(run(4))
    for env in range(4):
        n = min(len(first[env]), len(again[env]), len(other[env]))
        assert n >= 16
        assert torch.equal(first[env][:n], again[env][:n]), f"env {env} drew other actions"
        assert not torch.equal(first[env][:n], other[env][:n])
    assert len(torch.cat(list(first.values())).unique()) == 5


def test_a_policy_failure_names_its_worker():
    c = worker_collector("process_slots", FailsInWorker(os.getpid()), total_frames=-1)
    with c, pytest.raises(WorkerError, match="the policy failed on purpose") as info:
        for _ in range(1000):
            next(c)
    assert info.value.worker_index in (0, 1)


def test_a_killed_worker_restarts_on_the_newest_weights():
    policy = ConstantPolicy(1)
    with worker_collector(
        "process_slots", policy, n=4, frames_per_batch=16, total_frames=-1, max_worker_restarts=1
    ) as c:
        batches = [next(c) for _ in range(3)]
        with torch.no_grad():
            policy.value.fill_(4)
        assert c.update_policy_weights_(policy) == 1
        pid = c.transport.pids[1]
        os.kill(pid, signal.SIGKILL)
        wait_until(lambda: process_gone(pid), 30, "the killed worker to be gone")
        after = torch.zeros(4, dtype=torch.long)
        deadline = time.monotonic() + 300
        with pytest.warns(WorkerRestartWarning):
            while not bool((after >= 20).all()):
                batch = next(c)
                batches.append(batch)
                if c.stats()["worker_restarts"] == 1:
                    after += torch.bincount(batch["env_index"], minlength=4)
                # a hang guard, not a speed bound: the new worker imports torch before
                # its first step, while the other streams on (any number of batches)
                assert time.monotonic() < deadline, "the restarted worker delivers nothing"
    data = collect(batches)
    version = data["policy_version"]
    assert torch.equal(data["action"], torch.where(version == 0, 1, 4))
    for env in (2, 3):  # the restarted worker's envs: what it delivered last
        # (at least 20 rows since the restart, of which a held-back chunk of the old
        # worker, 4 steps, may be the first)
        assert bool((version[data["env_index"] == env][-8:] == 1).all()), (
            "a restarted worker acted on old weights"
        )


def test_cartpole_in_worker_processes():
    # a real gymnasium env and an MLP: every action is the policy's for its own row
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))

    class Greedy(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.net = mlp

        def forward(self, obs):
            return self.net(obs).argmax(-1)

    policy = Greedy()
    with AsyncBatchedCollector(
        [functools.partial(gym.make, "CartPole-v1")] * 4,
        policy,
        inference_backend="worker",
        envs_per_worker=2,
        frames_per_batch=64,
        total_frames=640,
    ) as c:
        data = collect(c)
    with torch.no_grad():
        assert torch.equal(data["action"], policy(data["observation"]))


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (dict(min_batch_size=2), ValueError, "has no server"),
        (dict(max_batch_size=4), ValueError, "has no server"),
        (dict(policy=UnpicklablePolicy()), TypeError, "cannot be pickled for the env workers"),
        (dict(policy=RecurrentCountingPolicy()), ValueError, "serves feed-forward policies"),
        (dict(policy_device="meta"), ValueError, "runs the policy inside each env worker"),
    ],
)
def test_bad_input_is_refused_at_construction(kwargs, error, match):
    policy = kwargs.pop("policy", CountingPolicy())
    with pytest.raises(error, match=match):
        AsyncBatchedCollector(
            counting_envs(2),
            policy,
            inference_backend="worker",
            frames_per_batch=8,
            total_frames=16,
            **kwargs,
        )


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("kind", ["stepped whole", "send/recv"])
def test_vector_envs_act_in_their_workers(transport, kind):
    """Vector envs' staged requests answered in their worker: every action reaches the
    sub-env whose observation chose it, streams are whole, batches exact."""
    if kind == "stepped whole":
        fns = [functools.partial(counting_vector, 3 * i, 3, "SameStep") for i in range(2)]
    else:  # results for an arbitrary subset of sub-envs, named by info["env_id"]
        fns = [functools.partial(CountingVectorEnv, 4 * i, 4, 2, order_seed=i) for i in range(2)]
    with AsyncBatchedCollector(
        fns,
        CountingPolicy(),
        transport=transport,
        inference_backend="worker",
        frames_per_batch=48,
        total_frames=960,
    ) as c:
        data = collect(c)
        assert c.stats()["server"]["batches"] > 0
    assert data.batch_size[0] == 960
    check_counting_streams(data)
    assert (data["policy_version"] == 0).all()


def test_a_vector_envs_seeded_sampling_policy_repeats_exactly():
    """One worker's own stream: the same actions for every sub-env in every run."""

    def run(seed):
        with AsyncBatchedCollector(
            [functools.partial(CountingVectorEnv, 0, 4, 2, order_seed=0)],
            SamplingPolicy(),
            inference_backend="worker",
            seed=seed,
            frames_per_batch=32,
            total_frames=256,
        ) as c:
            return {env: rows["action"] for env, rows in streams(collect(c)).items()}

    first, again, other = run(3), run(3), run(4)
    assert sorted(first) == [0, 1, 2, 3]
    for env in first:
        assert torch.equal(first[env], again[env]), f"env {env} drew other actions"
    assert any(not torch.equal(first[env], other[env]) for env in first)
