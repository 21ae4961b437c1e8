"""``AsyncBatchedCollector``: envs in workers, one batching inference server, exact batches.

::

    env_fns ─▶ workers (threads or processes, numpy only) ──ring──▶ InferenceServer thread
                   │ full chunks, by index                               (policy on device)
                   ▼
    caller ◀─ TensorDict [frames_per_batch] ◀─ BatchBuilder (the iterating thread) ─▶ replay_buffer

The collector checks its arguments, builds one env in the driver to learn the spaces
(and whether factories build plain envs or vector envs, see ``source.py``),
runs the policy once on sampled observations to learn its outputs, lays the ring out
from both, starts the transport and the server, and then turns chunks into batches for
as long as the caller iterates.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import math
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Literal

import cloudpickle
import numpy as np
import torch
from gymnasium import spaces
from tensordict import TensorDict

from rlcollect.collector.batches import BatchBuilder
from rlcollect.collector.restarts import RESTART_SLOTS, WorkerRestarts
from rlcollect.collector.source import Source, describe
from rlcollect.collector.spec import WorkerSpec, observation_key, transition_fields
from rlcollect.collector.worker import run_worker
from rlcollect.errors import ChannelClosed, CollectorError, WorkerError
from rlcollect.inference.backend import InferenceBackend
from rlcollect.inference.policy import PolicyRunner, output_fields
from rlcollect.inference.process import InferenceConfig, ProcessInference, WeightsLayout
from rlcollect.inference.server import BatchingConfig, InferenceServer
from rlcollect.inference.step import build_action_step
from rlcollect.replay.buffer import ReplayBuffer
from rlcollect.replay.sink import SupportsExtend
from rlcollect.transports.base import ServerEnd, Transport
from rlcollect.transports.layout import Field, Path, RingLayout, Staging
from rlcollect.transports.process_slots import ProcessSlotTransport
from rlcollect.transports.thread_queue import ThreadQueueTransport

__all__ = ["AsyncBatchedCollector"]

_TRANSPORTS: dict[str, Callable[[], Transport]] = {
    "thread": ThreadQueueTransport,
    "process_slots": ProcessSlotTransport,
}
_SLOTS = 2  # chunk slots per worker: one being filled while the driver copies the other
_AUTO_CHUNK_CAP = 64  # steps per env and chunk beyond which per-message cost is noise
_POLL = 0.1  # seconds between liveness checks while waiting for chunks
_BACKENDS = ("thread", "process")
_JOIN_TIMEOUT = 10.0  # seconds shutdown() waits for the background thread's last write


class AsyncBatchedCollector:
    """Collects transitions from many envs with one batched policy, asynchronously.

    Iterating yields :class:`tensordict.TensorDict` batches of exactly
    ``frames_per_batch`` transitions (the last one holds what remains of
    ``total_frames``) with the keys ``observation``, ``action``, every other policy
    output, ``policy_version``, ``env_index``, ``episode``, ``step`` and
    ``("next", "observation" | "reward" | "terminated" | "truncated" | "done")``.
    Rows of one batch come from many envs; sort by ``(env_index, episode, step)`` to
    read one env's stream.

    Args:
        env_fns: zero-argument callables, each returning a ``gymnasium.Env`` or a
            ``gymnasium.vector.VectorEnv``. Env ``i`` is the one ``env_fns[i]`` builds;
            a factory that returns a vector env of ``n`` sub-envs contributes ``n``
            consecutive env indices instead (every factory must build the same kind of
            env). A vector env with ``send``/``recv`` and ``batch_size < num_envs``
            (ale-py's ``AtariVectorEnv``) is driven asynchronously; see
            ``docs/usage.md``. With ``transport="process_slots"`` the factories travel to
            the workers with cloudpickle.
        policy: a ``torch.nn.Module`` (receives the observation batch, returns the
            action tensor or a mapping holding ``action``) or a ``TensorDictModule``
            whose ``out_keys`` include ``action``. The collector serves a deep copy on
            ``policy_device``; push new weights with :meth:`update_policy_weights_`.
            With ``inference_backend="process"`` it travels to the inference process
            with cloudpickle.
        policy_factory: instead of ``policy``, a zero-argument callable that builds it
            (called once in the driver to learn the policy's outputs, and once in the
            inference process with ``inference_backend="process"``, so the policy need
            not be picklable, only the factory). Give exactly one of the two.
        frames_per_batch: transitions per yielded batch.
        total_frames: transitions to deliver in all, or -1 to collect until
            :meth:`shutdown`.
        transport: ``"process_slots"`` (worker processes, shared memory),
            ``"thread"`` (worker threads in this process), or a
            :class:`~rlcollect.transports.Transport` instance (used for this collector
            only).
        envs_per_worker: env factories per worker (envs it steps one after the other,
            or vector envs it drives in turn); ``len(env_fns)`` must be a multiple of it.
        worker_splits: groups a worker's envs split into, each with its own request
            outstanding: one group steps while the others wait for their actions
            (double buffering). A divisor of ``envs_per_worker``; default (None): 1, which
            measured fastest with the policy on the CPU (``docs/benchmarks.md``); try 2
            where inference runs on a GPU and cores are free. With vector envs each
            vector env is a group, so it must be ``envs_per_worker`` (the default there).
        transition_chunk_size: transitions per message from a worker, a multiple of the
            envs a worker steps (``envs_per_worker``, times the sub-envs of a vector env:
            a chunk holds as many transitions as steps of each of the worker's envs).
            ``"auto"`` gives each env ``frames_per_batch // num_envs`` steps per
            chunk, at least 1 and at most 64: a batch then draws on many envs rather
            than a few (fresher data, no env over-represented), while the per-message
            cost is already spread over many transitions where batches are large.
        max_batch_size: most env observations per policy call (default: every env).
        min_batch_size: observations the server waits for before a call ...
        batch_timeout: ... but never longer than this many seconds after the oldest
            waiting request.
        policy_device: where the policy runs; default ``"cuda"`` when available, else
            ``"cpu"``. On a GPU, observations go up from page-locked memory in one
            asynchronous copy per batch and outputs come back the same way.
        compile: ``True``, or a dict of ``torch.compile`` keyword arguments: the action
            step is compiled, for every padded batch size, before collection starts.
            Needs a CUDA ``policy_device``.
        cuda_graph: capture the whole action step (dtype conversion, forward, sampling)
            as a CUDA graph once per padded batch size (powers of two up to
            ``max_batch_size``) and replay it. The policy must be capturable (no host
            synchronisation, no data-dependent control flow); weights pushed with
            :meth:`update_policy_weights_` are copied in place, so graphs stay valid.
            Needs a CUDA ``policy_device``.
        inference_backend: where the server runs and how weights reach it.
            ``"thread"``: a thread of this process; weights are copied into the served
            policy in place. ``"process"``: a process of its own (needs
            ``transport="process_slots"``), so a learner in this process never holds up
            inference by holding the GIL; weights travel through shared memory, two
            versions in flight at most. Either way an update lands between two
            inference batches, and each transition carries the version that chose it.
        replay_buffer: an :class:`rlcollect.ReplayBuffer`, or anything with
            ``.extend(tensordict)`` (:class:`~rlcollect.replay.sink.SupportsExtend`: a
            TorchRL replay buffer, say); every batch is written to it, in one call,
            before it is yielded. Needed by :meth:`start`.
        train_ratio: rows the learner samples from ``replay_buffer`` per row collected
            (DreamerV3 uses 2 to 16). Collection then waits for the learner instead of
            running ahead: a batch is written only once the learner has sampled
            ``train_ratio`` times the rows collected before it, so collection leads by
            one batch at most. Needs an :class:`rlcollect.ReplayBuffer`, which counts
            the rows sampled from it. Default None: unthrottled.
        learning_starts: rows collected without waiting for the learner (fill the
            buffer before learning); only with ``train_ratio``. The learner must be
            able to start sampling after this many rows, or both wait for each other.
        seed: env ``i`` is reset with ``seed + i`` the first time; None leaves envs
            unseeded.
        max_worker_restarts: how many times in all the collector restarts a worker that
            failed (an env raised, the process died) instead of raising its error. The
            worker's envs are rebuilt and reset; each one's interrupted episode ends
            ``truncated`` at its last delivered transition, and the transitions it had
            not handed over yet are dropped, so streams stay whole and budgets exact
            (``docs/failures.md``). Each restart warns with a
            :class:`~rlcollect.errors.WorkerRestartWarning`. Default 0: the first
            failure is raised. Needs plain envs (not vector envs) and a transport that
            can restart workers (both built-in ones can).

    Attributes:
        num_envs: envs in all (sub-envs of vector envs counted one by one).
        frames_per_batch: as given.
        total_frames: as given (-1: endless).
        worker_splits: request groups per worker, resolved (None became its default).
        transition_chunk_size: transitions per worker message, resolved (``"auto"``
            became a number).
        policy_device: the ``torch.device`` the policy is served on.
        observation_space: the envs' (single) observation space.
        action_space: the envs' (single) action space.
        transport: the :class:`~rlcollect.transports.Transport` in use, kept after
            shutdown for its diagnostics.

    Raises:
        TypeError: at construction, for an argument of the wrong kind: ``env_fns`` not a
            sequence of callables, a factory that cannot be pickled for a worker process,
            a policy that is not a module, cannot be copied or pickled where it must be,
            integer actions returned as floats, an unsupported space.
        ValueError: at construction, for values that cannot work together: a size out of
            range or not dividing another, an unknown transport or backend, CUDA options
            without CUDA, an env factory or a policy that raises on its probe, policy
            outputs of the wrong shape or under a reserved key.
        WorkerError: while iterating (also from :meth:`shutdown` and the ``with``
            block's exit), when an env raises or a worker dies; it names the env and
            worker, and carries the remote traceback as ``__cause__``.
        InferenceError: while iterating, when the policy fails or returns something
            other than it did when the collector was built.
        CollectorError: iterating a collector that is shut down, paused or collecting
            in the background.

    Examples:
        Eight transitions from each of two CartPole envs in worker processes, a policy
        that samples its actions, new weights after every batch:

        >>> import functools
        >>> import gymnasium as gym
        >>> import torch
        >>> from rlcollect import AsyncBatchedCollector
        >>> class Policy(torch.nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.logits = torch.nn.Linear(4, 2)
        ...     def forward(self, observation):  # [B, 4] float32 -> sampled actions [B]
        ...         logits = self.logits(observation)
        ...         return torch.distributions.Categorical(logits=logits).sample()
        >>> policy = Policy()
        >>> make_env = functools.partial(gym.make, "CartPole-v1")
        >>> with AsyncBatchedCollector(
        ...     [make_env] * 2,
        ...     policy,
        ...     frames_per_batch=16,
        ...     total_frames=48,
        ...     transport="process_slots",
        ...     policy_device="cpu",
        ... ) as collector:
        ...     for batch in collector:
        ...         version = collector.update_policy_weights_(policy)
        ...         print(batch.batch_size, "weights version", version)
        torch.Size([16]) weights version 1
        torch.Size([16]) weights version 2
        torch.Size([16]) weights version 3
        >>> sorted(batch.keys())
        ['action', 'env_index', 'episode', 'next', 'observation', 'policy_version', 'step']
        >>> sorted(batch["next"].keys())
        ['done', 'observation', 'reward', 'terminated', 'truncated']
        >>> batch["observation"].dtype, batch["action"].dtype, batch["next", "done"].dtype
        (torch.float32, torch.int64, torch.bool)

        An env that raises reaches the loop as a :class:`~rlcollect.errors.WorkerError`
        naming it (``transport="thread"``: worker threads, quick to start):

        >>> from rlcollect import WorkerError
        >>> def broken_env():
        ...     def fail(reward):
        ...         raise RuntimeError("sensor failure")
        ...     return gym.wrappers.TransformReward(make_env(), fail)
        >>> try:
        ...     with AsyncBatchedCollector(
        ...         [make_env, broken_env], policy, frames_per_batch=16, transport="thread"
        ...     ) as collector:
        ...         for batch in collector:
        ...             pass
        ... except WorkerError as error:
        ...     print(error.env_index, "|", error)
        1 | env 1 (worker 1) raised RuntimeError: sensor failure (during step)
    """

    def __init__(
        self,
        env_fns: Sequence[Callable[[], Any]],
        policy: torch.nn.Module | None = None,
        *,
        policy_factory: Callable[[], torch.nn.Module] | None = None,
        frames_per_batch: int,
        total_frames: int = -1,
        transport: Literal["thread", "process_slots"] | Transport = "process_slots",
        envs_per_worker: int = 1,
        worker_splits: int | None = None,
        transition_chunk_size: int | str = "auto",
        max_batch_size: int | None = None,
        min_batch_size: int = 1,
        batch_timeout: float = 1e-3,
        policy_device: str | torch.device | None = None,
        compile: bool | Mapping[str, Any] = False,
        cuda_graph: bool = False,
        inference_backend: Literal["thread", "process"] = "thread",
        replay_buffer: SupportsExtend | None = None,
        train_ratio: float | None = None,
        learning_starts: int = 0,
        seed: int | None = 0,
        max_worker_restarts: int = 0,
    ) -> None:
        self._closed = True  # until everything is up: shutdown() must work at any point
        self._transport: Transport | None = None
        self._server: InferenceBackend | None = None
        self._finalizer: weakref.finalize[Any, Any] | None = None
        self._shutdown_lock = threading.Lock()
        self._stopping = threading.Event()
        self._background: threading.Thread | None = None
        self._background_error: BaseException | None = None
        self._finished = threading.Event()  # background collection has ended
        self._pause_requested = threading.Event()
        self._quiet = threading.Event()  # the background thread holds at a quiet point

        env_fns = _check_env_fns(env_fns)
        _check_int("frames_per_batch", frames_per_batch, minimum=1)
        if total_frames != -1:
            _check_int("total_frames", total_frames, minimum=1, extra="or -1 (endless)")
        _check_int("envs_per_worker", envs_per_worker, minimum=1)
        if len(env_fns) % envs_per_worker:
            raise ValueError(
                f"{len(env_fns)} envs cannot be split into workers of envs_per_worker="
                f"{envs_per_worker}; use a divisor of the number of envs"
            )
        if worker_splits is not None:
            _check_int("worker_splits", worker_splits, minimum=1, extra="or None")
            if envs_per_worker % worker_splits:
                raise ValueError(
                    f"worker_splits={worker_splits} does not divide envs_per_worker="
                    f"{envs_per_worker}: a worker's envs split into equal groups"
                )
        if seed is not None:
            _check_int("seed", seed, minimum=0, extra="or None")
        if replay_buffer is not None and not callable(getattr(replay_buffer, "extend", None)):
            raise TypeError(
                f"replay_buffer must have an extend(tensordict) method; got "
                f"{type(replay_buffer).__name__}"
            )
        throttle = _throttle_of(train_ratio, learning_starts, replay_buffer)
        transport_obj = _make_transport(transport)
        if isinstance(transport_obj, ProcessSlotTransport):
            _check_picklable(env_fns)
        device = _device(policy_device)
        compile_options = _compile_options(compile)
        if not isinstance(cuda_graph, bool):
            raise ValueError(f"cuda_graph must be True or False, got {cuda_graph!r}")
        if device.type != "cuda" and (compile_options is not None or cuda_graph):
            raise ValueError(
                f"compile and cuda_graph need a CUDA policy_device; the policy runs on {device}"
            )

        policy_source = _policy_source(policy, policy_factory, inference_backend, transport_obj)
        _check_int("max_worker_restarts", max_worker_restarts, minimum=0)
        if max_worker_restarts and not transport_obj.supports_restart:
            raise ValueError(
                f"max_worker_restarts={max_worker_restarts}, but the transport "
                f"{type(transport_obj).__name__} cannot restart workers (supports_restart "
                "is False)"
            )

        source = _probe_source(env_fns[0])
        if max_worker_restarts and source.vector:
            raise ValueError(
                "max_worker_restarts needs plain envs: env_fns build vector envs, whose "
                "chunks do not hold every sub-env's last transition to end its episode at"
            )
        slots = RESTART_SLOTS if max_worker_restarts else _SLOTS
        observation_space, action_space = source.observation_space, source.action_space
        groups = _groups(worker_splits, envs_per_worker, source)
        num_envs = len(env_fns) * source.envs
        worker_envs = envs_per_worker * source.envs
        chunk_steps = _chunk_steps(
            transition_chunk_size, frames_per_batch, num_envs, envs_per_worker, source
        )
        batching = BatchingConfig(
            max_batch_size=num_envs if max_batch_size is None else max_batch_size,
            min_batch_size=min_batch_size,
            batch_timeout=batch_timeout,
        )
        paths, obs_fields = _observation_fields(observation_space)
        if policy is not None:
            served = _served_policy(policy, device, own=False)
        else:
            served = _served_policy(_build_policy(policy_source), device, own=True)
        runner = PolicyRunner(served, device=device, observation_paths=paths)
        action_field, extra_fields = output_fields(
            _probe_policy(runner, observation_space, paths), action_space
        )
        fields = transition_fields(obs_fields, action_field, extra_fields)
        staging = None
        if source.vector:
            staged = (*(f.key for f in obs_fields), action_field.key)
            staged += (*(f.key for f in extra_fields), ("policy_version",))
            staging = Staging(keys=staged, columns=source.batch_size)
        num_workers = len(env_fns) // envs_per_worker
        layout = RingLayout(
            fields=fields,
            num_workers=num_workers,
            envs_per_worker=worker_envs,
            chunk_steps=chunk_steps,
            slots=slots,
            groups=groups,
            staging=staging,
        )
        observations = dict(zip(paths, obs_fields, strict=True))
        outputs = {f.key: f for f in (action_field, *extra_fields)}
        capacity = max(batching.max_batch_size, layout.request_columns)
        step = None
        if inference_backend == "thread":
            step = build_action_step(
                runner,
                observations,
                outputs,
                capacity=capacity,
                compile_options=compile_options,
                cuda_graph=cuda_graph,
            )
        else:
            process_config = InferenceConfig(
                device=str(device),
                observation_paths=paths,
                observations=tuple(observations.items()),
                outputs=tuple(outputs.items()),
                layout=layout,
                batching=batching,
                capacity=capacity,
                compile_options=compile_options,
                cuda_graph=cuda_graph,
                weights=WeightsLayout.of(served.state_dict()),
            )
            del served, runner  # the inference process builds its own
        specs = [
            WorkerSpec(
                env_fns=tuple(env_fns[w * envs_per_worker : (w + 1) * envs_per_worker]),
                env_offset=w * worker_envs,
                seed=seed,
                chunk_steps=chunk_steps,
                slots=slots,
                source=source,
                observation_paths=paths,
                discrete_actions=isinstance(action_space, spaces.Discrete),
                groups=groups,
            )
            for w in range(num_workers)
        ]
        programs = [functools.partial(run_worker, spec=spec) for spec in specs]

        self.num_envs = num_envs
        self.frames_per_batch = frames_per_batch
        self.total_frames = total_frames
        self.worker_splits = groups
        self.transition_chunk_size = chunk_steps * worker_envs
        self.policy_device = device
        self.observation_space = observation_space
        self.action_space = action_space
        #: The transport in use (kept after shutdown, for its diagnostics).
        self.transport: Transport = transport_obj
        self._replay_buffer = replay_buffer
        self._throttle_to = throttle  # (train_ratio, the buffer that counts the samples)
        self._learning_starts = learning_starts
        self._sampled_at_start = 0 if throttle is None else throttle[1].sampled
        self._throttle_seconds = 0.0
        self._layout = layout
        self._frames = 0
        self._batches = 0
        self._wait_seconds = 0.0
        self._started = time.perf_counter()
        self._cpu_started = time.process_time()

        self._transport = transport_obj
        self._closed = False
        try:
            self._end: ServerEnd = transport_obj.start(layout, programs)
            if step is not None:
                self._server = InferenceServer(
                    runner,
                    step,
                    self._end,
                    layout=layout,
                    batching=batching,
                    output_keys=frozenset(outputs),
                )
            else:
                assert isinstance(transport_obj, ProcessSlotTransport)
                self._server = ProcessInference(
                    transport_obj.request_channel(),
                    process_config,
                    policy_source,
                    policy_is_factory=policy is None,
                )
            self._server.start()
        except BaseException:
            self.shutdown()
            raise
        # Shuts everything down if the collector is garbage-collected (or still open at
        # interpreter exit); it holds no reference to the collector itself.
        self._finalizer = weakref.finalize(self, _shutdown_parts, transport_obj, self._server)
        self._builder = BatchBuilder(
            layout, self._end.buffers, frames_per_batch=frames_per_batch, total_frames=total_frames
        )
        self._restarts: WorkerRestarts | None = None
        if max_worker_restarts:
            self._restarts = WorkerRestarts(
                max_worker_restarts,
                transport_obj,
                layout,
                self._end.buffers,
                specs,
                num_envs=num_envs,
            )

    # ------------------------------------------------------------------ iteration

    def __iter__(self) -> AsyncBatchedCollector:
        return self

    def __next__(self) -> TensorDict:
        self._raise_background_error()
        if self._background is not None:
            raise CollectorError(
                "the collector is collecting in the background (start() was called): "
                "sample from its replay buffer instead of iterating"
            )
        if self._pause_requested.is_set():
            raise CollectorError("the collector is paused: iterate after the pause() block")
        try:
            batch = self._produce()
        except BaseException:
            self.shutdown()
            raise
        if batch is None:
            self.shutdown()
            raise StopIteration
        return batch

    def _produce(self) -> TensorDict | None:
        """The next batch, already written to the replay buffer; None once the budget is met."""
        if self._closed:
            if self.total_frames != -1 and self._frames >= self.total_frames:
                return None
            raise CollectorError("the collector is shut down")
        if self._builder.exhausted and not self._builder.ready:
            return None
        t0 = time.perf_counter()
        while not self._builder.ready:
            self._quiet_point()
            try:
                chunks = self._end.wait_chunks(_POLL)
            except ChannelClosed:
                self._raise_server_error()
                raise CollectorError("the transport closed while collecting") from None
            except WorkerError as error:
                if self._restarts is None:
                    raise
                try:
                    self._restarts.restart(error, self._builder)
                except ChannelClosed:  # shut down or aborted meanwhile
                    self._raise_server_error()
                    raise error from error.__cause__
                continue
            for worker, slot in chunks:
                if self._restarts is not None:
                    held = self._restarts.hold(worker, slot)
                    if held is None:
                        continue
                    slot = held
                self._builder.add_chunk(worker, slot)
                self._end.release(worker, slot)
            self._raise_server_error()
        self._wait_seconds += time.perf_counter() - t0
        batch = self._builder.pop()
        self._throttle()
        self._quiet_point()
        if self._replay_buffer is not None:
            self._replay_buffer.extend(batch)
        self._frames += batch.batch_size[0]
        self._batches += 1
        # Even after the last batch the collector stays up until the next call finds the
        # budget met: the caller may still push weights for that batch.
        return batch

    def _raise_server_error(self) -> None:
        if self._server is not None and self._server.error is not None:
            raise self._server.error

    # ------------------------------------------------------------------ background

    def start(self) -> None:
        """Collect in a background thread into the replay buffer, until ``total_frames``
        are written or :meth:`shutdown`.

        Once ``total_frames`` are written the collector stays up (weights may still be
        pushed) until :meth:`shutdown`, which the ``with`` block calls.

        An error there is raised in the caller at its next call into the collector
        (:meth:`update_policy_weights_`, :meth:`stats`, :meth:`pause`, :meth:`join`,
        :meth:`shutdown`, iteration).

        Raises:
            CollectorError: without a ``replay_buffer``, when already started, or when
                shut down; the background error if an earlier collection failed.

        Examples:
            >>> import functools
            >>> import gymnasium as gym
            >>> import torch
            >>> from rlcollect import AsyncBatchedCollector
            >>> make_env = functools.partial(gym.make, "Pendulum-v1")  # Box(3) -> Box(1)
            >>> policy = torch.nn.Linear(3, 1)
            >>> from rlcollect import ReplayBuffer
            >>> buffer = ReplayBuffer(1_000, seed=0)
            >>> with AsyncBatchedCollector(
            ...     [make_env] * 2,
            ...     policy,
            ...     frames_per_batch=32,
            ...     total_frames=128,
            ...     transport="thread",
            ...     policy_device="cpu",
            ...     replay_buffer=buffer,
            ... ) as collector:
            ...     collector.start()
            ...     collector.join(timeout=30.0)  # a learner would sample meanwhile
            True
            >>> len(buffer), buffer.sample(8)["action"].shape
            (128, torch.Size([8, 1]))
        """
        self._raise_background_error()
        if self._closed:
            raise CollectorError("the collector is shut down")
        if self._replay_buffer is None:
            raise CollectorError(
                "start() collects into the replay buffer, and this collector has none: "
                "pass replay_buffer= or iterate over the collector instead"
            )
        if self._background is not None:
            raise CollectorError("the collector is already collecting in the background")
        self._background = threading.Thread(
            target=self._collect_in_background, name="rlcollect-collector", daemon=True
        )
        self._background.start()

    def join(self, timeout: float | None = None) -> bool:
        """Wait for background collection to end (``total_frames`` reached).

        Args:
            timeout: seconds to wait at most; None waits for as long as it takes.

        Returns:
            True once it has ended, False if ``timeout`` seconds passed first.

        Raises:
            CollectorError: when :meth:`start` was not called; the background error (a
                :class:`~rlcollect.errors.WorkerError` or
                :class:`~rlcollect.errors.InferenceError`) if collection failed.

        Examples:
            See :meth:`start`. With ``total_frames=-1`` background collection never ends
            by itself, and ``join`` returns False once its timeout has passed:

            >>> import functools
            >>> import gymnasium as gym
            >>> import torch
            >>> from rlcollect import AsyncBatchedCollector, ReplayBuffer
            >>> with AsyncBatchedCollector(
            ...     [functools.partial(gym.make, "Pendulum-v1")] * 2,
            ...     torch.nn.Linear(3, 1),
            ...     frames_per_batch=32,
            ...     transport="thread",
            ...     policy_device="cpu",
            ...     replay_buffer=ReplayBuffer(1_000),
            ... ) as collector:
            ...     collector.start()
            ...     collector.join(timeout=0.1)
            False
        """
        if self._background is None:
            raise CollectorError("join() waits for background collection; call start() first")
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._finished.wait(
            _POLL if deadline is None else min(_POLL, max(0.0, deadline - time.monotonic()))
        ):
            if deadline is not None and time.monotonic() >= deadline:
                return False
        self._raise_background_error()
        return True

    def _collect_in_background(self) -> None:
        # When the budget is met the parts stay up, as after the last batch of an
        # iteration: the learner may still push weights until it calls shutdown().
        try:
            while not self._stopping.is_set() and self._produce() is not None:
                pass
        except _Stopping:
            pass
        except BaseException as exc:
            if not self._stopping.is_set():
                self._background_error = exc
            self._release_parts()
        finally:
            self._finished.set()

    def _raise_background_error(self) -> None:
        error, self._background_error = self._background_error, None
        if error is not None:
            raise error

    @contextlib.contextmanager
    def pause(self, timeout: float = 10.0) -> Iterator[None]:
        """Hold collection at a quiet point for the ``with`` block.

        Inside the block no batch is written to the replay buffer and no inference batch
        runs: a consistent moment to checkpoint the replay buffer and the policy, or to
        evaluate on the GPU. Envs finish the step they are in and then wait for actions.

        Args:
            timeout: seconds to reach the quiet point.

        Raises:
            CollectorError: when shut down or already paused, or when the quiet point is
                not reached within ``timeout`` (the background error, if that is why).

        Examples:
            A consistent checkpoint of the replay buffer between two batches (with
            :meth:`start` the same block pauses background collection):

            >>> import functools
            >>> import gymnasium as gym
            >>> import torch
            >>> from rlcollect import AsyncBatchedCollector
            >>> make_env = functools.partial(gym.make, "Pendulum-v1")  # Box(3) -> Box(1)
            >>> policy = torch.nn.Linear(3, 1)
            >>> from rlcollect import ReplayBuffer
            >>> buffer = ReplayBuffer(1_000)
            >>> with AsyncBatchedCollector(
            ...     [make_env] * 2,
            ...     policy,
            ...     frames_per_batch=32,
            ...     transport="thread",
            ...     policy_device="cpu",
            ...     replay_buffer=buffer,
            ... ) as collector:
            ...     first = next(collector)
            ...     with collector.pause():
            ...         checkpoint = buffer.state_dict()  # or torch.save(it, path)
            ...     second = next(collector)
            >>> checkpoint["size"], len(buffer)
            (32, 64)
        """
        self._raise_background_error()
        if self._closed or self._server is None:
            raise CollectorError("the collector is shut down")
        if self._pause_requested.is_set():
            raise CollectorError("the collector is already paused")
        self._pause_requested.set()
        try:
            deadline = time.monotonic() + timeout
            background = self._background
            if background is not None:
                while not self._quiet.wait(_POLL):
                    if self._finished.is_set():
                        self._raise_background_error()
                        break  # collection ended: quiet for good
                    if time.monotonic() >= deadline:
                        raise CollectorError(
                            f"background collection did not pause within {timeout} s"
                        )
            self._server.pause(max(0.0, deadline - time.monotonic()))
            try:
                yield
            finally:
                self._server.resume()
        finally:
            self._pause_requested.clear()

    def _quiet_point(self) -> None:
        """In the background thread: hold here while a pause is requested."""
        if self._stopping.is_set():
            raise _Stopping
        if not self._pause_requested.is_set():
            return
        if threading.current_thread() is not self._background:
            return
        self._quiet.set()
        try:
            while self._pause_requested.is_set():
                if self._stopping.wait(_POLL):
                    raise _Stopping
        finally:
            self._quiet.clear()

    def _throttle(self) -> None:
        """Hold the next batch until the learner has sampled ``train_ratio`` rows per row
        collected (past ``learning_starts``)."""
        if self._throttle_to is None:
            return
        ratio, buffer = self._throttle_to
        ahead = self._frames - self._learning_starts
        if ahead <= 0:
            return
        target = self._sampled_at_start + math.ceil(ratio * ahead)
        t0 = time.perf_counter()
        while not buffer.wait_sampled(target, _POLL):
            self._quiet_point()
            self._raise_server_error()
        self._throttle_seconds += time.perf_counter() - t0

    # ------------------------------------------------------------------ control

    @property
    def policy_version(self) -> int:
        """Weights version in use: 0 at start, +1 per :meth:`update_policy_weights_`.

        Examples:
            >>> import functools
            >>> import gymnasium as gym
            >>> import torch
            >>> from rlcollect import AsyncBatchedCollector
            >>> make_env = functools.partial(gym.make, "Pendulum-v1")  # Box(3) -> Box(1)
            >>> policy = torch.nn.Linear(3, 1)
            >>> with AsyncBatchedCollector(
            ...     [make_env] * 2, policy, frames_per_batch=32, transport="thread"
            ... ) as collector:
            ...     before = collector.policy_version
            ...     after = collector.update_policy_weights_(policy)
            >>> before, after
            (0, 1)
        """
        return 0 if self._server is None else self._server.policy_version

    def update_policy_weights_(self, weights: torch.nn.Module | Mapping[str, torch.Tensor]) -> int:
        """Copy new weights into the served policy, between inference batches.

        Args:
            weights: a module with the policy's structure, or its ``state_dict()``.

        Returns:
            The new :attr:`policy_version`; every transition whose action these weights
            choose carries it.

        Raises:
            CollectorError: when shut down; the background error if collection failed.
            KeyError: when the weights' names are not the policy's (missing or extra).
            ValueError: when a weight's shape is not the policy's.
            InferenceError: with ``inference_backend="process"``, when the inference
                process has failed or has not applied the weights of two versions ago
                within its deadline.

        Examples:
            Every row carries the version of the weights that chose its action:

            >>> import functools
            >>> import gymnasium as gym
            >>> import torch
            >>> from rlcollect import AsyncBatchedCollector
            >>> make_env = functools.partial(gym.make, "Pendulum-v1")  # Box(3) -> Box(1)
            >>> policy = torch.nn.Linear(3, 1)
            >>> with AsyncBatchedCollector(
            ...     [make_env] * 2,
            ...     policy,
            ...     frames_per_batch=32,
            ...     total_frames=64,
            ...     transport="thread",
            ...     policy_device="cpu",
            ... ) as collector:
            ...     for batch in collector:
            ...         with torch.no_grad():
            ...             _ = policy.weight.mul_(0.5)  # stands for a learning step
            ...         version = collector.update_policy_weights_(policy.state_dict())
            >>> version, batch["policy_version"].max().item() <= version
            (2, True)
            >>> collector.update_policy_weights_(torch.nn.Linear(3, 2))
            Traceback (most recent call last):
            ...
            rlcollect.errors.CollectorError: the collector is shut down
        """
        self._raise_background_error()
        if self._closed or self._server is None:
            raise CollectorError("the collector is shut down")
        state = weights.state_dict() if isinstance(weights, torch.nn.Module) else weights
        return self._server.update_weights(state)

    def stats(self) -> dict[str, Any]:
        """Frames, batches, throughput, driver CPU time per frame and server statistics.

        Returns:
            A dict of ``frames`` and ``batches`` delivered, ``seconds`` since construction,
            ``frames_per_second``, ``driver_cpu_ms_per_frame`` (this process's CPU time,
            every thread of it, per frame), ``consumer_wait_seconds`` (time the caller
            waited for batches), ``policy_version``, and ``server``: the inference
            server's batch count, mean batch size, batch-size histogram, seconds per
            phase and request latency percentiles. With a ``train_ratio``, also
            ``train_ratio`` (rows sampled per row collected so far) and
            ``throttle_wait_seconds`` (seconds collection waited for the learner).
            ``worker_restarts`` counts the workers restarted so far
            (``max_worker_restarts``).

        Raises:
            CollectorError: the background error, if background collection failed.

        Examples:
            >>> import functools
            >>> import gymnasium as gym
            >>> import torch
            >>> from rlcollect import AsyncBatchedCollector
            >>> make_env = functools.partial(gym.make, "Pendulum-v1")  # Box(3) -> Box(1)
            >>> policy = torch.nn.Linear(3, 1)
            >>> with AsyncBatchedCollector(
            ...     [make_env] * 2,
            ...     policy,
            ...     frames_per_batch=32,
            ...     total_frames=96,
            ...     transport="thread",
            ...     policy_device="cpu",
            ... ) as collector:
            ...     frames = sum(batch.numel() for batch in collector)
            ...     stats = collector.stats()
            >>> frames, stats["frames"], stats["batches"]
            (96, 96, 3)
            >>> stats["server"]["mean_batch_size"] <= 2  # envs per inference call
            True
        """
        self._raise_background_error()
        elapsed = time.perf_counter() - self._started
        cpu = time.process_time() - self._cpu_started
        out: dict[str, Any] = {
            "frames": self._frames,
            "worker_restarts": 0 if self._restarts is None else self._restarts.count,
            "batches": self._batches,
            "seconds": elapsed,
            "frames_per_second": self._frames / elapsed if elapsed > 0 else 0.0,
            "driver_cpu_ms_per_frame": 1e3 * cpu / self._frames if self._frames else 0.0,
            "consumer_wait_seconds": self._wait_seconds,
            "policy_version": self.policy_version,
        }
        if self._throttle_to is not None:
            sampled = self._throttle_to[1].sampled - self._sampled_at_start
            out["train_ratio"] = sampled / max(1, self._frames - self._learning_starts)
            out["throttle_wait_seconds"] = self._throttle_seconds
        if self._server is not None:
            out["server"] = self._server.stats()
        return out

    def shutdown(self) -> None:
        """Stop background collection, the server and the workers; free shared memory.

        Idempotent. The ``with`` block calls it; iteration calls it once
        ``total_frames`` are delivered, and so does garbage collection.

        Raises:
            CollectorError: the background error (a WorkerError or InferenceError), if
                collection failed and it was not raised yet.

        Examples:
            Worker processes and the shared-memory segment are gone once it returns:

            >>> import functools
            >>> import gymnasium as gym
            >>> import torch
            >>> from rlcollect import AsyncBatchedCollector
            >>> make_env = functools.partial(gym.make, "Pendulum-v1")  # Box(3) -> Box(1)
            >>> policy = torch.nn.Linear(3, 1)
            >>> collector = AsyncBatchedCollector(
            ...     [make_env] * 2, policy, frames_per_batch=32, transport="process_slots"
            ... )
            >>> batch = next(collector)
            >>> collector.shutdown()
            >>> collector.shutdown()  # idempotent
            >>> import os
            >>> transport = collector.transport
            >>> [code is not None for code in transport.exit_codes]  # every worker exited
            [True, True]
            >>> os.path.exists(f"/dev/shm/{transport.shm_name}")
            False
        """
        self._stopping.set()
        background = self._background
        if background is not None and background is not threading.current_thread():
            background.join(_JOIN_TIMEOUT)
        self._release_parts()
        self._raise_background_error()

    def _release_parts(self) -> None:
        with self._shutdown_lock:
            if self._closed and self._transport is None:
                return
            self._closed = True
            server, transport = self._server, self._transport
            self._transport = None
        _shutdown_parts(transport, server)
        if self._finalizer is not None:
            self._finalizer.detach()

    def __enter__(self) -> AsyncBatchedCollector:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: object
    ) -> None:
        try:
            self.shutdown()
        except BaseException as error:
            if exc is None:
                raise
            exc.add_note(f"rlcollect: background collection had failed too: {error!r}")


class _Stopping(CollectorError):
    """Raised inside the collector's own threads when it is shut down under them."""

    def __init__(self) -> None:
        super().__init__("the collector was shut down")


def _shutdown_parts(transport: Transport | None, server: InferenceBackend | None) -> None:
    if server is not None:
        server.stop()
    if transport is not None:
        transport.close()


# ---------------------------------------------------------------------- argument checks


def _check_int(name: str, value: Any, *, minimum: int, extra: str = "") -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(
            f"{name} must be an int >= {minimum}{' ' + extra if extra else ''}, got {value!r}"
        )


def _check_env_fns(env_fns: Any) -> list[Callable[[], Any]]:
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


def _policy_source(policy: Any, factory: Any, backend: Any, transport: Transport) -> Any:
    """Check the policy arguments against the backend; returns what builds the policy."""
    if (policy is None) == (factory is None):
        raise TypeError("give exactly one of policy and policy_factory")
    if factory is not None and not callable(factory):
        raise TypeError(
            f"policy_factory must be a zero-argument callable, got {type(factory).__name__}"
        )
    if backend not in _BACKENDS:
        raise ValueError(f"inference_backend must be one of {list(_BACKENDS)}, got {backend!r}")
    source: Any = policy if policy is not None else factory
    if backend == "process":
        if not isinstance(transport, ProcessSlotTransport):
            raise ValueError(
                "inference_backend='process' needs transport='process_slots': the inference "
                "process serves the workers through their shared-memory ring"
            )
        what = "policy" if policy is not None else "policy_factory"
        try:
            cloudpickle.dumps(source)
        except Exception as exc:
            raise TypeError(
                f"{what} cannot be pickled for the inference process ({type(exc).__name__}: "
                f"{exc}); make it picklable or use inference_backend='thread'"
            ) from exc
    return source


def _build_policy(factory: Any) -> Any:
    try:
        return factory()
    except Exception as exc:
        raise ValueError(f"policy_factory raised: {type(exc).__name__}: {exc}") from exc


def _throttle_of(
    ratio: Any, learning_starts: Any, replay_buffer: Any
) -> tuple[float, ReplayBuffer] | None:
    """The checked ``(train_ratio, buffer)`` collection waits on, or None (unthrottled)."""
    if ratio is None:
        if learning_starts != 0:
            raise ValueError("learning_starts only applies with a train_ratio; pass train_ratio=")
        return None
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not ratio > 0:
        raise ValueError(
            f"train_ratio must be a number > 0 (rows sampled per row collected), got {ratio!r}"
        )
    if not math.isfinite(ratio):
        raise ValueError(f"train_ratio must be finite, got {ratio!r}")
    _check_int("learning_starts", learning_starts, minimum=0)
    if not isinstance(replay_buffer, ReplayBuffer):
        raise TypeError(
            "train_ratio needs replay_buffer= to be an rlcollect.ReplayBuffer, which counts "
            f"the rows the learner samples; got {type(replay_buffer).__name__}"
        )
    return float(ratio), replay_buffer


def _chunk_steps(
    chunk: int | str, fpb: int, num_envs: int, envs_per_worker: int, source: Source
) -> int:
    if chunk == "auto":
        return max(1, min(_AUTO_CHUNK_CAP, fpb // num_envs))
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f'transition_chunk_size must be "auto" or an int >= 1, got {chunk!r}')
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


def _groups(worker_splits: int | None, envs_per_worker: int, source: Source) -> int:
    """Request groups per worker: ``worker_splits``, or its default."""
    if source.vector:
        if worker_splits not in (None, envs_per_worker):
            raise ValueError(
                f"worker_splits={worker_splits}, but with vector envs each of a worker's "
                f"envs_per_worker={envs_per_worker} vector envs is a group of its own: "
                "leave worker_splits at None or set it to envs_per_worker"
            )
        return envs_per_worker
    # Default 1: on the 2-core development machine, with the policy on the CPU, splitting
    # never paid (benchmarks/worker_splits.py, docs/benchmarks.md).
    return 1 if worker_splits is None else worker_splits


def _make_transport(transport: str | Transport) -> Transport:
    if isinstance(transport, Transport):
        return transport
    if isinstance(transport, str) and transport in _TRANSPORTS:
        return _TRANSPORTS[transport]()
    raise ValueError(
        f"transport must be one of {sorted(_TRANSPORTS)} or a Transport instance, got {transport!r}"
    )


def _check_picklable(env_fns: list[Callable[[], Any]]) -> None:
    for i, fn in enumerate(env_fns):
        try:
            cloudpickle.dumps(fn)
        except Exception as exc:
            raise TypeError(
                f"env_fns[{i}] cannot be pickled for a worker process ({type(exc).__name__}: "
                f"{exc}); make the factory picklable or use transport='thread'"
            ) from exc


def _device(policy_device: str | torch.device | None) -> torch.device:
    if policy_device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(policy_device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"policy_device {policy_device!r} is not a torch device") from exc
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"policy_device={policy_device!r}, but CUDA is not available here")
    return device


def _compile_options(compile: Any) -> dict[str, Any] | None:
    if compile is False:
        return None
    if compile is True:
        return {}
    if isinstance(compile, Mapping):
        return dict(compile)
    raise ValueError(
        f"compile must be True, False or a dict of torch.compile options, got {compile!r}"
    )


def _probe_source(env_fn: Callable[[], Any]) -> Source:
    """Build env 0 once in the driver to learn what every factory must build."""
    try:
        env = env_fn()
    except Exception as exc:
        raise ValueError(f"env_fns[0] raised while building the probe env: {exc}") from exc
    try:
        return describe(env, "env_fns[0]")
    finally:
        close = getattr(env, "close", None)
        if callable(close):
            close()


def _observation_fields(space: Any) -> tuple[tuple[Path, ...], tuple[Field, ...]]:
    leaves: list[tuple[Path, Any]] = []

    def walk(path: Path, sub: Any) -> None:
        if isinstance(sub, spaces.Dict):
            for name, child in sub.spaces.items():
                walk((*path, str(name)), child)
        elif isinstance(
            sub, (spaces.Box, spaces.Discrete, spaces.MultiDiscrete, spaces.MultiBinary)
        ):
            leaves.append((path, sub))
        else:
            where = "observation" + "".join(f"[{n!r}]" for n in path)
            raise TypeError(
                f"{where} space {sub} is not supported; use Box, Discrete, MultiDiscrete, "
                "MultiBinary or a Dict of those"
            )

    walk((), space)
    if not leaves:
        raise TypeError(f"observation_space {space} holds no array leaves")
    paths = tuple(path for path, _ in leaves)
    fields = tuple(
        Field(observation_key(path), tuple(sub.shape), np.dtype(sub.dtype)) for path, sub in leaves
    )
    return paths, fields


def _served_policy(policy: Any, device: torch.device, *, own: bool) -> torch.nn.Module:
    """The policy to serve on ``device``: a deep copy of the caller's, or ``policy``
    itself when the collector built it (``own``)."""
    what = "policy_factory() returned" if own else "policy must be"
    if not isinstance(policy, torch.nn.Module):
        raise TypeError(
            f"{what} a torch.nn.Module or a TensorDictModule, got {type(policy).__name__}"
        )
    if not own:
        try:
            policy = copy.deepcopy(policy)
        except Exception as exc:
            raise TypeError(
                f"the policy cannot be copied for serving ({type(exc).__name__}: {exc}); "
                "pass policy_factory= instead"
            ) from exc
    served: torch.nn.Module = policy.to(device)
    served.requires_grad_(False)
    return served


def _probe_policy(
    runner: PolicyRunner, space: Any, paths: tuple[Path, ...]
) -> dict[tuple[str, ...], torch.Tensor]:
    """Run the policy once on two sampled observations to learn its outputs."""
    space.seed(0)
    samples = [space.sample(), space.sample()]
    batch: dict[Path, np.ndarray] = {}
    for path in paths:
        leaves = []
        for sample in samples:
            value = sample
            for name in path:
                value = value[name]
            leaves.append(np.asarray(value))
        batch[path] = np.stack(leaves)
    try:
        return runner(batch)
    except Exception as exc:
        shapes = ", ".join(
            f"{observation_key(path)}: {tuple(arr.shape)} {arr.dtype}"
            for path, arr in batch.items()
        )
        raise ValueError(
            f"the policy failed on a batch of 2 sampled observations ({shapes}): "
            f"{type(exc).__name__}: {exc}"
        ) from exc
