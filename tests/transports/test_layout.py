"""RingLayout: one flat buffer, every field aligned, shapes as documented."""

import dataclasses

import numpy as np
import pytest

from rlcollect.transports.layout import (
    PROGRESS,
    STAGED,
    Field,
    RingLayout,
    Staging,
    request_envs,
    request_rows,
    worker_views,
)

FIELDS = (
    Field(("observation",), (3, 5), np.dtype(np.uint8)),
    Field(("action",), (), np.dtype(np.int64)),
    Field(("next", "reward"), (), np.dtype(np.float32)),
)
ONES = {"num_workers": 1, "columns": 1, "chunk_steps": 1, "slots": 1}


def test_configuration_is_keyword_only():
    with pytest.raises(TypeError, match="positional argument"):
        RingLayout(FIELDS, 1, 1, 1, 1)  # type: ignore[misc]
    with pytest.raises(TypeError, match="positional argument"):
        Staging((("action",),), 2)  # type: ignore[misc]


def test_views_have_the_documented_shapes_and_do_not_overlap():
    layout = RingLayout(fields=FIELDS, num_workers=3, columns=2, chunk_steps=4, slots=2)
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
        RingLayout(fields=(FIELDS[0], FIELDS[0]), **ONES)
    with pytest.raises(ValueError, match="chunk_steps must be a positive int"):
        RingLayout(fields=FIELDS, **{**ONES, "chunk_steps": 0})
    with pytest.raises(ValueError, match="non-empty tuple"):
        Field((), (), np.dtype(np.uint8))
    layout = RingLayout(fields=FIELDS, **ONES)
    with pytest.raises(ValueError, match="buffer holds"):
        layout.views(np.zeros(3, np.uint8))


def test_in_place_requests_address_one_split_of_one_position():
    layout = RingLayout(fields=FIELDS, num_workers=2, columns=4, chunk_steps=3, slots=2, splits=2)
    views = layout.views(np.zeros(layout.nbytes, np.uint8))
    assert layout.request_columns == 2 and layout.requests_per_worker == 12
    obs = layout.request_sources(views, ("observation",))
    assert obs.shape == (2 * 6 * 4, 3, 5)
    assert np.shares_memory(obs, views[("observation",)])  # a view: nothing is copied
    # worker 1, position 4, split 1 -> request 4 * 2 + 1
    rows = request_rows(layout, views, np.array([1]), np.array([9]))
    obs[rows] = 7
    assert (views[("observation",)][1, 4, 2:] == 7).all()
    assert views[("observation",)].sum() == 7 * 2 * 15


def test_staged_requests_read_the_index_the_worker_wrote():
    staging = Staging(keys=(("observation",), ("action",)), columns=3)
    layout = RingLayout(
        fields=FIELDS,
        num_workers=2,
        columns=8,
        chunk_steps=4,
        slots=2,
        splits=2,
        staging=staging,
    )
    buf = np.zeros(layout.nbytes, np.uint8)
    views = layout.views(buf)
    assert views[(STAGED, "observation")].shape == (2, 16, 3, 5)  # two cells per env
    assert views[(STAGED, "action")].shape == (2, 16)
    assert views[(STAGED, "rows")].shape == (2, 2, 3)
    assert (STAGED, "next", "reward") not in views  # only the named fields are staged
    for arr in views.values():
        assert (arr.ctypes.data - buf.ctypes.data) % 4096 == 0
    assert layout.request_columns == 3 and layout.requests_per_worker == 2
    views[(STAGED, "rows")][1, 0] = [5, 0, 14]
    rows = request_rows(layout, views, np.array([1]), np.array([0]))
    assert rows.tolist() == [21, 16, 30]
    actions = layout.request_sources(views, ("action",))
    actions[rows] = [1, 2, 3]
    assert views[(STAGED, "action")][1].tolist() == [2, 0, 0, 0, 0, 1] + [0] * 8 + [3, 0]
    assert not views[("action",)].any()  # the transition field is the worker's to fill


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"splits": 3}, "4 envs per worker do not split into 3 equal groups"),
        ({"splits": 2, "slots": 1}, "splits > 1 needs slots >= 2"),
        ({"splits": 0}, "splits must be a positive int"),
        (
            {"staging": Staging(keys=(("value",),), columns=2)},
            r"Staging names fields the ring lacks: \[\('value',\)\]",
        ),
    ],
)
def test_bad_request_layouts_are_rejected(kwargs, match):
    args = {"num_workers": 1, "columns": 4, "chunk_steps": 1, "slots": 2, **kwargs}
    with pytest.raises(ValueError, match=match):
        RingLayout(fields=FIELDS, **args)
    with pytest.raises(ValueError, match="may not start with 'staged'"):
        RingLayout(fields=(Field((STAGED, "x"), (), np.dtype(np.uint8)),), **ONES)
    with pytest.raises(ValueError, match="columns must be a positive int"):
        Staging(keys=(("action",),), columns=0)


