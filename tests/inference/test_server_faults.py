"""The inference server thread dying outside the policy call: a clear InferenceError
reaches the caller within a bounded wait, every worker stops, nothing hangs."""

import os
import re
import threading
from collections.abc import Callable

import pytest
import torch
from envs import Unprintable
from helpers import (
    RELEASE_STUCK,
    SERVER_LAYOUT,
    STUCK,
    CountingPolicy,
    StuckPolicy,
    check_clean,
    counting_envs,
    first_error_within_bound,
    process_gone,
    respond_raising_after,
    wait_until,
)

from rlcollect import AsyncBatchedCollector, InferenceError, WorkerError
from rlcollect.transports import ProcessSlotTransport, ThreadQueueTransport


class TurnsAfter(CountingPolicy):
    """From its ``at``-th call on, returns its output passed through ``change``: the policy
    call itself succeeds, but what it returns is no longer what was probed at construction."""

    def __init__(self, at: int, change: Callable[[dict[str, torch.Tensor]], None]) -> None:
        super().__init__()
        self.calls = 0
        self.at = at
        self.change = change

    def forward(self, obs: torch.Tensor) -> dict[str, torch.Tensor]:
        out = super().forward(obs)
        self.calls += 1
        if self.calls >= self.at:
            self.change(out)
        return out


def wider_value(out: dict[str, torch.Tensor]) -> None:
    """A ``value`` of another shape: the server's scatter refuses it."""
    out["value"] = out["value"][:, None].expand(-1, 3)


def double_value(out: dict[str, torch.Tensor]) -> None:
    """A float64 ``value`` where it was float32: a cast would round it quietly."""
    out["value"] = out["value"].double() + 1e-12


def unprintable(out: dict[str, torch.Tensor]) -> None:
    """The policy raises an exception whose ``str()`` and ``repr()`` raise."""
    raise Unprintable("lost")


def float_action(out: dict[str, torch.Tensor]) -> None:
    """Float actions (the same numbers plus a half) where they were integers: a cast
    would truncate them quietly."""
    out["action"] = out["action"].double() + 0.5


@pytest.mark.parametrize(
    ("change", "cause", "message"),
    [
        (wider_value, ValueError, "policy output ('value',) has shape (3,) per env, but it had ()"),
        (float_action, TypeError, "policy output ('action',) is float64 now, but it was int64"),
        (double_value, TypeError, "policy output ('value',) is float64 now, but it was float32"),
        (unprintable, Unprintable, "Unprintable: <unprintable Unprintable: str() raised"),
    ],
    ids=["shape", "dtype", "extra-dtype", "unprintable"],
)
def test_output_that_changes_after_construction_reaches_the_caller_named(
    transport, change, cause, message
):
    c = AsyncBatchedCollector(
        counting_envs(3),
        TurnsAfter(5, change),
        frames_per_batch=8,
        total_frames=-1,
        transport=transport,
        policy_device="cpu",
        **SERVER_LAYOUT,  # the server's faults: the policy in the workers has none
    )
    error = first_error_within_bound(c)
    assert isinstance(error, InferenceError), repr(error)
    assert isinstance(error.__cause__, cause), repr(error.__cause__)
    assert "inference server failed" in str(error) and message in str(error), str(error)
    check_clean(c)


@pytest.mark.parametrize(
    "base", [ThreadQueueTransport, ProcessSlotTransport], ids=lambda t: t.__name__
)
def test_a_server_end_that_raises_reaches_the_caller(base):
    c = AsyncBatchedCollector(
        counting_envs(2),
        CountingPolicy(),
        frames_per_batch=8,
        total_frames=-1,
        transport=respond_raising_after(base, 30),
        policy_device="cpu",
        **SERVER_LAYOUT,
    )
    error = first_error_within_bound(c)
    assert isinstance(error, InferenceError), repr(error)
    assert "OSError: respond failed on purpose" in str(error)
    assert isinstance(error.__cause__, OSError)
    check_clean(c)


