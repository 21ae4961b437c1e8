"""The collection plan: every decision the collector makes before it starts anything.

:func:`plan_collection` checks the arguments (each value alone: ``options.py``; values
together: ``checks.py``), builds env 0 (``env0.py``) and runs the policy once
(``probe.py``), and then decides, once, everything the parts would otherwise branch on:

* the layout where the caller left it to the collector (``choice.py``: transport,
  inference backend, envs per worker, splits), from figures the probe measures,
* the inference backend (``inference/backend.py``: what the workers run, who serves),
* the delivery (``batches/delivery.py``: copied, lent chunks, a pooled ring, or
  on-policy rounds, with the ring's slots),
* the ring's layout, one :class:`~rlcollect.worker.spec.WorkerSpec` per worker and the
  configuration the backend builds its server from.

The :class:`Plan` it returns is frozen and has started nothing (no thread, no shared
memory, no worker) but, where env 0 is a vector env built where it will run, worker 0's
process that built it (``env0.py``), which the transport adopts as it starts; a plan
that fails ends it. ``start.py`` starts the parts from it. The words (column, split, chunk,
slot, delivery, ...) are defined once in ``docs/architecture.md``, *Terminology*.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from gymnasium import spaces

from rlcollect.collector import checks, values
from rlcollect.collector.batches.delivery import Delivery, choose_delivery
from rlcollect.collector.choice import KNOBS, Choice
from rlcollect.collector.env0 import adopted, env0_probed, first_worker, timing
from rlcollect.collector.figures import choose_layout
from rlcollect.collector.options import Options
from rlcollect.collector.probe import (
    ProbedEnv,
    build_policy,
    factory_takes_spaces,
    observation_fields,
    probe_policy,
    probe_runner,
    served_policy,
    warn_of_trailing_ones,
)
from rlcollect.inference.backend import BackendChoice, backend_kind, choose_backend
from rlcollect.inference.config import InferenceConfig, WeightsLayout
from rlcollect.inference.policy import PolicyRunner, output_fields
from rlcollect.inference.recurrent import state_fields
from rlcollect.inference.server import BatchingConfig
from rlcollect.replay.counting import CountsSamples
from rlcollect.transports.base import Transport
from rlcollect.transports.first_worker import FirstWorker
from rlcollect.transports.layout import Field, Path, RingLayout, Staging
from rlcollect.worker.source import Source
from rlcollect.worker.spec import IS_INIT, WorkerSpec, transition_fields

__all__ = ["Plan", "plan_collection"]


@dataclass(frozen=True)
class Plan:
    """What to start, decided once. Starts nothing; holds no resource but the served
    policy (in its backend choice) and the transport object (not yet started)."""

    options: Options  # as checked
    num_envs: int
    transport: Transport
    source: Source
    layout: RingLayout
    specs: tuple[WorkerSpec, ...]
    device: torch.device
    backend: BackendChoice
    delivery: Delivery
    throttle: tuple[float, CountsSamples] | None  # (train_ratio, the buffer that counts)
    choice: Choice  # the layout, what it was chosen from and why
    #: Worker 0's process where it built env 0 (``env0.py``), adopted at the start.
    first_worker: FirstWorker | None = None

    @property
    def envs_per_worker(self) -> int:
        """Env factories per worker, resolved."""
        return len(self.specs[0].env_fns)

    @property
    def transition_chunk_size(self) -> int:
        """Transitions per worker message."""
        return self.layout.chunk_steps * self.layout.columns


class _Arguments(NamedTuple):
    """The arguments as the plan uses them, checked together, the layout resolved."""

    env_fns: list[Callable[[], Any]]
    envs_per_worker: int
    transport: Transport
    backend: type[BackendChoice]
    device: torch.device
    compile_options: dict[str, Any] | None
    policy_source: Any
    throttle: tuple[float, CountsSamples] | None


class _Early(NamedTuple):
    """What the checks before any env or policy is built settled: the device, and each
    layout knob the caller gave, checked (absent where it is ``"auto"``)."""

    given: dict[str, Any]
    transport: Transport | None  # made from a given transport
    device: torch.device
    compile_options: dict[str, Any] | None
    throttle: tuple[float, CountsSamples] | None


class _Probed(NamedTuple):
    """What env 0 and one call of the policy told."""

    source: Source
    info_fields: tuple[Field, ...]
    paths: tuple[Path, ...]
    obs_fields: tuple[Field, ...]
    served: torch.nn.Module
    #: A policy factory as every process that builds the policy calls it: with no
    #: argument (one that takes the spaces, bound to env 0's); None with a policy.
    factory: Any
    runner: PolicyRunner
    action_field: Field
    extra_fields: tuple[Field, ...]
    env0: ProbedEnv  # what building env 0 told, its step time among it


def plan_collection(
    env_fns: Sequence[Callable[[], Any]], policy: torch.nn.Module | None, options: Options
) -> Plan:
    """Check the collector's arguments, probe env 0 and the policy, choose the layout
    left to the collector, and lay out the run (the arguments are
    :class:`~rlcollect.AsyncBatchedCollector`'s)."""
    load = checks.cpu_sample()  # the machine's load is measured over the probe
    fns = checks.check_env_fns(env_fns)
    o = options.checked()
    early = _check_early(fns, policy, o)
    first = first_worker(fns, early.transport, o, timing(early.given))
    try:  # another process's probe is no measure of the others' load: left unknown
        return _plan(fns, policy, o, early, first, None if first is not None else load)
    except BaseException:  # Ctrl-C included: worker 0's process ends with the plan
        if first is not None:
            first.close()
        raise


def _plan(
    fns: list[Callable[[], Any]],
    policy: torch.nn.Module | None,
    o: Options,
    early: _Early,
    first: FirstWorker | None,
    load: checks.CpuSample | None,
) -> Plan:
    probed = _probe(fns, early, policy, o, first)
    choice = choose_layout(
        fns,
        policy if policy is not None else o.policy_factory,
        o,
        early.given,
        early.device,
        probed.env0,
        probed.runner,
        probed.paths,
        load,
    )
    args = _resolve(fns, policy, o, early, probed, choice)
    first, fns = adopted(first, args.transport, fns)
    source = probed.source
    splits = choice.worker_splits
    num_envs = len(fns) * source.envs
    columns = args.envs_per_worker * source.envs
    chunk_steps = _chunk_steps(o, args, source, num_envs, choice.figures.observation_bytes)
    recurrent = probed.runner.initial_state is not None
    num_workers = len(fns) // args.envs_per_worker
    delivery = choose_delivery(
        on_policy=o.on_policy,
        restarts=o.max_worker_restarts > 0,
        vector=source.vector,
        names_slots=args.transport.names_slots,
        lends_pooled_blocks=args.backend.lends_pooled_blocks_with(args.device),
        recurrent=recurrent,
        worker_rows=chunk_steps * columns,
        block_rows=chunk_steps * num_envs,
        frames_per_batch=o.frames_per_batch,
        num_workers=num_workers,
        pool_slots=args.transport.pool_slots,
    )
    checks.warn_of_thread_oversubscription(num_workers)
    layout = _layout(o, probed, delivery, num_workers, columns, chunk_steps, splits)
    checks.check_batch_memory(
        layout.fields, o.frames_per_batch, o.total_frames, checks.available_memory()
    )
    config = _inference_config(o, args, probed, layout, num_envs)
    specs = tuple(
        WorkerSpec(
            env_fns=tuple(fns[w * args.envs_per_worker : (w + 1) * args.envs_per_worker]),
            env_offset=w * columns,
            seed=o.seed,
            chunk_steps=chunk_steps,
            slots=layout.credited_slots,
            source=source,
            observation_paths=probed.paths,
            discrete_actions=isinstance(source.action_space, spaces.Discrete),
            splits=splits,
            on_policy=o.on_policy,
            info_keys=tuple(o.info_keys),
        )
        for w in range(num_workers)
    )
    backend = choose_backend(
        args.backend.name,
        config,
        served=probed.served,
        policy_source=probed.factory if policy is None else args.policy_source,
        policy_is_factory=policy is None,
    )
    return Plan(
        options=o,
        num_envs=num_envs,
        transport=args.transport,
        source=source,
        layout=layout,
        specs=specs,
        device=args.device,
        backend=backend,
        delivery=delivery,
        throttle=args.throttle,
        choice=choice,
        first_worker=first,
    )


def _check_early(
    env_fns: list[Callable[[], Any]], policy: torch.nn.Module | None, o: Options
) -> _Early:
    """The checks of values together that need no env or policy built: every value the
    caller gave is checked here, before the probe, as before the layout was chosen."""
    given = {knob: getattr(o, knob) for knob in KNOBS if not values.is_auto(getattr(o, knob))}
    if "envs_per_worker" in given:
        given["envs_per_worker"] = checks.envs_per_worker_of(
            given["envs_per_worker"], len(env_fns), checks.usable_cores()
        )
    splits = given.get("worker_splits")
    if splits is not None and "envs_per_worker" in given and given["envs_per_worker"] % splits:
        raise ValueError(
            f"worker_splits={splits} does not divide envs_per_worker="
            f"{given['envs_per_worker']}: a worker's envs split into equal groups"
        )
    throttle = checks.throttle_of(o.train_ratio, o.learning_starts, o.replay_buffer)
    transport = None
    if "transport" in given:
        transport = checks.make_transport(given["transport"])
        given["transport"] = transport
        if transport.pickles_programs:
            checks.check_picklable(env_fns)
    backend = backend_kind(given["inference_backend"]) if "inference_backend" in given else None
    in_workers = backend is not None and backend.in_workers
    device = checks.device_of("cpu" if in_workers and o.policy_device is None else o.policy_device)
    compile_options = checks.compile_options_of(o.compile)
    if device.type != "cuda" and (compile_options is not None or o.cuda_graph):
        raise ValueError(
            f"compile and cuda_graph need a CUDA policy_device; the policy runs on {device}"
        )
    # The policy arguments, and pickling where the backend is given; the transport a
    # chosen one will be is checked against the backend once it is chosen (_resolve).
    checks.policy_source(
        policy,
        o.policy_factory,
        backend or backend_kind("thread"),
        transport or checks.make_transport("process_slots"),
    )
    checks.check_policy_lag(o.policy_lag, o.on_policy)
    if o.time_major and not o.on_policy:
        raise ValueError(
            "time_major=True lays out on-policy rounds as [T, num_envs]; it needs "
            "on_policy=True (off-policy batches are rows of many envs, with no time axis)"
        )
    if transport is not None:
        _check_restarts(o, transport)
    if backend is not None:
        _check_in_workers(o, backend, transport, device, compile_options)
    return _Early(given, transport, device, compile_options, throttle)


def _check_restarts(o: Options, transport: Transport) -> None:
    if o.max_worker_restarts and not transport.supports_restart:
        raise ValueError(
            f"max_worker_restarts={o.max_worker_restarts}, but the transport "
            f"{type(transport).__name__} cannot restart workers (supports_restart "
            "is False)"
        )


def _check_in_workers(
    o: Options,
    backend: type[BackendChoice],
    transport: Transport | None,
    device: torch.device,
    compile_options: dict[str, Any] | None,
) -> None:
    """The in-worker policy's own checks (the transport's part once it is known)."""
    if not backend.in_workers:
        return
    checks.check_worker_inference(device, o.max_batch_size, o.min_batch_size)
    if transport is None:
        return
    if not transport.pickles_programs and (compile_options is not None or o.cuda_graph):
        # Each worker compiles or captures its own step as it starts; threads of one
        # process would do so at the same time, and a CUDA graph capture in one
        # thread fails another thread's GPU work.
        raise ValueError(
            "inference_backend='worker' with compile or cuda_graph needs worker "
            "processes (transport='process_slots'): worker threads of one process "
            "would compile and capture the policy at the same time"
        )


def _probe(
    env_fns: list[Callable[[], Any]],
    early: _Early,
    policy: torch.nn.Module | None,
    o: Options,
    first: FirstWorker | None,
) -> _Probed:
    """Build env 0 (or read what ``first`` built) and call the policy once: the ring's
    fields come from them. Where a layout knob is left to the collector, env 0's steps
    are also timed."""
    env0 = env0_probed(env_fns[0], first, o, timing(early.given))
    source = env0.source
    if o.max_worker_restarts and source.vector:
        raise ValueError(
            "max_worker_restarts needs plain envs: env_fns build vector envs, whose "
            "chunks do not hold every sub-env's last transition to end its episode at"
        )
    paths, obs_fields = observation_fields(source.observation_space)
    factory: Any = None
    if policy is not None:
        served = served_policy(policy, early.device, own=False)
    else:
        factory = o.policy_factory
        assert factory is not None  # checks.policy_source: exactly one of the two
        if factory_takes_spaces(factory):
            # Bound here, once: every process that builds the policy calls it with none.
            factory = functools.partial(factory, source.observation_space, source.action_space)
        served = served_policy(build_policy(factory), early.device, own=True)
    runner = probe_runner(served, early.device, paths, o.exploration_type)
    action_field, extra_fields = output_fields(
        probe_policy(runner, source.observation_space, paths), source.action_space
    )
    if o.on_policy and not runner.tensordict_policy:
        warn_of_trailing_ones(extra_fields)
    if runner.initial_state is not None and o.store_recurrent_state:
        # The state each action was computed from: a policy output the server writes.
        extra_fields += state_fields(runner.initial_state)
    return _Probed(
        source,
        env0.info_fields,
        paths,
        obs_fields,
        served,
        factory,
        runner,
        action_field,
        extra_fields,
        env0,
    )


def _resolve(
    env_fns: list[Callable[[], Any]],
    policy: torch.nn.Module | None,
    o: Options,
    early: _Early,
    probed: _Probed,
    choice: Choice,
) -> _Arguments:
    """The arguments as the plan uses them, with the chosen layout, checked together:
    what was checked before the probe is not checked again."""
    transport = early.transport
    if transport is None:
        transport = checks.make_transport(choice.transport)
        if transport.pickles_programs:
            checks.check_picklable(env_fns)
        _check_restarts(o, transport)
    backend = backend_kind(choice.inference_backend)
    # A chosen backend that sends the policy elsewhere was chosen after it pickled
    # (figures.py): only a given one is checked here, against a chosen transport.
    checked = backend if "inference_backend" in early.given else backend_kind("thread")
    source_of_policy = checks.policy_source(policy, o.policy_factory, checked, transport)
    if len(early.given) < len(KNOBS):
        _check_in_workers(o, backend, transport, early.device, early.compile_options)
    if probed.runner.initial_state is not None and backend.in_workers:
        raise ValueError(
            "inference_backend='worker' serves feed-forward policies; this policy is "
            "recurrent (it has initial_state()): use inference_backend='thread' or 'process'"
        )
    return _Arguments(
        env_fns,
        choice.envs_per_worker,
        transport,
        backend,
        early.device,
        early.compile_options,
        source_of_policy,
        early.throttle,
    )


def _chunk_steps(
    o: Options, args: _Arguments, source: Source, num_envs: int, observation_bytes: int
) -> int:
    """Steps of each env per chunk (a round's ``T`` on-policy)."""
    columns = args.envs_per_worker * source.envs
    if o.on_policy:
        return checks.on_policy_steps(
            frames_per_batch=o.frames_per_batch,
            total_frames=o.total_frames,
            num_envs=num_envs,
            chunk=o.transition_chunk_size,
            worker_envs=columns,
            source=source,
            max_worker_restarts=o.max_worker_restarts,
        )
    return checks.chunk_steps_of(
        o.transition_chunk_size,
        o.frames_per_batch,
        num_envs,
        args.envs_per_worker,
        source,
        total_frames=o.total_frames,
        # workers in this process (threads): fewer, larger chunks (checks.chunk_steps_of)
        threads=not args.transport.pickles_programs,
        # what a step writes: its observation twice (this and the next), the rest small
        step_bytes=2 * observation_bytes + 64,
    )


def _layout(
    o: Options,
    probed: _Probed,
    delivery: Delivery,
    num_workers: int,
    columns: int,
    chunk_steps: int,
    splits: int,
) -> RingLayout:
    """The ring: every transition field, each worker's columns and slots."""
    recurrent = probed.runner.initial_state is not None
    staging = None
    if probed.source.vector:
        staged = (*(f.key for f in probed.obs_fields), probed.action_field.key)
        staged += (*(f.key for f in probed.extra_fields), ("policy_version",))
        if recurrent:  # written by the worker with each staged observation
            staged += (IS_INIT.key,)
        staging = Staging(keys=staged, columns=probed.source.batch_size)
    return RingLayout(
        fields=transition_fields(
            probed.obs_fields,
            probed.action_field,
            probed.extra_fields,
            probed.info_fields,
            recurrent=recurrent,
        ),
        num_workers=num_workers,
        columns=columns,
        chunk_steps=chunk_steps,
        slots=delivery.slots,
        splits=splits,
        staging=staging,
        rounds=delivery.rounds,
        pooled=delivery.pooled,
    )


def _inference_config(
    o: Options, args: _Arguments, probed: _Probed, layout: RingLayout, num_envs: int
) -> InferenceConfig:
    """What the backend builds its server (or each worker its policy) from."""
    batching = BatchingConfig(
        max_batch_size=num_envs if o.max_batch_size is None else o.max_batch_size,
        min_batch_size=o.min_batch_size,
        batch_timeout=o.batch_timeout,
        # Half: the envs that did start are served well before a stuck one is reported
        # (counted from the first request: see BatchingConfig).
        first_round_timeout=None if o.stall_timeout is None else o.stall_timeout / 2,
    )
    outputs = {f.key: f for f in (probed.action_field, *probed.extra_fields)}
    return InferenceConfig(
        device=str(args.device),
        observation_paths=probed.paths,
        observations=tuple(zip(probed.paths, probed.obs_fields, strict=True)),
        outputs=tuple(outputs.items()),
        layout=layout,
        batching=batching,
        capacity=max(batching.max_batch_size, layout.request_columns),
        compile_options=args.compile_options,
        cuda_graph=o.cuda_graph,
        weights=WeightsLayout.of(probed.served.state_dict()),
        seed=o.seed,
        stall_timeout=o.stall_timeout,
        recurrent=probed.runner.initial_state is not None,
        store_recurrent_state=o.store_recurrent_state,
        restarts=o.max_worker_restarts > 0,
        exploration_type=o.exploration_type,
    )
