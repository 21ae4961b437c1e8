"""On-policy rollouts (``on_policy=True``, collector/batches/rounds.py): their contract on
every transport, inference backend and kind of env source.

Each batch is [num_envs, T], row e is env e's next T steps in order, and every row of
batch k was computed by the weights of the k-th update: the policy writes its weight
``tag`` on every row, and the learner changes it between batches, so a row computed
before an update (an env running ahead of the learner) shows the old tag.
"""

import functools
import gc
import os
import re
import signal
import threading
import time

import envs
import gymnasium as gym
import pytest
import torch
from envs import HangOnce, StepCounter, async_factories, sync_factories
from helpers import (
    CountingPolicy,
    ListBuffer,
    TaggedPolicy,
    check_clean,
    check_counting_streams,
    check_episode_figures,
    counting_envs,
    process_gone,
    shm_exists,
    wait_until,
)

from rlcollect import AsyncBatchedCollector, ReplayBuffer
from rlcollect.errors import CollectorError, InferenceError, WorkerError
from rlcollect.testing import CountingEnv, CountingVectorEnv

# transport, inference backend
COMBOS = [("thread", "thread"), ("process_slots", "thread"), ("process_slots", "process")]


def _plain(n):
    return counting_envs(n)


def _ids_in_any_order(num_vector_envs, n):
    # Stepped whole, but each result names its sub-envs in a random order (info["env_id"]).
    return async_factories(num_vector_envs, n, n, "SameStep")


# name: (env factories, number of envs, collector kwargs)
SOURCES = {
    "plain": (_plain(4), 4, {}),
    "envs_per_worker": (_plain(6), 6, {"envs_per_worker": 3}),
    "worker_splits": (_plain(4), 4, {"envs_per_worker": 4, "worker_splits": 2}),
    "vector-SameStep": (sync_factories(2, 3, "SameStep"), 6, {}),
    "vector-Disabled": (sync_factories(2, 2, "Disabled"), 4, {"envs_per_worker": 2}),
    "vector-ids-in-any-order": (_ids_in_any_order(2, 3), 6, {}),
}


def make(combo, source, policy, steps=7, batches=4, **kwargs):
    transport, backend = combo
    env_fns, num_envs, extra = SOURCES[source]
    kwargs = {**extra, **kwargs}
    kwargs.setdefault("total_frames", num_envs * steps * batches)
    return AsyncBatchedCollector(
        env_fns,
        policy,
        frames_per_batch=num_envs * steps,
        transport=transport,
        inference_backend=backend,
        policy_device="cpu",
        on_policy=True,
        **kwargs,
    )


def acted_by_then_update(c, policy, batch, k, version):
    """Every row of batch ``k`` was acted by weights ``version`` (its ``policy_version``
    and the policy's own ``tag``); then the learner's update ``k + 1`` is pushed."""
    assert bool((batch["policy_version"] == version).all()), batch["policy_version"]
    assert bool((batch["tag"] == version).all()), f"batch {k} holds rows of other weights"
    with torch.no_grad():
        policy.tag.fill_(k + 1)
    assert c.update_policy_weights_(policy) == k + 1


@pytest.mark.parametrize("source", list(SOURCES))
@pytest.mark.parametrize("combo", COMBOS, ids=["-".join(c) for c in COMBOS])
def test_rollouts_are_env_rows_of_one_weights_version(combo, source):
    steps, num_envs = 7, SOURCES[source][1]
    policy = TaggedPolicy(0)
    batches = []
    with make(combo, source, policy, steps=steps) as c:
        for k, batch in enumerate(c):
            assert batch.batch_size == (num_envs, steps)
            assert torch.equal(
                batch["env_index"], torch.arange(num_envs)[:, None].expand(-1, steps)
            )
            batches.append(batch)
            # One weights version per batch: the one of the updates made before next().
            acted_by_then_update(c, policy, batch, k, version=k)
        episodes = c.stats()["episodes"]
    assert len(batches) == 4
    data = torch.cat([b.reshape(-1) for b in batches])
    check_counting_streams(data)  # routing; per env in order from step 0, no gap/duplicate
    check_episode_figures(data)
    for e in range(num_envs):
        # Row e of consecutive batches is env e's stream, already in order.
        row = torch.cat([b[e] for b in batches])
        order = row["episode"] * 1000 + row["step"]
        assert bool((order.diff() > 0).all()), f"env {e}'s rows are out of order"
    done = data[("next", "done")]
    assert episodes["count"] == int(done.sum())
    last = data[("next", "episode_length")][done][-100:].float()
    assert episodes["length_mean"] == pytest.approx(float(last.mean()))


