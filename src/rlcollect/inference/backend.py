"""The inference backends: the only place that knows ``"thread"``, ``"process"`` and
``"worker"``.

The plan chooses a backend by name (:func:`choose_backend`) and asks it what it needs to
know (its capabilities, below); the collector starts it in two phases::

    plan:       choice = choose_backend(name, config, ...)      frozen, starts nothing
    collector:  prepared = choice.prepare()       phase 1: what the workers run
                end = transport.start(layout, [prepared.program(spec) for spec in specs])
                server = prepared.serve(transport, end)          phase 2: serving

``"thread"``
    The batching server (:func:`~rlcollect.inference.build.build_server`) in a thread of
    this process; the workers run the plain worker loop.
``"process"``
    The same server in a process of its own (``process.py``), reading the workers'
    requests through the transport's request channel.
``"worker"``
    No server: each env worker runs the policy on its own requests
    (``in_worker_policy.py``). Its weights board exists before the workers, which find
    it by name: that is why phase 1 exists.

What a running backend is: ``base.py``.
"""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from rlcollect.inference.base import InferenceBackend
from rlcollect.inference.build import build_server
from rlcollect.inference.config import InferenceConfig
from rlcollect.inference.in_worker_policy import InWorkerBackend, run_worker_with_policy
from rlcollect.inference.process import ProcessInference
from rlcollect.transports.base import ServerEnd, Transport, WorkerProgram
from rlcollect.worker.loop import run_worker
from rlcollect.worker.spec import WorkerSpec

__all__ = ["BACKENDS", "BackendChoice", "PreparedBackend", "backend_kind", "choose_backend"]


@dataclass(frozen=True)
class BackendChoice(ABC):
    """An inference backend chosen by the plan, not started.

    Attributes:
        config: the ring and policy outputs to serve.
        served: the policy as probed in this process, where the backend needs it (the
            thread backend serves it; the in-worker policy starts every worker from its
            weights); None where the backend builds its own (the inference process), so
            that the probe's copy (on the GPU, maybe) goes.
        policy_source: a cloudpickle-able policy, or a factory when
            ``policy_is_factory``: what another process builds its copy from.
        policy_is_factory: which of the two ``policy_source`` is.
    """

    config: InferenceConfig
    served: torch.nn.Module | None
    policy_source: Any
    policy_is_factory: bool

    #: The name the collector's ``inference_backend`` argument gives it.
    name: ClassVar[str]
    #: The policy is built in other processes, so it must pickle (the error says where).
    policy_travels_to: ClassVar[str | None] = None
    #: The policy runs inside the env workers: no server, no batching across workers.
    in_workers: ClassVar[bool] = False
    #: Needs the transport's request channel (``Transport.supports_request_channel``).
    needs_request_channel: ClassVar[bool] = False
    #: Keeps the policy as probed in this process (see ``served``).
    keeps_served: ClassVar[bool] = True

    @classmethod
    def lends_pooled_blocks_with(cls, device: torch.device) -> bool:
        """Whether a pooled ring's blocks may go out as lent batches while this backend
        serves a policy on ``device``: only where the server reads the ring through a
        mapping of its own (page-locking that mapping, never the caller's view) and
        where copying would be nearly all the driver's work
        (``collector/batches/loans.py``). The policy in the workers reads each worker's
        own part of the ring, not the slots a pooled ring would give it."""
        return False

    @abstractmethod
    def prepare(self) -> PreparedBackend:
        """Phase 1: make what the workers need before they start."""


class PreparedBackend(ABC):
    """A backend between its two phases: the workers' program known, not serving yet."""

    @abstractmethod
    def program(self, spec: WorkerSpec) -> WorkerProgram:
        """What the worker of ``spec`` runs (also for a restarted worker)."""

    @abstractmethod
    def serve(self, transport: Transport, end: ServerEnd) -> InferenceBackend:
        """Phase 2: serve the workers of ``end``, started by ``transport``; returns once
        it serves. Whatever it started is stopped again if it fails (Ctrl-C included)."""

    def abort(self) -> None:  # noqa: B027 (most backends prepare nothing to give back)
        """Give back what :meth:`BackendChoice.prepare` made, if :meth:`serve` never
        returned. Idempotent."""


