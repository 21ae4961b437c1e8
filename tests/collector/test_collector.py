"""The guarantees (docs/architecture.md), on every transport, with real gymnasium envs."""

import functools
import gc
import sys
import threading
import time

import pytest
import torch
from envs import DictObsEnv, RaisesUnprintable, StepCounter, TorchProbeEnv, cartpole
from helpers import (
    SERVER_LAYOUT,
    CountingPolicy,
    FailingPolicy,
    ListBuffer,
    check_clean,
    check_counting_streams,
    check_weight_update,
    collect,
    counting_collector,
    counting_envs,
    interrupt,
    process_gone,
    shm_exists,
    start_driver,
    streams,
    wait_until,
    with_server_layout,
)
from tensordict.nn import TensorDictModule

from rlcollect import AsyncBatchedCollector, CollectorError, InferenceError, WorkerError
from rlcollect.collector.checks import envs_per_worker_of, usable_cores
from rlcollect.testing import CountingEnv


def make(transport, n=4, policy=None, **kwargs):
    return counting_collector(transport, policy, n, **kwargs)


# ------------------------------------------------------------------ budgets and keys


def test_batches_are_exact_and_total_is_exact(transport):
    with make(transport, frames_per_batch=37, total_frames=500) as c:
        sizes = [b.batch_size[0] for b in c]
    assert sizes == [37] * 13 + [500 - 37 * 13]


@pytest.mark.parametrize(("transport", "steps"), [("thread", 256), ("process_slots", 64)])
def test_worker_threads_hand_over_a_batch_in_one_chunk(transport, steps):
    # Each hand-over between a worker thread and the consumer's thread passes the
    # interpreter lock, so "auto" gives a worker thread the batch's 256 steps of each
    # env in one chunk; worker processes keep chunks of at most 64 steps.
    layout = {"inference_backend": "worker", "envs_per_worker": 4}
    with make(transport, frames_per_batch=1024, total_frames=3072, **layout) as c:
        assert c.transition_chunk_size == steps * 4
        data = collect(c)
    assert data.batch_size[0] == 3072
    check_counting_streams(data)


def test_batch_keys_shapes_and_dtypes(transport):
    with make(transport, total_frames=64) as c:
        batch = next(iter(c))
    keys = set(batch.keys(include_nested=True, leaves_only=True))
    assert keys == {
        "observation",
        "action",
        "value",
        "policy_version",
        "env_index",
        "episode",
        "step",
        ("next", "observation"),
        ("next", "reward"),
        ("next", "terminated"),
        ("next", "truncated"),
        ("next", "done"),
        ("next", "episode_return"),  # every transition carries the episode's running
        ("next", "episode_length"),  # return and length, this step included
    }
    assert batch["observation"].shape == (32, 4) and batch["observation"].dtype == torch.int64
    assert batch[("next", "episode_return")].dtype == torch.float32
    assert batch[("next", "episode_length")].dtype == torch.int64
    assert batch["action"].dtype == torch.int64 and batch["action"].shape == (32,)
    assert batch[("next", "reward")].dtype == torch.float32
    for key in ("terminated", "truncated", "done"):
        assert batch[("next", key)].dtype == torch.bool
    for key in ("policy_version", "env_index", "episode", "step"):
        assert batch[key].dtype == torch.int64


def test_endless_collection_until_shutdown(transport):
    c = make(transport, total_frames=-1, frames_per_batch=16)
    got = []
    for batch in c:
        got.append(batch.batch_size[0])
        if len(got) == 5:
            break
    c.shutdown()
    assert got == [16] * 5
    with pytest.raises(CollectorError, match="shut down"):
        next(c)


def test_iteration_resumes_after_break(transport):
    with make(transport, total_frames=96) as c:
        first = next(iter(c))
        rest = list(c)
    assert [b.batch_size[0] for b in [first, *rest]] == [32, 32, 32]


# ------------------------------------------------------------------ routing and streams


@pytest.mark.parametrize(
    "options",
    [
        {"envs_per_worker": 1, "transition_chunk_size": 1},
        {"envs_per_worker": 2, "transition_chunk_size": 8},
        {"envs_per_worker": 3, "transition_chunk_size": "auto", "max_batch_size": 3},
        {
            "envs_per_worker": 1,
            "transition_chunk_size": 5,
            "min_batch_size": 6,
            "batch_timeout": 0.5,
        },
    ],
    ids=["chunk1", "k2-chunk8", "k3-auto-max3", "chunk5-min6"],
)
def test_routing_and_per_env_streams(transport, options):
    with make(transport, n=6, frames_per_batch=50, total_frames=1500, **options) as c:
        data = collect(c)
    assert data.batch_size[0] == 1500
    check_counting_streams(data)


