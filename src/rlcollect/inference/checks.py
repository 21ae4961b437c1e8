"""What the policy hands back, checked before it lands anywhere.

Outputs go into the ring's rows (:func:`scatter_outputs`, each checked by
:func:`check_output`), new weights into the served policy (:func:`check_weights`). Every
backend shares these checks, so a policy that changes an output's shape or dtype, or
weights that do not match, fail with the same message whichever backend serves it: the
server's batches, the in-worker policy's own requests, the process backend's and the
distributed collector's weight updates.

New weights are checked whole before any is copied, so a failed update leaves the policy
as it was. An output is checked before it is written: a new shape or a lossy cast fails,
naming the output, where numpy would broadcast or truncate it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import numpy as np
import torch

from rlcollect.transports.layout import Key

__all__ = ["check_output", "check_weights", "output_cast", "scatter_outputs"]


def scatter_outputs(
    outputs: Mapping[Key, np.ndarray], fields: Mapping[Key, np.ndarray], flat: np.ndarray
) -> None:
    """Write a batch's outputs into rows ``flat`` of their ring fields (``[rows, ...]``),
    each checked first (the server's batches and a worker's own requests alike).

    Raises:
        ValueError: the policy returned other outputs, or another shape per env, than
            when the collector was built.
        TypeError: see :func:`check_output`.
    """
    if outputs.keys() != fields.keys():
        raise ValueError(
            f"policy returned outputs {sorted(outputs)}, but {sorted(fields)} "
            "when the collector was built"
        )
    for key, src in outputs.items():
        dst = fields[key]
        check_output(key, src, dst)
        dst[flat] = src


def check_output(key: Key, src: np.ndarray, dst: np.ndarray) -> None:
    """Check a policy output ``[B, ...]`` against the ring field it goes to (``[rows,
    ...]``), by shape per env and by dtype (both backends and the workers' own policy).

    The action is cast to its field's dtype, the action space's, where the kind stays
    (float64 actions into a float32 ``Box``); every other output keeps the dtype it had
    when the collector was built, or one that widens into it (:func:`output_cast`).

    Raises:
        ValueError: another shape per env than when the collector was built.
        TypeError: a dtype the field's cannot hold without loss (floats into integers;
            for an output other than the action, float64 into float32 too).
    """
    if src.shape[1:] != dst.shape[1:]:
        raise ValueError(
            f"policy output {key} has shape {src.shape[1:]} per env, but it had "
            f"{dst.shape[1:]} when the collector was built"
        )
    if src.dtype != dst.dtype and not np.can_cast(src.dtype, dst.dtype, output_cast(key)):
        # numpy's assignment would cast anyway: floats into integers, truncated
        raise TypeError(
            f"policy output {key} is {src.dtype} now, but it was {dst.dtype} when "
            "the collector was built; a cast would lose what it holds"
        )


def output_cast(key: Key) -> Literal["same_kind", "safe"]:
    """The casts allowed from what the policy returns for ``key`` into its ring field
    (numpy's names): the action is the action space's dtype whatever the policy's
    arithmetic (``"same_kind"``: no floats into integers); any other output was recorded
    with the policy's own dtype, so a narrower one later (float64 where it gave float32)
    would be rounded without a word (``"safe"`` casts only)."""
    return "same_kind" if key == ("action",) else "safe"


def check_weights(
    state_dict: Mapping[str, Any], policy: Mapping[str, tuple[tuple[int, ...], torch.dtype]]
) -> None:
    """Check new weights against the policy's (``policy``: each weight's shape and dtype,
    by name) before anything changes: every backend copies them only once this passed,
    so that no copy can fail half-way through an update (the thread backend would act
    with some new weights under the old version; the others would leave a slot half
    written).

    Raises:
        KeyError: a name missing, or one the policy lacks.
        TypeError: a weight that is not a tensor, or whose dtype the policy's cannot
            hold without loss (floats into integers, complex into reals).
        ValueError: a weight of another shape, or one that cannot be copied as it is:
            a meta tensor (no data), a sparse or otherwise non-dense one, a quantized one.
    """
    missing = set(policy) - set(state_dict)
    unexpected = set(state_dict) - set(policy)
    if missing or unexpected:
        raise KeyError(
            f"weights do not match the policy: missing {sorted(missing)}, "
            f"unexpected {sorted(unexpected)}"
        )
    for name, value in state_dict.items():
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"weight {name!r} is a {type(value).__name__}, not a torch.Tensor")
    for name, value in state_dict.items():
        shape = policy[name][0]
        if tuple(value.shape) != shape:
            raise ValueError(
                f"weight {name!r} has shape {tuple(value.shape)}, the policy's has {shape}"
            )
    for name, value in state_dict.items():
        _check_copyable(name, value, policy[name][1])


def _check_copyable(name: str, value: torch.Tensor, dtype: torch.dtype) -> None:
    """``value`` can be copied into a dense tensor of ``dtype`` (``copy_``) as it is."""
    if value.is_meta:
        raise ValueError(
            f"weight {name!r} is a meta tensor: it has a shape but no data to copy "
            "(load or materialise it first)"
        )
    if value.layout != torch.strided:
        raise ValueError(
            f"weight {name!r} has layout {value.layout}; the policy's weights are dense "
            "(torch.strided): pass value.to_dense()"
        )
    if value.is_quantized:
        raise ValueError(f"weight {name!r} is quantized; pass value.dequantize()")
    if not torch.can_cast(value.dtype, dtype):
        raise TypeError(
            f"weight {name!r} is {value.dtype}, the policy's is {dtype}: the copy would "
            "lose what it holds"
        )
