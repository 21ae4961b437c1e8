"""Starting a plan's parts, in order::

    plan.backend.prepare()        phase 1: what the workers run (the in-worker policy's
                                  weights board exists before its workers)
    plan.transport.start(...)     the workers, running those programs on the ring
    prepared.serve(...)           phase 2: the backend serves the workers' requests
    chunk_loop(...)               the driver's loop: chunks in, batches out, as the
                                  plan's delivery says

The collector (``collector.py``) owns what has started from the first step on, so that
its ``shutdown()`` stops it whatever step failed; what the backend prepared but never
served is given back here.
"""

from __future__ import annotations

from collections.abc import Callable

from rlcollect.collector.background import Background, Throttle
from rlcollect.collector.batches.loop import ChunkLoop
from rlcollect.collector.batches.restarts import WorkerRestarts
from rlcollect.collector.batches.stall import Stalls, StallWatch
from rlcollect.collector.plan import Plan
from rlcollect.inference.base import InferenceBackend
from rlcollect.processes import out_of_descriptors
from rlcollect.transports.base import ServerEnd, WorkerProgram
from rlcollect.transports.layout import PROGRESS
from rlcollect.worker.spec import WorkerSpec

__all__ = ["chunk_loop", "start_serving"]


def start_serving(
    plan: Plan,
) -> tuple[ServerEnd, InferenceBackend, Callable[[WorkerSpec], WorkerProgram]]:
    """Start the workers and the backend serving them; returns the driver's end of the
    ring, the running backend, and what a restarted worker runs. On failure the
    transport is left for the caller to close."""
    if plan.first_worker is not None:  # worker 0's process, which built env 0
        plan.transport.adopt_first_worker(plan.first_worker)
    prepared = plan.backend.prepare()
    try:
        programs = [prepared.program(spec) for spec in plan.specs]
        end = plan.transport.start(plan.layout, programs)
        server = prepared.serve(plan.transport, end)
    except BaseException as exc:
        prepared.abort()
        named = out_of_descriptors(exc, f"starting {plan.layout.num_workers} workers")
        if named is not None:
            raise named from exc
        raise
    return end, server, prepared.program


def chunk_loop(
    plan: Plan,
    end: ServerEnd,
    server: InferenceBackend,
    background: Background,
    program: Callable[[WorkerSpec], WorkerProgram],
) -> ChunkLoop:
    """The driver's loop over ``plan``'s ring, started as ``end`` and served by
    ``server``; a restarted worker runs ``program``."""
    o = plan.options
    restarts = None
    if o.max_worker_restarts:
        restarts = WorkerRestarts(
            o.max_worker_restarts,
            plan.transport,
            plan.layout,
            end.buffers,
            list(plan.specs),
            num_envs=plan.num_envs,
            program=program,
        )
    builder = plan.delivery.builder(
        plan.layout,
        end.buffers,
        num_envs=plan.num_envs,
        frames_per_batch=o.frames_per_batch,
        total_frames=o.total_frames,
        time_major=o.time_major,
    )
    throttle = None if plan.throttle is None else Throttle(*plan.throttle, o.learning_starts)
    stalls = None
    if o.stall_timeout is not None:
        watch = StallWatch(end.buffers[PROGRESS], o.stall_timeout, plan.transport.worker_pid)
        stalls = Stalls(watch, plan.transport, o.stall_timeout, plan.source.envs)
    return ChunkLoop(
        end,
        builder,
        restarts,
        server,
        background,
        throttle,
        o.replay_buffer,
        plan.delivery.gate(end, server, plan.layout.num_workers),
        stalls,
    )