def test_server_batches_respect_min_and_max(transport):
    with make(transport, n=4, min_batch_size=4, batch_timeout=5.0, total_frames=200) as c:
        list(c)
        sizes = c.stats()["server"]["batch_sizes"]
    assert set(sizes) == {4}, sizes
    with make(
        transport, n=4, min_batch_size=2, max_batch_size=2, batch_timeout=5.0, total_frames=200
    ) as c:
        list(c)
        sizes = c.stats()["server"]["batch_sizes"]
    assert set(sizes) == {2}, sizes


class CartPolePolicy(torch.nn.Module):
    """Deterministic and exact (a comparison), so batch composition cannot change it."""

    def forward(self, obs):
        return (obs[:, 2] + 0.1 * obs[:, 3] > 0).long()


def cartpole_streams(**kwargs):
    with AsyncBatchedCollector(
        [cartpole] * 4, CartPolePolicy(), policy_device="cpu", seed=123,
        **with_server_layout(kwargs),
    ) as c:  # fmt: skip
        return streams(collect(c))


def test_reproducible_across_transports_chunks_and_batches():
    runs = [
        cartpole_streams(
            transport="thread",
            frames_per_batch=16,
            total_frames=2000,
            transition_chunk_size=1,
            max_batch_size=1,
        ),
        cartpole_streams(transport="process_slots", frames_per_batch=64, total_frames=2000),
        cartpole_streams(
            transport="process_slots",
            frames_per_batch=40,
            total_frames=2000,
            envs_per_worker=2,
            transition_chunk_size=6,
            min_batch_size=4,
        ),
    ]
    for i in range(4):
        # How far each env got is the scheduler's: a starved worker's env may have few
        # steps (32 of 500 on a heavily loaded machine); each compared stream is non-empty.
        n = min(len(run[i]) for run in runs)
        assert n > 0
        ref = runs[0][i][:n]
        for run in runs[1:]:
            other = run[i][:n]
            for key in (
                "observation",
                ("next", "observation"),
                "action",
                ("next", "reward"),
                ("next", "done"),
                "episode",
                "step",
            ):
                assert torch.equal(ref[key], other[key]), f"env {i} differs in {key}"
    # and the seed matters: envs differ from each other
    assert not torch.equal(runs[0][0]["observation"][:5], runs[0][1]["observation"][:5])


# ------------------------------------------------------------------ weights and versions


def test_weight_updates_are_versioned(transport):
    check_weight_update(
        lambda policy: make(transport, policy=policy, frames_per_batch=40, total_frames=-1),
        before=1,
        after=20,
    )


def test_update_weights_rejects_mismatched_weights(transport):
    with make(transport) as c:
        with pytest.raises(KeyError, match="missing"):
            c.update_policy_weights_({"nope": torch.zeros(1)})
        with pytest.raises(ValueError, match="shape"):
            c.update_policy_weights_({"scale": torch.zeros(3)})
        assert c.policy_version == 0


# ------------------------------------------------------------------ other conventions


def test_dict_observations_and_box_actions_with_a_tensordict_module(transport):
    module = TensorDictModule(
        lambda pos, cells: (pos * 0.1, cells.float().mean((1, 2))),
        in_keys=[("observation", "pos"), ("observation", "grid", "cells")],
        out_keys=["action", "cell_mean"],
    )
    with AsyncBatchedCollector(
        [functools.partial(DictObsEnv, i) for i in range(3)],
        module,
        frames_per_batch=30,
        total_frames=90,
        transport=transport,
        policy_device="cpu",
    ) as c:
        data = collect(c)
    assert data["observation", "grid", "cells"].dtype == torch.uint8
    assert data["action"].dtype == torch.float32 and data["action"].shape == (90, 2)
    assert torch.allclose(data["action"], data["observation", "pos"] * 0.1)
    assert torch.equal(data["cell_mean"], data["env_index"].float())
    assert torch.equal(data["next", "observation", "pos"][:, 0], data["env_index"].float())


# ------------------------------------------------------------------ failures


