"""The rows a :class:`~rlcollect.ReplayBuffer` stores: a batch's tensors by nested key,
and the check of a batch against the layout the buffer's first write fixed."""

from __future__ import annotations

from typing import Any

import torch

from rlcollect._tensordict import TensorDictBase, is_non_tensor

Rows = dict[tuple[str, ...], torch.Tensor]  # batch fields by nested key
Fields = list[tuple[tuple[str, ...], torch.Tensor]]  # storage, in key order


def name(key: tuple[str, ...]) -> str:
    """A key as the errors write it: ``'observation'``, ``('next', 'reward')``."""
    return repr(key[0]) if len(key) == 1 else repr(key)


def leaves(data: Any, what: str) -> Rows:
    """The tensors of a one-dim TensorDict by nested key; anything else is refused."""
    if not isinstance(data, TensorDictBase):
        raise TypeError(f"{what} needs a TensorDict, got {type(data).__name__}")
    if data.batch_dims != 1:
        raise ValueError(f"{what} needs a one-dim batch [n], got batch_size {list(data.shape)}")
    out = {}
    for key, value in data.items(include_nested=True):
        key = key if isinstance(key, tuple) else (key,)
        if isinstance(value, torch.Tensor):
            out[key] = value
        elif is_non_tensor(value):
            raise TypeError(f"{what}: {name(key)} holds non-tensor data; only tensors are stored")
    return out


def check_layout(fields: Fields, rows: Rows) -> None:
    """``rows`` must have the keys, per-row shapes and dtypes of the stored ``fields``."""
    layout = dict(fields)
    missing = ", ".join(name(k) for k in layout if k not in rows)
    extra = ", ".join(name(k) for k in rows if k not in layout)
    if missing or extra:
        raise ValueError(
            "extend: keys differ from the buffer's layout (fixed by the first write): "
            f"missing [{missing}], extra [{extra}]"
        )
    for key, stored in layout.items():
        got, what = rows[key], f"extend: {name(key)} has"
        if got.shape[1:] != stored.shape[1:]:
            shapes = f"{list(got.shape[1:])}, the buffer stores {list(stored.shape[1:])}"
            raise ValueError(f"{what} rows of shape {shapes}")
        if got.dtype != stored.dtype:
            raise TypeError(f"{what} dtype {got.dtype}, the buffer stores {stored.dtype}")
