"""The layout the defaults choose (collector/choice.py): the rule table on figures, and
the collector that measures them, runs the choice and says what it chose."""

import dataclasses
import functools
import logging
import threading

import pytest
import torch
from envs import StepCounter, cartpole
from helpers import (
    CountingPolicy,
    RecurrentCountingPolicy,
    check_counting_streams,
    collect,
    counting_envs,
)

from rlcollect import AsyncBatchedCollector
from rlcollect.collector.choice import (
    KNOBS,
    OFF_POLICY_MARGIN,
    ON_POLICY_MARGIN,
    RULES,
    Choice,
    Figures,
    choose,
    process_margin,
    process_speedup,
)
from rlcollect.transports import ProcessSlotTransport, ThreadQueueTransport

# Figures as the probe measures them for the workloads the rules were made for: CartPole
# and a small MLP (a step far cheaper than the forward), Pong and a small CNN (a step
# about as costly as the forward, an observation of 33,600 bytes).
CARTPOLE = dict(env_step_s=6e-6, forward_1_s=50e-6, forward_n_s=55e-6, observation_bytes=16)
PONG = dict(env_step_s=400e-6, forward_1_s=600e-6, forward_n_s=950e-6, observation_bytes=33600)


def figures(**overrides):
    values = dict(cores=2, device="cpu", factories=4, num_envs=4, **CARTPOLE)
    values.update(overrides)
    return Figures(**values)


def chosen(f, given=None):
    rule, layout = choose(f, given or {})
    return rule.name, layout


# ------------------------------------------------------------------ the rule table


def test_every_rule_has_a_distinct_name_and_the_last_applies_to_anything():
    names = [rule.name for rule in RULES]
    assert len(set(names)) == len(names)
    assert RULES[-1].applies(figures(device="mps")) and RULES[-1].defines == ()


def test_cheap_envs_on_busy_cores_step_in_one_worker_thread_that_runs_the_policy():
    # Other programs keep the cores busy: processes would only share the same CPU time,
    # and each pays a forward per step where one thread pays one for every env.
    name, layout = chosen(figures(free_cores=0.5))
    assert name == "cpu-one-thread"
    assert layout == {
        "transport": "thread",
        "inference_backend": "worker",
        "envs_per_worker": 4,
        "worker_splits": "auto",
    }


def test_on_free_cores_worker_processes_step_in_parallel_about_one_per_core():
    for f in (figures(), figures(**PONG), figures(free_cores=2.0)):
        name, layout = chosen(f)
        assert name == "cpu-processes"
        assert (layout["transport"], layout["inference_backend"]) == ("process_slots", "worker")
        assert layout["envs_per_worker"] == "auto"


def test_on_policy_rollouts_take_processes_only_where_they_clearly_pay():
    # The envs wait while the learner learns: the rollout's speed is all processes gain,
    # against the thread's instant start (PPO's 200k steps of four CartPole envs).
    f = figures(on_policy=True, total_frames=200_000)
    speedup = process_speedup(f)
    assert speedup is not None and speedup < ON_POLICY_MARGIN == process_margin(f)
    assert chosen(f)[0] == "cpu-one-thread"
    assert process_margin(figures()) == OFF_POLICY_MARGIN < ON_POLICY_MARGIN
    assert chosen(figures(on_policy=True, **PONG))[0] == "cpu-processes"


def test_busier_cores_and_cheaper_envs_favour_the_one_thread():
    speedups = [process_speedup(figures(free_cores=free)) for free in (2.0, 1.5, 1.0, 0.0)]
    # From one core down, both get the same CPU time: what counts is the CPU per frame,
    # where one forward for every env beats a forward per worker.
    assert speedups[0] > speedups[1] > speedups[2] == speedups[3]
    assert speedups[3] < 1


def test_busy_programs_of_this_session_favour_the_processes():
    # Other sessions' programs keep their group's time: the collector has what they
    # leave, however many processes it runs. Programs of its own session share the cores
    # with it thread by thread: two worker processes get two parts where one thread
    # gets one, which pays for their extra forwards where a step or a forward is costly.
    for workload in ({**PONG, "num_envs": 4}, {"factories": 16, "num_envs": 16}):
        assert chosen(figures(free_cores=0.5, **workload))[0] == "cpu-one-thread"
        assert chosen(figures(busy_beside=2.0, **workload))[0] == "cpu-processes"
    speedups = [process_speedup(figures(busy_beside=b)) for b in (0.0, 1.0, 2.0, 4.0)]
    assert speedups[0] > speedups[1] and speedups[1] < speedups[2] < speedups[3]


def test_many_cheap_envs_on_many_cores_run_in_processes():
    # 64 CartPole envs on 16 cores: sixteen processes step four envs each in parallel,
    # more than a single thread can make up for with its one forward per step.
    assert chosen(figures(cores=16, factories=64, num_envs=64))[0] == "cpu-processes"


