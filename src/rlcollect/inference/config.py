"""The configuration every inference backend builds its server from.

:class:`InferenceConfig` is written once by the plan (``collector/plan.py``) and read by
each backend: the thread backend builds the server from it in the driver, the process
backend sends it (pickled) to its own process, the in-worker policy hands it to every
worker. :class:`WeightsLayout` is where each weight lives in a flat shared segment (the
weights slots of ``process.py`` and the board of ``board.py``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from rlcollect.inference.server import BatchingConfig
from rlcollect.transports.layout import Field, Key, Path, RingLayout

__all__ = ["InferenceConfig", "WeightsLayout"]

_ALIGN = 64  # bytes: each weight starts on a cache line


@dataclass(frozen=True)
class WeightsLayout:
    """Where each tensor of the policy's ``state_dict`` lives inside one weights slot."""

    entries: tuple[tuple[str, tuple[int, ...], str, int], ...]  # name, shape, dtype, offset
    slot_bytes: int

    @staticmethod
    def of(state: Mapping[str, torch.Tensor]) -> WeightsLayout:
        entries = []
        offset = 0
        for name, tensor in state.items():
            entries.append((name, tuple(tensor.shape), str(tensor.dtype), offset))
            size = tensor.numel() * tensor.element_size()
            offset += -(-size // _ALIGN) * _ALIGN
        return WeightsLayout(tuple(entries), max(offset, _ALIGN))

    def weights(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Each weight's shape and dtype, by name (what new weights are checked against)."""
        return {
            name: (shape, getattr(torch, dtype.removeprefix("torch.")))
            for name, shape, dtype, _ in self.entries
        }

    def views(self, buffer: Any, slot: int, *, start: int = 0) -> dict[str, torch.Tensor]:
        """Tensors over slot ``slot`` of the slots from byte ``start`` of ``buffer`` (no
        copy)."""
        out = {}
        base = start + slot * self.slot_bytes
        for name, shape, dtype, offset in self.entries:
            torch_dtype = getattr(torch, dtype.removeprefix("torch."))
            count = int(np.prod(shape)) if shape else 1
            if count == 0:
                out[name] = torch.empty(shape, dtype=torch_dtype)
                continue
            flat = torch.frombuffer(buffer, dtype=torch_dtype, count=count, offset=base + offset)
            out[name] = flat.view(shape)
        return out


@dataclass(frozen=True)
class InferenceConfig:
    """Everything the inference process needs to build the same server as the thread
    backend would."""

    device: str
    observation_paths: tuple[Path, ...]
    observations: tuple[tuple[Path, Field], ...]
    outputs: tuple[tuple[Key, Field], ...]
    layout: RingLayout
    batching: BatchingConfig
    capacity: int
    compile_options: dict[str, Any] | None
    cuda_graph: bool
    weights: WeightsLayout
    seed: int | None = None  # the policy's random stream (inference/rng.py); None: unseeded
    #: How long the process may stay stopped (SIGSTOP), and one policy call may run.
    stall_timeout: float | None = None
    #: The probed policy is recurrent (``inference/recurrent.py``): the server holds every
    #: env's state, and the policy it builds must be recurrent too.
    recurrent: bool = False
    store_recurrent_state: bool = True  # the state goes out as ("recurrent_state", ...)
    restarts: bool = True  # workers may restart: a batch may name an env twice
    #: What a ``TensorDictModule`` policy is called under (``inference/policy.py``).
    exploration_type: str = "random"
