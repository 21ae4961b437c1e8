"""The rollout ring: where every transition field lives while a chunk is being built.

Each worker owns ``slots`` chunk buffers (*slots*) of ``chunk_steps`` steps of each of
its ``columns`` (env lanes: sub-envs of vector envs count one by one). A *position*
``p = slot * chunk_steps + t`` names one step of one worker; every transition field is
seen as ``[num_workers, positions, columns, *shape]``, so the driver copies a chunk out
with one slice. All fields share one flat buffer, which is what makes a single
shared-memory segment enough for a whole collector.

A *pooled* ring (``pooled=True``) is the same memory seen another way: its
``num_workers * slots`` slots are shared by every worker, a worker writes the slot its
credit names, and every ``num_workers`` consecutive slots are one contiguous *block*
(:meth:`RingLayout.block`), which a batch can view instead of copying. ``slots.py``
holds both ways of addressing slots; :class:`RingLayout` answers every question whose
answer differs (``credited_slots``, ``first_credits``, ``worker_buffers``,
``worker_spans_ring``), so no transport reads ``pooled`` itself.

Requests (what the inference server reads observations from and writes actions into)
address the ring in one of two ways, fixed per collector:

*In place* (envs stepped one by one; ``staging is None``)
    A worker's columns form ``splits`` equal splits of ``columns // splits`` columns.
    Request ``q = p * splits + g`` is split ``g`` at position ``p``: the server reads
    its observations from, and writes its actions into, the very cells that become the
    chunk's transitions. Nothing is copied for a request. (Pooled, ``p`` is a position
    of the whole ring: of whichever slot the worker writes.)

*Staged* (vector envs; ``staging`` set)
    A vector env returns results for a subset of its sub-envs, so request columns do
    not line up with chunk columns. Each staged field (observation leaves, policy
    outputs, ``policy_version``) has a second array ``("staged", *key)`` of shape
    ``[num_workers, 2 * columns, *shape]``: two cells per column (column ``e``'s are
    ``e`` and ``e + columns``), used in turn. One holds the observation an env's action
    is being chosen for (and then the outputs computed from it); the other still holds
    the step before, whose transition the worker copies into the chunk *after* sending
    the new request, so that copy is off the path from a result to its actions.
    Request ``q`` (``0 <= q < splits``, one per vector env of the worker) names the
    ``staging.columns`` cells listed in ``("staged", "rows")[worker, q]``.

:func:`request_rows` turns ``(worker, request)`` pairs into flat row indices for
either way, so the server and any stand-in for it gather and scatter the same rows.
"""

from __future__ import annotations

import mmap
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import numpy as np

from rlcollect.transports.slots import SlotAddressing, request_envs, slot_addressing

__all__ = [
    "Field",
    "Key",
    "RingLayout",
    "Staging",
    "request_envs",
    "request_rows",
    "worker_views",
]

Key = tuple[str, ...]
"""A TensorDict key as a tuple of names: ``("observation",)``, ``("next", "reward")``.

The ring's arrays (``RingLayout.views``, an end's ``buffers``) are keyed by it.
"""

Path = tuple[str, ...]
"""Where a leaf sits inside one observation: the names of the ``Dict`` spaces above it,
``()`` for a plain array observation. Its ring key is ``("observation", *path)``.
"""

#: First name of every staged array's key; ``(STAGED, "rows")`` is the request index.
STAGED = "staged"

#: Key of the workers' progress records, ``[num_workers, PROGRESS_WIDTH]`` int64: what
#: each worker is doing and since when, written by the worker and read by the driver to
#: tell a stalled env from a slow one (``stall_timeout``; ``collector/batches/stall.py`` keeps
#: the record's protocol). Every ring has it, beside the transition fields.
PROGRESS: Key = ("progress",)
PROGRESS_WIDTH = 4

_ALIGN = 4096  # a page: no two fields share a cache line (no false sharing), and each
# field can be page-locked (cudaHostRegister) on its own