def step_counting(**kwargs):
    """4 envs of 5 steps a batch, 3 batches; thread transport: the envs live in this
    process, so their steps can be counted (``StepCounter.steps``, reset here)."""
    fns = [functools.partial(StepCounter, i) for i in range(4)]
    c = AsyncBatchedCollector(
        fns, CountingPolicy(), frames_per_batch=4 * 5, total_frames=4 * 5 * 3,
        transport="thread", policy_device="cpu", on_policy=True, **kwargs,
    )  # fmt: skip
    # Counted from here: choosing the layout, the collector timed env 0 by stepping it;
    # no round starts before its batch is asked for.
    StepCounter.steps = 0
    return c


def test_envs_wait_while_the_learner_learns():
    with step_counting() as c:
        # Nothing steps before the first batch is asked for (the weights may still change).
        assert StepCounter.steps == 0
        for k, _ in enumerate(c):
            assert StepCounter.steps == 20 * (k + 1)
            # The learner learns: a real computation, after which no env has stepped.
            x = torch.randn(64, 64)
            for _ in range(200):
                x = torch.tanh(x @ x.T / 64)
            assert StepCounter.steps == 20 * (k + 1), "envs ran ahead of the learner"


def test_an_update_from_another_thread_never_splits_a_batch():
    # Background collection: the learner updates while rounds run; every batch (as
    # written to the buffer, [num_envs * T] rows) still holds one weights version.
    buffer = ListBuffer()
    policy = TaggedPolicy(0)
    with make(("process_slots", "thread"), "plain", policy, steps=10, batches=30,
              replay_buffer=buffer) as c:  # fmt: skip
        c.start()
        version = 0
        deadline = time.monotonic() + 120  # a hang guard
        while not c.join(timeout=0):
            assert time.monotonic() < deadline, "background collection did not end"
            with torch.no_grad():
                policy.tag.fill_(version + 1)
            version = c.update_policy_weights_(policy)
        c.join(timeout=60)
    assert buffer.rows() == 4 * 10 * 30
    previous = -1
    for part in buffer.parts:
        assert part.batch_size == (40,)
        versions = part["policy_version"].unique()
        assert len(versions) == 1, f"a batch mixes versions {versions.tolist()}"
        assert bool((part["tag"] == versions[0].float()).all())
        assert int(versions[0]) >= previous
        previous = int(versions[0])
    check_counting_streams(torch.cat(buffer.parts))


def test_background_collection_with_train_ratio():
    buffer = ReplayBuffer(1000)
    with make(("thread", "thread"), "plain", CountingPolicy(), steps=5, batches=6,
              replay_buffer=buffer, train_ratio=1.0) as c:  # fmt: skip
        c.start()
        # False once collection has ended and the learner's share is sampled (or after
        # 30 s with nothing to sample, which join() below would then explain).
        while c.wait_to_sample(timeout=30):
            buffer.sample(20)
        assert c.join(timeout=60)
        assert len(buffer) == 120
        assert c.stats()["train_ratio"] >= 1.0


def test_endless_on_policy_collection_stops_at_shutdown():
    with make(("process_slots", "thread"), "plain", CountingPolicy(), total_frames=-1) as c:
        for k, batch in enumerate(c):
            assert batch.batch_size == (4, 7)
            if k == 5:
                break
        assert c.stats()["frames"] == 6 * 28


