"""The inference server thread dying outside the policy call: a clear InferenceError
reaches the caller within a bounded wait, every worker stops, nothing hangs."""

import threading
import time

import pytest
import torch
from helpers import CountingPolicy, check_clean, counting_envs

from rlcollect import AsyncBatchedCollector, InferenceError
from rlcollect.transports import ProcessSlotTransport, ThreadQueueTransport

_BOUND = 10.0  # seconds: far above the ~0.1 s the error takes; only a hang reaches it


class ShapeShifter(CountingPolicy):
    """From its ``at``-th call on, returns a ``value`` of another shape than at
    construction: the policy call itself succeeds, the server's scatter refuses it."""

    def __init__(self, at: int) -> None:
        super().__init__()
        self.calls = 0
        self.at = at

    def forward(self, obs: torch.Tensor) -> dict[str, torch.Tensor]:
        out = super().forward(obs)
        self.calls += 1
        if self.calls >= self.at:
            out["value"] = out["value"][:, None].expand(-1, 3)
        return out


class TypeShifter(CountingPolicy):
    """From its ``at``-th call on, returns float actions (the same numbers plus a half),
    where it returned integers at construction: a cast would truncate them quietly."""

    def __init__(self, at: int) -> None:
        super().__init__()
        self.calls = 0
        self.at = at

    def forward(self, obs: torch.Tensor) -> dict[str, torch.Tensor]:
        out = super().forward(obs)
        self.calls += 1
        if self.calls >= self.at:
            out["action"] = out["action"].double() + 0.5
        return out


def respond_raising_after(base, calls):
    """A transport whose server end's respond() raises on its ``calls``-th call."""

    class Failing(base):
        def start(self, layout, programs):
            end = super().start(layout, programs)
            respond = end.respond
            count = [0]

            def failing(workers):
                count[0] += 1
                if count[0] >= calls:
                    raise OSError("respond failed on purpose")
                respond(workers)

            end.respond = failing
            return end

    return Failing()


def first_error_within_bound(c):
    """Iterate ``c`` in a thread; the error it raised, failing if none came in time."""
    out = {}

    def consume():
        try:
            for _ in c:
                pass
        except BaseException as exc:
            out["error"] = exc

    t = threading.Thread(target=consume, daemon=True)
    t0 = time.monotonic()
    t.start()
    t.join(_BOUND)
    assert not t.is_alive(), f"no error within {_BOUND} s: the collector hangs"
    out["seconds"] = time.monotonic() - t0
    return out["error"]


def test_output_that_breaks_the_scatter_reaches_the_caller(transport):
    c = AsyncBatchedCollector(
        counting_envs(3),
        ShapeShifter(at=5),
        frames_per_batch=8,
        total_frames=-1,
        transport=transport,
        policy_device="cpu",
    )
    error = first_error_within_bound(c)
    assert isinstance(error, InferenceError), repr(error)
    assert "inference server failed" in str(error) and "value" in str(error), str(error)
    check_clean(c)


def test_output_of_another_dtype_reaches_the_caller_named(transport):
    c = AsyncBatchedCollector(
        counting_envs(3),
        TypeShifter(at=5),
        frames_per_batch=8,
        total_frames=-1,
        transport=transport,
        policy_device="cpu",
    )
    error = first_error_within_bound(c)
    assert isinstance(error, InferenceError), repr(error)
    assert isinstance(error.__cause__, TypeError)
    assert "policy output ('action',) is float64 now, but it was int64" in str(error), str(error)
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
    )
    error = first_error_within_bound(c)
    assert isinstance(error, InferenceError), repr(error)
    assert "OSError: respond failed on purpose" in str(error)
    assert isinstance(error.__cause__, OSError)
    check_clean(c)
