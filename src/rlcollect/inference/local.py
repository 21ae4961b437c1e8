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
    │ writes obs of group g at position p   │        │ update_policy_weights_:       │
    │ request(q): LocalEnd serves it here:  │        │  WeightsBoard.publish ────┐   │
    │   refresh weights from the board ◀────┼────────┼───────────────────────────┘   │
    │   policy(obs[p, group]) → action,     │        │                              │
    │   outputs, version written at p       │        │ consuming thread:             │
    │ steps its envs … chunk full:          │        │  chunks → batches, as ever    │
    │ hand_over ────────────────────────────┼───────▶│                              │
    └──────────────────────────────────────┘        └──────────────────────────────┘

:class:`LocalEnd` wraps the transport's worker end, so the worker loop
(``collector/worker.py``) runs unchanged: its ``request`` computes the actions, its
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
from dataclasses import dataclass

import numpy as np
import torch

from rlcollect.collector.spec import WorkerSpec
from rlcollect.collector.worker import run_worker
from rlcollect.errors import ChannelClosed, WorkerFailure
from rlcollect.inference.board import WeightsBoard
from rlcollect.inference.policy import PolicyRunner
from rlcollect.inference.process import InferenceConfig
from rlcollect.inference.rng import PolicyRng, policy_rng
from rlcollect.inference.server import check_output, scatter_outputs
from rlcollect.inference.step import ActionStep, build_action_step
from rlcollect.processes import unlink_segment
from rlcollect.transports.base import WorkerEnd
from rlcollect.transports.layout import STAGED, Key, request_rows

__all__ = ["LocalEnd", "LocalPolicy", "run_local_worker"]

_BOARD_WAIT = 60.0  # seconds a worker may wait for the driver to finish publishing


@dataclass(frozen=True)
class LocalPolicy:
    """What a worker needs to run the policy itself; pickled into worker processes
    (``payload`` is the policy or its factory, already cloudpickled: no torch object)."""

    config: InferenceConfig
    payload: bytes
    is_factory: bool
    board: str
    driver_pid: int


def run_local_worker(end: WorkerEnd, spec: WorkerSpec, policy: LocalPolicy) -> None:
    """A worker program: the collector's worker loop, its requests served in place."""
    import cloudpickle

    torch.set_num_threads(1)  # the other cores step the other workers' envs
    source = cloudpickle.loads(policy.payload)
    module = source() if policy.is_factory else source
    config = policy.config
    try:
        board = WeightsBoard.attach(policy.board, config.weights, config.layout.num_workers)
    except FileNotFoundError as exc:  # as the ring's: gone before this worker got going
        raise ChannelClosed("the driver closed the collector before this worker started") from exc
    try:
        own_process = policy.driver_pid != os.getpid()
        local = LocalEnd(end, spec, config, module, board, own_process=own_process)
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


class LocalEnd(WorkerEnd):
    """A worker end whose requests are answered in the worker, by its own policy copy.

    A CPU policy on in-place requests reads its group's ring cells where they are (the
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
            policy, device=device, observation_paths=config.observation_paths
        )
        self._step: ActionStep | None = None
        if device.type != "cpu" or config.layout.staging is not None:
            self._bind_step(config)
        self._params = policy.state_dict(keep_vars=True)
        self._board = board
        self._version = -1  # none yet: the first request loads version 0 from the board
        self._groups = spec.groups
        width = config.layout.envs_per_worker // spec.groups
        self._width = width
        self._columns = [slice(g * width, (g + 1) * width) for g in range(spec.groups)]
        self._inputs = [
            (path, end.buffers[("observation", *path)]) for path in config.observation_paths
        ]
        self._outputs: dict[Key, np.ndarray] = {key: end.buffers[key] for key, _ in config.outputs}
        self._version_field = end.buffers[("policy_version",)]
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
        p, g = divmod(position, self._groups)
        cols = self._columns[g]
        self._version = self._board.refresh(self.index, self._params, self._version, _BOARD_WAIT)
        tensors = {path: torch.from_numpy(ring[p, cols]) for path, ring in self._inputs}
        rng = self._rng
        if rng is None:
            out = self._runner.call(tensors)
        else:
            rng.swap_in()
            try:
                out = self._runner.call(tensors)
            finally:
                rng.swap_out()
        if out.keys() != self._outputs.keys():
            raise ValueError(
                f"policy returned outputs {sorted(out)}, but {sorted(self._outputs)} when "
                "the collector was built"
            )
        for key, value in out.items():
            src = value.numpy()
            field = self._outputs[key]
            # The full check only when the output differs from its field: this runs once
            # per forward, and a cheap env's step costs a few microseconds.
            if src.dtype != field.dtype or src.shape[1:] != field.shape[2:]:
                check_output(key, src, field[p, cols])
            field[p, cols] = src
        self._version_field[p, cols] = self._version
        self._board.record(self.index, self._width, time.perf_counter_ns() - start)

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
        outputs, _ = step.run(rows)
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


def _stream(seed: int, worker: int) -> int:
    """Worker ``worker``'s seed: distinct per worker, the same in every run."""
    return (seed * 1_000_003 + worker) % (2**63)