STALL = 1.0  # seconds: nothing but the stuck policy waits on it


@pytest.fixture
def release_stuck_threads():
    """StuckPolicy blocks a thread of this process (the thread backend's server, worker
    threads): set the event after the test, so that none stays."""
    RELEASE_STUCK.clear()
    STUCK.clear()
    yield
    RELEASE_STUCK.set()


@pytest.mark.parametrize(
    ("transport", "backend"),
    [("thread", "thread"), ("process_slots", "thread"), ("process_slots", "process")],
)
def test_a_policy_that_never_returns_is_a_named_error_with_the_servers_stack(
    transport, backend, release_stuck_threads
):
    """A forward that never returns (here on its fourth call while collecting): next()
    raises an InferenceError naming the stall and showing the server thread's stack,
    within stall_timeout of the server's own progress, and nothing is left behind."""
    c = AsyncBatchedCollector(
        counting_envs(2), StuckPolicy(3, os.getpid()), frames_per_batch=4, total_frames=-1,
        transport=transport, inference_backend=backend, policy_device="cpu",
        stall_timeout=STALL,
    )  # fmt: skip
    error = first_error_within_bound(c, bound=60.0)
    message = str(error)
    assert isinstance(error, InferenceError), repr(error)
    assert "the inference server has not finished its policy call in" in message, message
    assert f"stalled (stall_timeout={STALL:g} s)" in message
    assert "the inference server's Python stack" in message and "RELEASE_STUCK.wait" in message
    check_clean(c)
    if backend == "process":
        wait_until(lambda: process_gone(c.server.pid), what="the inference process")


def test_an_update_waiting_for_a_policy_that_never_returns_is_bounded(release_stuck_threads):
    """The thread backend copies weights between policy calls: an update made while one
    never returns waits, bounded, and raises the stall."""
    c = AsyncBatchedCollector(
        counting_envs(2), StuckPolicy(3, os.getpid()), frames_per_batch=4, total_frames=-1,
        transport="thread", policy_device="cpu", stall_timeout=STALL, **SERVER_LAYOUT,
    )  # fmt: skip
    assert STUCK.wait(60), "the policy call never got stuck"
    done: dict[str, BaseException] = {}

    def update():
        try:
            c.update_policy_weights_(CountingPolicy())
        except BaseException as exc:
            done["error"] = exc

    thread = threading.Thread(target=update, daemon=True)
    thread.start()
    thread.join(60)
    assert not thread.is_alive(), "the update hangs"
    assert isinstance(done.get("error"), InferenceError), done
    assert "has not finished its policy call" in str(done["error"])
    c.shutdown()
    check_clean(c)


@pytest.mark.parametrize("transport", ["thread", "process_slots"])
def test_a_policy_in_a_worker_that_never_returns_is_a_named_stall(transport, release_stuck_threads):
    """inference_backend="worker": the forward runs in the worker, marked in its
    progress record as an env call is; one that never returns is a WorkerError naming
    the worker's policy, with its stack."""
    c = AsyncBatchedCollector(
        counting_envs(2), StuckPolicy(3, os.getpid()), frames_per_batch=4, total_frames=-1,
        transport=transport, inference_backend="worker", policy_device="cpu",
        stall_timeout=STALL,
    )  # fmt: skip
    error = first_error_within_bound(c, bound=60.0)
    assert isinstance(error, WorkerError), repr(error)
    assert re.search(
        rf"the policy in worker \d has not returned from its forward in .* s: stalled "
        rf"\(stall_timeout={STALL:g} s\)",
        str(error),
    ), str(error)
    assert re.search(r'helpers\.py", line \d+,? in forward', str(error)), str(error)  # the stack
    assert error.env_index == -1
    c.shutdown()
    RELEASE_STUCK.set()
    check_clean(c)