@dataclass(frozen=True)
class Field:
    """One transition field: its TensorDict key, per-env shape and dtype.

    Args:
        key: the TensorDict key as a tuple of names, e.g. ``("next", "reward")``.
        shape: the shape of one env's value (``()`` for a scalar).
        dtype: the numpy dtype.

    Raises:
        ValueError: the key is empty or holds an empty or non-string name.

    Examples:
        >>> import numpy as np
        >>> from rlcollect.transports import Field
        >>> Field(("observation", "pixels"), (84, 84), np.dtype(np.uint8)).key
        ('observation', 'pixels')
        >>> Field((), (), np.dtype(np.uint8))
        Traceback (most recent call last):
        ...
        ValueError: field key must be a non-empty tuple of names, got ()
    """

    key: Key
    shape: tuple[int, ...]
    dtype: np.dtype[np.generic]

    def __post_init__(self) -> None:
        if not self.key or not all(isinstance(k, str) and k for k in self.key):
            raise ValueError(f"field key must be a non-empty tuple of names, got {self.key!r}")


@dataclass(frozen=True, kw_only=True)
class Staging:
    """Staged requests (vector envs): which fields are staged, and rows per request.

    Args:
        keys: the fields with a staging array (observation leaves, policy outputs,
            ``policy_version``).
        columns: rows per request: the sub-envs a vector env returns at a time.

    Raises:
        ValueError: no keys, or ``columns`` not a positive int.

    Examples:
        >>> from rlcollect.transports import Staging
        >>> Staging(keys=(("observation",), ("action",)), columns=4).columns
        4
    """

    keys: tuple[Key, ...]
    columns: int

    def __post_init__(self) -> None:
        if not self.keys:
            raise ValueError("Staging.keys must name at least one field")
        if not isinstance(self.columns, int) or self.columns < 1:
            raise ValueError(f"Staging.columns must be a positive int, got {self.columns!r}")


