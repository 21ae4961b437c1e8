"""Recurrent policies on a real GPU (skipped where CUDA is absent; run on the device).

The state store's gather, reset and write-back run on the device, inside the CUDA graph
with ``cuda_graph=True`` (both graphs: the separate launches, and the one replay that
also holds the index upload and the gather from the page-locked ring), and around the
compiled policy with ``compile=True``. Padded rows of a graphed batch must never touch
an env's state: batch sizes vary here (``max_batch_size``, ``worker_splits``, several
workers), so most batches are padded.
"""

import mmap

import numpy as np
import pytest
import torch
from helpers import (
    CUDA_MODES,
    CUDA_ONLY,
    RecurrentCountingPolicy,
    check_counting_streams,
    check_recurrent_streams,
    check_state_kept_across_updates,
    check_vector_sub_envs_own_their_state,
    collect,
    cuda_collector,
    plain_runner,
    step_fields,
)

from rlcollect.inference import build_action_step

pytestmark = CUDA_ONLY


@pytest.mark.parametrize("mode", list(CUDA_MODES))
def test_every_mode_keeps_every_state_its_env_s(transport, mode):
    policy = RecurrentCountingPolicy()
    with cuda_collector(transport, policy, envs_per_worker=2, **CUDA_MODES[mode]) as c:
        data = collect(c)
        stats = c.stats()["server"]
    assert stats["gathers_on_device"], "the ring was not page-locked for a GPU-side gather"
    check_counting_streams(data)
    check_recurrent_streams(data)


@pytest.mark.parametrize("mode", ["graph", "compiled+graph"])
@pytest.mark.parametrize(
    "layout",
    [
        {"max_batch_size": 3, "min_batch_size": 3},  # padded to 4: a scratch row each
        {"envs_per_worker": 2, "worker_splits": 2, "min_batch_size": 3},
        {"n": 8, "max_batch_size": 5, "min_batch_size": 5},
    ],
)
def test_padded_replays_never_touch_an_env_s_state(transport, mode, layout):
    # batches wait for min_batch_size rows (up to 50 ms): sizes that are no power of two
    policy = RecurrentCountingPolicy()
    with cuda_collector(transport, policy, batch_timeout=0.05, **layout, **CUDA_MODES[mode]) as c:
        data = collect(c)
        sizes = c.stats()["server"]["batch_sizes"]
    check_counting_streams(data)
    check_recurrent_streams(data)
    assert any(size & (size - 1) for size in sizes), f"no padded batch: {sizes}"


def test_a_tensor_state_on_the_process_backend_with_a_graph():
    policy = RecurrentCountingPolicy(tensor_state=True)
    with cuda_collector("process_slots", policy, inference_backend="process", cuda_graph=True) as c:
        data = collect(c)
    check_counting_streams(data)
    check_recurrent_streams(data)


@pytest.mark.parametrize("mode", ["NextStep", "SameStep"])
def test_vector_env_sub_envs_own_their_state_in_a_graph(transport, mode):
    check_vector_sub_envs_own_their_state(transport, mode, policy_device="cuda", cuda_graph=True)


@pytest.mark.parametrize("mode", ["graph", "compiled+graph"])
def test_the_state_is_kept_across_weight_updates_in_a_graph(mode):
    policy = RecurrentCountingPolicy()
    c = cuda_collector(policy=policy, total_frames=-1, frames_per_batch=24, **CUDA_MODES[mode])
    check_state_kept_across_updates(c, policy, batches=30, min_version=10)


def test_a_new_state_on_another_device_fails_at_construction():
    class Elsewhere(RecurrentCountingPolicy):
        def forward(self, obs, state):
            out, new = super().forward(obs, state)
            return out, {k: v.cpu() for k, v in new.items()}

    with pytest.raises(ValueError, match=r"new_state\['count'\] is on cpu"):
        cuda_collector(policy=Elsewhere())


def test_an_uncapturable_recurrent_policy_fails_at_construction_with_a_clear_error():
    class Syncs(RecurrentCountingPolicy):
        def forward(self, obs, state):
            if state["count"].sum().item() < 0:  # a host sync: cannot be captured
                raise AssertionError
            return super().forward(obs, state)

    with pytest.raises(ValueError, match="capturing the action step as a CUDA graph"):
        cuda_collector(policy=Syncs(), cuda_graph=True)


# ---------------------------------------------------------------- the step, unit by unit


class GRUPolicy(torch.nn.Module):
    """Deterministic, float state: any state mixed up or reset late shows in the logits."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.cell = torch.nn.GRUCell(4, 8)
        self.head = torch.nn.Linear(8, 3)

    def initial_state(self):
        return {"h": torch.full((8,), 0.5)}

    def forward(self, obs, state):
        h = self.cell(obs, state["h"])
        logits = self.head(h)
        return {"action": logits.argmax(-1), "logits": logits}, {"h": h}


def gru_step(device, num_envs, **kwargs):
    runner = plain_runner(GRUPolicy(), device)
    obs, outputs = step_fields(
        ((4,), np.float32),
        {("logits",): ((3,), np.float32), ("recurrent_state", "h"): ((8,), np.float32)},
    )
    return build_action_step(runner, obs, outputs, capacity=16, num_envs=num_envs, **kwargs)


@pytest.mark.parametrize("register", [True, False])
@pytest.mark.parametrize("mode", ["eager", "graph", "compiled+graph"])
def test_graphed_state_steps_match_the_cpu_step_batch_for_batch(mode, register):
    """Batches of changing sizes over 12 envs, each env in at most one row of a batch,
    episodes starting at random: the graphed step (one replay with the ring page-locked,
    separate launches without) gives the CPU step's outputs and states, batch for batch."""
    num_envs, rows = 12, 48  # ring row r is env r % 12
    storage = mmap.mmap(-1, rows * 4 * 4)
    ring = np.frombuffer(storage, dtype=np.float32).reshape(rows, 4)
    rng = np.random.default_rng(0)
    ring[...] = rng.standard_normal(ring.shape, dtype=np.float32)
    is_init = np.zeros(rows, dtype=bool)
    options = dict(CUDA_MODES[mode])
    compile_options = {} if options.pop("compile", False) else None
    steps = [
        gru_step(torch.device("cpu"), num_envs),
        gru_step(torch.device("cuda"), num_envs, compile_options=compile_options, **options),
    ]
    for step in steps:
        step.states.bind(is_init, np.arange(rows) % num_envs)
    steps[0].attach({(): ring})
    steps[1].attach({(): ring}, register=register)
    for n in (16, 3, 5, 1, 12, 7, 16, 2, 9, 11, 4, 13):
        envs = rng.permutation(num_envs)[: min(n, num_envs)]
        flat = envs + num_envs * rng.integers(0, rows // num_envs, len(envs))
        is_init[:] = rng.random(rows) < 0.2
        results = []
        for step in steps:
            out, _ = step.run(step.load(flat))
            results.append({k: v.copy() for k, v in out.items()})
        for key in results[0]:
            np.testing.assert_allclose(results[1][key], results[0][key], rtol=1e-4, atol=1e-5)
        cpu_state = steps[0].states.states[("h",)][:num_envs]
        gpu_state = steps[1].states.states[("h",)][:num_envs].cpu()
        torch.testing.assert_close(gpu_state, cpu_state, rtol=1e-4, atol=1e-5)
    for step in steps:
        step.close()
