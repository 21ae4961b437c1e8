"""The argument checks' own rules: what ``envs_per_worker="auto"`` resolves to."""

import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from rlcollect.collector.checks import (
    available_memory,
    cgroup_cpu_quota,
    check_batch_memory,
    chunk_steps_of,
    cpu_sample,
    envs_per_worker_of,
    free_cores,
    usable_cores,
)
from rlcollect.transports.layout import Field
from rlcollect.worker.source import Source


@pytest.mark.parametrize(
    ("factories", "cores", "expected"),
    [
        (64, 16, 4),  # 16 workers of 4 on 16 cores
        (48, 16, 3),
        (32, 16, 2),
        (16, 16, 1),
        (10, 16, 1),  # fewer envs than cores: one env each
        (1, 16, 1),
        (16, 2, 8),  # the 2-core machine's fastest layout (docs/tuning.md)
        (4, 2, 2),
        (6, 4, 2),
        (17, 16, 1),  # a prime: 17 one-env workers, not one worker of 17
        (18, 4, 6),  # 3 workers (4/3 too few) are nearer 4 cores than 6 (6/4 too many)
        (2, 1, 2),  # one core: one worker
    ],
)
def test_auto_leaves_about_one_worker_per_core(factories, cores, expected):
    assert envs_per_worker_of("auto", factories, cores) == expected


PLAIN = Source(observation_space=None, action_space=None)


