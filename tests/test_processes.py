"""Shared-memory segments (rlcollect/processes.py): a shortage of /dev/shm is a clear error
when the segment is created, never a SIGBUS later; a mapping's pages entered at once."""

import mmap
import os
import re

import pytest

from rlcollect import processes
from rlcollect.errors import CollectorError
from rlcollect.processes import attach_segment, create_segment, shm_free_bytes, unlink_segment


def test_a_segment_is_backed_in_full_when_created():
    size = 8 * 2**20
    name, ring = create_segment("rlc_test_", size)
    try:
        # every page is allocated now (st_blocks counts 512-byte units), not when touched
        assert os.stat(f"/dev/shm/{name}").st_blocks * 512 >= size
    finally:
        ring.close()
        unlink_segment(name)
    assert not os.path.exists(f"/dev/shm/{name}")


def test_a_segment_larger_than_the_free_space_is_refused_with_the_remedy():
    free = shm_free_bytes()
    assert free is not None and free > 0
    before = set(os.listdir("/dev/shm"))
    with pytest.raises(CollectorError) as info:
        create_segment("rlc_test_", free + 2**30)
    message = str(info.value)
    needed, has = (float(x) for x in re.findall(r"([\d.]+) MiB", message)[:2])
    assert needed == pytest.approx((free + 2**30) / 2**20, abs=0.1)
    assert has == pytest.approx(free / 2**20, rel=0.05)  # others may use /dev/shm meanwhile
    assert "--shm-size" in message and "frames_per_batch" in message
    # nothing was created (other tests may create segments meanwhile: ours have our prefix)
    assert not [n for n in set(os.listdir("/dev/shm")) - before if n.startswith("rlc_test_")]


@pytest.mark.parametrize("populate", [True, False])
def test_map_every_page_leaves_no_page_to_fault_in(monkeypatch, populate):
    """After map_every_page, writing every page of a fresh mapping of a segment takes no
    page fault, with MADV_POPULATE_WRITE and with the reads an older kernel gets
    instead (forced here by an advice the kernel refuses); the contents are untouched."""
    if not populate:
        monkeypatch.setattr(processes, "_MADV_POPULATE_WRITE", 10_000)
    pages, page = 1024, mmap.PAGESIZE
    name, owner = create_segment("rlc_test", pages * page)
    try:
        owner[page : page + 3] = b"abc"
        mapping = attach_segment(name, pages * page)
        processes.map_every_page(mapping)
        before = _minor_faults()
        for offset in range(0, pages * page, page):
            mapping[offset] = 7
        assert _minor_faults() - before < pages // 16
        assert owner[page + 1 : page + 3] == b"bc" and owner[0] == 7
        mapping.close()
    finally:
        unlink_segment(name)
        owner.close()


def _minor_faults() -> int:
    # This thread's own count: no other thread of the test process adds to it.
    with open("/proc/thread-self/stat") as stat:
        return int(stat.read().rsplit(")", 1)[1].split()[7])
