"""ReplayBuffer: a fixed-capacity ring of transitions for off-policy training.

Threading protocol: one writer thread calls ``extend``, any number of threads call
``sample``. Row serial ``s`` (rows numbered in write order) lives at position
``s % capacity``. One lock, ``_cond``, guards the bookkeeping: the readable window
``[_lo, _hi)`` of serials, ``_epoch``, the samplers gathering under the current epoch
(``_readers``) and under older ones (``_old_readers``), the counters and CUDA events.
Rows are copied and gathered outside the lock, so a sampler never waits for a copy
and the writer never waits for a gather it cannot collide with.

Writer (``extend``), placing ``m`` rows at serials ``[_hi, _hi + m)``:

1. Under the lock: move ``_lo`` past the rows it will overwrite, so no sampler picks
   them from now on. If it moved, bump ``_epoch``, count every sampler now gathering as
   old and wait until no old one is left (they may have picked those rows). Samplers
   arriving meanwhile pick from the shrunk window and gather alongside the copy. If
   ``_lo`` did not move, the target positions have never held a readable row.
2. Without the lock: copy the rows in, one copy per field (two where the ring wraps).
3. Under the lock: ``_hi += m``. The rows become readable only now, fully written.

Sampler (``sample``): under the lock, draw offsets into the window (the buffer's own
generator) and register under the current epoch; gather without the lock; under the
lock, deregister and count the rows as sampled, waking the writer and ``wait_sampled``.

So a position is written only while it is outside the window and no sampler that
picked it is still gathering, and it re-enters the window only once its copy is done:
no sampled row is ever torn. While a write replaces every stored row the window is
empty; samplers then wait for that write instead of failing.

CUDA storage: a copy call returns once the copy is *queued*, so the order is carried to
the device with events. Each write records ``_write_event`` on the writer's stream; a
sampler's stream waits on the one published with the window it drew from. Each gather
records an event that the sampler hands in as it deregisters; before its next copy the
writer's stream waits on all events handed in since its last write (more than the rows
it overwrites need; it keeps the list short) and on the previous ``_write_event``, which
keeps the chain intact if the writer changes streams.

With ``frame_stack`` a write also copies its rows' new frames into the frame store
(``rlcollect/replay/frames.py``) in step 2, before the rows; the positions of each row's
frames are one more row field. Step 1 then also moves ``_lo`` past every row that names
a frame the write overwrites, so the same wait covers the frames: a frame is overwritten
only once no readable row names it and no sampler that picked such a row is gathering.
The storage half (laying out, copying, gathering) is ``rlcollect/replay/ring.py``.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from rlcollect._tensordict import TensorDict
from rlcollect.errors import CollectorError
from rlcollect.replay.frames import (
    NEXT_OBSERVATION,
    OBSERVATION,
    TABLE,
    FrameStore,
    Plan,
    check_stacks,
)
from rlcollect.replay.ring import RingStorage
from rlcollect.replay.rows import Rows, check_layout, leaves
from rlcollect.replay.state import checked, restored, saved

__all__ = ["FrameStackError", "ReplayBuffer"]


class FrameStackError(ValueError):
    """A row's frame stack is not the one rebuilt from the frames stored before it.

    Raised by ``extend`` on a buffer with ``frame_stack=k`` where a verified row's
    ``observation`` or ``("next", "observation")`` differs, bit for bit, from the stack
    its frames rebuild: the env stacks on another axis than the first, or a wrapper
    changes frames once stacked. The message names the key and the env; no row of the
    batch becomes readable.

    Examples:
        >>> from rlcollect.replay import FrameStackError
        >>> issubclass(FrameStackError, ValueError)  # bad input, found in the rows
        True
    """


class ReplayBuffer(RingStorage):
    """Uniform-sampling ring buffer of transitions, for one writer and many samplers.

    The first non-empty ``extend`` lays out the storage from its keys (nested keys
    kept), per-row shapes and dtypes, as ``[capacity, *row]`` tensors; later batches
    must match it. When full, the oldest rows are overwritten. The threading protocol
    is described in the module docstring.

    Args:
        capacity: rows kept at most.
        device: where rows are stored and samples returned: ``"cpu"`` or a CUDA device.
        pin_memory: keep storage and samples in page-locked host memory (CPU device
            only), so that ``sample(n).to("cuda", non_blocking=True)`` overlaps.
        seed: seeds the buffer's own generator; ``None`` draws a random seed.
        frame_stack: ``k`` to store each frame of stacked observations once: rows with
            ``observation`` ``[k, *frame]`` (the stack on the first axis, oldest frame
            first) and ``env_index``, ``episode`` and ``step`` (as the collector writes
            them), whose ``observation`` and ``("next", "observation")`` are rebuilt at
            ``sample()``, bit for bit (``rlcollect/replay/frames.py``; ``None``: rows as
            given). A transition then costs one frame, and each episode one more; the
            frames kept (``capacity`` and 1/16 more) hold ``capacity`` rows where
            episodes last 32 steps or more and one ``extend`` writes at most
            ``capacity / 32`` rows, fewer rows otherwise.

    Raises:
        ValueError: a bad capacity, device, seed or frame_stack, ``pin_memory`` off the
            CPU, or CUDA asked for (device or pinning) where none is available.

    Examples:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> buffer = ReplayBuffer(1_000, seed=0)
        >>> batch = TensorDict(
        ...     {"observation": torch.zeros(8, 4), ("next", "reward"): torch.ones(8)},
        ...     batch_size=[8],
        ... )
        >>> buffer.extend(batch)
        >>> len(buffer), buffer.written
        (8, 8)
        >>> minibatch = buffer.sample(32)
        >>> minibatch["next", "reward"].shape, buffer.sampled
        (torch.Size([32]), 32)
    """

    def __init__(
        self,
        capacity: int,
        *,
        device: str | torch.device = "cpu",
        pin_memory: bool = False,
        seed: int | None = None,
        frame_stack: int | None = None,
    ) -> None:
        if not isinstance(capacity, int) or isinstance(capacity, bool) or capacity < 1:
            raise ValueError(f"capacity must be a positive int, got {capacity!r}")
        if frame_stack is not None and (
            not isinstance(frame_stack, int) or isinstance(frame_stack, bool) or frame_stack < 1
        ):
            raise ValueError(f"frame_stack must be a positive int or None, got {frame_stack!r}")
        if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
            raise ValueError(f"seed must be an int or None, got {seed!r}")
        dev = torch.device(device)
        if dev.type not in ("cpu", "cuda"):
            raise ValueError(f"device must be the CPU or a CUDA device, got {dev}")
        if pin_memory and dev.type != "cpu":
            raise ValueError(f"pin_memory=True needs device='cpu', got {dev}")
        if (pin_memory or dev.type == "cuda") and not torch.cuda.is_available():
            need = "pin_memory=True" if pin_memory else f"device={dev}"
            raise ValueError(f"{need} needs CUDA, which is not available")
        if dev.type == "cuda" and dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        self.capacity, self.device, self.pin_memory = capacity, dev, pin_memory
        self.frame_stack, self._seed = frame_stack, seed
        self._generator = torch.Generator()
        if seed is None:
            self._generator.seed()
        else:
            self._generator.manual_seed(seed)
        self._cond = threading.Condition()
        self._fields, self._frames = None, None
        self._lo = self._hi = self._size = self._written = self._sampled = 0
        self._epoch = self._readers = self._old_readers = 0
        self._writing = False
        self._write_event: torch.cuda.Event | None = None
        self._gather_events: list[torch.cuda.Event] = []

    def __len__(self) -> int:
        """Rows stored now (at most ``capacity``)."""
        return self._size

    @property
    def written(self) -> int:
        """Rows ever passed to ``extend``, including those since overwritten."""
        return self._written

    @property
    def sampled(self) -> int:
        """Rows ever returned by ``sample`` (the sum of the batch sizes)."""
        return self._sampled

    @property
    def nbytes(self) -> int:
        """Bytes of storage laid out (0 before the first write): every field's, and with
        ``frame_stack`` the frames', their table's and the host's record of them."""
        fields = sum(tensor.nbytes for _, tensor in self._fields or [])
        return fields + (0 if self._frames is None else self._frames.nbytes)

    def __repr__(self) -> str:
        keys = [".".join(k) for k, _ in self._fields or []]
        stack = "" if self.frame_stack is None else f", frame_stack={self.frame_stack}"
        return (
            f"ReplayBuffer(capacity={self.capacity}, len={len(self)}, "
            f"device={self.device}, keys={keys}{stack})"
        )

    def extend(self, data: TensorDict) -> None:
        """Append the rows of ``data``; only the newest ``capacity`` rows of a larger
        batch are kept, and an empty batch changes nothing. One writer thread at a time.

        Args:
            data: TensorDict with a one-dim batch ``[n]``.

        Raises:
            TypeError: not a TensorDict, non-tensor data, or a dtype other than stored.
            ValueError: a key missing or extra, or a per-row shape other than stored;
                with ``frame_stack``, no stacks ``[n, k, *frame]`` or no integer
                ``env_index``, ``episode`` and ``step``.
            FrameStackError: with ``frame_stack``, a row's stack differs from the one
                rebuilt from its frames (no row of the batch is written).
            CollectorError: another thread is in ``extend`` or ``load_state_dict`` (the
                buffer has one writer).

        Examples:
            >>> import torch
            >>> from tensordict import TensorDict
            >>> from rlcollect import ReplayBuffer
            >>> buffer = ReplayBuffer(4)
            >>> buffer.extend(TensorDict({"x": torch.arange(6)}, batch_size=[6]))
            >>> len(buffer), buffer.written  # the newest 4 rows are kept
            (4, 6)
            >>> sorted(buffer.sample(100)["x"].unique().tolist())
            [2, 3, 4, 5]
            >>> buffer.extend(TensorDict({"y": torch.zeros(2)}, batch_size=[2]))
            Traceback (most recent call last):
            ...
            ValueError: extend: keys differ from the buffer's layout ...: missing ['x'], extra ['y']
        """
        rows = leaves(data, "extend")
        k, obs, nxt = self.frame_stack, None, None
        if k is not None:  # the stacks go to the frame store, the other fields to rows
            obs, nxt = rows.pop(OBSERVATION, None), rows.pop(NEXT_OBSERVATION, None)
            check_stacks(k, obs, nxt, None if self._frames is None else self._frames.frames)
        if self._fields is not None:
            check_layout(self._fields, rows)
        n = data.batch_size[0]
        if n == 0:
            return
        m = min(n, self.capacity)
        rows = {key: value[n - m :] for key, value in rows.items()}
        if k is None or obs is None or nxt is None:  # (check_stacks refused None)
            self._write(rows, m, n, None)
            return
        obs, nxt = obs[n - m :], nxt[n - m :]
        if self._frames is None:
            self._frames = FrameStore(self.capacity, k, obs[:, 0], self._empty, self._seed)
        dropped = n - m  # rows dropped at once (beyond capacity) count as written
        for plan in self._frames.plans(rows, obs, nxt):
            self._write(plan.rows, plan.size, plan.size + dropped, plan)
            dropped = 0

    def _write(self, rows: Rows, m: int, count: int, frames: Plan | None) -> None:
        """Write ``m`` rows (``count`` rows written, for ``written``) by the protocol of
        the module docstring; with ``frame_stack``, their frames first."""
        with self._cond:
            self._begin_write()
            if self._fields is None:
                stored = sorted((k, v) for k, v in rows.items() if k != TABLE)
                self._fields = [(k, self._empty(self.capacity, v)) for k, v in stored]
            first = self._hi % self.capacity
            lo = max(self._lo, self._hi + m - self.capacity)
            if frames is not None and self._frames is not None:
                lo = max(lo, self._frames.evict(frames))  # rows naming frames overwritten
                self._frames.forget(lo)
            if lo > self._lo:  # step 1: hide the rows to be overwritten, outwait their readers
                self._lo = lo
                self._epoch += 1
                self._old_readers += self._readers
                self._readers = 0
                self._cond.wait_for(lambda: self._old_readers == 0)
            events, self._gather_events = self._gather_events, []
        done = False
        try:  # step 2: the frames (verified), then the rows
            stream = self._stream_after(events)
            if frames is not None and self._frames is not None:
                differs = self._frames.write(frames)
                if differs:
                    raise FrameStackError(differs)
            event = self._copy(self._stored(), rows, first, stream)
            done = True
        finally:
            with self._cond:  # step 3 (after a failed copy, the hidden rows stay hidden)
                if done:
                    if frames is not None and self._frames is not None:
                        self._frames.commit(frames, self._hi)
                    self._hi += m
                    self._written += count
                    self._write_event = event
                self._size = self._hi - self._lo
                self._writing = False
                self._cond.notify_all()

    def sample(self, batch_size: int) -> TensorDict:
        """Draw ``batch_size`` rows uniformly, with replacement; safe from any thread.

        Args:
            batch_size: rows to draw.

        Returns:
            A fresh TensorDict ``[batch_size]`` on the storage device. With
            ``frame_stack``, its ``observation`` and ``("next", "observation")`` are
            two views of one gather of each row's ``k + 1`` frames: they share memory
            (clone one before writing into it).

        Raises:
            ValueError: the buffer is empty, or ``batch_size`` is not a positive int.

        Examples:
            >>> import torch
            >>> from tensordict import TensorDict
            >>> from rlcollect import ReplayBuffer
            >>> buffer = ReplayBuffer(100, seed=0)
            >>> buffer.sample(8)
            Traceback (most recent call last):
            ...
            ValueError: sample: the buffer is empty; extend it first
            >>> buffer.extend(TensorDict({"x": torch.ones(10, 3)}, batch_size=[10]))
            >>> buffer.sample(8)["x"].shape, buffer.sampled
            (torch.Size([8, 3]), 8)
        """
        if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
            raise ValueError(f"sample: batch_size must be a positive int, got {batch_size!r}")
        with self._cond:
            while self._hi == self._lo:  # empty, or a write is replacing every row
                if self._size == 0:
                    raise ValueError("sample: the buffer is empty; extend it first")
                self._cond.wait()
            offsets = torch.randint(self._hi - self._lo, (batch_size,), generator=self._generator)
            start, epoch, fields, after = self._lo, self._epoch, self._fields, self._write_event
            frames = self._frames
            self._readers += 1
        assert fields is not None
        done = False
        try:
            positions = (offsets + start % self.capacity) % self.capacity
            out, event = self._gather(fields, positions, after, frames)
            done = True
        finally:
            with self._cond:
                if epoch == self._epoch:
                    self._readers -= 1
                else:
                    self._old_readers -= 1
                if done:
                    self._sampled += batch_size
                    if event is not None:
                        self._gather_events.append(event)
                self._cond.notify_all()
        return out

    def wait_sampled(self, target: int, timeout: float) -> bool:
        """Block until ``sampled >= target`` or ``timeout`` (``>= 0``) seconds pass; returns
        whether ``sampled`` reached ``target``. The collector's ``train_ratio`` throttle
        waits here for the learner (:meth:`wait_written` is the learner's side).

        Raises:
            ValueError: a negative ``timeout``.

        Examples:
            >>> import threading
            >>> import torch
            >>> from tensordict import TensorDict
            >>> from rlcollect import ReplayBuffer
            >>> buffer = ReplayBuffer(100)
            >>> buffer.extend(TensorDict({"x": torch.zeros(10)}, batch_size=[10]))
            >>> buffer.wait_sampled(32, timeout=0.0)
            False
            >>> learner = threading.Thread(target=buffer.sample, args=(32,))
            >>> learner.start()
            >>> buffer.wait_sampled(32, timeout=10.0)
            True
            >>> learner.join()
        """
        if timeout < 0:
            raise ValueError(f"wait_sampled: timeout must be >= 0, got {timeout!r}")
        with self._cond:
            return self._cond.wait_for(lambda: self._sampled >= target, timeout)

    def wait_written(self, target: int, timeout: float) -> bool:
        """Block until ``written >= target`` or ``timeout`` (``>= 0``) seconds pass; returns
        whether ``written`` reached ``target`` (the learner's side of ``train_ratio``).

        Raises:
            ValueError: a negative ``timeout``.
        """
        if timeout < 0:
            raise ValueError(f"wait_written: timeout must be >= 0, got {timeout!r}")
        with self._cond:
            return self._cond.wait_for(lambda: self._written >= target, timeout)

    def state_dict(self) -> dict[str, Any]:
        """The stored rows (copied to the CPU), ring position, counters and generator
        state, as plain tensors, ints and dicts (``torch.load(weights_only=True)`` reads
        them back). Waits for a running write to finish.

        Returns:
            The state, for :meth:`load_state_dict` (or ``torch.save``).

        Examples:
            >>> import torch
            >>> from tensordict import TensorDict
            >>> from rlcollect import ReplayBuffer
            >>> buffer = ReplayBuffer(100, seed=0)
            >>> buffer.extend(TensorDict({"x": torch.arange(10)}, batch_size=[10]))
            >>> state = buffer.state_dict()
            >>> state["size"], state["written"], state["cursor"]
            (10, 10, 10)
        """
        with self._cond:
            self._cond.wait_for(lambda: not self._writing)
            stored: dict[str, Any] = {"storage": None, "frames": None}
            if self._fields is not None:
                if self._write_event is not None:
                    torch.cuda.current_stream(self.device).wait_event(self._write_event)
                stored = saved(self._fields, self._frames, self._size, self._hi)
            return {
                "capacity": self.capacity,
                **stored,  # the rows, and with frame_stack the frames
                "cursor": self._hi % self.capacity,
                "size": self._size,
                "written": self._written,
                "sampled": self._sampled,
                "generator": self._generator.get_state(),
            }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a ``state_dict()`` onto this buffer's device, replacing its layout;
        the buffer then samples what the saved one would have. Not while ``extend`` or
        ``sample`` runs.

        Args:
            state: what :meth:`state_dict` returned (or ``torch.load`` read back).

        Raises:
            ValueError: the state is for another capacity, or inconsistent.
            CollectorError: ``extend`` or ``sample`` is running.

        Examples:
            >>> import torch
            >>> from tensordict import TensorDict
            >>> from rlcollect import ReplayBuffer
            >>> saved = ReplayBuffer(100, seed=0)
            >>> saved.extend(TensorDict({"x": torch.arange(10)}, batch_size=[10]))
            >>> restored = ReplayBuffer(100)
            >>> restored.load_state_dict(saved.state_dict())
            >>> torch.equal(restored.sample(5)["x"], saved.sample(5)["x"])
            True
        """
        cursor, size = checked(state, self.capacity, self.frame_stack)
        with self._cond:
            if self._readers or self._old_readers:
                raise CollectorError(
                    "load_state_dict while sample is running: load the state before the "
                    "learner samples, or between two samples"
                )
            self._begin_write()
        try:
            fields, frames, event = None, None, None
            if size:  # the frames are copied on the stream of the rows' copy
                stream = self._stream_after([])
                fields, rows, frames = restored(state, self.capacity, self._empty)
                event = self._copy(fields, rows, 0, stream)
            with self._cond:
                self._generator.set_state(state["generator"])
                self._fields, self._frames, self._write_event = fields, frames, event
                self._lo, self._hi, self._size = cursor - size, cursor, size
                self._written, self._sampled = state["written"], state["sampled"]
        finally:
            with self._cond:
                self._writing = False
                self._cond.notify_all()
