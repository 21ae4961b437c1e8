"""The weights board: the policy's weights in shared memory, read by every env worker.

With ``inference_backend="worker"`` each env worker runs its own copy of the policy
(``inference/in_worker_policy.py``); this board is how the driver's weights reach them. One
shared-memory segment::

    offset 0        header   int64[8]: [0] the version of the weights in the slot
    stats_offset    stats    int64[num_workers, 3]: forwards, rows, nanoseconds (worker w's row)
    hist_offset     latency  int64[num_workers, 1024]: forwards by whole microseconds
    slot_offset     slot     every tensor of the policy's state_dict (``WeightsLayout``)

and one lock per worker: an open-file-description lock (``F_OFD_SETLK``) on byte ``w``
of the segment's file, which each party takes through a descriptor of its own.

The protocol (who writes what, in what order, why it is safe):

* Only the driver writes the header and the slot, and only while it holds *every*
  worker's lock: :meth:`WeightsBoard.publish` takes them all, copies the tensors in,
  writes the new version into the header, then lets them go. A worker reads the slot
  only while it holds its own lock. So no worker ever reads a slot being written, and a
  worker sees either the old weights and version or the new ones, never a mixture.
* Taking and releasing a lock is a system call under a kernel lock, which orders memory
  like a mutex: whatever the driver wrote before releasing is visible to the worker
  that takes its lock afterwards.
* Before each forward a worker reads the header's version *without* the lock, as a
  hint; only when it differs from the version it holds does it take its lock, read the
  version again and copy the slot into its policy (:meth:`WeightsBoard.refresh`). A
  stale hint costs one more forward on the weights the worker already has, which it
  stamps with their own version: every transition still names the weights that chose
  its action.
* A worker holds its lock only for that copy, so :meth:`publish` waits at most that long
  per worker (bounded: a worker stopped mid-copy is an error naming it). The kernel
  releases the locks of a process that dies, so a dead worker or a dead driver leaves
  none held. Worker lock waits are bounded too.
* On-policy rounds: :meth:`publish` returns only after the new version is in the header;
  the consumer's go-ahead for the next round (a pipe write) comes after, and a worker
  reads the hint after reading the go-ahead, so the round runs on the new weights.
* Each worker writes only its own stats and latency rows; the driver reads them
  unlocked, as the approximate figures they are.

The segment is created and unlinked by the driver; a worker process that finds its
driver gone unlinks it too (``inference/in_worker_policy.py``), as it does the ring.
"""

from __future__ import annotations

import _posixshmem
import fcntl
import mmap
import os
import struct
import time
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from rlcollect.errors import InferenceError
from rlcollect.inference.config import WeightsLayout
from rlcollect.processes import attach_segment, create_segment, release_mapping, unlink_segment

__all__ = ["LATENCY_BINS", "WeightsBoard"]

_HEADER = 8  # int64 words
_STATS = 3  # forwards, rows, nanoseconds
LATENCY_BINS = 1024  # whole microseconds; the last bin holds everything slower
_ALIGN = 64
_FLOCK = struct.Struct("hhqqi4x")  # Linux's struct flock: type, whence, start, len, pid
_POLL = 1e-4  # seconds between tries of a lock somebody holds


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


