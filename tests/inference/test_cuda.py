"""The GPU path on a real GPU (skipped where CUDA is absent; run on the device).

Eager, compiled and CUDA-graphed action steps; page-locked transfers; weight updates
reaching captured graphs; policies that write their own inputs.
"""

import functools

import gymnasium as gym
import numpy as np
import pytest
import torch
from helpers import (
    CUDA_MODES,
    CUDA_ONLY,
    ConstantPolicy,
    CountingPolicy,
    biased_actor,
    check_clean,
    check_counting_streams,
    check_weight_update,
    collect,
    counting_collector,
    counting_envs,
    cuda_collector,
    first_error_within_bound,
    plain_runner,
    respond_raising_after,
    sampled_share,
    step_fields,
    streams,
)
from tensordict.nn import TensorDictModule, TensorDictSequential

from rlcollect import AsyncBatchedCollector, InferenceError
from rlcollect.inference.step import DeviceStep, buckets_for
from rlcollect.testing import CountingVectorEnv
from rlcollect.transports import ProcessSlotTransport

pytestmark = CUDA_ONLY


class DevicePolicy(CountingPolicy):
    """Records the device it ran on, so the test sees the forward happen on the GPU."""

    def forward(self, obs):
        out = super().forward(obs)
        out["on_cuda"] = torch.full_like(out["value"], float(obs.is_cuda and self.scale.is_cuda))
        return out


@pytest.mark.parametrize("mode", list(CUDA_MODES))
def test_every_mode_keeps_every_invariant(transport, mode):
    with cuda_collector(transport, DevicePolicy(), envs_per_worker=2, **CUDA_MODES[mode]) as c:
        data = collect(c)
        stats = c.stats()["server"]
    assert data["observation"].device.type == "cpu"
    assert bool((data["on_cuda"] == 1).all())
    check_counting_streams(data)
    copies = stats["phase_seconds"]["h2d"], stats["phase_seconds"]["d2h"]
    if CUDA_MODES[mode].get("cuda_graph"):  # one replay holds the copies: timed as forward
        assert copies == (0, 0)
    else:
        assert min(copies) > 0
    assert stats["phase_seconds"]["forward"] > 0
    assert stats["gathers_on_device"], "the ring was not page-locked for a GPU-side gather"
    assert 0 < stats["request_latency_p50"] <= stats["request_latency_p95"]


def test_default_device_is_cuda_when_present():
    with AsyncBatchedCollector(
        counting_envs(2), CountingPolicy(), frames_per_batch=8, total_frames=16, transport="thread"
    ) as c:
        assert c.policy_device.type == "cuda"
        list(c)


# ---------------------------------------------------------------- the step, unit by unit


class ConvPolicy(torch.nn.Module):
    """A small Nature-style CNN, deterministic: argmax of its logits."""

    def __init__(self, sample=False):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(
            torch.nn.Conv2d(4, 16, 8, stride=4),
            torch.nn.ReLU(),
            torch.nn.Conv2d(16, 32, 4, stride=2),
            torch.nn.ReLU(),
            torch.nn.Flatten(),
            torch.nn.Linear(32 * 9 * 9, 6),
        )
        self.sample = sample

    def forward(self, obs):
        logits = self.net(obs.float() / 255.0)
        if self.sample:  # Gumbel-max: a capturable categorical sample
            u = torch.rand_like(logits).clamp_(1e-9, 1.0)
            logits = logits - torch.log(-torch.log(u))
        return {"action": logits.argmax(-1), "logits": logits}


def conv_step(policy, capacity=64, **kwargs):
    runner = plain_runner(policy, torch.device("cuda"))
    obs, outputs = step_fields(((4, 84, 84), np.uint8), {("logits",): ((6,), np.float32)})
    return DeviceStep(runner, obs, outputs, capacity, compile_options=None, **kwargs)