def test_a_short_run_does_not_pay_for_the_processes_start_up():
    endless = process_speedup(figures(**PONG))
    short = process_speedup(figures(**PONG, total_frames=2_000))
    assert endless is not None and short is not None
    assert short < OFF_POLICY_MARGIN <= endless
    assert chosen(figures(**PONG, total_frames=2_000))[0] == "cpu-one-thread"


def test_the_speedup_grows_with_the_envs_cost_and_needs_every_figure():
    cheap = process_speedup(figures())
    costly = process_speedup(figures(**PONG))
    assert cheap is not None and costly is not None and cheap < costly
    assert process_speedup(figures(env_step_s=None)) is None
    assert process_speedup(figures(forward_n_s=None)) is None
    # Unmeasured figures: the processes, as documented for the in-worker policy.
    assert chosen(figures(env_step_s=None))[0] == "cpu-processes"


def test_a_learner_beside_the_collection_gets_processes_to_step_beside_it():
    assert chosen(figures(free_cores=0.5, replay_buffer=True))[0] == "cpu-processes"


def test_policy_lag_leaves_the_learner_a_core():
    name, layout = chosen(figures(on_policy=True, policy_lag=1))
    assert name == "cpu-policy-lag"
    assert layout["transport"] == "process_slots" and layout["envs_per_worker"] == 4


@pytest.mark.parametrize(
    ("overrides", "rule"),
    [
        ({"recurrent": True}, "recurrent"),
        ({"server_batching": True}, "server-batching"),
        ({"policy_picklable": False}, "policy-stays"),
    ],
)
def test_a_policy_the_workers_cannot_run_is_served_by_the_server_thread(overrides, rule):
    name, layout = chosen(figures(**overrides))
    assert name == rule and layout["inference_backend"] == "thread"
    assert layout["transport"] == "process_slots"


def test_env_factories_that_do_not_pickle_stay_in_this_process():
    assert chosen(figures(envs_picklable=False, **PONG))[1]["transport"] == "thread"
    assert chosen(figures(envs_picklable=False, recurrent=True))[1]["transport"] == "thread"


@pytest.mark.parametrize(
    ("overrides", "rule", "backend", "envs_per_worker"),
    [
        # one AtariVectorEnv driven with send/recv: the policy in its worker, on the GPU
        ({"factories": 1, "num_envs": 64, "sub_envs": 64, "asynchronous": True},
         "gpu-vector-send-recv", "worker", 1),
        ({"factories": 8, "num_envs": 32, "sub_envs": 4}, "gpu-vector", "thread", 1),
        ({"factories": 64, "num_envs": 64}, "gpu-many-envs", "process", "auto"),
        ({"factories": 16, "num_envs": 16}, "gpu-many-envs", "process", "auto"),
        ({"factories": 8, "num_envs": 8}, "gpu", "thread", "auto"),
    ],
)  # fmt: skip
def test_gpu_layouts_are_the_documented_ones(overrides, rule, backend, envs_per_worker):
    f = figures(device="cuda", cores=16, **{**PONG, **overrides})
    name, layout = chosen(f)
    assert (name, layout["inference_backend"]) == (rule, backend)
    assert layout["envs_per_worker"] == envs_per_worker


def test_every_given_knob_wins_and_rules_that_stand_on_another_value_step_aside():
    # cpu-one-thread stands on the thread transport: given worker processes, the next
    # rule that agrees fills the rest.
    busy = figures(free_cores=0.5)
    assert chosen(busy)[0] == "cpu-one-thread"
    name, layout = chosen(busy, {"transport": "process_slots"})
    assert name == "cpu-processes" and layout["transport"] == "process_slots"
    name, layout = chosen(busy, {"inference_backend": "thread"})
    assert name == "server" and layout["inference_backend"] == "thread"
    name, layout = chosen(busy, {"envs_per_worker": 2})  # only filled by the rule
    assert name == "cpu-one-thread" and layout["envs_per_worker"] == 2
    given = {"transport": "thread", "inference_backend": "thread", "envs_per_worker": 1}
    given["worker_splits"] = None
    assert chosen(figures(), given) == ("given", given)


def test_the_reason_and_the_figures_read_as_text():
    f = figures(total_frames=1000, on_policy=True)
    for rule in RULES:
        assert rule.why(f) and "\n" not in rule.why(f)
    text = str(f)
    assert "2 usable cores" in text and "env step 6 us" in text and "on-policy" in text


# ------------------------------------------------------------------ the collector


