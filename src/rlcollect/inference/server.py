"""The inference server: one thread that batches worker requests and runs the policy.

Each pass of its loop is a few named, timed phases::

    wait     collect requests (worker, request) until min_batch_size rows are ready
             or batch_timeout has passed since the oldest one arrived
    gather   one ``np.take`` per observation field over the requests' rows into the
             action step's input buffers (page-locked when the policy is on a GPU)
    h2d      host → device copy               ┐
    forward  the policy (eager, compiled or   │ the action step (``step.py``); weights
             a CUDA graph replay)             │ never change during it
    d2h      device → host copy of outputs    ┘ (with a CUDA graph and the gather on the
                                                GPU, one replay holds all three, timed
                                                as forward)
    scatter  actions and extra outputs, stamped with the weights version, written back
             into the requests' rows
    respond  each served request's worker is woken (one message per request)

A request holds ``layout.request_columns`` observations (one split of a worker's columns,
or the sub-envs a vector env returned); which rows of the ring they are is
``rlcollect.transports.layout.request_rows``. A batch is a whole number of requests:
at most ``max_batch_size`` rows, and never less than one request. Requests are served
in the order they arrived, so a worker holding several gets its responses in the order
it asked: that is what lets a worker keep one request per split outstanding.

Once a second the loop also times how long the thread waits to take the interpreter
lock back after letting go of it, and warns once where another thread of the process
keeps it for whole switch intervals (``lock_wait.py``): collection would starve.

The first batch waits for the first request of every worker: workers start at
different speeds (process start, env construction), and serving the early ones alone
would fill the first batches with a few envs' data.

The server's own progress is bounded too (``stall_timeout``): the loop marks each
action step (the policy call) it runs, and whoever reads :attr:`InferenceServer.error`
(the consuming thread, between its bounded waits; the inference process's control
loop) finds a step under way for longer than that, counted from when it first saw it.
That is the server's error, with the server thread's Python stack, and the ring is
aborted, so that every worker stops; a thread cannot be stopped, so the server thread
is left blocked in the policy (a daemon thread; the inference process exits with it).
"""

from __future__ import annotations

import math
import sys
import threading
import time
import traceback
import warnings
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from rlcollect.errors import ChannelClosed, InferenceError
from rlcollect.inference.base import InferenceBackend
from rlcollect.inference.checks import check_weights, scatter_outputs
from rlcollect.inference.lock_wait import LockWatch
from rlcollect.inference.policy import PolicyRunner
from rlcollect.inference.step import ActionStep
from rlcollect.transports.base import RequestEnd, text_of
from rlcollect.transports.layout import Key, RingLayout, request_rows

__all__ = ["BatchingConfig", "InferenceServer"]

_IDLE_WAIT = 0.05  # seconds between checks of the stop flag when no request comes
PHASES = ("wait", "gather", "h2d", "forward", "d2h", "scatter", "respond")
_LATENCIES = 1 << 14  # request latencies kept for the percentiles (a ring)


@dataclass(frozen=True, kw_only=True)
class BatchingConfig:
    """How the server forms batches (rows = envs).

    The collector builds one from its ``max_batch_size``, ``min_batch_size`` and
    ``batch_timeout`` arguments; the tuning guide (``docs/tuning.md``) gives their
    measured effect.

    Args:
        max_batch_size: most env observations per policy call (a batch is a whole
            number of requests, and never less than one).
        min_batch_size: observations the server waits for before a call ...
        batch_timeout: ... but never longer than this many seconds after the oldest
            waiting request arrived.
        first_round_timeout: the first batch waits for every worker's first request
            (all envs start together), but not longer than this many seconds after the
            first one came: an env stuck in its first reset holds no other env back
            beyond it, while workers slow to start (a busy machine) are still waited
            for (the collector passes half its ``stall_timeout``). None: no bound.

    Raises:
        ValueError: a size that is not a positive int, ``min_batch_size >
            max_batch_size``, or a negative timeout.

    Examples:
        >>> from rlcollect.inference import BatchingConfig
        >>> config = BatchingConfig(max_batch_size=16, min_batch_size=8, batch_timeout=2e-3)
        >>> config.min_batch_size, config.batch_timeout, config.first_round_timeout
        (8, 0.002, None)
        >>> BatchingConfig(max_batch_size=4, min_batch_size=8)
        Traceback (most recent call last):
        ...
        ValueError: min_batch_size (8) exceeds max_batch_size (4)
    """

    max_batch_size: int
    min_batch_size: int = 1
    batch_timeout: float = 1e-3
    first_round_timeout: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.max_batch_size, int) or self.max_batch_size < 1:
            raise ValueError(f"max_batch_size must be a positive int, got {self.max_batch_size!r}")
        if not isinstance(self.min_batch_size, int) or self.min_batch_size < 1:
            raise ValueError(f"min_batch_size must be a positive int, got {self.min_batch_size!r}")
        if self.min_batch_size > self.max_batch_size:
            raise ValueError(
                f"min_batch_size ({self.min_batch_size}) exceeds max_batch_size "
                f"({self.max_batch_size})"
            )
        if not isinstance(self.batch_timeout, (int, float)) or not self.batch_timeout >= 0:
            raise ValueError(f"batch_timeout must be a number >= 0, got {self.batch_timeout!r}")
        bound = self.first_round_timeout
        if bound is not None and (not isinstance(bound, (int, float)) or not bound > 0):
            raise ValueError(f"first_round_timeout must be a number > 0 or None, got {bound!r}")


