"""Every transition's ("next", "episode_return" | "episode_length"), and stats()["episodes"]
(collector/batches/episodes.py), for plain and vector envs, off- and on-policy, both transports."""

import functools

import pytest
import torch
from envs import counting_vector, with_info
from helpers import CountingPolicy, check_counting_streams, check_episode_figures, collect
from tensordict import TensorDict

from rlcollect import AsyncBatchedCollector, ReplayBuffer
from rlcollect.collector.batches import episodes
from rlcollect.collector.batches.episodes import EpisodeStats
from rlcollect.testing import CountingEnv, CountingVectorEnv, episode_length

SOURCES = {
    "plain": (
        [functools.partial(CountingEnv, i) for i in range(4)],
        {"worker_splits": 2, "envs_per_worker": 2},
    ),
    "vector-NextStep": ([functools.partial(counting_vector, 3 * i, 3) for i in range(2)], {}),
    "vector-Disabled": (
        [functools.partial(counting_vector, 3 * i, 3, "Disabled") for i in range(2)],
        {},
    ),
    "send-recv": (
        [functools.partial(CountingVectorEnv, 4 * i, 4, 2, order_seed=i) for i in range(2)],
        {},
    ),
}


@pytest.mark.parametrize("source", list(SOURCES))
def test_running_return_and_length_on_every_row(transport, source):
    env_fns, extra = SOURCES[source]
    with AsyncBatchedCollector(
        env_fns, CountingPolicy(), frames_per_batch=48, total_frames=960, transport=transport,
        policy_device="cpu", **extra,
    ) as c:  # fmt: skip
        data = collect(c)
        stats = c.stats()["episodes"]
    check_counting_streams(data)
    check_episode_figures(data)
    done = data[("next", "done")]
    assert stats["count"] == int(done.sum()) > 0
    ended = data[done]
    # at a done row the figures are the finished episode's
    lengths = torch.tensor(
        [
            episode_length(int(e), int(p))
            for e, p in zip(ended["env_index"], ended["episode"], strict=True)
        ]
    )
    assert torch.equal(ended[("next", "episode_length")], lengths)


def test_episode_stats_before_any_episode_ends_and_over_the_last_100():
    stats = EpisodeStats()
    assert stats.stats() == {"count": 0, "return_mean": None, "length_mean": None}
    n = 150
    batch = TensorDict(
        {
            ("next", "done"): torch.ones(n, dtype=torch.bool),
            ("next", "episode_return"): torch.arange(n, dtype=torch.float32),
            ("next", "episode_length"): torch.arange(n),
            ("next", "terminated"): torch.ones(n, dtype=torch.bool),
            "env_index": torch.zeros(n, dtype=torch.int64),
            "episode": torch.arange(n),
        },
        batch_size=[n],
    )
    stats.record(batch)
    assert stats.stats() == {"count": 150, "return_mean": 99.5, "length_mean": 99.5}


def test_running_figures_start_again_after_a_worker_restart(transport, tmp_path):
    from envs import CrashOnce

    from rlcollect.errors import WorkerRestartWarning

    fns = [functools.partial(CountingEnv, i) for i in range(4)]
    fns[3] = functools.partial(CrashOnce, 3, str(tmp_path / "crashed"), at=(1, 2))
    with (
        pytest.warns(WorkerRestartWarning),
        AsyncBatchedCollector(
            fns, CountingPolicy(), frames_per_batch=32, transport=transport,
            policy_device="cpu", envs_per_worker=2, max_worker_restarts=1,
        ) as c,
    ):  # fmt: skip
        # Endless, until the restart happened and every env gave 20 rows after it: the
        # other worker alone could meet a fixed budget before the crash (a busy machine).
        batches, after = [], torch.zeros(4, dtype=torch.long)
        for batch in c:
            batches.append(batch)
            if c.stats()["worker_restarts"]:
                after += torch.bincount(batch["env_index"], minlength=4)
                if bool((after >= 20).all()):
                    break
            assert len(batches) < 2000, "the worker was not restarted"
        data = torch.cat(batches)
    # The rebuilt envs start new episodes at step 0: their figures start from 0 too,
    # and the interrupted episodes' last rows carry what they had reached.
    check_episode_figures(data)


