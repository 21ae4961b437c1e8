"""A worker's observation copies on its own GPU (skipped where CUDA is absent).

The copier on its own, against numpy's copy of the same rows; and in a collector whose
vector-env worker answers its own requests on the GPU, where it writes every
observation of the data the tests check.
"""

import functools

import numpy as np
import pytest
import torch
from helpers import CUDA_ONLY, CountingPolicy, check_counting_streams, collect

from rlcollect import AsyncBatchedCollector
from rlcollect.inference.mapped import map_host, unmap_host
from rlcollect.inference.row_copy import DeviceRowCopier
from rlcollect.testing import CountingVectorEnv

pytestmark = CUDA_ONLY

CUDA = torch.device("cuda")


def page_array(shape, dtype):
    """A zeroed array starting on a page of its own, as the ring's fields do."""
    nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
    raw = np.zeros(nbytes + 2 * 4096, np.uint8)
    skip = -raw.ctypes.data % 4096
    return raw[skip : skip + nbytes].view(dtype).reshape(shape)


@pytest.fixture
def cells():
    """12 staging cells of 3x5x7 uint8, each filled with its own numbers, mapped."""
    rng = np.random.default_rng(0)
    array = page_array((12, 3, 5, 7), np.uint8)
    array[:] = rng.integers(0, 256, array.shape, dtype=np.uint8)
    view = map_host(array, CUDA)
    assert view is not None, "this GPU's driver refused to page-lock the cells"
    yield array, view
    unmap_host(array.ctypes.data)


def test_rows_land_where_copy_says_once_waited(cells):
    array, view = cells
    obs, nxt = page_array((14, 3, 5, 7), np.uint8), page_array((14, 3, 5, 7), np.uint8)
    counts = []
    copier = DeviceRowCopier.build(CUDA, [(view, obs, nxt)], 4, counts.append)
    assert copier is not None  # graphs of 1, 2 and 4 rows
    try:
        # 3 rows: the graph of 4 runs, its padding row writes row 4 again, never row 5.
        copier.copy(np.array([3, 11, 0]), np.array([7, 7, 2]), 2)
        # 6 rows: more than one replay holds, so two turns; the second waits for the
        # first, whose index it rewrites.
        copier.copy(np.arange(6), np.arange(11, 5, -1), 6)
        copier.wait()
        np.testing.assert_array_equal(obs[2:5], array[[3, 11, 0]])
        np.testing.assert_array_equal(nxt[2:5], array[[7, 7, 2]])
        np.testing.assert_array_equal(obs[6:12], array[np.arange(6)])
        np.testing.assert_array_equal(nxt[6:12], array[np.arange(11, 5, -1)])
        for rows in (slice(0, 2), slice(5, 6), slice(12, 14)):
            assert not obs[rows].any() and not nxt[rows].any(), f"rows {rows} were written"
        assert counts == [3, 6]
    finally:
        copier.close()
    copier.close()  # idempotent


def test_a_chunk_that_cannot_be_mapped_gives_no_copier_and_keeps_nothing_locked(cells):
    _, view = cells
    obs, nxt = page_array((4, 3, 5, 7), np.uint8), page_array((4, 3, 5, 7), np.uint8)
    taken = map_host(nxt, CUDA)  # registered already: a second registration is refused
    assert taken is not None
    try:
        assert DeviceRowCopier.build(CUDA, [(view, obs, nxt)], 4, [].append) is None
    finally:
        unmap_host(nxt.ctypes.data)
    # obs, registered before nxt was refused, was released: it maps again.
    again = map_host(obs, CUDA)
    assert again is not None
    unmap_host(obs.ctypes.data)
    # And a failed registration left no CUDA error behind for the next launch.
    assert torch.ones(1, device=CUDA).sum().item() == 1


@pytest.mark.parametrize("transport", ["process_slots", "thread"])
def test_a_vector_worker_process_copies_every_observation_on_its_gpu(transport):
    # In worker processes the GPU copies the observations of every transition the
    # worker finishes (the stats count them); in threads the worker's CPU does, as
    # the copier's graphs need a process of their own. Either way the data is whole
    # and each env's stream exact.
    envs = [functools.partial(CountingVectorEnv, 8 * i, 8, 4, order_seed=i) for i in range(2)]
    with AsyncBatchedCollector(
        envs,
        CountingPolicy(),
        transport=transport,
        policy_device="cuda",
        inference_backend="worker",
        frames_per_batch=32,
        total_frames=320,
    ) as c:
        data = collect(c)
        copied = c.stats()["server"]["rows_copied_on_device"]
    check_counting_streams(data)
    if transport == "thread":
        assert copied == 0
    else:
        # Every transition collected, at least: a worker may finish more before it stops.
        assert copied >= len(data)