@pytest.mark.parametrize(
    ("fpb", "threads", "step_bytes", "expected"),
    [
        (1024, False, 96, 64),  # worker processes: at most 64 steps a chunk
        (64, False, 96, 16),  # fewer where the batch is smaller
        (1024, True, 96, 256),  # worker threads: the batch's steps in one chunk
        (1 << 20, True, 96, (8 << 20) // (4 * 96)),  # ... up to 8 MiB a chunk
        (1 << 20, True, 1 << 20, 64),  # large observations: never below 64
        (8, True, 96, 2),
    ],
)
def test_auto_chunks_are_larger_where_the_workers_are_threads(fpb, threads, step_bytes, expected):
    steps = chunk_steps_of("auto", fpb, 4, 4, PLAIN, threads=threads, step_bytes=step_bytes)
    assert steps == expected


def test_an_auto_chunk_holds_no_more_steps_than_the_run():
    # 100 frames of 4 envs: 25 steps each, not a 1024-frame batch's 256
    assert chunk_steps_of("auto", 1024, 4, 4, PLAIN, total_frames=100, threads=True) == 25
    assert chunk_steps_of("auto", 1024, 4, 4, PLAIN, total_frames=100) == 25
    assert chunk_steps_of("auto", 1024, 4, 4, PLAIN, total_frames=10**6, threads=True) == 256


def test_a_given_chunk_size_is_kept_whatever_the_workers():
    assert chunk_steps_of(8, 1024, 4, 4, PLAIN, threads=True, step_bytes=96) == 2


def test_an_int_is_checked_and_kept():
    assert envs_per_worker_of(3, 6, 2) == 3
    with pytest.raises(
        ValueError, match="6 envs cannot be split into workers of envs_per_worker=4"
    ):
        envs_per_worker_of(4, 6, 2)
    with pytest.raises(ValueError, match='envs_per_worker must be an int >= 1 or "auto"'):
        envs_per_worker_of("many", 6, 2)
    with pytest.raises(ValueError, match='envs_per_worker must be an int >= 1 or "auto"'):
        envs_per_worker_of(0, 6, 2)


def test_usable_cores_is_at_least_one():
    assert usable_cores() >= 1


def test_a_cgroup_quota_caps_the_cores(tmp_path):
    # cgroup v2: "<quota> <period>" in cpu.max, "max" for none
    v2 = tmp_path / "v2"
    v2.mkdir()
    (v2 / "cpu.max").write_text("150000 100000\n")
    assert cgroup_cpu_quota(v2) == 1.5
    assert usable_cores(v2) == min(2, len(os.sched_getaffinity(0)))  # 1.5 CPUs: 2 cores
    (v2 / "cpu.max").write_text("max 100000\n")
    assert cgroup_cpu_quota(v2) is None
    # cgroup v1: cfs quota and period, -1 for none
    v1 = tmp_path / "v1" / "cpu"
    v1.mkdir(parents=True)
    (v1 / "cpu.cfs_quota_us").write_text("50000\n")
    (v1 / "cpu.cfs_period_us").write_text("100000\n")
    assert cgroup_cpu_quota(v1.parent) == 0.5
    assert usable_cores(v1.parent) == 1  # never below one
    (v1 / "cpu.cfs_quota_us").write_text("-1\n")
    assert cgroup_cpu_quota(v1.parent) is None
    assert cgroup_cpu_quota(tmp_path / "none") is None  # nothing to read: no quota


def test_a_cgroup_memory_limit_caps_the_memory_available(tmp_path):
    assert (available_memory() or 0) > 0  # this machine's, as the plan reads it
    meminfo = tmp_path / "meminfo"
    meminfo.write_text(f"MemTotal: 8388608 kB\nMemAvailable: {2**21} kB\n")  # 2 GiB
    assert available_memory(tmp_path / "none", meminfo) == 2**31  # no cgroup files
    v2 = tmp_path / "v2"
    v2.mkdir()
    (v2 / "memory.max").write_text(f"{2**30}\n")
    (v2 / "memory.current").write_text(f"{2**29}\n")  # page cache, say: not subtracted
    assert available_memory(v2, meminfo) == 2**30  # the container's limit
    (v2 / "memory.max").write_text("max\n")
    assert available_memory(v2, meminfo) == 2**31  # no limit
    v1 = tmp_path / "v1" / "memory"
    v1.mkdir(parents=True)
    (v1 / "memory.limit_in_bytes").write_text(f"{2**20}\n")
    assert available_memory(v1.parent, meminfo) == 2**20
    assert available_memory(tmp_path / "none", tmp_path / "no-meminfo") is None


def test_a_batch_must_fit_in_the_memory_available():
    fields = [Field(("observation",), (4,), np.dtype(np.float32))]  # 16 bytes a row
    check_batch_memory(fields, 64, -1, 1024)  # exactly fits
    check_batch_memory(fields, 10**9, 64, 1024)  # the budget caps the batch
    check_batch_memory(fields, 10**9, -1, None)  # nothing known: nothing refused
    with pytest.raises(ValueError, match=r"frames_per_batch=65: a batch of 65 transitions"):
        check_batch_memory(fields, 65, -1, 1024)


def test_the_load_beside_counts_this_sessions_programs_thread_by_thread():
    """A CPU-bound process of this session is counted beside the collector (the
    scheduler shares the cores with it thread by thread); one started in a session of
    its own is not, where the kernel groups sessions (``sched_autogroup_enabled``)."""
    spin = [sys.executable, "-c", "while True: pass"]
    same = subprocess.Popen(spin)
    other = subprocess.Popen(spin, start_new_session=True)
    try:
        first = cpu_sample()
        assert first is not None  # Linux
        assert same.pid in first.group and os.getpid() not in first.group
        grouped = Path("/proc/sys/kernel/sched_autogroup_enabled")
        if grouped.exists() and grouped.read_text().strip() == "1":
            assert other.pid not in first.group
        # the window the probe measures over: this thread busy beside them
        deadline = time.monotonic() + 60
        while True:
            start, spun = cpu_sample(), time.process_time()
            while time.process_time() - spun < 0.2:  # CPU time of its own, however busy
                pass
            free, beside = free_cores(start, os.cpu_count() or 1)
            # at least the spinning child's share beside, once it has run in the window
            if beside is not None and beside >= 0.5:
                break
            assert time.monotonic() < deadline, f"the spinning child never counted: {beside}"
        assert free is not None and 0.0 <= free <= (os.cpu_count() or 1)
    finally:
        for p in (same, other):
            p.kill()
            p.wait(30)
