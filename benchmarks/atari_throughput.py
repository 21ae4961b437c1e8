"""Atari throughput on a native vector env: rlcollect against the env alone and a hand loop.

Pong through ale-py's ``AtariVectorEnv`` (84x84 grayscale, 4 stacked frames, frameskip
4): ``--envs`` sub-envs, ``--batch`` of them per ``recv`` (first-k-of-N asynchrony),
``--threads`` C++ threads in all. Each value ``w`` of ``--splits`` divides them into
``w`` vector envs of ``envs/w`` sub-envs, ``batch/w`` per ``recv`` and ``threads/w``
threads. The policy is the Nature CNN, sampling by Gumbel-max, captured as a CUDA graph
where CUDA is present (eager on the CPU). In one run, interleaved, ``--repeats``
times, each series timed over ``--seconds``, for each split ``w``:

* ``env_only[Ww]``: each vector env in a process of its own, ``send``/``recv`` with
  random actions, no policy, timed over one shared window: the ceiling.
* ``hand_loop[Ww]``: one thread visiting the vector envs in turn: ``recv`` →
  observations into the graph's input → replay → actions back → ``send``; the same
  network, nothing stored. ``hand_loop[1w]`` is the classic single-env loop.
* ``rlcollect[thread-Ww]``: ``AsyncBatchedCollector`` with one worker per vector env,
  workers as threads (the vector env's C++ threads release the GIL).
* ``rlcollect[process_slots-Ww]``: the same with worker processes.
* with ``--double-buffer``, ``rlcollect[thread-2x]`` and ``rlcollect[process_slots-2x]``:
  two vector envs of half the envs, batch and threads each, in one worker that
  alternates between them (two batches at the policy at once); compared with
  ``env_only[2w]`` and ``hand_loop[2w]``, added to the run if ``--splits`` lacks 2.

``--no-thread`` and ``--no-process`` leave out the collector series of that worker
kind (device time is short: one fewer series per repeat).
``--hold-us 150,300`` adds ``hand_loop[Ww+150us]`` and ``hand_loop[Ww+300us]``: the hand
loop holding each batch that much longer between ``recv`` and ``send`` (spinning, as a
busy thread would): how the env's throughput falls with the time its sub-envs wait for
their actions, to set beside the collector's longer cycle.
``--policy noop`` replaces the network by action 0 in every series: what is left is the
cost of moving data, the collector's overhead against the hand loop's. ``--env-nice N``
runs the vector envs' C++ threads at niceness ``N`` in every series, the threads that
drive them (the hand loop's, the collector's) at their own.

The target (issue 5): rlcollect at >= 0.9x ``env_only`` of the same configuration, and
ahead of the hand loop. A collector is timed from ``--warmup`` seconds after its first
batch. Ratios are taken within each repeat, then their median: to ``env_only`` and
``hand_loop`` of the same split, and to the best hand loop of the repeat. Results go to
``--out``/atari_throughput.json, a plot to atari_throughput.png where matplotlib is
importable, and a markdown table to stdout::

    python benchmarks/atari_throughput.py --envs 64 --batch 32 --threads 16 --out DIR
    python benchmarks/atari_throughput.py --envs 8 --batch 4 --threads 2 --seconds 5  # CPU
"""

from __future__ import annotations

import argparse
import functools
import json
import multiprocessing
import os
import re
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine, make_atari_vector, step_vector_env_randomly
from policies import NatureCNN

from rlcollect import AsyncBatchedCollector
from rlcollect.transports import ProcessSlotTransport

FRAME = (84, 84)
DOUBLE_BUFFERS = {"rlcollect[thread-2x]": "thread", "rlcollect[process_slots-2x]": "process_slots"}


def series_names(
    splits: list[int],
    process: bool,
    double_buffer: bool,
    thread: bool = True,
    holds_us: tuple[int, ...] = (),
) -> list[str]:
    names = []
    for w in splits:
        names += [f"env_only[{w}w]", f"hand_loop[{w}w]"]
        names += [f"hand_loop[{w}w+{hold}us]" for hold in holds_us]
        if thread:
            names.append(f"rlcollect[thread-{w}w]")
        if process:
            names.append(f"rlcollect[process_slots-{w}w]")
    if double_buffer:
        if 2 not in splits:  # the double-buffer series' own configuration, for its ratios
            names += ["env_only[2w]", "hand_loop[2w]"]
        kinds = {"thread": thread, "process_slots": process}
        names += [n for n, t in DOUBLE_BUFFERS.items() if kinds[t]]
    return names


