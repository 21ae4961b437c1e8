"""The collector's argument checks: each one names the argument and what is wrong with it.

Pure functions over the constructor's arguments; :func:`~rlcollect.collector.plan.plan_collection`
calls them in a fixed order (the order of the messages in ``docs/failures.md``). None of
them builds an env or a policy: that is ``probe.py``'s.
"""

from __future__ import annotations

import math
import os
import time
import warnings
import weakref
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import cloudpickle
import numpy as np
import torch
from gymnasium.vector import AutoresetMode

from rlcollect.collector.probe import factory_takes_spaces
from rlcollect.collector.values import (
    check_int,
    is_auto,
    is_flag,
    is_real,
    transition_chunk_size_of,
)
from rlcollect.inference.backend import BackendChoice
from rlcollect.replay.counting import CountsSamples
from rlcollect.transports.base import Transport
from rlcollect.transports.layout import Field
from rlcollect.transports.process_slots import ProcessSlotTransport
from rlcollect.transports.thread_queue import ThreadQueueTransport
from rlcollect.worker.source import Source

__all__ = [
    "available_memory",
    "CpuSample",
    "cgroup_cpu_quota",
    "check_batch_memory",
    "check_env_fns",
    "check_picklable",
    "check_policy_lag",
    "check_worker_inference",
    "chunk_steps_of",
    "claim_transport",
    "compile_options_of",
    "cpu_sample",
    "device_of",
    "envs_per_worker_of",
    "free_cores",
    "info_keys_of",
    "make_transport",
    "on_policy_steps",
    "policy_source",
    "splits_of",
    "throttle_of",
    "transport_name",
    "usable_cores",
    "warn_of_thread_oversubscription",
]

_TRANSPORTS: dict[str, Callable[[], Transport]] = {
    "thread": ThreadQueueTransport,
    "process_slots": ProcessSlotTransport,
}
_AUTO_CHUNK_CAP = 64  # steps per env and chunk beyond which per-message cost is noise
# Where the workers are threads of this process a message costs more than its own time:
# the consumer's thread wakes for it and takes the interpreter lock from the worker, and
# beside busy programs each such hand-over waits for a scheduler's turn. A chunk there
# holds the whole batch's steps, up to this many bytes (docs/decisions/chunk-size.md).
_THREAD_CHUNK_BYTES = 8 << 20


def usable_cores(cgroup: Path = Path("/sys/fs/cgroup")) -> int:
    """The cores this process may use: its affinity mask (where the OS has one), capped
    by the CPU quota of its cgroup where one is set (a container's ``--cpus``), which
    the mask does not show."""
    if hasattr(os, "sched_getaffinity"):
        cores = len(os.sched_getaffinity(0))
    else:
        cores = os.cpu_count() or 1
    quota = cgroup_cpu_quota(cgroup)
    return cores if quota is None else max(1, min(cores, math.ceil(quota)))


class CpuSample(NamedTuple):
    """When, how busy the machine had been, how much CPU this process had used, and
    each process beside it in its scheduling group (:func:`_group_cpu`)."""

    wall: float
    machine_busy: float  # CPU seconds of every core, all programs
    own: float  # CPU seconds of this process, all its threads
    group: dict[int, float]  # CPU seconds of each other process of this scheduling group


_MIN_LOAD_WINDOW = 0.05  # seconds: /proc/stat counts in ticks of 10 ms


def cpu_sample(stat: Path = Path("/proc/stat"), proc: Path = Path("/proc")) -> CpuSample | None:
    """The machine's busy CPU time, this process's own and its group's, now; None
    where the machine's cannot be read (not Linux)."""
    try:
        fields = [int(v) for v in stat.read_text().split("\n", 1)[0].split()[1:9]]
    except (OSError, ValueError):
        return None
    busy = sum(fields) - fields[3] - fields[4]  # all but idle and iowait; steal counts
    tick = os.sysconf("SC_CLK_TCK")
    return CpuSample(time.perf_counter(), busy / tick, time.process_time(), _group_cpu(proc))


