"""The action step: observations in host buffers → policy → outputs in host buffers.

The server gathers a batch's observations into ``step.inputs`` (host arrays of
``capacity`` rows) and calls ``step.run(rows)``, which returns the outputs as host
arrays of ``rows`` rows, valid until the next call. The strategy is chosen once, at
construction:

``HostStep`` (policy on the CPU)
    The policy reads the gathered rows in place; nothing more is copied.

``DeviceStep`` (policy on a CUDA device)
    ``inputs`` are page-locked, so the host→device copy is one asynchronous copy per
    observation field; outputs come back the same way into page-locked arrays, and the
    server thread waits once per batch, on one event, never per request. Everything
    runs on the server's own CUDA stream. Optionally:

    * ``compile``: the action step goes through ``torch.compile``; each padded batch
      size is compiled during construction (warm-up), never in the middle of collection.
    * ``cuda_graph``: the whole action step (dtype conversion, forward, sampling) is
      captured once per padded batch size — powers of two up to the capacity. A batch is
      copied into the front of the static input, padded to the next captured size,
      replayed, and its rows sliced off the static outputs. Fresh observations are
      copied into the static input before every replay, so a policy that writes its
      input in place never reads a stale one; padding rows hold earlier observations,
      whose outputs are ignored. RNG draws inside a graph advance with every replay, so
      a sampling policy stays random.

    Weights are updated in place (see ``InferenceServer.update_weights``), so captured
    graphs and compiled code keep reading the current weights.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch

from rlcollect.inference.policy import PolicyRunner
from rlcollect.transports.layout import Field, Key

__all__ = ["ActionStep", "DeviceStep", "HostStep", "StepTimes", "buckets_for"]

Path = tuple[str, ...]
#: Seconds one call of ``run`` spent copying host→device and device→host (GPU timers).
StepTimes = tuple[float, float]
_WARMUP_CALLS = 3


def buckets_for(capacity: int) -> list[int]:
    """Padded batch sizes: powers of two from 1 up to the first one >= ``capacity``."""
    sizes = [1]
    while sizes[-1] < capacity:
        sizes.append(sizes[-1] * 2)
    return sizes


class ActionStep(ABC):
    """Runs the policy on the first ``rows`` rows of ``inputs``."""

    #: Host buffers the server gathers observations into, ``[capacity, *shape]``.
    inputs: dict[Path, np.ndarray]
    capacity: int

    @abstractmethod
    def run(self, rows: int) -> tuple[dict[Key, np.ndarray], StepTimes]:
        """Outputs ``[rows, ...]`` by key (valid until the next call), and phase times."""


class HostStep(ActionStep):
    """The policy on the CPU, reading the gathered rows where they are."""

    def __init__(
        self, runner: PolicyRunner, observations: Mapping[Path, Field], capacity: int
    ) -> None:
        self._runner = runner
        self.capacity = capacity
        self._tensors = {
            path: torch.from_numpy(np.empty((capacity, *f.shape), dtype=f.dtype))
            for path, f in observations.items()
        }
        self.inputs = {path: t.numpy() for path, t in self._tensors.items()}

    def run(self, rows: int) -> tuple[dict[Key, np.ndarray], StepTimes]:
        with torch.inference_mode():
            out = self._runner.call({path: t[:rows] for path, t in self._tensors.items()})
        return {key: value.detach().numpy() for key, value in out.items()}, (0.0, 0.0)


class DeviceStep(ActionStep):
    """The policy on a CUDA device: page-locked staging, optional compile and graphs."""

    def __init__(
        self,
        runner: PolicyRunner,
        observations: Mapping[Path, Field],
        outputs: Mapping[Key, Field],
        capacity: int,
        *,
        compile_options: Mapping[str, Any] | None,
        cuda_graph: bool,
    ) -> None:
        device = runner.device
        self.buckets = buckets_for(capacity)
        self.capacity = self.buckets[-1]
        cap = self.capacity
        self._pinned_in = {
            path: torch.empty((cap, *f.shape), dtype=_torch_dtype(f), pin_memory=True)
            for path, f in observations.items()
        }
        self.inputs = {path: t.numpy() for path, t in self._pinned_in.items()}
        self._device_in = {
            path: torch.zeros((cap, *f.shape), dtype=_torch_dtype(f), device=device)
            for path, f in observations.items()
        }
        self._pinned_out = {
            key: torch.empty((cap, *f.shape), dtype=_torch_dtype(f), pin_memory=True)
            for key, f in outputs.items()
        }
        self._out_np = {key: t.numpy() for key, t in self._pinned_out.items()}
        self._stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
        self._events = [
            torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            for _ in range(4)
        ]
        self._pad = compile_options is not None or cuda_graph

        step: Callable[[Mapping[Path, torch.Tensor]], dict[Key, torch.Tensor]] = runner.call
        if compile_options is not None:
            step = torch.compile(runner.call, **compile_options)
        self._step = step
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, dict[Key, torch.Tensor]]] = {}
        with torch.cuda.stream(self._stream), torch.inference_mode():
            if compile_options is not None or cuda_graph:
                for size in self.buckets:  # compiles each padded size now, not mid-collection
                    for _ in range(_WARMUP_CALLS):
                        self._step(self._inputs_of(size))
            if cuda_graph:
                self._capture()
        self._stream.synchronize()

    def _inputs_of(self, size: int) -> dict[Path, torch.Tensor]:
        return {path: t[:size] for path, t in self._device_in.items()}

    def _capture(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        # Largest first, so the smaller graphs fit in the memory the largest reserved.
        for size in reversed(self.buckets):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=self._stream):
                out = self._step(self._inputs_of(size))
            self._graphs[size] = (graph, out)

    def run(self, rows: int) -> tuple[dict[Key, np.ndarray], StepTimes]:
        e0, e1, e2, e3 = self._events
        size = self._bucket(rows) if self._pad else rows
        with torch.cuda.stream(self._stream), torch.inference_mode():
            e0.record()
            for path, src in self._pinned_in.items():
                self._device_in[path][:rows].copy_(src[:rows], non_blocking=True)
            e1.record()
            if size in self._graphs:
                graph, out = self._graphs[size]
                graph.replay()
            else:
                out = self._step(self._inputs_of(size))
            e2.record()
            for key, dst in self._pinned_out.items():
                dst[:rows].copy_(out[key][:rows], non_blocking=True)
            e3.record()
        e3.synchronize()  # the one wait per batch
        times = (e0.elapsed_time(e1) / 1e3, e2.elapsed_time(e3) / 1e3)
        return {key: arr[:rows] for key, arr in self._out_np.items()}, times

    def _bucket(self, rows: int) -> int:
        for size in self.buckets:
            if size >= rows:
                return size
        raise ValueError(f"batch of {rows} rows exceeds the step's capacity {self.capacity}")

    def synchronize(self) -> None:
        """Wait for everything queued on the server's stream (used around weight updates)."""
        self._stream.synchronize()


def _torch_dtype(field: Field) -> torch.dtype:
    return torch.from_numpy(np.empty(0, dtype=field.dtype)).dtype
