"""What :meth:`~rlcollect.ReplayBuffer.state_dict` holds beside the ring's position and
counters (the rows, and with ``frame_stack`` the frames), and the checks of a state
before :meth:`~rlcollect.ReplayBuffer.load_state_dict` loads it."""

from __future__ import annotations

from typing import Any

from rlcollect._tensordict import TensorDict
from rlcollect.replay.frames import Empty, FrameStore
from rlcollect.replay.rows import Fields, Rows, leaves


def saved(fields: Fields, frames: FrameStore | None, size: int, hi: int) -> dict[str, Any]:
    """The rows at positions ``[0, size)`` (all of them once the ring is full), copied
    to the CPU, and the frame store's state. With frame_stack, the positions that ever
    held a row: the window of readable rows may be shorter than the ring's rows."""
    filled = size if frames is None else frames.filled
    rows = TensorDict(batch_size=[filled])
    for key, tensor in fields:
        rows.set(key, tensor[:filled].to("cpu", copy=True))
    return {
        "storage": rows.to_dict(),
        "frames": None if frames is None else frames.state_dict(hi),
    }


def checked(state: dict[str, Any], capacity: int, frame_stack: int | None) -> tuple[int, int]:
    """The state's cursor and size, once it is found to fit a buffer of ``capacity``
    rows and ``frame_stack``."""
    cap, cursor, size = state["capacity"], state["cursor"], state["size"]
    if cap != capacity:
        raise ValueError(f"state is for capacity {cap}, this buffer has {capacity}")
    frames = state.get("frames")  # absent from the states of buffers without frame_stack
    filled = size if frames is None else frames["filled"]
    # below capacity the ring has never wrapped, so its rows sit at [0, filled)
    if not (0 <= cursor < cap and 0 <= size <= filled <= cap) or (
        filled < cap and cursor != filled
    ):
        raise ValueError(f"inconsistent state: cursor {cursor}, size {size}, capacity {cap}")
    if (state["storage"] is None) != (size == 0):
        raise ValueError(f"inconsistent state: size {size} but storage {state['storage']!r}")
    k = None if frames is None else frames["frame_stack"]
    if size and k != frame_stack:
        raise ValueError(f"state is for frame_stack={k}, this buffer has {frame_stack}")
    return cursor, size


def restored(
    state: dict[str, Any], capacity: int, empty: Empty
) -> tuple[Fields, Rows, FrameStore | None]:
    """Storage laid out for a checked state of ``size > 0``: its fields (still to be
    filled from the rows returned) and its frame store (filled, on the current stream)."""
    saved_frames = state.get("frames")
    filled = state["size"] if saved_frames is None else saved_frames["filled"]
    rows = leaves(TensorDict(state["storage"], batch_size=[filled]), "state")
    fields = [(key, empty(capacity, value)) for key, value in sorted(rows.items())]
    frames = None
    if saved_frames is not None:
        k = saved_frames["frame_stack"]
        frames = FrameStore(capacity, k, saved_frames["frames"], empty, 0)
        frames.load_state_dict(saved_frames, state["cursor"])
    return fields, rows, frames
