"""The policy inside each env worker: ``inference_backend="worker"``, for cheap envs and
for one native vector env per worker.

When an env steps in microseconds (CartPole, most classic-control and toy envs), the
round trip to a batching server costs more than the env: two wake-ups between cores,
the server's per-batch Python, and a policy call that is mostly fixed overhead. Here
each worker runs its own copy of the policy on one CPU thread, beside its envs, and
answers its own requests in place; nothing waits for another process, and the workers'
forwards run in parallel, one per core::

    worker process w (torch, one thread)             driver process
    ┌──────────────────────────────────────┐        ┌──────────────────────────────┐
    │ writes obs of split g at position p  │        │ update_policy_weights_:      │
    │ request(q): InWorkerEnd serves it:   │        │  WeightsBoard.publish ────┐  │
    │   refresh weights from the board ◀───┼────────┼───────────────────────────┘  │
    │   policy(obs[p, split]) → action,    │        │                              │
    │   outputs, version written at p      │        │ consuming thread:            │
    │ steps its envs … chunk full:         │        │  chunks → batches, as ever   │
    │ hand_over ───────────────────────────┼───────▶│                              │
    └──────────────────────────────────────┘        └──────────────────────────────┘

:class:`InWorkerEnd` wraps the transport's worker end, so the worker loop
(``worker/loop.py``) runs unchanged: its ``request`` computes the actions, its
``wait_response`` has nothing to wait for. The ring, its chunks, backpressure,
restarts and stall detection are the transport's and the collector's as with any
backend. Weights travel through a :class:`~rlcollect.inference.board.WeightsBoard`;
every worker starts from the driver's weights (version 0), even when each builds its
policy from a factory.

The same holds for a vector env's staged requests (its result is a batch already: the
worker serves it as a hand-written send/recv loop would) and for a policy on a GPU: the
worker then runs the server's action step (``inference/step.py``: GPU gather, compile,
CUDA graphs) over its own part of the ring (a worker process in a CUDA context of its
own; worker threads, which share one, are refused ``compile`` and ``cuda_graph``).

A worker seeded with ``seed`` draws its exploration noise from a stream of its own
(``seed`` and its index; in a process its generator is seeded once, in a thread the
stream is swapped in around each forward): its envs' actions depend only on what its
envs returned, so a seeded run repeats each env's stream exactly.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import cloudpickle
import numpy as np
import torch

from rlcollect.errors import ChannelClosed, InferenceError, WorkerFailure
from rlcollect.inference.base import InferenceBackend
from rlcollect.inference.board import WeightsBoard
from rlcollect.inference.build import build_action_step
from rlcollect.inference.checks import check_output, check_weights, scatter_outputs
from rlcollect.inference.config import InferenceConfig
from rlcollect.inference.policy import PolicyRunner
from rlcollect.inference.rng import PolicyRng, policy_rng
from rlcollect.inference.step import ActionStep
from rlcollect.lifeline import at_driver_death
from rlcollect.processes import unlink_segment
from rlcollect.transports.base import WorkerEnd
from rlcollect.transports.layout import PROGRESS, STAGED, Key, Path, request_rows
from rlcollect.worker.loop import run_worker
from rlcollect.worker.progress import Progress, Stage
from rlcollect.worker.spec import WorkerSpec

__all__ = ["InWorkerBackend", "InWorkerEnd", "InWorkerPolicy", "run_worker_with_policy"]

_POLICY = Stage.POLICY  # the progress mark of a forward (stall_timeout)
_PUBLISH_WAIT = 10.0  # seconds a worker may hold the board (copying weights) before an error
_BOARD_WAIT = 60.0  # seconds a worker may wait for the driver to finish publishing


@dataclass(frozen=True)
class InWorkerPolicy:
    """What a worker needs to run the policy itself; pickled into worker processes
    (``payload`` is the policy or its factory, already cloudpickled: no torch object)."""

    config: InferenceConfig
    payload: bytes
    is_factory: bool
    board: str
    driver_pid: int


def run_worker_with_policy(end: WorkerEnd, spec: WorkerSpec, policy: InWorkerPolicy) -> None:
    """A worker program: the collector's worker loop, its requests served in place."""
    import cloudpickle

    own_process = policy.driver_pid != os.getpid()
    if own_process:  # the board, unlinked too where the driver dies (lifeline.py)
        at_driver_death(lambda: unlink_segment(policy.board))
    torch.set_num_threads(1)  # the other cores step the other workers' envs
    source = cloudpickle.loads(policy.payload)
    module = source() if policy.is_factory else source
    config = policy.config
    try:
        board = WeightsBoard.attach(policy.board, config.weights, config.layout.num_workers)
    except FileNotFoundError as exc:  # as the ring's: gone before this worker got going
        raise ChannelClosed("the driver closed the collector before this worker started") from exc
    try:
        local = InWorkerEnd(end, spec, config, module, board, own_process=own_process)
        try:
            # Inference mode is per thread, and this thread only ever acts: entered once,
            # it spares every forward its context and its ops their autograd bookkeeping.
            with torch.inference_mode():
                run_worker(local, spec)
        finally:
            local.close()
    except ChannelClosed:
        if own_process:  # the driver may be gone: nobody else would unlink the board
            unlink_segment(policy.board)
        raise
    finally:
        board.close(unlink=False)


