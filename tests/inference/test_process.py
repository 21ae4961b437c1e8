"""The "process" inference backend: the server in its own process, weights over shm."""

import functools
import os
import signal
import time

import pytest
import torch
from envs import async_factories
from helpers import (
    CountingPolicy,
    FailingPolicy,
    ListBuffer,
    UnpicklablePolicy,
    check_clean,
    check_counting_streams,
    check_weight_update,
    collect,
    counting_collector,
    counting_envs,
    forking_policy_in_child,
    process_gone,
    shm_exists,
    wait_until,
)

from rlcollect import AsyncBatchedCollector, InferenceError
from rlcollect.collector.batches.delivery import POOL_BLOCKS
from rlcollect.errors import RemoteTraceback


def process_collector(policy=None, **kwargs):
    return counting_collector("process_slots", policy, inference_backend="process", **kwargs)


def check_backend_gone(c):
    backend = c.server
    wait_until(lambda: process_gone(backend.pid), what="the inference process to exit")
    assert not shm_exists(backend.shm_name)
    check_clean(c)


def test_streams_and_budget():
    with process_collector(total_frames=640, frames_per_batch=64) as c:
        assert c.server.pid != os.getpid()
        batches = list(c)
    assert [b.batch_size[0] for b in batches] == [64] * 10
    assert c.stats()["server"]["rows"] >= 640  # the final figures outlive the process
    check_counting_streams(torch.cat(batches))
    check_backend_gone(c)


def test_batches_view_blocks_of_a_pooled_ring_the_server_reads_by_slot():
    """Envs stepped one by one whose chunk of every worker is a batch: the ring is
    pooled, the inference process gathers and scatters each request by the slot its
    worker writes, and batches are lent views of it. The server answers no env before
    every env has asked, which keeps the workers in step: then at least a third of the
    batches are lent (tests/collector/batches/test_pooled.py says why)."""
    with process_collector(
        n=8, envs_per_worker=2, worker_splits=2, frames_per_batch=128, total_frames=1280,
        min_batch_size=8, batch_timeout=30.0,
    ) as c:  # fmt: skip
        kept = [b.clone() for b in c]
        stats = c.stats()
    assert stats["batches"] == 10 and stats["lent_batches"] >= 4
    check_counting_streams(torch.cat(kept))
    check_backend_gone(c)


@pytest.mark.parametrize("mode", ["NextStep", "SameStep"])
def test_asynchronous_vector_envs_give_whole_streams(mode):
    """Vector envs whose results name arbitrary subsets of their sub-envs, each in a
    worker process, served from the inference process: every action reaches the sub-env
    whose observation chose it, and every batch holds whole requests."""
    fns = async_factories(3, 4, 2, mode)
    with AsyncBatchedCollector(
        fns,
        CountingPolicy(),
        frames_per_batch=50,
        total_frames=900,
        inference_backend="process",
        policy_device="cpu",
    ) as c:
        data = collect(c)
        sizes = c.stats()["server"]["batch_sizes"]
    assert c.num_envs == 12
    assert data.batch_size[0] == 900
    check_counting_streams(data)  # routing, order, no gap, reset steps never transitions
    assert set(data["env_index"].unique().tolist()) <= set(range(12))
    assert sizes and all(size % 2 == 0 for size in sizes), sizes
    check_backend_gone(c)


def test_weight_updates_are_versioned():
    check_weight_update(lambda policy: process_collector(policy, total_frames=-1))


def test_many_updates_in_flight_land_in_order():
    """50 updates in a row land in order, and the last one reaches the data once the
    rows written before it are through: a pooled ring (four envs, a chunk of each a
    batch) holds at most POOL_BLOCKS batches of them, so within POOL_BLOCKS + 1."""
    policy = CountingPolicy()
    with process_collector(policy, total_frames=-1) as c:
        next(c)
        versions = [c.update_policy_weights_(policy) for _ in range(50)]
        assert versions == list(range(1, 51))
        assert c.server.wait_applied(50, timeout=30)
        data = collect(next(c) for _ in range(POOL_BLOCKS + 1))
    assert int(data["policy_version"].max()) == 50
    check_backend_gone(c)


def test_mismatched_weights_are_rejected_before_anything_changes():
    with process_collector(total_frames=-1) as c:
        with pytest.raises(KeyError, match="missing"):
            c.update_policy_weights_({})
        with pytest.raises(ValueError, match="shape"):
            c.update_policy_weights_({"scale": torch.ones(3)})
        assert c.policy_version == 0
        next(c)


def test_policy_factory_builds_the_policy_in_the_inference_process():
    refused = r"policy cannot be pickled .* use inference_backend='thread'"
    with pytest.raises(TypeError, match=refused):
        process_collector(UnpicklablePolicy())
    c = AsyncBatchedCollector(
        counting_envs(4),
        policy_factory=UnpicklablePolicy,
        frames_per_batch=32,
        total_frames=320,
        policy_device="cpu",
        inference_backend="process",
    )
    with c:
        data = collect(c)
    check_counting_streams(data)
    check_backend_gone(c)


def test_policy_error_reaches_the_caller_with_its_traceback():
    c = process_collector(FailingPolicy(fail_on_call=20), total_frames=-1, frames_per_batch=4)
    with pytest.raises(InferenceError, match="policy failed on purpose") as info:
        for _ in c:
            pass
    assert isinstance(info.value.__cause__, RemoteTraceback)
    assert 'raise RuntimeError("policy failed on purpose")' in str(info.value.__cause__)
    check_backend_gone(c)


