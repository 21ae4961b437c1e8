"""ReplayBuffer(frame_stack=k) on hand-made rows: each frame stored once, the stacks
rebuilt at sample() bit for bit across episode ends, restarts and wraps of the rings;
what is verified and refused; memory; state; threads. Fed by collectors:
test_frame_stack_fed.py."""

import threading

import numpy as np
import pytest
import torch
from frame_checks import Streams, check_stacks
from frame_envs import fading, last_axis
from tensordict import TensorDict

from rlcollect import ReplayBuffer
from rlcollect.replay import FrameStackError
from rlcollect.replay.frames import VERIFY_FIRST, frame_slots

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda, CUDA])]


@pytest.mark.parametrize("k", [1, 2, 4])
@pytest.mark.parametrize("capacity", [5, 40, 1000])
def test_stacks_come_back_bit_for_bit_across_episode_ends_and_wraps(k, capacity):
    streams = Streams(range(6), k=k, seed=capacity)
    buffer = ReplayBuffer(capacity, frame_stack=k, seed=1)
    serial = 0
    for size in streams.rng.integers(1, 60, 120):
        batch = streams.rows(int(size))
        batch["serial"] = torch.arange(serial, serial + int(size))
        serial += int(size)
        buffer.extend(batch)
        out = buffer.sample(64)
        check_stacks(out, k)
        # only rows of the newest capacity written, never one overwritten
        assert int(out["serial"].min()) >= serial - capacity
    assert buffer.written == serial and 0 < len(buffer) <= capacity


def test_a_full_buffer_of_long_episodes_holds_capacity_rows_and_samples_what_rows_would():
    """Episodes longer than 32 steps, batches of at most capacity / 32 rows: the frames
    hold every row, and with one seed a frame buffer and a row buffer sample the same
    rows, their stacks equal bit for bit."""
    streams = Streams(range(8), k=4, seed=3, lengths=lambda env, episode: 300 + 10 * env)
    frames, rows = ReplayBuffer(4096, frame_stack=4, seed=7), ReplayBuffer(4096, seed=7)
    for _ in range(50):
        batch = streams.rows(128)
        frames.extend(batch)
        rows.extend(batch)
    assert len(frames) == len(rows) == 4096
    for n in (1, 32, 256):
        a, b = frames.sample(n), rows.sample(n)
        assert (a == b).all(), "another row, or another stack"


def test_streams_seen_mid_episode_restarted_or_idle_for_long_start_anew():
    streams = Streams(range(4), k=4, seed=5)
    buffer = ReplayBuffer(200, frame_stack=4, seed=0)
    streams.jump(2, 5)  # env 2 first seen at step 5 of its episode
    buffer.extend(streams.rows(50))
    check_stacks(buffer.sample(200), 4)
    streams.restart(1)  # env 1 rebuilt: a new episode from step 0
    streams.jump(3, 2)  # env 3 skips two steps (a gap): its frames are stored anew
    buffer.extend(streams.rows(50))
    check_stacks(buffer.sample(200), 4)
    for _ in range(20):  # env 0 stands still while the others fill the frames, twice over
        buffer.extend(streams.rows(30, envs=[1, 2, 3]))
    buffer.extend(streams.rows(30))
    check_stacks(buffer.sample(300), 4)
    assert len(buffer) > 100  # the idle env's old frames did not take the window with them


def test_a_batch_larger_than_the_frame_ring_is_written_in_parts():
    streams = Streams(range(3), k=4, seed=2)
    buffer = ReplayBuffer(16, frame_stack=4, seed=0)
    batch = streams.rows(300)
    batch["serial"] = torch.arange(300)
    buffer.extend(batch)
    assert buffer.written == 300 and 0 < len(buffer) <= 16
    out = buffer.sample(100)
    check_stacks(out, 4)
    assert int(out["serial"].min()) >= 284


