"""The suite's sample_factory series (issue 59): its plan and its skip run anywhere; the
Sample Factory run itself only where its virtual environment (.peers-sf) was built."""

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from benchmarks.common import make_pong
from benchmarks.suite import plans
from benchmarks.suite.runner import run_series, sf_problem
from benchmarks.suite.sf_peer import make_env, sf_arguments
from benchmarks.suite.sf_series import sf_config, sf_name

ROOT = Path(__file__).resolve().parents[1]
SF_PYTHON = ROOT / ".peers-sf" / "bin" / "python"


def _sf_only(sf_runs: dict) -> plans.Series:
    return plans.Series("sample_factory", "Sample Factory alone", sf_runs)


def _quick_sf_run() -> dict:
    m = plans.machine("cpu", quick=True, scale=1.0)
    return {sf_name(c): c for c in [sf_config(m, 2, 1, 2)]}


def test_the_series_runs_sample_factory_beside_rlcollect_at_the_same_numbers_of_envs():
    series = plans.SERIES["sample_factory"](plans.machine("cpu", quick=False, scale=1.0))
    theirs = {n: c for n, c in series.runs.items() if c["kind"] == "sample_factory"}
    ours = {n: c for n, c in series.runs.items() if c["kind"] == "rlcollect"}
    assert theirs and ours and "env_only[4 procs]" in series.runs
    for config in theirs.values():
        assert config["num_workers"] * config["envs_per_worker"] == config["num_envs"]
        assert config["envs_per_worker"] % config["worker_num_splits"] == 0
        assert config["policy"] == "small_cnn" and config["device"] == "cpu"
    # every Sample Factory layout is at a number of envs one of rlcollect's runs has
    assert {c["num_envs"] for c in theirs.values()} <= {c["num_envs"] for c in ours.values()}
    ratios = set(series.ratios)
    for name in [*theirs, *ours]:
        assert (name, "env_only[4 procs]") in ratios
    assert {(r, s) for r in ours for s in theirs} <= ratios


def test_a_layout_that_does_not_divide_the_envs_is_refused():
    m = plans.machine("cpu", quick=False, scale=1.0)
    with pytest.raises(ValueError, match="6 envs do not split into 4 workers"):
        sf_config(m, 6, 4, 1)
    with pytest.raises(ValueError, match="4 envs do not split into 4 workers of 2"):
        sf_config(m, 4, 4, 2)


def test_sample_factory_gets_the_runs_settings_and_the_gpu_as_it_names_it():
    m = plans.machine("gpu", quick=False, scale=1.0)
    args = sf_arguments(sf_config(m, 64, 16, 2), "/tmp/x")
    for expected in (
        "--device=gpu",
        "--num_workers=16",
        "--num_envs_per_worker=4",
        "--worker_num_splits=2",
        "--batch_size=4096",
        "--use_rnn=False",
        "--obs_scale=255.0",
        "--bench_policy=nature_cnn",
    ):
        assert expected in args


def test_the_env_rebuilt_for_sample_factory_is_the_suites_pong():
    """Same seed, same actions: the same 4x105x80 stacks as benchmarks.common.make_pong."""
    ours, rebuilt = make_pong(), make_env("rlcollect_pong")
    try:
        assert rebuilt.observation_space == ours.observation_space
        a, _ = ours.reset(seed=3)
        b, _ = rebuilt.reset(seed=3)
        np.testing.assert_array_equal(np.asarray(a), b)
        for step in range(40):
            action = step % 6
            a, ra, ta, _, _ = ours.step(action)
            b, rb, tb, _, _ = rebuilt.step(action)
            np.testing.assert_array_equal(np.asarray(a), b)
            assert (ra, ta) == (rb, tb)
    finally:
        ours.close()
        rebuilt.close()


def _one_repeat(out_dir, sf_python):
    """The quick Sample Factory run, once, under ``sf_python``: the series' JSON."""
    path = run_series(
        _sf_only(_quick_sf_run()),
        suite="cpu",
        repeats=1,
        out_dir=out_dir,
        peers_path=None,
        deadline=None,
        sf_python=sf_python,
    )
    return json.loads(path.read_text())


def test_without_its_virtual_environment_the_sample_factory_runs_are_skipped(tmp_path):
    doc = _one_repeat(tmp_path, None)
    (reason,) = doc["skipped"].values()
    assert "no --sf-python given" in reason and "make peers-sf" in reason
    assert doc["runs"] == {}


def test_an_interpreter_without_sample_factory_is_named_in_the_reason(tmp_path):
    assert "is not a file" in str(sf_problem(str(tmp_path / "python")))
    problem = str(sf_problem(sys.executable))  # rlcollect's own: no sample_factory
    assert "does not import" in problem and sys.executable in problem


@pytest.mark.slow
@pytest.mark.skipif(not SF_PYTHON.is_file(), reason="no .peers-sf (make peers-sf builds it)")
def test_the_sample_factory_run_measures_frames_under_its_own_interpreter(tmp_path):
    doc = _one_repeat(tmp_path, str(SF_PYTHON))
    assert doc["skipped"] == {}
    ((result,),) = doc["runs"].values()
    assert "error" not in result, result
    assert result["frames_per_second"] > 0
    assert result["sample_factory"]["versions"]["sample-factory"] == "2.1.1"
    assert "--num_envs_per_worker=2" in result["sample_factory"]["arguments"]
