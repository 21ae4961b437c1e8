"""stall_timeout: an env call that does not return, or a worker process that stopped,
ends in a WorkerError naming the env, the worker, the stage and how long (or a restart).

The stalls are real: an env blocked in its step or reset (``HangOnce``), a worker
process stopped with SIGSTOP. Every wait is bounded: the loops below give up with a
failure long before the tests' own timeout.
"""

import functools
import os
import signal
import time

import envs
import pytest
import torch
from envs import HangingFactory, HangOnce, StopsOnArrival
from helpers import (
    CountingPolicy,
    check_clean,
    counting_envs,
    first_error_within_bound,
    process_gone,
    wait_until,
    with_server_layout,
)
from test_restarts import check_restarted_streams, collect_past_restarts

from rlcollect import AsyncBatchedCollector, InferenceError, WorkerError
from rlcollect.errors import WorkerRestartWarning

STALL = 1.0  # seconds: short, since nothing but the stall itself waits on it
LIMIT = 60.0  # seconds a test waits for what it expects before it fails


@pytest.fixture(autouse=True)
def release_hung_threads():
    """HangOnce blocks worker *threads* until this is set; set it after each test."""
    envs.RELEASE_HANGS.clear()
    yield
    envs.RELEASE_HANGS.set()


def make(transport, fns, **kwargs):
    kwargs.setdefault("frames_per_batch", 8)
    kwargs.setdefault("total_frames", -1)
    kwargs.setdefault("stall_timeout", STALL)
    return AsyncBatchedCollector(
        fns, CountingPolicy(), transport=transport, policy_device="cpu",
        **with_server_layout(kwargs),
    )  # fmt: skip


def next_until_error(c):
    """Iterate ``c`` until it raises; fail if it has not within LIMIT seconds."""
    deadline = time.monotonic() + LIMIT
    with pytest.raises(WorkerError) as info:
        while time.monotonic() < deadline:
            next(c)
    return info.value


def test_an_env_stuck_in_step_is_a_named_error_with_its_stack(transport, tmp_path):
    fns = counting_envs(2)
    fns[1] = functools.partial(HangOnce, 1, str(tmp_path / "hung"), at=(0, 3))
    c = make(transport, fns)
    started = time.monotonic()
    error = next_until_error(c)
    waited = time.monotonic() - started
    message = str(error)
    assert "env 1 (worker 1) has not finished its step in" in message
    assert f"stalled (stall_timeout={STALL:g} s)" in message
    assert "the worker's Python stack" in message and "_hang_here" in message, message
    assert (error.worker_index, error.env_index) == (1, 1)
    assert waited < LIMIT
    c.shutdown()
    envs.RELEASE_HANGS.set()  # a thread cannot be stopped: it was left blocked until now
    check_clean(c)


def test_an_env_stuck_in_its_first_reset_holds_no_other_env_hostage(transport, tmp_path):
    """The first batch waits for every env's first request, but not beyond
    stall_timeout: env 0 delivers rows while env 1 is stuck, then the stall is raised."""
    fns = counting_envs(2)
    fns[1] = functools.partial(HangOnce, 1, str(tmp_path / "hung"), at=(0, 0), in_reset=True)
    c = make(transport, fns, stall_timeout=4.0)  # env 0 is served after 2 s, env 1 raised at 4
    rows = []
    deadline = time.monotonic() + LIMIT
    with pytest.raises(WorkerError, match=r"env 1 \(worker 1\) has not finished its reset"):
        while time.monotonic() < deadline:
            rows.append(next(c)["env_index"])
    assert rows and bool((torch.cat(rows) == 0).all()), "env 0 was held back"
    c.shutdown()
    envs.RELEASE_HANGS.set()
    check_clean(c)


def test_a_stuck_env_is_restarted_under_max_worker_restarts(tmp_path):
    fns = counting_envs(3)
    fns[1] = functools.partial(HangOnce, 1, str(tmp_path / "hung"), at=(1, 2))
    with (
        pytest.warns(WorkerRestartWarning, match=r"worker 1 \(envs 1\).*has not finished its step"),
        make("process_slots", fns, max_worker_restarts=1) as c,
    ):
        data = collect_past_restarts(c, restarts=1)
    assert check_restarted_streams(data) == {0: 0, 1: 1, 2: 0}
    check_clean(c)


def test_a_stopped_worker_process_is_a_named_error():
    c = make("process_slots", counting_envs(2))
    next(c)
    pid = c.transport.pids[0]
    os.kill(pid, signal.SIGSTOP)
    error = next_until_error(c)
    assert f"worker 0 (pid {pid}) has been stopped (SIGSTOP" in str(error)
    assert error.worker_index == 0
    c.shutdown()
    wait_until(lambda: process_gone(pid), what="the stopped worker to be killed")
    check_clean(c)


