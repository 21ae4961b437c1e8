"""RingLayout: one flat buffer, every field aligned, shapes as documented."""

import numpy as np
import pytest

from rlcollect.transports.layout import (
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
ONES = {"num_workers": 1, "envs_per_worker": 1, "chunk_steps": 1, "slots": 1}


def test_configuration_is_keyword_only():
    with pytest.raises(TypeError, match="positional argument"):
        RingLayout(FIELDS, 1, 1, 1, 1)  # type: ignore[misc]
    with pytest.raises(TypeError, match="positional argument"):
        Staging((("action",),), 2)  # type: ignore[misc]


def test_views_have_the_documented_shapes_and_do_not_overlap():
    layout = RingLayout(fields=FIELDS, num_workers=3, envs_per_worker=2, chunk_steps=4, slots=2)
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


def test_in_place_requests_address_one_group_of_one_position():
    layout = RingLayout(
        fields=FIELDS, num_workers=2, envs_per_worker=4, chunk_steps=3, slots=2, groups=2
    )
    views = layout.views(np.zeros(layout.nbytes, np.uint8))
    assert layout.request_columns == 2 and layout.requests_per_worker == 12
    obs = layout.request_sources(views, ("observation",))
    assert obs.shape == (2 * 6 * 4, 3, 5)
    assert np.shares_memory(obs, views[("observation",)])  # a view: nothing is copied
    # worker 1, position 4, group 1 -> request 4 * 2 + 1
    rows = request_rows(layout, views, np.array([1]), np.array([9]))
    obs[rows] = 7
    assert (views[("observation",)][1, 4, 2:] == 7).all()
    assert views[("observation",)].sum() == 7 * 2 * 15


def test_staged_requests_read_the_index_the_worker_wrote():
    staging = Staging(keys=(("observation",), ("action",)), columns=3)
    layout = RingLayout(
        fields=FIELDS,
        num_workers=2,
        envs_per_worker=8,
        chunk_steps=4,
        slots=2,
        groups=2,
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
        ({"groups": 3}, "4 envs per worker do not split into 3 equal groups"),
        ({"groups": 2, "slots": 1}, "groups > 1 needs slots >= 2"),
        ({"groups": 0}, "groups must be a positive int"),
        (
            {"staging": Staging(keys=(("value",),), columns=2)},
            r"Staging names fields the ring lacks: \[\('value',\)\]",
        ),
    ],
)
def test_bad_request_layouts_are_rejected(kwargs, match):
    args = {"num_workers": 1, "envs_per_worker": 4, "chunk_steps": 1, "slots": 2, **kwargs}
    with pytest.raises(ValueError, match=match):
        RingLayout(fields=FIELDS, **args)
    with pytest.raises(ValueError, match="may not start with 'staged'"):
        RingLayout(fields=(Field((STAGED, "x"), (), np.dtype(np.uint8)),), **ONES)
    with pytest.raises(ValueError, match="columns must be a positive int"):
        Staging(keys=(("action",),), columns=0)


# ------------------------------------------------------------------- position-major


def position_major(**kwargs):
    sizes = {"num_workers": 3, "envs_per_worker": 4, "chunk_steps": 2, "slots": 3, **kwargs}
    return RingLayout(fields=FIELDS, position_major=True, **sizes)


def test_position_major_views_keep_their_shapes_and_fields_their_pages():
    layout = position_major()
    buf = np.zeros(layout.nbytes, np.uint8)
    views = layout.views(buf)
    assert views[("observation",)].shape == (3, 6, 4, 3, 5)  # [workers, positions, envs]
    assert worker_views(views, 2)[("action",)].shape == (6, 4)
    for i, arr in enumerate(views.values()):
        assert (arr.ctypes.data - buf.ctypes.data) % 4096 == 0
        arr[...] = i + 1
    for i, arr in enumerate(views.values()):
        assert (arr == i + 1).all(), "fields overlap"


def test_a_slot_of_every_worker_is_one_block_in_step_worker_env_order():
    layout = position_major()
    views = layout.views(np.zeros(layout.nbytes, np.uint8))
    action = views[("action",)]
    workers, positions, envs = np.meshgrid(np.arange(3), np.arange(6), np.arange(4), indexing="ij")
    action[...] = workers * 100 + positions * 10 + envs  # each cell names itself
    block = layout.slot_block(views, ("action",), 2)  # positions 4 and 5
    assert block.flags.c_contiguous and np.shares_memory(block, action)
    expected = [w * 100 + p * 10 + e for p in (4, 5) for w in range(3) for e in range(4)]
    assert block.tolist() == expected
    block[:] = -1  # a view: what the workers wrote is what the block reads
    assert (action[:, 4:6] == -1).all() and (action[:, :4] >= 0).all()
    obs = layout.slot_block(views, ("observation",), 0)
    assert obs.shape == (2 * 3 * 4, 3, 5)


def test_worker_major_rings_of_several_workers_have_no_slot_block():
    layout = RingLayout(fields=FIELDS, num_workers=2, envs_per_worker=1, chunk_steps=1, slots=1)
    views = layout.views(np.zeros(layout.nbytes, np.uint8))
    with pytest.raises(ValueError, match="position_major"):
        layout.slot_block(views, ("action",), 0)


@pytest.mark.parametrize("groups", [1, 2, 4])
def test_position_major_requests_address_the_cells_they_name(groups):
    """Every request's flat rows land in its own group of its own position and worker,
    and name those envs: the server's gather, its scatter and the recurrent state's
    env keys all follow the memory, whichever order it has."""
    layout = position_major(groups=groups)
    views = layout.views(np.zeros(layout.nbytes, np.uint8))
    action = layout.request_sources(views, ("action",))
    assert np.shares_memory(action, views[("action",)])  # a view: nothing is copied
    c = layout.request_columns
    for w in range(3):
        for q in range(layout.requests_per_worker):
            rows = request_rows(layout, views, np.array([w]), np.array([q]))
            action[rows] = 1000 * (w + 1) + q
            p, g = divmod(q, groups)
            assert (views[("action",)][w, p, g * c : (g + 1) * c] == 1000 * (w + 1) + q).all()
            first = w * 4 + g * c
            assert request_envs(layout, rows).tolist() == list(range(first, first + c))
    assert len(np.unique(action)) == 3 * layout.requests_per_worker  # every cell, once


def test_staged_rings_of_several_workers_cannot_be_position_major():
    staging = Staging(keys=(("observation",), ("action",)), columns=2)
    with pytest.raises(ValueError, match="cannot be position_major"):
        position_major(staging=staging)
    one = position_major(num_workers=1, staging=staging)  # one worker: the same memory
    views = one.views(np.zeros(one.nbytes, np.uint8))
    assert views[("action",)].flags.c_contiguous
