"""Vector envs as env sources: the guarantees (docs/architecture.md) for their sub-envs.

Gymnasium's SyncVectorEnv (stepped whole, every autoreset mode) and
rlcollect.testing.CountingVectorEnv (send/recv returning an arbitrary subset of
sub-envs, as native asynchronous vector envs do) over CountingEnvs, whose observations
tell which env, episode and step they are; on both transports.
"""

import functools
import threading

import gymnasium as gym
import pytest
import torch
from envs import (
    LyingIds,
    NoneRewardsVector,
    StepCounter,
    StepCountingVector,
    async_factories,
    cartpole,
    counting_vector,
    failing_vector,
    sync_factories,
)
from helpers import (
    CountingPolicy,
    check_counting_streams,
    collect,
    process_gone,
    shm_exists,
    streams,
    wait_until,
    with_server_layout,
)

from rlcollect import AsyncBatchedCollector, WorkerError
from rlcollect.testing import CountingEnv, CountingVectorEnv

MODES = ["NextStep", "SameStep", "Disabled"]


def run(env_fns, transport, **kwargs):
    kwargs.setdefault("frames_per_batch", 50)
    kwargs.setdefault("total_frames", 1500)
    kwargs.setdefault("policy_device", "cpu")
    with AsyncBatchedCollector(env_fns, CountingPolicy(), transport=transport, **kwargs) as c:
        data = collect(c)
    return c, data


def check_env_indices(data, num_envs):
    """Every row names one of the ``num_envs`` envs (``check_counting_streams``: its own).
    Which workers' envs made the budget is the scheduler's choice: a worker process that
    starts late beside busy processes may make none before it is met (a Ray test saw
    this), so no env is required to appear. (One worker's envs all appear: see
    ``test_a_vector_env_reusing_its_result_arrays_gives_whole_streams``.)"""
    ids = set(data["env_index"].unique().tolist())
    assert ids and ids <= set(range(num_envs)), ids


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("envs_per_worker", [1, 2])
def test_sync_vector_envs_give_whole_streams(transport, mode, envs_per_worker):
    c, data = run(sync_factories(4, 3, mode), transport, envs_per_worker=envs_per_worker)
    assert c.num_envs == 12
    assert data.batch_size[0] == 1500
    check_counting_streams(data)  # routing, order, no gap, reset steps never transitions
    check_env_indices(data, 12)


@pytest.mark.parametrize("mode", MODES)
def test_a_vector_env_reusing_its_result_arrays_gives_whole_streams(transport, mode):
    # SyncVectorEnv(copy=False) writes each step's observations, and in Disabled mode
    # its partial resets, into the array the last step returned: nothing of a result
    # may be read after the env is next stepped or reset.
    fns = [functools.partial(counting_vector, 3 * i, 3, mode, copy=False) for i in range(2)]
    _, data = run(fns, transport, envs_per_worker=2, frames_per_batch=60, total_frames=1200)
    check_counting_streams(data)
    # Whole vector envs only; which of the two workers delivers first is the scheduler's.
    ids = set(data["env_index"].unique().tolist())
    assert ids in ({0, 1, 2}, {3, 4, 5}, set(range(6))), ids


@pytest.mark.parametrize("mode", ["NextStep", "SameStep"])
@pytest.mark.parametrize(
    ("envs_per_worker", "sub_envs", "batch"), [(1, 4, 2), (2, 4, 1), (2, 5, 3)]
)
def test_async_vector_envs_route_by_env_id(transport, mode, envs_per_worker, sub_envs, batch):
    c, data = run(
        async_factories(4, sub_envs, batch, mode), transport, envs_per_worker=envs_per_worker
    )
    assert c.num_envs == 4 * sub_envs
    check_counting_streams(data)
    check_env_indices(data, 4 * sub_envs)
    # requests carry the sub-envs one result returned: batches are whole requests
    sizes = c.stats()["server"]["batch_sizes"]
    assert all(size % batch == 0 for size in sizes), sizes


def test_exact_budgets_with_vector_envs(transport):
    _, data = run(async_factories(2, 4, 2), transport, frames_per_batch=37, total_frames=500)
    assert data.batch_size[0] == 500
    check_counting_streams(data)
    with AsyncBatchedCollector(
        sync_factories(2, 3),
        CountingPolicy(),
        frames_per_batch=37,
        total_frames=500,
        transport=transport,
        policy_device="cpu",
    ) as c:
        sizes = [b.batch_size[0] for b in c]
    assert sizes == [37] * 13 + [500 - 37 * 13]


def test_chunks_of_vector_envs_hold_steps_of_every_sub_env(transport):
    c, data = run(sync_factories(2, 3), transport, transition_chunk_size=9, total_frames=900)
    assert c.transition_chunk_size == 9
    check_counting_streams(data)


def cartpole_vector(n):
    return gym.vector.SyncVectorEnv([cartpole] * n)


class CartPolePolicy(torch.nn.Module):
    def forward(self, obs):
        return (obs[:, 2] + 0.1 * obs[:, 3] > 0).long()


def cartpole_streams(env_fns, **kwargs):
    with AsyncBatchedCollector(
        env_fns,
        CartPolePolicy(),
        frames_per_batch=40,
        total_frames=2000,
        policy_device="cpu",
        seed=11,
        **with_server_layout(kwargs),
    ) as c:
        return streams(collect(c))