def split_of(name: str) -> int:
    """The split ``w`` of a series name: the vector envs its configuration divides the
    envs into (the double-buffer series: 2, in one worker)."""
    found = re.search(r"(\d+)[wx](\+\d+us)?\]$", name)
    return int(found.group(1)) if found else 1


def hold_of(name: str) -> float:
    """Seconds a ``hand_loop[Ww+Nus]`` series holds each batch beyond its own work."""
    found = re.search(r"\+(\d+)us\]$", name)
    return int(found.group(1)) * 1e-6 if found else 0.0


def vector_config(args: argparse.Namespace, w: int) -> tuple[int, int, int]:
    """Sub-envs, batch and threads of each of ``w`` vector envs."""
    return args.envs // w, args.batch // w, max(1, args.threads // w)


def env_only(args: argparse.Namespace, w: int) -> dict[str, float]:
    """``w`` processes, one vector env each, stepped with random actions over one window."""
    n, b, t = vector_config(args, w)
    ctx = multiprocessing.get_context("spawn")
    start = ctx.Barrier(w)
    counts = [ctx.Value("q", 0) for _ in range(w)]
    procs = [
        ctx.Process(
            target=step_vector_env_randomly,
            args=(n, b, t, args.warmup, args.seconds, start, counts[i], args.env_nice),
        )
        for i in range(w)
    ]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(timeout=args.warmup + args.seconds + 120)
        if proc.exitcode != 0:
            raise RuntimeError(f"env_only process exited with {proc.exitcode}")
    return {"fps": sum(c.value for c in counts) * b / args.seconds}


class GraphedStep:
    """The network's action step for ``batch`` observations: a CUDA graph fed from
    page-locked memory on a GPU, the eager module on the CPU."""

    def __init__(self, policy: torch.nn.Module, batch: int, device: torch.device) -> None:
        self.policy = policy
        self.device = device
        if device.type != "cuda":
            return
        shape = (batch, 4, *FRAME)
        self.host_in = torch.empty(shape, dtype=torch.uint8, pin_memory=True)
        self.dev_in = torch.zeros(shape, dtype=torch.uint8, device=device)
        self.host_out = torch.empty(batch, dtype=torch.int64, pin_memory=True)
        stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
        with torch.cuda.stream(stream), torch.inference_mode():
            for _ in range(3):
                policy(self.dev_in)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph, stream=stream):
                self.dev_out = policy(self.dev_in)["action"]
        stream.synchronize()

    def __call__(self, obs: np.ndarray) -> np.ndarray:
        if self.device.type != "cuda":
            with torch.inference_mode():
                out: np.ndarray = self.policy(torch.from_numpy(obs))["action"].numpy()
                return out
        self.host_in.numpy()[...] = obs
        self.dev_in.copy_(self.host_in, non_blocking=True)
        self.graph.replay()
        self.host_out.copy_(self.dev_out, non_blocking=True)
        torch.cuda.current_stream(self.device).synchronize()
        return self.host_out.numpy()


def hand_loop(
    args: argparse.Namespace,
    device: torch.device,
    w: int,
    hold: float = 0.0,
) -> dict[str, float]:
    """One thread visiting ``w`` vector envs in turn: recv, the graphed network, send;
    with ``hold`` (seconds), each batch's actions are sent that much later (a spin)."""
    n, b, t = vector_config(args, w)
    make = functools.partial(make_atari_vector, n, b, t, args.env_nice)
    envs = [make() for _ in range(w)]
    try:
        policy = _policy(envs[0].single_action_space.n, args.policy).to(device)
        act = GraphedStep(policy, b, device)
        for i, env in enumerate(envs):
            obs, _ = env.reset(seed=i)
            env.send(act(obs))

        def step() -> None:
            for env in envs:
                actions = act(env.recv()[0])
                if hold:
                    until = time.perf_counter() + hold
                    while time.perf_counter() < until:
                        pass
                env.send(actions)

        rounds = _timed(step, args.warmup, args.seconds)
    finally:
        for env in envs:
            env.close()
    return {"fps": rounds * w * b / args.seconds}