def test_env_error_in_step_reaches_the_caller(transport):
    fns = counting_envs(4)
    fns[2] = functools.partial(CountingEnv, 2, fail_at=(1, 2))
    c = AsyncBatchedCollector(
        fns,
        CountingPolicy(),
        frames_per_batch=8,
        total_frames=-1,
        transport=transport,
        policy_device="cpu",
        **SERVER_LAYOUT,
    )
    t0 = time.monotonic()
    with pytest.raises(WorkerError, match=r"env 2 .* failed on purpose in step") as info:
        for _ in c:
            assert time.monotonic() - t0 < 10, "the error never arrived"
    assert info.value.env_index == 2
    assert "CountingEnv.step" in str(info.value.__cause__) or "in step" in str(info.value.__cause__)
    assert "Traceback" in str(info.value.__cause__)
    check_clean(c)


def test_an_env_error_whose_str_raises_still_names_the_env_and_its_type(transport):
    """The worker's report survives an exception it cannot print: the env and the
    exception's type are named at once, neither a stall nor a bare exit status."""
    fns = [*counting_envs(1), functools.partial(RaisesUnprintable, 1)]
    c = AsyncBatchedCollector(
        fns, CountingPolicy(), frames_per_batch=8, transport=transport, policy_device="cpu",
        **SERVER_LAYOUT,
    )  # fmt: skip
    with pytest.raises(WorkerError, match=r"env 1 \(worker 1\) raised Unprintable: <") as info:
        list(c)
    assert info.value.env_index == 1
    assert "str() of this exception fails" in str(info.value)  # why it cannot be shown
    assert "RaisesUnprintable" in str(info.value.__cause__) or "step" in str(info.value.__cause__)
    check_clean(c)


def test_env_error_in_reset_reaches_the_caller(transport):
    fns = counting_envs(2)
    fns[1] = functools.partial(CountingEnv, 1, fail_at=(2, 0), fail_in_reset=True)
    c = AsyncBatchedCollector(
        fns,
        CountingPolicy(),
        frames_per_batch=8,
        total_frames=-1,
        transport=transport,
        policy_device="cpu",
    )
    with pytest.raises(WorkerError, match=r"env 1 .* in reset") as info:
        for _ in c:
            pass
    assert info.value.env_index == 1
    check_clean(c)


def test_policy_error_reaches_the_caller(transport):
    c = make(transport, policy=FailingPolicy(fail_on_call=20), total_frames=-1, frames_per_batch=4)
    with pytest.raises(InferenceError, match="policy failed on purpose") as info:
        for _ in c:
            pass
    assert isinstance(info.value.__cause__, RuntimeError)
    check_clean(c)


def test_policy_error_unblocks_workers_without_a_consumer():
    c = make("process_slots", policy=FailingPolicy(fail_on_call=2), total_frames=-1)
    # nobody iterates: the server's failure alone must end every worker
    wait_until(
        lambda: all(code is not None for code in c.transport.exit_codes),
        what="workers to exit after the policy failed",
    )
    with pytest.raises(InferenceError):
        next(c)
    c.shutdown()


def test_shutdown_is_idempotent_and_leaves_nothing(transport):
    c = make(transport, total_frames=-1)
    next(c)
    c.shutdown()
    c.shutdown()
    check_clean(c)


def test_weights_can_be_pushed_after_every_batch_including_the_last(transport):
    policy = CountingPolicy()
    with make(transport, policy=policy, total_frames=96) as c:
        versions = []
        for _batch in c:
            versions.append(c.update_policy_weights_(policy))
    assert versions == [1, 2, 3]
    check_clean(c)


def test_budget_end_shuts_down_by_itself(transport):
    c = make(transport, total_frames=64)
    assert len(list(c)) == 2
    check_clean(c)
    with pytest.raises(StopIteration):
        next(c)


def test_garbage_collection_cleans_up():
    c = make("process_slots", total_frames=-1)
    next(c)
    t = c.transport
    del c
    gc.collect()
    wait_until(lambda: all(process_gone(p) for p in t.pids), what="worker processes")
    assert not shm_exists(t.shm_name)


def test_error_inside_the_with_block_cleans_up():
    with pytest.raises(ZeroDivisionError), make("process_slots", total_frames=-1) as c:
        next(c)
        1 / 0  # noqa: B018
    check_clean(c)


# ------------------------------------------------------------------ workers and memory


def test_worker_processes_do_not_import_torch():
    fns = [functools.partial(TorchProbeEnv, i) for i in range(2)]
    with AsyncBatchedCollector(
        fns,
        CountingPolicy(),
        frames_per_batch=8,
        total_frames=16,
        transport="process_slots",
        policy_device="cpu",
        inference_backend="thread",  # the policy in the workers would import torch there
    ) as c:
        data = collect(c)
    assert "torch" in sys.modules  # the driver has it ...
    assert bool((data["observation"][:, 3] < 1000).all())  # ... the workers do not