def check_records(records, total):
    """CountingEnv's episodes, each once, in its env's order, with its figures and the
    info of its last step (``lives`` = 3 - steps % 3, ``progress`` = 1)."""
    seen = {}
    for r in records:
        length = episode_length(r.env_index, r.episode)
        assert r.episode_length == length, r
        assert r.episode_return == length * (length + 1) // 2, r
        assert r.info == {"lives": 3 - length % 3, "progress": 1.0}, r
        assert 0 < r.frames <= total
        seen.setdefault(r.env_index, []).append(r.episode)
    for env, numbers in seen.items():
        assert numbers == list(range(len(numbers))), (env, numbers)
    frames = [r.frames for r in records]
    assert frames == sorted(frames)


def test_finished_episodes_are_drained_while_collecting_in_the_background(transport):
    total = 2000
    records = []
    with AsyncBatchedCollector(
        [functools.partial(with_info, i) for i in range(4)], CountingPolicy(),
        frames_per_batch=40, total_frames=total, transport=transport, policy_device="cpu",
        replay_buffer=ReplayBuffer(total), info_keys=("lives", "progress"),
    ) as c:  # fmt: skip
        c.start()
        while not c.join(timeout=0.01):
            records += c.episodes()  # from this thread, while the background one fills it
        records += c.episodes()
        count = c.stats()["episodes"]["count"]
    assert count == len(records) > 20
    check_records(records, total)
    assert c.episodes() == []  # drained


@pytest.mark.parametrize("time_major", [False, True])
def test_finished_episodes_of_on_policy_rounds(time_major):
    with AsyncBatchedCollector(
        [functools.partial(with_info, i) for i in range(4)], CountingPolicy(),
        frames_per_batch=40, total_frames=800, transport="thread", policy_device="cpu",
        on_policy=True, time_major=time_major, info_keys=("lives", "progress"),
    ) as c:  # fmt: skip
        ended = 0
        records = []
        for batch in c:
            ended += int(batch["next", "done"].sum())
            drained = c.episodes()
            assert all(r.frames == c.stats()["frames"] for r in drained)
            records += drained
    assert len(records) == ended > 10
    check_records(records, 800)


def test_undrained_records_past_the_bound_are_dropped_oldest_first(monkeypatch):
    monkeypatch.setattr(episodes, "KEPT", 3)
    stats = EpisodeStats()

    def batch(first, done, terminated):
        n = len(done)
        return TensorDict(
            {
                ("next", "done"): torch.tensor(done),
                ("next", "episode_return"): torch.arange(n, dtype=torch.float32),
                ("next", "episode_length"): torch.arange(n),
                ("next", "terminated"): torch.tensor(terminated),
                ("next", "info", "lives"): torch.arange(n),
                "env_index": torch.arange(first, first + n),
                "episode": torch.zeros(n, dtype=torch.int64),
            },
            batch_size=[n],
        )

    # the latest batch's records are kept whole, even past the bound
    stats.record(batch(0, [True, False, True, True, True], [True, False, False, True, True]), 5)
    kept = stats.drain()
    assert [r.env_index for r in kept] == [0, 2, 3, 4] and stats.dropped == 0
    assert [r.terminated for r in kept] == [True, False, True, True]
    assert kept[1].info == {"lives": 2} and kept[1].frames == 5
    # undrained, the oldest batch's go once a later batch's are in
    stats.record(batch(10, [True, True], [True, True]), 7)
    stats.record(batch(20, [True, True], [True, True]), 9)
    kept = stats.drain()
    assert [r.env_index for r in kept] == [20, 21] and stats.dropped == 2
    assert [r.frames for r in kept] == [9, 9]
    assert stats.count == 8 and stats.drain() == []