def test_updates_before_the_first_batch_are_used_by_it():
    policy = TaggedPolicy(0)
    with make(("process_slots", "process"), "plain", policy) as c:
        for tag in (5, 6):
            with torch.no_grad():
                policy.tag.fill_(tag)
            c.update_policy_weights_(policy)
        batch = next(c)
    assert bool((batch["policy_version"] == 2).all())
    assert bool((batch["tag"] == 6).all())


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"frames_per_batch": 10}, "frames_per_batch=10 is not a multiple of the 4 envs"),
        ({"total_frames": 100}, "total_frames=100 is not a multiple of frames_per_batch=40"),
        ({"transition_chunk_size": 4}, "transition_chunk_size=4"),
        ({"max_worker_restarts": 1}, "max_worker_restarts=1"),
        ({"on_policy": 1}, "on_policy must be True or False"),
        ({"on_policy": False, "time_major": True}, r"time_major=True .* needs on_policy=True"),
        ({"time_major": 1}, "time_major must be True or False"),
    ],
)
def test_bad_on_policy_input_is_refused_at_construction(kwargs, message):
    args = {"frames_per_batch": 40, "total_frames": 400, "on_policy": True, **kwargs}
    with pytest.raises(ValueError, match=message):
        AsyncBatchedCollector(
            counting_envs(4), CountingPolicy(), transport="process_slots", policy_device="cpu",
            **args,
        )  # fmt: skip


@pytest.mark.parametrize(
    ("env_fns", "message"),
    [
        (sync_factories(2, 2, "NextStep"), "NextStep autoreset"),
        (
            [functools.partial(CountingVectorEnv, 0, 4, 2, autoreset_mode="SameStep")],
            "driven with send/recv",
        ),
    ],
    ids=["NextStep", "send-recv"],
)
def test_vector_envs_that_cannot_give_whole_rounds_are_refused(env_fns, message):
    with pytest.raises(ValueError, match=message):
        AsyncBatchedCollector(
            env_fns, CountingPolicy(), frames_per_batch=40, transport="thread",
            policy_device="cpu", on_policy=True,
        )  # fmt: skip


def test_cartpole_rollouts_with_gymnasium_sync_vector_env():
    def make_vec():
        return gym.vector.SyncVectorEnv(
            [functools.partial(gym.make, "CartPole-v1")] * 2,
            autoreset_mode=gym.vector.AutoresetMode.SAME_STEP,
        )

    class Policy(torch.nn.Module):
        def forward(self, obs):
            return (obs[:, 2] > 0).long()

    with AsyncBatchedCollector(
        [make_vec] * 2, Policy(), frames_per_batch=4 * 64, total_frames=4 * 64 * 2,
        transport="process_slots", policy_device="cpu", on_policy=True,
    ) as c:  # fmt: skip
        batches = list(c)
    for batch in batches:
        nxt, obs = batch[("next", "observation")], batch["observation"]
        # Within each row, the next observation is the following row's observation
        # unless the episode ended there.
        inner = ~batch[("next", "done")][:, :-1]
        assert torch.equal(nxt[:, :-1][inner], obs[:, 1:][inner])
    ends = torch.cat([b[("next", "done")].reshape(-1) for b in batches])
    lengths = torch.cat([b[("next", "episode_length")].reshape(-1) for b in batches])[ends]
    assert bool((lengths >= 8).all())  # a CartPole episode lasts at least 8 steps


def test_a_background_pause_and_update_inside_it_do_not_deadlock():
    buffer = ListBuffer()
    policy = TaggedPolicy(0)
    with make(("thread", "thread"), "plain", policy, steps=5, batches=40,
              replay_buffer=buffer) as c:  # fmt: skip
        c.start()
        wait_until(lambda: buffer.rows() > 0, timeout=30, what="a first batch")
        with c.pause(timeout=30):
            with torch.no_grad():
                policy.tag.fill_(1)
            c.update_policy_weights_(policy)
        assert c.join(timeout=60)
    for part in buffer.parts:
        assert len(part["policy_version"].unique()) == 1


def test_two_threads_updating_while_iterating_never_split_a_batch():
    policy = TaggedPolicy(0)
    stop = threading.Event()
    errors = []

    def updater(c):
        try:
            while not stop.is_set():
                c.update_policy_weights_(policy)
        except Exception as exc:  # the collector shut down under it: fine at the end
            if not stop.is_set():
                errors.append(exc)

    with make(("process_slots", "thread"), "plain", policy, steps=6, batches=15) as c:
        thread = threading.Thread(target=updater, args=(c,), daemon=True)
        thread.start()
        try:
            for k in range(15):
                batch = next(c)
                assert batch["policy_version"].unique().numel() == 1, f"batch {k} is split"
        finally:
            stop.set()
            thread.join(timeout=30)
        assert not thread.is_alive() and not errors
        assert c.policy_version > 0