def test_a_killed_inference_process_reaches_the_caller():
    c = process_collector(total_frames=-1)
    next(c)
    os.kill(c.server.pid, signal.SIGKILL)
    with pytest.raises(InferenceError, match="died"):
        for _ in c:
            pass
    check_backend_gone(c)


def test_a_killed_inference_process_is_found_while_its_status_pipe_stays_open(tmp_path):
    """Its death is seen from the process itself: a process it started still holds the
    status pipe's write end, so that pipe's end of file never comes."""
    pidfile = tmp_path / "grandchild"
    factory = functools.partial(forking_policy_in_child, str(pidfile), os.getpid())
    c = AsyncBatchedCollector(
        counting_envs(2),
        None,
        policy_factory=factory,
        frames_per_batch=8,
        total_frames=-1,
        inference_backend="process",
        policy_device="cpu",
    )
    grandchild = int(pidfile.read_text())
    try:
        next(c)
        pid = c.server.pid
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 60
        with pytest.raises(InferenceError, match=rf"\(pid {pid}\) died: killed by SIGKILL"):
            while time.monotonic() < deadline:
                next(c)
        check_backend_gone(c)
    finally:
        os.kill(grandchild, signal.SIGKILL)


def test_pause_holds_the_inference_process():
    rb = ListBuffer()
    with process_collector(replay_buffer=rb, total_frames=-1) as c:
        c.start()
        wait_until(lambda: rb.rows() >= 64, what="two batches")
        with c.pause():
            served = c.stats()["server"]["batches"]
            rows = rb.rows()
            # a window in which a running collector would write several batches
            assert not threading_event().wait(0.3)
            assert c.stats()["server"]["batches"] == served
            assert rb.rows() == rows
        wait_until(lambda: rb.rows() > rows, what="collection to go on after the pause")
    check_backend_gone(c)


def threading_event():
    import threading

    return threading.Event()


def test_bad_combinations_are_refused():
    with pytest.raises(ValueError, match="needs transport='process_slots'"):
        counting_collector("thread", inference_backend="process")
    with pytest.raises(ValueError, match="inference_backend must be one of"):
        counting_collector("thread", inference_backend="gpu")
    with pytest.raises(TypeError, match="exactly one of policy and policy_factory"):
        AsyncBatchedCollector(counting_envs(2), frames_per_batch=8, policy_device="cpu")
    with pytest.raises(TypeError, match="exactly one of policy and policy_factory"):
        AsyncBatchedCollector(
            counting_envs(2),
            CountingPolicy(),
            policy_factory=CountingPolicy,
            frames_per_batch=8,
            policy_device="cpu",
        )
    with pytest.raises(TypeError, match="policy_factory must be a zero-argument callable"):
        AsyncBatchedCollector(
            counting_envs(2), policy_factory=3, frames_per_batch=8, policy_device="cpu"
        )


DRIVER = """
import sys
sys.path.insert(0, {tests!r})
from helpers import counting_collector
c = counting_collector("process_slots", inference_backend="process", total_frames=-1)
next(c)
print(c.transport.shm_name, c.server.shm_name, c.server.pid, *c.transport.pids, flush=True)
sys.stdin.read()
"""


def test_driver_killed_with_sigkill_leaves_nothing_behind():
    import subprocess
    import sys
    from pathlib import Path

    tests = str(Path(__file__).resolve().parents[1])
    driver = subprocess.Popen(
        [sys.executable, "-c", DRIVER.format(tests=tests)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        ring, weights, *pids = driver.stdout.readline().split()
        assert shm_exists(ring) and shm_exists(weights)
        driver.kill()
        driver.wait(10)
        wait_until(lambda: all(process_gone(int(p)) for p in pids), what="orphaned processes")
        wait_until(lambda: not shm_exists(ring), what="the ring segment to be unlinked")
        wait_until(lambda: not shm_exists(weights), what="the weights segment to be unlinked")
    finally:
        driver.kill()
        driver.wait(10)


ABANDONED = """
import os, sys, threading
from rlcollect.inference.process import _exit_if_abandoned
read, write = os.pipe()
ready = threading.Event()
if sys.argv[1] == "ready":
    ready.set()  # as after the policy is built: a message wakes the thread, which ends
watcher = threading.Thread(target=_exit_if_abandoned, args=(read, ready, sys.argv[2]))
watcher.start()
os.write(write, b"x") if sys.argv[1] == "ready" else os.close(write)
watcher.join(60)
print("still running", flush=True)  # only where the watcher let the process go on
"""


@pytest.mark.parametrize("when", ["building", "ready"])
def test_an_inference_process_exits_once_abandoned_while_it_builds_its_policy(tmp_path, when):
    """The driver stopping (Ctrl-C) while the policy is still being built closes the
    control pipe: the inference process exits at once and unlinks its weights segment,
    instead of being killed after the driver's grace period. Once ready, a message on
    the pipe leaves it running."""
    import subprocess
    import sys

    from rlcollect.processes import create_segment, unlink_segment

    name, segment = create_segment(f"rlcollect-test-abandoned-{when}-", 64)
    segment.close()
    try:
        done = subprocess.run(
            [sys.executable, "-c", ABANDONED, when, name],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr
        if when == "building":
            assert "still running" not in done.stdout
            assert not shm_exists(name)
        else:
            assert "still running" in done.stdout
            assert shm_exists(name)
    finally:
        unlink_segment(name)
