"""GPU inference benchmark: server round trip by batch size, and Pong collection speed.

Runs on a CUDA machine. Two parts, in one run:

1. **Latency by batch size** (1 … 256) of the server's per-batch work for the Nature
   CNN on 4x105x80 uint8 frames — gather the batch's rows out of a ring-shaped array,
   host→device, forward and sampling, device→host, scatter back into the ring — for
   the eager, compiled and CUDA-graphed action steps (gathering on the GPU from the
   page-locked ring), the graphed step gathering on the CPU into page-locked staging
   (``graph_staged``: the other way to pin, measured to choose); beside a bare
   ``torch.cuda.CUDAGraph`` replay of the same network with its copies (page-locked
   input → device, replay, device → page-locked output, synchronise). Median of
   ``--iters`` timed calls after a warm-up.
2. **Pong collection** with 16 and 32 envs (process slots), eager vs CUDA-graphed
   policy, frames/s from the first batch on, median of ``--repeats``; and the env-only
   throughput of the same envs for the ratio.

Writes ``inference_latency.json`` and ``inference_latency.png`` to ``--out``.
``--latency-only`` runs part 1 alone, ``--modes`` a subset of its action steps (always
beside the bare replay): what an A/B of the step between two source trees needs.

    python benchmarks/inference_latency.py --out benchmarks/results/h200
    python benchmarks/inference_latency.py --latency-only --modes graph --out DIR
"""

from __future__ import annotations

import argparse
import json
import mmap
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine, make_pong
from policies import NatureCNN

from rlcollect import AsyncBatchedCollector
from rlcollect.envspeed import env_throughput
from rlcollect.inference import PolicyRunner, build_action_step
from rlcollect.transports import Field

SHAPE = (4, 105, 80)
SIZES = [1, 2, 4, 8, 16, 32, 64, 128, 256]
# mode: (torch.compile options, CUDA graph, page-lock the ring and gather on the GPU)
MODES = {
    "eager": (None, False, True),
    "compiled": ({}, False, True),
    "graph": (None, True, True),
    "graph_staged": (None, True, False),
    "compiled_graph": ({}, True, True),  # the compiled step, captured
}


def policy() -> NatureCNN:
    torch.manual_seed(0)
    return NatureCNN(6)


def server_latency(mode: str, iters: int) -> dict[int, float]:
    compile_options, graph, register = MODES[mode]
    runner = PolicyRunner(policy().cuda(), device=torch.device("cuda"), observation_paths=((),))
    obs = {(): Field(("observation",), SHAPE, np.dtype(np.uint8))}
    outputs = {
        ("action",): Field(("action",), (), np.dtype(np.int64)),
        ("log_prob",): Field(("log_prob",), (), np.dtype(np.float32)),
    }
    step = build_action_step(
        runner, obs, outputs, capacity=max(SIZES), compile_options=compile_options, cuda_graph=graph
    )
    rng = np.random.default_rng(0)
    slots = 2 * max(SIZES)
    storage = mmap.mmap(-1, slots * int(np.prod(SHAPE)))  # page-aligned, like the ring
    ring = np.frombuffer(storage, dtype=np.uint8).reshape(slots, *SHAPE)  # one row per slot
    ring[...] = rng.integers(0, 256, ring.shape, dtype=np.uint8)
    step.attach({(): ring}, register=register)
    assert step.gathers_on_device == register, "the ring could not be page-locked"
    ring_action = np.zeros((2 * max(SIZES), 1), np.int64)
    ring_logp = np.zeros((2 * max(SIZES), 1), np.float32)
    out: dict[int, float] = {}
    for size in SIZES:
        flat = rng.permutation(len(ring))[:size]
        times = []
        for i in range(iters + 10):
            t0 = time.perf_counter()
            rows = step.load(flat)
            result, _ = step.run(rows)
            ring_action[flat] = result[("action",)].reshape(size, 1)
            ring_logp[flat] = result[("log_prob",)].reshape(size, 1)
            if i >= 10:
                times.append(time.perf_counter() - t0)
        out[size] = statistics.median(times)
    step.close()
    return out


def bare_graph_latency(iters: int) -> dict[int, float]:
    net = policy().cuda()
    out: dict[int, float] = {}
    stream = torch.cuda.Stream()
    for size in SIZES:
        host_in = torch.randint(0, 256, (size, *SHAPE), dtype=torch.uint8).pin_memory()
        static_in = torch.zeros((size, *SHAPE), dtype=torch.uint8, device="cuda")
        host_action = torch.empty(size, dtype=torch.int64).pin_memory()
        host_logp = torch.empty(size, dtype=torch.float32).pin_memory()
        with torch.cuda.stream(stream), torch.inference_mode():
            for _ in range(3):
                net(static_in)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=stream):
                result = net(static_in)
        stream.synchronize()
        times = []
        with torch.cuda.stream(stream), torch.inference_mode():
            for i in range(iters + 10):
                t0 = time.perf_counter()
                static_in.copy_(host_in, non_blocking=True)
                graph.replay()
                host_action.copy_(result["action"], non_blocking=True)
                host_logp.copy_(result["log_prob"], non_blocking=True)
                stream.synchronize()
                if i >= 10:
                    times.append(time.perf_counter() - t0)
        out[size] = statistics.median(times)
    return out