def collector(
    args: argparse.Namespace,
    device: torch.device,
    transport: str,
    w: int,
    one_worker: bool,
    backend: str = "thread",
) -> dict[str, Any]:
    """``w`` vector envs, one per worker (or all in ``one_worker``, alternating), the
    policy in the collector's ``backend`` (``inference_backend``).

    Besides frames/s, where the CPU goes, per frame over the timed window: the driver
    process, its inference-server thread and, with worker processes, their Python loops
    (each process's main thread) and the whole processes (the env's C++ threads too).
    """
    n, b, t = vector_config(args, w)
    make = functools.partial(make_atari_vector, n, b, t, args.env_nice)
    fns: list[Callable[[], Any]] = [make] * w
    handle: ProcessSlotTransport | str = (
        ProcessSlotTransport() if transport == "process_slots" else transport
    )
    with AsyncBatchedCollector(
        fns,
        _policy(6, args.policy),
        frames_per_batch=args.frames_per_batch,
        total_frames=-1,
        transport=handle,
        envs_per_worker=w if one_worker else 1,
        policy_device=device,
        cuda_graph=device.type == "cuda",
        inference_backend=backend,
    ) as c:
        it = iter(c)
        next(it)
        t_end = time.perf_counter() + args.warmup
        while time.perf_counter() < t_end:
            next(it)
        pids = handle.pids if isinstance(handle, ProcessSlotTransport) else []
        # None with the policy in the workers: there is no server thread
        server_tid = next(
            (th.native_id for th in threading.enumerate() if th.name == "rlcollect-inference"),
            None,
        )
        before = _cpu_seconds(pids, server_tid)
        frames, t0, c0 = 0, time.perf_counter(), time.process_time()
        server0 = c.stats()["server"]
        while time.perf_counter() - t0 < args.seconds:
            frames += next(it).batch_size[0]
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        after = _cpu_seconds(pids, server_tid)
        server = c.stats()["server"]
    rows = server["rows"] - server0["rows"]
    batches = server["batches"] - server0["batches"]
    spent = {k: 1e3 * (after[k] - before[k]) / frames for k in before}
    return {
        "fps": frames / wall,
        "process_cpu_ms_per_frame": 1e3 * cpu / frames,
        "server_thread_cpu_ms_per_frame": spent["server_thread"] if server_tid else None,
        "worker_loop_cpu_ms_per_frame": spent["worker_loops"] if pids else None,
        "worker_process_cpu_ms_per_frame": spent["worker_processes"] if pids else None,
        "mean_batch_size": rows / batches if batches else 0.0,
        "phase_seconds": {
            k: v - server0["phase_seconds"][k] for k, v in server["phase_seconds"].items()
        },
        "request_latency_p50": server["request_latency_p50"],
        "gathers_on_device": server["gathers_on_device"],
    }


def _cpu_seconds(pids: list[int], server_tid: int | None) -> dict[str, float]:
    """CPU seconds so far of the server thread (this process), of each worker process's
    main thread (its Python loop), and of the worker processes whole."""

    def ticks(stat: str) -> float:
        fields = Path(stat).read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime+stime

    return {
        "server_thread": ticks(f"/proc/self/task/{server_tid}/stat") if server_tid else 0.0,
        "worker_loops": sum(ticks(f"/proc/{p}/task/{p}/stat") for p in pids),
        "worker_processes": sum(ticks(f"/proc/{p}/stat") for p in pids),
    }


class NoOp(torch.nn.Module):
    """Action 0 for every observation, as ``{"action": ...}`` like the Nature CNN: what is
    left is the cost of moving data (``--policy noop``)."""

    def forward(self, obs: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"action": torch.zeros(obs.shape[0], dtype=torch.int64, device=obs.device)}


def _policy(num_actions: int, kind: str) -> torch.nn.Module:
    if kind == "noop":
        return NoOp()
    torch.manual_seed(0)
    policy = NatureCNN(num_actions, FRAME)
    policy.requires_grad_(False)
    return policy


def _timed(step: Callable[[], None], warmup: float, seconds: float) -> int:
    """Calls of ``step`` in ``seconds``, after ``warmup`` seconds of calls."""
    t_end = time.perf_counter() + warmup
    while time.perf_counter() < t_end:
        step()
    calls, t_end = 0, time.perf_counter() + seconds
    while time.perf_counter() < t_end:
        step()
        calls += 1
    return calls


