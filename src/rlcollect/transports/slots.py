"""Slot addressing: which slots a worker's credits name, and where its requests sit.

A ring (:class:`~rlcollect.transports.layout.RingLayout`) is addressed one of two ways,
fixed per collector by ``RingLayout.pooled``. Each way is one class here, and
:func:`slot_addressing` is the only code that tests the flag: the layout asks the
addressing it returns every question whose answer differs (``credited_slots``,
``first_credits``, ``worker_buffers``, ``worker_spans_ring``, ``block``, the first rows
of ``request_rows``), and so does :func:`request_envs`, so that a transport, a worker
or the server asks the layout and never reads the flag itself.

:class:`OwnSlots` (the default)
    Worker ``w`` owns ``slots`` slots, ``0`` up, slot ``s`` being its positions
    ``s * chunk_steps`` on. Its credits name them, it starts with every one of them,
    and its request numbers address its own part of the ring, so each request row is
    one env's for good.

:class:`PooledSlots` (``pooled=True``)
    The same memory seen another way: the ring's ``num_workers * slots`` slots are
    shared by every worker, slot ``b`` being rows ``b * chunk_steps * columns`` on of
    every transition field seen whole, and a worker writes the slot its credit names
    (it starts with two: slot ``w`` of block 0 and slot ``w`` of block 1, so that it
    never waits for its next slot while the driver keeps up). Every ``num_workers``
    consecutive slots are one contiguous *block* of ``chunk_steps * num_workers *
    columns`` rows: where that is a whole batch, the batch can view the ring instead of
    copying it, and the slots of a block go to whichever workers ask for them first, so
    no worker waits for another (``collector/batches/pooled.py``). A worker's request
    numbers are positions of the whole ring (of whichever slot it writes), so a request
    row belongs to whichever worker wrote it last, and names no env.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import Any, ClassVar, Protocol

import numpy as np

Key = tuple[str, ...]  # a TensorDict key as a tuple of names (layout.py's Key)


class RingLayout(Protocol):
    """What addressing reads of a ring's shape (``layout.RingLayout`` has it all). A
    protocol, not an import: ``layout.py`` builds on this module, never the other way."""

    @property
    def num_workers(self) -> int: ...
    @property
    def columns(self) -> int: ...
    @property
    def chunk_steps(self) -> int: ...
    @property
    def slots(self) -> int: ...
    @property
    def staging(self) -> Any: ...
    @property
    def rounds(self) -> bool: ...
    @property
    def pooled(self) -> bool: ...
    @property
    def positions(self) -> int: ...
    @property
    def fields(self) -> tuple[Any, ...]: ...


__all__ = ["OwnSlots", "PooledSlots", "SlotAddressing", "request_envs", "slot_addressing"]


class SlotAddressing(ABC):
    """How a ring's slots are addressed: the answers ``RingLayout`` gives for it."""

    #: Whether a worker may write any slot of the ring, not only its own.
    spans_ring: ClassVar[bool]

    @abstractmethod
    def check(self, layout: RingLayout) -> None:
        """Raise ValueError where ``layout`` cannot be addressed this way."""

    @abstractmethod
    def credited_slots(self, layout: RingLayout) -> int:
        """How many slot indices a credit may name."""

    @abstractmethod
    def first_credits(self, layout: RingLayout, worker: int) -> tuple[int, ...]:
        """The credits ``worker`` starts with, in order."""

    @abstractmethod
    def whole_fields(
        self, layout: RingLayout, views: Mapping[Key, np.ndarray]
    ) -> dict[Key, np.ndarray]:
        """Arrays a worker's buffers show whole instead of its own part of them."""

    @abstractmethod
    def first_rows(self, layout: RingLayout, workers: np.ndarray, firsts: np.ndarray) -> np.ndarray:
        """The first row of each in-place request of ``workers[i]``, ``firsts[i]`` being
        that row in the worker's own request space (request number times
        ``request_columns``)."""

    @abstractmethod
    def envs(self, layout: RingLayout, rows: np.ndarray) -> np.ndarray:
        """The collector env of each request row."""

    @abstractmethod
    def block(
        self, layout: RingLayout, views: Mapping[Key, np.ndarray], key: Key, block: int
    ) -> np.ndarray:
        """Block ``block`` of field ``key``, one contiguous view."""