def collection_fps(num_envs: int, graph: bool, frames: int) -> dict[str, float]:
    with AsyncBatchedCollector(
        [make_pong] * num_envs,
        policy(),
        frames_per_batch=1024,
        total_frames=frames,
        transport="process_slots",
        policy_device="cuda",
        cuda_graph=graph,
    ) as collector:
        it = iter(collector)
        next(it)
        t0 = time.perf_counter()
        n = sum(b.numel() for b in it)
        fps = n / (time.perf_counter() - t0)
        stats = collector.stats()["server"]
    return {
        "fps": fps,
        "mean_batch_size": stats["mean_batch_size"],
        "request_latency_p50": stats["request_latency_p50"],
        "request_latency_p95": stats["request_latency_p95"],
        "phase_seconds": stats["phase_seconds"],
    }


def plot(result: dict[str, Any], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for name, series in result["latency_seconds"].items():
        sizes = [int(s) for s in series]
        ax1.plot(sizes, [1e3 * v for v in series.values()], marker="o", label=name)
    ax1.set(
        xscale="log",
        xlabel="batch size (envs)",
        ylabel="ms per batch",
        title="Server round trip, Nature CNN, H200",
    )
    ax1.set_xticks(SIZES, [str(s) for s in SIZES])
    ax1.legend()
    labels, values = [], []
    for key, row in result["collection"].items():
        labels.append(key)
        values.append(row["fps_median"])
    ax2.bar(labels, values, color=["C0", "C2"] * (len(labels) // 2))
    ax2.set(ylabel="frames/s", title="Pong collection (process slots)")
    ax2.tick_params(axis="x", rotation=20)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(Path(__file__).parent / "results/h200"))
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--frames", type=int, default=40_000)
    parser.add_argument("--envs", type=int, nargs="+", default=[16, 32])
    parser.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES))
    parser.add_argument("--latency-only", action="store_true", help="part 1 alone")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("inference_latency.py needs a CUDA device")

    latency = {mode: server_latency(mode, args.iters) for mode in args.modes}
    latency["bare_graph"] = bare_graph_latency(args.iters)
    for mode, series in latency.items():
        print(mode, {s: f"{1e3 * v:.3f} ms" for s, v in series.items()}, flush=True)

    if args.latency_only:
        args.envs, args.repeats = [], 0
    env_only = {n: env_throughput([make_pong] * n, seconds=3.0) for n in args.envs}
    runs: dict[str, list[dict[str, Any]]] = {}
    for _ in range(args.repeats):
        for n in args.envs:
            for graph in (False, True):
                key = f"pong{n}-{'graph' if graph else 'eager'}"
                runs.setdefault(key, []).append(collection_fps(n, graph, args.frames))
                print(key, f"{runs[key][-1]['fps']:.0f} frames/s", flush=True)
    collection = {}
    for key, reps in runs.items():
        n = int(key.split("-")[0][4:])
        fps = [r["fps"] for r in reps]
        collection[key] = {
            "fps_median": statistics.median(fps),
            "fps_range": [min(fps), max(fps)],
            "ratio_to_env_only": statistics.median(fps) / env_only[n],
            "mean_batch_size_median": statistics.median(r["mean_batch_size"] for r in reps),
            "request_latency_p50_median": statistics.median(r["request_latency_p50"] for r in reps),
            "request_latency_p95_median": statistics.median(r["request_latency_p95"] for r in reps),
        }
    ratios = {
        n: statistics.median(
            g["fps"] / e["fps"]
            for g, e in zip(runs[f"pong{n}-graph"], runs[f"pong{n}-eager"], strict=True)
        )
        for n in args.envs
    }
    result = {
        "benchmark": "inference_latency",
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "machine": machine(),
        "config": {
            "obs_shape": SHAPE,
            "network": "Nature CNN + Gumbel-max sampling",
            "iters": args.iters,
            "repeats": args.repeats,
            "frames": args.frames,
            "modes": args.modes,
            "latency_only": args.latency_only,
        },
        "latency_seconds": {m: {str(s): v for s, v in d.items()} for m, d in latency.items()},
        "graph_vs_bare_at_64": (
            latency["graph"][64] / latency["bare_graph"][64] if "graph" in latency else None
        ),
        "env_only_fps": {str(n): v for n, v in env_only.items()},
        "collection": collection,
        "collection_graph_over_eager": {str(n): r for n, r in ratios.items()},
        "runs": runs,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "inference_latency.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(result, out / "inference_latency.png")
    print(
        json.dumps(
            {
                k: result[k]
                for k in ("graph_vs_bare_at_64", "env_only_fps", "collection_graph_over_eager")
            },
            indent=1,
        )
    )
    for key, row in collection.items():
        print(key, {k: v for k, v in row.items() if k != "fps_range"})


if __name__ == "__main__":
    main()
