"""EnvPool's Atari pools as a source: driven with async_reset/send/recv like ale-py's
AtariVectorEnv, stepped whole where ``batch_size == num_envs``.

Each sub-env of a pool has its own seeded RNG (its no-op starts), so its stream depends
only on its seed and its own actions, not on which sub-envs share a ``recv``: the
reference below drives the same pool by hand, stepped whole, with the same policy, and
every transition of every env must match it in order: observation, action, next
observation (the true final one at an episode's end), reward and flags. Episodes are cut
at 20 steps, so a NextStep reset step taken for a transition, or one missing, shows as
a mismatch within a few rows.
"""

import functools

import numpy as np
import pytest
import torch
from envs import envpool_pong
from helpers import streams

from rlcollect import AsyncBatchedCollector
from rlcollect.worker.source import describe

envpool = pytest.importorskip("envpool")
pytestmark = pytest.mark.slow

ROWS = 50  # per env: two whole episodes of 20 steps and part of a third


class FramePolicy(torch.nn.Module):
    """Deterministic, and varied: the action is the last frame's pixel sum modulo 6."""

    def forward(self, obs):
        return obs[:, -1].long().sum((1, 2)) % 6


def frame_actions(obs):
    return obs[:, -1].astype(np.int64).sum((1, 2)) % 6


@functools.cache
def reference(seed, num_envs=4, rows=ROWS):
    """Each sub-env's first ``rows`` transitions, the pool stepped whole by hand: a list
    per sub-env of (observation, action, next observation, reward, terminated,
    truncated). The step that only resets a sub-env (NextStep) is no transition."""
    pool = envpool_pong(num_envs, num_envs, seed)
    try:
        pool.async_reset()
        obs, *_, info = pool.recv()
        out = {e: [] for e in range(num_envs)}
        resets = np.zeros(num_envs, bool)  # the sub-env's next result only resets it
        while min(map(len, out.values())) < rows:
            ids, actions = info["env_id"], frame_actions(obs)
            pool.send(actions, ids)
            nxt, reward, term, trunc, info = pool.recv()
            previous = dict(zip(ids.tolist(), zip(obs, actions, strict=True), strict=True))
            for j, e in enumerate(info["env_id"].tolist()):
                if resets[e]:
                    resets[e] = False
                    continue
                o, a = previous[e]
                out[e].append((o, a, nxt[j].copy(), reward[j], term[j], trunc[j]))
                resets[e] = term[j] or trunc[j]
            obs = nxt.copy()
        return {e: t[:rows] for e, t in out.items()}
    finally:
        pool.close()


def collect(env_fns, transport, **kwargs):
    """Each env's stream, once every env has delivered ``ROWS`` rows (a pool driven
    asynchronously serves whichever sub-envs are ready, on a busy machine not fairly)."""
    with AsyncBatchedCollector(
        env_fns,
        FramePolicy(),
        frames_per_batch=40,
        total_frames=-1,
        transport=transport,
        policy_device="cpu",
        **kwargs,
    ) as c:
        n = c.num_envs
        batches, counts = [], torch.zeros(n, dtype=torch.long)
        while int(counts.min()) < ROWS:
            batches.append(next(c))
            counts += torch.bincount(batches[-1]["env_index"].reshape(-1), minlength=n)
            assert len(batches) < 500, f"a sub-env starved: rows {counts.tolist()}"
        return streams(torch.cat([b.reshape(-1) for b in batches]))


def check_against_reference(per_env, seeds, sub_envs=4):
    """Env ``i`` is sub-env ``i % sub_envs`` of the pool built with ``seeds[i //
    sub_envs]``: its first ROWS rows are that sub-env's reference transitions."""
    assert sorted(per_env) == list(range(len(seeds) * sub_envs))
    for i, rows in per_env.items():
        want = reference(seeds[i // sub_envs])[i % sub_envs]
        rows = rows[:ROWS]
        obs, nxt = rows["observation"].numpy(), rows["next", "observation"].numpy()
        for t, (o, a, n, r, te, tr) in enumerate(want):
            where = f"env {i}, transition {t}"
            assert np.array_equal(obs[t], o), f"{where}: another observation"
            assert int(rows["action"][t]) == a, f"{where}: another action"
            assert np.array_equal(nxt[t], n), f"{where}: another next observation"
            assert float(rows["next", "reward"][t]) == r, where
            assert bool(rows["next", "terminated"][t]) == te, where
            assert bool(rows["next", "truncated"][t]) == tr, where
        # counters: two episodes of 20 steps, then the third
        assert rows["step"].tolist() == [t % 20 for t in range(ROWS)]
        assert rows["episode"].tolist() == [t // 20 for t in range(ROWS)]
        done = rows["next", "done"].numpy()
        assert np.flatnonzero(done).tolist() == [19, 39]
        # the final observation is the last stack shifted on, not the next reset's
        assert np.array_equal(nxt[done][:, :3], obs[done][:, 1:])
        assert not np.array_equal(nxt[19], obs[20])


@pytest.mark.parametrize("batch_size", [2, 4], ids=["send-recv", "stepped-whole"])
def test_each_env_stream_is_the_pools_own(transport, batch_size):
    pool = functools.partial(envpool_pong, 4, batch_size, 3)
    check_against_reference(collect([pool], transport), seeds=[3])


def test_two_pools_per_worker_with_the_policy_in_the_worker():
    # inference_backend="worker": each pool is sent its actions before the worker writes
    # the transitions its result finished (vector_loop.py), from the ids of that result.
    pools = [functools.partial(envpool_pong, 4, 2, seed) for seed in (3, 11)]
    per_env = collect(
        pools, "process_slots", envs_per_worker=2, inference_backend="worker", worker_splits=2
    )
    check_against_reference(per_env, seeds=[3, 11])


def test_info_entries_of_a_pool():
    # info_keys: each row's entry from the result that finished it; EnvPool counts the
    # steps of an episode in "elapsed_step".
    with AsyncBatchedCollector(
        [functools.partial(envpool_pong, 4, 2, 3)],
        FramePolicy(),
        frames_per_batch=40,
        total_frames=200,
        transport="thread",
        policy_device="cpu",
        info_keys=("elapsed_step",),
    ) as c:
        data = torch.cat([b.reshape(-1) for b in c])
    assert torch.equal(data["next", "info", "elapsed_step"].long(), data["step"] + 1)


def test_a_pool_is_described_by_its_protocol():
    pool = envpool_pong(4, 2)
    whole = envpool_pong(4, 0)  # 0: every sub-env per recv
    try:
        source, stepped = describe(pool, "env_fns[0]"), describe(whole, "env_fns[0]")
    finally:
        pool.close()
        whole.close()
    assert source.envpool and source.asynchronous
    assert (source.sub_envs, source.batch_size, source.autoreset.value) == (4, 2, "NextStep")
    assert source.observation_space.shape == (4, 84, 84)
    assert source.action_space.n == 6
    assert stepped.envpool and not stepped.asynchronous and stepped.batch_size == 4


def test_restarts_are_refused_for_a_pool():
    with pytest.raises(ValueError, match="max_worker_restarts needs plain envs"):
        AsyncBatchedCollector(
            [functools.partial(envpool_pong, 4, 2)],
            FramePolicy(),
            frames_per_batch=40,
            total_frames=40,
            policy_device="cpu",
            max_worker_restarts=1,
        )