def _group_cpu(proc: Path) -> dict[int, float]:
    """CPU seconds (user and system, by pid) of every other process that the scheduler
    weighs thread by thread against this one's: its own session where the kernel groups
    each session (``sched_autogroup_enabled``, the desktop default), every process this
    one can see where it does not. A CPU-bound process of the same group takes a share
    from each of a collector's processes alike; another group's busy processes take
    their group's share, however many processes the collector runs."""
    try:
        grouped = (proc / "sys/kernel/sched_autogroup_enabled").read_text().strip() == "1"
    except OSError:
        grouped = False
    me = os.getpid()
    session = os.getsid(0)
    tick = os.sysconf("SC_CLK_TCK")
    found: dict[int, float] = {}
    for entry in os.scandir(proc):
        if not entry.name.isdigit() or int(entry.name) == me:
            continue
        try:
            text = (proc / entry.name / "stat").read_text()
        except OSError:
            continue  # gone, or not ours to read
        # after the command's closing parenthesis: state ppid pgrp session ... utime stime
        rest = text[text.rindex(")") + 2 :].split()
        if len(rest) < 13 or (grouped and int(rest[3]) != session):
            continue
        found[int(entry.name)] = (int(rest[11]) + int(rest[12])) / tick
    return found


def free_cores(
    since: CpuSample | None, cores: int, stat: Path = Path("/proc/stat"), proc: Path = Path("/proc")
) -> tuple[float | None, float | None]:
    """What other programs left of the ``cores`` this process may use since ``since``
    (a :func:`cpu_sample`), as two figures scaled to ``cores``: the cores left free by
    the programs of other scheduling groups, and the cores kept busy by those of this
    process's own group (which share them with the collector thread by thread); None,
    None where unknown or the window was too short to tell."""
    now = cpu_sample(stat, proc)
    if since is None or now is None or now.wall - since.wall < _MIN_LOAD_WINDOW:
        return None, None
    wall = now.wall - since.wall
    total = os.cpu_count() or cores
    own = now.own - since.own
    others = max(0.0, (now.machine_busy - since.machine_busy) - own)
    # only processes seen at both ends: one that started or ended in between is unknown
    group = sum(max(0.0, now.group[pid] - t) for pid, t in since.group.items() if pid in now.group)
    group = min(group, others)
    free = max(0.0, cores - (others - group) / wall * cores / total)
    beside = group / wall  # cores' worth, as they ran
    share = own / wall  # what the probe's one thread that never waits got
    if (others + own) / wall >= _SATURATED * total and 0 < share < 1:
        # Every core was taken: the group's programs got shares, not what they asked
        # for. Each of theirs that never waits got what the probe's thread got, so
        # they asked for their time over its share.
        beside /= share
    return free, beside * cores / total


_SATURATED = 0.9  # of every core busy: the machine gave shares, not what was asked


