"""The one-call GPU check's plumbing (benchmarks/check.py): parts cut at their budget with
their whole process group, the rows the defaults series measures, the summary always
written. The whole check runs on a CPU with ``benchmarks/gpu_check.sh OUT --dry-run``."""

import json
import os
import subprocess
import sys
from pathlib import Path

from helpers import wait_until

from benchmarks import check
from benchmarks.check_summary import render
from benchmarks.suite import plans

ROOT = Path(__file__).resolve().parents[1]

# A parent that starts a child which waits forever, says both are up, then waits itself.
HANGS = """
import subprocess, sys
child = subprocess.Popen([sys.executable, "-c", "import threading; threading.Event().wait()"])
print("child-pid", child.pid, flush=True)
child.wait()
"""


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"  # a zombie has ended; its parent (init) reaps it in its time


def test_a_part_past_its_budget_is_cut_with_its_whole_process_group(tmp_path):
    log = tmp_path / "hangs.log"
    # 6 s: time for two interpreters to start on a busy machine before the cut
    part = check.run_part("hangs", [sys.executable, "-c", HANGS], 6.0, log)
    assert part["status"] == "cut" and part["budget_s"] == 6.0, part
    text = log.read_text()
    assert "== cut at its budget of 6 s" in text, text
    pid = int(next(line for line in text.splitlines() if line.startswith("child-pid ")).split()[1])
    # SIGKILL is delivered, not done, when killpg returns: the child ends in its time
    wait_until(lambda: not _running(pid), timeout=30, what=f"the part's child {pid} to end")


def test_a_part_that_ends_reports_its_exit_status(tmp_path):
    ok = check.run_part("ok", [sys.executable, "-c", "print('fine')"], 60, tmp_path / "ok.log")
    failed = check.run_part(
        "failed", [sys.executable, "-c", "raise SystemExit(3)"], 60, tmp_path / "failed.log"
    )
    assert ok["status"] == "ok" and "fine" in (tmp_path / "ok.log").read_text()
    assert failed["status"] == "failed" and failed["returncode"] == 3


def test_the_rows_are_the_defaults_series_runs_on_the_gpu_host():
    # Same configuration as the defaults series' runs of the same name, windows aside:
    # the check's figures and the series' compare.
    rows = check.series(dry=False, scale=0.6)
    defaults = plans.defaults(plans.GPU)
    assert set(rows.runs) == {
        "defaults[pong x16]",
        "documented[pong x16]",
        "env_only[pong x16]",
        "defaults[pong x64]",
        "documented[pong x64]",
        "defaults[atari_vector x64]",
        "documented[atari_vector x64]",
        "vector_env_only[atari_vector x64]",
        "hand_loop[atari_vector x64]",
    }
    windows = {"warmup_s", "measure_s"}
    for name, config in rows.runs.items():
        theirs = defaults.runs[name]
        assert {k: v for k, v in config.items() if k not in windows} == {
            k: v for k, v in theirs.items() if k not in windows
        }, name
        assert config["measure_s"] == 0.6 * theirs["measure_s"], name
    assert ("documented[pong x64]", "env_only[pong x16]") in rows.ratios
    assert ("hand_loop[atari_vector x64]", "vector_env_only[atari_vector x64]") in rows.ratios


def test_the_rows_part_out_of_time_writes_its_json_with_no_run(tmp_path):
    # No second left: no run starts, and the series' JSON still says what it holds.
    cmd = [sys.executable, "-m", "benchmarks.check", "rows", "--out", str(tmp_path)]
    cmd += ["--seconds", "0", "--repeats", "2", "--scale", "1", "--dry-run"]
    env = dict(os.environ, TQDM_DISABLE="1")
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    doc = json.loads((tmp_path / f"{check.SERIES_NAME}.json").read_text())
    assert not doc["complete"] and all(runs == [] for runs in doc["runs"].values()), doc
    assert "not reached within the part's budget" in render(
        {"rows": {"status": "ok", "result": doc}}, {}, True
    )


def test_the_summary_names_every_part_and_the_ratios():
    ratio = {
        "numerator": "defaults[pong x16]",
        "denominator": "env_only[pong x16]",
        "per_repeat": [0.5, 0.7],
        "median": 0.6,
        "range": [0.5, 0.7],
    }
    runs = {
        "defaults[pong x16]": [{"frames_per_second": 10.0}, {"frames_per_second": 14.0}],
        "env_only[pong x16]": [{"frames_per_second": 20.0}, {"frames_per_second": 20.0}],
    }
    fps = {"median": 12.0, "range": [10.0, 14.0]}
    doc = {
        "repeats": 3,
        "runs": runs,
        "ratios": {"x": ratio},
        "summary": {name: {"repeats": 2, "frames_per_second": fps} for name in runs},
    }
    parts = {
        "install": {"status": "ok", "why": "installed 7 wheels"},
        "tests": {"status": "cut", "seconds": 150.0, "budget_s": 150.0, "result": None},
        "rows": {"status": "ok", "seconds": 300.0, "budget_s": 310.0, "result": doc},
        "ppo": {"status": "failed", "returncode": 1, "seconds": 3.0, "budget_s": 65.0},
        "replay": {"status": "skipped", "why": "not in this tree"},
    }
    env = {"git_commit": "abc123", "gpu": {"name": "NVIDIA H100"}, "cpu_affinity": 16}
    text = render(parts, env, dry=False)
    assert text.startswith("# GPU check of abc123\n"), text
    assert "| tests | **cut at its budget** | 150 | 150 |" in text, text
    assert "| ppo | **failed (exit 1)** |" in text and "no result (see its log)" in text
    assert "| rows | ok | 300 | 310 | 2 runs, 2-2 of 3 repeats each |" in text, text
    assert "| pong x16 | defaults / env_only | 0.60 | 0.50-0.70 | 2 |" in text, text
    assert "| replay | skipped |  |  | not in this tree |" in text, text
