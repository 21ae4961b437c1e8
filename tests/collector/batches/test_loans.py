"""Ring batches (collector/batches/loans.py): a batch goes out as a view of the ring, and its
slots go back to their workers once the caller lets go of it.

One vector env per worker whose chunk is ``frames_per_batch`` rows (the default chunk
size gives that); CountingEnvs tell each row's env, episode and step, so a slot written
while a caller still held it shows as a changed batch or a broken stream. A block of a
pooled ring lent as one batch (envs stepped one by one) is tested in
``test_pooled.py``.
"""

import functools
import gc

import numpy as np
import pytest
import torch
from envs import counting_vector
from helpers import CountingPolicy, check_counting_streams, hold_first_batch

from rlcollect import AsyncBatchedCollector
from rlcollect.collector.batches.delivery import POOL_BLOCKS, choose_delivery
from rlcollect.collector.batches.loans import RingLoans
from rlcollect.collector.options import Options
from rlcollect.collector.plan import plan_collection
from rlcollect.testing import CountingEnv, CountingVectorEnv
from rlcollect.transports import ThreadQueueTransport

FPB = 64  # 4 sub-envs x 16 steps: one chunk ("auto": frames_per_batch // num_envs steps)


def collector(transport, factory="sync", **kwargs):
    if factory == "sync":
        fns = [functools.partial(counting_vector, 0, 4, "NextStep")]
    else:  # results for arbitrary subsets of the sub-envs, two at a time
        fns = [functools.partial(CountingVectorEnv, 0, 4, 2, order_seed=3)]
    kwargs.setdefault("total_frames", 30 * FPB)
    return AsyncBatchedCollector(
        fns, CountingPolicy(), frames_per_batch=FPB, policy_device="cpu", transport=transport,
        **kwargs,
    )  # fmt: skip


def copies(batches):
    return [b.clone() for b in batches]


# ------------------------------------------------------------------------- RingLoans


def test_a_slot_comes_back_only_once_every_view_of_it_is_gone():
    loans = RingLoans(num_workers=2, slots=4)
    a, b = np.zeros(4), np.zeros(4)
    tensor = torch.from_numpy(a)
    view = tensor[1:]
    loans.lend(1, 3, [a, b])
    del a, b
    assert loans.returned() == [] and loans.alive()  # the tensor holds a
    del tensor
    assert loans.returned() == []  # its view still does
    del view
    gc.collect()
    assert loans.returned() == [(1, 3)]
    assert not loans.alive()
    assert loans.returned() == []  # given back once


def test_at_most_slots_minus_two_of_a_worker_are_lent():
    loans = RingLoans(num_workers=2, slots=4)
    held = [np.zeros(1) for _ in range(3)]
    loans.lend(0, 0, [held[0]])
    loans.lend(0, 1, [held[1]])
    assert not loans.can_lend(0)  # the worker keeps one slot to write and one to go on
    assert loans.can_lend(1)
    del held[0]
    assert loans.returned() == [(0, 0)]
    assert loans.can_lend(0)
    with pytest.raises(ValueError, match="at least 3 slots"):
        RingLoans(num_workers=1, slots=2)


# ---------------------------------------------------------------- through the collector


@pytest.mark.parametrize("factory", ["sync", "async"])
def test_batches_dropped_as_a_loop_drops_them_keep_being_lent(transport, factory):
    """The loop holds one batch while it asks for the next, so each ask finds at most
    one lent batch alive (the one dropped before it has come back) and lends the first
    chunk it takes. How many chunks one ask takes is the scheduler's: where the worker
    got ahead of the loop, more chunks come with the first and those past the limit of
    two lent at once are copied. The worker has 4 slots: with the held batch lent, an
    ask takes at most the other 3 chunks and lends one; with it copied, at most 4 and
    lends two. So a third of the batches at least are lent (all 30 where the loop keeps
    up; 16 where it sleeps 50 ms a batch), where a slot that never came back would stop
    lending after 2."""
    kept = []
    with collector(transport, factory) as c:
        for b in c:
            kept.append(b.clone())  # a copy: the batch itself is dropped next round
        stats = c.stats()
    assert stats["batches"] == 30
    assert stats["lent_batches"] >= 10
    check_counting_streams(torch.cat(kept))


def test_kept_batches_stay_intact_and_later_ones_are_copied(transport):
    """A caller that keeps every batch: the first two are lent, the rest copied (the
    worker must not wait for the caller), and none changes, during or after the run."""
    with collector(transport) as c:
        kept = list(c)
        early = copies(kept)
        stats = c.stats()
    assert stats["lent_batches"] == 2
    assert stats["batches"] == 30
    for batch, copy in zip(kept, early, strict=True):
        assert (batch == copy).all()
    check_counting_streams(torch.cat(kept))


def test_a_batch_held_for_good_leaves_the_others_lent_in_any_order(transport):
    """Batch 0 is kept to the end, the rest dropped as they come: their slots come back
    out of the order they were handed over, and the worker writes the free ones. (With
    batch 0 and the loop's last batch held, the next one is a copy: about every other
    batch is lent.)"""
    first, first_copy, rest, stats = hold_first_batch(collector(transport, total_frames=40 * FPB))
    # more than the two slots a worker may lend at once, one of them held all along
    assert stats["lent_batches"] >= 3
    assert (first == first_copy).all()
    check_counting_streams(torch.cat([first_copy, *rest]))


