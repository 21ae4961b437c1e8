"""Pixel collection with rlcollect, and the envs' own ceiling, on Pong 4x105x80.

One run is one configuration in a fresh process: ``AsyncBatchedCollector`` over
``num_envs`` Pong envs serving the suite's acting policy (eager, or a CUDA graph), timed by
:func:`benchmarks.suite.measure.measure` from the first batch on.
"""

from __future__ import annotations

from typing import Any

from benchmarks.common import make_pong
from benchmarks.suite.acting import acting_policy
from benchmarks.suite.measure import measure_collector
from rlcollect import AsyncBatchedCollector
from rlcollect.envspeed import env_throughput


def _collector_kwargs(config: dict[str, Any]) -> dict[str, Any]:
    return {
        "frames_per_batch": config["frames_per_batch"],
        "total_frames": -1,
        "transport": config["transport"],
        "envs_per_worker": config["envs_per_worker"],
        "worker_splits": config["worker_splits"],
        "min_batch_size": config["min_batch_size"],
        "batch_timeout": config["batch_timeout"],
        "transition_chunk_size": config["chunk"],
        "policy_device": config["device"],
        "cuda_graph": config["graph"],
        "inference_backend": config["inference_backend"],
        "seed": 0,
    }


def run_rlcollect(config: dict[str, Any]) -> dict[str, Any]:
    return measure_collector(
        lambda: AsyncBatchedCollector(
            [make_pong] * config["num_envs"],
            acting_policy(config["policy"]),
            **_collector_kwargs(config),
        ),
        config["warmup_s"],
        config["measure_s"],
    )


def run_env_only(config: dict[str, Any]) -> dict[str, Any]:
    fps = env_throughput([make_pong] * config["num_envs"], seconds=config["measure_s"])
    return {"frames_per_second": fps}
