"""The storage half of :class:`~rlcollect.ReplayBuffer`: rows laid out, copied in and
gathered out, in host memory or on a CUDA device, where events order the copies. When
each may run is the protocol of ``rlcollect/replay/buffer.py``."""

from __future__ import annotations

import torch

from rlcollect._tensordict import TensorDict
from rlcollect.errors import CollectorError
from rlcollect.replay.frames import NEXT_OBSERVATION, OBSERVATION, TABLE, FrameStore
from rlcollect.replay.rows import Fields, Rows


class RingStorage:
    """What :class:`~rlcollect.ReplayBuffer` stores and how it copies; the buffer sets
    every attribute below in its constructor."""

    capacity: int
    device: torch.device
    pin_memory: bool
    _fields: Fields | None
    _frames: FrameStore | None  # with frame_stack, from the first write
    _writing: bool
    _write_event: torch.cuda.Event | None

    def _begin_write(self) -> None:
        if self._writing:
            raise CollectorError(
                "ReplayBuffer has one writer: extend (or load_state_dict) is already running "
                "in another thread"
            )
        self._writing = True

    def _empty(self, n: int, like: torch.Tensor) -> torch.Tensor:
        """``n`` uninitialised rows shaped like those of ``like``, in the buffer's memory."""
        shape = (n, *like.shape[1:])
        return torch.empty(shape, dtype=like.dtype, device=self.device, pin_memory=self.pin_memory)

    def _stored(self) -> Fields:
        """The row fields a write copies: the fields, and with frame_stack the table."""
        assert self._fields is not None
        return self._fields + ([] if self._frames is None else [(TABLE, self._frames.table)])

    def _stream_after(self, gathers: list[torch.cuda.Event]) -> torch.cuda.Stream | None:
        """On CUDA, the current stream, made to wait for ``gathers`` and the previous
        write: a write's copies go there."""
        if self.device.type != "cuda":
            return None
        stream = torch.cuda.current_stream(self.device)
        for event in [*gathers, self._write_event]:
            if event is not None:
                stream.wait_event(event)
        return stream

    @torch.no_grad()  # a batch that requires grad must not link the storage into its graph
    def _copy(
        self, fields: Fields, rows: Rows, first: int, stream: torch.cuda.Stream | None
    ) -> torch.cuda.Event | None:
        """Copy ``rows`` to positions ``first, first + 1, ...`` (wrapping); on CUDA on
        ``stream``, returning this write's event."""
        for key, dst in fields:
            src = rows[key]
            head = min(len(src), self.capacity - first)
            dst[first : first + head].copy_(src[:head])
            if head < len(src):  # the ring wraps: the rest goes to the front
                dst[: len(src) - head].copy_(src[head:])
        return None if stream is None else stream.record_event()

    def _gather(
        self,
        fields: Fields,
        positions: torch.Tensor,
        after: torch.cuda.Event | None,
        frames: FrameStore | None,
    ) -> tuple[TensorDict, torch.cuda.Event | None]:
        """One ``index_select`` per field, and the stacks rebuilt with frame_stack; on CUDA
        after ``after``, returning an event."""
        n = len(positions)
        stream = None
        if self.device.type == "cuda":
            stream = torch.cuda.current_stream(self.device)
            positions = positions.pin_memory().to(self.device, non_blocking=True)
            if after is not None:
                stream.wait_event(after)  # the rows of the window drawn from are written
        out = TensorDict(batch_size=[n], device=self.device)
        for key, src in fields:
            out.set(key, torch.index_select(src, 0, positions, out=self._empty(n, src)))
        if frames is not None:
            obs, nxt = frames.gather(positions, self._empty)
            out.set(OBSERVATION, obs)
            out.set(NEXT_OBSERVATION, nxt)
        if stream is None:
            return out, None
        stores = [] if frames is None else [frames.frames, frames.table]
        for src in [tensor for _, tensor in fields] + stores:  # kept until this gather is done
            src.record_stream(stream)
        return out, stream.record_event()
