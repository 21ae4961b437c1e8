"""The ``defaults`` series: the collector with no layout arguments against the best
documented layout and the loops a user would write instead, workload by workload, in one
run (issue 63).

Workloads, by suite:

* CPU: CartPole with 1, 4 and 16 envs (a small MLP sampling by Gumbel-max), Pong with 4
  envs (4x105x80, the small CNN), and the on-policy PPO example's wall time
  (``examples/ppo_cartpole.py``).
* GPU: Pong with 16 and 64 envs (the Nature CNN as a CUDA graph), and ale-py's
  ``AtariVectorEnv`` of 64 sub-envs, 32 per ``recv``, a thread per core.

Each workload has three kinds of run: ``defaults`` (the collector given the envs, the
policy and ``frames_per_batch`` only, plus the suite's policy execution on a GPU),
``documented`` (the layout ``docs/tuning.md`` recommends for the case, by hand), and the
loops (a plain env loop, ``SyncVectorEnv`` and ``AsyncVectorEnv`` loops on the CPU; the
envs alone, the ``AsyncVectorEnv`` loop and the hand-written send/recv loop on a GPU).
Ratios pair runs of the same repeat. The runs of a workload keep their own seconds
and policy, so only ratios within a workload mean anything.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np

from benchmarks.suite.environment import ROOT
from benchmarks.suite.measure import measure, measure_collector
from benchmarks.suite.plans import Machine, Series, _base

__all__ = ["run_collector", "run_loop", "run_ppo", "series"]

# The best documented layout per workload (docs/tuning.md, docs/decisions/): on the CPU
# the policy in each worker, about one worker per core; on a GPU the server process with
# two splits per worker for many envs, and the policy in the vector env's own worker.
_CPU_DOCUMENTED = {"inference_backend": "worker", "transport": "process_slots"}
#: by number of Pong envs (benchmarks/check.py runs them too)
GPU_PONG_DOCUMENTED: dict[int, dict[str, Any]] = {
    16: {"inference_backend": "process", "envs_per_worker": 1, "worker_splits": 1},
    64: {"inference_backend": "process", "envs_per_worker": 4, "worker_splits": 2},
}
GPU_VECTOR_DOCUMENTED = {"inference_backend": "worker", "transport": "process_slots"}
PPO_STEPS = 100_000  # the PPO example's timesteps per run (CleanRL's 500k take minutes)


def _workload(
    m: Machine, env: str, n: int, documented: dict[str, Any], loops: tuple[str, ...]
) -> tuple[str, dict[str, dict[str, Any]], list[tuple[str, str]]]:
    label = f"{env} x{n}"
    fpb = {"cartpole": 1024, "pong": 256 if m.device == "cpu" else 1024}.get(env, 16 * n)
    common = _base(m, "", env=env, num_envs=n, frames_per_batch=fpb, policy=m.policy)
    common["graph"] = m.graph
    if env == "atari_vector":
        cores = len(os.sched_getaffinity(0))
        common["layout"] = [1, n, n // 2, cores]
    execution = {"policy_device": m.device, "cuda_graph": True} if m.graph else {}
    runs = {
        f"defaults[{label}]": {**common, "kind": "defaults_collector", "args": execution},
        f"documented[{label}]": {
            **common,
            "kind": "defaults_collector",
            "args": {**execution, "policy_device": m.device, **documented},
        },
    }
    for loop in loops:
        # On the CPU every loop is run_loop's; a GPU's run through the other series' kinds
        kind = "plain_loop" if m.device == "cpu" else _LOOP_KINDS[loop]
        runs[f"{loop}[{label}]"] = {**common, "kind": kind, "loop": loop}
    names = list(runs)
    ratios = [(names[0], other) for other in names[1:]]
    ratios += [(names[1], other) for other in names[2:]]
    return label, runs, ratios


# Loops run by kinds of other series (their configs carry what those read).
_LOOP_KINDS = {
    "env_only": "env_only",
    "async_vector_loop": "async_vector",
    "vector_env_only": "vector_env_only",
    "hand_loop": "atari_vector",
}


def series(m: Machine) -> Series:
    """The ``defaults`` series for machine ``m`` (see the module's docstring)."""
    workloads: list[tuple[str, dict[str, dict[str, Any]], list[tuple[str, str]]]] = []
    if m.device == "cpu":
        cores = len(os.sched_getaffinity(0))
        for n in (1, 4, 16) if not m.quick else (4,):
            documented = {**_CPU_DOCUMENTED, "envs_per_worker": max(1, n // cores)}
            loops = ("plain_env_loop",) * (n == 1) + ("sync_vector_loop",)
            loops += ("async_vector_loop",) * (not m.quick)  # quick: each kind of run once
            workloads.append(_workload(m, "cartpole", n, documented, loops))
        if not m.quick:
            documented = {**_CPU_DOCUMENTED, "envs_per_worker": max(1, 4 // cores)}
            pong_loops = ("sync_vector_loop", "async_vector_loop")
            workloads.append(_workload(m, "pong", 4, documented, pong_loops))
        workloads.append(_ppo(m))
    else:
        for n, layout in GPU_PONG_DOCUMENTED.items():
            documented = {**layout, "transport": "process_slots"}
            workloads.append(_workload(m, "pong", n, documented, ("env_only", "async_vector_loop")))
        workloads.append(
            _workload(
                m, "atari_vector", 64, GPU_VECTOR_DOCUMENTED, ("vector_env_only", "hand_loop")
            )
        )
    runs: dict[str, dict[str, Any]] = {}
    ratios: list[tuple[str, str]] = []
    for _, workload_runs, workload_ratios in workloads:
        runs.update(workload_runs)
        ratios += workload_ratios
    return Series(
        "defaults",
        "The defaults against the best documented layout and the loops a user would write",
        runs,
        tuple(ratios),
        notes=(
            "defaults: the collector given the envs, the policy and frames_per_batch only "
            "(on a GPU also policy_device and cuda_graph=True, the policy's execution every "
            "run of the suite shares); documented: the layout docs/tuning.md recommends, "
            "given by hand; the loops: what a user writes instead, with the same policy.",
            "CPU: CartPole with an MLP 4-64-64-2 sampling by Gumbel-max, Pong 4x105x80 with "
            "the small CNN; torch on one intra-op thread in every process. GPU: Pong with "
            "the Nature CNN, AtariVectorEnv Pong 64 envs, 32 per recv, a thread per core.",
            f"ppo: examples/ppo_cartpole.py, {PPO_STEPS:,} steps of seed 1, timed as the "
            "example times itself (collector start-up included); its frames/s is steps over "
            "wall time, so a ratio above 1 is a wall time below the other's.",
            "Each run's chosen layout and the rule that chose it are in the JSON (layout, rule).",
        ),
    )


def _ppo(m: Machine) -> tuple[str, dict[str, dict[str, Any]], list[tuple[str, str]]]:
    steps = 4_096 if m.quick else PPO_STEPS
    common = _base(m, "ppo", total_timesteps=steps)
    runs = {
        "defaults[ppo]": {**common, "argv": ["--loop", "rlcollect"]},
        # docs/decisions/in-worker-policy.md: the agent in each of two worker processes
        "documented[ppo]": {
            **common,
            "argv": ["--loop", "rlcollect", "--inference", "worker", "--workers", "2"],
        },
        "sync_vector_loop[ppo]": {**common, "argv": ["--loop", "sync"]},
    }
    names = list(runs)
    return "ppo", runs, [(names[0], names[1]), (names[0], names[2]), (names[1], names[2])]


# ------------------------------------------------------------------ the runs


def _envs(env: str) -> Callable[[], Any]:
    from benchmarks.common import make_cartpole, make_pong

    return {"cartpole": make_cartpole, "pong": make_pong}[env]


def _policy(config: dict[str, Any], device: str = "cpu") -> Any:
    import torch

    from benchmarks.policies import GumbelMLP
    from benchmarks.suite.acting import acting_policy

    torch.manual_seed(0)
    if config["env"] == "cartpole":
        return GumbelMLP(4, 2).to(device)
    return acting_policy("small_cnn" if config["device"] == "cpu" else config["policy"], device)


def _one_thread(config: dict[str, Any]) -> None:
    import torch

    if config["device"] == "cpu":
        torch.set_num_threads(1)  # the script's own threads leave the cores to the envs


def run_collector(config: dict[str, Any]) -> dict[str, Any]:
    """The collector over the workload's envs with the config's ``args`` only."""
    from rlcollect import AsyncBatchedCollector

    _one_thread(config)
    if config["env"] == "atari_vector":
        from benchmarks.suite.vectors import _Factory

        _, n, batch, threads = config["layout"]
        fns: list[Callable[[], Any]] = [_Factory(n, batch, threads)]
    else:
        fns = [_envs(config["env"])] * config["num_envs"]
    return measure_collector(
        lambda: AsyncBatchedCollector(
            fns,
            _policy(config),
            frames_per_batch=config["frames_per_batch"],
            **config["args"],
        ),
        config["warmup_s"],
        config["measure_s"],
    )


def run_loop(config: dict[str, Any]) -> dict[str, Any]:
    """A plain loop over the workload's envs on the CPU: one env stepped in a loop
    (``plain_env_loop``), or a ``SyncVectorEnv``/``AsyncVectorEnv`` stepped in lockstep,
    the policy acting on each step's observations in this process."""
    import torch

    _one_thread(config)
    policy = _policy(config)
    n, loop = config["num_envs"], config["loop"]

    def steps() -> Iterator[int]:
        if loop == "plain_env_loop":
            env = _envs(config["env"])()
            obs, _ = env.reset(seed=0)
            try:
                while True:
                    with torch.inference_mode():
                        action = policy(torch.from_numpy(np.asarray(obs))[None])
                    obs, _, terminated, truncated, _ = env.step(_action(action)[0])
                    if terminated or truncated:
                        obs, _ = env.reset()
                    yield 1
            finally:
                env.close()
        sync = loop == "sync_vector_loop"
        vector = gym.vector.SyncVectorEnv if sync else gym.vector.AsyncVectorEnv
        envs = vector([_envs(config["env"])] * n)
        try:
            obs, _ = envs.reset(seed=0)
            while True:
                with torch.inference_mode():
                    action = policy(torch.from_numpy(np.asarray(obs)))
                obs, *_ = envs.step(_action(action))  # finished envs reset themselves
                yield n
        finally:
            envs.close()

    it = steps()
    try:
        return measure(it, config["warmup_s"], config["measure_s"])
    finally:
        it.close()


def _action(output: Any) -> np.ndarray:
    action = output["action"] if isinstance(output, dict) else output
    return np.asarray(action.numpy())


def run_ppo(config: dict[str, Any]) -> dict[str, Any]:
    """``examples/ppo_cartpole.py`` with the config's ``argv``, seed 1: its wall time
    as the example measures it, start-up included."""
    path = ROOT / "examples" / "ppo_cartpole.py"
    spec = importlib.util.spec_from_file_location("ppo_cartpole", path)
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    argv = [*config["argv"], "--seeds", "1", "--total-timesteps", str(config["total_timesteps"])]
    args = example.parse_args([*argv, "--out", str(Path("/tmp"))])
    import torch

    torch.set_num_threads(1)  # as the example's main() does
    run = example.train(args.loop[0], 1, args)
    return {
        "frames_per_second": run["steps_per_second"],
        "wall_seconds": run["wall_seconds"],
        "mean_return_last_100": run["mean_return_last_100"],
    }
