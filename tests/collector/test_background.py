"""Background collection into a replay buffer: start(), join(), pause(), errors, shutdown."""

import functools
import threading

import pytest
import torch
from helpers import (
    SERVER_LAYOUT,
    ConstantPolicy,
    CountingPolicy,
    ListBuffer,
    check_clean,
    check_counting_streams,
    counting_collector,
    counting_envs,
    process_gone,
    shm_exists,
    streams,
    wait_until,
)
from tensordict import TensorDict

from rlcollect import AsyncBatchedCollector, CollectorError, WorkerError
from rlcollect.testing import CountingEnv


def test_every_transition_is_written_once_in_whole_batches(transport):
    rb = ListBuffer()
    c = counting_collector(transport, replay_buffer=rb, total_frames=650, frames_per_batch=64)
    c.start()
    assert c.join(timeout=60)
    assert [p.batch_size[0] for p in rb.parts] == [64] * 10 + [10]
    check_counting_streams(torch.cat(rb.parts))
    assert c.stats()["frames"] == 650
    assert c.update_policy_weights_(CountingPolicy()) == 1  # up until shutdown
    c.shutdown()
    check_clean(c)
    assert c.join(timeout=0)


def failing_collector(transport, n, failing, fail_at):
    """``n`` CountingEnvs collecting into a ListBuffer; env ``failing`` raises in its
    step ``fail_at`` = (episode, step)."""
    fns = counting_envs(n)
    fns[failing] = functools.partial(CountingEnv, failing, fail_at=fail_at)
    return AsyncBatchedCollector(
        fns,
        CountingPolicy(),
        frames_per_batch=8,
        transport=transport,
        policy_device="cpu",
        replay_buffer=ListBuffer(),
        **SERVER_LAYOUT,
    )


def test_a_background_error_is_raised_by_the_next_call(transport):
    c = failing_collector(transport, 4, failing=1, fail_at=(1, 3))
    c.start()
    policy = CountingPolicy()

    def raised() -> bool:
        try:
            c.update_policy_weights_(policy)
        except WorkerError as exc:
            assert exc.env_index == 1
            return True
        return False

    wait_until(raised, what="the env error to reach the caller")
    check_clean(c)
    c.shutdown()  # raised once already: shutdown is quiet now
    c.shutdown()


def test_join_raises_the_background_error(transport):
    c = failing_collector(transport, 2, failing=0, fail_at=(0, 2))
    c.start()
    with pytest.raises(WorkerError, match="env 0"):
        c.join(timeout=30)
    check_clean(c)


def test_start_is_refused_without_a_buffer_twice_or_while_iterating(transport):
    with counting_collector(transport, total_frames=-1) as c:
        with pytest.raises(CollectorError, match="has none: pass replay_buffer="):
            c.start()
        with pytest.raises(CollectorError, match="call start\\(\\) first"):
            c.join(timeout=1)
    with counting_collector(transport, replay_buffer=ListBuffer(), total_frames=-1) as c:
        c.start()
        with pytest.raises(CollectorError, match="already collecting"):
            c.start()
        with pytest.raises(CollectorError, match="sample from its replay buffer"):
            next(c)


def test_shutdown_stops_background_collection_and_writes_nothing_after(transport):
    rb = ListBuffer()
    c = counting_collector(transport, replay_buffer=rb, total_frames=-1)
    c.start()
    wait_until(lambda: len(rb.parts) >= 3, what="three batches")
    c.shutdown()
    written = len(rb.parts)
    check_clean(c)
    assert len(rb.parts) == written
    check_counting_streams(torch.cat(rb.parts))
    with pytest.raises(CollectorError, match="shut down"):
        c.update_policy_weights_(CountingPolicy())


def test_pause_reaches_a_quiet_point_and_resumes(transport):
    rb = ListBuffer()
    with counting_collector(transport, replay_buffer=rb, total_frames=-1) as c:
        c.start()
        wait_until(lambda: len(rb.parts) >= 2, what="two batches")
        with c.pause():
            written = len(rb.parts)
            served = c.stats()["server"]["batches"]
            # a window in which a running collector writes many batches
            assert not threading.Event().wait(0.3)
            assert len(rb.parts) == written
            assert c.stats()["server"]["batches"] == served
            with pytest.raises(CollectorError, match="already paused"), c.pause():
                pass
        wait_until(lambda: len(rb.parts) > written, what="collection to go on")
    check_counting_streams(torch.cat(rb.parts))