def test_in_flight_transitions_are_bounded_for_a_slow_consumer():
    StepCounter.steps = 0
    fns = [functools.partial(StepCounter, i) for i in range(4)]
    with AsyncBatchedCollector(
        fns,
        CountingPolicy(),
        frames_per_batch=16,
        total_frames=-1,
        transport="thread",
        transition_chunk_size=4,
        policy_device="cpu",
        **SERVER_LAYOUT,  # given: nothing to time, so env 0 is not stepped (StepCounter)
    ) as c:
        ring = 4 * 2 * 4  # envs * slots * steps per chunk
        # What the batch builder keeps beyond a batch: it takes every ready chunk, up to
        # the whole ring, on top of fewer than 16 rows (one 4-row chunk short of a batch),
        # so after a batch of 16 it holds at most 12 + ring - 16 (the same count as the
        # vector-env twin in test_vector_envs.py).
        kept = 12 + ring - 16
        taken = 0
        for _ in range(3):
            taken += next(c).batch_size[0]
            threading.Event().wait(0.3)  # a slow learner: the workers get time to run ahead
            # at most: what was delivered, what the builder keeps, the whole ring, one
            # step per env
            assert StepCounter.steps <= taken + kept + ring + 4, StepCounter.steps


def test_replay_buffer_receives_every_batch(transport):
    rb = ListBuffer()
    with make(transport, replay_buffer=rb, total_frames=100) as c:
        yielded = collect(c)
    assert torch.equal(torch.cat(rb.parts)["observation"], yielded["observation"])


CTRL_C_DRIVER = """
import faulthandler, functools, signal, sys
faulthandler.register(signal.SIGUSR1)  # the test asks for every thread's stack if it hangs
# A script started from a terminal gets Ctrl-C as KeyboardInterrupt; a test run started
# in the background of a non-interactive shell (cmd &) inherits SIGINT ignored, and so
# would this driver. Be the script the test is about.
signal.signal(signal.SIGINT, signal.default_int_handler)
from rlcollect import AsyncBatchedCollector
from rlcollect.testing import CountingEnv
sys.path.insert(0, {tests!r})
from helpers import CountingPolicy
c = AsyncBatchedCollector([functools.partial(CountingEnv, i) for i in range(3)],
                          CountingPolicy(), frames_per_batch=8, total_frames=-1,
                          transport="process_slots", policy_device="cpu")
it = iter(c)
next(it)
print(c.transport.shm_name, *c.transport.pids, flush=True)
for _ in it:
    pass
"""


def test_ctrl_c_in_the_driver_leaves_nothing_behind():
    import os
    import signal
    import subprocess

    driver = start_driver(CTRL_C_DRIVER)
    try:
        name, *pids = driver.stdout.readline().split()
        assert pids, driver.stderr.read()
        os.kill(driver.pid, signal.SIGINT)
        try:
            # Under 1.2 s here with two CPU hogs beside it (25 runs); the bound is for a
            # machine far busier than that, and a hang fails, with every thread's stack.
            _, err = driver.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            os.kill(driver.pid, signal.SIGUSR1)  # written at once, from the C handler
            threading.Event().wait(1.0)  # a moment for the dump to reach the pipe
            driver.kill()
            _, err = driver.communicate(timeout=10)
            raise AssertionError(f"the driver did not exit after Ctrl-C:\n{err[-6000:]}") from None
    finally:
        driver.kill()
    assert driver.returncode != 0
    assert "KeyboardInterrupt" in err, err[-2000:]
    wait_until(lambda: all(process_gone(int(p)) for p in pids), what="worker processes")
    assert not shm_exists(name)


CTRL_C_AT_START_DRIVER = """
import functools, os, signal, sys
signal.signal(signal.SIGINT, signal.default_int_handler)  # as CTRL_C_DRIVER says
sys.path.insert(0, {tests!r})
from helpers import slow_policy_in_child
from rlcollect import AsyncBatchedCollector
from rlcollect.testing import CountingEnv
factory = functools.partial(slow_policy_in_child, {marker!r}, os.getpid())
AsyncBatchedCollector([functools.partial(CountingEnv, i) for i in range(2)], None,
                      policy_factory=factory,
                      frames_per_batch=8, total_frames=-1, transport="process_slots",
                      inference_backend="process", policy_device="cpu")
"""


def children(pid):
    """Process ids whose parent is ``pid``, from /proc."""
    import os

    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/status") as f:
                    status = f.read()
            except OSError:
                continue
            if f"\nPPid:\t{pid}\n" in status:
                found.append(int(entry))
    return found


