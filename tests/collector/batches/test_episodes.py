"""Every transition's ("next", "episode_return" | "episode_length"), and stats()["episodes"]
(collector/batches/episodes.py), for plain and vector envs, off- and on-policy, both transports."""

import functools

import pytest
import torch
from envs import counting_vector
from helpers import CountingPolicy, check_counting_streams, check_episode_figures, collect
from tensordict import TensorDict

from rlcollect import AsyncBatchedCollector
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