def test_a_pause_with_the_policy_in_the_workers_writes_nothing_and_its_forwards_stop(
    transport,
):
    """The in-worker policy has no server to hold: paused, no batch is written, and the
    workers' forwards stop once their ring slots are full (docs/layout.md)."""
    rb = ListBuffer()
    layout = {"inference_backend": "worker", "envs_per_worker": 2}
    with counting_collector(transport, replay_buffer=rb, total_frames=-1, **layout) as c:
        c.start()
        wait_until(lambda: len(rb.parts) >= 2, what="two batches")
        with c.pause():
            written = len(rb.parts)
            rows = [c.stats()["server"]["rows"]]

            def forwards_stopped() -> bool:
                rows.append(c.stats()["server"]["rows"])
                return rows[-1] == rows[-2]

            wait_until(forwards_stopped, timeout=60, what="the forwards to stop")
            assert len(rb.parts) == written
        wait_until(lambda: len(rb.parts) > written, what="collection to go on")
    check_counting_streams(torch.cat(rb.parts))


def test_iterating_inside_pause_is_refused(transport):
    with counting_collector(transport, total_frames=-1) as c:
        next(c)
        with c.pause(), pytest.raises(CollectorError, match="paused"):
            next(c)
        next(c)


def test_versions_stamp_the_weights_that_chose_each_action(transport):
    rb = ListBuffer()
    policy = ConstantPolicy(1)
    with counting_collector(transport, policy, replay_buffer=rb, total_frames=-1) as c:
        c.start()
        wait_until(lambda: len(rb.parts) >= 2, what="two batches")
        with torch.no_grad():
            policy.value.fill_(4)
        assert c.update_policy_weights_(policy) == 1
        wait_until(
            lambda: any(bool((p["policy_version"] == 1).any()) for p in list(rb.parts)),
            what="rows chosen by the new weights",
        )
    data = torch.cat(rb.parts)
    version = data["policy_version"]
    assert torch.equal(data["action"], torch.where(version == 0, 1, 4))
    for rows in streams(data).values():
        assert bool((rows["policy_version"].diff() >= 0).all())


def test_error_in_the_with_block_keeps_the_background_error_as_a_note(transport):
    c = failing_collector(transport, 2, failing=1, fail_at=(0, 1))
    with pytest.raises(KeyError) as info, c:
        c.start()
        wait_until(lambda: c.background_done, what="background collection to fail")
        raise KeyError("the caller's own error")
    assert any("background collection had failed too" in n for n in info.value.__notes__)


@pytest.mark.parametrize("throttled", [False, True], ids=["free", "throttled"])
def test_a_collector_dropped_while_collecting_in_the_background_shuts_down(throttled):
    """The background thread holds no reference to its collector: dropping the last one
    collects it, and with it go its thread, workers and ring. Throttled, the thread
    waits for a learner that never samples (inside a batch) when it is dropped."""
    import gc

    from rlcollect import ReplayBuffer

    rb = ReplayBuffer(100_000, seed=0)
    extra = {"train_ratio": 1.0} if throttled else {}
    c = counting_collector(
        "process_slots", replay_buffer=rb, total_frames=-1, frames_per_batch=32, **extra
    )
    before = set(threading.enumerate())
    c.start()
    wait_until(lambda: len(rb) >= 32, what="a batch in the buffer")
    transport = c.transport
    (thread,) = [
        t for t in threading.enumerate() if t not in before and t.name == "rlcollect-collector"
    ]
    del c
    gc.collect()
    wait_until(lambda: not thread.is_alive(), what="the background thread to end")
    wait_until(lambda: all(process_gone(p) for p in transport.pids), what="worker processes")
    assert not shm_exists(transport.shm_name)


# ------------------------------------------------------------------ train ratio


def test_train_ratio_makes_collection_wait_for_the_learner(transport):
    from rlcollect import ReplayBuffer

    ratio, starts, fpb = 2.0, 64, 32
    rb = ReplayBuffer(100_000, seed=0)
    c = counting_collector(
        transport,
        replay_buffer=rb,
        total_frames=-1,
        frames_per_batch=fpb,
        train_ratio=ratio,
        learning_starts=starts,
    )
    with c:
        c.start()
        wait_until(lambda: len(rb) >= starts, what="the buffer to fill up to learning_starts")
        for _ in range(60):
            rb.sample(16)
            # a batch is written only once the learner has sampled `ratio` rows per row
            # collected before it: collection leads by one batch at most
            assert rb.written <= starts + fpb + rb.sampled / ratio
        sampled = rb.sampled
        # the learner stops: collection must stop too (unthrottled, it would write
        # thousands of rows in this window)
        assert not threading.Event().wait(0.3)
        assert rb.written <= starts + fpb + sampled / ratio
        # two batches past learning_starts (allowed: the learner sampled for 480 rows),
        # so the throttle has waited, however briefly, before the second
        wait_until(lambda: rb.written >= starts + 2 * fpb, what="two batches past the start")
        stats = c.stats()
        assert stats["throttle_wait_seconds"] > 0
        # This learner samples without waiting its turn: on a busy machine it may sample
        # more than `ratio` rows per row collected (the stat says so), but collection
        # never leads it by more than one batch, so the ratio is never much below.
        assert stats["train_ratio"] >= sampled / (fpb + sampled / ratio)
        # shutdown works while collection waits for the learner
    check_clean(c)
    # every row written once, none lost while collection waited
    stored = TensorDict(rb.state_dict()["storage"], batch_size=[len(rb)])
    assert len(rb) == rb.written
    check_counting_streams(stored)


