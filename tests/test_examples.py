"""Smoke tests: the examples and benchmarks run end to end with tiny budgets."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run(*args, timeout=300):
    done = subprocess.run(
        [sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


@pytest.mark.slow
def test_quickstart():
    out = run("examples/quickstart.py", "--frames", "1536", "--envs", "2", "--env-seconds", "0.5")
    for line in (
        "collector:",
        "mean batch size:",
        "driver CPU:",
        "env-only:",
        "collector / env-only:",
    ):
        assert line in out, out


@pytest.mark.slow
def test_cpu_collection_benchmark(tmp_path):
    out_file = tmp_path / "cpu.json"
    run(
        "benchmarks/cpu_collection.py",
        "--repeats",
        "1",
        "--envs",
        "cartpole",
        "--frames-scale",
        "0.05",
        "--env-seconds",
        "0.3",
        "--out",
        str(out_file),
    )
    result = json.loads(out_file.read_text())
    rows = result["summary"]["cartpole"]
    assert rows["rlcollect[process_slots-chunkauto]"]["fps_median"] > 0
    assert "ratio_to_async_vector_median" in rows["rlcollect[thread-chunkauto]"]


@pytest.mark.slow
def test_atari_throughput_benchmark(tmp_path):
    out = run(
        "benchmarks/atari_throughput.py",
        *("--envs", "4", "--batch", "2", "--threads", "1", "--repeats", "1"),
        *("--seconds", "0.5", "--warmup", "0.2", "--frames-per-batch", "64"),
        *("--out", str(tmp_path)),
    )
    result = json.loads((tmp_path / "atari_throughput.json").read_text())
    rows = result["summary"]
    for name in ("env_only", "hand_loop", "rlcollect[thread-1x]", "rlcollect[process_slots-1x]"):
        assert rows[name]["fps_median"] > 0, name
    assert "ratio_to_hand_loop_median" in rows["rlcollect[thread-2x]"]
    assert "| `rlcollect[thread-1x]` |" in out


@pytest.mark.slow
def test_worker_splits_benchmark(tmp_path):
    out_file = tmp_path / "splits.json"
    run(
        "benchmarks/worker_splits.py",
        *("--repeats", "1", "--envs", "cartpole", "--frames-scale", "0.02"),
        *("--out", str(out_file)),
    )
    rows = json.loads(out_file.read_text())["summary"]["cartpole"]
    assert rows["envs_per_worker=4,worker_splits=2"]["fps_median"] > 0