def test_the_collector_runs_what_it_describes_and_logs_it_once(caplog):
    with (
        caplog.at_level(logging.INFO, logger="rlcollect"),
        AsyncBatchedCollector(
            counting_envs(4), CountingPolicy(), frames_per_batch=16, total_frames=64
        ) as c,
    ):
        data = collect(c)
        choice = c.describe()
    check_counting_streams(data)
    assert isinstance(choice, Choice) and choice.given == ()
    assert choice.envs_per_worker == c.envs_per_worker
    assert choice.worker_splits == c.worker_splits
    kinds = {"thread": ThreadQueueTransport, "process_slots": ProcessSlotTransport}
    assert type(c.transport) is kinds[choice.transport]
    assert choice.figures.env_step_s is not None and choice.figures.forward_1_s is not None
    assert choice.figures.probe_seconds > 0
    logged = [r for r in caplog.records if r.name == "rlcollect" and r.levelno == logging.INFO]
    assert [r.getMessage() for r in logged] == [str(choice)]
    assert (
        str(choice)
        .splitlines()[-1]
        .endswith(", ".join(f"{k}={v!r}" for k, v in choice.arguments().items()))
    )


def test_the_described_arguments_give_the_same_layout_explicitly():
    kwargs = dict(frames_per_batch=16, total_frames=32)
    with AsyncBatchedCollector(counting_envs(4), CountingPolicy(), **kwargs) as c:
        first = c.describe()
    with AsyncBatchedCollector(
        counting_envs(4), CountingPolicy(), **kwargs, **first.arguments()
    ) as c:
        again = c.describe()
    assert again.rule == "given" and again.given == KNOBS
    assert again.arguments() == first.arguments()
    # nothing left to choose: nothing was timed
    assert again.figures.env_step_s is None and again.figures.probe_seconds == 0.0


def test_given_arguments_win_over_the_choice():
    with AsyncBatchedCollector(
        counting_envs(4),
        CountingPolicy(),
        frames_per_batch=16,
        total_frames=32,
        transport="process_slots",
        inference_backend="thread",
    ) as c:
        choice = c.describe()
        assert isinstance(c.transport, ProcessSlotTransport)
        assert type(c.server).__name__ != "InWorkerBackend"
    assert choice.given == ("transport", "inference_backend")
    assert (choice.transport, choice.inference_backend) == ("process_slots", "thread")


def test_a_given_transport_instance_is_named_by_its_kind():
    transport = ThreadQueueTransport()
    with AsyncBatchedCollector(
        counting_envs(2), CountingPolicy(), frames_per_batch=8, total_frames=16, transport=transport
    ) as c:
        assert c.transport is transport
        assert c.describe().transport == "thread"


def test_a_recurrent_policy_is_served_by_the_server_and_not_timed():
    with AsyncBatchedCollector(
        counting_envs(2), RecurrentCountingPolicy(), frames_per_batch=8, total_frames=16
    ) as c:
        choice = c.describe()
        collect(c)
    assert choice.rule == "recurrent" and choice.inference_backend == "thread"
    assert choice.figures.recurrent and choice.figures.forward_1_s is None


def test_an_unpicklable_policy_is_served_in_this_process():
    lock = threading.Lock()  # what the factory holds: no pickler can send it

    def factory():
        assert lock is not None
        return CountingPolicy()

    with AsyncBatchedCollector(
        counting_envs(2), policy_factory=factory, frames_per_batch=8, total_frames=16
    ) as c:
        choice = c.describe()
        check_counting_streams(collect(c))
    assert choice.rule == "policy-stays" and choice.inference_backend == "thread"


def test_choosing_leaves_the_callers_random_streams_as_they_were():
    def draw_after(**layout):
        torch.manual_seed(123)
        with AsyncBatchedCollector(
            [cartpole] * 2, CountingSampler(), frames_per_batch=8, total_frames=8, **layout
        ):
            pass
        # After the collector, not while it runs: a worker thread of this process swaps
        # the policy's stream in around each call (docs/reproducibility.md).
        return torch.rand(4)

    given = dict(transport="thread", inference_backend="thread", envs_per_worker=2)
    assert torch.equal(draw_after(), draw_after(**given, worker_splits=None))


class CountingSampler(torch.nn.Module):
    """Samples its actions from the default generator: a draw the probe must not leak."""

    def forward(self, obs):
        return torch.randint(0, 2, (obs.shape[0],))


def test_the_in_process_path_steps_every_env_in_one_thread_of_this_process():
    # 64 frames in all: worker processes could never make up for their start-up.
    StepCounter.steps = 0
    with AsyncBatchedCollector(
        [functools.partial(StepCounter, i) for i in range(4)],
        CountingPolicy(),
        frames_per_batch=16,
        total_frames=64,
        policy_device="cpu",
    ) as c:
        data = collect(c)
        choice = c.describe()
    assert choice.rule == "cpu-one-thread", choice
    assert isinstance(c.transport, ThreadQueueTransport) and c.envs_per_worker == 4
    assert StepCounter.steps >= 64  # stepped here, in this process
    check_counting_streams(data)


def test_figures_are_frozen_and_replaceable():
    f = figures()
    assert dataclasses.replace(f, cores=8).cores == 8
    with pytest.raises(dataclasses.FrozenInstanceError):
        f.cores = 3  # type: ignore[misc]
