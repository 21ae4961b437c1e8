"""What a ``RayCollector`` decides before it starts an actor: checks, groups, resources.

* The arguments are checked in the driver, each error naming the argument, before any
  actor starts; what only an env or the policy itself can tell (spaces, outputs) is
  found by each actor's own ``AsyncBatchedCollector`` and raised from the constructor.
* ``env_fns`` are cut into ``num_collectors`` contiguous groups, sizes differing by
  one at most (the first groups take the extra envs).
* Each actor's batches hold its share of ``frames_per_batch``, in proportion to its
  envs: every env then takes as many steps per actor batch as in a local collector
  (``transition_chunk_size="auto"`` resolves the same), and the driver cuts exact
  batches from them whatever their sizes.
* Default resources: one CPU per worker process of the group, but no more than the
  largest node has nor than an even share of the cluster's CPUs, so that every actor
  can be placed; given ones are checked against the cluster's CPUs and GPUs, since an
  actor Ray cannot place would leave the driver waiting.

Imports Ray only to read the cluster's size.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import ray
import ray.cloudpickle

from rlcollect.collector import checks, values
from rlcollect.collector.options import Options, driver_options
from rlcollect.distributed.failures import envs_of

__all__ = ["Group", "cluster_capacity", "plan_groups", "check_arguments", "actor_options"]

# The collector's options (collector/options.py) the RayCollector keeps to itself rather
# than passing to the actors, and those it passes on (frames_per_batch and total_frames
# are its own arguments: each actor gets its share).
DRIVER_KWARGS = driver_options()
_COLLECTOR_KWARGS = {f.name for f in dataclasses.fields(Options)} - {
    "frames_per_batch",
    "total_frames",
}


@dataclass(frozen=True)
class Group:
    """The envs of one collector and the size of its batches."""

    index: int
    env_offset: int
    num_envs: int
    frames_per_batch: int


def check_arguments(
    env_fns: Any,
    policy: Any,
    num_collectors: Any,
    frames_per_batch: Any,
    total_frames: Any,
    max_collector_restarts: Any,
    collector_kwargs: Mapping[str, Any],
) -> list[Callable[[], Any]]:
    """Check what the driver can check alone; returns ``env_fns`` as a list."""
    fns = checks.check_env_fns(env_fns)
    values.check_int("num_collectors", num_collectors, minimum=1)
    if num_collectors > len(fns):
        raise ValueError(
            f"num_collectors={num_collectors}, but env_fns has {len(fns)} env factories: "
            "each collector needs at least one"
        )
    values.check_int("frames_per_batch", frames_per_batch, minimum=1)
    if total_frames != -1:
        values.check_int("total_frames", total_frames, minimum=1, extra="or -1 (endless)")
    values.check_int("max_collector_restarts", max_collector_restarts, minimum=0)
    if collector_kwargs.get("on_policy"):
        # [num_envs, T] batches of one weights version each would need every actor to
        # take its T steps per env under the same version: not built yet.
        raise ValueError(
            "on_policy=True is not supported by RayCollector: iterate flat batches and "
            "sort by (env_index, episode, step), or use AsyncBatchedCollector"
        )
    unknown = sorted(set(collector_kwargs) - _COLLECTOR_KWARGS)
    if unknown:
        raise TypeError(
            f"RayCollector got unexpected keyword argument(s) {unknown}: neither its own nor "
            "AsyncBatchedCollector's"
        )
    if policy is None and "policy_factory" not in collector_kwargs:
        raise TypeError("give exactly one of policy and policy_factory")
    for i, fn in enumerate(fns):
        _check_picklable(f"env_fns[{i}]", fn)
    if policy is not None:
        _check_picklable("policy", policy)
    else:
        _check_picklable("policy_factory", collector_kwargs["policy_factory"])
    return fns


def _check_picklable(name: str, value: Any) -> None:
    try:
        ray.cloudpickle.dumps(value)
    except Exception as exc:
        raise TypeError(
            f"{name} cannot be pickled to send it to a Ray actor ({type(exc).__name__}: "
            f"{exc}); make it picklable (a module-level class or function, or "
            "functools.partial of one)"
        ) from exc


def plan_groups(num_envs: int, num_collectors: int, frames_per_batch: int) -> list[Group]:
    """Contiguous groups of envs, and each one's batch size."""
    base, extra = divmod(num_envs, num_collectors)
    groups, offset = [], 0
    for k in range(num_collectors):
        n = base + (k < extra)
        fpb = max(1, round(frames_per_batch * n / num_envs))
        groups.append(Group(k, offset, n, fpb))
        offset += n
    return groups