def test_a_lent_batch_survives_close(transport):
    """The transport frees the ring's pages at close, except under a batch the caller
    still holds: it reads what it was given until dropped."""
    with collector(transport) as c:
        batch = next(iter(c))
        copy = batch.clone()
        # The first batch is lent (nothing else is out yet); a second chunk may have come
        # in the same wait and been lent too, on a busy machine.
        assert c.stats()["lent_batches"] >= 1
    assert (batch == copy).all()
    assert batch["observation"].sum() > 0


def test_no_lending_where_a_chunk_is_not_a_batch(transport):
    with collector(transport, transition_chunk_size=32) as c:
        data = torch.cat(list(c))
        assert c.stats()["lent_batches"] == 0
    check_counting_streams(data)


class UnnamedSlots(ThreadQueueTransport):
    """A transport that does not say its credits name their slot."""

    names_slots = False


def test_no_lending_where_credits_do_not_name_slots():
    with collector(UnnamedSlots()) as c:
        data = torch.cat(list(c))
        assert c.stats()["lent_batches"] == 0
        assert c.transport.names_slots is False
    check_counting_streams(data)


# ------------------------------------------------------------------ which batches lend


# The backend's say, by (backend, GPU policy): whether a pooled ring's blocks may be lent.
_LENDS_POOLED = {
    ("process", True): True,
    ("thread", True): True,  # a GPU policy: the server thread pages an alias
    ("thread", False): False,  # the copy is a small part
    ("worker", True): False,
}


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({}, "pool"),
        ({"slot_rows": 64}, ""),  # a chunk of every worker is not a batch
        ({"recurrent": True}, ""),  # states are keyed by the env a row belongs to
        ({"pool_slots": 0}, ""),  # the transport does not serve pooled rings
        ({"num_workers": 42}, "pool"),  # 6 blocks of 42 slots: 252 of the credits' 256
        ({"num_workers": 43}, ""),  # more slots than the transport's credits name
        ({"recurrent": True, "vector": True}, "chunk"),
        ({"names_slots": False}, ""),  # lent slots would come back out of turn
        ({"copies_only": True}, ""),  # restarts
        ({"backend": "thread"}, "pool"),  # a GPU policy: the server thread pages an alias
        ({"backend": "thread", "gpu_policy": False}, ""),  # the copy is a small part
        ({"backend": "worker"}, ""),
        ({"vector": True}, "chunk"),
        ({"vector": True, "backend": "thread"}, "chunk"),  # staged: never page-locked
        ({"vector": True, "worker_rows": 32}, ""),
    ],
)
def test_how_batches_may_view_the_ring(kwargs, expected):
    args = {
        "vector": False,
        "names_slots": True,
        "copies_only": False,
        "backend": "process",
        "worker_rows": 128,
        "slot_rows": 128,
        "frames_per_batch": 128,
        "recurrent": False,
        "pool_slots": 256,
        "num_workers": 16,
        "gpu_policy": True,
        **kwargs,
    }
    delivery = choose_delivery(
        on_policy=False,
        restarts=args["copies_only"],
        vector=args["vector"],
        names_slots=args["names_slots"],
        lends_pooled_blocks=_LENDS_POOLED[args["backend"], args["gpu_policy"]],
        recurrent=args["recurrent"],
        worker_rows=args["worker_rows"],
        block_rows=args["slot_rows"],
        frames_per_batch=args["frames_per_batch"],
        num_workers=args["num_workers"],
        pool_slots=args["pool_slots"],
    )
    assert delivery.lending == expected


def test_on_policy_rounds_never_lend():
    delivery = choose_delivery(
        on_policy=True, restarts=False, vector=False, names_slots=True,
        lends_pooled_blocks=True, recurrent=False, worker_rows=128, block_rows=128,
        frames_per_batch=128, num_workers=16, pool_slots=256,
    )  # fmt: skip
    assert delivery.kind == "rounds" and delivery.lending == "" and delivery.slots == 1


@pytest.mark.filterwarnings("ignore:torch runs")  # 64 workers on this machine's cores
def test_sixty_four_workers_of_one_env_pool_over_process_slots():
    """64 envs with the defaults (a worker each) over process_slots pool the ring: six
    blocks of 64 places, more than a one-byte credit could name. Planned, not started."""
    envs = [functools.partial(CountingEnv, i) for i in range(64)]
    options = Options(
        frames_per_batch=64 * 4, transport="process_slots", envs_per_worker=1,
        policy_device="cpu", inference_backend="process", seed=None, stall_timeout=None,
    )  # fmt: skip
    plan = plan_collection(envs, CountingPolicy(), options)
    assert plan.delivery.lending == "pool"
    assert plan.layout.pooled and plan.layout.credited_slots == POOL_BLOCKS * 64
    assert plan.transport.pool_slots >= plan.layout.credited_slots
