"""``RayCollector``: one ``AsyncBatchedCollector`` per Ray actor, exact batches in the driver.

::

    node A (Ray actor: collector 0, envs 0-7)          node B (collector 1, envs 8-15)
    ┌──────────────────────────────────────────┐      ┌──────────────────────────────┐
    │ workers ─ring─▶ inference (local device) │      │ workers ─▶ inference          │
    │ AsyncBatchedCollector ─▶ batch [fpb / 2] │      │ ... ─▶ batch [fpb / 2]        │
    │   env_index + offset, episode, version   │      │                              │
    └────────────────┬─────────────────────────┘      └──────────────┬───────────────┘
                     │ numpy columns through the object store        │
                     │ (IN_FLIGHT next_batch calls queued per actor) │
                     ▼                                               ▼
    driver: Fleet.poll ─▶ InOrder (per actor) ─▶ HoldBack (restarts) ─▶ Assembler
            ─▶ TensorDict [frames_per_batch] ─▶ replay_buffer ─▶ caller
    update_policy_weights_: ray.put(state_dict) once ─▶ the ref to every actor

Inference stays on each node: an env step never waits for the network. Only finished
batches (to the driver) and weights (from it, one object-store copy per update, read by
every node) cross it.

The parts, each in a module of its own:

* ``plan.py``: argument checks, env groups, each actor's batch size and resources;
* ``actor.py``: the actor around its ``AsyncBatchedCollector`` (no Ray import);
* ``fleet.py``: the actors from the driver: requests in flight, liveness, restarts;
* ``assembly.py``: per-actor order, held-back rows, exact batches (no Ray import);
* ``rows.py``: batches as numpy columns; ``failures.py``: remote errors by name.

Iteration, background collection (``start``/``join``/``pause``, the ``train_ratio``
throttle) and the replay buffer work as on the local collector: both are a
``collector/facade.py`` over ``collector/background.py``. The budget is the driver's
alone: the actors collect endlessly and are stopped when it is met.
"""

from __future__ import annotations

import copy
import threading
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import ray
import torch

from rlcollect._tensordict import TensorDict
from rlcollect.collector import checks, values
from rlcollect.collector.background import POLL, Throttle
from rlcollect.collector.facade import CollectorFacade
from rlcollect.collector.lifecycle import Stage
from rlcollect.distributed import plan
from rlcollect.distributed.actor import CollectorActor
from rlcollect.distributed.assembly import Assembler
from rlcollect.distributed.failures import Failure
from rlcollect.distributed.fleet import CONTROL_THREADS, IN_FLIGHT, Fleet, Lost, Member, Starting
from rlcollect.errors import CollectorError
from rlcollect.inference.checks import check_weights
from rlcollect.replay.sink import SupportsExtend

__all__ = ["CollectorInfo", "RayCollector"]


@dataclass(frozen=True)
class CollectorInfo:
    """One collector of a ``RayCollector``, as :meth:`RayCollector.collectors` saw it."""

    index: int
    host: str
    node: str  # Ray node id
    actor: Any  # the Ray actor handle
    options: Mapping[str, Any]  # its Ray actor options: resources, scheduling
    segments: tuple[str, ...]  # its collector's shared-memory segments, on ``host``


START_TIMEOUT_S = 300.0  # seconds the actors may take to be placed and build their collectors
_CONTROL_TIMEOUT_S = 30.0  # seconds an actor may take to answer stats() or resume()


