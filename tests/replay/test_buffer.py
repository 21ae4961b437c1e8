"""ReplayBuffer: layout, ring, sampling, state, errors, and the one-writer/many-samplers
protocol under real threads (CPU here; pinned and CUDA storage on a GPU machine)."""

import io
import subprocess
import sys
import threading
from collections import Counter
from contextlib import nullcontext

import pytest
import torch
from helpers import collect, counting_collector
from tensordict import TensorDict

from rlcollect import ReplayBuffer

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
DEVICES = [
    "cpu",
    pytest.param("pinned", marks=[pytest.mark.cuda, CUDA]),
    pytest.param("cuda", marks=[pytest.mark.cuda, CUDA]),
]


def make(capacity, where="cpu", **kwargs):
    if where == "pinned":
        return ReplayBuffer(capacity, pin_memory=True, **kwargs)
    return ReplayBuffer(capacity, device=where, **kwargs)


def rows(first, n, width=16):
    """Rows with serials first … first+n-1; every field, every element encodes the serial."""
    s = torch.arange(first, first + n, dtype=torch.int64)
    return TensorDict(
        {
            "serial": s,
            "pixels": (s % 256).to(torch.uint8)[:, None].repeat(1, width),
            "action": s.float()[:, None].repeat(1, 2),
            "next": {"observation": s.int()[:, None].repeat(1, 3), "done": s % 2 == 1},
        },
        batch_size=[n],
    )


def torn(td):
    """How many rows of ``td`` are not one row as written (a mix, or garbage)."""
    s = td["serial"].cpu()
    good = (td["pixels"].cpu() == (s % 256).to(torch.uint8)[:, None]).all(1)
    good &= (td["action"].cpu() == s.float()[:, None]).all(1)
    good &= (td["next", "observation"].cpu() == s.int()[:, None]).all(1)
    good &= td["next", "done"].cpu() == (s % 2 == 1)
    return int((~good).sum())


def stored(buffer):
    """Serials of the stored rows, oldest first, read from state_dict's unrolled ring."""
    state = buffer.state_dict()
    serial, cursor = state["storage"]["serial"], state["cursor"]
    return torch.cat([serial[cursor:], serial[:cursor]]).tolist()


def test_layout_on_first_write_keeps_keys_shapes_dtypes():
    buffer = ReplayBuffer(10, seed=0)
    assert len(buffer) == 0 and "keys=[]" in repr(buffer)
    buffer.extend(rows(0, 4, width=5))
    out = buffer.sample(6)
    assert out.batch_size == torch.Size([6]) and out.device == torch.device("cpu")
    expected = {
        "serial": ([6], torch.int64),
        "pixels": ([6, 5], torch.uint8),
        "action": ([6, 2], torch.float32),
        ("next", "observation"): ([6, 3], torch.int32),
        ("next", "done"): ([6], torch.bool),
    }
    leaves = out.keys(include_nested=True, leaves_only=True)
    assert set(leaves) == set(expected)
    for key, (shape, dtype) in expected.items():
        assert list(out[key].shape) == shape and out[key].dtype == dtype, key
    assert torn(out) == 0
    assert set(out["serial"].tolist()) <= {0, 1, 2, 3}
    storage = buffer.state_dict()["storage"]
    assert storage["next"]["observation"].shape == (4, 3)  # nested, as written
    assert len(buffer) == 4 and buffer.written == 4 and buffer.capacity == 10
    text = repr(buffer)
    assert "capacity=10" in text and "len=4" in text and "device=cpu" in text
    assert "next.observation" in text


def test_wraparound_overwrites_the_oldest_rows():
    buffer = ReplayBuffer(8)
    buffer.extend(rows(0, 5))
    assert stored(buffer) == [0, 1, 2, 3, 4]
    buffer.extend(rows(5, 6))  # 5, 6, 7 fill the end; 8, 9, 10 wrap over 0, 1, 2
    state = buffer.state_dict()
    assert state["storage"]["serial"].tolist() == [8, 9, 10, 3, 4, 5, 6, 7]
    assert state["cursor"] == 3 and state["size"] == 8
    assert stored(buffer) == list(range(3, 11))
    assert torn(TensorDict(state["storage"], batch_size=[8])) == 0
    assert len(buffer) == 8 and buffer.written == 11


