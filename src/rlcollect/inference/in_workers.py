"""The ``"worker"`` inference backend, seen from the driver: no server, a weights board.

Each env worker runs the policy itself (``inference/local.py`` says why and how); the
driver keeps the one thing they share, the :class:`~rlcollect.inference.board.WeightsBoard`,
and answers the :class:`~rlcollect.inference.base.InferenceBackend` interface from it:
an update is published to every worker at once (atomic: a worker's forward runs on one
version, stamped on its transitions), statistics are summed over the workers' own
counts, and there is no server to pause or to fail: a policy that raises in a worker
fails that worker, which the collector reports (or restarts) like any worker failure.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import cloudpickle
import torch

from rlcollect.errors import InferenceError
from rlcollect.inference.base import InferenceBackend
from rlcollect.inference.board import WeightsBoard
from rlcollect.inference.local import LocalPolicy
from rlcollect.inference.process import InferenceConfig
from rlcollect.inference.server import check_weights

__all__ = ["WorkerInference"]

_PUBLISH_WAIT = 10.0  # seconds a worker may hold the board (copying weights) before an error


class WorkerInference(InferenceBackend):
    """The policy in every env worker (``inference_backend="worker"``).

    Args:
        config: the ring and policy outputs the workers serve.
        policy: a cloudpickle-able policy (``policy_is_factory=False``) or a
            zero-argument callable building it in each worker.
        policy_is_factory: which of the two ``policy`` is.
        initial: the weights every worker starts from (version 0): the driver's copy,
            so that workers building their policy from a factory still agree.

    Built before the workers start: :meth:`local_policy` is what each worker is handed.
    """

    def __init__(
        self,
        config: InferenceConfig,
        policy: Any,
        *,
        policy_is_factory: bool,
        initial: Mapping[str, torch.Tensor],
    ) -> None:
        self._config = config
        self._payload = cloudpickle.dumps(policy)
        self._is_factory = policy_is_factory
        self._version = 0
        self._board: WeightsBoard | None = WeightsBoard.create(
            config.weights, config.layout.num_workers, initial
        )
        self._last_stats: dict[str, Any] = {}
        self.shm_name = self._board.name  # the board's segment (unlinked by stop())

    def local_policy(self) -> LocalPolicy:
        """What a worker builds its policy and finds the board from."""
        assert self._board is not None
        return LocalPolicy(
            config=self._config,
            payload=self._payload,
            is_factory=self._is_factory,
            board=self._board.name,
            driver_pid=os.getpid(),
        )

    @property
    def policy_version(self) -> int:
        return self._version

    @property
    def error(self) -> InferenceError | None:
        """Always None: a policy that fails, fails its worker."""
        return None

    def start(self) -> None:
        """Nothing to start: every worker builds its policy when it starts."""

    def update_weights(self, state_dict: Mapping[str, torch.Tensor]) -> int:
        if self._board is None:
            raise InferenceError("the collector's weights board is closed")
        layout = self._config.weights
        check_weights(state_dict, {name: shape for name, shape, _, _ in layout.entries})
        version = self._version + 1
        self._board.publish(state_dict, version, _PUBLISH_WAIT)
        self._version = version
        return version

    def pause(self, timeout: float) -> None:
        """Nothing to hold here: the workers' forwards stop once the ring is full, and
        weights change only when the caller updates them."""

    def resume(self) -> None:
        """See :meth:`pause`."""

    def stop(self) -> None:
        if self._board is not None:
            self._last_stats = self.stats()  # the final figures outlive the board
            self._board.close(unlink=True)
            self._board = None

    def stats(self) -> dict[str, Any]:
        """Forwards (``batches``), rows, mean rows per forward, time in the forwards and
        the p50/p95 of a request's time in its worker (to the microsecond)."""
        if self._board is None:
            return dict(self._last_stats)
        s = self._board.summary()
        layout = self._config.layout
        width = layout.request_columns  # rows of every forward
        return {
            "batches": s["forwards"],
            "rows": s["rows"],
            "mean_batch_size": s["rows"] / s["forwards"] if s["forwards"] else 0.0,
            "batch_sizes": {width: s["forwards"]} if s["forwards"] else {},
            "phase_seconds": {"forward": s["seconds"]},
            "request_latency_p50": s["p50"],
            "request_latency_p95": s["p95"],
            "gathers_on_device": False,
        }