def test_paddings_are_told_from_the_rows_and_odd_ones_stored_whole():
    """Zeros, the first frame repeated, or something else (stored as its k frames)."""
    streams = Streams(range(3), k=3, seed=4, paddings={0: "zero", 1: "reset", 2: "zero"})
    buffer = ReplayBuffer(100, frame_stack=3, seed=0)
    batch = streams.rows(60)
    odd = (batch["env_index"] == 2) & (batch["step"] == 0)
    batch["observation"][odd, 0] = 7  # a start padded with 7s, not zeros: as given
    keep = batch.clone()
    buffer.extend(batch)
    out = buffer.sample(400)
    for i in range(400):  # the sampled rows are the rows given
        key = [int(out[k][i]) for k in ("env_index", "episode", "step")]
        match = (
            (keep["env_index"] == key[0]) & (keep["episode"] == key[1]) & (keep["step"] == key[2])
        )
        assert (out[i] == keep[match][0]).all()


def test_float_frames_with_nan_are_kept_bit_for_bit():
    streams = Streams(range(2), k=2, seed=6, dtype=np.float32)
    batch = streams.rows(30)
    for key in ("observation", ("next", "observation")):  # pixel 0x5A of every frame
        batch[key] = torch.where(batch[key] == 0x5A, float("nan"), batch[key])
    buffer = ReplayBuffer(50, frame_stack=2, seed=0)
    buffer.extend(batch)  # verification compares bits: a NaN equals itself there
    out = buffer.sample(200)
    for key in ("observation", ("next", "observation")):
        assert bool(torch.isnan(out[key][:, 1, 1, 2]).all())  # (the newest frames)
        out[key] = torch.nan_to_num(out[key], nan=0x5A)
    check_stacks(out, 2)


def test_memory_per_transition_is_one_frame_and_its_scalars():
    """Atari-sized rows (4 stacked 84x84 uint8): the storage laid out for a large
    capacity, without filling it, is at most 1.1 times one frame and the scalars per
    row, so 1M transitions take at most 8 GB (rows would take 56 GB)."""
    capacity = 1 << 16
    row = TensorDict(
        {
            "observation": torch.zeros(1, 4, 84, 84, dtype=torch.uint8),
            ("next", "observation"): torch.zeros(1, 4, 84, 84, dtype=torch.uint8),
            "action": torch.zeros(1, dtype=torch.int64),
            "env_index": torch.zeros(1, dtype=torch.int64),
            "episode": torch.zeros(1, dtype=torch.int64),
            "step": torch.zeros(1, dtype=torch.int64),
            "policy_version": torch.zeros(1, dtype=torch.int64),
            ("next", "reward"): torch.zeros(1),
            ("next", "terminated"): torch.zeros(1, dtype=torch.bool),
            ("next", "truncated"): torch.zeros(1, dtype=torch.bool),
            ("next", "done"): torch.zeros(1, dtype=torch.bool),
            ("next", "episode_return"): torch.zeros(1),
            ("next", "episode_length"): torch.zeros(1, dtype=torch.int64),
        },
        batch_size=[1],
    )
    buffer = ReplayBuffer(capacity, frame_stack=4)
    buffer.extend(row)
    scalars = sum(v[0].numel() * v.element_size() for k, v in row.items(True, True)) - 2 * 4 * 7056
    per_row = buffer.nbytes / capacity
    assert per_row <= 1.1 * (7056 + scalars), (per_row, scalars)
    # the layout is linear in capacity: the frames for a million rows, and the rest
    others = per_row - (frame_slots(capacity, 4) + 1) * 7056 / capacity
    million = (frame_slots(10**6, 4) + 1) * 7056 + 10**6 * others
    assert million <= 8e9 and million <= 1.1 * (7056 + scalars) * 10**6, million
    rows = ReplayBuffer(capacity)
    rows.extend(row)
    assert rows.nbytes / capacity >= 8 * 7056


