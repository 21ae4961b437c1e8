"""The vector worker's thread under each privilege a user may run with: with
``CAP_SYS_NICE`` it takes ``DRIVER_NICE``; without it, as low as its ``RLIMIT_NICE``
allows; with neither, it keeps its niceness and still runs.

Each case is a fresh interpreter started through ``prlimit`` (the limit) and ``setpriv``
(``CAP_SYS_NICE`` dropped from the capabilities it execs with), as a worker process of a
user without the capability would be; setting those up needs root, and raising the
limit ``CAP_SYS_RESOURCE`` as well (containers often lack it: those cases are skipped
there)."""

import os
import shutil
import subprocess
import sys

import pytest

from rlcollect.worker.vector_priority import DRIVER_NICE

# A worker process: SCHED_BATCH, as process_slots starts it; then what vector_loop does
# first. Prints the thread's niceness and scheduling policy afterwards.
WORKER = """
import os, threading
from rlcollect.worker.vector_priority import schedule_as_the_envs_driver
os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
schedule_as_the_envs_driver(raise_priority={raise_priority})
me = threading.get_native_id()
print(os.getpriority(os.PRIO_PROCESS, me), os.sched_getscheduler(0) == os.SCHED_OTHER)
"""

pytestmark = pytest.mark.skipif(
    not hasattr(os, "SCHED_BATCH")
    or os.geteuid() != 0
    or shutil.which("prlimit") is None
    or shutil.which("setpriv") is None,
    reason="needs Linux, root, prlimit and setpriv to run a worker with fewer privileges",
)


def may_raise_the_limit():
    done = subprocess.run(["prlimit", "--nice=25:25", "true"], capture_output=True, timeout=60)
    return done.returncode == 0


def worker_niceness(*, rlimit_nice, cap_sys_nice, nice=0, raise_priority=True):
    command = ["nice", "-n", str(nice)]
    if rlimit_nice:
        command += ["prlimit", f"--nice={rlimit_nice}:{rlimit_nice}"]
    if not cap_sys_nice:
        command += ["setpriv", "--inh-caps=-sys_nice", "--bounding-set=-sys_nice"]
    command += [sys.executable, "-c", WORKER.format(raise_priority=raise_priority)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-3000:]
    niceness, other = done.stdout.split()
    assert other == "True"  # back on the normal policy, raised or not
    return int(niceness)


@pytest.mark.parametrize(
    "rlimit_nice, cap_sys_nice, nice, expected",
    [
        (0, True, 0, DRIVER_NICE),  # root: the capability is enough
        (0, False, 0, 0),  # neither: keeps its niceness
        (0, False, 3, 3),  # ... whatever it inherited
        (0, True, DRIVER_NICE - 5, DRIVER_NICE - 5),  # started lower: not raised the other way
        (25, False, 0, -5),  # a limit of 25 allows down to -5
        (25, False, 3, -5),
        (15, False, 0, 0),  # a limit that allows only 5 and up: nothing lower to take
        (20 - DRIVER_NICE + 5, False, 0, DRIVER_NICE),  # a limit past it: no lower than asked
    ],
    ids=str,
)
def test_the_thread_takes_the_lowest_niceness_it_may_down_to_driver_nice(
    rlimit_nice, cap_sys_nice, nice, expected
):
    if rlimit_nice and not may_raise_the_limit():
        pytest.skip("may not raise RLIMIT_NICE here (no CAP_SYS_RESOURCE)")
    assert worker_niceness(rlimit_nice=rlimit_nice, cap_sys_nice=cap_sys_nice, nice=nice) == (
        expected
    )


def test_a_thread_that_does_not_run_the_policy_keeps_its_niceness():
    assert worker_niceness(rlimit_nice=0, cap_sys_nice=True, nice=2, raise_priority=False) == 2