class InWorkerEnd(WorkerEnd):
    """A worker end whose requests are answered in the worker, by its own policy copy.

    A CPU policy on in-place requests reads its split's ring cells where they are (the
    cheap-env path: nothing gathered). Otherwise (the policy on a GPU, or the staged
    requests of vector envs) the request goes through the same action step the server
    runs (``inference/step.py``), bound to this worker's part of the ring only: a GPU
    gather, ``compile`` and CUDA graphs work as they do there.
    """

    answers_in_request = True

    def __init__(
        self,
        end: WorkerEnd,
        spec: WorkerSpec,
        config: InferenceConfig,
        policy: torch.nn.Module,
        board: WeightsBoard,
        *,
        own_process: bool,
    ) -> None:
        self._end = end
        self.index = end.index
        self.buffers = end.buffers
        device = torch.device(config.device)
        self._device = device
        policy = policy.to(device)
        policy.requires_grad_(False)  # as the server's copy: weights change by copy only
        self._runner = PolicyRunner(
            policy,
            device=device,
            observation_paths=config.observation_paths,
            exploration_type=config.exploration_type,
        )
        self._step: ActionStep | None = None
        if device.type != "cpu" or config.layout.staging is not None:
            self._bind_step(config)
        self._params = policy.state_dict(keep_vars=True)
        self._board = board
        self._version = -1  # none yet: the first request loads version 0 from the board
        self._splits = spec.splits
        width = config.layout.columns // spec.splits
        self._width = width
        self._columns = [slice(g * width, (g + 1) * width) for g in range(spec.splits)]
        self._inputs = [
            (path, end.buffers[("observation", *path)]) for path in config.observation_paths
        ]
        self._outputs: dict[Key, np.ndarray] = {key: end.buffers[key] for key, _ in config.outputs}
        self._version_field = end.buffers[("policy_version",)]
        # Each request's cells (its inputs as tensors, its outputs' cells), made on its
        # first use and kept: a request reads and writes the same cells every round.
        self._cells: dict[int, _Cells] = {}
        # Each forward is marked in the worker's progress record, as an env call is: a
        # policy that never returns is a stall (stall_timeout), found by the driver.
        progress = Progress(end.buffers[PROGRESS])
        self._enter, self._leave = progress.enter, progress.leave  # bound once: per forward
        self._first_env = spec.env_offset
        self._rng: PolicyRng | None = None
        if spec.seed is not None:
            seed = _stream(spec.seed, end.index)
            if self._step is not None:  # a stream of the step's own, as the server's
                self._step.seed(seed)
            elif own_process:  # its generator is its own: seed it once
                torch.manual_seed(seed)
            else:  # a thread: the driver's generator, so a stream swapped in per forward
                self._rng = policy_rng(device, seed)

    def _bind_step(self, config: InferenceConfig) -> None:
        """The server's action step over this worker's part of the ring: the ring seen
        as a ring of one worker, so that ``request_rows`` names this worker's rows."""
        layout = dataclasses.replace(config.layout, num_workers=1)
        views = {key: array[None] for key, array in self.buffers.items()}
        step = build_action_step(
            self._runner,
            dict(config.observations),
            dict(config.outputs),
            capacity=layout.request_columns,
            compile_options=config.compile_options,
            cuda_graph=config.cuda_graph,
        )
        step.attach(
            {
                path: layout.request_sources(views, ("observation", *path))
                for path in config.observation_paths
            }
        )
        self._step = step
        self._layout = layout
        self._views = views
        self._step_outputs = {key: layout.request_sources(views, key) for key, _ in config.outputs}
        self._step_versions = layout.request_sources(views, ("policy_version",))
        self._me = np.zeros(1, dtype=np.intp)
        # Staged (vector envs): a request's rows in a ring of one worker are its cells,
        # as its request index names them (what request_rows computes, without the
        # arithmetic, which runs between a vector env's result and its actions).
        self._request_cells = self.buffers.get((STAGED, "rows"))

    def request(self, position: int) -> None:
        if self._step is not None:
            self._request_step(position)
            return
        start = time.perf_counter_ns()
        cells = self._cells.get(position)
        if cells is None:
            cells = self._cells[position] = self._cells_of(position)
        self._version = self._board.refresh(self.index, self._params, self._version, _BOARD_WAIT)
        rng = self._rng
        self._enter(_POLICY, self._first_env)
        if rng is None:
            out = self._runner.call(cells.inputs)
        else:
            rng.swap_in()
            try:
                out = self._runner.call(cells.inputs)
            finally:
                rng.swap_out()
        self._leave()
        if out.keys() != self._outputs.keys():
            raise ValueError(
                f"policy returned outputs {sorted(out)}, but {sorted(self._outputs)} when "
                "the collector was built"
            )
        outputs = cells.outputs
        for key, value in out.items():
            dtype, shape, target, dst = outputs[key]
            # An output of its field's dtype and shape (and one numpy would take) is
            # copied as it is, tensor to tensor; the full check only where it differs:
            # this runs once per forward, on the critical path of a cheap env's every step.
            if (
                value.dtype == dtype
                and value.shape == shape
                and value.is_cpu
                and not value.requires_grad
            ):
                assert target is not None  # a dtype torch has
                target.copy_(value)
                continue
            src = value.numpy()
            if src.dtype != dst.dtype or src.shape[1:] != dst.shape[1:]:
                check_output(key, src, dst)
            dst[...] = src
        cells.version[...] = self._version
        self._board.record(self.index, self._width, time.perf_counter_ns() - start)

    def _cells_of(self, position: int) -> _Cells:
        """Request ``position``'s cells: split ``g``'s columns at ring position ``p``."""
        p, g = divmod(position, self._splits)
        cols = self._columns[g]
        outputs: dict[Key, tuple[torch.dtype | None, torch.Size, torch.Tensor | None, Any]] = {}
        for key, field in self._outputs.items():
            dst = field[p, cols]
            try:
                target: torch.Tensor | None = torch.from_numpy(dst)
            except TypeError:  # a dtype torch does not have: every output takes the check
                target = None
            dtype = None if target is None else target.dtype
            outputs[key] = (dtype, torch.Size(dst.shape), target, dst)
        return _Cells(
            inputs={path: torch.from_numpy(ring[p, cols]) for path, ring in self._inputs},
            outputs=outputs,
            version=self._version_field[p, cols],
        )

    def _request_step(self, request: int) -> None:
        start = time.perf_counter_ns()
        step = self._step
        assert step is not None
        version = self._board.refresh(self.index, self._params, self._version, _BOARD_WAIT)
        if version != self._version and self._device.type == "cuda":
            # The copy into the parameters ran on this thread's current stream; the step
            # runs on a stream of its own, which must not read them half copied.
            torch.cuda.current_stream(self._device).synchronize()
        self._version = version
        if self._request_cells is not None:
            flat = self._request_cells[request]
        else:
            flat = request_rows(self._layout, self._views, self._me, np.array([request]))
        rows = step.load(flat)
        self._enter(_POLICY, self._first_env)
        outputs, _ = step.run(rows)
        self._leave()
        scatter_outputs(outputs, self._step_outputs, flat)
        self._step_versions[flat] = version
        self._board.record(self.index, rows, time.perf_counter_ns() - start)

    def close(self) -> None:
        """Release what the action step holds (page-locked ring cells)."""
        if self._step is not None:
            self._step.close()

    def wait_response(self) -> None:
        """Nothing to wait for: :meth:`request` wrote the actions."""

    def hand_over(self, slot: int) -> None:
        self._end.hand_over(slot)

    def wait_slot(self) -> int | None:
        return self._end.wait_slot()

    def report(self, failure: WorkerFailure) -> None:
        self._end.report(failure)


