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
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from rlcollect._tensordict import TensorDict, TensorDictBase, is_non_tensor
from rlcollect.errors import CollectorError

__all__ = ["ReplayBuffer"]

_Rows = dict[tuple[str, ...], torch.Tensor]  # batch fields by nested key
_Fields = list[tuple[tuple[str, ...], torch.Tensor]]  # storage, in key order


def _name(key: tuple[str, ...]) -> str:
    return repr(key[0]) if len(key) == 1 else repr(key)


def _leaves(data: Any, what: str) -> _Rows:
    """The tensors of a one-dim TensorDict by nested key; anything else is refused."""
    if not isinstance(data, TensorDictBase):
        raise TypeError(f"{what} needs a TensorDict, got {type(data).__name__}")
    if data.batch_dims != 1:
        raise ValueError(f"{what} needs a one-dim batch [n], got batch_size {list(data.shape)}")
    leaves = {}
    for key, value in data.items(include_nested=True):
        key = key if isinstance(key, tuple) else (key,)
        if isinstance(value, torch.Tensor):
            leaves[key] = value
        elif is_non_tensor(value):
            raise TypeError(f"{what}: {_name(key)} holds non-tensor data; only tensors are stored")
    return leaves


def _check_layout(fields: _Fields, rows: _Rows) -> None:
    """``rows`` must have the keys, per-row shapes and dtypes of the stored ``fields``."""
    layout = dict(fields)
    missing = ", ".join(_name(k) for k in layout if k not in rows)
    extra = ", ".join(_name(k) for k in rows if k not in layout)
    if missing or extra:
        raise ValueError(
            "extend: keys differ from the buffer's layout (fixed by the first write): "
            f"missing [{missing}], extra [{extra}]"
        )
    for key, stored in layout.items():
        got, what = rows[key], f"extend: {_name(key)} has"
        if got.shape[1:] != stored.shape[1:]:
            shapes = f"{list(got.shape[1:])}, the buffer stores {list(stored.shape[1:])}"
            raise ValueError(f"{what} rows of shape {shapes}")
        if got.dtype != stored.dtype:
            raise TypeError(f"{what} dtype {got.dtype}, the buffer stores {stored.dtype}")