# ------------------------------------------------------------------------- pooled


def pooled(**kwargs):
    sizes = {"num_workers": 3, "columns": 4, "chunk_steps": 2, "slots": 3, **kwargs}
    return RingLayout(fields=FIELDS, pooled=True, **sizes)


def test_a_pooled_rings_workers_each_see_every_slot_and_their_own_progress():
    layout = pooled()
    views = layout.views(np.zeros(layout.nbytes, np.uint8))
    assert views[("observation",)].shape == (3, 6, 4, 3, 5)  # the same views as ever
    assert layout.credited_slots == 9 and layout.requests_per_worker == 9 * 2
    assert [layout.first_credits(w) for w in range(3)] == [(0, 3), (1, 4), (2, 5)]
    mine = layout.worker_buffers(views, 2)
    assert mine[("action",)].shape == (18, 4)  # [credited_slots * chunk_steps, columns]
    mine[("action",)][2 * 4 + 1] = 7  # slot 4 of the ring (worker 1's slot 1), step 1
    assert views[("action",)][1, 3].tolist() == [7] * 4
    assert np.shares_memory(mine[PROGRESS], views[PROGRESS][2])
    assert not np.shares_memory(mine[PROGRESS], views[PROGRESS][1])
    plain = dataclasses.replace(layout, pooled=False)
    assert plain.credited_slots == 3 and plain.first_credits(2) == (0, 1, 2)
    assert plain.worker_buffers(views, 2)[("action",)].shape == (6, 4)
    assert layout.worker_spans_ring and not plain.worker_spans_ring


def test_a_block_is_its_slots_in_order_one_contiguous_view():
    layout = pooled()
    views = layout.views(np.zeros(layout.nbytes, np.uint8))
    whole = layout.worker_buffers(views, 0)[("action",)]  # [slot * 2 + step, column]
    slots, steps, cols = np.meshgrid(np.arange(9), np.arange(2), np.arange(4), indexing="ij")
    whole[...] = (slots * 100 + steps * 10 + cols).reshape(18, 4)  # each cell names itself
    block = layout.block(views, ("action",), 1)  # slots 3, 4 and 5
    assert block.flags.c_contiguous and np.shares_memory(block, whole)
    expected = [p * 100 + t * 10 + e for p in (3, 4, 5) for t in range(2) for e in range(4)]
    assert block.tolist() == expected
    assert layout.block(views, ("observation",), 0).shape == (2 * 3 * 4, 3, 5)
    with pytest.raises(ValueError, match="pooled"):
        dataclasses.replace(layout, pooled=False).block(views, ("action",), 0)


@pytest.mark.parametrize("splits", [1, 2, 4])
def test_pooled_requests_address_the_cells_of_the_slot_they_name(splits):
    """A request's position is one of the whole ring's, whichever worker makes it: its
    rows are that slot's split of columns; they name no env (the writer does)."""
    layout = pooled(splits=splits)
    views = layout.views(np.zeros(layout.nbytes, np.uint8))
    action = layout.request_sources(views, ("action",))
    whole = layout.worker_buffers(views, 0)[("action",)]
    c = layout.request_columns
    for q in range(layout.requests_per_worker):
        rows = request_rows(layout, views, np.array([q % 3]), np.array([q]))
        action[rows] = q + 1
        p, g = divmod(q, splits)
        assert (whole[p, g * c : (g + 1) * c] == q + 1).all()
    assert len(np.unique(action)) == layout.requests_per_worker  # every cell, once
    with pytest.raises(ValueError, match="pooled"):
        request_envs(layout, np.arange(4))


def test_a_pooled_ring_is_in_place_not_in_rounds_with_two_slots():
    staging = Staging(keys=(("observation",), ("action",)), columns=2)
    for bad in ({"staging": staging}, {"rounds": True}, {"slots": 1}):
        with pytest.raises(ValueError, match="pooled RingLayout"):
            pooled(**bad)
