"""worker_splits: a worker's envs in groups, each with a request of its own outstanding."""

import functools

import pytest
import torch
from envs import cartpole, counting_vector
from helpers import (
    CountingPolicy,
    check_counting_streams,
    collect,
    counting_collector,
    streams,
)

from rlcollect import AsyncBatchedCollector, WorkerError
from rlcollect.testing import CountingEnv


@pytest.mark.parametrize(("envs_per_worker", "splits"), [(2, 2), (4, 2), (4, 4), (3, 3)])
def test_groups_keep_every_stream_whole_and_routed(transport, envs_per_worker, splits):
    with counting_collector(
        transport,
        n=12,
        envs_per_worker=envs_per_worker,
        worker_splits=splits,
        frames_per_batch=60,
        total_frames=1800,
    ) as c:
        assert c.worker_splits == splits
        data = collect(c)
    assert data.batch_size[0] == 1800
    check_counting_streams(data)


CUDA = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


@pytest.mark.parametrize(
    ("device", "envs_per_worker", "splits"),
    [
        ("cpu", 4, 1),  # the server's time is the envs' cores': no split
        pytest.param("cuda", 1, 1, marks=CUDA),
        pytest.param("cuda", 4, 2, marks=CUDA),  # the fewest groups above one
        pytest.param("cuda", 3, 3, marks=CUDA),
    ],
)
def test_auto_splits_a_worker_only_for_a_gpu_policy(device, envs_per_worker, splits):
    with counting_collector(
        "process_slots",
        n=2 * envs_per_worker,
        envs_per_worker=envs_per_worker,
        worker_splits="auto",
        policy_device=device,
        frames_per_batch=12 * envs_per_worker,
        total_frames=120 * envs_per_worker,
    ) as c:
        assert c.worker_splits == splits
        data = collect(c)
        if splits > 1:  # a request is one group: a policy call serves whole groups
            sizes = c.stats()["server"]["batch_sizes"]
            assert all(size % (envs_per_worker // splits) == 0 for size in sizes), sizes
    check_counting_streams(data)


def test_a_worker_holds_one_request_per_group_at_once(transport):
    """One worker, two envs, two groups: a request is one env, and the server, told to
    wait for two rows, gets them at once, so both groups' requests are outstanding."""
    with counting_collector(
        transport,
        n=2,
        envs_per_worker=2,
        worker_splits=2,
        min_batch_size=2,
        batch_timeout=10.0,
        frames_per_batch=20,
        total_frames=200,
    ) as c:
        data = collect(c)
        server = c.stats()["server"]
    check_counting_streams(data)
    assert server["batch_sizes"] == {2: server["batches"]}


def cartpole_streams(**kwargs):
    class Policy(torch.nn.Module):
        def forward(self, obs):
            return (obs[:, 2] + 0.1 * obs[:, 3] > 0).long()

    with AsyncBatchedCollector(
        [cartpole] * 4,
        Policy(),
        frames_per_batch=40,
        total_frames=2000,
        policy_device="cpu",
        seed=3,
        # the server, as written: each batch answers every env that waits, where worker
        # threads that run the policy themselves may leave one env behind when busy
        inference_backend="thread",
        **kwargs,
    ) as c:
        return streams(collect(c))


def test_streams_do_not_depend_on_the_split():
    runs = [
        cartpole_streams(transport="thread", envs_per_worker=1),
        cartpole_streams(transport="process_slots", envs_per_worker=2, worker_splits=2),
        cartpole_streams(transport="thread", envs_per_worker=4, worker_splits=4),
        cartpole_streams(transport="process_slots", envs_per_worker=4, worker_splits=1),
    ]
    for i in range(4):
        n = min(len(run[i]) for run in runs)
        assert n > 50
        for run in runs[1:]:
            for key in ("observation", "action", ("next", "observation"), ("next", "done")):
                assert torch.equal(runs[0][i][key][:n], run[i][key][:n]), f"env {i}: {key}"


def test_default_splits():
    with counting_collector("thread", n=4, envs_per_worker=1, total_frames=32) as c:
        assert c.worker_splits == 1
    with counting_collector("thread", n=3, envs_per_worker=3, total_frames=32) as c:
        assert c.worker_splits == 1
    with counting_collector("thread", n=4, envs_per_worker=2, total_frames=32) as c:
        assert c.worker_splits == 1  # measured: splitting did not pay on the CPU
    fns = [functools.partial(counting_vector, 3 * i, 3) for i in range(4)]
    with AsyncBatchedCollector(
        fns, CountingPolicy(), frames_per_batch=8, total_frames=16, envs_per_worker=2,
        transport="thread", policy_device="cpu",
    ) as c:  # fmt: skip
        assert c.worker_splits == 2  # each vector env is a group


def test_an_env_error_in_the_second_group_names_the_env(transport):
    fns = [functools.partial(CountingEnv, i) for i in range(4)]
    fns[3] = functools.partial(CountingEnv, 3, fail_at=(0, 2))
    with (
        pytest.raises(WorkerError, match=r"env 3 .* failed on purpose in step") as info,
        AsyncBatchedCollector(
            fns,
            CountingPolicy(),
            frames_per_batch=8,
            total_frames=-1,
            envs_per_worker=4,
            worker_splits=2,
            transport=transport,
            policy_device="cpu",
        ) as c,
    ):
        for _ in c:
            pass
    assert info.value.env_index == 3
