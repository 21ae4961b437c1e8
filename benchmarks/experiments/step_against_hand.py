"""The action step a vector env's worker runs against the hand loop's, alone on the GPU.

From a vector env's result to its actions the policy in the worker took about 270-290 us
per batch of 32 on the H200 where the hand loop's whole path (its copy included) took
about 300 (``profile_vector_worker.py``). This times the two steps in one process, on
the same graphed Nature CNN and the same batches, with no env running, in interleaved
blocks:

``hand``
    ``atari_throughput.GraphedStep``: the result copied into a page-locked buffer, one
    copy up, the graph replayed, the actions copied down, the stream synchronised;
``inputs``
    the library's step bound to its inputs (``attach_inputs``): the result copied into
    them, one copy up, the step's graph replayed, the outputs copied down, an event
    waited on;
``ring``
    the library's step bound to a page-locked ring of 64 cells: the result copied into
    32 scattered cells, one replay that gathers them on the GPU;

each also without the host copy (``*_nocopy``); the hand loop's step also waited on an
event (``hand_event``) and captured with its copies as one graph (``hand_whole``); the
library's bound to its inputs as it ran before: the copies captured into its graph too
(``inputs_whole``), or through the launches the server times (``inputs_launches``); the
ring's gather and the network as one graph between the index's copy up and the actions'
copy down (``ring_lean``); and each result taken from a pool of arrays larger than the
caches, as an env's fresh results are. ``--env-load`` runs
``AtariVectorEnv`` (64 envs, batch 32, 16 threads) on random actions in a process of its
own meanwhile, so every core steps sub-envs as in the collector::

    python benchmarks/experiments/probe_tree.py result_inputs .probe
    PYTHONPATH=.probe/src python benchmarks/experiments/step_against_hand.py --out DIR

The step bound to its inputs exists only in the probe ``result_inputs`` (not adopted),
so the script runs on that probe's tree (``--env-load`` for the loaded case). H200
results: ``results/archive/h200/result_inputs/``.
"""

from __future__ import annotations

import argparse
import json
import mmap
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import atari_throughput as at

from rlcollect.inference import PolicyRunner, build_action_step
from rlcollect.inference.step import DeviceStep
from rlcollect.transports import Field

SHAPE = (4, *at.FRAME)
_LOAD = """
import sys, numpy as np
sys.path.insert(0, {benchmarks!r})
from common import make_atari_vector
env = make_atari_vector(64, 32, 16)
env.reset(seed=0)
rng = np.random.default_rng(0)
while True:
    env.send(rng.integers(0, env.single_action_space.n, 32))
    env.recv()
"""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--blocks", type=int, default=20)
    p.add_argument("--calls", type=int, default=100, help="calls per block")
    p.add_argument("--pool", type=int, default=24, help="result arrays cycled through")
    p.add_argument("--env-load", action="store_true", help="an env on every core meanwhile")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if "attach_inputs" not in vars(DeviceStep):
        sys.exit(
            "this rlcollect has no DeviceStep.attach_inputs: run on the tree of the probe "
            "result_inputs (benchmarks/experiments/probe_tree.py result_inputs DIR, then "
            "PYTHONPATH=DIR/src)"
        )
    load = None
    if args.env_load:
        code = _LOAD.format(benchmarks=str(Path(__file__).resolve().parents[1]))
        load = subprocess.Popen([sys.executable, "-c", code])
        time.sleep(3.0)  # its threads up and stepping (a start-up allowance, not a sync)
    try:
        measure(args)
    finally:
        if load is not None:
            load.kill()
            load.wait(10)