# ------------------------------------------------------------------ policy_lag=1


@pytest.mark.parametrize("source", ["plain", "vector-SameStep"])
@pytest.mark.parametrize("combo", COMBOS, ids=["-".join(c) for c in COMBOS])
def test_policy_lag_one_acts_each_batch_with_the_weights_before_the_last_update(combo, source):
    # Batch k's round starts when batch k-1 is handed out, before the update on it: its
    # rows are all of version k-1 (batch 0: version 0), whatever the learner did since.
    steps, num_envs = 7, SOURCES[source][1]
    policy = TaggedPolicy(0)
    batches = []
    with make(combo, source, policy, steps=steps, batches=5, policy_lag=1) as c:
        assert c.policy_lag == 1
        for k, batch in enumerate(c):
            assert batch.batch_size == (num_envs, steps)
            batches.append(batch)
            # The weights before the update on batch k-1; the last update, after the
            # last batch, lands too: nothing was asked past it.
            acted_by_then_update(c, policy, batch, k, version=max(0, k - 1))
        assert c.stats()["frames"] == num_envs * steps * 5
    assert len(batches) == 5
    data = torch.cat([b.reshape(-1) for b in batches])
    check_counting_streams(data)
    check_episode_figures(data)


def test_policy_lag_one_collects_the_next_round_while_the_learner_learns():
    with step_counting(policy_lag=1) as c:
        assert StepCounter.steps == 0  # nothing before the first batch is asked for
        for k, _ in enumerate(c):
            if k < 2:
                # The caller is away (learning): round k+1 runs without another next().
                wait_until(lambda k=k: StepCounter.steps == 20 * (k + 2), timeout=30,
                           what=f"round {k + 1} while the learner learns")  # fmt: skip
    # No round past the budget was started: the helper stops at the last batch.
    assert StepCounter.steps == 60


def test_policy_lag_one_an_env_error_in_the_next_round_reaches_the_caller(transport):
    fns = counting_envs(4)
    # Env 2's 17th step (episode 2, step 1) raises: in round 2, collected by the helper.
    fns[2] = functools.partial(CountingEnv, 2, fail_at=(2, 1))
    c = AsyncBatchedCollector(
        fns, CountingPolicy(), frames_per_batch=4 * 7, total_frames=-1, transport=transport,
        policy_device="cpu", on_policy=True, policy_lag=1,
    )  # fmt: skip
    delivered = 0
    with pytest.raises(WorkerError, match=r"env 2 .* failed on purpose in step") as info:
        for _ in c:
            delivered += 1
            assert delivered < 10, "the error never arrived"
    assert delivered == 2  # rounds 0 and 1; round 2 failed
    assert "Traceback" in str(info.value.__cause__)
    check_clean(c)
    assert not any(t.name == "rlcollect-next-round" for t in threading.enumerate())


def test_policy_lag_one_shutdown_during_the_next_round_ends_it():
    with make(("process_slots", "thread"), "plain", CountingPolicy(), total_frames=-1,
              policy_lag=1) as c:  # fmt: skip
        next(c)  # the helper now runs round 1; leave without taking it
    check_clean(c)
    assert not any(t.name == "rlcollect-next-round" for t in threading.enumerate())
    with pytest.raises(CollectorError, match="shut down"):
        next(c)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"policy_lag": 2}, "policy_lag must be 0 .* or 1 .*, got 2"),
        ({"policy_lag": True}, "policy_lag must be 0 .* or 1 .*, got True"),
        ({"policy_lag": 1, "on_policy": False}, "policy_lag=1 needs on_policy=True"),
    ],
)
def test_bad_policy_lag_is_refused_at_construction(kwargs, message):
    args = {"frames_per_batch": 40, "total_frames": 400, "on_policy": True, **kwargs}
    with pytest.raises(ValueError, match=message):
        AsyncBatchedCollector(
            counting_envs(4), CountingPolicy(), transport="thread", policy_device="cpu", **args
        )


