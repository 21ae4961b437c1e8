"""One collector on one node: an ``AsyncBatchedCollector`` inside a Ray actor.

The driver (``collector.py``) makes this class a Ray actor with ``ray.remote``; this
module imports Ray only to name the node it runs on, so that it reads as plain Python. The actor
runs several threads (Ray's ``max_concurrency``): a few ``next_batch`` calls wait in
line for the collector while control calls (weights, pause, stats) go on beside them.

What the actor adds to its collector's batches, so that the driver need not touch them:

* ``env_index`` is offset to the env's position in the driver's ``env_fns``;
* ``episode`` is offset by ``episode_base``: after a restart, each env numbers its
  episodes on from the last one the driver received from the actor before;
* ``policy_version`` is the driver's version: the local collector counts its own
  updates from 0, and the actor maps each local version to the one the driver sent.

Threaded Ray actors do not keep the order of calls, so every batch carries the number
the actor gave it (in the order its collector produced them) and the driver puts them
back in order (``assembly.InOrder``); a weights update older than one already applied
is skipped.
"""

from __future__ import annotations

import contextlib
import functools
import os
import socket
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from gymnasium.vector import VectorEnv

from rlcollect.collector.checks import envs_per_worker_of
from rlcollect.collector.collector import AsyncBatchedCollector
from rlcollect.collector.probe import factory_takes_spaces
from rlcollect.collector.values import is_auto
from rlcollect.distributed.failures import Failure, describe
from rlcollect.distributed.rows import Rows, to_rows
from rlcollect.errors import CollectorError

__all__ = ["CollectorActor"]


def sub_envs(env_fn: Callable[[], Any]) -> int:
    """Envs one factory contributes: a vector env's sub-envs, else 1 (built, closed)."""
    env = env_fn()
    try:
        return int(env.num_envs) if isinstance(env, VectorEnv) else 1
    finally:
        env.close()


def _with_weights(factory: Callable[[], torch.nn.Module], weights: Any) -> torch.nn.Module:
    policy = factory()
    policy.load_state_dict(weights)
    return policy


def _with_weights_from_spaces(
    factory: Callable[[Any, Any], torch.nn.Module],
    weights: Any,
    observation_space: Any,
    action_space: Any,
) -> torch.nn.Module:
    """``_with_weights`` of a factory that takes the spaces: it asks for them too."""
    policy = factory(observation_space, action_space)
    policy.load_state_dict(weights)
    return policy


