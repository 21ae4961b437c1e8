"""RayCollector scaling: 1, 2 and 4 simulated nodes against the local collector.

Each simulated node (``ray.cluster_utils.Cluster``: its own raylet and object store) gets
its share of the machine's ``--cores``: the envs of the collector placed there pin
themselves to that node's cores (``os.sched_setaffinity`` in the env factory, which runs
in each env worker process and in the collector actor itself), so the nodes compete for
cores as separate machines would not. The envs are CPU-bound: CartPole whose every step
also spins ``--env-us`` microseconds (or ale-py Pong with ``--env pong``), one env per
core by default, the small sampling MLP of the other benchmarks on each node's CPU.

Series, each measured ``--repeats`` times, frames/s over ``--seconds`` after a warm-up:

* ``local``: ``AsyncBatchedCollector`` over every env, on all ``--cores``;
* ``ray[1x{C}]``: one collector actor on one node of all ``C`` cores, the same envs
  (target: at least 0.9x ``local``);
* ``ray[nx{C/n}]``: ``n`` nodes (2 and 4) of ``C/n`` cores, one collector each, the
  same envs;
* ``ray[1x{C/2}]``: one node of half the cores with half the envs, to which
  ``ray[2x{C/2}]`` compares (target: at least 1.8x).

Results: ``benchmarks/results/ray_scaling/<--name>.json`` (and ``.png`` with
``--plot``). On the 2-core development machine only the 1- and 2-node series run, and
only show that everything works::

    python benchmarks/ray_scaling.py --cores 2 --seconds 3 --repeats 1 --name cpu_2core
    python benchmarks/ray_scaling.py --cores 16 --plot --name h200_16core   # 16 cores
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import gymnasium as gym
import ray
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common
from common import machine
from policies import MLP, SmallCNN

from rlcollect import AsyncBatchedCollector
from rlcollect.distributed import RayCollector

RESULTS = Path(__file__).resolve().parent / "results" / "ray_scaling"
STORE = 200 * 2**20  # bytes of object store per simulated node


class Busy(gym.Wrapper):
    """Spins ``micros`` microseconds of CPU in every step: a simulator's cost."""

    def __init__(self, env: gym.Env, micros: float) -> None:
        super().__init__(env)
        self.seconds = micros * 1e-6

    def step(self, action: Any) -> Any:
        end = time.perf_counter() + self.seconds
        while time.perf_counter() < end:
            pass
        return self.env.step(action)


def make_env(name: str, micros: float, cores: tuple[int, ...]) -> gym.Env:
    """The env, after pinning the calling process to ``cores`` (its node's)."""
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, cores)
    if name == "pong":
        return common.make_pong()
    return Busy(gym.make("CartPole-v1"), micros)


def env_fns(name: str, micros: float, nodes: int, cores_per_node: int, envs_per_node: int):
    """Factories of ``nodes * envs_per_node`` envs, group k pinned to node k's cores
    (RayCollector gives collector k the k-th contiguous group)."""
    fns = []
    for k in range(nodes):
        cores = tuple(range(k * cores_per_node, (k + 1) * cores_per_node))
        fns += [functools.partial(make_env, name, micros, cores)] * envs_per_node
    return fns


def policy_for(name: str) -> torch.nn.Module:
    return SmallCNN(6) if name == "pong" else MLP(4, 2)


def timed(collector: Any, warmup: float, seconds: float) -> dict[str, float]:
    """Frames/s of ``collector`` over ``seconds``, after ``warmup`` seconds of batches."""
    t_start = time.perf_counter()
    it = iter(collector)
    next(it)
    first_batch = time.perf_counter() - t_start
    end = time.perf_counter() + warmup
    while time.perf_counter() < end:
        next(it)
    frames, t0, c0 = 0, time.perf_counter(), time.process_time()
    while time.perf_counter() - t0 < seconds:
        frames += next(it).numel()
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    return {
        "fps": frames / wall,
        "driver_cpu_ms_per_frame": 1e3 * cpu / frames,
        "first_batch_seconds": first_batch,
    }


def run_local(args: argparse.Namespace, envs: int) -> dict[str, float]:
    fns = env_fns(args.env, args.env_us, 1, args.cores, envs)
    with AsyncBatchedCollector(
        fns,
        policy_for(args.env),
        frames_per_batch=args.frames_per_batch,
        policy_device="cpu",
        inference_backend=args.inference,
    ) as collector:
        return timed(collector, args.warmup, args.seconds)


def run_ray(args: argparse.Namespace, nodes: int, cores: int, envs: int) -> dict[str, float]:
    """``nodes`` simulated nodes of ``cores`` cores, ``envs`` envs on each."""
    from ray.cluster_utils import Cluster

    # Ray starts its workers (the collector actors and so their env workers) at niceness
    # 15 unless told otherwise; the local collector runs at 0. The nodes pass this on.
    os.environ["RAY_worker_niceness"] = str(args.worker_niceness)  # noqa: SIM112 (Ray spells it so)
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 0, "include_dashboard": False, "object_store_memory": STORE},
    )
    try:
        for _ in range(nodes):
            cluster.add_node(num_cpus=cores, object_store_memory=STORE)
        ray.init(address=cluster.address, log_to_driver=False, logging_level="WARNING")
        ray.cloudpickle.register_pickle_by_value(common)  # not installed on the "nodes"
        with RayCollector(
            env_fns(args.env, args.env_us, nodes, cores, envs),
            policy_for(args.env),
            num_collectors=nodes,
            frames_per_batch=args.frames_per_batch,
            resources_per_collector={"num_cpus": cores},
            policy_device="cpu",
            inference_backend=args.inference,
        ) as collector:
            assert len({m.node for m in collector._fleet.members}) == nodes
            return timed(collector, args.warmup, args.seconds)
    finally:
        ray.shutdown()
        cluster.shutdown()


