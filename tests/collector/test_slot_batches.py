"""A slot of every worker as one batch (collector/slot_batches.py): envs stepped one by
one, the ring laid out position-major, the batch a view of it where the loans allow.

The builder is driven by hand first (which chunks wait, which are lent or copied, which
slots go back and in what order); then through the collector, where the server runs in
a process of its own (the only backend that lends slots). There ``min_batch_size`` set
to every env keeps the workers in step (the server answers no env before every env has
asked), so how the slots fall does not depend on the scheduler; CountingEnvs tell each
row's env, episode and step, so a slot written while a caller still held it shows as a
changed batch or a broken stream.
"""

import dataclasses
import functools
import gc
import time

import envs
import pytest
import torch
from envs import HangOnce, SlowCounting
from helpers import (
    CountingPolicy,
    check_clean,
    check_counting_streams,
    counting_envs,
    hold_first_batch,
)

from rlcollect import AsyncBatchedCollector, WorkerError
from rlcollect.collector.slot_batches import SlotBatchBuilder
from rlcollect.errors import CollectorError
from rlcollect.testing import counting_layout

# ----------------------------------------------------------------- the builder by hand

STEPS, ENVS = 3, 2  # per chunk: 6 rows; two workers: a batch of 12


def builder(num_workers=2, slots=4):
    layout = counting_layout(
        num_workers=num_workers, envs_per_worker=ENVS, chunk_steps=STEPS, slots=slots
    )
    layout = dataclasses.replace(layout, position_major=True)
    ring = layout.views(bytearray(layout.nbytes))
    fpb = num_workers * ENVS * STEPS
    return SlotBatchBuilder(layout, ring, frames_per_batch=fpb, total_frames=-1), ring


def mark(ring, worker, slot, value):
    """Every row of chunk ``slot`` of ``worker`` says ``value`` in its step field."""
    ring[("step",)][worker, slot * STEPS : (slot + 1) * STEPS] = value


def test_a_slot_waits_for_every_worker_then_is_one_batch_viewing_the_ring():
    b, ring = builder()
    mark(ring, 0, 1, 10)
    mark(ring, 1, 1, 11)
    assert b.add_chunk(1, 0) == [] and not b.ready  # worker 0's chunk of slot 0 is not in
    assert b.add_chunk(0, 0) == [] and b.ready == 1  # lent: nothing to give back
    assert b.add_chunk(0, 1) == [] and b.add_chunk(1, 1) == []
    first, second = b.pop(), b.pop()
    assert b.lent == 2
    assert second["step"].tolist() == [10, 10, 11, 11] * STEPS  # steps, workers, envs
    mark(ring, 0, 1, 12)
    mark(ring, 1, 1, 12)
    assert second["step"].tolist() == [12] * 12  # a view: nothing was copied
    # Two slots are lent, the most a worker may lend: the next whole slot is one copy,
    # and goes back to every worker at once.
    mark(ring, 0, 2, 20)
    assert b.add_chunk(0, 2) == [] and b.add_chunk(1, 2) == [(0, 2), (1, 2)]
    copied = b.pop()
    mark(ring, 0, 2, 21)
    assert copied["step"].tolist()[:2] == [20, 20]
    del first
    gc.collect()
    assert b.returned() == [(0, 0), (1, 0)]
    # Every worker writes slot 3 next, then the slots in the order they went back: 2
    # (copied), then 0 (let go of). Slot 1 is still lent.
    assert b.add_chunk(0, 3) == [] and b.add_chunk(1, 3) == []
    assert b.lent == 3
    assert b.add_chunk(0, 2) == [] and b.add_chunk(1, 2) == [(0, 2), (1, 2)]
    assert b.add_chunk(0, 0) == [] and b.add_chunk(1, 0) == [(0, 0), (1, 0)]
    assert b.ready == 3 and b.lent == 3


def test_a_straggler_holds_no_rows_back_and_lending_resumes_once_it_catches_up():
    """Worker 0 runs to its last slot while worker 1 has handed over nothing: its chunks
    are copied in the order they came, as soon as they fill a batch, but its slots go
    back only once worker 1's chunks of them are in too, so both stay in one order of
    slots, and the next whole slot is lent again."""
    b, ring = builder()
    for slot in range(4):
        mark(ring, 0, slot, 100 + slot)
        mark(ring, 1, slot, 200 + slot)
    assert b.add_chunk(0, 0) == [] and b.add_chunk(0, 1) == []
    assert not b.ready  # worker 0 can still write two slots: its rows may wait
    assert b.add_chunk(0, 2) == []  # its last slot but one: the two oldest are copied
    assert b.ready == 1 and b.pop()["step"].tolist() == [100] * 6 + [101] * 6
    assert b.add_chunk(0, 3) == [] and b.pop()["step"].tolist() == [102] * 6 + [103] * 6
    assert b.add_chunk(1, 0) == []  # slot 0 is not whole yet: worker 1's rows wait
    assert b.add_chunk(1, 1) == [(0, 0), (1, 0), (0, 1), (1, 1)]
    assert b.pop()["step"].tolist() == [200] * 6 + [201] * 6
    # Both workers have two slots to write again: worker 1's rows may wait, until
    # worker 0, ahead, is down to its last slot but one.
    assert b.add_chunk(1, 2) == [] and b.add_chunk(1, 3) == [] and not b.ready
    assert b.add_chunk(0, 0) == [(0, 2), (1, 2), (0, 3), (1, 3)]
    assert b.pop()["step"].tolist() == [202] * 6 + [203] * 6
    assert b.lent == 0
    assert b.add_chunk(1, 0) == []  # slot 0 is whole, as the workers are in step again
    assert b.lent == 1 and b.ready == 1


