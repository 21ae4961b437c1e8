"""The action step: observations in the ring → policy → outputs in host buffers.

The server binds the step to the ring once (``attach``: each observation field as
``[rows, *shape]``, see ``RingLayout.request_sources``), then per batch calls
``load(flat)`` with the flat row indices of the batch's observations
(``rlcollect.transports.layout.request_rows``) and ``run(rows)``, which returns the
outputs as host arrays of ``rows`` rows, valid until the next call. The strategy is
chosen once, at construction:

``HostStep`` (policy on the CPU)
    ``load`` gathers the rows with one ``np.take`` per observation field into buffers
    the policy then reads in place.

``DeviceStep`` (policy on a CUDA device)
    ``attach`` page-locks the ring's observation fields where it is their own memory
    (``cudaHostRegister``, mapped), through a second mapping of their pages (``_alias``:
    the caller's batches may view the ring, and must stay pageable memory, below), and
    the gather then runs on the GPU: one ``index_select`` per field reads the batch's
    rows straight out of host memory over the bus, so the CPU copies nothing. (Safe
    under the ring's protocol: the kernel is launched only after the server has read the
    rows' request messages, and device reads of page-locked host memory see what the
    CPUs wrote.) Where registration is refused, ``load`` gathers into page-locked
    staging buffers and ``run`` copies them up asynchronously. Outputs come back into
    page-locked arrays; the server thread waits once per batch, on one event, never per
    request. Everything runs on the server's own CUDA stream. Optionally:

    * ``compile``: the action step goes through ``torch.compile``; each padded batch
      size is compiled during construction (warm-up), never in the middle of collection.
    * ``cuda_graph``: the whole action step (dtype conversion, forward, sampling) is
      captured once per padded batch size — powers of two up to the capacity. A batch is
      copied into the front of the static input, padded to the next captured size,
      replayed, and its rows sliced off the static outputs. Fresh observations are
      copied into the static input before every replay, so a policy that writes its
      input in place never reads a stale one; padding rows hold earlier observations,
      whose outputs are ignored. RNG draws inside a graph advance with every replay, so
      a sampling policy stays random (from the step's own generator state, which its
      graphs are captured on: ``inference/rng.py``). When the ring is page-locked,
      ``attach`` captures a second graph per size that also holds the batch's index
      upload, the gather and the outputs' copies down: a batch is then one replay, where
      each of those copies would otherwise be a launch of its own from the server
      thread, and the GPU would wait for each. The index buffer starts zeroed and its
      unused tail keeps earlier batches' rows, so the padding rows a replay gathers are
      always rows of the ring. Its copies are inside the replay, timed as part of
      ``forward``.

    Weights are updated in place (see ``InferenceServer.update_weights``), so captured
    graphs and compiled code keep reading the current weights.
"""

from __future__ import annotations

import ctypes
import functools
import mmap
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from rlcollect.inference.checks import output_cast
from rlcollect.inference.policy import PolicyRunner
from rlcollect.inference.recurrent import StateStore
from rlcollect.inference.rng import DeviceRng, HostRng
from rlcollect.transports.layout import Field, Key, Path, RingLayout

