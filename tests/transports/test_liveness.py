"""A worker process that dies is noticed from the process itself, not only from its pipe's
end of file, which does not come while another process holds a copy of the pipe."""

import os
import signal
import subprocess
import sys
import textwrap

from helpers import process_gone, wait_until

DRIVER = """
import functools, subprocess, sys
sys.path.insert(0, {tests!r})
from helpers import CountingPolicy
from rlcollect import AsyncBatchedCollector, WorkerError
from rlcollect.testing import CountingEnv


class Forking(CountingEnv):
    # Starts a process that inherits every inheritable descriptor of the worker, the
    # write end of its reports pipe included, and outlives it.
    def __init__(self, env_id, pidfile):
        super().__init__(env_id)
        child = subprocess.Popen(
            ["sleep", "120"], close_fds=False,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,  # not the test's pipes
        )
        with open(pidfile, "w") as f:
            f.write(str(child.pid))


fns = [functools.partial(CountingEnv, 0), functools.partial(Forking, 1, {pidfile!r})]
c = AsyncBatchedCollector(fns, CountingPolicy(), frames_per_batch=8, total_frames=-1,
                          transport="process_slots", policy_device="cpu",
                          inference_backend="thread", envs_per_worker=1, worker_splits=None)
next(c)
print(c.transport.pids[1], flush=True)
sys.stdin.readline()  # the test kills worker 1, then says go
try:
    for _ in c:
        pass
except WorkerError as error:
    print("WorkerError", error.worker_index, error, flush=True)
"""


def test_a_dead_worker_is_noticed_while_its_pipe_is_held_open(tmp_path):
    tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    pidfile = str(tmp_path / "grandchild")
    script = textwrap.dedent(DRIVER.format(tests=tests, pidfile=pidfile))
    driver = subprocess.Popen(
        [sys.executable, "-c", script],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    grandchild = None
    try:
        worker = int(driver.stdout.readline())
        with open(pidfile) as f:
            grandchild = int(f.read())
        os.kill(worker, signal.SIGKILL)
        wait_until(lambda: process_gone(worker), what="the worker to die")
        assert not process_gone(grandchild)  # it still holds the reports pipe open
        out, err = driver.communicate("go\n", timeout=60)
    finally:
        driver.kill()
        if grandchild is not None and not process_gone(grandchild):
            os.kill(grandchild, signal.SIGKILL)
    assert "WorkerError 1 " in out and "killed by SIGKILL" in out, (out, err[-3000:])