def test_batch_larger_than_capacity_keeps_its_newest_rows():
    buffer = ReplayBuffer(8)
    buffer.extend(rows(0, 3))
    buffer.extend(rows(3, 20))
    assert stored(buffer) == list(range(15, 23))
    assert len(buffer) == 8 and buffer.written == 23
    buffer.extend(rows(23, 2))
    assert stored(buffer) == list(range(17, 25))


def test_empty_batch_changes_nothing():
    buffer = ReplayBuffer(4)
    buffer.extend(rows(0, 0))
    assert len(buffer) == 0 and buffer.written == 0 and "keys=[]" in repr(buffer)
    buffer.extend(rows(0, 3))
    buffer.extend(rows(3, 0))
    assert stored(buffer) == [0, 1, 2] and buffer.written == 3
    with pytest.raises(TypeError, match=r"'serial' has dtype torch\.int32"):
        buffer.extend(rows(3, 0).apply(lambda t: t.int() if t.dtype == torch.int64 else t))


def test_rows_that_require_grad_are_stored_as_plain_data():
    buffer = ReplayBuffer(4)
    batch = rows(0, 3)
    batch["action"] = batch["action"].requires_grad_()
    buffer.extend(batch)
    out = buffer.sample(5)
    assert not out["action"].requires_grad and out["action"].grad_fn is None
    assert torn(out) == 0


def test_sample_covers_exactly_the_stored_rows_uniformly():
    buffer = ReplayBuffer(16, seed=1)
    for first in range(0, 40, 5):
        buffer.extend(rows(first, 5))
    out = buffer.sample(16_000)
    assert torn(out) == 0
    counts = Counter(out["serial"].tolist())
    assert set(counts) == set(range(24, 40))
    assert all(800 < c < 1200 for c in counts.values()), counts  # 1000 each expected
    assert buffer.sampled == 16_000


def test_seed_makes_samples_reproducible():
    def draws(seed):
        buffer = ReplayBuffer(32, seed=seed)
        buffer.extend(rows(0, 40))
        return torch.cat([buffer.sample(n)["serial"] for n in (1, 7, 50)])

    assert torch.equal(draws(5), draws(5))
    assert not torch.equal(draws(5), draws(6))


def round_trip(state):
    stream = io.BytesIO()
    torch.save(state, stream)
    stream.seek(0)
    return torch.load(stream, weights_only=True)


@pytest.mark.parametrize("fill", [5, 29], ids=["partly-full", "wrapped"])
def test_state_dict_round_trip_continues_identically(fill):
    original = ReplayBuffer(12, seed=3)
    original.extend(rows(0, fill))
    original.sample(9)
    restored = ReplayBuffer(12, seed=77)
    restored.extend(rows(500, 3, width=4))  # a different layout is replaced
    restored.load_state_dict(round_trip(original.state_dict()))
    for b in (original, restored):
        assert b.written == fill and b.sampled == 9 and len(b) == min(fill, 12)
    assert repr(restored) == repr(original)
    for step in range(4):
        a, b = original.sample(20), restored.sample(20)
        assert torch.equal(a["serial"], b["serial"]) and torn(b) == 0
        original.extend(rows(fill + 7 * step, 7))
        restored.extend(rows(fill + 7 * step, 7))
    assert stored(original) == stored(restored)


def test_state_dict_of_an_empty_buffer():
    original = ReplayBuffer(4, seed=0)
    restored = ReplayBuffer(4)
    restored.load_state_dict(round_trip(original.state_dict()))
    with pytest.raises(ValueError, match="empty"):
        restored.sample(1)
    original.extend(rows(0, 3))
    restored.extend(rows(0, 3))
    assert torch.equal(original.sample(10)["serial"], restored.sample(10)["serial"])


def test_load_state_dict_refuses_other_capacity_and_inconsistent_state():
    state = ReplayBuffer(4).state_dict()
    with pytest.raises(ValueError, match="capacity 4, this buffer has 5"):
        ReplayBuffer(5).load_state_dict(state)
    buffer = ReplayBuffer(4)
    buffer.extend(rows(0, 2))
    with pytest.raises(ValueError, match="cursor 1, size 2"):
        ReplayBuffer(4).load_state_dict({**buffer.state_dict(), "cursor": 1})