class WeightsBoard:
    """One party's view of the board: the driver's (:meth:`create`) or worker ``w``'s
    (:meth:`attach`)."""

    def __init__(
        self, name: str, mapping: mmap.mmap, weights: WeightsLayout, num_workers: int
    ) -> None:
        self.name = name
        self.num_workers = num_workers
        self._mapping = mapping
        stats_offset = _HEADER * 8
        hist_offset = stats_offset + _aligned(num_workers * _STATS * 8)
        slot_offset = hist_offset + _aligned(num_workers * LATENCY_BINS * 8)
        self.header = np.frombuffer(mapping, np.int64, _HEADER, 0)
        self.stats = np.frombuffer(mapping, np.int64, num_workers * _STATS, stats_offset)
        self.stats = self.stats.reshape(num_workers, _STATS)
        self.latency = np.frombuffer(mapping, np.int64, num_workers * LATENCY_BINS, hist_offset)
        self.latency = self.latency.reshape(num_workers, LATENCY_BINS)
        # The same rows as flat memoryviews, for record(), which runs once per forward:
        # a memoryview's item update costs a fraction of numpy's.
        self._stats_cells = self.stats.reshape(-1).data
        self._latency_cells = self.latency.reshape(-1).data
        self._slot = weights.views(mapping, 0, start=slot_offset)
        # A descriptor of this party's own: OFD locks belong to an open file description,
        # so the driver's and a worker thread's exclude each other even in one process.
        self._fd = _posixshmem.shm_open("/" + name, os.O_RDWR, mode=0o600)

    @staticmethod
    def size(weights: WeightsLayout, num_workers: int) -> int:
        """Bytes of the segment."""
        return (
            _HEADER * 8
            + _aligned(num_workers * _STATS * 8)
            + _aligned(num_workers * LATENCY_BINS * 8)
            + weights.slot_bytes
        )

    @classmethod
    def create(
        cls, weights: WeightsLayout, num_workers: int, state: Mapping[str, torch.Tensor]
    ) -> WeightsBoard:
        """The driver's board, holding ``state`` as version 0."""
        name, mapping = create_segment("rlcb_", cls.size(weights, num_workers))
        try:
            board = cls(name, mapping, weights, num_workers)
        except BaseException:
            release_mapping(mapping)
            unlink_segment(name)
            raise
        with torch.no_grad():
            for key, value in state.items():
                board._slot[key].copy_(value.detach())
        return board

    @classmethod
    def attach(cls, name: str, weights: WeightsLayout, num_workers: int) -> WeightsBoard:
        """A worker's view of the board ``name``."""
        return cls(name, attach_segment(name, cls.size(weights, num_workers)), weights, num_workers)

    # ------------------------------------------------------------------ driver

    def publish(self, state: Mapping[str, torch.Tensor], version: int, timeout: float) -> None:
        """Copy ``state`` into the slot as ``version``, under every worker's lock.

        Raises:
            InferenceError: a worker held its lock (it was copying the previous weights)
                for ``timeout`` seconds: stopped, by SIGSTOP or a debugger.
        """
        held: list[int] = []
        deadline = time.monotonic() + timeout
        try:
            for w in range(self.num_workers):
                while not self._lock(w):
                    if time.monotonic() > deadline:
                        raise InferenceError(
                            f"worker {w} has held the weights board for more than {timeout:g}"
                            " s while copying weights (stopped, by SIGSTOP or a debugger?); "
                            f"weights version {version} was not published"
                        )
                    time.sleep(_POLL)
                held.append(w)
            with torch.no_grad():
                for key, value in state.items():
                    self._slot[key].copy_(value.detach())
            self.header[0] = version
        finally:
            for w in held:
                self._unlock(w)

    def close(self, *, unlink: bool) -> None:
        """Close this party's descriptor and mapping (idempotent); ``unlink``: the name too."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
            self._stats_cells.release()
            self._latency_cells.release()
            del self.header, self.stats, self.latency
            self._slot = {}
            release_mapping(self._mapping)
        if unlink:
            unlink_segment(self.name)

    # ------------------------------------------------------------------ worker

    def refresh(
        self, worker: int, params: Mapping[str, torch.Tensor], held: int, timeout: float
    ) -> int:
        """Worker ``worker`` holding version ``held`` in ``params``: copy the slot in when
        the header names another; returns the version ``params`` hold now."""
        if int(self.header[0]) == held:
            return held
        deadline = time.monotonic() + timeout
        while not self._lock(worker):
            if time.monotonic() > deadline:
                raise InferenceError(
                    f"the driver has held the weights board for more than {timeout:g} s"
                )
            time.sleep(_POLL)
        try:
            version = int(self.header[0])
            with torch.no_grad():
                for key, target in params.items():
                    target.copy_(self._slot[key])
        finally:
            self._unlock(worker)
        return version

    def record(self, worker: int, rows: int, nanoseconds: int) -> None:
        """Count one forward of ``rows`` rows that took ``nanoseconds`` (worker's own row)."""
        stats, row = self._stats_cells, worker * _STATS
        stats[row] += 1
        stats[row + 1] += rows
        stats[row + 2] += nanoseconds
        self._latency_cells[worker * LATENCY_BINS + min(nanoseconds // 1000, LATENCY_BINS - 1)] += 1

    # ------------------------------------------------------------------ locks

    def _lock(self, worker: int) -> bool:
        """Try to take worker ``worker``'s lock; never blocks (callers poll, bounded)."""
        try:
            lock = _FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, worker, 1, 0)
            fcntl.fcntl(self._fd, fcntl.F_OFD_SETLK, lock)
        except BlockingIOError:
            return False
        except PermissionError:  # EACCES: some systems' word for "held"
            return False
        return True

    def _unlock(self, worker: int) -> None:
        unlock = _FLOCK.pack(fcntl.F_UNLCK, os.SEEK_SET, worker, 1, 0)
        fcntl.fcntl(self._fd, fcntl.F_OFD_SETLK, unlock)

    def summary(self) -> dict[str, Any]:
        """Forwards, rows and latency percentiles over every worker (the driver's view)."""
        forwards, rows, ns = (int(x) for x in self.stats.sum(axis=0))
        hist = self.latency.sum(axis=0)
        total = int(hist.sum())
        p50 = p95 = 0.0
        if total:
            cumulative = np.cumsum(hist)
            # bin b holds forwards of [b, b + 1) µs: report its middle
            p50 = (int(np.searchsorted(cumulative, 0.5 * total)) + 0.5) * 1e-6
            p95 = (int(np.searchsorted(cumulative, 0.95 * total)) + 0.5) * 1e-6
        return {"forwards": forwards, "rows": rows, "seconds": ns / 1e9, "p50": p50, "p95": p95}