class ReplayBuffer:
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

    Raises:
        ValueError: a bad capacity, device or seed, ``pin_memory`` off the CPU, or
            CUDA asked for (device or pinning) where none is available.

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
    ) -> None:
        if not isinstance(capacity, int) or isinstance(capacity, bool) or capacity < 1:
            raise ValueError(f"capacity must be a positive int, got {capacity!r}")
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
        self._generator = torch.Generator()
        if seed is None:
            self._generator.seed()
        else:
            self._generator.manual_seed(seed)
        self._cond = threading.Condition()
        self._fields: _Fields | None = None
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

    def __repr__(self) -> str:
        keys = [".".join(k) for k, _ in self._fields or []]
        return (
            f"ReplayBuffer(capacity={self.capacity}, len={len(self)}, "
            f"device={self.device}, keys={keys})"
        )

    def extend(self, data: TensorDict) -> None:
        """Append the rows of ``data``; only the newest ``capacity`` rows of a larger
        batch are kept, and an empty batch changes nothing. One writer thread at a time.

        Args:
            data: TensorDict with a one-dim batch ``[n]``.

        Raises:
            TypeError: not a TensorDict, non-tensor data, or a dtype other than stored.
            ValueError: a key missing or extra, or a per-row shape other than stored.
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
        rows = _leaves(data, "extend")
        if self._fields is not None:
            _check_layout(self._fields, rows)
        n = data.batch_size[0]
        if n == 0:
            return
        m = min(n, self.capacity)
        rows = {key: value[n - m :] for key, value in rows.items()}
        with self._cond:
            self._begin_write()
            if self._fields is None:
                self._fields = [(k, self._empty(self.capacity, v)) for k, v in sorted(rows.items())]
            first = self._hi % self.capacity
            lo = max(self._lo, self._hi + m - self.capacity)
            if lo > self._lo:  # step 1: hide the rows to be overwritten, outwait their readers
                self._lo = lo
                self._epoch += 1
                self._old_readers += self._readers
                self._readers = 0
                self._cond.wait_for(lambda: self._old_readers == 0)
            events, self._gather_events = self._gather_events, []
        done = False
        try:
            event = self._copy(self._fields, rows, first, events)  # step 2
            done = True
        finally:
            with self._cond:  # step 3 (after a failed copy, the hidden rows stay hidden)
                if done:
                    self._hi += m
                    self._written += n
                    self._write_event = event
                self._size = self._hi - self._lo
                self._writing = False
                self._cond.notify_all()

    def sample(self, batch_size: int) -> TensorDict:
        """Draw ``batch_size`` rows uniformly, with replacement; safe from any thread.

        Args:
            batch_size: rows to draw.

        Returns:
            A fresh TensorDict ``[batch_size]`` on the storage device.

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
            self._readers += 1
        assert fields is not None
        done = False
        try:
            positions = (offsets + start % self.capacity) % self.capacity
            out, event = self._gather(fields, positions, after)
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
            storage = None
            if self._fields is not None:
                if self._write_event is not None:
                    torch.cuda.current_stream(self.device).wait_event(self._write_event)
                td = TensorDict(batch_size=[self._size])
                for key, tensor in self._fields:
                    td.set(key, tensor[: self._size].to("cpu", copy=True))
                storage = td.to_dict()
            return {
                "capacity": self.capacity,
                "storage": storage,  # positions [0, size): all of them once the ring is full
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
        cap, cursor, size = state["capacity"], state["cursor"], state["size"]
        if cap != self.capacity:
            raise ValueError(f"state is for capacity {cap}, this buffer has {self.capacity}")
        # below capacity the ring has never wrapped, so its rows sit at [0, size)
        if not (0 <= cursor < cap and 0 <= size <= cap and (size == cap or cursor == size)):
            raise ValueError(f"inconsistent state: cursor {cursor}, size {size}, capacity {cap}")
        if (state["storage"] is None) != (size == 0):
            raise ValueError(f"inconsistent state: size {size} but storage {state['storage']!r}")
        with self._cond:
            if self._readers or self._old_readers:
                raise CollectorError(
                    "load_state_dict while sample is running: load the state before the "
                    "learner samples, or between two samples"
                )
            self._begin_write()
        try:
            fields, event = None, None
            if size:
                rows = _leaves(TensorDict(state["storage"], batch_size=[size]), "state")
                fields = [(k, self._empty(cap, v)) for k, v in sorted(rows.items())]
                event = self._copy(fields, rows, 0, [])
            with self._cond:
                self._generator.set_state(state["generator"])
                self._fields, self._write_event = fields, event
                self._lo, self._hi, self._size = cursor - size, cursor, size
                self._written, self._sampled = state["written"], state["sampled"]
        finally:
            with self._cond:
                self._writing = False
                self._cond.notify_all()

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

    @torch.no_grad()  # a batch that requires grad must not link the storage into its graph
    def _copy(
        self, fields: _Fields, rows: _Rows, first: int, gathers: list[torch.cuda.Event]
    ) -> torch.cuda.Event | None:
        """Copy ``rows`` to positions ``first, first + 1, ...`` (wrapping); on CUDA after
        ``gathers`` and the previous write, returning this write's event."""
        stream = None
        if self.device.type == "cuda":
            stream = torch.cuda.current_stream(self.device)
            for event in [*gathers, self._write_event]:
                if event is not None:
                    stream.wait_event(event)
        for key, dst in fields:
            src = rows[key]
            head = min(len(src), self.capacity - first)
            dst[first : first + head].copy_(src[:head])
            if head < len(src):  # the ring wraps: the rest goes to the front
                dst[: len(src) - head].copy_(src[head:])
        return None if stream is None else stream.record_event()

    def _gather(
        self, fields: _Fields, positions: torch.Tensor, after: torch.cuda.Event | None
    ) -> tuple[TensorDict, torch.cuda.Event | None]:
        """One ``index_select`` per field; on CUDA after ``after``, returning an event."""
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
        if stream is None:
            return out, None
        for _, src in fields:  # the allocator keeps the storage until this gather is done
            src.record_stream(stream)
        return out, stream.record_event()
