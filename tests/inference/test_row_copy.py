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


def test_rows_land_where_gather_says_once_waited(cells):
    array, view = cells
    obs, nxt = page_array((10, 3, 5, 7), np.uint8), page_array((10, 3, 5, 7), np.uint8)
    copier = DeviceRowCopier.build(
        CUDA, {("observation",): view}, {("observation",): obs, ("next", "observation"): nxt}, 8
    )
    assert copier is not None
    try:
        first, second = np.array([3, 11, 0]), np.array([7, 7, 2, 5])
        copier.gather(("observation",), first, ("observation",), 2)
        copier.gather(("observation",), second, ("next", "observation"), 5)
        # The index holds 8 numbers: this gather waits for the two before, then reuses it.
        copier.gather(("observation",), np.array([1, 4]), ("observation",), 8)
        copier.wait()
        np.testing.assert_array_equal(obs[2:5], array[first])
        np.testing.assert_array_equal(nxt[5:9], array[second])
        np.testing.assert_array_equal(obs[8:10], array[[1, 4]])
        assert not obs[:2].any() and not obs[5:8].any(), "rows outside the runs were written"
        assert not nxt[:5].any() and not nxt[9:].any(), "rows outside the runs were written"
    finally:
        copier.close()
    copier.close()  # idempotent


def test_a_chunk_that_cannot_be_mapped_gives_no_copier_and_keeps_nothing_locked(cells):
    _, view = cells
    obs, nxt = page_array((4, 3, 5, 7), np.uint8), page_array((4, 3, 5, 7), np.uint8)
    taken = map_host(nxt, CUDA)  # registered already: a second registration is refused
    assert taken is not None
    try:
        targets = {("observation",): obs, ("next", "observation"): nxt}
        assert DeviceRowCopier.build(CUDA, {("observation",): view}, targets, 8) is None
    finally:
        unmap_host(nxt.ctypes.data)
    # obs, registered before nxt was refused, was released: it maps again.
    again = map_host(obs, CUDA)
    assert again is not None
    unmap_host(obs.ctypes.data)
    # And a failed registration left no CUDA error behind for the next launch.
    assert torch.ones(1, device=CUDA).sum().item() == 1


def test_a_vector_worker_on_the_gpu_copies_every_observation_there(monkeypatch):
    # The worker is a thread of this process (transport="thread"), so its copier's
    # calls are seen here; the data must be whole and each env's stream exact.
    calls = {"rows": 0}
    gather = DeviceRowCopier.gather

    def counted(self, source, rows, target, start):
        calls["rows"] += len(rows)
        gather(self, source, rows, target, start)

    monkeypatch.setattr(DeviceRowCopier, "gather", counted)
    env = functools.partial(CountingVectorEnv, 0, 8, 4, order_seed=3)
    with AsyncBatchedCollector(
        [env],
        CountingPolicy(),
        transport="thread",
        policy_device="cuda",
        inference_backend="worker",
        frames_per_batch=32,
        total_frames=320,
    ) as c:
        data = collect(c)
    check_counting_streams(data)
    # Two copies (observation, next observation) of every transition collected, at
    # least: a slot's rows may be copied before the collector stops taking them.
    assert calls["rows"] >= 2 * len(data)
