"""Vector envs stepped whole, as on-policy PPO needs them: the collector against the env alone.

An experiment, not a figure. ``examples/ppo_atari.py`` steps its ALE vector envs whole
(``batch_size == num_envs``, ``SameStep``), since an on-policy round needs every env to
step once per step. This measures, for each layout of the same 32 envs (``G`` vector
envs of ``N`` envs on ``T`` C++ threads each, a transport, vector envs per worker), in
interleaved repeats:

* the env alone: the ``G`` vector envs stepped whole with random actions, each by a
  Python thread of its own (their C++ threads release the GIL);
* the collector: ``AsyncBatchedCollector`` over the same envs, the example's Nature CNN
  acting (a CUDA graph on a GPU), with and without ``on_policy``, no learner.

Each measurement is a fresh ``AsyncBatchedCollector`` of the ``rlcollect`` this process
imports, so two trees are compared by running it twice (``PYTHONPATH=<tree>/src``),
interleaved, as ``results/archive/h200/on_policy_prefault/`` was made::

    python benchmarks/experiments/whole_vector_envs.py --repeats 2 --out DIR
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import statistics
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rlcollect import AsyncBatchedCollector

ROOT = Path(__file__).resolve().parents[2]
LAYOUTS = "1x32x16:thread:1,2x16x8:thread:1,4x8x4:thread:4,4x8x4:process_slots:1"


def load_example() -> Any:
    spec = importlib.util.spec_from_file_location("ppo_atari", ROOT / "examples/ppo_atari.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def parse_layout(text: str) -> dict[str, Any]:
    shape, transport, per_worker = text.split(":")
    groups, envs, threads = (int(x) for x in shape.split("x"))
    return {
        "name": text,
        "groups": groups,
        "envs": envs,
        "threads": threads,
        "transport": transport,
        "envs_per_worker": int(per_worker),
    }


def env_alone(ppo: Any, layout: dict[str, Any], seconds: float) -> float:
    """Env steps per second of the layout's vector envs stepped whole, each by a thread."""
    n = layout["envs"]
    envs = [ppo.make_ale_vector(n, layout["threads"], 108_000) for _ in range(layout["groups"])]
    counts = [0] * len(envs)
    start = threading.Barrier(len(envs) + 1)
    stop = threading.Event()

    def drive(i: int) -> None:
        rng = np.random.default_rng(i)
        envs[i].reset(seed=i)
        start.wait(timeout=60)
        while not stop.is_set():
            envs[i].step(rng.integers(0, 6, n))
            counts[i] += n

    threads = [threading.Thread(target=drive, args=(i,)) for i in range(len(envs))]
    for t in threads:
        t.start()
    start.wait(timeout=60)
    t0 = time.perf_counter()
    first = sum(counts)
    stop.wait(seconds)
    rate = (sum(counts) - first) / (time.perf_counter() - t0)
    stop.set()
    for t in threads:
        t.join(timeout=60)
    for env in envs:
        env.close()
    return rate


def collector(
    ppo: Any, agent: torch.nn.Module, layout: dict[str, Any], on_policy: bool, args: Any
) -> dict[str, Any]:
    """Frames per second of the collector over the layout, no learner."""
    n = layout["envs"]
    fns = [functools.partial(ppo.make_ale_vector, n, layout["threads"], 108_000)]
    cuda = torch.cuda.is_available()
    with AsyncBatchedCollector(
        fns * layout["groups"],
        agent,
        frames_per_batch=n * layout["groups"] * args.steps,
        total_frames=-1,
        on_policy=on_policy,
        transport=layout["transport"],
        envs_per_worker=layout["envs_per_worker"],
        policy_device="cuda" if cuda else "cpu",
        cuda_graph=cuda,
        seed=1,
    ) as c:
        batches = iter(c)
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < args.warmup:
            next(batches)
        frames, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < args.seconds:
            frames += next(batches).numel()
        elapsed = time.perf_counter() - t0
        server = c.stats()["server"]
    return {
        "fps": frames / elapsed,
        "mean_batch": server["mean_batch_size"],
        "request_latency_p50": server["request_latency_p50"],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layouts", default=LAYOUTS, help="GxNxT:transport:envs_per_worker,...")
    p.add_argument("--steps", type=int, default=128, help="steps per env per batch")
    p.add_argument("--seconds", type=float, default=8.0)
    p.add_argument("--warmup", type=float, default=3.0)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--policies", default="on,off", help="on_policy modes to measure: on, off")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/whole_vector_envs"))
    args = p.parse_args()
    torch.set_num_threads(1)
    ppo = load_example()
    agent = ppo.Agent(6).to("cuda" if torch.cuda.is_available() else "cpu")
    layouts = [parse_layout(x) for x in args.layouts.split(",")]
    runs: dict[str, list[Any]] = {}
    for repeat in range(args.repeats):
        measured: set[str] = set()  # the env alone once per shape and repeat
        for layout in layouts:
            shape = f"{layout['groups']}x{layout['envs']}x{layout['threads']}"
            if shape not in measured:
                measured.add(shape)
                alone = env_alone(ppo, layout, args.seconds)
                runs.setdefault(f"env_alone:{shape}", []).append(alone)
                print(f"repeat {repeat}: env alone {shape}: {alone:,.0f} steps/s", flush=True)
            for on_policy in (mode == "on" for mode in args.policies.split(",")):
                key = f"{layout['name']}:{'on' if on_policy else 'off'}_policy"
                result = collector(ppo, agent, layout, on_policy, args)
                runs.setdefault(key, []).append(result)
                print(f"repeat {repeat}: {key}: {result['fps']:,.0f} frames/s", flush=True)
    summary = {
        key: statistics.median(v if isinstance(v[0], float) else [r["fps"] for r in v])
        for key, v in runs.items()
    }
    for key, value in summary.items():
        print(f"{key:40s} {value:10,.0f}")
    args.out.mkdir(parents=True, exist_ok=True)
    result = {"config": {k: str(v) for k, v in vars(args).items()}, "summary": summary}
    result["runs"] = runs
    (args.out / "whole_vector_envs.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