def test_graph_and_eager_give_identical_actions_at_every_bucket_size():
    eager, graph = (
        conv_step(ConvPolicy(), cuda_graph=False),
        conv_step(ConvPolicy(), cuda_graph=True),
    )
    rng = np.random.default_rng(0)
    for size in buckets_for(64):
        frames = rng.integers(0, 256, (size, 4, 84, 84), dtype=np.uint8)
        for step in (eager, graph):
            step.inputs[()][:size] = frames
        a, _ = eager.run(size)
        a = {k: v.copy() for k, v in a.items()}
        b, _ = graph.run(size)
        assert np.array_equal(a[("action",)], b[("action",)]), f"actions differ at batch {size}"
        assert np.array_equal(a[("logits",)], b[("logits",)]), f"logits differ at batch {size}"


def test_padded_rows_do_not_leak_into_a_smaller_batch():
    graph = conv_step(ConvPolicy(), cuda_graph=True)
    rng = np.random.default_rng(1)
    frames = rng.integers(0, 256, (5, 4, 84, 84), dtype=np.uint8)
    graph.inputs[()][:5] = frames
    full = {k: v.copy() for k, v in graph.run(5)[0].items()}  # replays the graph of 8
    graph.inputs[()][:3] = frames[:3]
    part = graph.run(3)[0]  # replays the graph of 4: rows 3 are stale padding
    assert part[("action",)].shape == (3,)
    assert np.array_equal(part[("logits",)], full[("logits",)][:3])


def test_sampling_inside_a_graph_stays_random():
    step = conv_step(ConvPolicy(sample=True), cuda_graph=True, capacity=256)
    step.inputs[()][:256] = 7  # the same observation in every row, every replay
    seen = np.concatenate([step.run(256)[0][("action",)].copy() for _ in range(20)])
    counts = np.bincount(seen, minlength=6)
    assert (counts > 0).sum() >= 2, f"graph replays keep drawing the same sample: {counts}"
    first, second = step.run(256)[0][("action",)].copy(), step.run(256)[0][("action",)].copy()
    assert not np.array_equal(first, second), "two replays drew identical samples"


# ---------------------------------------------------------------- weights and inputs


@pytest.mark.parametrize("mode", ["graph", "compiled+graph"])
def test_weight_updates_reach_captured_graphs(mode):
    check_weight_update(
        lambda policy: cuda_collector(
            policy=policy, total_frames=-1, frames_per_batch=40, **CUDA_MODES[mode]
        )
    )


class WritesItsInput(CountingPolicy):
    """Computes its action, then scribbles over its input tensor in place."""

    def forward(self, obs):
        out = super().forward(obs)
        obs.mul_(0).add_(3)
        return out


def test_a_policy_writing_its_input_in_place_never_reads_stale_inputs(transport):
    with cuda_collector(transport, WritesItsInput(), cuda_graph=True, total_frames=2000) as c:
        data = collect(c)
    check_counting_streams(data)  # every action matches its own fresh observation