@pytest.mark.parametrize("backend", ["thread", "worker", "process"])
@pytest.mark.parametrize("workers", [1, 2])
def test_a_worker_stopped_before_its_first_request_is_a_named_error(backend, workers, tmp_path):
    """Worker 0 stops itself (SIGSTOP) while it unpickles its program: it has written
    no progress record and sent no request. It is found from its process all the same:
    with one worker next() would block without bound, with two its envs would be
    missing from every batch."""
    fns = [StopsOnArrival(str(tmp_path / "stopped"), 0, os.getpid()), *counting_envs(workers)[1:]]
    c = make("process_slots", fns, inference_backend=backend)
    pid = c.transport.pids[0]
    error = first_error_within_bound(c, LIMIT)  # one worker: next() itself must end
    assert isinstance(error, WorkerError), repr(error)
    assert f"worker 0 (pid {pid}) has been stopped (SIGSTOP" in str(error), str(error)
    assert error.worker_index == 0
    c.shutdown()
    wait_until(lambda: process_gone(pid), what="the stopped worker to be killed")
    check_clean(c)


def test_a_stopped_worker_process_is_restarted():
    with make("process_slots", counting_envs(2), max_worker_restarts=1) as c:
        # Stop it only once env 1 has delivered rows: its stream then shows the rebuild
        # (on a busy machine the first batches may come from env 0 alone).
        first = next(c)
        while not bool((first["env_index"] == 1).any()):
            first = torch.cat([first, next(c)])
            assert first.batch_size[0] < 2000, "env 1 delivered nothing"
        pid = c.transport.pids[1]
        os.kill(pid, signal.SIGSTOP)
        with pytest.warns(WorkerRestartWarning, match=r"worker 1 .* has been stopped"):
            data = torch.cat([first, collect_past_restarts(c, restarts=1)])
        assert c.transport.pids[1] != pid
    assert check_restarted_streams(data) == {0: 0, 1: 1}
    check_clean(c)


def test_a_stopped_inference_process_is_a_named_error():
    c = make("process_slots", counting_envs(2), inference_backend="process")
    next(c)
    pid = c.server.pid
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + LIMIT
    with pytest.raises(InferenceError, match=rf"inference process \(pid {pid}\) has been stopped"):
        while time.monotonic() < deadline:
            next(c)
    c.shutdown()
    wait_until(lambda: process_gone(pid), what="the stopped inference process to be killed")
    check_clean(c)


def test_waiting_for_the_learner_is_no_stall(transport):
    """Workers blocked on a full ring while the learner takes its time (three
    stall_timeouts here) are not stalled: no env call is under way."""
    with make(transport, counting_envs(2), stall_timeout=0.5) as c:
        next(c)
        time.sleep(1.5)  # the learner "learning"; the workers wait for free slots
        for _ in range(5):
            next(c)


def test_an_env_factory_that_never_returns_is_a_named_error_at_construction(tmp_path):
    """Env 0 is built once in the driver (the probe) before anything starts: a factory
    that never returns there is a WorkerError after stall_timeout, not a hang."""
    fn = functools.partial(HangingFactory, str(tmp_path / "hung"))
    started = time.monotonic()
    with pytest.raises(WorkerError, match=r"env_fns\[0\] has not returned an env in 1 s"):
        make("process_slots", [fn, *counting_envs(1)])
    assert time.monotonic() - started < LIMIT


@pytest.mark.parametrize("layout", ["given", "auto"])
def test_an_env_stuck_in_the_probes_reset_is_a_named_error_at_construction(tmp_path, layout):
    """The probe also resets and steps env 0 in the driver (for info_keys, and to time it
    where the layout is left to the collector): an env stuck there is a WorkerError after
    stall_timeout too, not a constructor that never returns."""
    fns = [functools.partial(HangOnce, 0, str(tmp_path / "hung"), in_reset=True)]
    fns += counting_envs(1)
    kwargs = {"info_keys": ("step",)}  # env 0 reset and stepped once
    if layout == "auto":  # env 0 timed: reset and stepped for a while
        kwargs = {"inference_backend": "auto", "envs_per_worker": "auto", "worker_splits": "auto"}
    started = time.monotonic()
    with pytest.raises(WorkerError, match=r"env_fns\[0\] has not returned an env in 1 s.*reset"):
        make("process_slots", fns, **kwargs)
    assert time.monotonic() - started < LIMIT
    assert (tmp_path / "hung").exists()  # it did hang there


@pytest.mark.parametrize("value", [0, -1.0, True, "60"])
def test_stall_timeout_must_be_positive_seconds_or_none(value):
    with pytest.raises(ValueError, match="stall_timeout must be a number of seconds > 0"):
        make("thread", counting_envs(1), stall_timeout=value)


def test_stall_timeout_none_disables_the_watch(transport):
    with make(transport, counting_envs(2), stall_timeout=None, total_frames=64) as c:
        assert sum(b.batch_size[0] for b in c) == 64
