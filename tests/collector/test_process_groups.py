"""What a worker starts goes with it, and workers go with their driver.

Every child of the driver leads a process group of its own, killed whole when the child
ends, and holds a lifeline to the driver that tells it when the driver died
(``rlcollect/processes.py``, ``rlcollect/lifeline.py``). Each test uses real processes
and real signals: a helper process an env started, a driver killed with SIGKILL while an
env is inside a long call, Ctrl-C at the terminal (SIGINT to the driver's whole process
group) while the workers and the inference process are still starting.
"""

import functools
import os
import select
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from envs import ForksAHelper
from helpers import CountingPolicy, process_gone, shm_exists, wait_until, with_server_layout

from rlcollect import AsyncBatchedCollector, InferenceError
from rlcollect.errors import WorkerRestartWarning
from rlcollect.testing import CountingEnv

TESTS = str(Path(__file__).resolve().parents[1])
LIMIT = 60.0  # seconds a test waits for what it expects before it fails


def helpers_of(directory):
    """The pids of the helpers envs started, by file name (helper-<env>-<worker pid>)."""
    return {
        name: int((directory / name).read_text())
        for name in os.listdir(directory)
        if name.startswith("helper-") and not name.endswith(".part")
    }


def kill_left(pids):
    for pid in pids:
        if not process_gone(pid):
            os.kill(pid, signal.SIGKILL)


def helper_collector(directory, **kwargs):
    fns = [functools.partial(CountingEnv, 0), functools.partial(ForksAHelper, 1, str(directory))]
    return AsyncBatchedCollector(
        fns, CountingPolicy(), frames_per_batch=8, total_frames=-1, transport="process_slots",
        policy_device="cpu", **with_server_layout(kwargs),
    )  # fmt: skip


@pytest.mark.parametrize("backend", ["thread", "process"])
def test_a_process_an_env_started_ends_with_its_worker_at_shutdown(tmp_path, backend):
    c = helper_collector(tmp_path, inference_backend=backend)
    try:
        next(c)
        (helper,) = helpers_of(tmp_path).values()
        assert not process_gone(helper)
        c.shutdown()
        wait_until(lambda: process_gone(helper), timeout=LIMIT, what="the env's helper process")
    finally:
        c.shutdown()
        kill_left(helpers_of(tmp_path).values())


def test_a_process_an_env_started_ends_with_its_killed_worker(tmp_path):
    """Worker 1 killed (SIGKILL): its helper, which holds the worker's pipes open, goes
    with it as soon as the driver finds the worker dead, while collection goes on."""
    c = helper_collector(tmp_path, max_worker_restarts=1)
    try:
        next(c)
        ((name, helper),) = helpers_of(tmp_path).items()
        worker = c.transport.pids[1]
        assert name.endswith(f"-{worker}")
        os.kill(worker, signal.SIGKILL)
        with pytest.warns(WorkerRestartWarning, match=r"worker 1 .*killed by SIGKILL"):
            while c.stats()["worker_restarts"] == 0:
                next(c)
        wait_until(lambda: process_gone(helper), timeout=LIMIT, what="the dead worker's helper")
        next(c)  # collection goes on, the new worker with a helper of its own
        wait_until(lambda: len(helpers_of(tmp_path)) == 2, timeout=LIMIT, what="a new helper")
    finally:
        c.shutdown()
        kill_left(helpers_of(tmp_path).values())
    wait_until(
        lambda: all(process_gone(p) for p in helpers_of(tmp_path).values()),
        timeout=LIMIT,
        what="every helper",
    )


LONG_CALL_DRIVER = """
import functools, sys
sys.path.insert(0, {tests!r})
from envs import ForksAHelper, HangOnce
from helpers import CountingPolicy
from rlcollect import AsyncBatchedCollector
from rlcollect.testing import CountingEnv
fns = [functools.partial(HangOnce, 0, {marker!r}, at=(1, 2)),
       functools.partial(ForksAHelper, 1, {directory!r})]
c = AsyncBatchedCollector(fns, CountingPolicy(), frames_per_batch=8, total_frames=-1,
                          transport="process_slots", inference_backend={backend!r},
                          envs_per_worker=1, worker_splits=None,  # no timing probe: env 0
                          policy_device="cpu", stall_timeout=None)  # steps in its worker
pids = [*c.transport.pids] + ([c.server.pid] if {backend!r} == "process" else [])
print(",".join([c.transport.shm_name, *c.server.segments()]), *pids, flush=True)
for _ in c:
    pass
"""


