"""The collector actors, seen from the driver: start, keep busy, watch, restart, stop.

Each :class:`Member` is one contiguous group of ``env_fns`` and the actor collecting it
now. The driver keeps ``IN_FLIGHT`` ``next_batch`` calls queued at every actor (Ray
object refs), so an actor has its next request waiting whenever it finishes a batch,
and :meth:`Fleet.poll` takes whatever results have arrived, from any actor, in one
bounded ``ray.wait``.

Every wait is bounded: ``ray.wait`` and ``ray.get`` take a timeout; an actor that sends
nothing for ``QUIET_S`` seconds is pinged, and one that does not answer its ping within
``PING_TIMEOUT_S`` seconds counts as lost. An actor still starting (placed by Ray,
building its collector: its ``ready`` call is outstanding) is not pinged, since the ping
would only queue behind its constructor and a busy node can take minutes to start the
workers; it counts as lost when it has not started within the start timeout. Ray itself
reports an actor whose process died or whose node was lost (``RayActorError``) within
seconds.

A lost actor (``Fleet._lose``) is replaced while ``max_collector_restarts`` allows: the
rows it still held back are released with their episodes ended (``assembly.HoldBack``),
batches that arrived ahead of a missing one are dropped (never counted), and a new actor
builds the same envs, reseeded, numbering each env's episodes on from the last one
delivered, serving the newest weights under the newest version. It starts in the
background: the other actors' batches keep flowing meanwhile.
"""

from __future__ import annotations

import socket
import threading
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import ray

from rlcollect.distributed.assembly import HoldBack, InOrder
from rlcollect.distributed.failures import Failure, envs_of, lost_error
from rlcollect.distributed.rows import Rows, length
from rlcollect.errors import CollectorError, WorkerRestartWarning
from rlcollect.processes import unlink_segment

__all__ = ["CONTROL_THREADS", "IN_FLIGHT", "Fleet", "Lost", "Member"]

IN_FLIGHT = 3  # next_batch calls queued per actor: one being made, the next ones waiting
CONTROL_THREADS = 3  # actor threads beside them: weights, pause/resume, stats, pings
QUIET_S = 10.0  # seconds without a result after which an actor is pinged
PING_TIMEOUT_S = 60.0  # seconds an actor may take to answer a ping before it is lost
GET_TIMEOUT_S = 60.0  # seconds ray.get may take for a result ray.wait found ready
SHUTDOWN_S = 5.0  # seconds actors get to shut their collectors down before ray.kill


@dataclass
class Member:
    """One collector: ``env_fns[first_fn:first_fn + len(env_fns)]`` and its actor.

    ``env_offset`` and ``num_envs`` count envs as ``env_index`` does (a vector env's
    sub-envs one by one); until the first actor has reported them, they count factories.
    """

    index: int
    env_fns: list[Callable[[], Any]]
    first_fn: int
    frames_per_batch: int
    options: dict[str, Any]  # Ray actor options: resources, scheduling, concurrency
    hold_back: bool  # keep each env's latest row back (with restarts)
    env_offset: int = 0
    num_envs: int = 0
    holdback: HoldBack | None = None
    episode_base: np.ndarray | None = None  # first episode number of each env, after a restart
    handle: Any = None
    host: str = "?"
    node: str = "?"  # Ray node id
    generation: int = 0  # restarts of this collector so far
    in_order: InOrder = field(default_factory=InOrder)
    calls: dict[Any, str] = field(default_factory=dict)  # object ref: "batch" | "ready" | ...
    last_seen: float = 0.0
    ping_sent: float | None = None
    segments: tuple[str, ...] = ()  # its collector's shared-memory segments, on ``host``

    def __post_init__(self) -> None:
        self.env_offset, self.num_envs = self.first_fn, len(self.env_fns)

    @property
    def envs(self) -> str:
        return envs_of(self.env_offset, self.num_envs)

    @property
    def batches_in_flight(self) -> int:
        return sum(kind == "batch" for kind in self.calls.values())