@dataclass(frozen=True, kw_only=True)
class RingLayout:
    """Shape of the rollout ring shared by all workers of one collector.

    ``splits`` is the number of requests a worker may hold at once (double buffering:
    one split of its columns steps while another waits for its actions).

    Args:
        fields: every transition field (unique keys; none may start with ``"staged"``).
        num_workers: workers sharing the ring.
        columns: env columns per worker (sub-envs of vector envs one by one).
        chunk_steps: steps of each column per chunk.
        slots: chunk slots per worker.
        splits: requests a worker may hold at once.
        staging: staged requests (vector envs), or None for in-place requests.
        rounds: workers run in on-policy rounds (``on_policy=True``): every split steps
            a slot's last position before the worker waits for the next slot, so one
            slot is enough with ``splits > 1``.
        pooled: the ring's slots are shared by every worker, which writes the slot its
            credit names (:meth:`first_credits`, :meth:`worker_buffers`), and every
            ``num_workers`` of them are one block (:meth:`block`); ``slots.py``. In
            place only, not in rounds; the views are the same either way.

    Raises:
        ValueError: a size that is not a positive int, duplicate or reserved keys,
            ``columns`` not divisible into ``splits``, ``splits > 1`` with one
            slot (unless ``rounds``), staging that names fields the ring lacks, or a
            pooled ring that is staged, in rounds, or of fewer than two slots.

    Examples:
        >>> import numpy as np
        >>> from rlcollect.transports import Field, RingLayout
        >>> layout = RingLayout(
        ...     fields=(Field(("observation",), (4,), np.dtype(np.float32)),),
        ...     num_workers=2,
        ...     columns=3,
        ...     chunk_steps=8,
        ...     slots=2,
        ... )
        >>> layout.positions, layout.request_columns, layout.requests_per_worker
        (16, 3, 16)
        >>> views = layout.views(bytearray(layout.nbytes))
        >>> views[("observation",)].shape  # [num_workers, positions, columns, *shape]
        (2, 16, 3, 4)
    """

    fields: tuple[Field, ...]
    num_workers: int
    columns: int
    chunk_steps: int
    slots: int
    splits: int = 1
    staging: Staging | None = None
    rounds: bool = False
    pooled: bool = False

    def __post_init__(self) -> None:
        for name in ("num_workers", "columns", "chunk_steps", "slots", "splits"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"RingLayout.{name} must be a positive int, got {value!r}")
        keys = [f.key for f in self.fields]
        if len(set(keys)) != len(keys):
            raise ValueError(f"RingLayout has duplicate field keys: {keys}")
        if any(key[0] == STAGED for key in keys):
            raise ValueError(f"field keys may not start with {STAGED!r}: {keys}")
        if PROGRESS in keys:
            raise ValueError(f"{PROGRESS!r} is the ring's own key, not a field key")
        if self.staging is None and self.columns % self.splits:
            raise ValueError(
                f"RingLayout: {self.columns} envs per worker do not split into "
                f"{self.splits} equal groups"
            )
        if self.splits > 1 and self.slots < 2 and not self.rounds:
            # The first split enters a new slot before the last one hands the old one over.
            raise ValueError("RingLayout with splits > 1 needs slots >= 2")
        if self.staging is not None:
            missing = set(self.staging.keys) - set(keys)
            if missing:
                raise ValueError(f"Staging names fields the ring lacks: {sorted(missing)}")
        self._slots.check(self)

    @property
    def _slots(self) -> SlotAddressing:
        """How this ring's slots are addressed (``slots.py``): what every answer below
        that differs between a pooled ring and another comes from."""
        return slot_addressing(self.pooled)

    @property
    def positions(self) -> int:
        """Steps one worker can hold in the ring: ``slots * chunk_steps``."""
        return self.slots * self.chunk_steps

    @property
    def credited_slots(self) -> int:
        """How many slot indices a worker's credits may name: ``slots``, or pooled,
        every worker's (``num_workers * slots``)."""
        return self._slots.credited_slots(self)

    def first_credits(self, worker: int) -> tuple[int, ...]:
        """The credits ``worker`` starts with, in order: every slot, ``0`` up; pooled,
        slot ``worker`` of block 0 and slot ``worker`` of block 1 (two, so that a
        worker never waits for its next slot while the driver keeps up)."""
        return self._slots.first_credits(self, worker)

    @property
    def worker_spans_ring(self) -> bool:
        """Whether a worker may write any slot of the ring, not only its own (pooled):
        its buffers then span the whole ring, and a process transport maps every page
        of it in each worker at start (``processes.map_every_page``)."""
        return self._slots.spans_ring

    @property
    def request_columns(self) -> int:
        """Env observations per request."""
        if self.staging is not None:
            return self.staging.columns
        return self.columns // self.splits

    @property
    def requests_per_worker(self) -> int:
        """Distinct request numbers of one worker: ``0 <= q < requests_per_worker``."""
        if self.staging is not None:
            return self.splits
        return self.credited_slots * self.chunk_steps * self.splits

    def _arrays(self) -> Iterator[tuple[Key, tuple[int, ...], np.dtype[np.generic]]]:
        w, p, k = self.num_workers, self.positions, self.columns
        by_key = {f.key: f for f in self.fields}
        for f in self.fields:
            yield f.key, (w, p, k, *f.shape), f.dtype
        if self.staging is not None:
            for key in self.staging.keys:
                f = by_key[key]
                yield (STAGED, *key), (w, 2 * k, *f.shape), f.dtype
            yield (STAGED, "rows"), (w, self.splits, self.staging.columns), np.dtype(np.int64)
        yield PROGRESS, (w, PROGRESS_WIDTH), np.dtype(np.int64)

    def _offsets(self) -> list[tuple[Key, tuple[int, ...], np.dtype[np.generic], int, int]]:
        out = []
        offset = 0
        for key, shape, dtype in self._arrays():
            nbytes = int(np.prod(shape)) * dtype.itemsize
            out.append((key, shape, dtype, offset, nbytes))
            offset += -(-nbytes // _ALIGN) * _ALIGN
        return out

    @property
    def nbytes(self) -> int:
        """Size of the flat buffer that holds every array (at least one byte)."""
        offsets = self._offsets()
        if not offsets:
            return 1
        *_, last, size = offsets[-1]
        return max(1, last + size)

    def views(self, buffer: memoryview | mmap.mmap | np.ndarray) -> dict[Key, np.ndarray]:
        """Numpy views of every array over ``buffer`` (``nbytes`` long, writable).

        Transition fields under their keys, ``[num_workers, positions, columns,
        *shape]``; staged arrays (if any) under ``("staged", *key)``,
        ``[num_workers, 2 * columns, *shape]``, and the request index under
        ``("staged", "rows")``, ``[num_workers, splits, staging.columns]``; the
        workers' progress records under :data:`PROGRESS`, ``[num_workers,
        PROGRESS_WIDTH]``.

        Args:
            buffer: at least :attr:`nbytes` bytes (shared memory, an mmap, ...).

        Returns:
            The views by key; they share ``buffer``'s memory.

        Raises:
            ValueError: ``buffer`` is shorter than :attr:`nbytes`.

        Examples:
            >>> from rlcollect.testing import counting_layout
            >>> layout = counting_layout(num_workers=2, columns=1, chunk_steps=4, slots=2)
            >>> views = layout.views(bytearray(layout.nbytes))
            >>> views[("next", "reward")].shape, views[("next", "reward")].dtype
            ((2, 8, 1), dtype('float32'))
        """
        flat = np.frombuffer(buffer, dtype=np.uint8)
        if flat.size < self.nbytes:
            raise ValueError(f"buffer holds {flat.size} bytes, the ring needs {self.nbytes}")
        out: dict[Key, np.ndarray] = {}
        for key, shape, dtype, offset, nbytes in self._offsets():
            out[key] = flat[offset : offset + nbytes].view(dtype).reshape(shape)
        return out

    def worker_buffers(self, views: Mapping[Key, np.ndarray], worker: int) -> dict[Key, np.ndarray]:
        """What worker ``worker`` writes (a :class:`~rlcollect.transports.WorkerEnd`'s
        ``buffers``): :func:`worker_views`, or pooled, every transition field whole,
        ``[credited_slots * chunk_steps, columns, *shape]`` (slot ``b`` at positions
        ``b * chunk_steps`` on), beside the worker's own progress record.

        Args:
            views: what :meth:`views` returned.
            worker: the worker's index.

        Returns:
            Views (not copies) by key.

        Examples:
            >>> import dataclasses
            >>> from rlcollect.testing import counting_layout
            >>> layout = counting_layout(num_workers=2, columns=3, chunk_steps=4, slots=2)
            >>> views = layout.views(bytearray(layout.nbytes))
            >>> layout.worker_buffers(views, 1)[("observation",)].shape
            (8, 3, 4)
            >>> pooled = dataclasses.replace(layout, pooled=True)
            >>> ring = pooled.views(bytearray(pooled.nbytes))
            >>> pooled.worker_buffers(ring, 1)[("observation",)].shape  # every slot
            (16, 3, 4)
        """
        out = worker_views(views, worker)
        out.update(self._slots.whole_fields(self, views))
        return out

    def block(self, views: Mapping[Key, np.ndarray], key: Key, block: int) -> np.ndarray:
        """Slots ``block * num_workers`` to ``(block + 1) * num_workers - 1`` of a
        pooled ring, as one contiguous view: ``[chunk_steps * num_workers * columns,
        *shape]``, slot by slot, each slot's rows by step, then column.

        Args:
            views: what :meth:`views` returned.
            key: a transition field's key.
            block: the block, ``0 <= block < slots``.

        Returns:
            A view of the ring (never a copy).

        Raises:
            ValueError: the ring is not pooled.

        Examples:
            >>> import dataclasses
            >>> from rlcollect.testing import counting_layout
            >>> layout = counting_layout(num_workers=2, columns=3, chunk_steps=4, slots=2)
            >>> layout = dataclasses.replace(layout, pooled=True)
            >>> views = layout.views(bytearray(layout.nbytes))
            >>> layout.worker_buffers(views, 0)[("step",)][12:16] = 7  # slot 3: block 1
            >>> block = layout.block(views, ("step",), 1)
            >>> block.shape, block.flags.c_contiguous, block[10:14].tolist()
            ((24,), True, [0, 0, 7, 7])
        """
        return self._slots.block(self, views, key, block)

    def request_sources(self, views: Mapping[Key, np.ndarray], key: Key) -> np.ndarray:
        """Where requests read or write field ``key``: ``[rows, *shape]``, all workers.

        Index it with :func:`request_rows`. In place that is the transition field
        itself; staged, its staging array (two cells per column). A view, never a copy.

        Args:
            views: what :meth:`views` returned.
            key: a transition field's key.

        Returns:
            The field seen as ``[rows, *shape]``.

        Raises:
            KeyError: no such field (or, staged, the field is not staged).

        Examples:
            >>> from rlcollect.testing import counting_layout
            >>> layout = counting_layout(num_workers=2, columns=3, chunk_steps=4, slots=2)
            >>> views = layout.views(bytearray(layout.nbytes))
            >>> layout.request_sources(views, ("observation",)).shape  # 2 * 8 * 3 rows
            (48, 4)
        """
        if self.staging is not None:
            array = views[(STAGED, *key)]
            return array.reshape(-1, *array.shape[2:])
        array = views[key]
        return array.reshape(-1, *array.shape[3:])


def request_rows(
    layout: RingLayout,
    views: Mapping[Key, np.ndarray],
    workers: np.ndarray,
    requests: np.ndarray,
) -> np.ndarray:
    """Flat rows (into :meth:`RingLayout.request_sources`) of requests ``(workers[i],
    requests[i])``, request by request: ``[len(workers) * request_columns]`` intp.

    Args:
        layout: the ring.
        views: its arrays (staged layouts read the request index from them).
        workers: worker of each request.
        requests: request number of each request.

    Returns:
        The rows, ``request_columns`` per request, in request order.

    Examples:
        >>> import numpy as np
        >>> from rlcollect.testing import counting_layout
        >>> from rlcollect.transports import request_rows
        >>> layout = counting_layout(num_workers=2, columns=2, chunk_steps=4, slots=2)
        >>> views = layout.views(bytearray(layout.nbytes))
        >>> request_rows(layout, views, np.array([0, 1]), np.array([0, 3])).tolist()
        [0, 1, 22, 23]
    """
    c = layout.request_columns
    if layout.staging is not None:
        per_worker = 2 * layout.columns  # staging cells
        cells = views[(STAGED, "rows")][workers, requests]
        rows: np.ndarray = (workers[:, None] * per_worker + cells).reshape(-1)
        return rows.astype(np.intp, copy=False)
    # q * c == p * k + g * c (pooled, p is a position of the whole ring)
    first = layout._slots.first_rows(layout, workers, requests * c)
    out: np.ndarray = (first[:, None] + np.arange(c)).reshape(-1)
    return out.astype(np.intp, copy=False)


def worker_views(views: Mapping[Key, np.ndarray], worker: int) -> dict[Key, np.ndarray]:
    """One worker's part of the ring: every array without its leading worker dimension.

    Args:
        views: what :meth:`RingLayout.views` returned.
        worker: the worker's index.

    Returns:
        Views (not copies) by key, as a :class:`~rlcollect.transports.WorkerEnd` sees
        its ``buffers``.

    Examples:
        >>> from rlcollect.testing import counting_layout
        >>> from rlcollect.transports import worker_views
        >>> layout = counting_layout(num_workers=2, columns=3, chunk_steps=4, slots=2)
        >>> views = layout.views(bytearray(layout.nbytes))
        >>> worker_views(views, 1)[("observation",)].shape
        (8, 3, 4)
    """
    return {key: array[worker] for key, array in views.items()}