def test_extend_names_a_mismatched_key_shape_or_dtype():
    buffer = ReplayBuffer(8)
    buffer.extend(rows(0, 3))
    bad = rows(3, 2)
    del bad["next", "done"]
    with pytest.raises(ValueError, match=r"missing \[\('next', 'done'\)\], extra \[\]"):
        buffer.extend(bad)
    bad = rows(3, 2).set("extra", torch.zeros(2))
    with pytest.raises(ValueError, match=r"missing \[\], extra \['extra'\]"):
        buffer.extend(bad)
    with pytest.raises(ValueError, match=r"'pixels' has rows of shape \[9\], the buffer stores"):
        buffer.extend(rows(3, 2, width=9))
    bad = rows(3, 2).set(("next", "observation"), torch.zeros(2, 3))
    with pytest.raises(TypeError, match=r"\('next', 'observation'\) has dtype torch.float32"):
        buffer.extend(bad)
    assert stored(buffer) == [0, 1, 2] and buffer.written == 3  # nothing half-written


def test_bad_arguments_are_named():
    with pytest.raises(TypeError, match="needs a TensorDict, got dict"):
        ReplayBuffer(4).extend({"a": torch.zeros(2)})
    with pytest.raises(ValueError, match=r"one-dim batch \[n\], got batch_size \[2, 3\]"):
        ReplayBuffer(4).extend(TensorDict({"a": torch.zeros(2, 3)}, batch_size=[2, 3]))
    text = TensorDict({"a": torch.zeros(2)}, batch_size=[2])
    text.set_non_tensor("note", "hello")
    with pytest.raises(TypeError, match="'note' holds non-tensor data"):
        ReplayBuffer(4).extend(text)
    for capacity in (0, -1, True, 2.0):
        with pytest.raises(ValueError, match="capacity must be a positive int"):
            ReplayBuffer(capacity)
    with pytest.raises(ValueError, match="seed must be an int"):
        ReplayBuffer(4, seed="1")
    with pytest.raises(ValueError, match="device must be the CPU or a CUDA device, got meta"):
        ReplayBuffer(4, device="meta")
    with pytest.raises(ValueError, match="pin_memory=True needs device='cpu'"):
        ReplayBuffer(4, device="cuda", pin_memory=True)
    buffer = ReplayBuffer(4)
    with pytest.raises(ValueError, match="the buffer is empty"):
        buffer.sample(1)
    buffer.extend(rows(0, 2))
    for size in (0, -3, 1.5, True):
        with pytest.raises(ValueError, match="batch_size must be a positive int"):
            buffer.sample(size)
    with pytest.raises(ValueError, match="timeout must be >= 0"):
        buffer.wait_sampled(1, -1.0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error where CUDA is absent")
def test_cuda_requests_without_cuda_are_refused():
    with pytest.raises(ValueError, match="pin_memory=True needs CUDA"):
        ReplayBuffer(4, pin_memory=True)
    with pytest.raises(ValueError, match="device=cuda needs CUDA"):
        ReplayBuffer(4, device="cuda")


def test_wait_sampled_wakes_when_a_sampler_thread_reaches_the_target():
    buffer = ReplayBuffer(8)
    buffer.extend(rows(0, 8))
    assert not buffer.wait_sampled(1, timeout=0.01)  # nothing sampled yet
    assert buffer.wait_sampled(0, timeout=0)
    go = threading.Event()
    results = []
    returned = threading.Event()

    def waiter():  # a long timeout: it returns in time only if sample() wakes it
        results.append(buffer.wait_sampled(20, timeout=60))
        returned.set()

    def sampler():
        assert go.wait(timeout=10)
        for _ in range(5):
            buffer.sample(4)

    threads = [threading.Thread(target=waiter), threading.Thread(target=sampler)]
    for t in threads:
        t.start()
    buffer.sample(3)  # 3 < 20: the waiter keeps waiting
    assert not returned.is_set()
    go.set()
    assert returned.wait(timeout=10)
    for t in threads:
        t.join(timeout=10)
    assert results == [True] and buffer.sampled == 23
    assert not buffer.wait_sampled(24, timeout=0.01)


def on_own_stream(where):
    """A fresh CUDA stream for this thread where the storage is on the GPU."""
    return torch.cuda.stream(torch.cuda.Stream()) if where == "cuda" else nullcontext()


@pytest.mark.parametrize("where", DEVICES)
def test_concurrent_samplers_never_see_a_torn_or_stale_row(where):
    """One writer thread, three sampler threads, a small ring: every row the samplers get
    is one whole row (4096 pixel bytes and every other field agree) and was stored. On
    CUDA each thread has its own stream and the writer copies from device memory, so
    only the events order the copies and the gathers."""
    capacity, writes, sizes = 64, 400, [1, 7, 33, 64, 100, 5, 20]
    buffer = make(capacity, where, seed=0)
    source = "cuda" if where == "cuda" else "cpu"
    buffer.extend(rows(0, 8, width=4096))
    done = threading.Event()
    failures, batches = [], Counter()

    def writer():
        try:
            with on_own_stream(where):
                first = 8
                for i in range(writes):
                    # interleave with the samplers, as a train-ratio throttle would
                    assert buffer.wait_sampled(8 * i, timeout=30), "samplers stalled"
                    n = sizes[i % len(sizes)]
                    buffer.extend(rows(first, n, width=4096).to(source))
                    first += n
        except BaseException as e:
            failures.append(e)
        finally:
            done.set()

    def sampler(name):
        try:
            with on_own_stream(where):
                while not done.is_set():
                    before = buffer.written
                    out = buffer.sample(16)
                    after = buffer.written
                    s = out["serial"].cpu()
                    bad = torn(out)
                    stale = int(((s < before - capacity) | (s >= after)).sum())
                    if bad or stale:
                        failures.append(f"{name}: {bad} torn and {stale} stale rows")
                    batches[name] += 1
        except BaseException as e:
            failures.append(e)

    threads = [threading.Thread(target=sampler, args=(f"s{i}",)) for i in range(3)]
    threads.append(threading.Thread(target=writer))
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a thread hung"
    assert failures == []
    assert buffer.written == 8 + sum(sizes[i % len(sizes)] for i in range(writes))
    assert buffer.sampled == 16 * sum(batches.values()) >= 8 * (writes - 1)
    assert len(batches) == 3


def test_feeds_from_a_collector():
    buffer = ReplayBuffer(100, seed=0)
    with counting_collector("thread", replay_buffer=buffer, total_frames=320) as c:
        data = collect(c)
    assert buffer.written == 320 and len(buffer) == 100
    state = buffer.state_dict()
    storage = TensorDict(state["storage"], batch_size=[100])
    cursor = state["cursor"]
    newest = torch.cat([storage[cursor:], storage[:cursor]])
    assert (newest == data[-100:]).all()


def test_needs_no_torchrl():
    """ReplayBuffer works where torchrl cannot even be imported."""
    script = (
        "import sys\n"
        "sys.modules['torchrl'] = None\n"  # any `import torchrl` now raises ImportError
        "import torch\n"
        "from tensordict import TensorDict\n"
        "from rlcollect import ReplayBuffer\n"
        "b = ReplayBuffer(4, seed=0)\n"
        "b.extend(TensorDict({'a': torch.arange(6)}, batch_size=[6]))\n"
        "assert sorted(b.sample(50)['a'].unique().tolist()) == [2, 3, 4, 5]\n"
        "assert not [m for m in sys.modules if m.startswith('torchrl') and sys.modules[m]]\n"
        "print('ok')\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr


@pytest.mark.cuda
@CUDA
def test_pinned_storage_returns_pinned_samples():
    buffer = ReplayBuffer(8, pin_memory=True, seed=0)
    buffer.extend(rows(0, 10))
    out = buffer.sample(32)
    assert out["pixels"].is_pinned() and out["next", "observation"].is_pinned()
    assert torn(out) == 0 and set(out["serial"].tolist()) <= set(range(2, 10))
    assert torn(out.to("cuda", non_blocking=True)) == 0


@pytest.mark.cuda
@CUDA
def test_cuda_storage_and_state_across_devices():
    buffer = ReplayBuffer(16, device="cuda", seed=2)
    assert buffer.device == torch.device("cuda", torch.cuda.current_device())
    buffer.extend(rows(0, 10))  # from host memory
    buffer.extend(rows(10, 10).to("cuda"))  # from device memory
    out = buffer.sample(64)
    assert out.device == buffer.device and out["pixels"].is_cuda and torn(out) == 0
    assert stored(buffer) == list(range(4, 20))
    on_cpu = ReplayBuffer(16, seed=9)
    on_cpu.load_state_dict(round_trip(buffer.state_dict()))
    back = ReplayBuffer(16, device="cuda", seed=9)
    back.load_state_dict(on_cpu.state_dict())
    for _ in range(3):
        a, b, c = buffer.sample(40), on_cpu.sample(40), back.sample(40)
        assert torch.equal(a["serial"].cpu(), b["serial"]) and torn(c) == 0
        assert torch.equal(a["serial"], c["serial"])
        for each in (buffer, on_cpu, back):
            each.extend(rows(each.written, 5))
