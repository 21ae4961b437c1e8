"""The driver's bookkeeping of RayCollector, without Ray: order, held-back rows, exact batches."""

import numpy as np
import pytest

pytest.importorskip("ray")  # rlcollect.distributed (the package) needs it
from rlcollect.distributed.assembly import Assembler, HoldBack, InOrder


def rows(env, episode, step, terminated=None):
    env = np.asarray(env)
    n = len(env)
    term = np.zeros(n, bool) if terminated is None else np.asarray(terminated)
    return {
        ("env_index",): env,
        ("episode",): np.asarray(episode),
        ("step",): np.asarray(step),
        ("next", "terminated"): term,
        ("next", "truncated"): np.zeros(n, bool),
        ("next", "done"): term.copy(),
    }


def test_assembler_cuts_exact_batches_and_stops_at_the_budget():
    a = Assembler(frames_per_batch=4, total_frames=10)
    sizes, seen = [], []
    for start in range(0, 30, 3):  # pieces of 3 rows, cut across batches
        a.add(rows(np.arange(start, start + 3), [0] * 3, [0] * 3))
        while a.ready:
            batch = a.pop()
            sizes.append(batch.batch_size[0])
            seen.extend(batch["env_index"].tolist())
    assert sizes == [4, 4, 2] and a.exhausted
    assert seen == list(range(10))  # in the order given, none lost or repeated


def test_assembler_endless():
    a = Assembler(frames_per_batch=5, total_frames=-1)
    a.add(rows(np.arange(12), [0] * 12, [0] * 12))
    assert [a.pop().batch_size[0] for _ in range(2)] == [5, 5]
    assert not a.ready and a.queued == 2 and not a.exhausted


def test_in_order_passes_batches_on_in_the_actors_order():
    order = InOrder()
    assert order.add(1, {"b": 1}) == []
    assert order.waiting == 1
    assert order.add(0, {"a": 0}) == [{"a": 0}, {"b": 1}]
    with pytest.raises(AssertionError, match="twice"):
        order.add(1, {})


def test_hold_back_keeps_each_envs_latest_row_and_ends_its_episode_on_release():
    hb = HoldBack(env_offset=10, num_envs=2)
    out = hb.pass_on(rows([10, 11, 10, 11], [0, 0, 0, 0], [0, 0, 1, 1]))
    assert out[("step",)].tolist() == [0, 0]  # step 1 of each env held back
    out = hb.pass_on(rows([10, 10], [0, 1], [2, 0], terminated=[True, False]))
    # env 10's held step 1 first, then its step 2; episode 1 step 0 held
    assert list(zip(out[("env_index",)], out[("step",)], strict=True)) == [(10, 1), (10, 2)]
    assert hb.last_episodes().tolist() == [1, 0]
    ended = hb.release_ended()
    assert ended[("env_index",)].tolist() == [10, 11]
    assert ended[("next", "truncated")].tolist() == [True, True]
    assert ended[("next", "done")].tolist() == [True, True]
    assert hb.release_ended() is None