def segments_of(pids):
    """The /dev/shm names mapped by processes ``pids``."""
    names = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/maps") as f:
                shm = [line for line in f if "/dev/shm/" in line]
            names.update(line.split("/dev/shm/")[1].strip() for line in shm)
        except OSError:
            pass
    return names


def test_ctrl_c_while_the_inference_process_starts_leaves_nothing_behind(tmp_path):
    """Ctrl-C while the driver waits for the inference process (its policy is being
    built there): KeyboardInterrupt, and no process or segment is left."""

    marker = tmp_path / "building"
    driver = start_driver(CTRL_C_AT_START_DRIVER, marker=str(marker))
    try:
        wait_until(marker.exists, timeout=120, what="the inference process to build its policy")
        kids = children(driver.pid)
        names = segments_of(kids)
        assert len(kids) == 3, kids  # two workers and the inference process
        assert names, "no segment mapped"
        interrupt(driver)
    finally:
        driver.kill()
    wait_until(lambda: all(process_gone(p) for p in kids), what="the driver's children")
    assert [n for n in names if shm_exists(n)] == []


def test_collectors_in_a_loop_leak_no_fds_processes_or_segments(transport):
    import os

    def fds():
        return len(os.listdir("/proc/self/fd"))

    with make(transport, total_frames=64) as c:  # warm up imports and lazy state
        list(c)
    before_fds, before_threads = fds(), threading.active_count()
    names = []  # this test's own segments: other tests on the machine make theirs
    for _ in range(5):
        with make(transport, total_frames=-1) as c:
            next(c)
            if transport == "process_slots":
                names.append(c.transport.shm_name)
        check_clean(c)
    assert fds() == before_fds
    assert [n for n in names if shm_exists(n)] == []
    wait_until(lambda: threading.active_count() == before_threads, what="threads to end")


class FrozenLakePolicy(torch.nn.Module):
    def forward(self, obs):  # obs: [B] int64 cell index
        return obs % 4


class PendulumPolicy(torch.nn.Module):
    def forward(self, obs):  # obs: [B, 3] float32 → action [B, 1] float32
        return {"action": obs[:, :1].clamp(-2, 2) * 0.5}


def test_scalar_observations_of_a_discrete_space(transport):
    from envs import frozen_lake

    with AsyncBatchedCollector(
        [frozen_lake] * 3,
        FrozenLakePolicy(),
        frames_per_batch=20,
        total_frames=60,
        transport=transport,
        policy_device="cpu",
    ) as c:
        data = collect(c)
    assert data["observation"].shape == (60,) and data["observation"].dtype == torch.int64
    assert torch.equal(data["action"], data["observation"] % 4)
    for rows in streams(data).values():
        inner = ~rows["next", "done"][:-1]
        assert torch.equal(rows["next", "observation"][:-1][inner], rows["observation"][1:][inner])


def test_box_actions_with_more_envs_per_worker_than_max_batch_size(transport):
    from envs import pendulum

    with AsyncBatchedCollector(
        [pendulum] * 4,
        PendulumPolicy(),
        frames_per_batch=100,
        total_frames=900,
        transport=transport,
        envs_per_worker=4,
        worker_splits=1,
        max_batch_size=2,
        policy_device="cpu",
    ) as c:
        data = collect(c)
        sizes = c.stats()["server"]["batch_sizes"]
    assert set(sizes) == {4}  # a request is never split: one worker's 4 envs per batch
    assert data["action"].shape == (900, 1) and data["action"].dtype == torch.float32
    assert torch.allclose(data["action"], data["observation"][:, :1].clamp(-2, 2) * 0.5)
    ends = data[data["next", "done"]]
    assert bool(ends["next", "truncated"].all()) and ends.numel() >= 4  # 200-step limit
    assert torch.equal(ends["step"], torch.full_like(ends["step"], 199))


def test_auto_envs_per_worker_resolves_and_collects(transport):
    # "auto" groups the envs into about one worker per core of this machine; every env's
    # stream is still complete and in order.
    cores = usable_cores()
    with make(transport, n=6, envs_per_worker="auto", frames_per_batch=48, total_frames=480) as c:
        assert c.envs_per_worker == envs_per_worker_of("auto", 6, cores)
        data = collect(c)
        # a policy call serves whole requests: each of a worker's envs_per_worker envs
        sizes = c.stats()["server"]["batch_sizes"]
    assert sizes and all(size % c.envs_per_worker == 0 for size in sizes), sizes
    assert data.batch_size[0] == 480
    check_counting_streams(data)