class RayCollector(CollectorFacade):
    """Collects from envs spread over the nodes of a Ray cluster, one
    :class:`~rlcollect.AsyncBatchedCollector` per Ray actor, in exact batches.

    ``env_fns`` are cut into ``num_collectors`` contiguous groups; each group is stepped
    by a collector in a Ray actor, with its own inference server on its own node. Batches
    keep the local collector's layout and guarantees: exactly ``frames_per_batch`` rows
    each (the last one what remains of ``total_frames``), ``env_index`` the env's
    position in ``env_fns`` whichever node stepped it, each env's transitions in order
    with no gap and no duplicate. Guide: ``docs/distributed.md``.

    Args:
        env_fns: zero-argument callables returning gymnasium envs; they are pickled to
            the actors, so they must be importable there (a module installed on every
            node, or ``functools.partial(gymnasium.make, ...)``).
        policy: a ``torch.nn.Module`` (or ``TensorDictModule``), pickled to every actor.
        num_collectors: Ray actors, each an ``AsyncBatchedCollector`` over its group.
        frames_per_batch: transitions per yielded batch.
        total_frames: transitions in all, or -1 to collect until :meth:`shutdown`.
        resources_per_collector: Ray actor options of each actor, e.g.
            ``{"num_cpus": 8, "num_gpus": 1}``; by default one CPU per worker process
            of its group (at most an even share of the cluster's CPUs, and what its
            largest node has; with ``envs_per_worker="auto"``, one per env within those
            bounds, the envs then grouped into about one worker per CPU given). Actors
            are spread over the nodes unless a
            ``scheduling_strategy`` is given.
        max_collector_restarts: collector actors restarted in all, after dying, before
            a :class:`~rlcollect.errors.WorkerError` is raised.
        **collector_kwargs: any other keyword argument of ``AsyncBatchedCollector``;
            ``replay_buffer``, ``train_ratio`` and ``learning_starts`` act in the
            driver, ``seed`` seeds env ``i`` with ``seed + i`` as locally, every other
            one goes to each actor's collector.

    Attributes:
        num_envs: envs in all (sub-envs of vector envs counted one by one).
        num_collectors: as given.
        frames_per_batch: as given.
        total_frames: as given (-1: endless).

    Raises:
        TypeError, ValueError: at construction, a bad argument (named), or what a
            collector actor's ``AsyncBatchedCollector`` raised building itself.
        WorkerError: while iterating, an env of a collector failed (``env_index`` in the
            driver's numbering), or a collector actor died past
            ``max_collector_restarts`` (named with its envs).
        InferenceError: while iterating, the policy failed in a collector.
        CollectorError: the actors could not be placed in time; iterating a collector
            shut down, paused or collecting in the background.

    Example: ``examples/ray_collect.py``, shown in ``docs/distributed.md``.
    """

    def __init__(
        self,
        env_fns: Sequence[Callable[[], Any]],
        policy: torch.nn.Module | None = None,
        *,
        num_collectors: int,
        frames_per_batch: int,
        total_frames: int = -1,
        resources_per_collector: Mapping[str, Any] | None = None,
        max_collector_restarts: int = 0,
        **collector_kwargs: Any,
    ) -> None:
        super().__init__()
        self._fleet: Fleet | None = None
        self._finalizer: weakref.finalize[Any, Any] | None = None
        self._shutdown_lock = threading.Lock()
        fns = plan.check_arguments(
            env_fns,
            policy,
            num_collectors,
            frames_per_batch,
            total_frames,
            max_collector_restarts,
            collector_kwargs,
        )
        driver_kwargs, actor_kwargs = plan.split_kwargs(collector_kwargs)
        self._replay_buffer: SupportsExtend | None = driver_kwargs.get("replay_buffer")
        throttle = checks.throttle_of(
            driver_kwargs.get("train_ratio"),
            driver_kwargs.get("learning_starts", 0),
            self._replay_buffer,
        )
        seed = values.seed_of(driver_kwargs.get("seed", 0))
        self.num_collectors = num_collectors
        self.frames_per_batch = frames_per_batch
        self.total_frames = total_frames
        # Weights are checked in the driver against the policy's names, shapes and
        # dtypes, so that a bad update fails at the call, with nothing changed, as locally.
        self._weights = None
        if policy is not None:
            self._weights = {n: (tuple(t.shape), t.dtype) for n, t in policy.state_dict().items()}

        if not ray.is_initialized():
            ray.init()  # RAY_ADDRESS, when set, names the cluster to join
        capacity = plan.cluster_capacity()
        groups = plan.plan_groups(len(fns), num_collectors, frames_per_batch)
        members = [
            Member(
                index=g.index,
                env_fns=plan.group_fns(fns, g),
                first_fn=g.env_offset,
                frames_per_batch=g.frames_per_batch,
                options=plan.actor_options(
                    g,
                    num_collectors,
                    resources_per_collector,
                    actor_kwargs.get("envs_per_worker", 1),
                    capacity,
                    IN_FLIGHT + CONTROL_THREADS,
                ),
                hold_back=max_collector_restarts > 0,
            )
            for g in groups
        ]
        self._started, self._cpu_started = time.perf_counter(), time.process_time()
        self._fleet = Fleet(
            ray.remote(CollectorActor),
            members,
            policy_ref=ray.put(_on_cpu(policy)),  # one copy, read by every actor
            collector_kwargs=actor_kwargs,
            seed=seed,
            max_restarts=max_collector_restarts,
        )
        self._lifecycle.move(Stage.OPEN)
        # Kills the actors if the collector is garbage-collected or open at exit (Ray
        # kills them too when this driver exits).
        self._finalizer = weakref.finalize(self, self._fleet.shutdown)
        try:
            self._fleet.start(START_TIMEOUT_S)
        except BaseException:
            self.shutdown()
            raise
        self.num_envs = self._fleet.num_envs
        self._assembler = Assembler(frames_per_batch, total_frames)
        learning_starts = driver_kwargs.get("learning_starts", 0)
        self._throttle = None if throttle is None else Throttle(*throttle, learning_starts)
        self._delivered = self._batches = 0
        self._wait_seconds = 0.0

    # ------------------------------------------------------------------ for the façade

    @property
    def _frames(self) -> int:
        return self._delivered

    def _next_batch(self) -> TensorDict | None:
        batch = self._assemble()
        if batch is None:
            return None
        if self._throttle is not None:
            self._throttle.wait(self._delivered, self._background.quiet_point)
        self._background.quiet_point()
        if self._replay_buffer is not None:
            self._replay_buffer.extend(batch)
        self._delivered += batch.batch_size[0]
        self._batches += 1
        return batch

    def _assemble(self) -> TensorDict | None:
        """The next exact batch out of the actors' rows; None once the budget is met."""
        assembler, fleet = self._assembler, self._fleet
        assert fleet is not None
        if assembler.exhausted:
            return None
        t0 = time.perf_counter()
        while not assembler.ready:
            self._background.quiet_point()
            wanted = None
            if self.total_frames != -1:
                wanted = self.total_frames - self._delivered - assembler.queued
            for rows in fleet.poll(POLL, wanted):
                assembler.add(rows)
        self._wait_seconds += time.perf_counter() - t0
        return assembler.pop()

    def _pausable(self) -> _Everyone | None:
        return None if self._fleet is None else _Everyone(self._fleet)

    def _release(self) -> None:
        with self._shutdown_lock:
            if self._lifecycle.move(Stage.CLOSED) is Stage.CLOSED:
                return
            finalizer, self._finalizer = self._finalizer, None
        if finalizer is not None:
            finalizer()  # Fleet.shutdown, once

    # ------------------------------------------------------------------ control

    def collectors(self) -> list[CollectorInfo]:
        """Each collector as it is now (a restarted one has a new actor): index, host,
        Ray node, actor handle, Ray resources and shared-memory segments."""
        if self._fleet is None:
            return []
        return [
            CollectorInfo(m.index, m.host, m.node, m.handle, dict(m.options), m.segments)
            for m in self._fleet.members
        ]

    @property
    def hosts(self) -> list[str]:
        """The host each collector runs on (now: a restarted one may have moved)."""
        return [] if self._fleet is None else [m.host for m in self._fleet.members]

    @property
    def policy_version(self) -> int:
        """Weights version in use: 0 at start, +1 per :meth:`update_policy_weights_`."""
        return 0 if self._fleet is None else self._fleet.version

    def update_policy_weights_(self, weights: torch.nn.Module | Mapping[str, torch.Tensor]) -> int:
        """Put new weights (a module or its ``state_dict()``) in the object store once and
        send every collector the reference; each copies them into its policy between
        two inference batches. Returns the new :attr:`policy_version`, which stamps the
        rows chosen with these weights.

        Raises:
            CollectorError: when shut down; the background error if collection failed.
            KeyError, TypeError, ValueError: weights whose names, types, shapes or
                dtypes are not the policy's, or that cannot be copied as they are (a meta
                or sparse tensor): nothing changed, the version not bumped.
        """
        self._background.raise_error()
        self._lifecycle.refuse("update")
        if self._fleet is None:
            raise CollectorError("the collector is shut down")
        state = weights.state_dict() if isinstance(weights, torch.nn.Module) else weights
        if self._weights is not None:
            check_weights(state, self._weights)
        cpu = {name: value.detach().to("cpu") for name, value in state.items()}
        version = self._fleet.version + 1
        self._fleet.update(ray.put(cpu), version)
        return version

    def stats(self) -> dict[str, Any]:
        """Frames, batches, throughput and driver CPU time per frame as on the local
        collector, ``collector_restarts``, and under ``collectors`` each collector's own
        ``stats()`` with its ``host`` and ``envs`` (``docs/distributed.md``).

        Raises:
            CollectorError: the background error, if background collection failed.
        """
        self._background.raise_error()
        frames = self._delivered
        out: dict[str, Any] = {
            "frames": frames,
            "batches": self._batches,
            **self._throughput(frames),
            "consumer_wait_seconds": self._wait_seconds,
            "policy_version": self.policy_version,
            "collector_restarts": 0 if self._fleet is None else self._fleet.restarts,
        }
        if self._throttle is not None:
            out.update(self._throttle.stats(frames))
        collectors: list[dict[str, Any]] = []
        fleet = self._fleet
        if fleet is not None:
            answers = (
                []
                if self._lifecycle.closed
                else fleet.call_all("stats", _CONTROL_TIMEOUT_S, skip_starting=True)
            )
            for i, m in enumerate(fleet.members):
                one: dict[str, Any] = {"collector": m.index, "envs": m.envs, "host": m.host}
                answer = answers[i] if answers else None
                if isinstance(answer, dict):
                    one.update(answer)
                elif isinstance(answer, Starting):
                    one["state"] = "starting"  # a restart still building its collector
                elif isinstance(answer, Lost):
                    one["error"] = f"lost: {answer.why}"
                elif isinstance(answer, Failure):
                    one["error"] = f"{answer.type_name}: {answer.message}"
                collectors.append(one)
        out["worker_restarts"] = sum(c.get("worker_restarts", 0) for c in collectors)
        out["collectors"] = collectors
        return out


def _on_cpu(policy: torch.nn.Module | None) -> torch.nn.Module | None:
    """``policy``, or a copy of it on the CPU: the actors' nodes need not have the
    driver's device (each serves its copy on its own ``policy_device``)."""
    if policy is None:
        return None
    tensors = [*policy.parameters(), *policy.buffers()]
    if all(t.device.type == "cpu" for t in tensors):
        return policy
    return copy.deepcopy(policy).cpu()


class _Everyone:
    """Pauses every collector actor (what ``Background.paused`` holds)."""

    def __init__(self, fleet: Fleet) -> None:
        self._fleet = fleet

    def pause(self, timeout: float) -> None:
        answers = self._fleet.call_all("pause", timeout + _CONTROL_TIMEOUT_S, timeout)
        for m, answer in zip(self._fleet.members, answers, strict=True):
            why = None
            if isinstance(answer, Lost):
                why = f"it was lost: {answer.why}"
            elif isinstance(answer, Failure):
                why = f"{answer.type_name}: {answer.message}"
            if why is not None:
                self.resume()
                raise CollectorError(f"collector {m.index} ({m.envs}) could not pause: {why}")

    def resume(self) -> None:
        self._fleet.call_all("resume", _CONTROL_TIMEOUT_S)
