"""The collection plan: every decision the collector makes before it starts anything.

:func:`plan_collection` checks the constructor's arguments (``checks.py``, in a fixed
order), builds env 0 and runs the policy once (``probe.py``), lays the ring out from
what it learned, writes one :class:`~rlcollect.worker.spec.WorkerSpec` per worker and
the configuration the inference backend is built from. The :class:`Plan` it returns is
frozen and has started nothing: no worker, no thread, no shared memory. The collector
(``collector.py``) starts the parts from it.

Names, one meaning each (``docs/architecture.md`` has the picture):

* ``envs_per_worker``: env *factories* per worker (the argument);
  ``RingLayout.columns`` / :attr:`Plan.worker_envs`: the envs a worker *steps*,
  its ring columns (``envs_per_worker`` times the sub-envs of a vector env).
* ``worker_splits`` (the argument) is ``RingLayout.splits``: request groups per worker.
* ``transition_chunk_size`` counts *transitions* per chunk (all of a worker's envs);
  ``chunk_steps`` counts *steps of each env* per chunk:
  ``transition_chunk_size == chunk_steps * worker_envs``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from gymnasium import spaces

from rlcollect.collector import checks
from rlcollect.collector.batches.loans import LEND_SLOTS, POOL_BLOCKS, Lending, lending
from rlcollect.collector.batches.restarts import RESTART_SLOTS
from rlcollect.collector.probe import (
    build_policy,
    observation_fields,
    probe_env,
    probe_policy,
    probe_runner,
    served_policy,
)
from rlcollect.inference.config import InferenceConfig, WeightsLayout
from rlcollect.inference.in_worker_policy import InWorkerPolicy, run_worker_with_policy
from rlcollect.inference.policy import output_fields
from rlcollect.inference.recurrent import state_fields
from rlcollect.inference.server import BatchingConfig
from rlcollect.replay.counting import CountsSamples
from rlcollect.replay.sink import SupportsExtend
from rlcollect.transports.base import Transport, WorkerProgram
from rlcollect.transports.layout import RingLayout, Staging
from rlcollect.worker.loop import run_worker
from rlcollect.worker.source import Source
from rlcollect.worker.spec import IS_INIT, WorkerSpec, transition_fields

__all__ = ["Plan", "plan_collection", "program"]

_SLOTS = 2  # chunk slots per worker: one being filled while the driver copies the other
_ROUND_SLOTS = 1  # on-policy: a worker's one round, which the driver gives back to start
# the next (collector/batches/rounds.py)


@dataclass(frozen=True)
class Plan:
    """What to start, decided once. Starts nothing; holds no resource but the served
    policy (thread backend) and the transport object (not yet started)."""

    num_envs: int
    frames_per_batch: int
    total_frames: int
    transport: Transport
    source: Source
    layout: RingLayout
    specs: tuple[WorkerSpec, ...]
    device: torch.device
    backend: str  # "thread" | "process" | "worker"
    inference: InferenceConfig
    #: The policy served in this process (``backend == "thread"``), or the weights the
    #: workers start from (``"worker"``); None for ``"process"``.
    served: torch.nn.Module | None
    #: What the inference process, or each worker, builds the policy from.
    policy_source: Any
    policy_is_factory: bool
    replay_buffer: SupportsExtend | None
    throttle: tuple[float, CountsSamples] | None  # (train_ratio, the buffer that counts)
    learning_starts: int
    max_worker_restarts: int
    stall_timeout: float | None
    on_policy: bool = False
    #: On-policy only: 1 starts round k+1 when batch k is handed out (``batches/ahead.py``).
    policy_lag: int = 0
    #: Batches are views of the ring, lent until let go (``batches/loans.py``): ``"chunk"``,
    #: one worker's chunk is a batch; ``"pool"``, one block of a pooled ring is; ``""``,
    #: every batch is copied out.
    lend: Lending = ""

    @property
    def envs_per_worker(self) -> int:
        """Env factories per worker, resolved."""
        return len(self.specs[0].env_fns)

    @property
    def worker_envs(self) -> int:
        """Envs each worker steps (its ring columns)."""
        return self.layout.columns

    @property
    def transition_chunk_size(self) -> int:
        """Transitions per worker message."""
        return self.layout.chunk_steps * self.layout.columns

    def programs(self, local: InWorkerPolicy | None = None) -> list[WorkerProgram]:
        """What each worker runs (see :func:`program`)."""
        return [program(spec, local) for spec in self.specs]


def program(spec: WorkerSpec, local: InWorkerPolicy | None) -> WorkerProgram:
    """What the worker of ``spec`` runs: the worker loop, with its own copy of the policy
    when ``local`` says how to build it (``inference_backend="worker"``)."""
    if local is not None:
        return functools.partial(run_worker_with_policy, spec=spec, policy=local)
    return functools.partial(run_worker, spec=spec)


def plan_collection(
    env_fns: Sequence[Callable[[], Any]],
    policy: torch.nn.Module | None,
    *,
    policy_factory: Callable[[], torch.nn.Module] | None,
    frames_per_batch: int,
    total_frames: int,
    transport: str | Transport,
    envs_per_worker: int | str,
    worker_splits: int | str | None,
    transition_chunk_size: int | str,
    max_batch_size: int | None,
    min_batch_size: int,
    batch_timeout: float,
    policy_device: str | torch.device | None,
    compile: bool | Mapping[str, Any],
    cuda_graph: bool,
    inference_backend: str,
    replay_buffer: SupportsExtend | None,
    train_ratio: float | None,
    learning_starts: int,
    seed: int | None,
    max_worker_restarts: int,
    stall_timeout: float | None,
    store_recurrent_state: bool = True,
    on_policy: bool = False,
    info_keys: Sequence[str] = (),
    policy_lag: int = 0,
) -> Plan:
    """Check the collector's arguments, probe env 0 and the policy, and lay out the run
    (the arguments are :class:`~rlcollect.AsyncBatchedCollector`'s)."""
    env_fns = checks.check_env_fns(env_fns)
    checks.check_int("frames_per_batch", frames_per_batch, minimum=1)
    if total_frames != -1:
        checks.check_int("total_frames", total_frames, minimum=1, extra="or -1 (endless)")
    envs_per_worker = checks.envs_per_worker_of(
        envs_per_worker, len(env_fns), checks.usable_cores()
    )
    if worker_splits is not None and not checks.is_auto(worker_splits):
        checks.check_int("worker_splits", worker_splits, minimum=1, extra='or None, or "auto"')
        if envs_per_worker % int(worker_splits):
            raise ValueError(
                f"worker_splits={worker_splits} does not divide envs_per_worker="
                f"{envs_per_worker}: a worker's envs split into equal groups"
            )
    if seed is not None:
        checks.check_int("seed", seed, minimum=0, extra="or None")
    if replay_buffer is not None and not callable(getattr(replay_buffer, "extend", None)):
        raise TypeError(
            f"replay_buffer must have an extend(tensordict) method; got "
            f"{type(replay_buffer).__name__}"
        )
    throttle = checks.throttle_of(train_ratio, learning_starts, replay_buffer)
    transport_obj = checks.make_transport(transport)
    if transport_obj.pickles_programs:
        checks.check_picklable(env_fns)
    if inference_backend == "worker" and policy_device is None:
        policy_device = "cpu"  # the workers' own cores: the only place it can run
    device = checks.device_of(policy_device)
    compile_options = checks.compile_options_of(compile)
    if not isinstance(cuda_graph, bool):
        raise ValueError(f"cuda_graph must be True or False, got {cuda_graph!r}")
    if device.type != "cuda" and (compile_options is not None or cuda_graph):
        raise ValueError(
            f"compile and cuda_graph need a CUDA policy_device; the policy runs on {device}"
        )
    source_of_policy = checks.policy_source(
        policy, policy_factory, inference_backend, transport_obj
    )
    checks.check_int("max_worker_restarts", max_worker_restarts, minimum=0)
    stall_timeout = checks.check_stall_timeout(stall_timeout)
    if not isinstance(store_recurrent_state, bool):
        raise ValueError(
            f"store_recurrent_state must be True or False, got {store_recurrent_state!r}"
        )
    if not isinstance(on_policy, bool):
        raise ValueError(f"on_policy must be True or False, got {on_policy!r}")
    checks.check_policy_lag(policy_lag, on_policy)
    names = checks.info_keys_of(info_keys)
    if max_worker_restarts and not transport_obj.supports_restart:
        raise ValueError(
            f"max_worker_restarts={max_worker_restarts}, but the transport "
            f"{type(transport_obj).__name__} cannot restart workers (supports_restart "
            "is False)"
        )

    if inference_backend == "worker":
        checks.check_worker_inference(device, max_batch_size, min_batch_size)
        if not transport_obj.pickles_programs and (compile_options is not None or cuda_graph):
            # Each worker compiles or captures its own step as it starts; threads of one
            # process would do so at the same time, and a CUDA graph capture in one
            # thread fails another thread's GPU work (seen on the H200).
            raise ValueError(
                "inference_backend='worker' with compile or cuda_graph needs worker "
                "processes (transport='process_slots'): worker threads of one process "
                "would compile and capture the policy at the same time"
            )
    source, info_fields = probe_env(env_fns[0], names, stall_timeout)
    if max_worker_restarts and source.vector:
        raise ValueError(
            "max_worker_restarts needs plain envs: env_fns build vector envs, whose "
            "chunks do not hold every sub-env's last transition to end its episode at"
        )
    splits = checks.splits_of(worker_splits, envs_per_worker, source, device)
    num_envs = len(env_fns) * source.envs
    worker_envs = envs_per_worker * source.envs
    if on_policy:
        chunk_steps = checks.on_policy_steps(
            frames_per_batch=frames_per_batch,
            total_frames=total_frames,
            num_envs=num_envs,
            chunk=transition_chunk_size,
            worker_envs=worker_envs,
            source=source,
            max_worker_restarts=max_worker_restarts,
        )
    else:
        chunk_steps = checks.chunk_steps_of(
            transition_chunk_size, frames_per_batch, num_envs, envs_per_worker, source
        )
    batching = BatchingConfig(
        max_batch_size=num_envs if max_batch_size is None else max_batch_size,
        min_batch_size=min_batch_size,
        batch_timeout=batch_timeout,
        # Half: the envs that did start are served well before a stuck one is reported
        # (counted from the first request: see BatchingConfig).
        first_round_timeout=None if stall_timeout is None else stall_timeout / 2,
    )
    paths, obs_fields = observation_fields(source.observation_space)
    if policy is not None:
        served = served_policy(policy, device, own=False)
    else:
        served = served_policy(build_policy(source_of_policy), device, own=True)
    runner = probe_runner(served, device, paths)
    action_field, extra_fields = output_fields(
        probe_policy(runner, source.observation_space, paths), source.action_space
    )
    recurrent = runner.initial_state is not None
    if recurrent and inference_backend == "worker":
        raise ValueError(
            "inference_backend='worker' serves feed-forward policies; this policy is "
            "recurrent (it has initial_state()): use inference_backend='thread' or 'process'"
        )
    if recurrent and store_recurrent_state:
        # The state each action was computed from: a policy output the server writes.
        assert runner.initial_state is not None
        extra_fields += state_fields(runner.initial_state)
    staging = None
    if source.vector:
        staged = (*(f.key for f in obs_fields), action_field.key)
        staged += (*(f.key for f in extra_fields), ("policy_version",))
        if recurrent:  # written by the worker with each staged observation
            staged += (IS_INIT.key,)
        staging = Staging(keys=staged, columns=source.batch_size)
    slots = RESTART_SLOTS if max_worker_restarts else _SLOTS
    if on_policy:
        slots = _ROUND_SLOTS
    num_workers = len(env_fns) // envs_per_worker
    lend = lending(
        vector=source.vector,
        names_slots=transport_obj.names_slots,
        copies_only=on_policy or max_worker_restarts > 0,
        backend=inference_backend,
        worker_rows=chunk_steps * worker_envs,
        slot_rows=chunk_steps * num_envs,
        frames_per_batch=frames_per_batch,
        recurrent=recurrent,
        pool_slots=transport_obj.pool_slots,
        num_workers=num_workers,
        gpu_policy=device.type == "cuda",
    )
    if lend:
        slots = POOL_BLOCKS if lend == "pool" else LEND_SLOTS
    checks.warn_of_thread_oversubscription(num_workers)
    layout = RingLayout(
        fields=transition_fields(
            obs_fields, action_field, extra_fields, info_fields, recurrent=recurrent
        ),
        num_workers=num_workers,
        columns=worker_envs,
        chunk_steps=chunk_steps,
        slots=slots,
        splits=splits,
        staging=staging,
        rounds=on_policy,
        pooled=lend == "pool",
    )
    outputs = {f.key: f for f in (action_field, *extra_fields)}
    inference = InferenceConfig(
        device=str(device),
        observation_paths=paths,
        observations=tuple(zip(paths, obs_fields, strict=True)),
        outputs=tuple(outputs.items()),
        layout=layout,
        batching=batching,
        capacity=max(batching.max_batch_size, layout.request_columns),
        compile_options=compile_options,
        cuda_graph=cuda_graph,
        weights=WeightsLayout.of(served.state_dict()),
        seed=seed,
        stall_timeout=stall_timeout,
        recurrent=recurrent,
        store_recurrent_state=store_recurrent_state,
        restarts=max_worker_restarts > 0,
    )
    specs = tuple(
        WorkerSpec(
            env_fns=tuple(env_fns[w * envs_per_worker : (w + 1) * envs_per_worker]),
            env_offset=w * worker_envs,
            seed=seed,
            chunk_steps=chunk_steps,
            slots=layout.credited_slots,
            source=source,
            observation_paths=paths,
            discrete_actions=isinstance(source.action_space, spaces.Discrete),
            splits=splits,
            on_policy=on_policy,
            info_keys=names,
        )
        for w in range(num_workers)
    )
    return Plan(
        num_envs=num_envs,
        frames_per_batch=frames_per_batch,
        total_frames=total_frames,
        transport=transport_obj,
        source=source,
        layout=layout,
        specs=specs,
        device=device,
        backend=inference_backend,
        inference=inference,
        # The inference process builds its own policy: the driver's probe copy goes. The
        # workers build theirs too, but start from this copy's weights.
        served=None if inference_backend == "process" else served,
        policy_source=source_of_policy,
        policy_is_factory=policy is None,
        replay_buffer=replay_buffer,
        throttle=throttle,
        learning_starts=learning_starts,
        max_worker_restarts=max_worker_restarts,
        stall_timeout=stall_timeout,
        on_policy=on_policy,
        policy_lag=policy_lag,
        lend=lend,
    )