class CollectorActor:
    """An ``AsyncBatchedCollector`` over envs ``env_offset`` … of the driver's list.

    Never raises from its constructor: a collector that cannot be built (bad input, a
    failing env) is kept as the error :meth:`ready` raises, so the driver gets the
    exception itself rather than Ray's report of a dead actor.
    """

    def __init__(
        self,
        env_fns: Sequence[Callable[[], Any]],
        policy: torch.nn.Module | None,
        *,
        first_fn: int,
        total_fns: int,
        generation: int,
        episode_base: Sequence[int] | None,
        weights: Mapping[str, torch.Tensor] | None,
        policy_version: int,
        frames_per_batch: int,
        seed: int | None,
        cpus: float | None,
        collector_kwargs: Mapping[str, Any],
    ) -> None:
        self._error: BaseException | None = None
        self._offset = first_fn
        self._episode_base = torch.zeros(0, dtype=torch.int64)
        # _versions[local] = the driver's version of the weights the collector counts as
        # ``local``; guarded by _versions_lock with the update that extends it.
        self._versions = torch.tensor([policy_version], dtype=torch.int64)
        self._applied = policy_version
        self._versions_lock = threading.Lock()
        # One next() at a time, and none during a pause. A condition rather than a lock:
        # a pause asked for goes before the next_batch calls waiting in line.
        self._gate = threading.Condition()
        self._busy = False  # a next() is under way
        self._pausing = False  # a pause is asked for or held
        self._produced = 0
        self._pause: contextlib.AbstractContextManager[None] | None = None
        self.collector: AsyncBatchedCollector | None = None
        kwargs = dict(collector_kwargs)
        if weights is not None:
            # The restarted actor's collector serves the newest weights from its very
            # first inference batch: no row is stamped with weights it did not use.
            if policy is not None:
                policy.load_state_dict(weights)
            else:
                factory = kwargs["policy_factory"]
                try:
                    spaces = factory_takes_spaces(factory)
                except TypeError:
                    spaces = False  # the collector below names what is wrong with it
                rebuild = _with_weights_from_spaces if spaces else _with_weights
                kwargs["policy_factory"] = functools.partial(rebuild, factory, weights)
        if cpus is not None:
            if is_auto(kwargs.get("envs_per_worker")):
                # About one worker per core Ray gave this actor, not per core of the
                # node: other actors may share the node.
                kwargs["envs_per_worker"] = envs_per_worker_of(
                    "auto", len(env_fns), max(1, int(cpus))
                )
            # This process is the collector's alone: the cores Ray gave it that its env
            # workers leave free go to torch (the policy on the CPU), and no more.
            workers = len(env_fns) // kwargs.get("envs_per_worker", 1)
            torch.set_num_threads(max(1, int(cpus) - workers))
        try:
            # Env indices (and seeds) count a vector env's sub-envs one by one, and
            # every factory builds the same kind of env: this group's first tells.
            per_fn = sub_envs(env_fns[0])
            self._offset = first_fn * per_fn
            if seed is not None:  # as a local collector over all envs, renewed per restart
                seed += self._offset + total_fns * per_fn * generation
            self.collector = AsyncBatchedCollector(
                env_fns,
                policy,
                frames_per_batch=frames_per_batch,
                total_frames=-1,  # the driver keeps the budget
                seed=seed,
                **kwargs,
            )
            base = [0] * self.collector.num_envs if episode_base is None else episode_base
            self._episode_base = torch.tensor(list(base), dtype=torch.int64)
        except BaseException as exc:
            self._error = exc

    def _collector(self) -> AsyncBatchedCollector:
        if self._error is not None:
            raise self._error
        if self.collector is None:
            raise CollectorError("the collector actor has no collector")
        return self.collector

    def ready(self) -> dict[str, Any] | Failure:
        """Where the collector runs, or the error that kept it from starting."""
        try:
            collector = self._collector()
        except BaseException as exc:
            return describe(exc)
        import ray  # only ever called in a Ray actor

        return {
            "node": ray.get_runtime_context().get_node_id(),
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "env_offset": self._offset,
            "num_envs": collector.num_envs,
            "policy_device": str(collector.policy_device),
            "segments": _segments(collector),
        }

    def next_batch(self) -> tuple[int, Rows] | Failure:
        """The collector's next batch, numbered, with driver-wide indices and versions;
        or why the collector failed (after which it is shut down)."""
        try:
            collector = self._collector()
            with self._gate:
                self._gate.wait_for(lambda: not (self._busy or self._pausing))
                self._busy = True
            try:
                batch = next(collector)
                number = self._produced
                self._produced += 1
            finally:
                with self._gate:
                    self._busy = False
                    self._gate.notify_all()
        except Exception as exc:
            # The first error is the one to report: the calls queued behind it would
            # only find the collector shut down, and may reach the driver first.
            with self._versions_lock:
                self._error = self._error or exc
            return describe(self._error)
        batch["env_index"] += self._offset
        batch["episode"] += self._episode_base[batch["env_index"] - self._offset]
        with self._versions_lock:
            batch["policy_version"] = self._versions[batch["policy_version"]]
        return number, to_rows(batch)

    def update_weights(self, weights: Mapping[str, torch.Tensor], version: int) -> int | Failure:
        """Serve ``weights`` as the driver's ``version``, unless newer ones are served."""
        with self._versions_lock:
            if version <= self._applied:
                return self._applied
            try:
                local = self._collector().update_policy_weights_(weights)
            except Exception as exc:
                return describe(exc)
            if local >= len(self._versions):
                grown = torch.empty(local + 1, dtype=torch.int64)
                grown[: len(self._versions)] = self._versions
                self._versions = grown
            self._versions[local] = version
            self._applied = version
            return version

    def pause(self, timeout: float) -> Failure | None:
        """Hold the collector at a quiet point until :meth:`resume`: the batch in the
        making is finished first (the driver's pause waits for it), then none is made."""
        try:
            collector = self._collector()
        except Exception as exc:
            return describe(exc)
        with self._gate:
            if self._pausing:
                return describe(CollectorError("the collector is already paused"))
            self._pausing = True
            if not self._gate.wait_for(lambda: not self._busy, timeout):
                self._pausing = False
                self._gate.notify_all()
                error = CollectorError(f"the collector did not finish its batch within {timeout} s")
                return describe(error)
        try:
            pause = collector.pause(timeout)
            pause.__enter__()
            self._pause = pause
        except Exception as exc:
            self._open_gate()
            return describe(exc)
        return None

    def resume(self) -> None:
        pause, self._pause = self._pause, None
        try:
            if pause is not None:
                pause.__exit__(None, None, None)
        finally:
            self._open_gate()

    def _open_gate(self) -> None:
        with self._gate:
            self._pausing = False
            self._gate.notify_all()

    def stats(self) -> dict[str, Any] | Failure:
        try:
            return self._collector().stats()
        except Exception as exc:
            return describe(exc)

    def shutdown(self) -> None:
        """Stop the collector's workers and server and free its shared memory."""
        if self.collector is not None:
            with contextlib.suppress(BaseException):
                self.resume()
            self.collector.shutdown()


def _segments(collector: AsyncBatchedCollector) -> list[str]:
    """The shared-memory segments the collector made on this node: should this actor be
    killed (its worker processes with it), the driver unlinks what is left of them."""
    names = list(collector.transport.segments())
    if collector.server is not None:
        names += collector.server.segments()
    return names
