"""Blocks of a pooled ring as batches (collector/batches/pooled.py): envs stepped one by
one, any worker writing whichever place of the ring it is given, a block of places the
batch, viewing the ring where the loans allow.

The builder is driven by hand first (which places go to whom, which blocks are lent or
copied, which places are copied without a slow one); then through the collector, where
the server runs in a process of its own (with a CPU policy, the only backend that pools
the ring; the server thread pools it for a GPU policy, tested at the end). There
``min_batch_size`` set to every env keeps the workers in step (the server answers no
env before every env has asked), so how the blocks fall does not depend on the
scheduler; CountingEnvs tell each row's env, episode and step, so a place written while
a caller still held it shows as a changed batch or a broken stream.
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
from rlcollect.collector.batches import pooled
from rlcollect.collector.batches.delivery import POOL_BLOCKS
from rlcollect.collector.batches.pooled import PoolBatchBuilder
from rlcollect.errors import CollectorError
from rlcollect.testing import counting_layout

# ----------------------------------------------------------------- the builder by hand

STEPS, ENVS, SLOTS = 3, 2, 4  # a place: 6 rows; two workers: blocks of 12, 8 places


def builder(total_frames=-1):
    layout = counting_layout(num_workers=2, columns=ENVS, chunk_steps=STEPS, slots=SLOTS)
    layout = dataclasses.replace(layout, pooled=True)
    ring = layout.views(bytearray(layout.nbytes))
    for place in range(layout.credited_slots):  # every row of place p says 10 + p
        ring[("step",)][place // SLOTS, place % SLOTS * STEPS :][:STEPS] = 10 + place
    b = PoolBatchBuilder(layout, ring, frames_per_batch=12, total_frames=total_frames, lend="pool")
    return b, ring


def steps(batch):
    return batch["step"].tolist()


def test_a_block_whose_places_are_all_written_is_a_batch_viewing_the_ring():
    b, ring = builder()
    # Worker 0 starts with places 0 and 2, worker 1 with 1 and 3 (blocks 0 and 1).
    assert b.add_chunk(0, 0) == [(0, 4)]  # the next free place, to who asks first
    assert not b.ready  # place 1 is not written yet
    assert b.add_chunk(1, 1) == [(1, 5)]
    assert b.ready == 1 and b.lent == 1
    batch = b.pop()
    assert steps(batch) == [10] * 6 + [11] * 6  # place by place, each by step, then env
    ring[("step",)][0, 0:STEPS] = 99  # place 0
    assert steps(batch)[:6] == [99] * 6  # a view: nothing was copied


def test_a_fast_worker_takes_the_places_a_slow_one_does_not_ask_for():
    """Worker 1 hands nothing over while worker 0 writes four places, given to it as it
    asks; once worker 0 would wait for a place, the written ones are copied without
    worker 1's, each worker's in the order it wrote them, and lending resumes once
    worker 1's places are in."""
    b, _ = builder()
    assert b.add_chunk(0, 0) == [(0, 4)]
    assert b.add_chunk(0, 2) == [(0, 5)]
    assert b.add_chunk(0, 4) == [(0, 6)]
    assert b.add_chunk(0, 5) == [(0, 7)]
    assert not b.ready  # block 0 waits for place 1: every worker has a place to write
    # No place is free now: worker 0 would wait, so its places are copied in order, and
    # block 2, copied whole, gives place 4 back to it.
    assert b.add_chunk(0, 6) == [(0, 4)]
    assert [steps(b.pop()) for _ in range(2)] == [[10] * 6 + [12] * 6, [14] * 6 + [15] * 6]
    assert b.add_chunk(1, 1) == [(1, 5)]  # place 1 may wait: a place was free for worker 1
    assert not b.ready
    assert b.add_chunk(1, 3) == [(1, 0)]  # none was free: places 1 and 3 are copied
    assert steps(b.pop()) == [11] * 6 + [13] * 6
    assert b.lent == 0
    assert b.add_chunk(0, 7) == [(0, 1)]  # block 3: places 6 and 7, the next in turn
    assert b.lent == 1 and steps(b.pop()) == [16] * 6 + [17] * 6


