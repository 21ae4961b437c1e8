"""The inference server thread dying outside the policy call: a clear InferenceError
reaches the caller within a bounded wait, every worker stops, nothing hangs."""

from collections.abc import Callable

import pytest
import torch
from helpers import (
    SERVER_LAYOUT,
    CountingPolicy,
    check_clean,
    counting_envs,
    first_error_within_bound,
    respond_raising_after,
)

from rlcollect import AsyncBatchedCollector, InferenceError
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


def float_action(out: dict[str, torch.Tensor]) -> None:
    """Float actions (the same numbers plus a half) where they were integers: a cast
    would truncate them quietly."""
    out["action"] = out["action"].double() + 0.5


@pytest.mark.parametrize(
    ("change", "cause", "message"),
    [
        (wider_value, ValueError, "policy output ('value',) has shape (3,) per env, but it had ()"),
        (float_action, TypeError, "policy output ('action',) is float64 now, but it was int64"),
    ],
    ids=["shape", "dtype"],
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
