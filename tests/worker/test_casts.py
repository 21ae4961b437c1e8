"""What numpy's same_kind cast of an observation into the ring would lose is found."""

import numpy as np

from rlcollect.worker.casts import cast_loss


def copied(src, dtype):
    dst = np.empty(np.shape(src), dtype)
    np.copyto(dst, src, casting="same_kind")
    return dst


def test_rounding_is_no_loss_but_a_value_turned_inf_or_wrapped_is():
    small = np.array([0.1, -3.4e38])
    assert cast_loss(small, copied(small, np.float32)) is None  # rounded, within range
    far = np.array([0.1, 1e300])
    assert cast_loss(far, copied(far, np.float32)) == (
        "holding 1e+300, which float32 (its observation space's dtype) cannot hold: it "
        "would be stored as inf"
    )
    assert cast_loss(np.array(np.inf), copied(np.array(np.inf), np.float32)) is None
    big = np.array([1, 300], np.int64)
    assert "holding 300, which int8" in (cast_loss(big, copied(big, np.int8)) or "")
    ints = np.array([1, 2], np.int64)
    assert cast_loss(ints, copied(ints, np.int32)) is None
    assert cast_loss(ints, copied(ints, np.float32)) is None  # ints into floats: rounding
