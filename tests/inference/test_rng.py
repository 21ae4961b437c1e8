"""The served policy's random stream (inference/rng.py): seeded from the collector's
``seed``, the same in every run where batches are formed the same way, and kept apart
from the stream the rest of the process draws from."""

import contextlib
import threading

import pytest
import torch
from helpers import counting_envs, streams

from rlcollect import AsyncBatchedCollector
from rlcollect.inference.rng import DeviceRng


class Sampling(torch.nn.Module):
    """Samples actions 0-4 from fixed logits: every action is the policy's noise."""

    def __init__(self):
        super().__init__()
        self.logits = torch.nn.Parameter(torch.zeros(5))

    def forward(self, observation):  # Gumbel-max: capturable in a CUDA graph
        noise = torch.rand(observation.shape[0], 5, device=observation.device)
        return (self.logits - torch.log(-torch.log(noise))).argmax(dim=-1)


def actions(seed, transport="process_slots", n=4, beside=None, **kwargs):
    """Each env's actions in step order. One worker holds every env, so every batch is
    the same request of all of them in every run: the batching allows repeating.
    ``beside``: a context entered once the collector is built, left when it is done."""
    kwargs.setdefault("policy_device", "cpu")
    with (
        AsyncBatchedCollector(
            counting_envs(n),
            Sampling(),
            frames_per_batch=64,
            total_frames=256,
            transport=transport,
            envs_per_worker=n,
            worker_splits=1,  # "auto" splits a worker for a GPU policy
            seed=seed,
            **kwargs,
        ) as c,
        beside if beside is not None else contextlib.nullcontext(),
    ):
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
        # the server, whose pause holds its forwards: a worker thread running the policy
        # itself may still forward inside the pause (docs/reproducibility.md)
        inference_backend="thread",
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


def rand_graph():
    """A graph of ``torch.rand(64)`` on the GPU, captured on whatever generator state
    the device's default generator holds now; returns it and its output."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        torch.rand(64, device="cuda")  # warm-up
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            out = torch.rand(64, device="cuda")
    stream.synchronize()
    return graph, out


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_graph_captured_on_the_stream_draws_from_it_alone():
    rng = DeviceRng(torch.device("cuda"), 3)
    with rng.installed():
        graph, out = rand_graph()

    def replays():
        draws = []
        for _ in range(3):
            graph.replay()
            draws.append(out.clone())
        return draws

    rng.reseed(3)
    first = replays()
    rng.reseed(3)
    torch.cuda.manual_seed(99)  # the device's own stream is elsewhere...
    torch.rand(64, device="cuda")
    default_before = torch.cuda.get_rng_state()
    again = replays()  # ...and the graph's draws neither follow it nor take from it
    assert torch.equal(torch.cuda.get_rng_state(), default_before)
    assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))
    assert not torch.equal(first[0], first[1])  # each replay draws afresh
    rng.reseed(4)
    assert not torch.equal(replays()[0], first[0])


class Learner:
    """A training thread beside the collector, drawing on the GPU from
    ``manual_seed(11)`` until stopped: eager draws, and replays of a graph of its own
    captured on the device's default generator, as a learner's would be."""

    def __init__(self):
        self.graph, self.out = rand_graph()
        self.draws = []
        self._drawing = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _draw(self):
        eager = torch.rand(64, device="cuda")
        self.graph.replay()
        return torch.cat([eager, self.out])

    def _run(self):
        torch.cuda.manual_seed(11)
        while not self._stop.is_set() and len(self.draws) < 20_000:
            self.draws.append(self._draw())
            self._drawing.set()

    def __enter__(self):
        self._thread.start()
        # The collector serves from construction on: the first draw is during collection.
        assert self._drawing.wait(timeout=60)
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(timeout=60)
        assert not self._thread.is_alive()

    def expected(self):
        """The learner's draws had it been alone."""
        torch.cuda.manual_seed(11)
        return [self._draw() for _ in self.draws]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_learner_beside_a_graphed_server_draws_apart_from_it():
    """Thread backend, CUDA graphs: a learner drawing on the same device all through
    collection neither takes numbers from the server's stream nor lends it any."""
    alone = actions(5, policy_device="cuda", cuda_graph=True)
    learner = Learner()
    beside = actions(5, policy_device="cuda", cuda_graph=True, beside=learner)
    assert learner.draws  # it drew while batches ran
    assert all(torch.equal(alone[e], beside[e]) for e in alone)
    expected = learner.expected()
    assert all(torch.equal(a, b) for a, b in zip(learner.draws, expected, strict=True))
