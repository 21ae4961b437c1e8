"""The served policy's random stream (inference/rng.py): seeded from the collector's
``seed``, the same in every run where batches are formed the same way, and kept apart
from the stream the rest of the process draws from."""

import pytest
import torch
from helpers import counting_envs, streams

from rlcollect import AsyncBatchedCollector


class Sampling(torch.nn.Module):
    """Samples actions 0-4 from fixed logits: every action is the policy's noise."""

    def __init__(self):
        super().__init__()
        self.logits = torch.nn.Parameter(torch.zeros(5))

    def forward(self, observation):  # Gumbel-max: capturable in a CUDA graph
        noise = torch.rand(observation.shape[0], 5, device=observation.device)
        return (self.logits - torch.log(-torch.log(noise))).argmax(dim=-1)


def actions(seed, transport="process_slots", n=4, **kwargs):
    """Each env's actions in step order. One worker holds every env, so every batch is
    the same request of all of them in every run: the batching allows repeating."""
    kwargs.setdefault("policy_device", "cpu")
    with AsyncBatchedCollector(
        counting_envs(n),
        Sampling(),
        frames_per_batch=64,
        total_frames=256,
        transport=transport,
        envs_per_worker=n,
        seed=seed,
        **kwargs,
    ) as c:
        data = torch.cat(list(c))
    return {env: rows["action"] for env, rows in streams(data).items()}


@pytest.mark.parametrize(
    ("transport", "backend"),
    [("thread", "thread"), ("process_slots", "thread"), ("process_slots", "process")],
)
def test_a_seeded_sampling_policy_repeats_each_envs_stream(transport, backend):
    first = actions(3, transport, inference_backend=backend)
    again = actions(3, transport, inference_backend=backend)
    other = actions(4, transport, inference_backend=backend)
    assert all(torch.equal(first[e], again[e]) for e in first)
    assert any(not torch.equal(first[e], other[e]) for e in first)
    # the noise is real: each env sees several actions
    assert all(len(set(a.tolist())) > 1 for a in first.values())


def test_the_callers_stream_goes_on_as_if_the_server_drew_nothing():
    with AsyncBatchedCollector(
        counting_envs(4),
        Sampling(),
        frames_per_batch=64,
        total_frames=512,
        transport="thread",
        envs_per_worker=4,
        policy_device="cpu",
    ) as c:
        with c.pause():  # no batch runs: nothing else draws meanwhile
            torch.manual_seed(11)
            first = torch.rand(4)
        served = sum(b.batch_size[0] for b in c)  # the server draws 512 numbers meanwhile
    second = torch.rand(4)
    torch.manual_seed(11)
    expected = torch.rand(4), torch.rand(4)
    assert served == 512
    assert torch.equal(first, expected[0]) and torch.equal(second, expected[1])


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
def test_a_seeded_sampling_policy_repeats_on_the_gpu(graph):
    first = actions(5, policy_device="cuda", cuda_graph=graph)
    again = actions(5, policy_device="cuda", cuda_graph=graph)
    assert all(torch.equal(first[e], again[e]) for e in first)
    assert any(not torch.equal(first[e], actions(6, policy_device="cuda")[e]) for e in first)
