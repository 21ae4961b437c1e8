"""A declared vector env is built once, in worker 0's process (``collector/env0.py``,
``transports/first_worker.py``): never in the driver, whatever the probe needs; its
failures while built there are the probe's errors, and nothing outlives them.

Constructions are counted across processes through a file each constructor appends its
process id to (``envs.LoggedVector``).
"""

import functools
import os

import gymnasium as gym
import pytest
from envs import (
    RELEASE_HANGS,
    LoggedVector,
    VectorDying,
    VectorHanging,
    VectorRaising,
    logged_info_vector,
    plain_declared_vector,
)
from helpers import (
    CountingPolicy,
    check_counting_streams,
    collect,
    interrupt,
    process_gone,
    start_driver,
    wait_until,
    with_server_layout,
)

from rlcollect import AsyncBatchedCollector, WorkerError
from rlcollect.testing import CountingVectorEnv
from rlcollect.worker.source import declares_vector


def logged(log, vector_envs=2, n=4, batch=2):
    return [
        functools.partial(LoggedVector, str(log), n * i, n, batch, order_seed=i)
        for i in range(vector_envs)
    ]


def builders(log):
    """Process ids that built an env, one per construction."""
    return [int(line) for line in log.read_text().split()]


@pytest.mark.parametrize(
    "layout",
    [
        {},  # every layout knob "auto"
        {"transport": "process_slots", "inference_backend": "thread"},
        {"transport": "process_slots", "inference_backend": "worker", "envs_per_worker": 2},
    ],
    ids=["auto", "server-thread", "in-worker-policy"],
)
def test_a_declared_vector_env_is_built_once_in_its_worker_never_in_the_driver(tmp_path, layout):
    log = tmp_path / "built"
    with AsyncBatchedCollector(
        logged(log),
        CountingPolicy(),
        frames_per_batch=16,
        total_frames=160,
        policy_device="cpu",
        **layout,
    ) as c:
        data = collect(c)
        pids = c.transport.pids
    check_counting_streams(data)
    built = builders(log)
    assert os.getpid() not in built  # the driver built none: not even to probe
    assert set(built) <= set(pids), built  # each in the worker that runs it
    # Worker 0 built its factories once each, env 0 included (before the plan, for the
    # probe); the others theirs, at most once each (the budget may be met before).
    per_worker = 2 // len(pids)
    assert built.count(pids[0]) == per_worker, built
    assert all(built.count(pid) <= per_worker for pid in pids[1:]), built
    wait_until(lambda: all(process_gone(p) for p in pids), what="worker processes")


def test_with_info_keys_the_driver_still_builds_no_vector_env(tmp_path):
    """The probe steps env 0 for the info fields: worker 0's process then builds its
    own (a stepped env is not as its factory built it), the driver none."""
    log = tmp_path / "built"
    with AsyncBatchedCollector(
        [functools.partial(logged_info_vector, str(log), 0, 2)],
        CountingPolicy(),
        frames_per_batch=8,
        total_frames=32,
        policy_device="cpu",
        info_keys=["lives"],
        **with_server_layout({"transport": "process_slots"}),
    ) as c:
        data = collect(c)
        (pid,) = c.transport.pids
    assert data["next", "info", "lives"].shape == (32,)
    assert builders(log) == [pid, pid]


def test_a_plain_env_declared_vector_on_a_thread_gives_its_process_back(tmp_path):
    """A factory that says vector but builds a plain env, for which the rules choose one
    worker thread: worker 0's process is ended, and the thread builds env 0 again."""
    log = tmp_path / "built"
    with AsyncBatchedCollector(
        [functools.partial(plain_declared_vector, str(log))],
        CountingPolicy(),
        frames_per_batch=8,
        total_frames=32,
        policy_device="cpu",
    ) as c:
        assert c.describe().transport == "thread"
        collect(c)
    first, again = builders(log)
    assert again == os.getpid() != first
    wait_until(lambda: process_gone(first), what="worker 0's process")


def test_a_declared_vector_env_that_raises_is_the_probes_error():
    with pytest.raises(ValueError, match="env_fns\\[0\\] raised while building the probe env: "):
        AsyncBatchedCollector(
            [functools.partial(VectorRaising, 0, 4, 2)],
            CountingPolicy(),
            frames_per_batch=8,
            policy_device="cpu",
            transport="process_slots",
        )


def test_a_worker_process_that_dies_building_env_0_is_a_named_error():
    with pytest.raises(WorkerError, match=r"worker 0.s process died while it built env 0.*SIGKILL"):
        AsyncBatchedCollector(
            [functools.partial(VectorDying, 0, 4, 2)],
            CountingPolicy(),
            frames_per_batch=8,
            policy_device="cpu",
            transport="process_slots",
        )


def test_a_vector_env_stuck_in_its_constructor_is_a_stall_and_its_process_ends(tmp_path):
    marker = tmp_path / "building"
    try:
        with pytest.raises(WorkerError, match=r"has not returned an env in 1 s.*stalled"):
            AsyncBatchedCollector(
                [functools.partial(VectorHanging, str(marker), 0, 4, 2)],
                CountingPolicy(),
                frames_per_batch=8,
                policy_device="cpu",
                transport="process_slots",
                stall_timeout=1.0,
            )
        pid = int(marker.read_text())
        assert pid != os.getpid()
        wait_until(lambda: process_gone(pid), what="worker 0's process")
    finally:
        RELEASE_HANGS.set()  # for a hang in this process, had it been built here
        RELEASE_HANGS.clear()


CTRL_C_DRIVER = """
import functools, signal, sys
signal.signal(signal.SIGINT, signal.default_int_handler)  # as test_collector.py says
sys.path.insert(0, {tests!r})
from envs import VectorHanging
from helpers import CountingPolicy
from rlcollect import AsyncBatchedCollector
AsyncBatchedCollector([functools.partial(VectorHanging, {marker!r}, 0, 4, 2)],
                      CountingPolicy(), frames_per_batch=8, policy_device="cpu",
                      transport="process_slots")
"""


def test_ctrl_c_while_env_0_is_built_leaves_no_process(tmp_path):
    marker = tmp_path / "building"
    driver = start_driver(CTRL_C_DRIVER, marker=str(marker))
    try:
        wait_until(marker.exists, timeout=120, what="worker 0's process to build env 0")
        pid = int(marker.read_text())
        interrupt(driver)
    finally:
        driver.kill()
    wait_until(lambda: process_gone(pid), what="worker 0's process")


def test_which_factories_declare_a_vector_env():
    def annotated() -> gym.vector.VectorEnv:
        raise AssertionError("never called")

    def unannotated():
        raise AssertionError("never called")

    assert declares_vector(CountingVectorEnv)
    assert declares_vector(functools.partial(CountingVectorEnv, 0, 4, 2))
    assert declares_vector(gym.make_vec)
    assert declares_vector(functools.partial(annotated))
    assert not declares_vector(unannotated)
    assert not declares_vector(functools.partial(gym.make, "CartPole-v1"))