def cgroup_cpu_quota(root: Path) -> float | None:
    """CPUs' worth of time the cgroup mounted at ``root`` may use per period, or None
    for no quota (or no cgroup file to read). cgroup v2 writes ``"<quota> <period>"``
    or ``"max <period>"`` to ``cpu.max``; v1 has ``cpu/cpu.cfs_quota_us`` (-1: none)
    and ``cpu/cpu.cfs_period_us``."""
    try:
        quota, period = (root / "cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        quota_us = int((root / "cpu" / "cpu.cfs_quota_us").read_text())
        period_us = int((root / "cpu" / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return quota_us / period_us if quota_us > 0 and period_us > 0 else None


def available_memory(
    cgroup: Path = Path("/sys/fs/cgroup"), meminfo: Path = Path("/proc/meminfo")
) -> int | None:
    """Bytes this process may allocate at most: the kernel's estimate of memory
    available without swapping (``MemAvailable`` of ``meminfo``), capped by the memory
    limit of the cgroup mounted at ``cgroup`` (a container's ``--memory``: v2
    ``memory.max``, v1 ``memory/memory.limit_in_bytes``); None where neither can be
    read. The limit, not what is left of it: the cgroup's usage counts page cache that
    the kernel reclaims on demand, and a check must never refuse what would work."""
    found: list[int] = []
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                found.append(int(line.split()[1]) * 1024)
    except (OSError, ValueError, IndexError):
        pass
    for limit in ("memory.max", "memory/memory.limit_in_bytes"):
        try:
            found.append(int((cgroup / limit).read_text()))
        except (OSError, ValueError):
            continue  # no such file, or "max": no limit
        break
    return min(found) if found else None


def check_batch_memory(
    fields: Sequence[Field], frames_per_batch: int, total_frames: int, available: int | None
) -> None:
    """A batch of ``frames_per_batch`` rows of ``fields`` (fewer if ``total_frames`` is
    smaller) must fit in the memory ``available``: checked before any part starts, where
    numpy would fail (or the kernel's OOM killer strike) once the workers run."""
    rows = frames_per_batch if total_frames == -1 else min(frames_per_batch, total_frames)
    row_bytes = sum(int(np.prod(f.shape, dtype=np.int64)) * f.dtype.itemsize for f in fields)
    need = rows * row_bytes
    if available is None or need <= available:
        return
    gib = 2**30
    raise ValueError(
        f"frames_per_batch={frames_per_batch}: a batch of {rows} transitions of {row_bytes} "
        f"bytes takes {need / gib:.1f} GiB, but this machine has {available / gib:.1f} GiB "
        "of memory available; use a smaller frames_per_batch"
    )


def envs_per_worker_of(envs_per_worker: Any, factories: int, cores: int) -> int:
    """Env factories per worker: ``envs_per_worker``, checked, or for ``"auto"`` the
    divisor of ``factories`` that leaves the number of workers nearest ``cores``.

    Nearest by ratio (16 workers are as far from 8 cores as 4 are); a tie goes to fewer
    workers (fewer processes to start, fewer and fuller requests). So no more workers
    than cores where a divisor allows it, and one env each while envs are fewer than
    cores. Why about one worker per core: ``docs/tuning.md``, *envs_per_worker*.
    """
    if is_auto(envs_per_worker):
        divisors = [k for k in range(1, factories + 1) if factories % k == 0]
        return min(divisors, key=lambda k: (abs(math.log(factories / k / cores)), -k))
    check_int("envs_per_worker", envs_per_worker, minimum=1, extra='or "auto"')
    if factories % envs_per_worker:
        raise ValueError(
            f"{factories} envs cannot be split into workers of envs_per_worker="
            f'{envs_per_worker}; use a divisor of the number of envs, or "auto"'
        )
    return int(envs_per_worker)


def check_env_fns(env_fns: Any) -> list[Callable[[], Any]]:
    if isinstance(env_fns, (str, bytes)) or not isinstance(env_fns, Sequence):
        raise TypeError(
            "env_fns must be a sequence of zero-argument callables returning gymnasium "
            f"envs; got {type(env_fns).__name__}"
        )
    if not env_fns:
        raise ValueError("env_fns is empty: give at least one env factory")
    for i, fn in enumerate(env_fns):
        if not callable(fn):
            raise TypeError(f"env_fns[{i}] is a {type(fn).__name__}, not a callable")
    return list(env_fns)


def policy_source(
    policy: Any, factory: Any, backend: type[BackendChoice], transport: Transport
) -> Any:
    """Check the policy arguments against the backend; returns what builds the policy."""
    if (policy is None) == (factory is None):
        raise TypeError("give exactly one of policy and policy_factory")
    if factory is not None and not callable(factory):
        raise TypeError(
            f"policy_factory must be a zero-argument callable, got {type(factory).__name__}"
        )
    if factory is not None:
        factory_takes_spaces(factory)  # takes none or two arguments, or a TypeError here
    source: Any = policy if policy is not None else factory
    if backend.needs_request_channel and not transport.supports_request_channel:
        raise ValueError(
            f"inference_backend={backend.name!r} needs transport='process_slots': the "
            "inference process serves the workers through their shared-memory ring"
        )
    if backend.policy_travels_to is not None:
        what = "policy" if policy is not None else "policy_factory"
        try:
            cloudpickle.dumps(source)
        except Exception as exc:
            raise TypeError(
                f"{what} cannot be pickled for {backend.policy_travels_to} "
                f"({type(exc).__name__}: {exc}); make it picklable or use "
                "inference_backend='thread'"
            ) from exc
    return source


def throttle_of(
    ratio: Any, learning_starts: Any, replay_buffer: Any
) -> tuple[float, CountsSamples] | None:
    """The checked ``(train_ratio, buffer)`` collection waits on, or None (unthrottled)."""
    if ratio is None:
        if learning_starts != 0:
            raise ValueError("learning_starts only applies with a train_ratio; pass train_ratio=")
        return None
    if not is_real(ratio) or not ratio > 0:
        raise ValueError(
            f"train_ratio must be a number > 0 (rows sampled per row collected), got {ratio!r}"
        )
    if not math.isfinite(ratio):
        raise ValueError(f"train_ratio must be finite, got {ratio!r}")
    check_int("learning_starts", learning_starts, minimum=0)
    # The protocol, not the class: any buffer that counts its rows will do.
    if not isinstance(replay_buffer, CountsSamples):
        raise TypeError(
            "train_ratio needs replay_buffer= to be an rlcollect.ReplayBuffer, or another "
            "buffer that counts the rows the learner samples (rlcollect.replay.CountsSamples; "
            "wrap one with rlcollect.replay.CountingBuffer(buffer) and sample through the "
            f"wrapper); got {type(replay_buffer).__name__}"
        )
    return float(ratio), replay_buffer


def chunk_steps_of(
    chunk: int | str,
    fpb: int,
    num_envs: int,
    envs_per_worker: int,
    source: Source,
    *,
    total_frames: int = -1,
    threads: bool = False,
    step_bytes: int = 0,
) -> int:
    """Steps of each env per chunk, from ``transition_chunk_size`` (transitions).

    ``"auto"``: a batch's steps of each env (``fpb // num_envs``, or ``total_frames``'s
    where it is fewer), at most 64; where the workers are threads of this process
    (``threads``), at most what keeps a chunk within ``_THREAD_CHUNK_BYTES`` at
    ``step_bytes`` per env step, a cap never below 64."""
    if chunk == "auto":
        # no env steps past the run's end to fill a chunk (total_frames -1: endless)
        batch = fpb if total_frames < 0 else min(fpb, total_frames)
        steps = max(1, batch // num_envs)
        cap = _AUTO_CHUNK_CAP
        if threads:
            worker_envs = envs_per_worker * source.envs
            cap = max(cap, _THREAD_CHUNK_BYTES // max(1, worker_envs * step_bytes))
        return min(cap, steps)
    chunk = transition_chunk_size_of(chunk)
    assert isinstance(chunk, int)
    worker_envs = envs_per_worker * source.envs
    if chunk % worker_envs:
        what = f"envs_per_worker={envs_per_worker}"
        if source.vector:
            what = f"the {worker_envs} envs of a worker ({what}, {source.sub_envs} sub-envs each)"
        raise ValueError(
            f"transition_chunk_size={chunk} is not a multiple of {what}: a chunk holds the "
            "same number of steps of every env of a worker"
        )
    return chunk // worker_envs


def info_keys_of(info_keys: Any) -> tuple[str, ...]:
    """The checked ``info_keys``: distinct non-empty names."""
    if isinstance(info_keys, str) or not isinstance(info_keys, (Sequence, set, frozenset)):
        raise TypeError(
            f"info_keys must be a sequence of info entry names, e.g. ('lives',); got {info_keys!r}"
        )
    names = tuple(info_keys)
    for name in names:
        if not isinstance(name, str) or not name:
            raise ValueError(f"info_keys must hold non-empty strings, got {name!r}")
    if len(set(names)) != len(names):
        raise ValueError(f"info_keys names an entry twice: {names!r}")
    return names


def check_policy_lag(policy_lag: int, on_policy: bool) -> None:
    """``policy_lag=1`` only with ``on_policy=True``."""
    if policy_lag and not on_policy:
        raise ValueError(
            "policy_lag=1 needs on_policy=True: it starts the next on-policy round while the "
            "learner learns. Off-policy collection never waits for the learner; its lag is "
            "each batch's policy_version against yours"
        )


def on_policy_steps(
    *,
    frames_per_batch: int,
    total_frames: int,
    num_envs: int,
    chunk: int | str,
    worker_envs: int,
    source: Source,
    max_worker_restarts: int,
) -> int:
    """``T``, the steps of each env per on-policy batch, once the combination is checked."""
    if frames_per_batch % num_envs:
        raise ValueError(
            f"on_policy=True: frames_per_batch={frames_per_batch} is not a multiple of the "
            f"{num_envs} envs; each batch is [num_envs, T] with T = frames_per_batch // "
            f"num_envs (e.g. frames_per_batch={num_envs * max(1, frames_per_batch // num_envs)})"
        )
    steps = frames_per_batch // num_envs
    if total_frames != -1 and total_frames % frames_per_batch:
        raise ValueError(
            f"on_policy=True: total_frames={total_frames} is not a multiple of "
            f"frames_per_batch={frames_per_batch}; every on-policy batch holds T={steps} steps "
            "of every env, so the budget must be whole batches (or -1)"
        )
    if chunk != "auto" and chunk != steps * worker_envs:
        raise ValueError(
            f"on_policy=True: transition_chunk_size={chunk!r}, but a worker hands over one "
            f"round of T={steps} steps of its {worker_envs} envs at a time: leave it at "
            f'"auto" (or {steps * worker_envs})'
        )
    if max_worker_restarts:
        raise ValueError(
            f"on_policy=True with max_worker_restarts={max_worker_restarts}: a restarted "
            "worker's envs would start new episodes in the middle of a round, leaving its "
            "rows short of T steps; use max_worker_restarts=0"
        )
    if source.vector and (source.asynchronous or source.autoreset is AutoresetMode.NEXT_STEP):
        how = (
            f"driven with send/recv (batch_size={source.batch_size} < {source.sub_envs} sub-envs)"
            if source.asynchronous
            else "with the NextStep autoreset mode"
        )
        raise ValueError(
            f"on_policy=True: env_fns build vector envs {how}. On-policy rounds need every "
            "step to finish one transition of every sub-env, so that each gets T per round "
            "without stepping past it: use a vector env stepped whole with "
            "autoreset_mode=SameStep or Disabled (e.g. gymnasium.vector.SyncVectorEnv(..., "
            "autoreset_mode=gymnasium.vector.AutoresetMode.SAME_STEP))"
        )
    return steps


def splits_of(
    worker_splits: int | str | None, envs_per_worker: int, source: Source, device: torch.device
) -> int:
    """Request splits per worker: ``worker_splits``, its default, or for ``"auto"`` the
    fewest splits above one where the policy runs on a GPU, and one split elsewhere."""
    if source.vector:
        if not (worker_splits in (None, envs_per_worker) or is_auto(worker_splits)):
            raise ValueError(
                f"worker_splits={worker_splits}, but with vector envs each of a worker's "
                f"envs_per_worker={envs_per_worker} vector envs is a group of its own: "
                'leave worker_splits at None or "auto", or set it to envs_per_worker'
            )
        return envs_per_worker
    if is_auto(worker_splits):
        # With the policy on a GPU, one split steps while another's request is served,
        # hiding the server's latency behind env steps; more splits than needed only
        # make smaller requests. On the CPU the server's time is the envs' own cores',
        # so there is nothing to hide (docs/tuning.md, worker_splits).
        if device.type != "cuda" or envs_per_worker == 1:
            return 1
        return next(d for d in range(2, envs_per_worker + 1) if envs_per_worker % d == 0)
    # Default 1: with the policy on the CPU, splitting has nothing to hide
    # (docs/tuning.md, worker_splits).
    return 1 if worker_splits is None else int(worker_splits)


# Transport instances given to a collector, by id (a user's transport need not be
# hashable); an entry goes when its transport is garbage-collected.
_claimed: weakref.WeakValueDictionary[int, Transport] = weakref.WeakValueDictionary()


def make_transport(transport: str | Transport) -> Transport:
    if isinstance(transport, Transport):
        if _claimed.get(id(transport)) is transport:
            raise ValueError(
                f"this {type(transport).__name__} instance already serves another collector: "
                "a transport serves one collector; pass a new instance"
            )
        return transport
    if isinstance(transport, str) and transport in _TRANSPORTS:
        return _TRANSPORTS[transport]()
    raise ValueError(
        f"transport must be one of {sorted(_TRANSPORTS)} or a Transport instance, or "
        f'"auto"; got {transport!r}'
    )


def transport_name(transport: Transport) -> str:
    """The name a ``transport`` argument gives ``transport``'s kind (its class name for
    a transport of the caller's own)."""
    for name, kind in _TRANSPORTS.items():
        if type(transport) is kind:
            return name
    return type(transport).__name__


def check_picklable(env_fns: list[Callable[[], Any]]) -> None:
    for i, fn in enumerate(env_fns):
        try:
            cloudpickle.dumps(fn)
        except Exception as exc:
            raise TypeError(
                f"env_fns[{i}] cannot be pickled for a worker process ({type(exc).__name__}: "
                f"{exc}); make the factory picklable or use transport='thread'"
            ) from exc


def check_worker_inference(
    device: torch.device, max_batch_size: int | None, min_batch_size: int
) -> None:
    """``inference_backend="worker"``: each worker runs the policy on its own requests,
    on its CPU or a CUDA device; there is no server to batch them."""
    if device.type not in ("cpu", "cuda"):
        raise ValueError(
            "inference_backend='worker' runs the policy inside each env worker, on its CPU "
            f"or a CUDA device; policy_device={str(device)!r} is neither"
        )
    if max_batch_size is not None or min_batch_size != 1:
        raise ValueError(
            "max_batch_size and min_batch_size shape the server's batches; "
            "inference_backend='worker' has no server (each worker serves its own envs, "
            "worker_splits groups at a time): leave them unset"
        )


def device_of(policy_device: str | torch.device | None) -> torch.device:
    if policy_device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(policy_device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"policy_device {policy_device!r} is not a torch device") from exc
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"policy_device={policy_device!r}, but CUDA is not available here")
    return device


def compile_options_of(compile: Any) -> dict[str, Any] | None:
    if is_flag(compile):
        return {} if compile else None
    if isinstance(compile, Mapping):
        return dict(compile)
    raise ValueError(
        f"compile must be True, False or a dict of torch.compile options, got {compile!r}"
    )


_warned_of_threads = False  # once per process: the setting is the script's, not a collector's


def warn_of_thread_oversubscription(num_workers: int) -> None:
    """Warn once when torch's intra-op pool in this process (the learner's) and the env
    workers together want more cores than there are: the pool's threads spin between
    small operations and take the workers' cores (``docs/tuning.md``, *Torch threads*).
    The collector changes nothing itself: the pool belongs to the training script."""
    global _warned_of_threads
    threads = torch.get_num_threads()
    cores = usable_cores()
    if _warned_of_threads or threads <= 1 or num_workers + threads <= cores:
        return
    _warned_of_threads = True
    warnings.warn(
        f"torch runs {threads} intra-op threads in this process (the learner's pool) "
        f"beside {num_workers} env workers on {cores} cores: they will compete for the "
        f"cores. Call torch.set_num_threads({max(1, cores - num_workers)}) in the "
        "training script before creating the collector (docs/tuning.md, Torch threads).",
        RuntimeWarning,
        stacklevel=4,
    )


def claim_transport(transport: Transport) -> None:
    """Mark ``transport`` as this collector's, just before it starts, so a second
    collector given it is refused before it can touch the first one's workers."""
    _claimed[id(transport)] = transport