def test_a_stack_on_another_axis_or_a_wrapper_that_changes_old_frames_is_refused():
    for make in (last_axis, fading):
        env, rows = make(3), []
        obs, _ = env.reset(seed=0)
        for t in range(6):
            nxt = env.step(0)[0]
            rows.append((obs, nxt, t))
            obs = nxt
        batch = TensorDict(
            {
                "observation": torch.from_numpy(np.stack([r[0] for r in rows])),
                ("next", "observation"): torch.from_numpy(np.stack([r[1] for r in rows])),
                "env_index": torch.full((6,), 3),
                "episode": torch.zeros(6, dtype=torch.int64),
                "step": torch.tensor([r[2] for r in rows]),
            },
            batch_size=[6],
        )
        buffer = ReplayBuffer(100, frame_stack=4)
        message = r"\('next', 'observation'\) of env 3 \(episode 0, step 0\) differs"
        with pytest.raises(FrameStackError, match=message) as info:
            buffer.extend(batch)
        assert isinstance(info.value, ValueError)
        assert len(buffer) == 0 and buffer.written == 0  # nothing of the batch was written


def test_bad_input_is_named():
    streams = Streams(range(2), k=4)
    batch = streams.rows(4)
    with pytest.raises(ValueError, match="frame_stack must be a positive int"):
        ReplayBuffer(10, frame_stack=0)
    with pytest.raises(ValueError, match=r"'observation' has rows of shape \[4, 3, 4\]"):
        ReplayBuffer(10, frame_stack=3).extend(batch)
    with pytest.raises(ValueError, match="needs an integer column 'episode'"):
        ReplayBuffer(10, frame_stack=4).extend(batch.exclude("episode"))
    with pytest.raises(ValueError, match="needs a tensor 'observation'"):
        ReplayBuffer(10, frame_stack=4).extend(batch.exclude("observation"))
    with pytest.raises(ValueError, match="env_index must be >= 0"):
        ReplayBuffer(10, frame_stack=4).extend(batch.set("env_index", -batch["env_index"] - 1))
    buffer = ReplayBuffer(10, frame_stack=4)
    buffer.extend(Streams(range(2), k=4).rows(4))
    other = Streams(range(2), k=4).rows(4)
    other["observation"] = other["observation"][:, :, :2]
    other["next", "observation"] = other["next", "observation"][:, :, :2]
    with pytest.raises(ValueError, match=r"frames \[2, 4\] torch.uint8, the buffer stores"):
        buffer.extend(other)
    assert "frame_stack=4" in repr(buffer)


def test_the_first_rows_of_each_env_every_episode_start_and_one_in_16_are_verified():
    """A wrong stack is always found in an env's first rows and at an episode's first
    step; past those, in about one row in 16 (the buffer's seeded choice)."""
    streams = Streams(range(2), k=4, seed=9)
    buffer = ReplayBuffer(1000, frame_stack=4, seed=0)
    batch = streams.rows(VERIFY_FIRST)  # both envs' first rows, all of them verified
    batch["next", "observation"][-1, 0] += 1
    with pytest.raises(FrameStackError, match=r"\('next', 'observation'\) of env"):
        buffer.extend(batch)
    batch["next", "observation"][-1, 0] -= 1
    buffer.extend(batch)
    buffer.extend(streams.rows(4 * VERIFY_FIRST))  # past every env's first rows
    caught = 0
    for _ in range(160):
        batch = streams.rows(10)
        starts = (batch["step"] == 0).nonzero().squeeze(1)
        if len(starts):  # an episode's first row: always verified
            bad = batch.clone()
            bad["next", "observation"][starts[0], 0] += 1
            with pytest.raises(FrameStackError, match=r"step 0\) differs"):
                buffer.extend(bad)
        later = (batch["step"] > 0).nonzero().squeeze(1)
        batch["observation"][later[0], 0] += 1  # one later row's oldest frame changed
        try:
            buffer.extend(batch)  # (that frame is not stored: unverified, it goes in)
        except FrameStackError:
            caught += 1
            batch["observation"][later[0], 0] -= 1
            buffer.extend(batch)
    assert 3 <= caught <= 25, caught  # 10 expected