class OwnSlots(SlotAddressing):
    """Each worker writes its own slots (see the module docstring)."""

    spans_ring = False

    def check(self, layout: RingLayout) -> None:
        pass  # any layout

    def credited_slots(self, layout: RingLayout) -> int:
        return layout.slots

    def first_credits(self, layout: RingLayout, worker: int) -> tuple[int, ...]:
        return tuple(range(layout.slots))  # every slot, 0 up: the ring starts free

    def whole_fields(
        self, layout: RingLayout, views: Mapping[Key, np.ndarray]
    ) -> dict[Key, np.ndarray]:
        return {}

    def first_rows(self, layout: RingLayout, workers: np.ndarray, firsts: np.ndarray) -> np.ndarray:
        # A worker's requests address its own part of the ring.
        rows: np.ndarray = workers * (layout.positions * layout.columns) + firsts
        return rows

    def envs(self, layout: RingLayout, rows: np.ndarray) -> np.ndarray:
        # Worker w's column c is env w * columns + c: rows [w, p, c] in place, staging
        # cells c and c + columns of worker w staged.
        k = layout.columns
        rows = rows.astype(np.int64, copy=False)
        per_worker = 2 * k if layout.staging is not None else layout.positions * k
        out: np.ndarray = (rows // per_worker) * k + rows % k
        return out

    def block(
        self, layout: RingLayout, views: Mapping[Key, np.ndarray], key: Key, block: int
    ) -> np.ndarray:
        raise ValueError("blocks are a pooled ring's")


class PooledSlots(SlotAddressing):
    """Every worker writes any slot of the ring (see the module docstring)."""

    spans_ring = True

    def check(self, layout: RingLayout) -> None:
        if layout.staging is not None or layout.rounds or layout.slots < 2:
            # Staged requests name a worker's own staging cells, and rounds a worker's
            # own slot; each worker starts with two slots (first_credits).
            raise ValueError("a pooled RingLayout is in place, not in rounds, with slots >= 2")

    def credited_slots(self, layout: RingLayout) -> int:
        return layout.slots * layout.num_workers

    def first_credits(self, layout: RingLayout, worker: int) -> tuple[int, ...]:
        return (worker, layout.num_workers + worker)

    def whole_fields(
        self, layout: RingLayout, views: Mapping[Key, np.ndarray]
    ) -> dict[Key, np.ndarray]:
        out: dict[Key, np.ndarray] = {}
        for f in layout.fields:
            whole = views[f.key].reshape(-1, *views[f.key].shape[2:])
            assert not whole.flags.owndata  # worker-major memory: a view
            out[f.key] = whole
        return out

    def first_rows(self, layout: RingLayout, workers: np.ndarray, firsts: np.ndarray) -> np.ndarray:
        return firsts  # every worker's requests address the whole ring

    def envs(self, layout: RingLayout, rows: np.ndarray) -> np.ndarray:
        raise ValueError("a pooled ring's rows belong to whichever worker wrote them last")

    def block(
        self, layout: RingLayout, views: Mapping[Key, np.ndarray], key: Key, block: int
    ) -> np.ndarray:
        rows = layout.chunk_steps * layout.num_workers * layout.columns
        array = views[key]
        whole = array.reshape(-1, *array.shape[3:])
        out: np.ndarray = whole[block * rows : (block + 1) * rows]
        assert not out.flags.owndata  # a view: the reshape did not copy
        return out


_OWN = OwnSlots()
_POOLED = PooledSlots()


def slot_addressing(pooled: bool) -> SlotAddressing:
    """The addressing of a ring whose ``RingLayout.pooled`` is ``pooled``."""
    return _POOLED if pooled else _OWN


def request_envs(layout: RingLayout, rows: np.ndarray) -> np.ndarray:
    """The collector env of each flat request row (as
    :func:`~rlcollect.transports.layout.request_rows` gives them).

    A row's env follows from where it sits: worker ``w``'s column ``c`` is env
    ``w * columns + c``, in place (rows ``[w, p, c]``) and staged alike (cells ``c``
    and ``c + columns`` of worker ``w``). The inference server keys each env's
    recurrent state by it.

    Args:
        layout: the ring.
        rows: flat rows into
            :meth:`~rlcollect.transports.layout.RingLayout.request_sources`.

    Returns:
        int64 env indices, one per row.

    Raises:
        ValueError: the ring is pooled (its rows are no env's for good).

    Examples:
        >>> import numpy as np
        >>> from rlcollect.testing import counting_layout
        >>> from rlcollect.transports.layout import request_envs, request_rows
        >>> layout = counting_layout(num_workers=2, columns=2, chunk_steps=4, slots=2)
        >>> views = layout.views(bytearray(layout.nbytes))
        >>> rows = request_rows(layout, views, np.array([0, 1]), np.array([0, 3]))
        >>> request_envs(layout, rows).tolist()  # worker 0's envs, then worker 1's
        [0, 1, 2, 3]
    """
    return slot_addressing(layout.pooled).envs(layout, rows)
