"""The casts a worker makes into the ring, checked for what they would lose.

An env's observation is stored with its observation space's dtype. numpy's
``same_kind`` cast, which the worker uses where the env returns another dtype, rounds
float64 into float32 (expected: the space says float32) but also turns a value beyond
float32's range into ``inf``, and wraps an integer that does not fit a narrower integer
dtype, without a word. :func:`cast_loss` finds those after the copy, so that the worker
can refuse the observation, naming the env, instead of storing a value the env never
returned. It runs only where the dtypes differ and the cast narrows, off the usual path.
"""

from __future__ import annotations

import numpy as np

__all__ = ["cast_loss"]


def cast_loss(src: np.ndarray, dst: np.ndarray) -> str | None:
    """What copying ``src`` into ``dst`` (same shape, done already) lost beyond
    rounding, as the end of a message; None when nothing was lost."""
    src_kind, dst_kind = src.dtype.kind, dst.dtype.kind
    if dst_kind in "iu" and src_kind in "iub":
        lost = src != dst  # a wrapped integer
    elif dst_kind == "f" and src_kind == "f" and src.dtype.itemsize > dst.dtype.itemsize:
        lost = np.isinf(dst) & np.isfinite(src)  # beyond the narrower float's range
    else:
        return None
    if not lost.any():
        return None
    value, stored = src[lost].flat[0].item(), dst[lost].flat[0].item()
    return (
        f"holding {value!r}, which {dst.dtype} (its observation space's dtype) cannot "
        f"hold: it would be stored as {stored!r}"
    )
