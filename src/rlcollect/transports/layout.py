"""The rollout ring: where every transition field lives while a chunk is being built.

Each worker owns ``slots`` chunk buffers of ``chunk_steps`` steps for each of its
``envs_per_worker`` envs. A *position* ``p = slot * chunk_steps + t`` names one step of
one worker; every field is laid out as ``[num_workers, positions, envs_per_worker,
*shape]``, so the server gathers a batch with one fancy index over (worker, position)
and the driver copies a chunk out with one slice. All fields share one flat buffer,
which is what makes a single shared-memory segment enough for a whole collector.
"""

from __future__ import annotations

import mmap
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

__all__ = ["Field", "Key", "RingLayout"]

Key = tuple[str, ...]

_ALIGN = 4096  # a page: no two fields share a cache line (no false sharing), and each
# field can be page-locked (cudaHostRegister) on its own


@dataclass(frozen=True)
class Field:
    """One transition field: its TensorDict key, per-env shape and dtype."""

    key: Key
    shape: tuple[int, ...]
    dtype: np.dtype[np.generic]

    def __post_init__(self) -> None:
        if not self.key or not all(isinstance(k, str) and k for k in self.key):
            raise ValueError(f"field key must be a non-empty tuple of names, got {self.key!r}")


@dataclass(frozen=True)
class RingLayout:
    """Shape of the rollout ring shared by all workers of one collector."""

    fields: tuple[Field, ...]
    num_workers: int
    envs_per_worker: int
    chunk_steps: int
    slots: int

    def __post_init__(self) -> None:
        for name in ("num_workers", "envs_per_worker", "chunk_steps", "slots"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"RingLayout.{name} must be a positive int, got {value!r}")
        keys = [f.key for f in self.fields]
        if len(set(keys)) != len(keys):
            raise ValueError(f"RingLayout has duplicate field keys: {keys}")

    @property
    def positions(self) -> int:
        """Steps one worker can hold in the ring: ``slots * chunk_steps``."""
        return self.slots * self.chunk_steps

    def _field_shape(self, field: Field) -> tuple[int, ...]:
        return (self.num_workers, self.positions, self.envs_per_worker, *field.shape)

    def _offsets(self) -> list[tuple[Field, int, int]]:
        out = []
        offset = 0
        for field in self.fields:
            nbytes = int(np.prod(self._field_shape(field))) * field.dtype.itemsize
            out.append((field, offset, nbytes))
            offset += -(-nbytes // _ALIGN) * _ALIGN
        return out

    @property
    def nbytes(self) -> int:
        """Size of the flat buffer that holds every field (at least one byte)."""
        offsets = self._offsets()
        if not offsets:
            return 1
        _, last, size = offsets[-1]
        return max(1, last + size)

    def views(self, buffer: memoryview | mmap.mmap | np.ndarray) -> dict[Key, np.ndarray]:
        """Numpy views of every field over ``buffer`` (``nbytes`` long, writable)."""
        flat = np.frombuffer(buffer, dtype=np.uint8)
        if flat.size < self.nbytes:
            raise ValueError(f"buffer holds {flat.size} bytes, the ring needs {self.nbytes}")
        out: dict[Key, np.ndarray] = {}
        for field, offset, nbytes in self._offsets():
            raw = flat[offset : offset + nbytes]
            out[field.key] = raw.view(field.dtype).reshape(self._field_shape(field))
        return out


def worker_views(views: Mapping[Key, np.ndarray], worker: int) -> dict[Key, np.ndarray]:
    """One worker's part of the ring: every field as ``[positions, envs_per_worker, ...]``."""
    return {key: array[worker] for key, array in views.items()}