def test_state_dict_round_trip_continues_identically():
    streams = Streams(range(5), k=4, seed=8)
    saved = ReplayBuffer(64, frame_stack=4, seed=3)
    for _ in range(10):
        saved.extend(streams.rows(17))
    state = saved.state_dict()
    assert state["frames"]["frame_stack"] == 4
    restored = ReplayBuffer(64, frame_stack=4)
    restored.load_state_dict(state)
    for _ in range(5):
        a, b = saved.sample(50), restored.sample(50)
        assert (a == b).all()
        check_stacks(b, 4)
        batch = streams.rows(11)
        saved.extend(batch)
        restored.extend(batch.clone())
    with pytest.raises(ValueError, match="state is for frame_stack=4, this buffer has None"):
        ReplayBuffer(64).load_state_dict(state)
    with pytest.raises(ValueError, match="state is for frame_stack=None, this buffer has 4"):
        rows = ReplayBuffer(64)
        rows.extend(streams.rows(3))
        ReplayBuffer(64, frame_stack=4).load_state_dict(rows.state_dict())


@pytest.mark.parametrize("where", DEVICES)
def test_concurrent_samplers_never_see_a_torn_or_stale_stack(where):
    """One writer, three samplers, rings of rows and of frames that wrap every few
    writes: every stack sampled is the one its env gave, and from a row still stored."""
    capacity, streams = 48, Streams(range(6), k=4, seed=11)
    buffer = ReplayBuffer(capacity, frame_stack=4, device=where, seed=0)
    done, failures, written = threading.Event(), [], [0]

    def batch(n):
        rows = streams.rows(n)
        rows["serial"] = torch.arange(written[0], written[0] + n)
        written[0] += n
        return rows.to(where)

    def writer():
        try:
            for i in range(300):
                assert buffer.wait_sampled(8 * i, timeout=30), "samplers stalled"
                buffer.extend(batch(1 + i % 23))
        except BaseException as e:
            failures.append(e)
        finally:
            done.set()

    def sampler():
        try:
            while not done.is_set():
                before = buffer.written
                out = buffer.sample(16)
                check_stacks(out, 4)
                if int(out["serial"].min()) < before - capacity:
                    failures.append("a row sampled after it was overwritten")
        except BaseException as e:
            failures.append(e)

    buffer.extend(batch(8))
    threads = [threading.Thread(target=sampler) for _ in range(3)]
    threads.append(threading.Thread(target=writer))
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a thread hung"
    assert failures == []
    assert buffer.written == written[0]


@pytest.mark.cuda
@CUDA
@pytest.mark.parametrize("where", ["cuda", "pinned"])
def test_cuda_and_pinned_storage_rebuild_the_stacks_where_they_are(where):
    """Stacks gathered on the device (or into page-locked memory), rows from host or
    device memory, and a state moved between devices samples on identically."""
    streams = Streams(range(5), k=4, seed=12)
    kwargs = {"pin_memory": True} if where == "pinned" else {"device": "cuda"}
    buffer = ReplayBuffer(64, frame_stack=4, seed=2, **kwargs)
    for i in range(12):
        batch = streams.rows(13)
        buffer.extend(batch.to("cuda") if i % 2 and where == "cuda" else batch)
    out = buffer.sample(128)
    if where == "cuda":
        assert out["observation"].is_cuda and out["next", "observation"].is_cuda
    else:
        assert out["observation"].is_pinned()
    check_stacks(out, 4)
    on_cpu = ReplayBuffer(64, frame_stack=4)
    on_cpu.load_state_dict(buffer.state_dict())
    for _ in range(3):
        a, b = buffer.sample(40), on_cpu.sample(40)
        assert torch.equal(a["observation"].cpu(), b["observation"])
        batch = streams.rows(9)
        buffer.extend(batch)
        on_cpu.extend(batch.clone())