class Fleet:
    """Every collector actor of one :class:`~rlcollect.distributed.RayCollector`."""

    def __init__(
        self,
        actor_class: Any,
        members: Sequence[Member],
        *,
        policy_ref: Any,
        collector_kwargs: Mapping[str, Any],
        seed: int | None,
        max_restarts: int,
    ) -> None:
        self._actor_class = actor_class
        self.members = list(members)
        self._policy_ref = policy_ref
        self._kwargs = dict(collector_kwargs)
        self._seed = seed
        self._total_fns = sum(len(m.env_fns) for m in self.members)
        self.max_restarts = max_restarts
        self.restarts = 0
        self.weights_ref: Any = None  # the newest weights in the object store
        self.version = 0
        self._lock = threading.RLock()  # the learner's updates beside the polling thread
        self._closed = False
        self._start_timeout = 0.0  # set by start(); bounds a restarted actor's start too

    # ------------------------------------------------------------------ start

    def start(self, timeout: float) -> None:
        """Start every actor and wait (at most ``timeout`` s) until each has built its
        collector; raises the first one's error otherwise."""
        self._start_timeout = timeout
        for m in self.members:
            self._spawn(m)
        deadline = time.monotonic() + timeout
        pending = {ref: m for m in self.members for ref, kind in m.calls.items() if kind == "ready"}
        while pending:
            done, _ = ray.wait(
                list(pending), num_returns=len(pending), timeout=_left(deadline), fetch_local=True
            )
            if not done:
                late = sorted(pending.values(), key=lambda m: m.index)
                raise CollectorError(
                    f"{len(late)} collector actor(s) did not start within {timeout:.0f} s "
                    f"(collector {late[0].index}, {late[0].envs}, asks Ray for "
                    f"{_resources(late[0].options)}); the cluster has "
                    f"{ray.available_resources()} free of {ray.cluster_resources()}: give "
                    "smaller resources_per_collector, fewer collectors or more nodes"
                )
            for ref in done:
                m = pending.pop(ref)
                m.calls.pop(ref)
                value = self._get(m, ref)
                if isinstance(value, Lost):
                    raise CollectorError(
                        f"collector {m.index} ({m.envs}) died while starting: {value.why}\n"
                        "rlcollect: if it could not unpickle its arguments, the modules that "
                        "define the policy and the env factories must be importable on every "
                        "node (installed there, or ray.init(runtime_env={'py_modules': [...]}))"
                    )
                self._take_ready(m, ref, value)
        per_fn = {m.num_envs // len(m.env_fns) for m in self.members}
        if len(per_fn) > 1:
            raise ValueError(
                "env_fns build envs of different kinds (vector envs of different sizes, or "
                "vector and plain envs): every factory must build the same kind of env"
            )

    @property
    def num_envs(self) -> int:
        """Envs in all, as ``env_index`` counts them."""
        return sum(m.num_envs for m in self.members)

    def _spawn(self, m: Member) -> None:
        """Start an actor for ``m`` (not waiting for it) and queue its first calls."""
        m.handle = self._actor_class.options(**m.options).remote(
            m.env_fns,
            self._policy_ref,  # a ref among the arguments: Ray passes its value
            first_fn=m.first_fn,
            total_fns=self._total_fns,
            generation=m.generation,
            episode_base=None if m.episode_base is None else m.episode_base.tolist(),
            weights=self.weights_ref,
            policy_version=self.version,
            frames_per_batch=m.frames_per_batch,
            seed=self._seed,
            cpus=m.options.get("num_cpus"),
            collector_kwargs=self._kwargs,
        )
        m.in_order = InOrder()
        m.calls = {m.handle.ready.remote(): "ready"}
        m.last_seen, m.ping_sent = time.monotonic(), None

    def _take_ready(self, m: Member, ref: Any, value: Any) -> None:
        if isinstance(value, Failure):
            raise value.error(m.index, m.env_offset, m.num_envs)
        m.host, m.node = str(value["host"]), str(value["node"])
        m.segments = tuple(value.get("segments", ()))
        m.env_offset, m.num_envs = int(value["env_offset"]), int(value["num_envs"])
        if m.hold_back and m.holdback is None:
            m.holdback = HoldBack(m.env_offset, m.num_envs)

    # ------------------------------------------------------------------ collect

    def poll(self, timeout: float, rows_wanted: int | None) -> list[Rows]:
        """Results that arrived within ``timeout`` s, as rows in each env's order.

        ``rows_wanted``: rows the driver still needs beyond what it holds (None:
        endless); no more batches than those are asked for.

        Raises:
            WorkerError, InferenceError: a collector failed, or an actor was lost with no
                restart left.
        """
        with self._lock:
            self._top_up(rows_wanted)
            out = self._watch()
            owner = {ref: m for m in self.members for ref in m.calls}
        if not owner:
            return out
        done, _ = ray.wait(list(owner), num_returns=1, timeout=timeout, fetch_local=True)
        if done:  # whatever else is ready too, without waiting again
            done, _ = ray.wait(list(owner), num_returns=len(owner), timeout=0, fetch_local=True)
        with self._lock:
            for ref in done:
                m = owner[ref]
                kind = m.calls.pop(ref, None)
                if kind is None:
                    continue  # a call to an actor replaced meanwhile
                value = self._get(m, ref)
                if isinstance(value, Lost):
                    out.extend(self._lose(m, value.why))
                    continue
                m.last_seen, m.ping_sent = time.monotonic(), None
                if isinstance(value, Failure):
                    raise value.error(m.index, m.env_offset, m.num_envs)
                if kind in ("ready", "ping"):
                    self._take_ready(m, ref, value)
                elif kind == "batch":
                    number, rows = value
                    for due in m.in_order.add(number, rows):
                        passed = due if m.holdback is None else m.holdback.pass_on(due)
                        if passed is not None and length(passed):
                            out.append(passed)
        return out

    def _top_up(self, rows_wanted: int | None) -> None:
        """Queue ``next_batch`` calls: up to IN_FLIGHT per actor, and only as many rows
        as are wanted, plus the rows that may stay held back (each actor's envs)."""
        if rows_wanted is not None:
            rows_wanted += sum(m.num_envs for m in self.members if m.holdback is not None)
            rows_wanted -= sum(m.batches_in_flight * m.frames_per_batch for m in self.members)
        for _ in range(IN_FLIGHT):
            for m in self.members:
                if rows_wanted is not None and rows_wanted <= 0:
                    return
                if m.batches_in_flight < IN_FLIGHT:
                    m.calls[m.handle.next_batch.remote()] = "batch"
                    if rows_wanted is not None:
                        rows_wanted -= m.frames_per_batch

    def _watch(self) -> list[Rows]:
        """Ping actors that have been quiet; lose those that do not answer, or do not
        start in time (returns the rows they held back)."""
        now = time.monotonic()
        out: list[Rows] = []
        for m in self.members:
            if _starting(m):  # last_seen: when it was spawned
                if now - m.last_seen > self._start_timeout:
                    why = f"it did not start within {self._start_timeout:.0f} s"
                    out.extend(self._lose(m, why))
            elif m.ping_sent is not None and now - m.ping_sent > PING_TIMEOUT_S:
                out.extend(self._lose(m, f"it did not answer for {PING_TIMEOUT_S:.0f} s"))
            elif m.ping_sent is None and now - m.last_seen > QUIET_S:
                m.calls[m.handle.ready.remote()] = "ping"
                m.ping_sent = now
        return out

    def _get(self, m: Member, ref: Any) -> Any:
        """The value of a finished call, or :class:`Lost` when the actor is gone."""
        try:
            return ray.get(ref, timeout=GET_TIMEOUT_S)
        except (ray.exceptions.RayActorError, ray.exceptions.ObjectLostError) as exc:
            return Lost.of(exc)
        except ray.exceptions.GetTimeoutError as exc:
            raise CollectorError(
                f"collector {m.index} ({m.envs}, on {m.host}): a finished batch did not reach "
                f"the driver within {GET_TIMEOUT_S:.0f} s"
            ) from exc
        except ray.exceptions.RayTaskError as exc:  # a bug in the actor's own code
            raise CollectorError(f"collector {m.index} ({m.envs}) raised: {exc}") from exc

    def _lose(self, m: Member, why: str) -> list[Rows]:
        """``m``'s actor is gone: restart it, or raise. Returns the rows it held back,
        each env's interrupted episode ended."""
        old = m.handle
        _kill(old)
        _unlink_left_behind(m)
        if self.restarts >= self.max_restarts or self._closed:
            raise lost_error(
                m.index, m.env_offset, m.num_envs, m.host, why, self.restarts, self.max_restarts
            )
        self.restarts += 1
        m.generation += 1
        released: list[Rows] = []
        if m.holdback is not None:
            last = m.holdback.last_episodes()
            ended = m.holdback.release_ended()
            if ended is not None:
                released.append(ended)
            before = np.zeros(m.num_envs, np.int64) if m.episode_base is None else m.episode_base
            m.episode_base = np.where(last >= 0, last + 1, before)
        warnings.warn(
            WorkerRestartWarning(
                f"restarting collector {m.index} ({m.envs}, on {m.host}) after: {why}; "
                f"restart {self.restarts} of max_collector_restarts={self.max_restarts}. Its "
                "envs' interrupted episodes end truncated; the rows it had not sent are "
                "dropped."
            ),
            stacklevel=2,
        )
        self._spawn(m)
        return released

    # ------------------------------------------------------------------ control

    def update(self, weights_ref: Any, version: int) -> None:
        """Send the newest weights to every actor (not waiting for them to apply)."""
        with self._lock:
            self.weights_ref, self.version = weights_ref, version
            for m in self.members:
                for ref, kind in list(m.calls.items()):
                    if kind == "update":  # superseded: its answer no longer matters
                        del m.calls[ref]
                m.calls[m.handle.update_weights.remote(weights_ref, version)] = "update"

    def call_all(
        self, method: str, timeout: float, *args: Any, skip_starting: bool = False
    ) -> list[Any]:
        """``method(*args)`` on every actor, their answers (:class:`Lost` for a dead one);
        raises a CollectorError naming the first actor that does not answer in time.

        ``skip_starting``: an actor still starting (a restart: building its collector
        can take longer than ``timeout`` on a busy machine) is not asked; its answer is
        :class:`Starting`.
        """
        with self._lock:
            refs = [
                (
                    m,
                    None
                    if skip_starting and _starting(m)
                    else getattr(m.handle, method).remote(*args),
                )
                for m in self.members
            ]
        deadline = time.monotonic() + timeout
        out: list[Any] = []
        for m, ref in refs:
            if ref is None:
                out.append(Starting())
                continue
            try:
                out.append(ray.get(ref, timeout=_left(deadline)))
            except (ray.exceptions.RayActorError, ray.exceptions.ObjectLostError) as exc:
                out.append(Lost.of(exc))
            except ray.exceptions.GetTimeoutError:
                raise CollectorError(
                    f"collector {m.index} ({m.envs}, on {m.host}) did not answer {method}() "
                    f"within {timeout} s"
                ) from None
        return out

    def shutdown(self) -> None:
        """Shut every collector down (``SHUTDOWN_S`` s at most), then kill every actor.
        Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            handles = [m.handle for m in self.members if m.handle is not None]
            for m in self.members:
                m.calls.clear()
        if not ray.is_initialized():
            return
        try:
            refs = [h.shutdown.remote() for h in handles]
            ray.wait(refs, num_returns=len(refs), timeout=SHUTDOWN_S)
        except Exception:  # Ray going away (at exit): the kills below still apply
            pass
        finally:
            for h in handles:
                _kill(h)
            for m in self.members:
                _unlink_left_behind(m)


def _starting(m: Member) -> bool:
    return "ready" in m.calls.values()


@dataclass(frozen=True)
class Starting:
    """The answer of an actor that was not asked: it is still starting."""


@dataclass(frozen=True)
class Lost:
    """The value of a call to an actor that is gone, and Ray's word on why."""

    why: str

    @classmethod
    def of(cls, exc: BaseException) -> Lost:
        # Ray's message runs to many lines (the actor's creation traceback among them):
        # its first line, and the last one that names an error, say what happened.
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
        why = lines[0] if lines else type(exc).__name__
        errors = [line for line in lines[1:] if "Error" in line.split(":")[0]]
        if errors and errors[-1] not in why:
            why += f" ({errors[-1]})"
        return cls(why)


def _unlink_left_behind(m: Member) -> None:
    """Unlink the segments of ``m``'s killed actor where this process can: on its own
    host (simulated nodes, one machine). A killed actor's worker processes normally
    unlink them on seeing it gone, but Ray may kill them with it. Unlinking a name still
    mapped elsewhere is harmless: the mappings stay valid until they go."""
    if m.host != socket.gethostname():
        return
    for name in m.segments:
        unlink_segment(name)


def _kill(handle: Any) -> None:
    if handle is None or not ray.is_initialized():
        return
    try:
        ray.kill(handle, no_restart=True)
    except Exception:  # already gone
        pass


def _left(deadline: float) -> float:
    return max(0.0, deadline - time.monotonic())


def _resources(options: Mapping[str, Any]) -> dict[str, Any]:
    keys = ("num_cpus", "num_gpus", "memory", "resources")
    return {k: options[k] for k in keys if k in options}
