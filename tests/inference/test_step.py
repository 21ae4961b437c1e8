"""The action step's host side (inference/step.py); its GPU side is in test_cuda.py."""

import ctypes
import mmap

import numpy as np

from rlcollect.inference.step import _alias


def _through(address: int, nbytes: int) -> np.ndarray:
    return np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(address))


def test_an_alias_maps_the_same_pages_and_private_memory_has_none():
    """The server thread page-locks an alias of the ring, never the caller's view."""
    storage = mmap.mmap(-1, 3 * mmap.PAGESIZE)
    ring = np.frombuffer(storage, dtype=np.uint8).reshape(3, mmap.PAGESIZE)
    alias = _alias(ring)
    assert alias is not None
    assert alias.address == alias.start != ring.ctypes.data
    assert alias.nbytes == ring.nbytes
    other = _through(alias.address, ring.nbytes)
    ring[1, 5] = 7
    assert other[mmap.PAGESIZE + 5] == 7
    other[2 * mmap.PAGESIZE] = 9
    assert ring[2, 0] == 9
    del other
    alias.unmap()
    assert ring[1, 5] == 7  # the ring's own mapping is untouched
    private = np.zeros(2 * mmap.PAGESIZE + 4096, dtype=np.uint8)
    aligned = private[-private.ctypes.data % mmap.PAGESIZE :][: mmap.PAGESIZE]
    assert _alias(aligned) is None  # not shared: no second mapping of it


def test_a_ring_off_a_page_is_aliased_from_its_first_page():
    """A field that starts mid-page and ends mid-page: the alias covers its pages whole,
    and the ring's first byte is at the same offset in it."""
    storage = mmap.mmap(-1, 4 * mmap.PAGESIZE)
    ring = np.frombuffer(storage, dtype=np.uint8, offset=100, count=2 * mmap.PAGESIZE)
    alias = _alias(ring)
    assert alias is not None
    assert alias.address - alias.start == 100
    assert alias.nbytes == 3 * mmap.PAGESIZE  # bytes 100 .. 2 pages + 100: three pages
    other = _through(alias.address, ring.nbytes)
    ring[:] = np.arange(ring.size) % 251
    assert np.array_equal(other, ring)
    del other
    alias.unmap()