def test_at_most_two_blocks_are_lent_and_a_block_let_go_of_is_given_out_again():
    b, _ = builder()
    assert b.add_chunk(0, 0) == [(0, 4)] and b.add_chunk(1, 1) == [(1, 5)]  # block 0 lent
    assert b.add_chunk(0, 2) == [(0, 6)] and b.add_chunk(1, 3) == [(1, 7)]  # block 1 lent
    first, second = b.pop(), b.pop()
    assert b.lent == 2
    assert b.add_chunk(0, 4) == []  # every place is out: copied, worker 0 waits in line
    assert b.add_chunk(1, 5) == [(0, 4), (1, 5)]  # block 2 copied: its places go out
    copied = b.pop()
    assert steps(copied) == [14] * 6 + [15] * 6 and b.lent == 2
    del first
    gc.collect()
    assert b.returned() == []  # block 0 is free again: nobody is in line
    assert b.add_chunk(0, 6) == [(0, 0)]
    assert b.add_chunk(1, 7) == [(1, 1)]  # block 3: lent, one loan being back
    assert b.lent == 3 and steps(b.pop()) == [16] * 6 + [17] * 6
    assert steps(second) == [12] * 6 + [13] * 6


def test_the_last_batch_keeps_the_first_places_of_its_block():
    b, _ = builder(total_frames=18)
    b.add_chunk(0, 0)
    b.add_chunk(1, 1)
    b.add_chunk(0, 2)
    assert b.ready == 1  # place 3 is not written yet
    b.add_chunk(1, 3)
    b.pop()
    assert steps(b.pop()) == [12] * 6  # worker 0's chunk; worker 1's is past the budget
    assert b.exhausted and b.add_chunk(0, 4) == [(0, 4)]


def test_the_time_a_worker_has_no_place_to_write_is_counted(monkeypatch):
    """A worker that has handed over both its places waits until it is given one: from
    its second hand-over to that moment, by the builder's clock."""
    clock = [0.0]
    monkeypatch.setattr(pooled, "_now", lambda: clock[0])
    b, _ = builder()
    assert b.add_chunk(0, 0) == [(0, 4)] and b.add_chunk(1, 1) == [(1, 5)]  # block 0 lent
    assert b.add_chunk(0, 2) == [(0, 6)] and b.add_chunk(1, 3) == [(1, 7)]  # block 1 lent
    kept = [b.pop(), b.pop()]  # both loans out: only blocks 2 and 3 are the workers'
    assert b.add_chunk(0, 4) == []  # worker 0 still writes place 6
    clock[0] = 1.0
    assert b.add_chunk(0, 6) == []  # and now has nothing to write
    assert b.slot_wait_seconds == 0.0
    clock[0] = 3.5
    assert b.slot_wait_seconds == 2.5  # still waiting
    # Block 2 copied, its places go to worker 0, first in line for both; worker 1 is
    # in line after it, but still writes place 7: it does not wait.
    assert b.add_chunk(1, 5) == [(0, 4), (0, 5)]
    clock[0] = 10.0
    assert b.slot_wait_seconds == 2.5
    assert steps(kept[0]) == [10] * 6 + [11] * 6


def test_a_place_the_worker_was_not_given_is_an_error():
    b, _ = builder()
    with pytest.raises(CollectorError, match=r"worker 1 handed over place 0 .* worker 0"):
        b.add_chunk(1, 0)


def test_a_ring_that_is_not_pooled_is_refused():
    layout = counting_layout(num_workers=2, columns=1, chunk_steps=2, slots=4)
    ring = layout.views(bytearray(layout.nbytes))
    with pytest.raises(ValueError, match="pooled"):
        PoolBatchBuilder(layout, ring, frames_per_batch=4, total_frames=-1, lend="pool")
    pooled = dataclasses.replace(layout, pooled=True)
    with pytest.raises(ValueError, match="lend='pool'"):
        PoolBatchBuilder(
            pooled, pooled.views(bytearray(pooled.nbytes)), frames_per_batch=4, total_frames=-1
        )


# ------------------------------------------------------------------ through the collector

NUM_ENVS = 8
FPB = NUM_ENVS * 16  # "auto": 16 steps per chunk, a block of the pooled ring a batch


def in_step(envs_per_worker=2, **kwargs):
    """The server in its own process, answering no env before every env has asked."""
    kwargs.setdefault("total_frames", 30 * FPB)
    return AsyncBatchedCollector(
        counting_envs(NUM_ENVS), CountingPolicy(), frames_per_batch=FPB, policy_device="cpu",
        transport="process_slots", inference_backend="process", envs_per_worker=envs_per_worker,
        min_batch_size=NUM_ENVS, batch_timeout=30.0, **kwargs,
    )  # fmt: skip