# The strategies (ActionStep, HostStep, DeviceStep) are the inference server's business;
# users build one with build.py's build_action_step and hand it over.
__all__ = ["ActionStep", "DeviceStep", "HostStep"]

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
    """Gathers a batch out of the ring and runs the policy on it."""

    #: Most rows one batch may hold.
    capacity: int
    #: Host buffers a host-side gather writes into, ``[capacity, *shape]``.
    inputs: dict[Path, np.ndarray]
    #: Every env's recurrent state (recurrent policies only; ``inference/recurrent.py``).
    states: StateStore | None = None

    @property
    def gathers_on_device(self) -> bool:
        """True when batches are gathered on the GPU from the page-locked ring."""
        return False

    def attach(self, rings: Mapping[Path, np.ndarray]) -> None:
        """Bind to the ring: each observation field as ``[rows, *shape]``."""
        self._rings = dict(rings)

    def attach_envs(self, layout: RingLayout, views: Mapping[Key, np.ndarray]) -> None:  # noqa: B027
        """Bind a recurrent step's states to the ring: each request row's env and its
        ``is_init`` (``recurrent_step.py``). A feed-forward step keeps no env's state."""

    def load(self, flat: np.ndarray) -> int:
        """Gather rows ``flat`` (flat row indices) of every field; returns the row count."""
        rows = len(flat)
        for path, ring in self._rings.items():
            np.take(ring, flat, axis=0, out=self.inputs[path][:rows], mode="clip")  # valid rows
        return rows

    @abstractmethod
    def run(self, rows: int) -> tuple[dict[Key, np.ndarray], StepTimes]:
        """Outputs ``[rows, ...]`` by key (valid until the next call), and copy times."""

    @abstractmethod
    def seed(self, seed: int) -> None:
        """From the next batch on, the policy draws from a stream of its own started
        from ``seed`` (``inference/rng.py``)."""

    def close(self) -> None:  # noqa: B027 (most steps hold nothing to release)
        """Release what ``attach`` took (page-locking). Idempotent."""


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
        # Unseeded, the policy draws from the process's stream and nothing is swapped.
        self._rng: HostRng | None = None

    def seed(self, seed: int) -> None:
        self._rng = HostRng(seed)

    def run(self, rows: int) -> tuple[dict[Key, np.ndarray], StepTimes]:
        rng = self._rng
        if rng is not None:
            rng.swap_in()
        try:
            with torch.inference_mode():
                out = self._runner.call({path: t[:rows] for path, t in self._tensors.items()})
        finally:
            if rng is not None:
                rng.swap_out()
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
        self._device = device
        self._ring_views: dict[Path, torch.Tensor] = {}
        # the aliases page-locked, each with the ring's own address
        self._registered: list[tuple[_Alias, int]] = []
        # Zeroed: a padded replay of the whole-step graph gathers the unused tail too.
        self._index_pin = torch.zeros(cap, dtype=torch.int64, pin_memory=True)
        self._index_np = self._index_pin.numpy()
        self._index_dev = torch.empty(cap, dtype=torch.int64, device=device)
        self._stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
        # The last event is the one waited on, spinning: a blocking event (the thread
        # sleeps until the GPU is done) adds its wake-up to every batch, on the critical
        # path of every worker's cycle (docs/decisions/ keeps the measurements).
        self._events = [
            torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            for _ in range(4)
        ]
        self._pad = compile_options is not None or cuda_graph
        self._step = self._build_step(runner, compile_options)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, dict[Key, torch.Tensor]]] = {}
        # Per padded size, the graph of index upload + gather + step + outputs down
        # (captured by attach when the ring is page-locked).
        self._whole: dict[int, torch.cuda.CUDAGraph] = {}
        self._pool = torch.cuda.graph_pool_handle() if cuda_graph else None
        # Always a stream of its own, seeded by the OS until seed(): the graphs are bound
        # to the generator state they are captured with, for good (inference/rng.py).
        self._rng = DeviceRng(device, None)
        with self._rng.installed(), torch.cuda.stream(self._stream), torch.inference_mode():
            if compile_options is not None or cuda_graph:
                for size in self.buckets:  # compiles each padded size now, not mid-collection
                    for _ in range(_WARMUP_CALLS):
                        self._step(self._inputs_of(size))
            if cuda_graph:
                self._capture()
        self._stream.synchronize()

    def _build_step(
        self, runner: PolicyRunner, compile_options: Mapping[str, Any] | None
    ) -> Callable[[Mapping[Path, torch.Tensor]], dict[Key, torch.Tensor]]:
        """What is compiled, warmed up and captured: the policy call, device tensors in."""
        if compile_options is not None:
            compiled: Callable[[Mapping[Path, torch.Tensor]], dict[Key, torch.Tensor]]
            compiled = torch.compile(runner.call, **compile_options)
            return compiled
        return runner.call

    @property
    def gathers_on_device(self) -> bool:
        return bool(self._ring_views)

    def seed(self, seed: int) -> None:
        self._rng.reseed(seed)

    def attach(self, rings: Mapping[Path, np.ndarray], *, register: bool = True) -> None:
        """Bind to the ring; page-lock it for a GPU-side gather unless ``register=False``."""
        super().attach(rings)
        self._ring_views = {}
        self._registered = []
        if not register:
            return
        for path, ring in rings.items():
            registered = _register(ring, self._device)
            if registered is None:  # refused (not pinnable here): gather on the host instead
                self.close()
                self._ring_views = {}
                return
            view, alias = registered
            self._registered.append((alias, ring.ctypes.data))
            self._ring_views[path] = view
        if self._graphs:
            self._index_np[:] = 0  # rows of this ring, whatever an earlier one held
            self._capture_whole()

    def load(self, flat: np.ndarray) -> int:
        if not self._ring_views:
            return super().load(flat)
        n = len(flat)
        self._index_np[:n] = flat
        return n

    def close(self) -> None:
        self._whole = {}  # they read the registered ring: never replayed past this point
        cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]
        for alias, ring in self._registered:
            cudart.cudaHostUnregister(alias.address)
            alias.unmap()
            _LOCKED.discard(ring)
        self._registered = []

    def _copy_up(self, rows: int) -> None:
        if self._ring_views:
            index = self._index_dev[:rows]
            index.copy_(self._index_pin[:rows], non_blocking=True)
            for path, ring in self._ring_views.items():
                torch.index_select(ring, 0, index, out=self._device_in[path][:rows])
        else:
            for path, src in self._pinned_in.items():
                self._device_in[path][:rows].copy_(src[:rows], non_blocking=True)

    def _inputs_of(self, size: int) -> dict[Path, torch.Tensor]:
        return {path: t[:size] for path, t in self._device_in.items()}

    def _capture(self) -> None:
        # Largest first, so the smaller graphs fit in the memory the largest reserved.
        for size in reversed(self.buckets):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool, stream=self._stream):
                out = self._step(self._inputs_of(size))
            self._graphs[size] = (graph, out)

    def _whole_step(self, size: int) -> None:
        """Index upload, gather, step and outputs down for ``size`` rows: what one
        whole-step graph replays."""
        self._copy_up(size)
        out = self._step(self._inputs_of(size))
        for key, dst in self._pinned_out.items():
            dst[:size].copy_(out[key][:size], non_blocking=True)

    def _capture_whole(self) -> None:
        try:
            with self._rng.installed(), torch.cuda.stream(self._stream), torch.inference_mode():
                self._whole_step(self.capacity)  # once uncaptured: the gather's first run
                for size in reversed(self.buckets):
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=self._pool, stream=self._stream):
                        self._whole_step(size)
                    self._whole[size] = graph
            self._stream.synchronize()
        except Exception as exc:
            self.close()
            raise ValueError(
                "capturing the action step with its GPU-side gather as a CUDA graph "
                f"failed: {type(exc).__name__}: {exc}"
            ) from exc

    def run(self, rows: int) -> tuple[dict[Key, np.ndarray], StepTimes]:
        e0, e1, e2, e3 = self._events
        size = self._bucket(rows) if self._pad else rows
        whole = self._whole.get(size)
        if whole is not None:
            with torch.cuda.stream(self._stream):
                whole.replay()
                e3.record()
            e3.synchronize()  # the one wait per batch
            return {key: arr[:rows] for key, arr in self._out_np.items()}, (0.0, 0.0)
        with torch.cuda.stream(self._stream), torch.inference_mode():
            e0.record()
            self._copy_up(rows)
            e1.record()
            if size in self._graphs:
                graph, out = self._graphs[size]
                graph.replay()
            else:
                self._rng.swap_in()
                try:
                    out = self._step(self._inputs_of(size))
                finally:
                    self._rng.swap_out()
                _check_outputs(out, self._pinned_out)  # a graph's outputs cannot change
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


