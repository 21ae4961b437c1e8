"""Batches as they cross the network: flat columns of numpy arrays.

A collector actor sends each of its batches as :data:`Rows`, a dict from the batch's
keys (tuples, ``("next", "observation")``) to numpy arrays of one common length.
Numpy arrays are what Ray's serializer stores out of band: the object store keeps
their bytes as they are, and a reader on the same node maps them without a copy. The
driver copies each row once, from there into the batch it yields.

This module imports no Ray: the driver's bookkeeping is tested without a cluster.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch

from rlcollect._tensordict import TensorDict

__all__ = ["Key", "Rows", "concat", "length", "take", "to_rows", "to_tensordict"]

Key = tuple[str, ...]
#: One batch's columns, every array of the same length (its rows).
Rows = dict[Key, np.ndarray]


def to_rows(batch: TensorDict) -> Rows:
    """The columns of ``batch`` (a collector's batch: tensors on the CPU)."""
    out: Rows = {}
    for key in batch.keys(include_nested=True, leaves_only=True):
        name: Key = key if isinstance(key, tuple) else (key,)
        out[name] = batch.get(key).numpy()
    return out


def length(rows: Rows) -> int:
    """Rows in ``rows``."""
    return len(next(iter(rows.values())))


def take(rows: Rows, index: np.ndarray) -> Rows:
    """The rows ``index`` selects (a bool mask or positions), as new arrays."""
    return {key: value[index] for key, value in rows.items()}


def concat(parts: Iterable[Rows]) -> Rows:
    """``parts`` one after the other, as new arrays."""
    parts = [p for p in parts if length(p)]
    if not parts:
        raise ValueError("concat needs at least one non-empty part")
    return {key: np.concatenate([p[key] for p in parts]) for key in parts[0]}


def to_tensordict(rows: Rows) -> TensorDict:
    """A TensorDict over the arrays of ``rows`` (no copy: they must be writable)."""
    td = TensorDict(batch_size=[length(rows)])
    for key, value in rows.items():
        td.set(key, torch.from_numpy(value))
    return td