def test_a_chunk_out_of_the_shared_order_of_slots_is_an_error():
    b, _ = builder()
    b.add_chunk(0, 0)
    with pytest.raises(CollectorError, match="worker 1 handed over slot 1 where slot 0"):
        b.add_chunk(1, 1)


def test_a_worker_major_ring_of_several_workers_is_refused():
    layout = counting_layout(num_workers=2, envs_per_worker=1, chunk_steps=2, slots=4)
    ring = layout.views(bytearray(layout.nbytes))
    with pytest.raises(ValueError, match="position_major"):
        SlotBatchBuilder(layout, ring, frames_per_batch=4, total_frames=-1)


# ------------------------------------------------------------------ through the collector

NUM_ENVS = 8
FPB = NUM_ENVS * 16  # "auto": 16 steps per chunk, one slot of every worker a batch


def in_step(envs_per_worker=2, **kwargs):
    """The server in its own process, answering no env before every env has asked."""
    kwargs.setdefault("total_frames", 30 * FPB)
    return AsyncBatchedCollector(
        counting_envs(NUM_ENVS), CountingPolicy(), frames_per_batch=FPB, policy_device="cpu",
        transport="process_slots", inference_backend="process", envs_per_worker=envs_per_worker,
        min_batch_size=NUM_ENVS, batch_timeout=30.0, **kwargs,
    )  # fmt: skip


@pytest.mark.parametrize(("envs_per_worker", "worker_splits"), [(1, None), (2, 2), (4, 1)])
def test_slots_dropped_as_a_loop_drops_them_keep_being_lent(envs_per_worker, worker_splits):
    """The loop holds one batch while it asks for the next: each ask lends the first
    whole slot (the one batch held and the one lent are the most a worker may lend), and
    the at most two other slots that are whole by then are copied. So at least a third
    of the batches are lent, whatever the scheduler does."""
    kept = []
    with in_step(envs_per_worker, worker_splits=worker_splits) as c:
        for batch in c:
            kept.append(batch.clone())
        stats = c.stats()
    assert stats["batches"] == 30
    assert stats["ring_batches"] >= 10
    check_counting_streams(torch.cat(kept))


def test_kept_slot_batches_stay_intact_and_later_ones_are_copied():
    with in_step(total_frames=12 * FPB) as c:
        kept = list(c)
        early = [b.clone() for b in kept]
        stats = c.stats()
    assert stats["ring_batches"] == 2 and stats["batches"] == 12
    for batch, copy in zip(kept, early, strict=True):
        assert (batch == copy).all()
    check_counting_streams(torch.cat(kept))


def test_a_slot_batch_held_for_good_leaves_the_others_lent():
    """Batch 0's slots stay lent to the end: every worker writes the slots given back
    after them, out of the order they were handed over, all workers in the same order."""
    first, first_copy, rest, stats = hold_first_batch(in_step(total_frames=40 * FPB))
    assert stats["ring_batches"] >= 3
    assert (first == first_copy).all()
    check_counting_streams(torch.cat([first_copy, *rest]))


def test_a_slot_batch_survives_close():
    with in_step() as c:
        batch = next(iter(c))
        copy = batch.clone()
        assert c.stats()["ring_batches"] >= 1
    assert (batch == copy).all()
    assert batch["observation"].sum() > 0


def test_slots_are_copied_where_a_slot_is_not_a_batch():
    with in_step(transition_chunk_size=8, total_frames=8 * FPB) as c:
        data = torch.cat(list(c))
        assert c.stats()["ring_batches"] == 0
    check_counting_streams(data)


def test_an_env_stuck_in_its_first_reset_holds_no_other_envs_rows_back(tmp_path):
    """Env 1's worker never hands a chunk over; env 0's rows still reach the caller,
    copied, before the stall is raised."""
    fns = counting_envs(2)
    fns[1] = functools.partial(HangOnce, 1, str(tmp_path / "hung"), at=(0, 0), in_reset=True)
    c = AsyncBatchedCollector(
        fns, CountingPolicy(), frames_per_batch=8, total_frames=-1, policy_device="cpu",
        transport="process_slots", inference_backend="process", stall_timeout=4.0,
    )  # fmt: skip
    rows = []
    deadline = time.monotonic() + 60.0
    with pytest.raises(WorkerError, match=r"env 1 \(worker 1\) has not finished its reset"):
        while time.monotonic() < deadline:
            rows.append(next(c)["env_index"].clone())
    assert rows and bool((torch.cat(rows) == 0).all()), "env 0 was held back"
    assert c.stats()["ring_batches"] == 0
    c.shutdown()
    envs.RELEASE_HANGS.set()
    check_clean(c)


def test_a_slow_env_keeps_its_share_of_every_batch():
    """Env 0 steps about forty times slower than the others. Its worker's slots go back
    only with the others' slots, so no worker gets more than 4 chunks (its slots) ahead
    of env 0's worker; a collector copying whichever chunks come first would deliver
    hardly any of env 0's rows. Of 40 chunks delivered the others hand over at most
    ``c + 4`` each where env 0 hands over ``c``, so ``c >= 7``; at most 3 of those wait
    undelivered when the budget ends (a batch is 4 chunks): env 0 delivers 4 chunks at
    least, 64 rows. Streams stay whole, with copies and loans mixed."""
    fns = counting_envs(4)
    fns[0] = functools.partial(SlowCounting, 0)
    with AsyncBatchedCollector(
        fns, CountingPolicy(), frames_per_batch=64, total_frames=640, policy_device="cpu",
        transport="process_slots", inference_backend="process",
    ) as c:  # fmt: skip
        data = torch.cat([b.clone() for b in c])
        stats = c.stats()
    assert stats["batches"] == 10
    check_counting_streams(data)
    assert int((data["env_index"] == 0).sum()) >= 64