def test_a_tensordict_policy_overwriting_its_observation_key():
    scale = TensorDictModule(lambda o: o * 2, in_keys=["observation"], out_keys=["observation"])
    act = TensorDictModule(
        lambda o: ((o[:, 0] * 7 + o[:, 1] * 3 + o[:, 2]) // 2) % 5,
        in_keys=["observation"],
        out_keys=["action"],
    )
    # the second module reads the doubled observation and halves it back: the counting
    # action of the raw one, provided no replay ever reads a stale observation
    policy = TensorDictSequential(scale, act)
    with cuda_collector(policy=policy, cuda_graph=True, total_frames=2000) as c:
        data = collect(c)
    obs = data["observation"]
    assert torch.equal(data["action"], (obs[:, 0] * 7 + obs[:, 1] * 3 + obs[:, 2]) % 5)


def test_an_uncapturable_policy_fails_at_construction_with_a_clear_error():
    class Syncs(CountingPolicy):
        def forward(self, obs):
            if obs.sum().item() < 0:  # a host sync: cannot be captured
                raise AssertionError
            return super().forward(obs)

    with pytest.raises(ValueError, match="capturing the action step as a CUDA graph"):
        cuda_collector(policy=Syncs(), cuda_graph=True)


def test_gathering_on_the_device_matches_the_host_gather():
    import mmap

    rows = 80
    storage = mmap.mmap(-1, rows * 4 * 84 * 84)
    ring = np.frombuffer(storage, dtype=np.uint8).reshape(rows, 4, 84, 84)
    ring[...] = np.random.default_rng(2).integers(0, 256, ring.shape, dtype=np.uint8)
    flat = np.array([15, 14, 7, 6, 79, 0, 1, 24, 25, 3])  # any rows, in any order
    results = []
    for register in (True, False):
        step = conv_step(ConvPolicy(), cuda_graph=True)
        step.attach({(): ring}, register=register)
        assert step.gathers_on_device == register
        n = step.load(flat)
        assert n == 10
        results.append({k: v.copy() for k, v in step.run(n)[0].items()})
        step.close()
    assert np.array_equal(results[0][("logits",)], results[1][("logits",)])
    direct = conv_step(ConvPolicy(), cuda_graph=True)
    direct.inputs[()][:10] = ring[flat]
    assert np.array_equal(direct.run(10)[0][("logits",)], results[0][("logits",)])


def test_a_ring_that_cannot_be_page_locked_is_gathered_on_the_host():
    """A second step bound to a ring already page-locked (by the first) is refused the
    page-locking; it gathers on the host, and the refusal leaves no CUDA error behind
    for the next launch to report as its own."""
    import mmap

    rows = 16
    storage = mmap.mmap(-1, rows * 4 * 84 * 84)
    ring = np.frombuffer(storage, dtype=np.uint8).reshape(rows, 4, 84, 84)
    ring[...] = np.random.default_rng(3).integers(0, 256, ring.shape, dtype=np.uint8)
    first = conv_step(ConvPolicy(), cuda_graph=True)
    second = conv_step(ConvPolicy(), cuda_graph=False)
    first.attach({(): ring})
    second.attach({(): ring})
    assert first.gathers_on_device and not second.gathers_on_device
    flat = np.array([3, 1, 4, 15, 9, 2, 6])
    outputs = []
    for step in (first, second):
        n = step.load(flat)
        outputs.append(step.run(n)[0][("logits",)].copy())
    torch.cuda.synchronize()  # a left-over error would surface here at the latest
    assert np.array_equal(outputs[0], outputs[1])
    first.close()
    second.close()


def test_the_whole_step_graph_serves_batches_of_every_size_in_any_order():
    """Batches of changing sizes through the one-replay graphs (page-locked ring), each
    against the same rows through the separate launches (ring not page-locked): the
    padded tail of the index, left from a larger batch, changes nothing."""
    import mmap

    rows = 96
    storage = mmap.mmap(-1, rows * 4 * 84 * 84)
    ring = np.frombuffer(storage, dtype=np.uint8).reshape(rows, 4, 84, 84)
    ring[...] = np.random.default_rng(4).integers(0, 256, ring.shape, dtype=np.uint8)
    whole, launches = (
        conv_step(ConvPolicy(), cuda_graph=True),
        conv_step(ConvPolicy(), cuda_graph=True),
    )
    whole.attach({(): ring})
    launches.attach({(): ring}, register=False)
    rng = np.random.default_rng(5)
    for n in (64, 3, 17, 1, 32, 64, 5):
        flat = rng.choice(rows, n, replace=False)
        got, times = whole.run(whole.load(flat))
        want = launches.run(launches.load(flat))[0]
        assert times == (0.0, 0.0)  # the copies ran inside the one replay
        for key in want:
            assert got[key].shape[0] == n
            assert np.array_equal(got[key], want[key]), (n, key)
    whole.close()
    launches.close()


@pytest.mark.parametrize("backend", ["thread", "process"])
def test_weights_change_only_between_whole_step_replays(backend):
    """Twenty updates into the whole-step graph while it serves two splits per
    worker: every row's action is its stamped version's weights, none a mix, and each
    env's versions never go back."""
    policy = ConstantPolicy(0)
    with cuda_collector(
        "process_slots",
        policy,
        n=8,
        envs_per_worker=2,
        worker_splits=2,
        frames_per_batch=16,
        total_frames=-1,
        cuda_graph=True,
        inference_backend=backend,
    ) as c:
        batches = [next(c) for _ in range(3)]
        for version in range(1, 21):
            with torch.no_grad():
                policy.value.fill_(version % 5)  # CountingEnv takes actions 0-4
            assert c.update_policy_weights_(policy) == version
            batches += [next(c) for _ in range(4)]
    data = torch.cat(batches)
    assert torch.equal(data["action"], data["policy_version"] % 5)
    assert int(data["policy_version"].max()) >= 10  # updates reached the served policy
    for rows in streams(data).values():
        assert bool((rows["policy_version"].diff() >= 0).all())


def test_a_failure_serving_the_whole_step_graph_reaches_the_caller():
    """respond() failing mid-run with the ring page-locked for the whole-step graph: the
    InferenceError reaches the caller within a bound, and nothing is left running."""
    c = cuda_collector(
        respond_raising_after(ProcessSlotTransport, 200),
        CountingPolicy(),
        total_frames=-1,
        cuda_graph=True,
    )
    error = first_error_within_bound(c)
    assert isinstance(error, InferenceError), repr(error)
    assert "OSError: respond failed on purpose" in str(error)
    check_clean(c)


class Echo(torch.nn.Module):
    """Returns its observation unchanged: the step's output is what it gathered."""

    def forward(self, obs):
        return {"action": obs.reshape(obs.shape[0], -1)[:, 0].long(), "echo": obs.clone()}


@pytest.mark.parametrize(
    ("shape", "dtype", "offset"),
    [
        ((4, 84, 84), np.uint8, 0),  # frame stacks
        ((3,), np.float32, 0),  # 12-byte rows
        ((3,), np.int16, 0),  # 6-byte rows
        ((5,), np.uint8, 0),  # 5-byte rows
        ((8,), np.uint8, 4),  # a ring that does not start on an 8-byte boundary
    ],
)
def test_the_device_gather_reads_exact_rows_of_any_field(shape, dtype, offset):
    import mmap

    rows = 40
    item = np.dtype(dtype)
    row_bytes = int(np.prod(shape)) * item.itemsize
    storage = mmap.mmap(-1, offset + rows * row_bytes)
    ring = np.frombuffer(storage, dtype=dtype, offset=offset).reshape(rows, *shape)
    ring[...] = np.random.default_rng(3).integers(0, 100, ring.shape).astype(dtype)
    obs, outputs = step_fields((shape, item), {("echo",): (shape, item)})
    runner = plain_runner(Echo(), torch.device("cuda"))
    step = DeviceStep(runner, obs, outputs, 16, compile_options=None, cuda_graph=True)
    step.attach({(): ring})
    assert step.gathers_on_device
    flat = np.array([39, 0, 17, 16, 5, 38, 2])
    out = step.run(step.load(flat))[0]
    step.close()
    assert np.array_equal(out[("echo",)], ring[flat])


@pytest.mark.parametrize("mode", ["eager", "graph"])
def test_the_process_backend_on_the_gpu(mode):
    with cuda_collector(
        "process_slots", DevicePolicy(), inference_backend="process", **CUDA_MODES[mode]
    ) as c:
        data = collect(c)
        stats = c.stats()["server"]
    assert bool((data["on_cuda"] == 1).all())
    assert stats["gathers_on_device"]
    check_counting_streams(data)
    check_weight_update(
        lambda p: cuda_collector(
            "process_slots", p, total_frames=-1, inference_backend="process", **CUDA_MODES[mode]
        )
    )


def vector_factories():
    """Two send/recv vector envs of 4 sub-envs, results for 2 at a time (staged requests)."""
    return [functools.partial(CountingVectorEnv, 4 * i, 4, 2, order_seed=i) for i in range(2)]


@pytest.mark.parametrize("envs", ["plain", "vector"])
@pytest.mark.parametrize("mode", ["eager", "graph"])
def test_the_policy_in_each_worker_on_the_gpu(transport, mode, envs):
    """inference_backend="worker" with the policy on the GPU: each worker runs the
    server's action step over its own part of the ring; every invariant holds, and
    weight updates reach its captured graphs."""

    def make(policy, total_frames=640):
        common = dict(
            transport=transport,
            policy_device="cuda",
            inference_backend="worker",
            frames_per_batch=32,
            total_frames=total_frames,
            **CUDA_MODES[mode],
        )
        if envs == "vector":
            return AsyncBatchedCollector(vector_factories(), policy, **common)
        return AsyncBatchedCollector(counting_envs(4), policy, envs_per_worker=2, **common)

    if transport == "thread" and mode == "graph":  # refused: captures in two threads
        with pytest.raises(ValueError, match="needs worker processes"):
            make(DevicePolicy())
        return
    with make(DevicePolicy()) as c:
        data = collect(c)
        assert c.stats()["server"]["batches"] > 0
    assert bool((data["on_cuda"] == 1).all())
    check_counting_streams(data)
    check_weight_update(lambda p: make(p, total_frames=-1))


def test_an_uncapturable_policy_fails_in_the_inference_process_with_a_clear_error():
    class Syncs(CountingPolicy):
        def forward(self, obs):
            out = super().forward(obs)
            if out["value"].sum().item() > -1:  # a host synchronisation: not capturable
                return out
            return out

    with pytest.raises(ValueError, match="the policy failed in the inference process"):
        cuda_collector("process_slots", Syncs(), inference_backend="process", cuda_graph=True)


@pytest.mark.parametrize("backend", ["thread", "process"])
@pytest.mark.parametrize("mode", ["eager", "graph"])
def test_on_policy_rollouts_with_graphs_use_one_version_per_batch(mode, backend):
    # The round gate (collector/batches/rounds.py) with weights updated in place into captured
    # graphs: every row of batch k carries the tag of the k-th update.
    from helpers import TaggedPolicy

    policy = TaggedPolicy(0)
    with counting_collector(
        "process_slots",
        policy,
        4,
        policy_device="cuda",
        frames_per_batch=4 * 8,
        total_frames=4 * 8 * 5,
        on_policy=True,
        inference_backend=backend,
        envs_per_worker=2,
        worker_splits=2,
        **CUDA_MODES[mode],
    ) as c:
        batches = []
        for k, batch in enumerate(c):
            assert batch.batch_size == (4, 8)
            assert bool((batch["policy_version"] == k).all())
            assert bool((batch["tag"] == k).all())
            batches.append(batch.reshape(-1))
            with torch.no_grad():
                policy.tag.fill_(k + 1)
            c.update_policy_weights_(policy)
    check_counting_streams(torch.cat(batches))


@pytest.mark.parametrize(
    ("mode", "backend"),
    [("eager", "thread"), ("graph", "thread"), ("compiled+graph", "thread"), ("graph", "process")],
)
def test_a_probabilistic_actor_samples_in_graphs_and_compiled_code(mode, backend):
    pytest.importorskip("torchrl")  # a dev dependency; a GPU machine may lack it
    # The exploration type is in force while the step is compiled and captured: a graph
    # captured under the default (deterministic) type would replay argmax for good.
    for kind in ("random", "deterministic"):
        with AsyncBatchedCollector(
            [functools.partial(gym.make, "CartPole-v1")] * 4,
            biased_actor(),
            frames_per_batch=200,
            total_frames=400,
            policy_device="cuda",
            inference_backend=backend,
            exploration_type=kind,
            **CUDA_MODES[mode],
        ) as c:
            action = torch.cat([b["action"] for b in c])
        share = sampled_share(action)
        assert (0.15 < share < 0.4) if kind == "random" else share == 0.0, (kind, share)
