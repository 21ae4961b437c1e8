"""``info_keys``: numeric info entries carried as ("next", "info", name) (worker/infos.py),
for plain envs and vector envs (info as arrays with "_name" masks; SameStep's final_info),
on both transports; missing or non-numeric entries are errors naming the env and entry."""

import functools

import pytest
import torch
from envs import InfoDropsLives, InfoLivesTurnString, info_vector, with_info
from helpers import CountingPolicy, check_counting_streams, collect

from rlcollect import AsyncBatchedCollector, WorkerError
from rlcollect.testing import STEP, CountingVectorEnv, episode_length

PLAIN = [functools.partial(with_info, i) for i in range(4)]
SOURCES = {
    "plain": PLAIN,
    "vector-NextStep": [functools.partial(info_vector, 2 * i, 2, "NextStep") for i in range(2)],
    "vector-SameStep": [functools.partial(info_vector, 2 * i, 2, "SameStep") for i in range(2)],
    "vector-Disabled": [functools.partial(info_vector, 2 * i, 2, "Disabled") for i in range(2)],
}


def run(env_fns, transport, **kwargs):
    kwargs.setdefault("frames_per_batch", 40)
    kwargs.setdefault("total_frames", 400)
    with AsyncBatchedCollector(
        env_fns, CountingPolicy(), transport=transport, policy_device="cpu", **kwargs
    ) as c:
        return collect(b.reshape(-1) for b in c)


def check_info(data):
    nxt = data[("next", "observation")]
    reached = nxt[:, STEP]  # the step each transition reached
    lives = data[("next", "info", "lives")]
    progress = data[("next", "info", "progress")]
    assert lives.dtype == torch.int64 and progress.dtype == torch.float64
    assert torch.equal(lives, 3 - reached % 3)
    lengths = torch.tensor(
        [
            episode_length(int(e), int(p))
            for e, p in zip(data["env_index"], data["episode"], strict=True)
        ]
    )
    assert torch.allclose(progress, reached.double() / lengths)


@pytest.mark.parametrize("source", list(SOURCES))
def test_info_entries_are_carried(transport, source):
    data = run(SOURCES[source], transport, info_keys=("lives", "progress"))
    check_counting_streams(data)
    check_info(data)  # at done rows too: SameStep's come from final_info


@pytest.mark.parametrize("source", ["plain", "vector-SameStep"])
def test_info_entries_in_on_policy_batches(source):
    data = run(SOURCES[source], "process_slots", info_keys=("lives",), on_policy=True)
    lives = data[("next", "info", "lives")]
    assert torch.equal(lives, 3 - data[("next", "observation")][:, STEP] % 3)


def test_info_entries_of_a_send_recv_vector_env_without_them_fail_at_the_probe():
    fns = [functools.partial(CountingVectorEnv, 0, 4, 2)]
    with pytest.raises(ValueError, match="info_keys names 'lives', but env 0's info"):
        run(fns, "thread", info_keys=("lives",))


@pytest.mark.parametrize(
    ("info_keys", "error", "message"),
    [
        (("missing",), ValueError, "info_keys names 'missing', but env 0's info after a step"),
        (("name",), ValueError, "only numbers"),
        ("lives", TypeError, "info_keys must be a sequence"),
        (("lives", "lives"), ValueError, "names an entry twice"),
        (("",), ValueError, "non-empty strings"),
    ],
)
def test_bad_info_keys_fail_at_construction(info_keys, error, message):
    with pytest.raises(error, match=message):
        run(PLAIN, "thread", info_keys=info_keys)


@pytest.mark.parametrize(
    ("env", "message"),
    [
        (InfoDropsLives, "env 2 returned an info without 'lives'"),
        (InfoLivesTurnString, r"env 2 returned info\['lives'\] = 'three'"),
    ],
)
def test_an_entry_that_goes_missing_or_bad_later_is_a_worker_error(transport, env, message):
    fns = [*PLAIN[:2], functools.partial(env, 2), PLAIN[3]]
    with (
        pytest.raises(WorkerError, match=message) as info,
        AsyncBatchedCollector(
            fns, CountingPolicy(), frames_per_batch=40, transport=transport,
            policy_device="cpu", info_keys=("lives",),
        ) as c,
    ):  # fmt: skip
        # Endless (a fixed budget could be met by the other workers first), but bounded.
        for k, _ in enumerate(c):
            assert k < 2000, "the bad info entry was never reported"
    assert info.value.env_index == 2


def test_a_sub_env_without_the_entry_is_named():
    import gymnasium as gym

    def vector():
        return gym.vector.SyncVectorEnv(
            [functools.partial(with_info, 0), functools.partial(InfoDropsLives, 1)],
            autoreset_mode="SameStep",
        )

    with pytest.raises(WorkerError, match=r"env 1 .*without 'lives'") as info:
        run([vector], "thread", info_keys=("lives",), frames_per_batch=20, total_frames=200)
    assert info.value.env_index == 1
