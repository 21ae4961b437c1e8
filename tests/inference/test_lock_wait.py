"""The server thread's watch on the interpreter lock (inference/lock_wait.py): a thread
busy in pure Python shows as a starved lock, and the collector's server thread warns."""

import functools
import threading
import time
import warnings

import pytest
from helpers import ConstantPolicy

from rlcollect import AsyncBatchedCollector, ReplayBuffer
from rlcollect.inference import lock_wait
from rlcollect.inference.lock_wait import LockWatch
from rlcollect.testing import CountingEnv

pytestmark = pytest.mark.skipif(
    lock_wait._core_seconds() is None, reason="the kernel keeps no scheduler statistics"
)


def _busy_in_python(stop: threading.Event) -> None:
    x = 0
    while not stop.is_set():  # never lets go of the lock before the switch interval
        x += 1


def test_a_thread_busy_in_python_starves_the_lock():
    """Checks until three of the last five waited half a switch interval (bounded: 60 s).
    Not every check does on a busy machine: where the busy thread is off its core when
    the lock is let go, nobody takes it."""
    stop = threading.Event()
    busy = threading.Thread(target=_busy_in_python, args=(stop,), daemon=True)
    busy.start()
    watch = LockWatch(every=0.0)
    deadline = time.monotonic() + 60
    try:
        while not watch.starved() and time.monotonic() < deadline:
            watch.check()
    finally:
        stop.set()
        busy.join(timeout=30)
    assert watch.starved(), list(watch.waits)


def test_alone_the_lock_is_not_starved():
    watch = LockWatch(every=0.0)
    for _ in range(5):
        watch.check()
    assert len(watch.waits) == 5 and not watch.starved(), list(watch.waits)


def test_checks_are_due_every_so_often():
    watch = LockWatch(every=3600.0)
    assert not watch.due(time.perf_counter())
    assert watch.due(time.perf_counter() + 3600.0)


def test_the_server_thread_warns_of_a_script_busy_in_python():
    """Background collection with the server thread, while this thread runs pure Python:
    the server warns, naming the remedy (bounded: 120 s)."""
    with (
        warnings.catch_warnings(record=True) as caught,
        AsyncBatchedCollector(
            [functools.partial(CountingEnv, i) for i in range(2)],
            ConstantPolicy(0.0),
            frames_per_batch=16,
            policy_device="cpu",
            transport="thread",
            inference_backend="thread",  # the server thread's warning
            replay_buffer=ReplayBuffer(1_000_000, seed=0),
        ) as c,  # fmt: skip
    ):
        warnings.simplefilter("always")
        c.start()
        deadline = time.monotonic() + 120
        x = 0
        while time.monotonic() < deadline and not any(
            "interpreter lock" in str(w.message) for w in caught
        ):
            for i in range(100_000):
                x += i
    ours = [w for w in caught if "interpreter lock" in str(w.message)]
    assert len(ours) == 1 and ours[0].category is RuntimeWarning
    assert "inference_backend='process'" in str(ours[0].message)
