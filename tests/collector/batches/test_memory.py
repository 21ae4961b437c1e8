"""Batch memory is reused only once nothing can reach it (collector/batches/memory.py)."""

import numpy as np
import pytest
import torch
from helpers import counting_collector

from rlcollect._tensordict import TensorDict
from rlcollect.collector.batches.memory import KEEP, BatchMemory
from rlcollect.transports.layout import Field

FIELDS = (
    Field(("observation",), (4, 3), np.dtype(np.uint8)),
    Field(("next", "reward"), (), np.dtype(np.float32)),
    Field(("next", "done"), (), np.dtype(np.bool_)),
)


def address(array: np.ndarray) -> int:
    return int(array.__array_interface__["data"][0])


def batch(memory: BatchMemory, rows: int = 8) -> list[torch.Tensor]:
    """What the builder does with the arrays: tensors over them, the arrays let go."""
    return [torch.from_numpy(a) for a in memory.take(rows)]


KEPT = {
    "a tensor view": lambda t: t[0][2:],
    "numpy of a tensor": lambda t: t[1].numpy()[1:],
    "a TensorDict": lambda t: TensorDict({"done": t[2]}, batch_size=[8]),
    "a tensor of another shape": lambda t: t[0].view(-1)[5:9],
}


@pytest.mark.parametrize("kept", KEPT.values(), ids=KEPT.keys())
def test_a_buffer_is_reused_only_once_every_view_of_it_is_gone(kept):
    memory = BatchMemory(FIELDS)
    tensors = batch(memory)
    first = address(tensors[0].numpy())
    view = kept(tensors)
    del tensors
    # One view of one field is left: the buffer is not handed out again.
    other = memory.take(8)
    assert memory.reused == 0
    assert address(other[0]) != first
    del other, view
    again = memory.take(8)
    assert memory.reused == 1
    assert address(again[0]) == first  # the oldest free buffer goes first


def test_a_batch_written_after_reuse_does_not_change_a_kept_view():
    memory = BatchMemory(FIELDS)
    tensors = batch(memory)
    tensors[0].fill_(7)
    view = tensors[0][1:]
    del tensors
    for _ in range(4):  # batches dropped and taken again while the view is kept
        for array in memory.take(8):
            array.fill(1)
    assert bool((view == 7).all())


def test_a_buffer_of_another_size_is_not_reused():
    memory = BatchMemory(FIELDS)
    memory.take(8)  # dropped at once
    memory.take(4)
    assert memory.reused == 0


def test_at_most_keep_free_buffers_are_kept():
    memory = BatchMemory(FIELDS)
    held = [memory.take(8) for _ in range(KEEP + 3)]
    del held  # all let go at once: only KEEP of them are kept
    held = [memory.take(8) for _ in range(KEEP + 3)]  # held: none freed meanwhile
    assert memory.reused == KEEP
    assert len({address(arrays[0]) for arrays in held}) == KEEP + 3


def test_batches_kept_in_part_stay_intact_while_the_others_are_reused(transport):
    """Through the collector: some batches are kept as views, the rest dropped, so later
    batches are built in their memory; every kept view still reads what it was given."""
    kept = []
    with counting_collector(transport, frames_per_batch=32, total_frames=640) as c:
        for i, b in enumerate(c):
            if i % 3 == 0:
                view = b["observation"][5:]
                kept.append((view, view.clone()))
            del b
        reuses = c.stats()["batch_memory_reuses"]
    assert len(kept) == 7
    assert reuses > 0  # the dropped batches' memory was built in again
    for view, copy in kept:
        assert torch.equal(view, copy)
