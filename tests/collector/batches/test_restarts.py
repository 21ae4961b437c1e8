"""max_worker_restarts: crashed workers restarted with every stream whole and budgets exact.

Faults are real: an env raising (once in all, through a marker file, or every time it
is built), and a worker process killed with SIGKILL.
"""

import functools
import os
import signal
import warnings

import pytest
import torch
from envs import CrashOnce, counting_vector
from helpers import (
    CountingPolicy,
    check_clean,
    check_restarted_streams,
    counting_envs,
    process_gone,
    wait_until,
    with_server_layout,
)

from rlcollect import AsyncBatchedCollector, CollectorError, WorkerError
from rlcollect.errors import WorkerRestartWarning
from rlcollect.testing import CountingEnv
from rlcollect.transports import Transport


def make(transport, fns, **kwargs):
    kwargs.setdefault("frames_per_batch", 16)
    kwargs.setdefault("total_frames", -1)
    return AsyncBatchedCollector(
        fns, CountingPolicy(), transport=transport, policy_device="cpu",
        **with_server_layout(kwargs),
    )  # fmt: skip


def collect_past_restarts(c, restarts, rows_after=20, limit=2000):
    """Batches of ``c`` until ``restarts`` restarts happened and then every env delivered
    ``rows_after`` more rows (a restarted worker process takes a while to start)."""
    batches, after = [], torch.zeros(c.num_envs, dtype=torch.long)
    for batch in c:
        batches.append(batch)
        if c.stats()["worker_restarts"] >= restarts:
            after += torch.bincount(batch["env_index"], minlength=c.num_envs)
            if bool((after >= rows_after).all()):
                break
        assert len(batches) < limit, f"only {c.stats()['worker_restarts']} restarts happened"
    return torch.cat(batches)


@pytest.mark.parametrize("splits", [1, 2], ids=["splits1", "splits2"])
def test_env_raising_in_step_restarts_its_worker(transport, splits, tmp_path):
    fns = counting_envs(4)
    fns[3] = functools.partial(CrashOnce, 3, str(tmp_path / "crashed"), at=(1, 2))
    with (
        pytest.warns(WorkerRestartWarning) as record,
        make(transport, fns, envs_per_worker=2, worker_splits=splits, max_worker_restarts=1) as c,
    ):
        data = collect_past_restarts(c, restarts=1)
    messages = [str(w.message) for w in record if w.category is WorkerRestartWarning]
    assert len(messages) == 1, messages
    assert "worker 1 (envs 2-3)" in messages[0]
    assert "env 3 (worker 1) raised RuntimeError: CrashOnce 3 crashed on purpose" in messages[0]
    assert "restart 1 of max_worker_restarts=1" in messages[0]
    assert data.batch_size[0] % 16 == 0
    rebuilt = check_restarted_streams(data)
    assert rebuilt == {0: 0, 1: 0, 2: 1, 3: 1}, rebuilt
    check_clean(c)


def test_env_raising_in_reset_restarts_its_worker(transport, tmp_path):
    fns = counting_envs(2)
    fns[1] = functools.partial(CrashOnce, 1, str(tmp_path / "crashed"), at=(2, 0), in_reset=True)
    with (
        pytest.warns(WorkerRestartWarning, match=r"worker 1 \(envs 1\).* in reset"),
        make(transport, fns, max_worker_restarts=3) as c,
    ):
        data = collect_past_restarts(c, restarts=1)
        assert c.stats()["worker_restarts"] == 1
    assert check_restarted_streams(data) == {0: 0, 1: 1}


def test_budgets_stay_exact_across_a_restart(tmp_path):
    fns = counting_envs(2)
    fns[0] = functools.partial(CrashOnce, 0, str(tmp_path / "crashed"), at=(0, 1))
    with (
        pytest.warns(WorkerRestartWarning),
        make("thread", fns, frames_per_batch=7, total_frames=300, max_worker_restarts=1) as c,
    ):
        sizes = [b.batch_size[0] for b in c]
        assert c.stats()["worker_restarts"] == 1
    assert sizes == [7] * 42 + [6]


def test_restarts_with_the_inference_process(tmp_path):
    """The inference process answers the new worker through the same pipes."""
    fns = counting_envs(2)
    fns[1] = functools.partial(CrashOnce, 1, str(tmp_path / "crashed"), at=(1, 2))
    with (
        pytest.warns(WorkerRestartWarning, match=r"worker 1 \(envs 1\)"),
        make("process_slots", fns, max_worker_restarts=1, inference_backend="process") as c,
    ):
        data = collect_past_restarts(c, restarts=1)
    assert check_restarted_streams(data) == {0: 0, 1: 1}
    check_clean(c)


def test_a_worker_killed_with_sigkill_is_restarted():
    with make("process_slots", counting_envs(3), max_worker_restarts=1) as c:
        # Kill only once env 1 has delivered rows: its stream then shows the rebuild
        # (on a busy machine the first batches may come from the other envs alone).
        first = next(c)
        while not bool((first["env_index"] == 1).any()):
            first = torch.cat([first, next(c)])
            assert first.batch_size[0] < 2000, "env 1 delivered nothing"
        pid = c.transport.pids[1]
        os.kill(pid, signal.SIGKILL)
        wait_until(lambda: process_gone(pid), what="the killed worker to die")
        with pytest.warns(WorkerRestartWarning, match=r"worker 1 \(envs 1\).*killed by SIGKILL"):
            data = torch.cat([first, collect_past_restarts(c, restarts=1)])
        assert c.transport.pids[1] != pid
    assert check_restarted_streams(data) == {0: 0, 1: 1, 2: 0}
    check_clean(c)


def test_past_max_worker_restarts_the_error_surfaces(transport):
    fns = counting_envs(2)
    fns[1] = functools.partial(CountingEnv, 1, fail_at=(0, 2))  # fails every time it is built
    c = make(transport, fns, max_worker_restarts=2)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        with pytest.raises(WorkerError, match=r"env 1 .* failed on purpose in step") as info:
            for _ in range(2000):
                next(c)
    restarts = [w for w in record if w.category is WorkerRestartWarning]
    assert len(restarts) == 2, [str(w.message) for w in restarts]
    for n, w in enumerate(restarts, 1):
        assert f"restart {n} of max_worker_restarts=2" in str(w.message)
    assert info.value.env_index == 1
    assert any("max_worker_restarts=2" in note for note in info.value.__notes__)
    check_clean(c)


def test_restarts_are_refused_where_they_cannot_work():
    class NoRestarts(Transport):
        def start(self, layout, programs):
            raise AssertionError("never started")

        def close(self):
            pass

    with pytest.raises(ValueError, match="cannot restart workers"):
        make(NoRestarts(), counting_envs(2), max_worker_restarts=1)
    # Called directly, the base class's restart_worker refuses by name.
    with pytest.raises(CollectorError, match=r"NoRestarts cannot restart workers .* worker 0"):
        NoRestarts().restart_worker(0, lambda end: None)
    with pytest.raises(ValueError, match="max_worker_restarts needs plain envs"):
        make("thread", [functools.partial(counting_vector, 0, 2)], max_worker_restarts=1)
    with pytest.raises(ValueError, match="max_worker_restarts must be an int >= 0, got -1"):
        make("thread", counting_envs(2), max_worker_restarts=-1)