@pytest.mark.parametrize("learner", ["fast", "slow"])
def test_train_ratio_holds_both_ways(transport, learner):
    from rlcollect import ReplayBuffer

    ratio, starts, fpb, batch, total = 2.0, 64, 32, 16, 1024
    rb = ReplayBuffer(100_000, seed=0)
    net, x = torch.nn.Linear(128, 128), torch.randn(256, 128)

    def work():  # a slow learner does real work between samples; a fast one none
        if learner == "slow":
            for _ in range(10):
                net(x).sum()

    c = counting_collector(
        transport,
        replay_buffer=rb,
        total_frames=total,
        frames_per_batch=fpb,
        train_ratio=ratio,
        learning_starts=starts,
    )
    with c:
        c.start()
        updates = 0
        while c.wait_to_sample(timeout=30.0):
            rb.sample(batch)
            updates += 1
            # the learner never goes more than one minibatch beyond its share ...
            assert rb.sampled <= ratio * (rb.written - starts) + batch
            # ... and collection never more than one batch beyond the learner's
            assert rb.written <= starts + fpb + rb.sampled / ratio
            work()
        assert c.background_done  # False came because collection ended, not a timeout
        assert c.join(timeout=10.0)
        stats = c.stats()
    assert rb.written == total
    # over the run: the asked ratio, give or take one minibatch
    assert stats["train_ratio"] == pytest.approx(ratio, abs=batch / (total - starts))
    assert updates * batch == rb.sampled


def test_wait_to_sample_without_a_train_ratio_waits_for_rows_until_the_end(transport):
    from rlcollect import ReplayBuffer

    rb = ReplayBuffer(10_000)
    with counting_collector(transport, replay_buffer=rb, total_frames=256) as c:
        with pytest.raises(CollectorError, match=r"call start\(\)"):
            c.wait_to_sample(timeout=0.0)
        c.start()
        assert c.wait_to_sample(timeout=30.0)
        assert len(rb) > 0
        assert c.join(timeout=30.0)
        assert not c.wait_to_sample(timeout=0.0)  # collection has ended: nothing to wait for


def test_wait_to_sample_times_out_while_collection_goes_on():
    from rlcollect import ReplayBuffer

    rb = ReplayBuffer(10_000)
    c = counting_collector(
        "thread",
        replay_buffer=rb,
        total_frames=-1,
        train_ratio=1.0,
        learning_starts=10**9,  # the learner's share stays zero
    )
    with c:
        c.start()
        wait_until(lambda: len(rb) > 0, what="a first batch")
        assert not c.wait_to_sample(timeout=0.2)
        assert not c.background_done


def test_wait_to_sample_needs_an_rlcollect_buffer():
    with counting_collector("thread", replay_buffer=ListBuffer(), total_frames=-1) as c:
        c.start()
        needs = r"needs replay_buffer= an rlcollect\.ReplayBuffer"
        with pytest.raises(CollectorError, match=needs):
            c.wait_to_sample(timeout=0.0)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"train_ratio": 0}, ValueError, "train_ratio must be a number > 0"),
        ({"train_ratio": -1.0}, ValueError, "train_ratio must be a number > 0"),
        ({"train_ratio": "2"}, ValueError, "train_ratio must be a number > 0"),
        ({"train_ratio": float("inf")}, ValueError, "train_ratio must be finite"),
        ({"train_ratio": 2, "learning_starts": -1}, ValueError, "learning_starts must be"),
        ({"learning_starts": 10}, ValueError, "learning_starts only applies with a train_ratio"),
    ],
)
def test_train_ratio_bad_input(kwargs, error, match):
    from rlcollect import ReplayBuffer

    with pytest.raises(error, match=match):
        counting_collector("thread", replay_buffer=ReplayBuffer(10), **kwargs)


def test_train_ratio_needs_a_counting_buffer():
    with pytest.raises(TypeError, match="train_ratio needs replay_buffer= to be an rlcollect"):
        counting_collector("thread", replay_buffer=ListBuffer(), train_ratio=2)
