"""Progress marks: what each worker is doing, written around every env call.

A worker's progress record (the ring's :data:`~rlcollect.transports.layout.PROGRESS`
array, one row per worker, int64) is written here, in the worker, and read by the
driver's stall watch (``collector/batches/stall.py``, which states the whole protocol)::

    before an env call: ENV, STAGE, then SINCE = time.monotonic_ns()
    after it:           SINCE = 0
    at start:           PID = os.getpid()

The worker alone writes its row, and writes ``ENV`` and ``STAGE`` before ``SINCE``:
``SINCE != 0`` is what makes them count, so the driver never reads a half-written mark
as a call under way. This module is torch-free: it runs inside env worker processes.
"""

from __future__ import annotations

import os
import time
from enum import IntEnum

import numpy as np

__all__ = ["ENV", "PID", "SINCE", "STAGE", "Progress", "Stage"]

# Columns of a progress record.
SINCE, STAGE, ENV, PID = range(4)


class Stage(IntEnum):
    """What an env call is doing; or the policy, where a worker runs it
    (``inference_backend="worker"``)."""

    CONSTRUCTION = 1
    RESET = 2
    STEP = 3
    POLICY = 4


class Progress:
    """The worker's side: marks the start and end of every env call.

    ``record`` is the worker's row of the progress array (``[PROGRESS_WIDTH]``). It is
    written through a memoryview: this runs around every env step, and a memoryview's
    item assignment costs a third of numpy's.
    """

    __slots__ = ("_record",)

    def __init__(self, record: np.ndarray) -> None:
        self._record = memoryview(record.data)
        self._record[SINCE] = 0
        self._record[PID] = os.getpid()

    def enter(self, stage: Stage, env: int) -> None:
        record = self._record
        record[ENV] = env
        record[STAGE] = stage
        record[SINCE] = time.monotonic_ns()

    def leave(self) -> None:
        self._record[SINCE] = 0
