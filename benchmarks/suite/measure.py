"""One timing protocol for every series: start up, warm up, then count frames for a window.

A loop under test is a generator that yields the frames it completed at each step
(a batch, a vector step, a received chunk). Start-up (process spawns, CUDA-graph
capture, the first reset) ends at its first yield; the window starts right after a
yield, once the warm-up is over, and ends at the first yield past ``measure_s``, so it
spans whole steps only. CPU time is read for the whole driver process (every thread in
it: the iterating thread, an in-process inference server, helper threads) and for the
iterating thread alone.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rlcollect import AsyncBatchedCollector


def measure(steps: Iterator[int], warmup_s: float, measure_s: float) -> dict[str, Any]:
    """Run ``steps`` through start-up, warm-up and one timed window.

    Args:
        steps: yields the frames completed per step; must not end before the window does.
        warmup_s: seconds after the first step that are not counted.
        measure_s: length of the counted window, in seconds (at least one whole step).

    Returns:
        ``frames_per_second``, ``driver_cpu_ms_per_frame`` (process),
        ``driver_thread_cpu_ms_per_frame`` (the iterating thread), ``steps_per_second``
        (yields per second: batches, vector steps, learner updates), ``frames``,
        ``seconds`` and ``startup_seconds`` (until the first step).
    """
    started = time.perf_counter()
    next(steps)
    startup = time.perf_counter() - started
    warm_end = time.perf_counter() + warmup_s
    for _ in steps:
        if time.perf_counter() >= warm_end:
            break
    t0, c0, th0 = time.perf_counter(), time.process_time(), time.thread_time()
    frames = count = 0
    for n in steps:
        frames += n
        count += 1
        if time.perf_counter() - t0 >= measure_s:
            break
    wall = time.perf_counter() - t0
    cpu, thread_cpu = time.process_time() - c0, time.thread_time() - th0
    if frames == 0:
        raise RuntimeError(
            f"no frames in the {wall:.2f} s window ({count} steps): the loop ended or stalled"
        )
    return {
        "frames_per_second": frames / wall,
        "driver_cpu_ms_per_frame": 1e3 * cpu / frames,
        "driver_thread_cpu_ms_per_frame": 1e3 * thread_cpu / frames,
        "steps_per_second": count / wall,
        "frames": frames,
        "seconds": wall,
        "startup_seconds": startup,
    }


def measure_collector(
    build: Callable[[], AsyncBatchedCollector], warmup_s: float, measure_s: float
) -> dict[str, Any]:
    """:func:`measure` over the batches of the collector ``build()`` returns, plus what its
    ``stats()`` say about the server (read before it shuts down).

    Returns:
        :func:`measure`'s result with ``transition_chunk_size``, ``envs_per_worker``,
        ``worker_splits``, ``mean_batch_size``,
        ``request_latency_p50``/``_p95``, ``server_phase_seconds`` and
        ``gathers_on_device``.
    """
    held: list[AsyncBatchedCollector] = []

    def batches() -> Iterator[int]:
        with build() as collector:
            held.append(collector)
            for batch in collector:
                yield batch.numel()

    steps = batches()
    try:
        result = measure(steps, warmup_s, measure_s)
        stats = held[0].stats()
        server = stats.get("server", {})
        # batches handed out as views of their ring slot (collector/batches/loans.py)
        result["lent_batches"] = stats.get("lent_batches")
        result["slot_wait_seconds"] = stats.get("slot_wait_seconds")
        result["transition_chunk_size"] = held[0].transition_chunk_size
        # the layout as resolved ("auto" becomes a number)
        result["envs_per_worker"] = held[0].envs_per_worker
        result["worker_splits"] = held[0].worker_splits
        # what the collector chose where the layout was left to it, and by which rule
        choice = held[0].describe()
        result["layout"] = {k: str(v) for k, v in choice.arguments().items()}
        result["rule"] = choice.rule
    finally:
        steps.close()  # leaves the with block: the collector shuts down
    for key in ("mean_batch_size", "request_latency_p50", "request_latency_p95"):
        result[key] = server.get(key)
    result["server_phase_seconds"] = server.get("phase_seconds")
    result["gathers_on_device"] = server.get("gathers_on_device")
    # batches launched while another was on the GPU: the two_lanes probe's server only
    result["overlapped_batches"] = server.get("overlapped_batches")
    result["batches"] = server.get("batches")
    result["gpu_wait"] = server.get("gpu_wait")  # naps before the spin (inference/gpu_wait.py)
    return result