def test_sync_vector_streams_equal_the_per_env_streams():
    """Sub-env i is seeded seed + i, as env i is: the same transitions, whatever the path."""
    runs = [
        cartpole_streams([cartpole] * 4, transport="process_slots"),
        cartpole_streams([functools.partial(cartpole_vector, 2)] * 2, transport="thread"),
        cartpole_streams(
            [functools.partial(cartpole_vector, 1)] * 4,
            transport="process_slots",
            envs_per_worker=2,
            transition_chunk_size=6,
        ),
    ]
    for i in range(4):
        n = min(len(run[i]) for run in runs)
        assert n > 50
        for run in runs[1:]:
            for key in ("observation", ("next", "observation"), "action", ("next", "done")):
                assert torch.equal(runs[0][i][key][:n], run[i][key][:n]), f"env {i}: {key}"
            assert torch.equal(runs[0][i]["episode"][:n], run[i]["episode"][:n])


# ------------------------------------------------------------------ bad input


class NoSendRecv(gym.vector.SyncVectorEnv):
    """Claims a batch_size below num_envs but cannot be driven with send/recv."""

    def __init__(self):
        super().__init__([functools.partial(CountingEnv, j) for j in range(4)])
        self.batch_size = 2


def build(env_fns, **kwargs):
    kwargs.setdefault("frames_per_batch", 8)
    kwargs.setdefault("total_frames", 16)
    kwargs.setdefault("policy_device", "cpu")
    kwargs.setdefault("transport", "thread")
    return AsyncBatchedCollector(env_fns, CountingPolicy(), **kwargs)


@pytest.mark.parametrize(
    ("env_fns", "kwargs", "match"),
    [
        ([NoSendRecv], {}, r"batch_size=2 < num_envs=4 but without send\(\) and recv\(\)"),
        (
            [functools.partial(CountingVectorEnv, 0, 4, 2, autoreset_mode="Disabled")],
            {},
            "driven asynchronously .* autoreset mode Disabled",
        ),
        (
            sync_factories(4, 2),
            {"envs_per_worker": 2, "worker_splits": 1},
            "each of a worker's envs_per_worker=2 vector envs is a group of its own",
        ),
        (
            sync_factories(2, 3),
            {"transition_chunk_size": 4},
            r"not a multiple of the 3 envs of a worker \(envs_per_worker=1, 3 sub-envs each\)",
        ),
    ],
)
def test_bad_vector_configurations(env_fns, kwargs, match):
    with pytest.raises(ValueError, match=match):
        build(env_fns, **kwargs)


def test_factories_that_build_different_vector_envs_are_rejected(transport):
    fns = [*sync_factories(1, 3), functools.partial(counting_vector, 3, 2)]
    with (
        pytest.raises(WorkerError, match=r"has 2 sub-envs .* env_fns\[0\] built one with 3"),
        build(fns, transport=transport, total_frames=-1) as c,
    ):
        for _ in c:
            pass


@pytest.mark.parametrize("backend", ["thread", "worker"])
def test_a_vector_env_naming_wrong_sub_envs_is_an_error(transport, backend):
    # backend "worker": the check runs after the actions are sent (vector_worker.py)
    with (
        pytest.raises(WorkerError, match="not all of them had an action or a reset") as info,
        build(
            [functools.partial(LyingIds, 0, 4, 2)],
            transport=transport,
            inference_backend=backend,
            total_frames=-1,
        ) as c,
    ):
        for _ in c:
            pass
    assert info.value.env_index == 0


def test_an_error_inside_a_vector_env_names_its_envs(transport):
    fns = [*sync_factories(1, 3), failing_vector]
    with (
        pytest.raises(WorkerError, match=r"env 3 .* vector env of envs 3-5") as info,
        build(fns, transport=transport, total_frames=-1) as c,
    ):
        for _ in c:
            pass
    assert info.value.env_index == 3
    assert "failed on purpose in step" in str(info.value.__cause__)


def test_a_vector_env_returning_rewards_of_none_is_an_error(transport):
    with (
        pytest.raises(WorkerError, match=r"rewards \[None, None\] .*real numbers") as info,
        build(
            [functools.partial(NoneRewardsVector, 0, 2, 2)], transport=transport, total_frames=64
        ) as c,
    ):
        for batch in c:
            assert not batch["next", "reward"].isnan().any(), "None was stored as NaN"
    assert info.value.env_index == 0
    assert "the step results check" in str(info.value)


def test_in_flight_transitions_of_vector_envs_are_bounded_for_a_slow_consumer():
    StepCounter.steps = 0
    fns = [functools.partial(StepCountingVector, 4 * i, 4, 2) for i in range(2)]
    with build(fns, frames_per_batch=16, total_frames=-1, transition_chunk_size=8) as c:
        # the ring (2 slots of 2 steps of 4 envs per worker), one transition under way
        # per env, and what the batch builder keeps beyond a batch: it takes every ready
        # chunk, up to the whole ring (32 rows), on top of fewer than 16, so after a
        # batch of 16 it holds at most 15 + 32 - 16
        bound = 2 * 2 * 2 * 4 + 8 + (15 + 32 - 16)
        taken = 0
        for _ in range(3):
            taken += next(c).batch_size[0]
            threading.Event().wait(0.3)  # a slow learner: the workers get time to run ahead
            assert StepCounter.steps <= taken + bound, (StepCounter.steps, taken)


def test_shutdown_leaves_nothing_behind(transport):
    c = build(async_factories(2, 4, 2), transport=transport, total_frames=-1)
    next(c)
    c.shutdown()
    c.shutdown()
    t = c.transport
    if transport == "process_slots":
        wait_until(lambda: all(process_gone(p) for p in t.pids), what="worker processes")
        assert not shm_exists(t.shm_name)
    else:
        wait_until(lambda: not any(t.alive), what="worker threads")