class _CudaArray:
    """A page-locked, mapped host range, presented to torch as CUDA memory (UVA)."""

    def __init__(self, array: np.ndarray, address: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": array.shape,
            "typestr": array.dtype.str,
            "data": (address, False),
            "version": 3,
        }


def _check_outputs(out: Mapping[Key, torch.Tensor], fields: Mapping[Key, torch.Tensor]) -> None:
    """Each output still fits its ring field (``fields``: a tensor of the field's dtype
    and per-env shape): a float where the probe returned integers would be truncated
    by the copy, a new shape broadcast or refused without naming the output; the casts
    allowed are ``checks.output_cast``'s."""
    for key, dst in fields.items():
        src = out[key]
        if src.shape[1:] != dst.shape[1:]:
            raise ValueError(
                f"policy output {key} has shape {tuple(src.shape[1:])} per env, but it had "
                f"{tuple(dst.shape[1:])} when the collector was built"
            )
        if output_cast(key) == "same_kind":
            fits = torch.can_cast(src.dtype, dst.dtype)
        else:  # "safe": src widens into dst
            fits = torch.promote_types(src.dtype, dst.dtype) == dst.dtype
        if not fits:
            raise TypeError(
                f"policy output {key} is {src.dtype} now, but it was {dst.dtype} when the "
                "collector was built; a cast would lose what it holds"
            )


