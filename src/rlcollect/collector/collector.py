"""``AsyncBatchedCollector``: envs in workers, one batching inference server, exact batches.

::

    env_fns ─▶ workers (threads or processes, numpy only) ──ring──▶ inference backend
                   │ full chunks, by index                          (policy on device)
                   ▼
    caller ◀─ TensorDict [frames_per_batch] ◀─ ChunkLoop (the consuming thread) ─▶ replay_buffer

The collector is a façade over its parts, each in a module of its own:

* ``options.py``: every keyword argument, defined once (default, type, check, help);
* ``plan.py``: the arguments checked, env 0 and the policy probed, the backend and the
  delivery chosen, the ring laid out, the workers' specs written: a frozen
  :class:`~rlcollect.collector.plan.Plan` that has started nothing;
* ``start.py``: the parts started from the plan (the backend in two phases around the
  transport's workers) and the chunk loop built (``batches/``);
* ``lifecycle.py``, ``background.py``, ``facade.py``: the stages, the background
  thread, pause, and iteration, shared with ``RayCollector``.

Every argument: ``docs/arguments.md``; how they work together: ``docs/usage.md``.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import torch

from rlcollect._tensordict import TensorDict
from rlcollect.collector.background import Background, Pausable
from rlcollect.collector.batches.ahead import PauseBetweenRounds, RoundAhead
from rlcollect.collector.batches.episodes import Episode
from rlcollect.collector.checks import claim_transport
from rlcollect.collector.choice import Choice
from rlcollect.collector.facade import CollectorFacade
from rlcollect.collector.lifecycle import Stage
from rlcollect.collector.options import Options
from rlcollect.collector.plan import plan_collection
from rlcollect.collector.start import chunk_loop, start_serving
from rlcollect.errors import CollectorError
from rlcollect.inference.base import InferenceBackend
from rlcollect.replay.sink import SupportsExtend
from rlcollect.transports.base import Transport

__all__ = ["AsyncBatchedCollector"]

_log = logging.getLogger("rlcollect")

# Seconds shutdown waits for the policy_lag helper: the transport is closed by then, and
# its round's bounded waits end at the next check. The finalizer waits as long for the
# background thread, whose waits end at the next check of its stop flag.
_JOIN_TIMEOUT = 10.0


class AsyncBatchedCollector(CollectorFacade):
    """Collects transitions from many envs with one batched policy, asynchronously.

    Iterating yields :class:`tensordict.TensorDict` batches of exactly
    ``frames_per_batch`` transitions (the last one holds what remains of
    ``total_frames``) with the keys ``observation``, ``action``, every other policy
    output, ``policy_version``, ``env_index``, ``episode``, ``step`` and
    ``("next", "observation" | "reward" | "terminated" | "truncated" | "done" |
    "episode_return" | "episode_length")``. Rows of one batch come from many envs; sort
    by ``(env_index, episode, step)`` to read one env's stream. With ``on_policy=True``
    a batch is ``[num_envs, T]`` instead (``[T, num_envs]`` with ``time_major=True``):
    row ``e`` is env ``e``'s next ``T`` steps, all computed with the weights current when
    the batch was asked for. :meth:`episodes` lists the episodes that finished. Every
    argument, in detail: ``docs/usage.md``. A count takes an int (numpy's too), a number
    of seconds or a ratio a real number; anything else is a ``ValueError`` naming the
    keyword, raised before any part starts (``docs/failures.md``, *Bad input*).

    Args:
        env_fns: zero-argument callables, each returning a ``gymnasium.Env`` or a
            ``gymnasium.vector.VectorEnv`` (whose ``n`` sub-envs become ``n``
            consecutive envs).
        policy: a ``torch.nn.Module`` (observations in, the action tensor or a mapping
            holding ``action`` out) or a ``TensorDictModule`` writing ``action``; a
            deep copy is served on ``policy_device``. With ``initial_state()`` it is
            recurrent: ``forward(observation, state) -> (outputs, new_state)``, each
            env's state kept by the server (``docs/usage.md``, *Recurrent policies*).
        policy_factory: instead of ``policy``, a callable that builds it: with no
            argument, or, when its signature asks for two, from ``(observation_space,
            action_space)``, one env's spaces (the collector's ``observation_space`` and
            ``action_space``), so that no env is built only to size the network; a
            class whose ``__init__`` takes the two spaces is one.
        frames_per_batch: transitions per yielded batch.
        total_frames: transitions in all, or -1 to collect until :meth:`shutdown`.
        transport: ``"process_slots"`` (worker processes), ``"thread"`` (worker
            threads of this process), or a :class:`~rlcollect.transports.Transport`
            instance (for this collector only). The four layout arguments (this one,
            ``envs_per_worker``, ``worker_splits``, ``inference_backend``) default to
            ``"auto"``: each one left so is chosen from what the collector measures at
            construction (the cores, the policy's device, env 0's step time, the
            policy's forward time, the features asked for); :meth:`describe` says what
            and why, and every one given wins (``docs/tuning.md``).
        envs_per_worker: env factories per worker, a divisor of ``len(env_fns)``; or
            ``"auto"``.
        worker_splits: request splits per worker (double buffering); divides
            ``envs_per_worker``; None: 1 (with vector envs: ``envs_per_worker``);
            ``"auto"``.
        transition_chunk_size: transitions per worker message, a multiple of the envs
            a worker steps, or ``"auto"`` (a batch's steps of each env, ``frames_per_batch
            // num_envs`` or fewer where ``total_frames`` is smaller, 1 to 64; up to 8 MiB
            a chunk where the workers are threads).
        max_batch_size: most observations per policy call (default: every env).
        min_batch_size: observations the server waits for before a call ...
        batch_timeout: ... but never longer than this many seconds (finite).
        policy_device: where the policy runs; default ``"cuda"`` when available.
        compile: ``True``, or a dict of ``torch.compile`` options (CUDA only).
        cuda_graph: capture the action step as a CUDA graph per padded batch size.
        inference_backend: ``"thread"`` (a server thread of this process),
            ``"process"`` (a server process of its own; needs a transport that supports
            it), ``"worker"`` (no server: each env worker runs the policy for its own
            envs), or ``"auto"``.
        replay_buffer: anything with ``.extend(tensordict)``; every batch goes there,
            once, before it is yielded. Needed by :meth:`start`.
        train_ratio: rows the learner samples per row collected; collection waits for
            the learner (needs an :class:`rlcollect.ReplayBuffer`, or any buffer that
            counts its rows: :class:`rlcollect.replay.CountingBuffer`).
        learning_starts: rows collected before the ``train_ratio`` wait begins.
        seed: env ``i`` is first reset with ``seed + i``, and the policy's random stream
            is seeded with it (``docs/usage.md``, *Reproducibility*); below ``2**64``;
            None: unseeded.
        max_worker_restarts: failed workers restarted in all before an error is raised.
        stall_timeout: seconds an env's construction, ``reset()`` or ``step()`` may run,
            and a worker process may stay stopped, before a :class:`WorkerError` naming
            the env, the worker, the stage and how long (a restart under
            ``max_worker_restarts``); the first batch waits for every env's first
            observation at most half of it after the first came. A policy call bounded
            alike is an :class:`InferenceError` with the server's stack. None (or
            ``float("inf")``): no bound (``docs/failures.md``, *Stalls*).
        store_recurrent_state: with a recurrent policy (one with ``initial_state()``),
            every transition carries ``recurrent_state``, the state its action was
            computed from; False leaves it out (large states). ``is_init`` is always there.
        on_policy: batches of ``batch_size [num_envs, T]``, ``T = frames_per_batch //
            num_envs``; every action of a batch is computed with the weights current
            when it was asked for, and envs wait while the learner learns
            (``docs/usage.md``, *On-policy rollouts*).
        info_keys: names of numeric ``info`` entries to carry as
            ``("next", "info", name)``; dtype and shape come from env 0.
        policy_lag: with ``on_policy=True``, 1 collects the next batch while the learner
            learns on this one: each round starts as soon as the batch before it is
            handed out, so batch ``k+1`` is acted by the weights before the update on
            batch ``k`` (a lag of exactly one update). 0 (default): no lag, envs wait.
        time_major: with ``on_policy=True``, batches of ``[T, num_envs]``, row ``t`` step
            ``t`` of every env (CleanRL's ``[num_steps, num_envs]``), built so rather than
            transposed: contiguous. False (default): ``[num_envs, T]``.
        exploration_type: what a ``TensorDictModule`` policy is called under
            (tensordict's ``set_interaction_type``, TorchRL's ``set_exploration_type``):
            ``"random"`` (default) samples, as TorchRL's collectors act, so a
            ``ProbabilisticActor`` explores; ``"deterministic"``, ``"mode"`` or
            ``"mean"`` for an evaluation collector. A plain ``nn.Module`` draws its own
            noise: only ``"random"`` is accepted with one (``docs/policies.md``).

    Attributes:
        num_envs: envs in all (sub-envs of vector envs counted one by one).
        frames_per_batch: as given.
        total_frames: as given (-1: endless).
        envs_per_worker: env factories per worker, resolved.
        worker_splits: request splits per worker, resolved.
        transition_chunk_size: transitions per worker message, resolved.
        policy_lag: as given (0 or 1).
        policy_device: the ``torch.device`` the policy is served on.
        observation_space: the envs' (single) observation space.
        action_space: the envs' (single) action space.
        transport: the :class:`~rlcollect.transports.Transport` in use.
        server: the inference backend in use (``pid`` with ``inference_backend="process"``).

    Raises:
        TypeError: at construction, an argument of the wrong kind.
        ValueError: at construction, values that cannot work together, or an env
            factory or policy failing its probe.
        WorkerError: while iterating, an env raised or a worker died (env, worker and
            remote traceback named).
        InferenceError: while iterating, the policy failed.
        CollectorError: iterating a collector shut down, paused or collecting in the
            background.

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
        >>> print(*sorted(batch["next"].keys()))
        done episode_length episode_return observation reward terminated truncated
        >>> batch["observation"].dtype, batch["action"].dtype, batch["next", "done"].dtype
        (torch.float32, torch.int64, torch.bool)

        An env that raises, by example: ``docs/usage.md``, *Errors*.
    """

    def __init__(
        self,
        env_fns: Sequence[Callable[[], Any]],
        policy: torch.nn.Module | None = None,
        *,
        policy_factory: Callable[..., torch.nn.Module] | None = None,
        frames_per_batch: int,
        total_frames: int = -1,
        transport: Literal["auto", "thread", "process_slots"] | Transport = "auto",
        envs_per_worker: int | Literal["auto"] = "auto",
        worker_splits: int | Literal["auto"] | None = "auto",
        transition_chunk_size: int | str = "auto",
        max_batch_size: int | None = None,
        min_batch_size: int = 1,
        batch_timeout: float = 1e-3,
        policy_device: str | torch.device | None = None,
        compile: bool | Mapping[str, Any] = False,
        cuda_graph: bool = False,
        inference_backend: Literal["auto", "thread", "process", "worker"] = "auto",
        replay_buffer: SupportsExtend | None = None,
        train_ratio: float | None = None,
        learning_starts: int = 0,
        seed: int | None = 0,
        max_worker_restarts: int = 0,
        stall_timeout: float | None = 60.0,
        store_recurrent_state: bool = True,
        on_policy: bool = False,
        info_keys: Sequence[str] = (),
        policy_lag: int = 0,
        time_major: bool = False,
        exploration_type: str = "random",
    ) -> None:
        super().__init__()
        self._transport: Transport | None = None
        self.server: InferenceBackend | None = None
        self._finalizer: weakref.finalize[Any, Any] | None = None
        self._ahead: RoundAhead | None = None  # policy_lag=1 only
        self._shutdown_lock = threading.Lock()
        # Every keyword above is a field of Options (options.py): one definition of each.
        plan = plan_collection(env_fns, policy, Options.of(locals()))
        self._choice = plan.choice
        _log.info("%s", plan.choice)
        self.num_envs = plan.num_envs
        self.frames_per_batch = plan.options.frames_per_batch  # a Python int, checked
        self.total_frames = plan.options.total_frames
        self.envs_per_worker = plan.envs_per_worker
        self.worker_splits = plan.layout.splits
        self.transition_chunk_size = plan.transition_chunk_size
        self.policy_lag = plan.options.policy_lag
        self.policy_device = plan.device
        self.observation_space = plan.source.observation_space
        self.action_space = plan.source.action_space
        self.transport: Transport = plan.transport
        self._replay_buffer = replay_buffer
        self._started, self._cpu_started = time.perf_counter(), time.process_time()
        self._transport = plan.transport
        self._lifecycle.move(Stage.OPEN)
        claim_transport(plan.transport)
        try:
            end, self.server, program = start_serving(plan)
        except BaseException:
            self.shutdown()
            raise
        # Shuts everything down if the collector is garbage-collected or open at exit: no
        # part holds a reference back to the collector (nor does the background thread:
        # _production), so refcounting alone frees it. The stop flag ends background
        # collection and a policy_lag round running in its helper thread at once.
        self._finalizer = weakref.finalize(
            self, _shutdown_parts, plan.transport, self.server, self._background
        )
        self._chunks = chunk_loop(plan, end, self.server, self._background, program)
        self._throttle = self._chunks.throttle  # the loop waits on it, the learner too
        if plan.options.policy_lag:
            chunks, gate = self._chunks, self._chunks.gate
            assert gate is not None  # policy_lag needs on_policy (checked)
            self._ahead = RoundAhead(chunks.produce, lambda: chunks.exhausted, gate.claim)

    # ------------------------------------------------------------------ for the façade

    @property
    def _frames(self) -> int:
        return self._chunks.frames

    def _next_batch(self) -> TensorDict | None:
        if self._ahead is not None:
            return self._ahead.next()
        return self._chunks.produce()

    def _production(self) -> Callable[[], TensorDict | None]:
        # The chunk loop and the round ahead never refer back to the collector.
        return self._chunks.produce if self._ahead is None else self._ahead.next

    def _pausable(self) -> Pausable | None:
        if self._ahead is not None and self.server is not None:
            return PauseBetweenRounds(self._ahead, self.server)
        return self.server

    def _release(self) -> None:
        with self._shutdown_lock:
            if self._lifecycle.move(Stage.CLOSED) is Stage.CLOSED:
                return
            server, transport = self.server, self._transport
            self._transport = None
        _shutdown_parts(transport, server)
        if self._ahead is not None:
            self._ahead.stop(_JOIN_TIMEOUT)  # its round ends with the transport
        if self._finalizer is not None:
            self._finalizer.detach()

    # ------------------------------------------------------------------ control

    def describe(self) -> Choice:
        """The layout this collector runs with: each of ``transport``,
        ``inference_backend``, ``envs_per_worker`` and ``worker_splits`` as given or as
        chosen, the rule that chose, and the figures it read (the cores, the policy's
        device, env 0's step time and observation size, the policy's forward time at
        batch 1 and at the env count, the features asked for). ``str()`` of it is a
        short report whose last line gives the same layout as explicit arguments;
        ``describe().arguments()`` is that dict. The collector also logs it once, at
        ``INFO``, to the ``"rlcollect"`` logger. The rules: ``docs/tuning.md``.

        Example: ``docs/usage.md``, *The layout*.
        """
        return self._choice

    @property
    def policy_version(self) -> int:
        """Weights version in use: 0 at start, +1 per :meth:`update_policy_weights_`."""
        return 0 if self.server is None else self.server.policy_version

    def update_policy_weights_(self, weights: torch.nn.Module | Mapping[str, torch.Tensor]) -> int:
        """Copy new weights (a module or its ``state_dict()``) into the served policy,
        between inference batches; returns the new :attr:`policy_version`.

        Raises:
            CollectorError: when shut down; the background error if collection failed.
            KeyError: when the weights' names are not the policy's (missing or extra).
            TypeError: when a weight is not a tensor, or of a dtype the policy's cannot
                hold without loss.
            ValueError: when a weight's shape is not the policy's, or it cannot be
                copied as it is (a meta or sparse tensor). Nothing has changed then.
            InferenceError: with ``inference_backend="process"``, when the inference
                process has failed or has not applied the weights of two versions ago
                within its deadline.

        Example: ``docs/usage.md``, *Weights*.
        """
        self._background.raise_error()
        self._lifecycle.refuse("update")
        if self.server is None:
            raise CollectorError("the collector is shut down")
        state = weights.state_dict() if isinstance(weights, torch.nn.Module) else weights
        gate = self._chunks.gate
        if gate is None:
            return self.server.update_weights(state)
        # On-policy: an update from another thread while a round runs waits for its end,
        # so that no batch mixes two versions (collector/batches/rounds.py); with
        # policy_lag=1, for the round collected ahead, whose failure it raises.
        with gate.between_rounds(self._check_alive):
            return self.server.update_weights(state)

    def _check_alive(self) -> None:
        self._background.raise_error()
        error = None if self._ahead is None else self._ahead.take_error()
        if error is not None:
            self.shutdown()  # as next() does after an error
            raise error
        if self._lifecycle.closed:
            raise CollectorError("the collector was shut down while an update waited")

    def episodes(self) -> list[Episode]:
        """The episodes finished since the last call, oldest first: each an
        :class:`~rlcollect.collector.batches.episodes.Episode` (env index, return,
        length, the frames delivered with it, the last step's ``info_keys`` entries).

        Filled from every delivered batch, whether iterated or written to the replay
        buffer in the background, and callable from any thread meanwhile: the learner
        of ``start()`` logs finished episodes with it. Records not drained are kept up
        to 10,000 (the oldest then dropped). After shutdown it returns what is left.

        Example: ``docs/usage.md``, *Finished episodes*.
        """
        return self._chunks.episodes.drain()

    def stats(self) -> dict[str, Any]:
        """Frames, batches, throughput, driver CPU time per frame and server statistics
        (every key is described in ``docs/usage.md``, *Statistics*).

        Raises:
            CollectorError: the background error, if background collection failed.
        """
        self._background.raise_error()
        frames = self._chunks.frames
        out: dict[str, Any] = {
            "frames": frames,
            "worker_restarts": 0 if self._chunks.restarts is None else self._chunks.restarts.count,
            "batches": self._chunks.batches,
            **self._throughput(frames),
            "consumer_wait_seconds": self._chunks.wait_seconds,
            "batch_memory_reuses": self._chunks.batch_memory_reuses,
            "lent_batches": self._chunks.lent_batches,
            "slot_wait_seconds": self._chunks.slot_wait_seconds,
            "policy_version": self.policy_version,
            "episodes": self._chunks.episodes.stats(),
        }
        if self._throttle is not None:
            out.update(self._throttle.stats(frames))
        if self.server is not None:
            out["server"] = self.server.stats()
        return out


def _shutdown_parts(
    transport: Transport | None,
    server: InferenceBackend | None,
    background: Background | None = None,
) -> None:
    if background is not None:  # the finalizer: background collection ends first
        background.stop(_JOIN_TIMEOUT)
    if server is not None:
        server.stop()
    if transport is not None:
        transport.close()