def test_policy_lag_one_pause_holds_between_rounds_and_an_update_inside_lands():
    # The helper runs round 1 when pause() is entered; the update inside the pause waits
    # for the round running to end, so pause() must let that round end first.
    policy = TaggedPolicy(0)
    done = threading.Event()
    versions = []

    def learner(c):
        versions.append(int(next(c)["policy_version"].unique()))
        with c.pause(timeout=30):
            with torch.no_grad():
                policy.tag.fill_(1)
            c.update_policy_weights_(policy)
        for batch in c:
            versions.append(int(batch["policy_version"].unique()))
        done.set()

    with make(("process_slots", "thread"), "plain", policy, batches=3, policy_lag=1) as c:
        thread = threading.Thread(target=learner, args=(c,), daemon=True)
        thread.start()
        assert done.wait(timeout=60), "pause() and an update inside it deadlocked"
        thread.join(timeout=30)
    # Batch 1 ran before the update (it had started); batch 2 started after it.
    assert versions == [0, 0, 1]


def test_policy_lag_one_a_dropped_collector_ends_its_next_round():
    c = make(("process_slots", "process"), "plain", CountingPolicy(), total_frames=-1,
             policy_lag=1)  # fmt: skip
    next(c)  # the helper now runs round 1
    pids, name = c.transport.pids, c.transport.shm_name
    del c  # no shutdown(): the finalizer must end the round and free everything
    gc.collect()
    wait_until(lambda: not any(t.name == "rlcollect-next-round" for t in threading.enumerate()),
               timeout=30, what="the helper thread to end")  # fmt: skip
    wait_until(lambda: all(process_gone(p) for p in pids), timeout=30, what="worker processes")
    assert not shm_exists(name)


@pytest.mark.parametrize(
    ("source", "policy_lag"),
    [("plain", 0), ("envs_per_worker", 0), ("worker_splits", 0), ("vector-SameStep", 0),
     ("vector-ids-in-any-order", 0), ("envs_per_worker", 1)],
)  # fmt: skip
def test_time_major_batches_are_the_rounds_transposed_and_contiguous(source, policy_lag):
    # The same seeded envs and a deterministic policy: each env's stream is the same in
    # both runs, so batch k of one is batch k of the other, transposed.
    runs, buffers = {}, {}
    for time_major in (False, True):
        buffers[time_major] = ListBuffer()
        with make(
            ("process_slots", "thread"), source, CountingPolicy(), policy_lag=policy_lag,
            time_major=time_major, replay_buffer=buffers[time_major],
        ) as c:  # fmt: skip
            runs[time_major] = list(c)
    assert len(runs[True]) == len(runs[False]) == 4
    # the replay buffer gets rows env by env either way (each env's steps contiguous)
    for rows, same in zip(buffers[False].parts, buffers[True].parts, strict=True):
        assert (rows == same).all()
    for rows, steps in zip(runs[False], runs[True], strict=True):
        num_envs, t = rows.batch_size
        assert steps.batch_size == (t, num_envs)
        for key in rows.keys(include_nested=True, leaves_only=True):
            assert torch.equal(steps[key], rows[key].transpose(0, 1)), key
            assert steps[key].is_contiguous(), key
        # column e is env e, row t its t-th step of the round
        assert bool((steps["env_index"] == torch.arange(num_envs)).all())


# A failure of the round collected ahead, which the learner's update after batch 1 waits
# for (round 2: env 2's episode 2, step 1, its 17th step; T = 7). Each fault is real.
AHEAD_FAULTS = {
    "env-raises": ("thread", "thread"),
    "env-raises-process": ("process_slots", "thread"),
    "env-stalls": ("thread", "thread"),
    "env-stalls-process": ("process_slots", "thread"),
    "worker-killed": ("process_slots", "thread"),
    "inference-process-killed": ("process_slots", "process"),
}


