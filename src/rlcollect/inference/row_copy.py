"""A vector-env worker's observation copies, done by its own GPU.

Where a worker answers its own requests on a GPU (``inference_backend="worker"``,
``inference/local.py``), its staging cells are already mapped into the GPU's address
space (``mapped.py``: the action step gathers each batch from them). Mapping the chunk's
observation fields as well lets the GPU write each finished transition's observation
and next observation straight from the cells into the chunk, reading and writing host
memory over the bus. The worker's CPU, which would otherwise copy two observations per
transition (about 2 MB per batch of 32 Atari frames, while every core steps sub-envs),
only writes the rows' numbers into an index and replays one CUDA graph.

The graph, captured once per padded size ``s`` (powers of two up to the most rows one
result can finish), runs for every observation field: gather the ``s`` cells of the
index's first list into a device buffer, write them to the chunk's observation rows of
its third list; the same from the second list into the next-observation rows. A copy
of ``n`` rows repeats its last entry of each list up to ``s``: the padding rows write
the last row again with the same bytes.

The protocol, between the worker's thread (the only one that calls in) and the GPU::

    worker thread                              copier's stream
    ─────────────                              ───────────────
    copy:  cells, cells, rows → index
           replay the graph of size s ───────▶ reads the index and the cells,
                                               writes the chunk rows
    wait:  synchronise with the stream ◀────── (every launched copy has landed)

Why it is safe:

* The cells a copy reads are not written again before :meth:`wait`: the worker
  stages a sub-env's next observation into the cell its previous step did not use,
  which a pending copy may read, so it waits before staging (``collector/vector_worker``).
* The chunk rows a copy writes are not handed over before :meth:`wait`: the worker
  waits before handing over a full slot, so the driver reads complete rows.
* The index is written only while no copy is pending (:meth:`copy` waits first if one
  is), so the CPU never rewrites numbers a replay has yet to read.
* Kernels read what the CPU wrote before the launch (``mapped.py``), and the CPU reads
  nothing the copier writes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from rlcollect.inference.mapped import map_host, unmap_host
from rlcollect.transports.base import RowCopier

__all__ = ["DeviceRowCopier", "Observation"]

_PAGE = 4096

Observation = tuple[torch.Tensor, np.ndarray, np.ndarray]
"""One observation field: its staging cells as the GPU sees them (mapped already,
``[cells, *shape]``), and the chunk's observation and next-observation fields
(``[rows, *shape]``, mapped by the copier)."""


class DeviceRowCopier(RowCopier):
    """Copies finished transitions' observations from the staging cells into the
    chunk on one GPU. Built by :meth:`build`, which returns None where the chunk
    cannot be mapped."""

    def __init__(
        self,
        graphs: dict[int, torch.cuda.CUDAGraph],
        index: np.ndarray,
        stream: torch.cuda.Stream,
        mapped: list[int],
        counted: Callable[[int], None],
    ) -> None:
        self._graphs = graphs
        self._counted = counted
        sizes = sorted(graphs)
        self._most = sizes[-1]
        # The padded size of k rows, and the numbers 0 … most - 1 (the rows' offsets).
        self._size_of = [next(s for s in sizes if s >= k) for k in range(self._most + 1)]
        self._ramp = np.arange(self._most)
        # [3, most]: cells of the observations, cells of the next ones, chunk rows.
        self._index = index
        self._stream = stream
        self._mapped = mapped  # the addresses build registered, released by close
        self._pending = False

    @classmethod
    def build(
        cls,
        device: torch.device,
        fields: Sequence[Observation],
        most: int,
        counted: Callable[[int], None],
    ) -> DeviceRowCopier | None:
        """A copier for ``fields`` that copies up to ``most`` rows per graph replay
        (more are copied in turns) and tells ``counted`` how many rows each copy
        holds; None where something cannot be mapped."""
        sizes = [1]
        while sizes[-1] < most:
            sizes.append(sizes[-1] * 2)
        index = _page_aligned(3 * sizes[-1]).reshape(3, sizes[-1])
        arrays = [index, *(a for _, obs, nxt in fields for a in (obs, nxt))]
        views = _map_all(arrays, device)
        if views is None:
            return None
        mapped = [array.ctypes.data for array in arrays]
        cells, nexts, rows = views[0]
        targets = [(views[1 + 2 * i], views[2 + 2 * i]) for i in range(len(fields))]
        stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
        rows_of = [
            torch.empty((sizes[-1], *src.shape[1:]), dtype=src.dtype, device=device)
            for src, _, _ in fields
        ]
        graphs: dict[int, torch.cuda.CUDAGraph] = {}
        try:
            for s in reversed(sizes):  # largest first: the smaller ones fit in its memory
                graph = torch.cuda.CUDAGraph()
                # thread_local: another thread of the process may use CUDA meanwhile
                # (workers as threads); nothing here touches its work.
                with torch.cuda.graph(graph, stream=stream, capture_error_mode="thread_local"):
                    for (src, _, _), (obs, nxt), tmp in zip(fields, targets, rows_of, strict=True):
                        torch.index_select(src, 0, cells[:s], out=tmp[:s])
                        obs.index_copy_(0, rows[:s], tmp[:s])
                        torch.index_select(src, 0, nexts[:s], out=tmp[:s])
                        nxt.index_copy_(0, rows[:s], tmp[:s])
                graphs[s] = graph
            stream.synchronize()
        except Exception:
            graphs.clear()
            for address in mapped:
                unmap_host(address)
            raise
        return cls(graphs, index, stream, mapped, counted)

    def copy(self, cells: np.ndarray, next_cells: np.ndarray, start: int) -> None:
        n = len(cells)
        done = 0
        while done < n:
            if self._pending:
                self.wait()  # the index is the one a pending replay reads
            k = min(n - done, self._most)
            size = self._size_of[k]
            index = self._index
            index[0, :k] = cells[done : done + k]
            index[1, :k] = next_cells[done : done + k]
            np.add(self._ramp[:k], start + done, out=index[2, :k])
            # Padding: the last row again, with the same bytes.
            index[:, k:size] = index[:, k - 1 : k]
            with torch.cuda.stream(self._stream):
                self._graphs[size].replay()
            self._pending = True
            done += k
        self._counted(n)

    def wait(self) -> None:
        if self._pending:
            # Spins, as the action step's wait does: by the time the worker waits (its
            # next result, a full slot) the copies have usually long landed.
            self._stream.synchronize()
            self._pending = False

    def close(self) -> None:
        """Wait for the copies, then release what this copier page-locked. Idempotent."""
        self.wait()
        self._graphs = {}  # they write the mapped chunk: never replayed past this point
        for address in self._mapped:
            unmap_host(address)
        self._mapped = []


def _map_all(arrays: list[np.ndarray], device: torch.device) -> list[torch.Tensor] | None:
    """Every array mapped (``map_host``), or none of them."""
    views: list[torch.Tensor] = []
    for array in arrays:
        view = map_host(array, device)
        if view is None:
            for done in arrays[: len(views)]:
                unmap_host(done.ctypes.data)
            return None
        views.append(view)
    return views


def _page_aligned(entries: int) -> np.ndarray:
    """``entries`` int64 numbers, starting on a page of their own: no other
    allocation shares a page that is page-locked."""
    raw = np.zeros(entries * 8 + 2 * _PAGE, dtype=np.uint8)
    skip = -raw.ctypes.data % _PAGE
    index: np.ndarray = raw[skip : skip + entries * 8].view(np.int64)
    return index
