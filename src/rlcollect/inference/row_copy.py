"""A vector-env worker's observation copies, done by its own GPU.

Where a worker answers its own requests on a GPU (``inference_backend="worker"``,
``inference/local.py``), its staging cells are already mapped into the GPU's address
space (``mapped.py``: the action step gathers each batch from them). Mapping the chunk's
observation fields as well lets the GPU write each finished transition's observation
and next observation straight from the cells into the chunk: a kernel per field and
run of rows, reading and writing host memory over the bus. The worker's CPU, which
would otherwise copy two observations per transition (about 1 MB per batch of 32 Atari
frames, while every core steps sub-envs), only writes the rows' cell numbers.

The protocol, between the worker's thread (the only one that calls in) and the GPU::

    worker thread                               copier's stream
    ─────────────                               ───────────────
    gather: cell numbers → index[at … at+n)
            launch index_select ─────────────▶  reads index[at … at+n), the cells,
                                                writes the chunk rows
    wait:   synchronise with the stream ◀─────  (every launched copy has landed)

Why it is safe:

* The cells a copy reads are not written again before :meth:`wait`: the worker
  stages a sub-env's next observation into the cell its previous step did not use,
  which a pending copy may read, so it waits before staging (``collector/vector_worker``).
* The chunk rows a copy writes are not handed over before :meth:`wait`: the worker
  waits before handing over a full slot, so the driver reads complete rows.
* Each gather writes its cell numbers to a part of the index not used since the last
  wait, so the CPU never rewrites numbers a launched kernel has yet to read; when the
  index is full the copier waits first.
* Kernels read what the CPU wrote before the launch (``mapped.py``), and the CPU reads
  nothing the copier writes.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

from rlcollect.inference.mapped import map_host, unmap_host
from rlcollect.transports.base import RowCopier
from rlcollect.transports.layout import Key

__all__ = ["DeviceRowCopier"]

_PAGE = 4096


class DeviceRowCopier(RowCopier):
    """Copies rows of mapped staging fields into mapped chunk fields on one GPU.

    Built by :meth:`build`, which returns None where the chunk cannot be mapped.
    """

    def __init__(
        self,
        sources: Mapping[Key, torch.Tensor],
        targets: Mapping[Key, torch.Tensor],
        index: tuple[np.ndarray, torch.Tensor],
        mapped: list[int],
    ) -> None:
        self._sources = dict(sources)
        self._targets = dict(targets)
        self._index_np, self._index_dev = index
        self._mapped = mapped  # the addresses build registered, released by close
        self._used = 0  # entries of the index written since the last wait
        self._stream = torch.cuda.Stream(self._index_dev.device)  # type: ignore[no-untyped-call]
        self._pending = False

    @classmethod
    def build(
        cls,
        device: torch.device,
        sources: Mapping[Key, torch.Tensor],
        targets: Mapping[Key, np.ndarray],
        capacity: int,
    ) -> DeviceRowCopier | None:
        """A copier from ``sources`` (staging fields, already mapped) into ``targets``
        (chunk fields ``[rows, *shape]``, mapped here), writing up to ``capacity`` cell
        numbers between waits; None where something cannot be mapped."""
        index = _page_aligned(capacity)
        arrays = [*targets.values(), index]
        views = _map_all(arrays, device)
        if views is None:
            return None
        mapped = [array.ctypes.data for array in arrays]
        return cls(sources, dict(zip(targets, views[:-1], strict=True)), (index, views[-1]), mapped)

    def gather(self, source: Key, cells: np.ndarray, target: Key, start: int) -> None:
        n = len(cells)
        if self._used + n > len(self._index_np):
            self.wait()
        at = self._used
        self._index_np[at : at + n] = cells
        self._used = at + n
        with torch.cuda.stream(self._stream):
            torch.index_select(
                self._sources[source],
                0,
                self._index_dev[at : at + n],
                out=self._targets[target][start : start + n],
            )
        self._pending = True

    def wait(self) -> None:
        if self._pending:
            # Spins, as the action step's wait does: by the time the worker waits (its
            # next result, a full slot) the copies have usually long landed.
            self._stream.synchronize()
            self._pending = False
        self._used = 0

    def close(self) -> None:
        """Wait for the copies, then release the memory this copier page-locked.
        Idempotent."""
        self.wait()
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
    """``entries`` int64 cell numbers, starting on a page of their own: no other
    allocation shares a page that is page-locked."""
    raw = np.zeros(entries * 8 + 2 * _PAGE, dtype=np.uint8)
    skip = -raw.ctypes.data % _PAGE
    index: np.ndarray = raw[skip : skip + entries * 8].view(np.int64)
    return index
