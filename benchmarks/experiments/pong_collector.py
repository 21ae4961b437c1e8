"""The Pong collector that ``driver_cpu.py`` and ``worker_cpu.py`` measure.

Pong envs (4x105x80 uint8, ``benchmarks/common.py``) in worker processes
(``process_slots``), endless. On the CPU the policy is the small CNN of the CPU
benchmarks; on a GPU the Nature CNN, captured as a CUDA graph.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import ENVS
from policies import NatureCNN, policy_for

from rlcollect import AsyncBatchedCollector


def pong_collector(
    envs: int, device: str, backend: str, frames_per_batch: int, **kwargs: Any
) -> AsyncBatchedCollector:
    """``envs`` Pong envs, the policy on ``device`` served by ``backend``; ``kwargs`` go
    to the constructor (``envs_per_worker``, ``worker_splits``)."""
    gpu = device != "cpu"
    return AsyncBatchedCollector(
        [ENVS["pong"]] * envs,
        NatureCNN(6) if gpu else policy_for("pong"),
        frames_per_batch=frames_per_batch,
        total_frames=-1,
        transport="process_slots",
        inference_backend=backend,
        policy_device=device,
        cuda_graph=gpu,
        **kwargs,
    )
