"""The argument checks' own rules: what ``envs_per_worker="auto"`` resolves to."""

import os

import pytest

from rlcollect.collector.checks import cgroup_cpu_quota, envs_per_worker_of, usable_cores


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