@dataclass(frozen=True)
class Capacity:
    """CPUs and GPUs of the cluster in all, and of its largest node."""

    cpus: float
    gpus: float
    node_cpus: float
    node_gpus: float


def cluster_capacity() -> Capacity:
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    res = [n.get("Resources", {}) for n in nodes]
    return Capacity(
        cpus=sum(r.get("CPU", 0.0) for r in res),
        gpus=sum(r.get("GPU", 0.0) for r in res),
        node_cpus=max((r.get("CPU", 0.0) for r in res), default=0.0),
        node_gpus=max((r.get("GPU", 0.0) for r in res), default=0.0),
    )


def actor_options(
    group: Group,
    num_collectors: int,
    resources: Mapping[str, Any] | None,
    envs_per_worker: int | str,
    capacity: Capacity,
    concurrency: int,
) -> dict[str, Any]:
    """The Ray options of ``group``'s actor: its resources, spread over the nodes."""
    if resources is None:
        if values.is_auto(envs_per_worker):
            # A core per env, as far as a node and the share allow: the actor then lays
            # its workers out on the cores it was given (actor.py).
            workers = group.num_envs
        else:
            workers = max(1, group.num_envs // int(envs_per_worker))
        share = capacity.cpus / num_collectors
        cpus = math.floor(100 * min(workers, capacity.node_cpus, share)) / 100
        options: dict[str, Any] = {"num_cpus": cpus}
    else:
        if not isinstance(resources, Mapping) or not all(isinstance(k, str) for k in resources):
            raise TypeError(
                "resources_per_collector must be a dict of Ray actor options, e.g. "
                f'{{"num_cpus": 8, "num_gpus": 1}}; got {resources!r}'
            )
        options = dict(resources)
        _check_fits(options, num_collectors, capacity, group)
    options.setdefault("scheduling_strategy", "SPREAD")
    # Ray's own restarts would rebuild the collector from scratch behind the driver's
    # back; the driver restarts collectors itself, with their streams' numbering.
    options["max_restarts"] = 0
    options["max_concurrency"] = concurrency
    return options


def _check_fits(
    options: Mapping[str, Any], num_collectors: int, capacity: Capacity, group: Group
) -> None:
    for key, node, total, unit in (
        ("num_cpus", capacity.node_cpus, capacity.cpus, "CPUs"),
        ("num_gpus", capacity.node_gpus, capacity.gpus, "GPUs"),
    ):
        want = options.get(key, 0)
        if isinstance(want, bool) or not isinstance(want, (int, float)) or want < 0:
            raise ValueError(
                f"resources_per_collector[{key!r}] must be a number >= 0, got {want!r}"
            )
        if want > node:
            raise ValueError(
                f"resources_per_collector asks for {want} {unit} per collector, but the "
                f"largest node of the Ray cluster has {node:g}: no node could run "
                f"collector {group.index} ({envs_of(group.env_offset, group.num_envs)})"
            )
        if want * num_collectors > total:
            raise ValueError(
                f"{num_collectors} collectors asking for {want} {unit} each need "
                f"{want * num_collectors:g}, but the Ray cluster has {total:g}: ask for "
                "fewer per collector (resources_per_collector) or use fewer collectors"
            )


def split_kwargs(
    collector_kwargs: Mapping[str, Any],
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the driver's own keyword arguments, those every actor's collector gets)."""
    driver = {k: v for k, v in collector_kwargs.items() if k in DRIVER_KWARGS}
    actors = {k: v for k, v in collector_kwargs.items() if k not in DRIVER_KWARGS}
    return driver, actors


def group_fns(fns: Sequence[Callable[[], Any]], group: Group) -> list[Callable[[], Any]]:
    return list(fns[group.env_offset : group.env_offset + group.num_envs])