def _register(array: np.ndarray, device: torch.device) -> tuple[torch.Tensor, _Alias] | None:
    """Page-lock a second mapping of ``array``'s pages (contiguous, in shared memory) and
    view it from the GPU: the view and the alias; or None.

    Why not ``array`` itself: torch takes page-locked host memory for pinned, so a
    caller's ``batch.to("cuda", non_blocking=True)`` from a batch that views the ring
    (``collector/batches/loans.py``) would return before its DMA had read the rows, and a worker
    could write them again once the caller dropped the batch. Page-locked only through
    the alias, the ring's own addresses stay pageable: that copy is staged, done when it
    returns. The GPU reads the same pages through the alias."""
    if not array.flags.c_contiguous or array.ctypes.data in _LOCKED:
        return None  # (CUDA refuses a range page-locked twice; an alias would not)
    alias = _alias(array)
    if alias is None:
        return None
    cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]
    mapped_portable = 0x02 | 0x01  # cudaHostRegisterMapped | cudaHostRegisterPortable
    if int(cudart.cudaHostRegister(alias.address, array.nbytes, mapped_portable)) != 0:
        # The refusal stays as the thread's last CUDA error, which torch would report
        # at its next launch as that launch's failure: clear it, then gather on the host.
        _clear_last_cuda_error()
        alias.unmap()
        return None
    try:
        view = torch.as_tensor(_CudaArray(array, alias.address), device=device)
    except Exception:
        cudart.cudaHostUnregister(alias.address)
        alias.unmap()
        return None
    _LOCKED.add(array.ctypes.data)
    return view, alias


# The rings' own addresses page-locked through an alias by a step of this process: a
# second step bound to one of them is refused, as CUDA refuses a range page-locked twice.
_LOCKED: set[int] = set()
_MREMAP_MAYMOVE = 1
_MAP_FAILED = 2**64 - 1


@dataclass(frozen=True)
class _Alias:
    """A second mapping of an array's pages: ``address`` is the array's first byte in
    it; the mapping is ``nbytes`` from ``start``, whole pages."""

    address: int
    start: int
    nbytes: int

    def unmap(self) -> None:
        _libc().munmap(self.start, self.nbytes)


@functools.cache
def _libc() -> Any:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mremap.restype = ctypes.c_void_p
    libc.mremap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    return libc


def _alias(array: np.ndarray) -> _Alias | None:
    """A second mapping of the pages under ``array``, which must be in a shared mapping
    (both transports' rings are); None for private memory or where the system has no
    ``mremap`` (Linux only).

    ``mremap`` with an old size of 0 maps the same pages of a shared mapping again, at
    a new address; a write through either is seen through the other. It maps whole
    pages, so the alias starts at the page that holds the array's first byte."""
    first = array.ctypes.data
    start = first - first % mmap.PAGESIZE
    nbytes = -(-(first - start + array.nbytes) // mmap.PAGESIZE) * mmap.PAGESIZE
    try:
        mremap = _libc().mremap
    except (OSError, AttributeError, TypeError):
        return None
    new = mremap(start, 0, nbytes, _MREMAP_MAYMOVE)
    if new is None or new == _MAP_FAILED:  # private memory: no second mapping of it
        return None
    return _Alias(int(new) + first - start, int(new), nbytes)


def _clear_last_cuda_error() -> None:
    """Reset this thread's last CUDA runtime error (``cudaGetLastError``), through the
    runtime library torch loaded: torch's own bindings do not offer the call."""
    with open("/proc/self/maps") as maps:
        paths = {line.split()[-1] for line in maps if "libcudart" in line}
    for path in paths:
        try:
            ctypes.CDLL(path).cudaGetLastError()
        except (OSError, AttributeError):
            continue


def _torch_dtype(field: Field) -> torch.dtype:
    return torch.from_numpy(np.empty(0, dtype=field.dtype)).dtype