def measure(args: argparse.Namespace) -> None:
    device = torch.device("cuda")
    b = args.batch
    rng = np.random.default_rng(0)
    pool = [rng.integers(0, 256, (b, *SHAPE), dtype=np.uint8) for _ in range(args.pool)]
    hand = at.GraphedStep(at._policy(6, "nature_cnn").to(device), b, device)
    obs_field = Field(("observation",), SHAPE, np.dtype(np.uint8))
    act_field = Field(("action",), (), np.dtype(np.int64))

    def step() -> object:
        runner = PolicyRunner(
            at._policy(6, "nature_cnn").to(device), device=device, observation_paths=((),)
        )
        return build_action_step(
            runner, {(): obs_field}, {("action",): act_field}, capacity=b, cuda_graph=True
        )

    direct = step()
    inputs = direct.attach_inputs()[()]  # type: ignore[attr-defined]
    ringed = step()
    storage = mmap.mmap(-1, 2 * b * int(np.prod(SHAPE)))
    ring = np.frombuffer(storage, dtype=np.uint8).reshape(2 * b, *SHAPE)
    ringed.attach({(): ring})  # type: ignore[attr-defined]
    cells = np.arange(0, 2 * b, 2)  # scattered, as a result's sub-envs' cells are

    def hand_nocopy(_: np.ndarray) -> None:
        hand.dev_in.copy_(hand.host_in, non_blocking=True)
        hand.graph.replay()
        hand.host_out.copy_(hand.dev_out, non_blocking=True)
        torch.cuda.current_stream(device).synchronize()

    # Bound to their inputs too, but run as the library ran them before: the timed
    # launches (copy up, replay, copies down, four timing events), and one graph that
    # captures the copies as well.
    launches = step()
    launches.attach_inputs()[()][...] = 0  # type: ignore[attr-defined]
    launches._bound_to_inputs = False  # type: ignore[attr-defined]
    whole = step()
    whole.attach_inputs()[()][...] = 0  # type: ignore[attr-defined]
    whole._capture_whole()  # type: ignore[attr-defined]
    # The hand loop's copies and network captured as one graph, as the library's step.
    whole_hand = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
    with (
        torch.cuda.stream(stream),
        torch.inference_mode(),
        torch.cuda.graph(whole_hand, stream=stream),
    ):
        hand.dev_in.copy_(hand.host_in, non_blocking=True)
        out = hand.policy(hand.dev_in)["action"]
        hand.host_out.copy_(out, non_blocking=True)
    stream.synchronize()
    event = torch.cuda.Event()  # type: ignore[no-untyped-call]
    # The ring's gather and the network captured together; the small copies outside.
    ring_view = ringed._ring_views[()]  # type: ignore[attr-defined]
    index_pin = torch.from_numpy(cells.astype(np.int64)).pin_memory()
    index_dev = index_pin.to(device)
    gathered = torch.empty((b, *SHAPE), dtype=torch.uint8, device=device)
    lean_policy = at._policy(6, "nature_cnn").to(device)
    with torch.cuda.stream(stream), torch.inference_mode():
        for _ in range(3):
            lean_policy(gathered)
        ring_graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(ring_graph, stream=stream):
            torch.index_select(ring_view, 0, index_dev, out=gathered)
            lean_out = lean_policy(gathered)["action"]
    stream.synchronize()
    lean_host = torch.empty(b, dtype=torch.int64, pin_memory=True)

    def ring_lean(_: np.ndarray) -> None:
        with torch.cuda.stream(stream):
            index_dev.copy_(index_pin, non_blocking=True)
            ring_graph.replay()
            lean_host.copy_(lean_out, non_blocking=True)
        stream.synchronize()

    def hand_event(_: np.ndarray) -> None:
        hand.dev_in.copy_(hand.host_in, non_blocking=True)
        hand.graph.replay()
        hand.host_out.copy_(hand.dev_out, non_blocking=True)
        event.record()
        event.synchronize()

    def hand_whole(_: np.ndarray) -> None:
        with torch.cuda.stream(stream):
            whole_hand.replay()
        stream.synchronize()

    def inputs_copy(obs: np.ndarray) -> None:
        np.copyto(inputs[:b], obs)
        direct.run(b)  # type: ignore[attr-defined]

    def ring_copy(obs: np.ndarray) -> None:
        ring[cells] = obs
        ringed.run(ringed.load(cells))  # type: ignore[attr-defined]

    def host_copy(obs: np.ndarray) -> None:
        np.copyto(inputs[:b], obs)

    runs: dict[str, Callable[[np.ndarray], object]] = {
        "hand": hand,
        "hand_nocopy": hand_nocopy,
        "inputs": inputs_copy,
        "inputs_nocopy": lambda _: direct.run(b),  # type: ignore[attr-defined]
        "ring": ring_copy,
        "ring_nocopy": lambda _: ringed.run(ringed.load(cells)),  # type: ignore[attr-defined]
        "host_copy_only": host_copy,
        "hand_event_nocopy": hand_event,
        "hand_whole_nocopy": hand_whole,
        "inputs_launches_nocopy": lambda _: launches.run(b),  # type: ignore[attr-defined]
        "inputs_whole_nocopy": lambda _: whole.run(b),  # type: ignore[attr-defined]
        "ring_lean_nocopy": ring_lean,
    }
    for run in runs.values():  # warm-up
        for k in range(20):
            run(pool[k % len(pool)])
    times: dict[str, list[float]] = {name: [] for name in runs}
    for block in range(args.blocks):
        names = list(runs)
        names = names[block % len(names) :] + names[: block % len(names)]
        for name in names:
            run = runs[name]
            t0 = time.perf_counter()
            for k in range(args.calls):
                run(pool[k % len(pool)])
            times[name].append((time.perf_counter() - t0) / args.calls * 1e6)
    summary = {name: statistics.median(ts) for name, ts in times.items()}
    for name, us in summary.items():
        print(f"{name:16s} {us:8.1f} us per call (median of {args.blocks} blocks)")
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        name = "step_against_hand_load.json" if args.env_load else "step_against_hand.json"
        (out / name).write_text(
            json.dumps({"config": vars(args), "us_per_call": summary, "blocks": times}, indent=1)
        )


if __name__ == "__main__":
    main()
