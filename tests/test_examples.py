"""Smoke tests: the examples and benchmarks run end to end with tiny budgets."""

import importlib.util
import json
import math
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from helpers import lowest_niceness_allowed, may_lower_niceness

from rlcollect.worker.vector_priority import DRIVER_NICE

ROOT = Path(__file__).resolve().parents[1]


def run(*args, timeout=300):
    done = subprocess.run(
        [sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


@pytest.mark.slow
def test_quickstart():
    args = ["examples/quickstart.py", "--envs", "2", "--rounds", "2", "--seconds", "0.5"]
    done = subprocess.run(
        [sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = done.stdout
    for line in (
        "layout chosen by rule",  # describe()
        "as explicit arguments:",
        "collector       loop   env-only",  # the rounds' table
        "driver CPU:",
        "collector / AsyncVectorEnv loop:",
        "collector / env-only:",
    ):
        assert line in out, out
    # ale-py's banner: from this process alone, not from every env process
    assert (out + done.stderr).count("A.L.E: Arcade Learning Environment") <= 1, done.stderr


@pytest.mark.lab
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


def test_custom_transport():
    from rlcollect.testing import CHECKS

    out = run("examples/custom_transport.py", "--frames", "1024", "--envs", "2")
    assert f"conformance: all {len(CHECKS)} checks passed" in out, out
    # Which envs fill the two batches is the scheduler's business: a worker that starts
    # late on a busy machine may contribute nothing before 1,024 frames are in.
    found = re.search(r"collected 1024 frames in 2 batches from envs \[([0-9, ]+)\]", out)
    assert found, out
    assert {int(i) for i in found.group(1).split(",")} <= {0, 1}, out


def test_ray_collect():
    pytest.importorskip("ray")
    # Simulated nodes of its own: a bare ray.init() would join any Ray cluster running
    # on this machine, such as the one tests/distributed/ starts.
    # A bound, not a speed check: beside two CPU hogs on 2 cores Ray's start took over
    # the default 300 s once (.ci/busy, 2026-12-03).
    out = run("examples/ray_collect.py", "--simulate-nodes", "2", "--node-cpus", "1",
              "--frames", "2048", "--envs", "4", "--frames-per-batch", "256",
              timeout=900)  # fmt: skip
    assert "4 envs on 2 collectors" in out, out
    assert "collected 2048 frames in 8 batches" in out, out
    assert "collector restarts: 0" in out, out


def test_training_loop_of_the_docs_home_page(tmp_path):
    text = (ROOT / "docs" / "index.md").read_text()
    code = text.split("```python\n", 1)[1].split("```", 1)[0]
    assert "total_frames=100_000" in code, "the loop's budget moved; update this test"
    script = tmp_path / "loop.py"
    script.write_text(code.replace("total_frames=100_000", "total_frames=6_000"))  # 3 rounds
    out = run(str(script))
    assert "weights v3: mean episode length" in out, out


@pytest.mark.slow
def test_benchmark_suite_quick(tmp_path):
    # Every series of the CPU suite end to end (fresh processes, JSON, the results page),
    # with tiny budgets; the TorchRL peer is left out on purpose and must say so.
    # The bound: beside two CPU hogs on 2 cores this took over 600 s once (.ci/busy).
    results = tmp_path / "results"
    run("-m", "benchmarks", "cpu", "--quick", "--peers-path", "", "--out",
        str(results / "suite_cpu"), timeout=1800)  # fmt: skip
    for series in (
        "peers",
        "pixels",
        "dqn_loop",
        "async_training",
        "throughput",
        "vector_throughput",
        "vector_layouts",
        "defaults",
    ):
        doc = json.loads((results / "suite_cpu" / f"{series}.json").read_text())
        assert doc["complete"], series
        assert doc["environment"]["versions"]["torch"], series
        for name, row in doc["summary"].items():
            assert row["failures"] == 0, (series, name, doc["runs"][name])
            assert row["frames_per_second"]["median"] > 0, (series, name)
    peers = json.loads((results / "suite_cpu" / "peers.json").read_text())
    assert "torchrl is not installed" in peers["skipped"]["torchrl[process_slots-chunk64-eager]"]
    docs = tmp_path / "docs"
    run("-m", "benchmarks", "report", "--results", str(results), "--docs", str(docs))
    page = (docs / "results.md").read_text()
    assert "| `rlcollect[process_slots-chunkauto-eager]` |" in page, page
    assert (docs / "results" / "headline.png").stat().st_size > 0
    # the defaults series: each collector run records the layout it ran with and its rule
    defaults = json.loads((results / "suite_cpu" / "defaults.json").read_text())
    for run_ in defaults["runs"]["defaults[cartpole x4]"]:
        assert run_["rule"] and set(run_["layout"]) >= {"transport", "inference_backend"}
    assert "| `defaults[cartpole x4]` | `documented[cartpole x4]` |" in page, page


@pytest.mark.slow
def test_benchmark_suite_resume_measures_only_the_missing_repeats(tmp_path):
    first, second = tmp_path / "first", tmp_path / "second"
    args = ("-m", "benchmarks", "cpu", "--quick", "--series", "dqn_loop", "--peers-path", "")
    run(*args, "--repeats", "1", "--out", str(first), timeout=300)
    run(*args, "--repeats", "2", "--resume", str(first), "--out", str(second), timeout=300)
    before = json.loads((first / "dqn_loop.json").read_text())
    after = json.loads((second / "dqn_loop.json").read_text())
    assert after["complete"] and len(after["resumed"]) == 1
    assert after["environment"] == before["environment"]
    for name, results in after["runs"].items():
        assert len(results) == 2, name
        assert results[0] == before["runs"][name][0], name  # kept, not measured again
    for ratio in after["ratios"].values():
        assert len(ratio["per_repeat"]) == 2


def check_dqn_summary(result, *, steps, learning_starts, batch_size, train_ratio, batch_rows):
    """What both DQN examples promise in their JSON: the budget met exactly, the train
    ratio kept both ways, episodes logged in step order."""
    assert result["env_steps"] == steps
    # a batch is written only once the learner has sampled train_ratio rows per row
    # collected before it: only the last batch of collection may have gone unlearned
    owed = train_ratio * (steps - learning_starts - batch_rows)
    assert result["updates"] * batch_size >= owed, result
    # and the learner kept to it too (wait_to_sample): one minibatch beyond its share at most
    assert result["updates"] * batch_size <= train_ratio * (steps - learning_starts) + batch_size
    curve = result["curve"]
    assert len(curve) == result["episodes"]
    ends = [steps_so_far for steps_so_far, _ in curve]
    assert ends == sorted(ends) and all(0 < end <= steps for end in ends), ends


def test_dqn_cartpole(tmp_path):
    out = run(
        "examples/dqn_cartpole.py",
        *("--steps", "3000", "--learning-starts", "1000", "--out", str(tmp_path)),
    )
    result = json.loads((tmp_path / "dqn_cartpole.json").read_text())
    check_dqn_summary(
        result, steps=3000, learning_starts=1000, batch_size=128, train_ratio=64, batch_rows=64
    )
    # CartPole pays 1 a step: finished episodes add up to at most the steps taken
    assert result["episodes"] > 0
    assert sum(ret for _, ret in result["curve"]) <= 3000
    assert "mean return (last 20)" in out, out
    assert (tmp_path / "dqn_cartpole.png").stat().st_size > 0


@pytest.mark.slow
def test_dqn_atari(tmp_path):
    # A Nature CNN update takes a good fraction of a second on a CPU: few of them here.
    run(
        "examples/dqn_atari.py",
        *("--total-steps", "640", "--envs", "2", "--learning-starts", "512"),
        *("--buffer-size", "1024", "--frames-per-batch", "64", "--log-every", "1"),
        *("--out", str(tmp_path)),
    )
    result = json.loads((tmp_path / "dqn_atari.json").read_text())
    check_dqn_summary(
        result, steps=640, learning_starts=512, batch_size=32, train_ratio=8, batch_rows=64
    )
    assert result["while_learning"]["updates_per_second"] > 0
    assert result["mean_inference_batch"] >= 1
    # the replay stores each frame once: 1024 transitions of 84x84 frames in under 8 MB
    replay = result["replay"]
    assert replay["frame_stack"] == 4 and replay["len"] == 640 and replay["gb"] < 0.008


def test_frame_replay_benchmark(tmp_path):
    out = run(
        "benchmarks/frame_replay.py",
        *("--capacity", "4096", "--full-capacity", "8192", "--batch", "128"),
        *("--rounds", "2", "--seconds", "0.02", "--fill-full", "--out", str(tmp_path)),
    )
    result = json.loads((tmp_path / "frame_replay.json").read_text())
    assert result["same_rows"] and result["len"] == {"frame_stack": 4096, "rows": 4096}
    memory = result["memory"]  # one frame and its scalars, against eight frames
    assert memory["ratio_to_one_frame_and_scalars"] <= 1.1
    assert memory["rows_bytes_per_transition"] > 8 * memory["frame_bytes"]
    for n in ("32", "256"):
        sample = result["sample"][n]
        assert sample["rows_us_median"] > 0 and sample["frame_stack_ratio"]["median"] > 0
    assert result["full"]["len"] == 8192
    assert "| 256 | frame_stack |" in out


@pytest.mark.lab
def test_startup_benchmark(tmp_path):
    out = run("benchmarks/startup.py", "--envs", "2", "--out", str(tmp_path))
    result = json.loads((tmp_path / "startup.json").read_text())
    row = result["results"]["2"]
    assert row["rlcollect"]["workers"] == 2 and row["rlcollect"]["first_batch_seconds"] > 0
    assert row["async_vector"]["first_step_seconds"] > 0
    assert "| 2 |" in out


@pytest.mark.lab
@pytest.mark.slow
def test_vector_startup_benchmark(tmp_path):
    out_file = tmp_path / "vector_startup.json"
    args = ["--workload", "slow", "--envs", "2", "--build-seconds", "0", "--repeats", "1"]
    out = run("benchmarks/vector_startup.py", *args, "--out", str(out_file))
    summary = json.loads(out_file.read_text())["summary"]
    assert summary["this"]["first_batch_seconds"] > 0 and summary["env_first_step_seconds"] > 0
    assert summary["this"]["layout"]["transport"] == "process_slots"
    assert "| this |" in out


@pytest.mark.lab
@pytest.mark.slow
def test_atari_throughput_benchmark(tmp_path):
    out = run(
        "benchmarks/atari_throughput.py",
        *("--envs", "4", "--batch", "2", "--threads", "1", "--repeats", "1"),
        *("--seconds", "0.5", "--warmup", "0.2", "--frames-per-batch", "64"),
        *("--splits", "1,2", "--double-buffer", "--env-nice", "5", "--out", str(tmp_path)),
    )
    result = json.loads((tmp_path / "atari_throughput.json").read_text())
    assert result["config"]["env_nice"] == 5
    rows = result["summary"]
    for w in (1, 2):
        for name in ("env_only", "hand_loop", "rlcollect[thread-", "rlcollect[process_slots-"):
            series = f"{name}{w}w]" if name.endswith("-") else f"{name}[{w}w]"
            assert rows[series]["fps_median"] > 0, series
            assert rows[series]["split"] == w
        assert rows[f"rlcollect[process_slots-{w}w]"]["ratio_to_env_only_median"] > 0
    assert rows["rlcollect[thread-2w]"]["ratio_to_best_hand_loop_median"] > 0
    for series in ("rlcollect[thread-2x]", "rlcollect[process_slots-2x]"):
        assert rows[series]["split"] == 2  # compared with env_only[2w] and hand_loop[2w]
        assert rows[series]["ratio_to_env_only_median"] > 0
    assert result["repeats_done"] == 1
    assert "| `rlcollect[thread-1w]` |" in out


# The lab's scripts (benchmarks/*.py beside the suite) run end to end in the tests marked
# lab (make test-lab), outside make test for its time; here each is imported, so that a
# renamed or removed name it uses fails make test all the same.
LAB_SCRIPTS = sorted(
    p for p in (ROOT / "benchmarks").glob("*.py") if p.name not in ("__init__.py", "__main__.py")
)


# Scripts that import an optional extra at the top, left out where it is not installed.
LAB_EXTRAS = {"ray_scaling.py": "ray"}


def test_every_lab_script_imports():
    assert len(LAB_SCRIPTS) >= 19, LAB_SCRIPTS  # every script of the lab, none lost to the glob
    paths = [
        str(p)
        for p in LAB_SCRIPTS
        if p.name not in LAB_EXTRAS or importlib.util.find_spec(LAB_EXTRAS[p.name]) is not None
    ]
    code = "import runpy, sys\nfor p in sys.argv[1:]:\n    runpy.run_path(p, run_name='lab')"
    done = subprocess.run(
        [sys.executable, "-c", code, *paths], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]


def test_atari_throughput_series_can_leave_out_either_worker_kind():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import atari_throughput as at
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    both = at.series_names([1], process=True, double_buffer=True)
    assert "rlcollect[thread-1w]" in both and "rlcollect[process_slots-2x]" in both
    processes = at.series_names([1], process=True, double_buffer=True, thread=False)
    assert [n for n in processes if n.startswith("rlcollect")] == [
        "rlcollect[process_slots-1w]",
        "rlcollect[process_slots-2x]",
    ]
    assert {"env_only[1w]", "hand_loop[1w]", "env_only[2w]", "hand_loop[2w]"} <= set(processes)
    threads = at.series_names([1], process=False, double_buffer=False)
    assert [n for n in threads if n.startswith("rlcollect")] == ["rlcollect[thread-1w]"]
    held = at.series_names([1, 2], process=False, double_buffer=False, holds_us=(150, 300))
    assert "hand_loop[2w+300us]" in held and "hand_loop[1w+150us]" in held
    assert at.split_of("hand_loop[2w+300us]") == 2 and at.hold_of("hand_loop[2w+300us]") == 3e-4
    assert at.hold_of("hand_loop[2w]") == 0.0 and at.split_of("rlcollect[process_slots-2x]") == 2


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="gathers on a CUDA device")
def test_gather_width_benchmark(tmp_path):
    out = run(
        "benchmarks/gather_width.py",
        *("--rows", "16", "--batches", "4", "--iterations", "5", "--out", str(tmp_path)),
    )
    row = json.loads((tmp_path / "gather_width.json").read_text())["rows"][0]
    assert row["batch"] == 4 and row["index_select_8B_fresh_us"] > 0
    assert "| 4 |" in out


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_inference_latency_benchmark_latency_only(tmp_path):
    run(
        "benchmarks/inference_latency.py",
        *("--latency-only", "--modes", "graph", "--iters", "3", "--out", str(tmp_path)),
    )
    result = json.loads((tmp_path / "inference_latency.json").read_text())
    assert set(result["latency_seconds"]) == {"graph", "bare_graph"}
    assert all(v > 0 for v in result["latency_seconds"]["graph"].values())
    assert result["collection"] == {}


@pytest.mark.lab
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


@pytest.mark.lab
@pytest.mark.slow
def test_cheap_envs_benchmark(tmp_path):
    out_file = tmp_path / "cheap.json"
    run(
        "benchmarks/cheap_envs.py",
        *("--repeats", "1", "--seconds", "0.3", "--cases", "cartpole1", "cartpole4"),
        *("--out", str(out_file)),
    )
    summary = json.loads(out_file.read_text())["summary"]
    assert summary["cartpole1"]["best_plain_loop"] in ("plain_env", "sync_vector", "async_vector")
    for case in ("cartpole1", "cartpole4"):
        for name in ("rlcollect[thread]", "rlcollect[worker]"):
            assert summary[case][name]["fps"] > 0 and summary[case][name]["round_trip_p50_us"] > 0
    assert (tmp_path / "cheap.png").stat().st_size > 0


@pytest.mark.lab
@pytest.mark.slow
def test_tuning_sweep_quick(tmp_path):
    # Two points of two series in fresh processes, tiny windows: the sweep's JSON as the
    # tuning guide reads it.
    out = tmp_path / "tuning"
    run("-m", "benchmarks.tuning", "--quick", "--series", "chunk", "transport", "--out", str(out))
    for series, first in (("chunk", "transition_chunk_size=1"), ("transport", "thread")):
        doc = json.loads((out / f"{series}.json").read_text())
        assert doc["complete"], series
        row = doc["summary"][first]
        assert row["failures"] == 0, doc["runs"][first]
        assert row["frames_per_second"]["median"] > 0
        assert row["mean_batch_size"]["median"] >= 1


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads Linux's /proc")
def test_benchmark_vector_env_threads_run_at_the_niceness_asked():
    """benchmarks/common.py's `nice`: the env's C++ threads niced, the caller's thread not."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from common import make_atari_vector
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))

    def niceness() -> dict[int, int]:
        out = {}
        for tid in Path("/proc/self/task").iterdir():
            try:
                stat = (tid / "stat").read_text()
            except FileNotFoundError:
                continue  # a thread that ended between the listing and the read
            fields = stat.rsplit(")", 1)[1].split()
            out[int(tid.name)] = int(fields[16])  # stat field 19, counted after the name
        return out

    own = niceness()
    env = make_atari_vector(4, 2, 2, nice=7)
    try:
        new = {tid: n for tid, n in niceness().items() if tid not in own}
        assert new and set(new.values()) == {7}, new
        assert niceness()[threading.get_native_id()] == own[threading.get_native_id()]
    finally:
        env.close()


def test_benchmarks_record_the_niceness_a_vector_worker_takes():
    """benchmarks/common.py reads the privilege (rlimit, capability) that lowering a
    niceness needs, and from it the niceness a vector worker's thread takes; both must
    agree with trying it in a thread."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from common import machine
        from common import may_lower_niceness as read_privilege
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    for nice in (-10, -5, -1, 0):
        assert read_privilege(nice) == may_lower_niceness(nice), nice
    assert machine()["vector_worker_nice"] == lowest_niceness_allowed(DRIVER_NICE)


def test_ppo_lstm(tmp_path):
    # A few updates of each policy: the recurrent one trains from the stored states, the
    # control without them; both write their curves, the figure holds both.
    for flag in ((), ("--feed-forward",)):
        out = run(
            "examples/ppo_lstm.py",
            *flag,
            *("--steps", "2048", "--envs", "4", "--rollout", "64", "--eval-episodes", "2"),
            *("--out", str(tmp_path)),
        )
        assert "mean return (last 20)" in out, out
    lstm = json.loads((tmp_path / "ppo_lstm.json").read_text())
    control = json.loads((tmp_path / "ppo_lstm_control.json").read_text())
    assert lstm["policy"] == "lstm" and control["policy"].startswith("feed-forward")
    for result in (lstm, control):
        assert result["env_steps"] == 2048 and result["updates"] == 8
        assert len(result["eval_returns"]) == 2 and result["episodes"] > 0
        # CartPole pays 1 a step: finished episodes add up to at most the steps taken
        assert sum(ret for _, ret in result["curve"]) <= 2048
    assert (tmp_path / "ppo_lstm.png").stat().st_size > 0


def test_recurrent_step_benchmark(tmp_path):
    # The eager steps on a CPU; on a GPU the graphed ones too (compiling is left out here:
    # it takes minutes for little more proof).
    device = "cuda" if torch.cuda.is_available() else "cpu"
    out = run(
        "benchmarks/recurrent_step.py",
        *("--sizes", "1,64", "--iters", "5", "--envs", "128", "--hidden", "32"),
        *("--modes", "eager,graph" if device == "cuda" else "eager", "--out", str(tmp_path)),
    )
    result = json.loads((tmp_path / f"recurrent_step_{device}.json").read_text())
    for kind in ("feed_forward", "recurrent"):
        assert result["latency_seconds"]["eager"][kind]["64"] > 0
    assert result["recurrent_over_feed_forward"]["eager"]["64"] > 0
    if device == "cuda":
        assert result["target"]["ratio"] > 0
    assert "| eager | 64 |" in out


def test_ppo_cartpole(tmp_path):
    # Both rollout loops, two rollouts each: the JSON, the curve, the timing in one run.
    out = run(
        "examples/ppo_cartpole.py",
        *("--total-timesteps", "1024", "--num-steps", "128", "--loop", "rlcollect", "sync"),
        *("--out", str(tmp_path)),
    )
    result = json.loads((tmp_path / "ppo_cartpole.json").read_text())
    runs = {run["loop"]: run for run in result["runs"]}
    assert set(runs) == {"rlcollect", "sync"}
    for run_ in runs.values():
        assert run_["env_steps"] == 1024 and run_["wall_seconds"] > 0
        steps = [step for step, _ in run_["curve"]]
        assert steps == sorted(steps) and all(0 < s <= 1024 for s in steps)
        # CartPole pays 1 a step: an episode's return is its length, at least 8
        assert all(ret >= 8 for _, ret in run_["curve"])
    assert "rlcollect seed 1: mean return (last 100)" in out, out
    assert (tmp_path / "ppo_cartpole.png").stat().st_size > 0
    # every rollout acted with the weights of every update before it
    assert runs["rlcollect"]["policy_lag"] == {"0": 2} == runs["sync"]["policy_lag"]


def test_ppo_cartpole_overlap(tmp_path):
    # Collection beside learning: the first rollout acts with the initial weights, every
    # later one with those of the update before the last (one behind the learner).
    run(
        "examples/ppo_cartpole.py",
        *("--total-timesteps", "2048", "--num-steps", "128", "--overlap"),
        *("--out", str(tmp_path)),
    )
    result = json.loads((tmp_path / "ppo_cartpole_overlap.json").read_text())
    (run_,) = result["runs"]
    assert run_["overlap"] and run_["env_steps"] == 2048
    assert run_["policy_lag"] == {"0": 1, "1": 3}
    steps = [step for step, _ in run_["curve"]]
    assert steps == sorted(steps) and all(0 < s <= 2048 for s in steps)
    assert (tmp_path / "ppo_cartpole_overlap.png").stat().st_size > 0


@pytest.mark.lab
def test_staleness_benchmark(tmp_path):
    out = run("benchmarks/staleness.py", "--batches", "4", "--envs", "2", "--out", str(tmp_path))
    result = json.loads((tmp_path / "staleness.json").read_text())
    assert result["on_policy"]["stale_fraction"] == 0.0  # the envs wait for the learner
    for mode in ("off_policy_rows", "on_policy", "background"):
        assert result[mode]["rows"] > 0, mode
        assert f"| {mode} |" in out


PPO_ATARI_TINY = (
    *("--num-envs", "2", "--num-steps", "16", "--num-minibatches", "2", "--update-epochs", "1"),
    # episodes cut at 100 frames (25 steps), so that a tiny budget sees some end
    *("--max-episode-frames", "100", "--device", "cpu", "--log-every", "0"),
)


def check_ppo_atari_run(result, *, updates, stopped_by):
    """What ppo_atari.py promises in its JSON, whichever loop wrote it."""
    summary = result["summary"]
    assert summary["updates"] == len(result["updates"]) == updates, summary
    assert summary["env_steps"] == updates * 32 and summary["stopped_by"] == stopped_by
    assert summary["wall_seconds"] >= summary["startup_seconds"] > 0
    assert summary["episodes"] == len(result["episodes"])
    for update in result["updates"]:
        assert all(math.isfinite(update[k]) for k in ("pg_loss", "v_loss", "entropy", "lr"))
    steps = [ep["env_step"] for ep in result["episodes"]]
    assert steps == sorted(steps) and all(0 < s <= updates * 32 for s in steps), steps
    assert all(-21 <= ep["return"] <= 21 for ep in result["episodes"])
    assert result["config"]["batch_size"] == 32 and result["config"]["minibatch_size"] == 16


@pytest.mark.slow
def test_ppo_atari_both_loops(tmp_path):
    # The rlcollect loop and the synchronous baseline on the same AtariVectorEnv, four
    # updates each on the CPU; the overlapped loop stopped early by --stop-at-target (a
    # target every episode meets), which drains the rollout asked for meanwhile.
    names = {
        "rlcollect": ("--loop", "rlcollect", "--total-timesteps", "128"),
        "sync": ("--loop", "sync", "--total-timesteps", "128"),
        "rlcollect_overlap": ("--overlap", "--total-timesteps", "1024", "--stop-at-target",
                              "--target-return", "-21", "--target-window", "1"),
    }  # fmt: skip
    results = {}
    for name, flags in names.items():
        run("examples/ppo_atari.py", *flags, *PPO_ATARI_TINY, "--out", str(tmp_path))
        results[name] = json.loads((tmp_path / f"ppo_atari_ale_{name}_seed1.json").read_text())
        assert (tmp_path / f"ppo_atari_ale_{name}_seed1.png").stat().st_size > 0
    for name in ("rlcollect", "sync"):
        check_ppo_atari_run(results[name], updates=4, stopped_by="total_timesteps")
        # the same envs, seeds and cut: each env ends an episode every 25 steps
        assert [ep["env_step"] for ep in results[name]["episodes"]] == [50, 50, 100, 100]
        assert results[name]["summary"]["policy_lag"]["counts"] == {"0": 4}
    assert results["rlcollect"]["summary"]["collector"]["frames"] == 128
    # overlapped: the second rollout (acted by the weights before the first update) holds
    # the first episode's end, so the run stops after two updates, the second one lagging
    overlap = results["rlcollect_overlap"]
    check_ppo_atari_run(overlap, updates=2, stopped_by="target")
    assert overlap["summary"]["policy_lag"]["counts"] == {"0": 1, "1": 1}
    assert overlap["summary"]["target"]["env_step"] == 50
    # --plot's figure of several runs, drawn here rather than in one more process
    ppo_atari = load_example("ppo_atari")
    ppo_atari.plot(list(results.values()), tmp_path / "compare.png")
    assert (tmp_path / "compare.png").stat().st_size > 0


def load_example(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / f"examples/{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="captures a CUDA graph")
def test_ppo_atari_graphed_learner_matches_eager(monkeypatch):
    # The learner's minibatch step as a CUDA graph does the eager step's arithmetic: from
    # the same weights, on the same rollouts and permutations, three updates each leave
    # the same weights and report the same losses. A graph that read stale inputs (the
    # rows, the rollout, the learning rate) or whose capture left the weights or Adam's
    # state moved would drift at once.
    ppo_atari = load_example("ppo_atari")
    flags = ["--num-envs", "8", "--num-steps", "32", "--num-minibatches", "4"]
    monkeypatch.setattr(sys, "argv", ["ppo_atari.py", *flags, "--total-timesteps", "1024"])
    args = ppo_atari.parse_args()
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", False)
    monkeypatch.setattr(torch.backends.cudnn, "deterministic", True)
    device = torch.device("cuda")
    torch.manual_seed(0)
    initial = ppo_atari.Agent(6).to(device)
    n, t = args.num_envs, args.num_steps
    rollouts = []
    for _ in range(3):
        done = torch.rand(n, t, device=device) < 0.05
        rollouts.append({
            "obs": torch.randint(0, 256, (n, t, 4, 84, 84), dtype=torch.uint8, device=device),
            "action": torch.randint(0, 6, (n, t), device=device),
            "logprob": math.log(1 / 6) + 0.1 * torch.randn(n, t, device=device),
            "value": torch.randn(n, t, device=device),
            "reward": torch.randint(-1, 2, (n, t), device=device).float() * done,
            "done": done,
            "last_next_obs": torch.randint(0, 256, (n, 4, 84, 84), dtype=torch.uint8,
                                           device=device),
        })  # fmt: skip
    results = {}
    for graphed in (False, True):
        args.graph_learner = graphed
        agent = ppo_atari.Agent(6).to(device)
        agent.load_state_dict(initial.state_dict())
        learner = ppo_atari.PPO(agent, args, device)
        torch.manual_seed(1)  # the same minibatch permutations for both
        stats = [learner.update(rollout, i) for i, rollout in enumerate(rollouts, 1)]
        assert (learner.graph is not None) == graphed
        results[graphed] = stats, [p.detach().clone() for p in agent.parameters()]
    (eager_stats, eager_params), (graph_stats, graph_params) = results[False], results[True]
    pairs = zip(eager_params, initial.parameters(), strict=True)
    moved = max((p - q).abs().max().item() for p, q in pairs)
    assert moved > 1e-4  # the updates did change the weights
    for p, q in zip(eager_params, graph_params, strict=True):
        torch.testing.assert_close(q, p, rtol=1e-4, atol=1e-5)
    for eager, graph in zip(eager_stats, graph_stats, strict=True):
        assert graph.keys() == eager.keys()
        for key in eager:
            assert graph[key] == pytest.approx(eager[key], rel=1e-3, abs=1e-6), key


@pytest.mark.slow
def test_ppo_atari_gym_envs_and_deadline(tmp_path):
    # gymnasium envs: in the collector's worker processes, and in AsyncVectorEnv processes
    # for the baseline, there stopped by a deadline already past at the first update.
    run("examples/ppo_atari.py", "--envs", "gym", *PPO_ATARI_TINY, "--total-timesteps", "64",
        "--out", str(tmp_path))  # fmt: skip
    collected = json.loads((tmp_path / "ppo_atari_gym_rlcollect_seed1.json").read_text())
    check_ppo_atari_run(collected, updates=2, stopped_by="total_timesteps")
    run("examples/ppo_atari.py", "--envs", "gym", "--loop", "sync", *PPO_ATARI_TINY,
        "--total-timesteps", "1024", "--max-seconds", "0.001", "--out", str(tmp_path))  # fmt: skip
    sync = json.loads((tmp_path / "ppo_atari_gym_sync_seed1.json").read_text())
    check_ppo_atari_run(sync, updates=1, stopped_by="max_seconds")


def test_torchrl_ppo(tmp_path):
    # The recipe of docs/torchrl.md, two rollouts, then the evaluation collector.
    out = run(
        "examples/torchrl_ppo.py",
        *("--frames", "512", "--num-envs", "4", "--num-steps", "64", "--epochs", "2"),
        *("--eval-episodes", "2", "--out", str(tmp_path)),
    )
    result = json.loads((tmp_path / "torchrl_ppo.json").read_text())
    (run_,) = result["runs"]
    assert run_["frames"] == 512 and run_["exploration_type"] == "random"
    frames = [f for f, _ in run_["curve"]]
    assert frames == sorted(frames) and all(0 < f <= 512 for f in frames)
    # CartPole pays 1 a step: finished episodes add up to at most the frames taken
    assert sum(ret for _, ret in run_["curve"]) <= 512
    assert len(run_["eval_returns"]) == 2 and all(r >= 8 for r in run_["eval_returns"])
    assert "seed 1: mean return (last 100)" in out, out
    assert (tmp_path / "torchrl_ppo.png").stat().st_size > 0


def test_cleanrl_ppo(tmp_path):
    out = run(
        "examples/cleanrl_ppo.py",
        *("--total-timesteps", "1024", "--out", str(tmp_path)),
    )
    result = json.loads((tmp_path / "cleanrl_ppo.json").read_text())
    assert result["env_steps"] == 1024 and result["episodes"] == len(result["curve"]) > 0
    steps = [s for s, _ in result["curve"]]
    assert steps == sorted(steps) and all(0 < s <= 1024 for s in steps)
    assert sum(ret for _, ret in result["curve"]) <= 1024
    assert "global_step=512, episodic_return=" in out, out
    assert (tmp_path / "cleanrl_ppo.png").stat().st_size > 0


def test_cleanrl_dqn(tmp_path):
    run(
        "examples/cleanrl_dqn.py",
        *("--total-timesteps", "3000", "--learning-starts", "1000", "--out", str(tmp_path)),
    )
    result = json.loads((tmp_path / "cleanrl_dqn.json").read_text())
    check_dqn_summary(
        result, steps=3000, learning_starts=1000, batch_size=128, train_ratio=12.8, batch_rows=10
    )
    assert sum(ret for _, ret in result["curve"]) <= 3000
    assert (tmp_path / "cleanrl_dqn.png").stat().st_size > 0