class InferenceServer(InferenceBackend):
    """Serves action requests from a :class:`~rlcollect.transports.RequestEnd` in a thread.

    Args:
        runner: the policy and its calling convention.
        step: the action step built around ``runner`` by
            :func:`~rlcollect.inference.build.build_action_step` (host, or device with
            compile and CUDA graphs), holding at least ``max_batch_size`` rows.
        end: the request side of a started transport (its driver end, or a request end
            handed to another process).
        layout: the ring ``end`` was started with (how requests address it).
        batching: batch size limits and timeout.
        output_keys: the keys the policy returned when the collector was built.
        seed: seeds the policy's own random stream (``step.seed``, ``inference/rng.py``);
            None leaves it unseeded: a policy on the CPU then draws from the process's
            stream, one on a GPU from a stream of the step's own seeded by the OS.
        stall_timeout: seconds one action step (the policy call) may run before
            :attr:`error` says the server stalled; None: no bound.

    The server owns the policy copy inside ``runner``; :meth:`update_weights` changes it
    between batches only and bumps :attr:`policy_version`, which is stamped on every
    transition the batch serves. It is the ``"thread"`` inference backend of the
    collector; :class:`~rlcollect.inference.process.ProcessInference` runs one in a
    process of its own.

    Raises:
        ValueError: ``step`` holds fewer rows than a batch.

    Examples:
        The collector builds and runs it; standing alone, it serves any started
        transport. Here CountingEnv workers on the thread transport, and a policy
        that answers each env with its step number modulo 5:

        >>> import numpy as np
        >>> import torch
        >>> from rlcollect.inference import (
        ...     BatchingConfig,
        ...     InferenceServer,
        ...     PolicyRunner,
        ...     build_action_step,
        ... )
        >>> from rlcollect.testing import counting_layout, counting_programs
        >>> from rlcollect.transports import ThreadQueueTransport
        >>> class StepModFive(torch.nn.Module):  # CountingEnv: [env, episode, step, last]
        ...     def forward(self, observation):
        ...         return observation[:, 2] % 5
        >>> layout = counting_layout(num_workers=2, columns=2, chunk_steps=4, slots=2)
        >>> fields = {field.key: field for field in layout.fields}
        >>> runner = PolicyRunner(
        ...     StepModFive(), device=torch.device("cpu"), observation_paths=((),)
        ... )
        >>> step = build_action_step(
        ...     runner,
        ...     {(): fields[("observation",)]},
        ...     {("action",): fields[("action",)]},
        ...     capacity=4,
        ... )
        >>> transport = ThreadQueueTransport()
        >>> end = transport.start(layout, counting_programs(layout))
        >>> server = InferenceServer(
        ...     runner,
        ...     step,
        ...     end,
        ...     layout=layout,
        ...     batching=BatchingConfig(max_batch_size=4),
        ...     output_keys=frozenset({("action",)}),
        ... )
        >>> server.start()
        >>> chunks = []
        >>> while not chunks:
        ...     for worker, slot in end.wait_chunks(5.0):
        ...         steps = slice(slot * layout.chunk_steps, (slot + 1) * layout.chunk_steps)
        ...         obs = end.buffers[("observation",)][worker, steps].copy()
        ...         next_obs = end.buffers[("next", "observation")][worker, steps].copy()
        ...         chunks.append((obs, next_obs))
        ...         end.release(worker, slot)
        >>> server.stop()
        >>> transport.close()
        >>> obs, next_obs = chunks[0]
        >>> bool((next_obs[..., 3] == obs[..., 2] % 5).all())  # each env got its own action
        True
        >>> server.stats()["rows"] >= 8, server.error is None  # one chunk: 4 steps, 2 envs
        (True, True)
    """

    def __init__(
        self,
        runner: PolicyRunner,
        step: ActionStep,
        end: RequestEnd,
        *,
        layout: RingLayout,
        batching: BatchingConfig,
        output_keys: frozenset[Key],
        seed: int | None = None,
        stall_timeout: float | None = None,
    ) -> None:
        self._runner = runner
        if seed is not None:
            step.seed(seed)
        self._step = step
        self._end = end
        self._layout = layout
        self._k = layout.request_columns
        self._batching = batching
        self._max_requests = max(1, batching.max_batch_size // self._k)
        # Every field requests touch, seen as [rows, *shape]: a batch is the rows that
        # request_rows names, read for observations and written for outputs.
        views = end.buffers
        step.attach_envs(layout, views)
        step.attach(
            {path: layout.request_sources(views, ("observation", *path)) for path in runner.paths}
        )
        if step.capacity < max(batching.max_batch_size, self._k):
            raise ValueError(f"the action step holds {step.capacity} rows, fewer than a batch")
        self._version_rows = layout.request_sources(views, ("policy_version",))
        self._output_rows = {key: layout.request_sources(views, key) for key in output_keys}
        self._weights_lock = threading.Lock()
        self._version = 0
        self._stop = threading.Event()
        self._pause = threading.Event()  # asked to hold between batches
        self._holding = threading.Event()  # holding: no batch in progress
        self._thread: threading.Thread | None = None
        self._error: InferenceError | None = None
        self._phase_ns = dict.fromkeys(PHASES, 0)
        self._batches = 0
        self._rows = 0
        self._batch_sizes = np.zeros(batching.max_batch_size + self._k + 1, np.int64)
        self._latencies = np.zeros(_LATENCIES, np.float64)
        self._served = 0
        self._warned_of_lock = False
        self._stall_timeout = stall_timeout
        self._steps_begun = 0
        self._in_step = 0  # the number of the action step under way; 0: none
        self._step_seen: tuple[int, float] | None = None  # (step, first seen under way)

    @property
    def policy_version(self) -> int:
        """Version of the weights in use: 0 at start, +1 per :meth:`update_weights`."""
        return self._version

    @property
    def error(self) -> InferenceError | None:
        """Why the server thread stopped serving, or None. With a ``stall_timeout``, an
        action step seen under way for longer than that is the error (module docstring)."""
        if self._error is None and self._stall_timeout is not None:
            self._look_for_a_stall(self._stall_timeout)
        return self._error

    def _look_for_a_stall(self, timeout: float) -> None:
        step, now = self._in_step, time.monotonic()
        seen = self._step_seen
        if not step:
            self._step_seen = None
            return
        if seen is None or seen[0] != step:
            self._step_seen = (step, now)
            return
        if now - seen[1] <= timeout or self._in_step != step:
            return
        frame = None
        if self._thread is not None:
            frame = sys._current_frames().get(self._thread.ident or -1)
        stack = "" if frame is None else "".join(traceback.format_stack(frame))
        message = (
            f"the inference server has not finished its policy call in {now - seen[1]:.1f} "
            f"s: stalled (stall_timeout={timeout:g} s)"
        )
        if stack:
            message += f"\nthe inference server's Python stack:\n{stack.rstrip()}"
        self._error = InferenceError(message)
        self._end.abort()  # every worker stops; the server thread stays in the policy

    def pause(self, timeout: float) -> None:
        """Hold the server between two batches; returns once it holds.

        Raises:
            InferenceError: the server failed, or did not reach a batch boundary within
                ``timeout`` seconds.
        """
        self._pause.set()
        deadline = time.monotonic() + timeout
        while not self._holding.wait(min(_IDLE_WAIT, max(0.0, deadline - time.monotonic()))):
            if self._error is not None:
                raise self._error
            if self._thread is None or not self._thread.is_alive():
                return  # not serving at all: nothing can run
            if time.monotonic() >= deadline:
                self._pause.clear()
                raise InferenceError(f"the inference server did not pause within {timeout} s")

    def resume(self) -> None:
        """Let a paused server go on."""
        self._pause.clear()

    def start(self) -> None:
        """Start the server thread."""
        self._thread = threading.Thread(target=self._run, name="rlcollect-inference", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 2.0) -> None:
        """Stop the server thread and release the step's hold on the ring (idempotent)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)
        if self._thread is None or not self._thread.is_alive():
            self._step.close()

    def update_weights(self, state_dict: Mapping[str, Any], *, version: int | None = None) -> int:
        """Copy ``state_dict`` into the served policy in place, between batches.

        A recurrent policy's per-env states are kept as they are: an env in the middle
        of an episode goes on from the state the old weights computed.

        Args:
            state_dict: every weight of the policy, by name.
            version: the version these weights become (default: the current one + 1).

        Returns:
            The new policy version.

        Raises:
            KeyError, TypeError, ValueError: before changing anything, if the weights
                do not match the policy's or cannot be copied (``checks.check_weights``).
            InferenceError: the server failed or stalled (in the policy call these
                weights wait for).
        """
        target = self._runner.policy.state_dict(keep_vars=True)
        check_weights(state_dict, {n: (tuple(t.shape), t.dtype) for n, t in target.items()})
        # Bounded: a policy call that never returns holds the lock (stall_timeout).
        while not self._weights_lock.acquire(timeout=_IDLE_WAIT):
            error = self.error
            if error is not None:
                raise error
        try:
            return self._copy_weights(target, state_dict, version)
        finally:
            self._weights_lock.release()

    def _copy_weights(
        self, target: Mapping[str, Any], state_dict: Mapping[str, Any], version: int | None
    ) -> int:
        with torch.no_grad():
            for name, value in state_dict.items():
                target[name].copy_(value)
            if self._runner.device.type == "cuda":
                # The copies ran on this thread's stream; the server's stream must not
                # start the next forward before they are done.
                torch.cuda.current_stream(self._runner.device).synchronize()
            self._version = self._version + 1 if version is None else version
            return self._version

    def stats(self) -> dict[str, Any]:
        """Batches, rows, mean batch size, batch-size histogram, seconds per phase, and the
        p50/p95 request latency (seconds from a request's arrival to its response) over
        the last 16384 requests."""
        sizes = {int(s): int(c) for s, c in enumerate(self._batch_sizes) if c}
        recent = self._latencies[: min(self._served, _LATENCIES)]
        p50, p95 = np.percentile(recent, [50, 95]).tolist() if recent.size else [0.0, 0.0]
        return {
            "batches": self._batches,
            "rows": self._rows,
            "mean_batch_size": self._rows / self._batches if self._batches else 0.0,
            "batch_sizes": sizes,
            "phase_seconds": {k: v / 1e9 for k, v in self._phase_ns.items()},
            "request_latency_p50": p50,
            "request_latency_p95": p95,
            "gathers_on_device": self._step.gathers_on_device,
        }

    # ---------------------------------------------------------------- the loop

    def _run(self) -> None:
        if self._runner.device.type == "cpu":
            # Per-thread (OpenMP) setting: the caller's threads keep theirs. On the CPU the
            # cores belong to the env workers; an intra-op pool that spins between small
            # forwards takes them away (``benchmarks/cpu_collection.py`` compares both).
            torch.set_num_threads(1)
        try:
            self._loop()
        except ChannelClosed:
            return
        except BaseException as exc:
            err = InferenceError(
                f"the inference server failed: {type(exc).__name__}: {text_of(exc)}"
            )
            err.__cause__ = exc
            self._error = err
            self._end.abort()  # unblocks every worker and the consumer

    def _loop(self) -> None:
        pending: deque[tuple[int, int, float]] = deque()
        self._await_first_requests(pending)
        oldest = time.perf_counter()
        min_rows = self._batching.min_batch_size
        timeout = self._batching.batch_timeout
        clock = time.perf_counter_ns
        phase = self._phase_ns
        watch = LockWatch()
        while not self._stop.is_set():
            if self._pause.is_set():
                self._hold()
                continue
            if watch.due(time.perf_counter()):
                self._watch_the_lock(watch)
            # wait
            t0 = clock()
            if not pending:
                wait = _IDLE_WAIT
            elif len(pending) * self._k >= min_rows:
                wait = 0.0
            else:
                wait = max(0.0, oldest + timeout - time.perf_counter())
            new = self._end.wait_requests(wait)
            if new:
                now = time.perf_counter()
                if not pending:
                    oldest = now
                pending.extend((w, p, now) for w, p in new)
            phase["wait"] += clock() - t0
            if not pending:
                continue
            ready = len(pending) * self._k >= min_rows
            if not ready and time.perf_counter() - oldest < timeout:
                continue
            n = min(len(pending), self._max_requests)
            batch = [pending.popleft() for _ in range(n)]
            if pending:
                oldest = pending[0][2]
            self._serve(batch)

    def _watch_the_lock(self, watch: LockWatch) -> None:
        """Warn once if this thread keeps waiting whole switch intervals to take the
        interpreter lock back (``lock_wait.py``): a thread of this process busy in pure
        Python is starving collection."""
        watch.check()
        if self._warned_of_lock or not watch.starved():
            return
        self._warned_of_lock = True
        warnings.warn(
            f"the inference server thread waited {1e3 * max(watch.waits):.1f} ms to take "
            "the interpreter lock back after letting go of it, in "
            f"{sum(w >= sys.getswitchinterval() / 2 for w in watch.waits)} of its last "
            f"{len(watch.waits)} checks: another thread of this process keeps the lock "
            "busy in pure Python (a training loop?), and collection starves. Use "
            "inference_backend='process' (docs/tuning.md, inference_backend).",
            RuntimeWarning,
            stacklevel=2,
        )

    def _hold(self) -> None:
        """Hold between batches while paused (a quiet point: no forward runs)."""
        self._holding.set()
        try:
            while self._pause.is_set() and not self._stop.wait(_IDLE_WAIT):
                pass
        finally:
            self._holding.clear()

    def _await_first_requests(self, pending: deque[tuple[int, int, float]]) -> None:
        missing = set(range(self._layout.num_workers))
        bound = (
            math.inf
            if self._batching.first_round_timeout is None
            else (self._batching.first_round_timeout)
        )
        deadline = math.inf  # set by the first request
        while missing and not self._stop.is_set() and time.monotonic() < deadline:
            if self._pause.is_set():
                self._hold()
                continue
            new = self._end.wait_requests(_IDLE_WAIT)
            now = time.perf_counter()
            if new and not pending:
                deadline = time.monotonic() + bound
            pending.extend((w, p, now) for w, p in new)
            missing.difference_update(w for w, _ in new)

    def _serve(self, batch: list[tuple[int, int, float]]) -> None:
        clock = time.perf_counter_ns
        phase = self._phase_ns
        n = len(batch)
        rows = n * self._k
        t0 = clock()
        workers = np.fromiter((b[0] for b in batch), dtype=np.intp, count=n)
        requests = np.fromiter((b[1] for b in batch), dtype=np.intp, count=n)
        flat = request_rows(self._layout, self._end.buffers, workers, requests)
        self._step.load(flat)
        t1 = clock()
        self._steps_begun += 1
        self._in_step = self._steps_begun  # marked: stall_timeout bounds the step
        try:
            with self._weights_lock:
                outputs, (h2d, d2h) = self._step.run(rows)
                version = self._version
        finally:
            self._in_step = 0
        t2 = clock()
        scatter_outputs(outputs, self._output_rows, flat)
        self._version_rows[flat] = version
        t3 = clock()
        self._end.respond([int(w) for w in workers])
        t4 = clock()
        done = time.perf_counter()
        for b in batch:
            self._latencies[self._served % _LATENCIES] = done - b[2]
            self._served += 1
        phase["gather"] += t1 - t0
        # The step's own split of its time (device timers on a GPU); what it does not
        # account for (launch overhead, the wait) is charged to forward.
        step_ns = t2 - t1
        phase["h2d"] += int(h2d * 1e9)
        phase["d2h"] += int(d2h * 1e9)
        phase["forward"] += max(0, step_ns - int((h2d + d2h) * 1e9))
        phase["scatter"] += t3 - t2
        phase["respond"] += t4 - t3
        self._batches += 1
        self._rows += rows
        self._batch_sizes[min(rows, len(self._batch_sizes) - 1)] += 1
