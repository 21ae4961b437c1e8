"""The interface of an inference backend: a running server and its weight sync scheme.

Three backends implement it, and ``backend.py`` is the one place that knows them (the
plan chooses one there by name, the collector starts it in two phases):

``"thread"`` (:class:`~rlcollect.inference.InferenceServer` itself)
    The server is a thread of the driver process; weights are copied into the served
    policy in place, under the lock the server holds around each forward.
``"process"`` (:class:`~rlcollect.inference.process.ProcessInference`)
    The server runs in a process of its own, so the learner's Python threads never
    compete with it for the driver's GIL; weights travel through shared memory,
    versioned (see that module for the protocol).
``"worker"`` (``in_worker_policy.py``)
    No server: each env worker runs the policy on its own requests; weights travel
    through a shared weights board.

Every way an update lands between two batches, never during one, and every transition
carries the version of the weights that chose its action.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import Any

import torch

from rlcollect.errors import InferenceError

__all__ = ["InferenceBackend"]


class InferenceBackend(ABC):
    """A running inference server and its weight sync scheme."""

    @property
    @abstractmethod
    def policy_version(self) -> int:
        """Version of the newest weights handed over: 0 at start, +1 per update."""

    @property
    @abstractmethod
    def error(self) -> InferenceError | None:
        """Why the server stopped serving, or None while it is healthy."""

    @abstractmethod
    def start(self) -> None:
        """Start serving requests."""

    @abstractmethod
    def update_weights(self, state_dict: Mapping[str, torch.Tensor]) -> int:
        """Hand over new weights; they are applied between two batches.

        Returns the new :attr:`policy_version`. Raises KeyError or ValueError, before
        anything changes, when the names or shapes do not match the served policy's.
        A recurrent policy's per-env states are kept across the update.
        """

    def wait_applied(self, version: int, timeout: float) -> bool:
        """Block until weights ``version`` serve the next batch, or ``timeout`` seconds
        pass (False), or the server fails (True: check :attr:`error`). A backend whose
        :meth:`update_weights` applies the weights before it returns (the thread
        backend) is always there."""
        return True

    @abstractmethod
    def pause(self, timeout: float) -> None:
        """Return once the server holds between two batches; raises InferenceError if it
        does not get there within ``timeout`` seconds."""

    @abstractmethod
    def resume(self) -> None:
        """Let a paused server go on."""

    @abstractmethod
    def stop(self) -> None:
        """Stop serving and free what the server holds. Idempotent; never hangs."""

    @abstractmethod
    def stats(self) -> dict[str, Any]:
        """Batches, batch sizes, time per phase and request latency (see the server)."""

    def segments(self) -> tuple[str, ...]:
        """Names of the shared-memory segments (``/dev/shm``) this backend created and
        :meth:`stop` unlinks, for whoever must unlink them should its process be killed
        first (a Ray actor's: ``distributed/fleet.py``). None by default."""
        return ()