@pytest.mark.parametrize(("envs_per_worker", "worker_splits"), [(1, None), (2, 2), (4, 1)])
def test_blocks_dropped_as_a_loop_drops_them_keep_being_lent(envs_per_worker, worker_splits):
    """The loop holds one batch while it asks for the next: each ask gives the block of
    the batch dropped back, then lends whole blocks while fewer than four (six blocks
    less two) are out, and copies any beyond that. The workers, in step, hold two
    places each, so at most two blocks are whole at an ask, and at least a third of the
    batches are lent, whatever the scheduler does."""
    kept = []
    with in_step(envs_per_worker, worker_splits=worker_splits) as c:
        for batch in c:
            kept.append(batch.clone())
        stats = c.stats()
    assert stats["batches"] == 30
    assert stats["lent_batches"] >= 10
    check_counting_streams(torch.cat(kept))


def test_kept_block_batches_stay_intact_and_later_ones_are_copied():
    with in_step(total_frames=12 * FPB) as c:
        kept = list(c)
        early = [b.clone() for b in kept]
        stats = c.stats()
    assert stats["lent_batches"] == POOL_BLOCKS - 2 and stats["batches"] == 12
    for batch, copy in zip(kept, early, strict=True):
        assert (batch == copy).all()
    check_counting_streams(torch.cat(kept))


def test_a_block_batch_held_for_good_leaves_the_others_lent():
    """Batch 0's block stays lent to the end: the other five go round, given out in
    the order they come back."""
    first, first_copy, rest, stats = hold_first_batch(in_step(total_frames=40 * FPB))
    assert stats["lent_batches"] >= 3
    assert (first == first_copy).all()
    check_counting_streams(torch.cat([first_copy, *rest]))


def test_a_block_batch_survives_close():
    with in_step() as c:
        batch = next(iter(c))
        copy = batch.clone()
        assert c.stats()["lent_batches"] >= 1
    assert (batch == copy).all()
    assert batch["observation"].sum() > 0


def test_places_are_copied_where_a_block_is_not_a_batch():
    with in_step(transition_chunk_size=8, total_frames=8 * FPB) as c:
        data = torch.cat(list(c))
        stats = c.stats()
    assert stats["lent_batches"] == 0
    assert stats["slot_wait_seconds"] == 0.0  # the ring is not pooled: no places
    check_counting_streams(data)


def test_an_env_stuck_in_its_first_reset_holds_no_other_envs_rows_back(tmp_path):
    """Env 1's worker never hands a place over, so block 0 is never whole; env 0's rows
    still reach the caller, copied once its worker would wait for a place, before the
    stall is raised."""
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
    assert c.stats()["lent_batches"] == 0
    c.shutdown()
    envs.RELEASE_HANGS.set()
    check_clean(c)


def test_a_slow_env_mixes_copies_and_loans_and_keeps_every_stream_whole():
    """Env 0 steps about forty times slower than the others. The fast envs' workers take
    the places env 0's does not ask for, and whenever one would wait for a place, the
    written places are copied without env 0's: batches are copied and lent in turn, and
    every env's stream stays in order, with no gap and no duplicate."""
    fns = counting_envs(4)
    fns[0] = functools.partial(SlowCounting, 0)
    with AsyncBatchedCollector(
        fns, CountingPolicy(), frames_per_batch=64, total_frames=640, policy_device="cpu",
        transport="process_slots", inference_backend="process",
    ) as c:  # fmt: skip
        data = torch.cat([b.clone() for b in c])
        stats = c.stats()
    assert stats["batches"] == 10 and data.numel() == 640
    check_counting_streams(data)


@pytest.mark.parametrize("transport", ["process_slots", "thread"])
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_server_thread_with_a_gpu_policy_lends_pageable_blocks(transport):
    """The server thread page-locks a second mapping of the ring for its GPU gather, so a
    lent batch is pageable: batch.to("cuda", non_blocking=True) is done with it when it
    returns, and the rows copied up are the batch's, whatever the workers write later."""
    ups, copies = [], []
    with AsyncBatchedCollector(
        counting_envs(NUM_ENVS), CountingPolicy(), frames_per_batch=FPB, policy_device="cuda",
        transport=transport, envs_per_worker=2, total_frames=30 * FPB,
        min_batch_size=NUM_ENVS, batch_timeout=30.0,
    ) as c:  # fmt: skip
        for batch in c:
            assert not batch["observation"].is_pinned()
            copies.append(batch.clone())
            ups.append(batch.to("cuda", non_blocking=True))
        stats = c.stats()
    torch.cuda.synchronize()
    assert stats["lent_batches"] >= 10
    assert stats["server"]["gathers_on_device"]
    for up, copy in zip(ups, copies, strict=True):
        assert (up.cpu() == copy).all()
    check_counting_streams(torch.cat(copies))
