"""ReplayBuffer(frame_stack=k) fed by real collectors: pixel envs whose frames tell
their env, episode and step (plain, in vector envs, on-policy, across worker restarts,
in the background with a train ratio) and ale-py's AtariVectorEnv; every sampled stack
is the one the env gave."""

import functools

import pytest
import torch
from frame_checks import check_stacks, same_as_given
from frame_envs import stacked, stacked_vector

from rlcollect import AsyncBatchedCollector, ReplayBuffer
from rlcollect.errors import WorkerRestartWarning


class PixelPolicy(torch.nn.Module):
    """Deterministic: the action is the newest frame's sum modulo 3."""

    def forward(self, obs):
        return obs[:, -1].long().sum((1, 2)) % 3


def collector(transport, envs, buffer, **kwargs):
    kwargs.setdefault("frames_per_batch", 24)
    kwargs.setdefault("total_frames", 24 * 30)
    return AsyncBatchedCollector(
        envs, PixelPolicy(), transport=transport, policy_device="cpu",
        replay_buffer=buffer, seed=0, **kwargs,
    )  # fmt: skip


def test_fed_by_a_collector(transport):
    """Plain envs of both paddings, several per batch, rings wrapping many times."""
    buffer = ReplayBuffer(100, frame_stack=4, seed=0)
    with collector(transport, [functools.partial(stacked, i) for i in range(4)], buffer) as c:
        for batch in c:
            check_stacks(batch, 4)  # (the env's own stacks, as the collector gives them)
            check_stacks(buffer.sample(64), 4)
    assert buffer.written == 720 and 50 < len(buffer) <= 100


def test_fed_by_vector_envs(transport):
    buffer = ReplayBuffer(100, frame_stack=4, seed=0)
    fns = [functools.partial(stacked_vector, 3 * i, 3) for i in range(2)]
    with collector(transport, fns, buffer, total_frames=24 * 20) as c:
        for _ in c:
            check_stacks(buffer.sample(64), 4)
    assert buffer.written == 480


def test_fed_on_policy_rounds():
    """On-policy batches [num_envs, T], which the collector writes as rows, env by env."""
    buffer = ReplayBuffer(60, frame_stack=4, seed=0)
    fns = [functools.partial(stacked_vector, 3 * i, 3, mode="SameStep") for i in range(2)]
    with collector("thread", fns, buffer, frames_per_batch=6 * 5, on_policy=True) as c:
        for batch in c:
            assert batch.batch_size == (6, 5)
            check_stacks(buffer.sample(64), 4)
    assert buffer.written == 720


def test_fed_across_worker_restarts(tmp_path):
    """A worker rebuilt after a crash starts its envs anew (episodes numbered on, the
    env's own count from 0): the buffer takes each rebuilt env as a new stream."""
    fns = [functools.partial(stacked, i) for i in range(4)]
    fns[3] = functools.partial(stacked, 3, marker=str(tmp_path / "crashed"), at=(2, 0))
    buffer = ReplayBuffer(80, frame_stack=4, seed=0)
    kept = []
    # Until the rebuilt env 3 has gone past episode 2: on a busy machine the other
    # worker may fill many batches before the rebuilt one steps (bounded by the cap).
    with (
        pytest.warns(WorkerRestartWarning),
        collector(
            "process_slots", fns, buffer, max_worker_restarts=1, envs_per_worker=2,
            total_frames=24 * 2000,
        ) as c,
    ):  # fmt: skip
        for batch in c:
            kept.append(batch.clone())
            same_as_given(buffer.sample(64), torch.cat(kept))
            if bool(((batch["env_index"] == 3) & (batch["episode"] > 2)).any()):
                break
        assert c.stats()["worker_restarts"] == 1
    rebuilt = torch.cat(kept)
    assert bool(((rebuilt["env_index"] == 3) & (rebuilt["episode"] > 2)).any())


@pytest.mark.slow
def test_fed_by_ale_atari_vector_env(transport):
    """ale-py's AtariVectorEnv (zero padding, sub-envs served as they finish): the
    sampled 84x84 stacks are the env's own, across episodes of 50 steps."""
    from envs import atari_vector

    buffer = ReplayBuffer(600, frame_stack=4, seed=0)
    kept = []
    with AsyncBatchedCollector(
        [functools.partial(atari_vector, "NextStep")], PixelPolicy(), frames_per_batch=100,
        total_frames=1600, transport=transport, policy_device="cpu", replay_buffer=buffer,
    ) as c:  # fmt: skip
        for batch in c:
            kept.append(batch.clone())
            same_as_given(buffer.sample(128), torch.cat(kept))
    # (writes of a sixth of the capacity each: the frames hold fewer rows than capacity)
    assert buffer.written == 1600 and 400 < len(buffer) <= 600


def test_train_ratio_with_background_collection(transport):
    """The learner samples its share while the collector writes from its own thread."""
    buffer = ReplayBuffer(200, frame_stack=4, seed=0)
    fns = [functools.partial(stacked, i) for i in range(4)]
    with collector(
        transport, fns, buffer, total_frames=600, train_ratio=2, learning_starts=48
    ) as c:
        c.start()
        while c.wait_to_sample(timeout=60):
            check_stacks(buffer.sample(16), 4)
        assert c.join(timeout=60)
        ratio = c.stats()["train_ratio"]
    assert buffer.written == 600
    assert ratio == pytest.approx(2, abs=0.2)