def _started(backend: InferenceBackend) -> InferenceBackend:
    try:
        backend.start()
    except BaseException:  # Ctrl-C included: nothing it started outlives the call
        backend.stop()
        raise
    return backend


# ------------------------------------------------------------------ a server in a thread


@dataclass(frozen=True)
class _ThreadChoice(BackendChoice):
    name: ClassVar[str] = "thread"

    @classmethod
    def lends_pooled_blocks_with(cls, device: torch.device) -> bool:
        # A GPU policy's server page-locks a second mapping of the ring; a CPU policy's
        # copy is a small part of the driver's work, so lending would not pay.
        return device.type == "cuda"

    def prepare(self) -> PreparedBackend:
        return _ServerThread(self)


class _ServerThread(PreparedBackend):
    def __init__(self, choice: _ThreadChoice) -> None:
        self._choice = choice

    def program(self, spec: WorkerSpec) -> WorkerProgram:
        return functools.partial(run_worker, spec=spec)

    def serve(self, transport: Transport, end: ServerEnd) -> InferenceBackend:
        assert self._choice.served is not None
        return _started(build_server(self._choice.served, self._choice.config, end))


# ------------------------------------------------------------------ a server process


@dataclass(frozen=True)
class _ProcessChoice(BackendChoice):
    name: ClassVar[str] = "process"
    policy_travels_to: ClassVar[str | None] = "the inference process"
    needs_request_channel: ClassVar[bool] = True
    keeps_served: ClassVar[bool] = False

    @classmethod
    def lends_pooled_blocks_with(cls, device: torch.device) -> bool:
        return True  # the inference process maps (and page-locks) the ring itself

    def prepare(self) -> PreparedBackend:
        return _ServerProcess(self)


class _ServerProcess(PreparedBackend):
    def __init__(self, choice: _ProcessChoice) -> None:
        self._choice = choice

    def program(self, spec: WorkerSpec) -> WorkerProgram:
        return functools.partial(run_worker, spec=spec)

    def serve(self, transport: Transport, end: ServerEnd) -> InferenceBackend:
        choice = self._choice
        process = ProcessInference(
            transport.request_channel(),
            choice.config,
            choice.policy_source,
            policy_is_factory=choice.policy_is_factory,
        )
        return _started(process)


# ------------------------------------------------------------------ the policy in the workers


@dataclass(frozen=True)
class _InWorkerChoice(BackendChoice):
    name: ClassVar[str] = "worker"
    policy_travels_to: ClassVar[str | None] = "the env workers"
    in_workers: ClassVar[bool] = True

    def prepare(self) -> PreparedBackend:
        return _PolicyInWorkers(self)


class _PolicyInWorkers(PreparedBackend):
    """The weights board is made here, before the workers that read it."""

    def __init__(self, choice: _InWorkerChoice) -> None:
        assert choice.served is not None
        self._backend: InWorkerBackend | None = InWorkerBackend(
            choice.config,
            choice.policy_source,
            policy_is_factory=choice.policy_is_factory,
            initial=choice.served.state_dict(),
        )
        self._policy = self._backend.local_policy()

    def program(self, spec: WorkerSpec) -> WorkerProgram:
        return functools.partial(run_worker_with_policy, spec=spec, policy=self._policy)

    def serve(self, transport: Transport, end: ServerEnd) -> InferenceBackend:
        assert self._backend is not None
        backend, self._backend = self._backend, None
        return _started(backend)

    def abort(self) -> None:
        if self._backend is not None:
            self._backend.stop()
            self._backend = None


_CHOICES: Mapping[str, type[BackendChoice]] = {
    kind.name: kind for kind in (_ThreadChoice, _ProcessChoice, _InWorkerChoice)
}
BACKENDS = tuple(_CHOICES)  # the names inference_backend takes


def backend_kind(name: str) -> type[BackendChoice]:
    """The backend called ``name`` (one of :data:`BACKENDS`), for its capabilities."""
    return _CHOICES[name]


def choose_backend(
    name: str,
    config: InferenceConfig,
    *,
    served: torch.nn.Module,
    policy_source: Any,
    policy_is_factory: bool,
) -> BackendChoice:
    """The backend called ``name`` (one of :data:`BACKENDS`), configured, not started."""
    kind = _CHOICES[name]
    return kind(config, served if kind.keeps_served else None, policy_source, policy_is_factory)