def series(args: argparse.Namespace) -> dict[str, tuple[int, int, int]]:
    """name: (nodes, cores per node, envs per node); nodes 0 is the local collector."""
    c, per_core = args.cores, args.envs_per_core
    out = {"local": (0, c, c * per_core), f"ray[1x{c}]": (1, c, c * per_core)}
    for n in args.nodes:
        if n > 1 and c % n == 0:
            out[f"ray[{n}x{c // n}]"] = (n, c // n, c // n * per_core)
    if c % 2 == 0:
        out[f"ray[1x{c // 2}]"] = (1, c // 2, c // 2 * per_core)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cores", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--nodes", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--env", choices=["cartpole", "pong"], default="cartpole")
    parser.add_argument("--env-us", type=float, default=500.0, help="CPU per CartPole step")
    parser.add_argument("--envs-per-core", type=int, default=1)
    parser.add_argument("--frames-per-batch", type=int, default=1024)
    parser.add_argument(
        "--worker-niceness", type=int, default=0, help="of Ray's workers (Ray's own default: 15)"
    )
    parser.add_argument(
        "--inference",
        choices=["thread", "process", "worker"],
        default="thread",
        help="inference_backend of every collector, local and on the nodes",
    )
    parser.add_argument("--seconds", type=float, default=15.0, help="measured window")
    parser.add_argument("--warmup", type=float, default=3.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--name", default="ray_scaling")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--plot", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)  # the driver (learner) stays off the nodes' cores' hands

    plan = series(args)
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in plan}
    for rep in range(args.repeats):
        for name, (nodes, cores, envs) in plan.items():
            print(f"repeat {rep + 1}/{args.repeats}: {name}", flush=True)
            if nodes == 0:
                runs[name].append(run_local(args, envs))
            else:
                runs[name].append(run_ray(args, nodes, cores, envs))
            print(f"  {runs[name][-1]['fps']:,.0f} frames/s", flush=True)

    def ratio(a: str, b: str) -> dict[str, Any] | None:
        if a not in runs or b not in runs:
            return None
        per = [x["fps"] / y["fps"] for x, y in zip(runs[a], runs[b], strict=True)]
        return {"median": statistics.median(per), "per_repeat": per}

    c = args.cores
    ratios = {
        f"ray[1x{c}] / local (target >= 0.9)": ratio(f"ray[1x{c}]", "local"),
        f"ray[2x{c // 2}] / ray[1x{c // 2}] (target >= 1.8)": ratio(
            f"ray[2x{c // 2}]", f"ray[1x{c // 2}]"
        ),
        **{f"{n} / local": ratio(n, "local") for n in plan if n.startswith("ray[")},
    }
    summary = {
        name: {
            "nodes": plan[name][0],
            "cores_per_node": plan[name][1],
            "envs_per_node": plan[name][2],
            "fps_median": statistics.median(r["fps"] for r in reps),
            "fps_range": [min(r["fps"] for r in reps), max(r["fps"] for r in reps)],
            "driver_cpu_ms_per_frame_median": statistics.median(
                r["driver_cpu_ms_per_frame"] for r in reps
            ),
            "first_batch_seconds_median": statistics.median(r["first_batch_seconds"] for r in reps),
        }
        for name, reps in runs.items()
    }
    result = {
        "benchmark": "ray_scaling",
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "machine": {**machine(), "ray": ray.__version__},
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "runs": runs,
        "summary": summary,
        "ratios": {k: v for k, v in ratios.items() if v is not None},
    }
    args.out.mkdir(parents=True, exist_ok=True)
    out = args.out / f"{args.name}.json"
    out.write_text(json.dumps(result, indent=2) + "\n")

    print("\n| series | nodes x cores | envs | frames/s | range | / local |")
    print("| --- | --- | ---: | ---: | ---: | ---: |")
    local = summary["local"]["fps_median"]
    for name, row in summary.items():
        lo, hi = row["fps_range"]
        print(
            f"| `{name}` | {row['nodes']} x {row['cores_per_node']} | "
            f"{row['nodes'] * row['envs_per_node'] or row['envs_per_node']} | "
            f"{row['fps_median']:,.0f} | {lo:,.0f}-{hi:,.0f} | {row['fps_median'] / local:.2f} |"
        )
    for name, r in result["ratios"].items():
        print(f"{name}: {r['median']:.2f}")
    if args.plot:
        plot(summary, args.out / f"{args.name}.png")
    print(f"\nwritten to {out}")


def plot(summary: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(summary)
    fps = [summary[n]["fps_median"] for n in names]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.bar(names, fps, color=["gray"] + ["tab:blue"] * (len(names) - 1))
    ax.set_ylabel("frames/s (median)")
    ax.set_title("RayCollector on simulated nodes vs the local collector")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