@dataclass(frozen=True)
class _Cells:
    """One request's cells: its observations as tensors (the ring's memory), and per
    output its field's torch dtype (None: torch has none), the shape of the request's
    output, its cells as a tensor and as an array; and the version's cells."""

    inputs: dict[Path, torch.Tensor]
    outputs: dict[Key, tuple[torch.dtype | None, torch.Size, torch.Tensor | None, Any]]
    version: np.ndarray


def _stream(seed: int, worker: int) -> int:
    """Worker ``worker``'s seed: distinct per worker, the same in every run."""
    return (seed * 1_000_003 + worker) % (2**63)


# ---------------------------------------------------------------- the driver's side


class InWorkerBackend(InferenceBackend):
    """The policy in every env worker (``inference_backend="worker"``).

    Args:
        config: the ring and policy outputs the workers serve.
        policy: a cloudpickle-able policy (``policy_is_factory=False``) or a
            zero-argument callable building it in each worker.
        policy_is_factory: which of the two ``policy`` is.
        initial: the weights every worker starts from (version 0): the driver's copy,
            so that workers building their policy from a factory still agree.

    Built before the workers start: :meth:`local_policy` is what each worker is handed.
    """

    def __init__(
        self,
        config: InferenceConfig,
        policy: Any,
        *,
        policy_is_factory: bool,
        initial: Mapping[str, torch.Tensor],
    ) -> None:
        self._config = config
        self._payload = cloudpickle.dumps(policy)
        self._is_factory = policy_is_factory
        self._version = 0
        self._board: WeightsBoard | None = WeightsBoard.create(
            config.weights, config.layout.num_workers, initial
        )
        self._last_stats: dict[str, Any] = {}
        self.shm_name = self._board.name  # the board's segment (unlinked by stop())

    def segments(self) -> tuple[str, ...]:
        """The weights board's segment (:attr:`shm_name`)."""
        return (self.shm_name,)

    def local_policy(self) -> InWorkerPolicy:
        """What a worker builds its policy and finds the board from."""
        assert self._board is not None
        return InWorkerPolicy(
            config=self._config,
            payload=self._payload,
            is_factory=self._is_factory,
            board=self._board.name,
            driver_pid=os.getpid(),
        )

    @property
    def policy_version(self) -> int:
        return self._version

    @property
    def error(self) -> InferenceError | None:
        """Always None: a policy that fails, fails its worker."""
        return None

    def start(self) -> None:
        """Nothing to start: every worker builds its policy when it starts."""

    def update_weights(self, state_dict: Mapping[str, torch.Tensor]) -> int:
        if self._board is None:
            raise InferenceError("the collector's weights board is closed")
        layout = self._config.weights
        check_weights(state_dict, layout.weights())
        version = self._version + 1
        self._board.publish(state_dict, version, _PUBLISH_WAIT)
        self._version = version
        return version

    def pause(self, timeout: float) -> None:
        """Nothing to hold here: the workers' forwards stop once the ring is full, and
        weights change only when the caller updates them."""

    def resume(self) -> None:
        """See :meth:`pause`."""

    def stop(self) -> None:
        if self._board is not None:
            self._last_stats = self.stats()  # the final figures outlive the board
            self._board.close(unlink=True)
            self._board = None

    def stats(self) -> dict[str, Any]:
        """Forwards (``batches``), rows, mean rows per forward, time in the forwards and
        the p50/p95 of a request's time in its worker (to the microsecond)."""
        if self._board is None:
            return dict(self._last_stats)
        s = self._board.summary()
        layout = self._config.layout
        width = layout.request_columns  # rows of every forward
        return {
            "batches": s["forwards"],
            "rows": s["rows"],
            "mean_batch_size": s["rows"] / s["forwards"] if s["forwards"] else 0.0,
            "batch_sizes": {width: s["forwards"]} if s["forwards"] else {},
            "phase_seconds": {"forward": s["seconds"]},
            "request_latency_p50": s["p50"],
            "request_latency_p95": s["p95"],
            "gathers_on_device": False,
        }
