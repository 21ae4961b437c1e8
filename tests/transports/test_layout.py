"""RingLayout: one flat buffer, every field aligned, shapes as documented."""

import numpy as np
import pytest

from rlcollect.transports.layout import Field, RingLayout, worker_views

FIELDS = (
    Field(("observation",), (3, 5), np.dtype(np.uint8)),
    Field(("action",), (), np.dtype(np.int64)),
    Field(("next", "reward"), (), np.dtype(np.float32)),
)


def test_views_have_the_documented_shapes_and_do_not_overlap():
    layout = RingLayout(FIELDS, num_workers=3, envs_per_worker=2, chunk_steps=4, slots=2)
    buf = np.zeros(layout.nbytes, np.uint8)
    views = layout.views(buf)
    assert views[("observation",)].shape == (3, 8, 2, 3, 5)
    assert views[("action",)].shape == (3, 8, 2)
    for i, arr in enumerate(views.values()):
        assert (arr.ctypes.data - buf.ctypes.data) % 4096 == 0  # each field on its own page
        arr[...] = i + 1
    for i, arr in enumerate(views.values()):
        assert (arr == i + 1).all(), "fields overlap"
    assert worker_views(views, 1)[("action",)].shape == (8, 2)


def test_bad_layouts_are_rejected():
    with pytest.raises(ValueError, match="duplicate field keys"):
        RingLayout((FIELDS[0], FIELDS[0]), 1, 1, 1, 1)
    with pytest.raises(ValueError, match="chunk_steps must be a positive int"):
        RingLayout(FIELDS, 1, 1, 0, 1)
    with pytest.raises(ValueError, match="non-empty tuple"):
        Field((), (), np.dtype(np.uint8))
    layout = RingLayout(FIELDS, 1, 1, 1, 1)
    with pytest.raises(ValueError, match="buffer holds"):
        layout.views(np.zeros(3, np.uint8))