def summarize(runs: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    hand_loops = [name for name in runs if name.startswith("hand_loop") and not hold_of(name)]
    out = {}
    for name, reps in runs.items():
        w = split_of(name)
        fps = [r["fps"] for r in reps]
        row: dict[str, Any] = {
            "split": w,
            "fps_median": statistics.median(fps),
            "fps_range": [min(fps), max(fps)],
        }
        for ref in (f"env_only[{w}w]", f"hand_loop[{w}w]"):
            if name != ref and ref in runs:
                ratios = [r["fps"] / b["fps"] for r, b in zip(reps, runs[ref], strict=True)]
                row[f"ratio_to_{ref.split('[')[0]}_median"] = statistics.median(ratios)
        if name.startswith("rlcollect"):
            best = [max(runs[h][i]["fps"] for h in hand_loops) for i in range(len(reps))]
            row["ratio_to_best_hand_loop_median"] = statistics.median(
                r["fps"] / b for r, b in zip(reps, best, strict=True)
            )
            for key in (
                "process_cpu_ms_per_frame",
                "server_thread_cpu_ms_per_frame",
                "worker_loop_cpu_ms_per_frame",
                "worker_process_cpu_ms_per_frame",
                "mean_batch_size",
            ):
                values = [r[key] for r in reps if r.get(key) is not None]
                row[f"{key}_median"] = statistics.median(values) if values else None
        out[name] = row
    return out


def table(summary: dict[str, dict[str, Any]]) -> str:
    """The markdown table; CPU columns in µs per frame (driver process, its server
    thread, the worker processes' Python loops)."""
    lines = [
        "| series | frames/s | range | / env_only | / hand_loop | / best hand loop | mean batch "
        "| driver µs/frame | server | worker loops |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]

    def cell(value: float | None, form: str = ".2f", scale: float = 1.0) -> str:
        return "" if value is None else format(value * scale, form)

    for name, row in summary.items():
        lo, hi = row["fps_range"]
        lines.append(
            f"| `{name}` | {row['fps_median']:,.0f} | {lo:,.0f}-{hi:,.0f} | "
            f"{cell(row.get('ratio_to_env_only_median'))} | "
            f"{cell(row.get('ratio_to_hand_loop_median'))} | "
            f"{cell(row.get('ratio_to_best_hand_loop_median'))} | "
            f"{cell(row.get('mean_batch_size_median'), '.1f')} | "
            f"{cell(row.get('process_cpu_ms_per_frame_median'), '.0f', 1e3)} | "
            f"{cell(row.get('server_thread_cpu_ms_per_frame_median'), '.0f', 1e3)} | "
            f"{cell(row.get('worker_loop_cpu_ms_per_frame_median'), '.0f', 1e3)} |"
        )
    return "\n".join(lines)


def plot(summary: dict[str, dict[str, Any]], config: dict[str, Any], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    names = list(summary)
    fps = [summary[n]["fps_median"] for n in names]
    lo = [summary[n]["fps_median"] - summary[n]["fps_range"][0] for n in names]
    hi = [summary[n]["fps_range"][1] - summary[n]["fps_median"] for n in names]
    fig, ax = plt.subplots(figsize=(11, 5))
    bars = ax.bar(range(len(names)), fps, yerr=[lo, hi], capsize=4, color="#4878a8")
    for bar, name in zip(bars, names, strict=True):
        ratio = summary[name].get("ratio_to_env_only_median")
        if ratio is not None:
            ax.annotate(
                f"{ratio:.2f}x env",
                (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                ha="center",
                va="bottom",
                fontsize=9,
            )
    ax.set_xticks(range(len(names)), [n.replace("rlcollect", "rlc") for n in names])
    ax.set_ylabel("agent steps / s")
    ax.set_title(
        f"Pong 84x84x4, AtariVectorEnv: {config['envs']} envs, batch {config['batch']}, "
        f"{config['threads']} threads in all, split in w; Nature CNN on {config['device']}",
        fontsize=10,
    )
    ax.tick_params(axis="x", labelrotation=30, labelsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--envs", type=int, default=64)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--threads", type=int, default=16)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--warmup", type=float, default=2.0)
    parser.add_argument("--repeats", type=int, default=3)
    # 1024 frames make a 29 MB observation tensor per batch: below glibc's largest mmap
    # threshold (32 MB), so freed batches are reused from the heap instead of every batch
    # faulting in fresh pages.
    parser.add_argument("--frames-per-batch", type=int, default=1024)
    parser.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    parser.add_argument(
        "--policy",
        choices=["nature_cnn", "noop"],
        default="nature_cnn",
        help="noop: action 0, no network; what is left is the cost of moving data",
    )
    parser.add_argument(
        "--env-nice",
        type=int,
        default=0,
        help="niceness of the vector envs' C++ threads in every series (Linux; 0: unchanged)",
    )
    parser.add_argument("--no-process", action="store_true", help="skip the worker-process series")
    parser.add_argument("--no-thread", action="store_true", help="skip the worker-thread series")
    parser.add_argument("--splits", default="1,4", help="vector envs the envs are divided into")
    parser.add_argument(
        "--hold-us",
        default="",
        help="comma-separated microseconds: hand-loop series holding each batch that longer",
    )
    parser.add_argument(
        "--double-buffer",
        action="store_true",
        help=f"add {list(DOUBLE_BUFFERS)} (2 vector envs, 1 worker)",
    )
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = parser.parse_args()
    splits = [int(x) for x in args.splits.split(",")]
    for w in [*splits, *([2] if args.double_buffer else [])]:
        if args.envs % w or args.batch % w or args.batch > args.envs:
            parser.error(f"--envs and --batch must divide by the split {w}, batch <= envs")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cpu":
        torch.set_num_threads(1)  # as the collector's server thread runs a CPU policy

    holds = tuple(int(x) for x in args.hold_us.split(",") if x)
    if any(h <= 0 for h in holds):
        parser.error(f"--hold-us takes positive microseconds, got {args.hold_us!r}")
    names = series_names(splits, not args.no_process, args.double_buffer, not args.no_thread, holds)
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    config = {
        "game": "pong",
        "frame": [4, *FRAME],
        "envs": args.envs,
        "batch": args.batch,
        "threads": args.threads,
        "splits": splits,
        "seconds": args.seconds,
        "warmup": args.warmup,
        "repeats": args.repeats,
        "frames_per_batch": args.frames_per_batch,
        "env_nice": args.env_nice,
        "hold_us": list(holds),
        "device": str(device),
        "cuda_graph": device.type == "cuda",
        "policy": (
            "no-op (action 0)"
            if args.policy == "noop"
            else "Nature CNN (84x84x4), Gumbel-max sampling"
        ),
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    bar = tqdm(total=args.repeats * len(names), desc="series", unit="run")
    for rep in range(args.repeats):
        for name in names:
            bar.set_postfix_str(f"repeat {rep + 1}/{args.repeats}: {name}")
            w = split_of(name)
            if name.startswith("env_only"):
                result = env_only(args, w)
            elif name.startswith("hand_loop"):
                result = hand_loop(args, device, w, hold_of(name))
            elif name in DOUBLE_BUFFERS:
                result = collector(args, device, DOUBLE_BUFFERS[name], 2, one_worker=True)
            else:
                transport = "process_slots" if "process_slots" in name else "thread"
                result = collector(args, device, transport, w, one_worker=False)
            runs[name].append(result)
            bar.update()
            tqdm.write(f"repeat {rep + 1}/{args.repeats}: {name}: {result['fps']:,.0f} frames/s")
        # After every repeat: a run stopped short (a time limit) keeps what it measured.
        summary = write(out, config, runs, device, repeats_done=rep + 1)
    bar.close()
    print()
    print(table(summary))
    drawn = plot(summary, config, out / "atari_throughput.png")
    print(f"\nwritten to {out / 'atari_throughput.json'}" + (" and .png" if drawn else ""))


def write(
    out: Path,
    config: dict[str, Any],
    runs: dict[str, list[dict[str, Any]]],
    device: torch.device,
    repeats_done: int,
) -> dict[str, dict[str, Any]]:
    """Write ``out``/atari_throughput.json with the repeats so far; returns the summary."""

    summary = summarize(runs)
    result = {
        "benchmark": "atari_throughput",
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "machine": machine(),
        "config": config,
        "repeats_done": repeats_done,
        "runs": runs,
        "summary": summary,
    }
    (out / "atari_throughput.json").write_text(json.dumps(result, indent=2) + "\n")
    return summary


if __name__ == "__main__":
    main()