@pytest.mark.parametrize("fault", list(AHEAD_FAULTS))
def test_policy_lag_one_a_failed_round_ahead_ends_the_update_waiting_for_it(fault, tmp_path):
    """The update after batch 1 waits for round 2, collected ahead; that round fails.
    The update raises the round's error (never a hang, whatever stall_timeout says), and
    the collector is shut down, as after an error from next()."""
    transport, backend = AHEAD_FAULTS[fault]
    marker = str(tmp_path / "hung")
    fns = counting_envs(4)
    if fault.startswith("env-raises"):
        fns[2] = functools.partial(CountingEnv, 2, fail_at=(2, 1))
    else:
        fns[2] = functools.partial(HangOnce, 2, marker, at=(2, 1))
    stall = 1.0 if fault.startswith("env-stalls") else 60.0
    policy = CountingPolicy()
    c = AsyncBatchedCollector(
        fns, policy, frames_per_batch=4 * 7, total_frames=-1, transport=transport,
        inference_backend=backend, policy_device="cpu", on_policy=True, policy_lag=1,
        stall_timeout=stall, envs_per_worker=1, worker_splits=None,
    )  # fmt: skip
    seen: dict[str, object] = {"batches": 0}

    def learner():
        try:
            for _ in c:
                seen["batches"] += 1
                seen["where"] = "update"
                c.update_policy_weights_(policy)
                seen["where"] = "next"
        except BaseException as error:
            seen["error"] = error

    thread = threading.Thread(target=learner, daemon=True)
    envs.RELEASE_HANGS.clear()
    try:
        thread.start()
        if fault in ("worker-killed", "inference-process-killed"):
            wait_until(lambda: os.path.exists(marker), timeout=60, what="round 2 to hang")
            pid = c.transport.pids[2] if fault == "worker-killed" else c.server.pid
            os.kill(pid, signal.SIGKILL)
        thread.join(60)
        assert not thread.is_alive(), f"{fault}: the learner hangs in {seen.get('where')}"
    finally:
        envs.RELEASE_HANGS.set()  # a worker thread blocked in HangOnce
    error = seen["error"]
    assert seen["batches"] == 2 and seen["where"] == "update", (seen, error)
    expected = {
        "env-raises": r"env 2 \(worker 2\) raised RuntimeError: .* failed on purpose",
        "env-stalls": r"env 2 \(worker 2\) has not finished its step .* stalled",
        "worker-killed": r"worker 2 \(pid \d+\) died .*killed by SIGKILL",
        "inference-process-killed": r"the inference process \(pid \d+\) died: killed by SIGKILL",
    }[fault.removesuffix("-process")]
    kind = InferenceError if fault == "inference-process-killed" else WorkerError
    assert isinstance(error, kind) and re.search(expected, str(error)), repr(error)
    check_clean(c)
    assert not any(t.name == "rlcollect-next-round" for t in threading.enumerate())
    with pytest.raises(CollectorError, match="shut down"):
        next(c)  # raised once: the collector is shut down


def test_policy_lag_one_an_update_right_after_next_waits_for_the_round_ahead():
    """Round k+1 belongs to batch k's hand-out, not to when its helper thread runs: an
    update made at once after next() returned waits for that round, whose rows are all
    of the weights before it, however late the helper starts (held back here until the
    update has come)."""
    policy = TaggedPolicy(0)
    with make(("process_slots", "thread"), "plain", policy, batches=3, policy_lag=1) as c:
        gate, produce, between_rounds = (
            c._chunks.gate,
            c._ahead._produce,
            c._chunks.gate.between_rounds,
        )
        updated, asked = threading.Event(), threading.Event()

        def late_produce():
            if threading.current_thread().name == "rlcollect-next-round":
                # Start the round only once the update was made (and, the round claimed
                # in next(), waits for it; else it has landed: the lag of one lost).
                assert asked.wait(60), "the learner's update never came"
            return produce()

        def update_asked(alive):
            asked.set()
            return between_rounds(alive)

        gate.between_rounds = update_asked
        c._ahead._produce = late_produce
        assert int(next(c)["policy_version"].unique()) == 0
        with torch.no_grad():
            policy.tag.fill_(1)
        update = threading.Thread(target=lambda: (c.update_policy_weights_(policy), updated.set()))
        update.start()
        batch = next(c)
        update.join(60)
        assert updated.is_set()
    assert batch["policy_version"].unique().tolist() == [0], "round 1 used the new weights"
    assert batch["tag"].unique().tolist() == [0.0]