@pytest.mark.parametrize("backend", ["thread", "process", "worker"])
def test_a_driver_killed_while_an_env_is_inside_a_long_call_leaves_nothing_behind(
    tmp_path, backend
):
    """Env 0 is inside a step that would last five minutes (no stall_timeout) when the
    driver is killed with SIGKILL: its worker notices the driver's death all the same,
    unlinks the ring (and the weights segment or board of the backend) and ends, and
    every helper an env started goes with its worker."""
    marker = str(tmp_path / "hung")
    script = LONG_CALL_DRIVER.format(
        tests=TESTS, marker=marker, directory=str(tmp_path), backend=backend
    )
    driver = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(script)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    pids = []
    try:
        ready, _, _ = select.select([driver.stdout], [], [], LIMIT)
        assert ready, "the driver did not print its pids (it hangs in its construction)"
        names, *pids = driver.stdout.readline().split()
        assert pids, driver.stderr.read()[-3000:]
        wait_until(lambda: os.path.exists(marker), timeout=LIMIT, what="env 0's long call")
        wait_until(lambda: helpers_of(tmp_path), timeout=LIMIT, what="env 1's helper")
        driver.kill()
        driver.wait(LIMIT)
        left = [int(p) for p in pids] + list(helpers_of(tmp_path).values())
        wait_until(lambda: all(process_gone(p) for p in left), timeout=LIMIT,
                   what="the workers, the inference process and the helpers")  # fmt: skip
        wait_until(lambda: not any(shm_exists(n) for n in names.split(",")), timeout=LIMIT,
                   what="the segments to be unlinked")  # fmt: skip
    finally:
        driver.kill()
        driver.wait(LIMIT)
        kill_left([int(p) for p in pids] + list(helpers_of(tmp_path).values()))


CTRL_C_FLOOD_DRIVER = """
import os, signal, sys, threading
sys.path.insert(0, {tests!r})
from helpers import counting_collector
# The driver survives Ctrl-C here (a script that catches it to save a checkpoint, say):
# what is tested is that no child of it dies of one.
received = []
signal.signal(signal.SIGINT, lambda *_: received.append(1))
done = threading.Event()

def ctrl_c():  # Ctrl-C at the terminal: SIGINT to the whole foreground process group
    while not done.is_set():
        os.killpg(0, signal.SIGINT)
        done.wait(0.002)

threading.Thread(target=ctrl_c, daemon=True).start()
try:
    c = counting_collector("process_slots", inference_backend={backend!r}, total_frames=-1)
    next(c)
finally:
    done.set()
c.shutdown()
print("collected after", len(received), "Ctrl-C", flush=True)
"""


@pytest.mark.parametrize("backend", ["thread", "process"])
def test_ctrl_c_at_the_terminal_during_start_up_kills_no_worker(backend):
    """SIGINT sent to the driver's whole process group, again and again while the
    collector starts: the workers and the inference process, starting or importing,
    never see it (process groups of their own; SIGINT ignored from their first line)."""
    script = CTRL_C_FLOOD_DRIVER.format(tests=TESTS, backend=backend)
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)],
        capture_output=True,
        text=True,
        timeout=300,
        start_new_session=True,  # a group of its own: the flood must not reach pytest
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "collected after" in done.stdout and " 0 Ctrl-C" not in done.stdout, done.stdout


def test_an_inference_process_killed_while_it_starts_is_named_so(tmp_path):
    """Not the policy's fault: the error says the process died while it started, how,
    and is an InferenceError (a policy that raises there stays a ValueError)."""
    import threading

    from helpers import slow_policy_in_child

    marker = tmp_path / "building"
    fns = [functools.partial(CountingEnv, i) for i in range(2)]
    factory = functools.partial(slow_policy_in_child, str(marker), os.getpid())

    def kill_it():
        wait_until(marker.exists, timeout=LIMIT, what="the inference process to build")
        os.kill(int(marker.read_text()), signal.SIGKILL)

    killer = threading.Thread(target=kill_it, daemon=True)
    killer.start()
    with pytest.raises(InferenceError, match=r"\(pid \d+\) died while it started .*SIGKILL"):
        AsyncBatchedCollector(
            fns, None, policy_factory=factory, frames_per_batch=8, total_frames=-1,
            transport="process_slots", inference_backend="process", policy_device="cpu",
        )  # fmt: skip
    killer.join(LIMIT)
