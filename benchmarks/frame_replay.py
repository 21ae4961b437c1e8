"""Replay of Atari frame stacks: memory and sample time, each frame stored once or rows.

``ReplayBuffer(capacity, frame_stack=4)`` against ``ReplayBuffer(capacity)`` (rows of
``observation`` and ``("next", "observation")``), on rows as the collector writes them
for Atari: 4 stacked 84x84 uint8 frames and the collector's scalars, ``--envs`` envs
interleaved step by step, episodes of ``--episode-steps`` steps padded with zeros at
their start (as ale-py's ``AtariVectorEnv``), written ``--batch`` rows at a time.

1. Memory: the bytes per transition laid out for ``--full-capacity`` transitions (the
   tensors allocated, not filled), against one frame and its scalars; the row buffer's
   from its layout at ``--capacity`` (it is linear in capacity).
2. With ``--fill-full``: the frame buffer of ``--full-capacity`` filled, the process's
   resident memory, and its sample times.
3. Sample time: both buffers filled with the same batches at ``--capacity`` (the largest
   both fit here: a row takes 56 KB), seeded alike so that they sample the same rows
   (checked equal, bit for bit). ``sample(32)`` and ``sample(256)`` timed in
   ``--rounds`` rounds, the buffers in turn (the order reversed every other round),
   ``--seconds`` each; each round's ratio, their median and range. Beside them the
   frame buffer gathering its two stacks apart, ``k`` frames each into two tensors of
   their own (as rows hold them), where the buffer gathers each row's ``k + 1`` frames
   once and returns two views. The time of ``extend`` per batch too.

    python benchmarks/frame_replay.py --out benchmarks/results          # about 5 minutes
    python benchmarks/frame_replay.py --fill-full --out benchmarks/results  # 8 GB more
    python benchmarks/frame_replay.py --device cuda --capacity 1000000 --fill-full \
        --out benchmarks/results/h100          # a GPU host: 56 GB of rows on an H100
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import types
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine

from rlcollect import ReplayBuffer

K, SIDE = 4, 84
FRAME_BYTES = SIDE * SIDE


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--capacity", type=int, default=100_000, help="both buffers, compared")
    p.add_argument("--full-capacity", type=int, default=1_000_000, help="frames only")
    p.add_argument("--fill-full", action="store_true", help="fill the full frame buffer")
    p.add_argument("--envs", type=int, default=16)
    p.add_argument("--episode-steps", type=int, default=1000)
    p.add_argument("--batch", type=int, default=1024, help="rows per extend")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--seconds", type=float, default=0.3, help="per buffer, size and round")
    p.add_argument("--threads", type=int, default=1, help="torch threads (the learner's)")
    p.add_argument("--device", default="cpu", help="the buffers' storage: cpu or cuda")
    p.add_argument("--out", type=Path, default=None)
    return p.parse_args()


class AtariRows:
    """Rows as the collector writes them: ``envs`` envs stepped in turn, each row's
    stacks the env's last 4 frames (zeros before an episode's first), random frames."""

    def __init__(self, envs: int, episode_steps: int, seed: int = 0) -> None:
        self.rng = np.random.default_rng(seed)
        self.pool = self.rng.integers(0, 256, (4096, SIDE, SIDE), dtype=np.uint8)
        self.envs, self.episode_steps = envs, episode_steps
        self.stacks = np.zeros((envs, K, SIDE, SIDE), np.uint8)
        self.stacks[:, -1] = self.frames(envs)
        self.episode = np.zeros(envs, np.int64)
        self.step = np.zeros(envs, np.int64)
        self.version = 0

    def frames(self, n: int) -> np.ndarray:
        return self.pool[self.rng.integers(0, len(self.pool), n)]

    def batch(self, rows: int) -> TensorDict:
        """``rows`` rows (a multiple of ``envs``): every env steps ``rows / envs`` times."""
        obs, nxt, episode, step = [], [], [], []
        for _ in range(rows // self.envs):
            after = np.concatenate([self.stacks[:, 1:], self.frames(self.envs)[:, None]], 1)
            obs.append(self.stacks)
            nxt.append(after)
            episode.append(self.episode.copy())
            step.append(self.step.copy())
            done = self.step + 1 >= self.episode_steps
            self.step = np.where(done, 0, self.step + 1)
            self.episode += done
            self.stacks = after.copy()
            self.stacks[done] = 0  # the next episode's first stack: zeros, then its frame
            self.stacks[done, -1] = self.frames(int(done.sum()))
        self.version += 1
        n = rows // self.envs * self.envs
        s = torch.from_numpy(np.concatenate(step))
        z = torch.zeros(n, dtype=torch.bool)
        return TensorDict(
            {
                "observation": torch.from_numpy(np.concatenate(obs)),
                ("next", "observation"): torch.from_numpy(np.concatenate(nxt)),
                "env_index": torch.arange(self.envs).repeat(rows // self.envs),
                "episode": torch.from_numpy(np.concatenate(episode)),
                "step": s,
                "action": s % 6,
                "policy_version": torch.full((n,), self.version),
                ("next", "reward"): torch.zeros(n),
                ("next", "terminated"): s + 1 >= self.episode_steps,
                ("next", "truncated"): z,
                ("next", "done"): s + 1 >= self.episode_steps,
                ("next", "episode_return"): torch.zeros(n),
                ("next", "episode_length"): s + 1,
            },
            batch_size=[n],
        )


def scalar_bytes(batch: TensorDict) -> int:
    """Bytes of one row's fields other than the two stacks."""
    stacks = {"observation", ("next", "observation")}
    leaves = batch[:1].items(include_nested=True, leaves_only=True)
    return sum(v.numel() * v.element_size() for k, v in leaves if k not in stacks)


def resident_bytes() -> int:
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith("VmRSS:"))
    return int(line.split()[1]) * 1024


def memory(args: argparse.Namespace, one: TensorDict) -> dict[str, Any]:
    """Bytes per transition, laid out and not filled."""
    frames = ReplayBuffer(args.full_capacity, frame_stack=K, device=args.device)
    frames.extend(one)
    rows = ReplayBuffer(args.capacity, device=args.device)
    rows.extend(one)
    scalars = scalar_bytes(one)
    per_frame_row = frames.nbytes / args.full_capacity
    per_row = rows.nbytes / args.capacity
    del frames, rows
    return {
        "capacity": args.full_capacity,
        "frame_bytes": FRAME_BYTES,
        "scalar_bytes": scalars,
        "frame_stack_bytes_per_transition": per_frame_row,
        "frame_stack_total_gb": per_frame_row * args.full_capacity / 1e9,
        "ratio_to_one_frame_and_scalars": per_frame_row / (FRAME_BYTES + scalars),
        "rows_bytes_per_transition": per_row,
        "rows_total_gb": per_row * args.full_capacity / 1e9,
    }


def fill(buffers: list[ReplayBuffer], source: AtariRows, rows: int, batch: int) -> list[float]:
    """Write ``rows`` rows into every buffer, batch by batch; each buffer's seconds of
    ``extend`` per batch (their median)."""
    seconds: list[list[float]] = [[] for _ in buffers]
    for _ in range(max(1, rows // batch)):
        data = source.batch(batch)
        for i, buffer in enumerate(buffers):
            start = time.perf_counter()
            buffer.extend(data)
            seconds[i].append(time.perf_counter() - start)
    return [statistics.median(s) for s in seconds]


def timed(buffer: ReplayBuffer, size: int, seconds: float) -> float:
    """Microseconds per ``sample(size)`` over about ``seconds`` (on CUDA, to the end of
    the last gather)."""
    cuda = buffer.device.type == "cuda"
    calls, start = 0, time.perf_counter()
    while True:
        buffer.sample(size)
        calls += 1
        if cuda:
            torch.cuda.synchronize(buffer.device)
        elapsed = time.perf_counter() - start
        if elapsed >= seconds:
            return elapsed / calls * 1e6


def gather_apart(store: Any, positions: torch.Tensor, empty: Any) -> tuple:
    """The alternative to ``FrameStore.gather``: each stack gathered into a tensor of its
    own, ``k`` frames each (``2k`` frames read per row, contiguous stacks)."""
    table, n = store.table.index_select(0, positions), len(positions)
    out = []
    for cols in (0, 1):
        index = table[:, cols : cols + K].reshape(-1)
        got = torch.index_select(store.frames, 0, index, out=empty(n * K, store.frames))
        out.append(got.view(n, K, SIDE, SIDE))
    return out[0], out[1]


def compare(args: argparse.Namespace, frames: ReplayBuffer, rows: ReplayBuffer) -> dict:
    """Paired rounds of sample(n), the buffers in turn; per size the medians and ratios.
    ``frame_stack_apart``: the frame buffer with ``gather_apart`` (sampling on its own
    generator's next rows: the same rows as the others' only by distribution)."""
    apart = ReplayBuffer(args.capacity, frame_stack=K, seed=8, device=args.device)
    apart.load_state_dict(frames.state_dict())
    store = apart._frames
    store.gather = types.MethodType(gather_apart, store)
    out = {}
    for size in (32, 256):
        runs = [("frame_stack", frames), ("frame_stack_apart", apart), ("rows", rows)]
        times: dict[str, list[float]] = {name: [] for name, _ in runs}
        for r in range(args.rounds):
            for name, buffer in runs if r % 2 == 0 else runs[::-1]:
                times[name].append(timed(buffer, size, args.seconds))
        out[str(size)] = {"rounds": args.rounds}
        for name in ("frame_stack", "frame_stack_apart", "rows"):
            out[str(size)][f"{name}_us_median"] = statistics.median(times[name])
        for name in ("frame_stack", "frame_stack_apart"):
            ratios = [a / b for a, b in zip(times[name], times["rows"], strict=True)]
            out[str(size)][f"{name}_ratio"] = {
                "median": statistics.median(ratios),
                "min": min(ratios),
                "max": max(ratios),
            }
    return out


def same_rows(frames: ReplayBuffer, rows: ReplayBuffer) -> bool:
    """With one seed and one window, both sample the same rows, stacks equal bit for bit."""
    if len(frames) != len(rows):
        return False
    a, b = frames.sample(256), rows.sample(256)
    keys = ("observation", ("next", "observation"), "env_index", "step")
    return all(torch.equal(a[key], b[key]) for key in keys)


def full_fill(args: argparse.Namespace) -> dict[str, Any]:
    """The frame buffer of ``--full-capacity`` filled: resident memory and sample times."""
    before = resident_bytes()
    buffer = ReplayBuffer(args.full_capacity, frame_stack=K, seed=0, device=args.device)
    start = time.perf_counter()
    (extend,) = fill([buffer], AtariRows(args.envs, args.episode_steps, seed=1),
                     args.full_capacity + args.batch, args.batch)  # fmt: skip
    seconds = time.perf_counter() - start
    grown = resident_bytes() - before
    samples = {str(n): statistics.median(timed(buffer, n, args.seconds) for _ in range(5))
               for n in (32, 256)}  # fmt: skip
    return {
        "capacity": args.full_capacity,
        "len": len(buffer),
        "nbytes_gb": buffer.nbytes / 1e9,
        "resident_growth_gb": grown / 1e9,
        "fill_seconds": seconds,
        "extend_ms_median": extend * 1e3,
        "sample_us_median": samples,
    }


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    source = AtariRows(args.envs, args.episode_steps)
    result: dict[str, Any] = {"config": vars(args) | {"out": str(args.out)}}
    result["machine"] = machine()
    result["memory"] = memory(args, source.batch(args.envs))
    frames = ReplayBuffer(args.capacity, frame_stack=K, seed=7, device=args.device)
    rows = ReplayBuffer(args.capacity, seed=7, device=args.device)
    extend = fill([frames, rows], source, args.capacity + args.batch, args.batch)
    result["extend_ms_median"] = {"frame_stack": extend[0] * 1e3, "rows": extend[1] * 1e3}
    result["len"] = {"frame_stack": len(frames), "rows": len(rows)}
    result["same_rows"] = same_rows(frames, rows)
    result["sample"] = compare(args, frames, rows)
    del frames, rows
    if args.fill_full:
        result["full"] = full_fill(args)
    report(result)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "frame_replay.json").write_text(json.dumps(result, indent=2))


def report(result: dict[str, Any]) -> None:
    m, cap = result["memory"], result["config"]["capacity"]
    print(
        f"memory at {m['capacity']:,} transitions: frame_stack "
        f"{m['frame_stack_bytes_per_transition']:.0f} B each ({m['frame_stack_total_gb']:.2f} GB"
        f", {m['ratio_to_one_frame_and_scalars']:.3f} x one frame and its {m['scalar_bytes']} "
        f"B of scalars); rows {m['rows_bytes_per_transition']:.0f} B ({m['rows_total_gb']:.1f} GB)"
    )
    print(f"filled to {cap:,}: len {result['len']}, same rows sampled: {result['same_rows']}")
    print(f"extend of {result['config']['batch']} rows (ms): {result['extend_ms_median']}")
    print("| sample(n) | buffer | us (median) | / rows: median | range |")
    print("| --- | --- | --- | --- | --- |")
    for n, s in result["sample"].items():
        print(f"| {n} | rows | {s['rows_us_median']:.0f} | 1 | |")
        for name in ("frame_stack", "frame_stack_apart"):
            r = s[f"{name}_ratio"]
            print(
                f"| {n} | {name} | {s[f'{name}_us_median']:.0f} | {r['median']:.2f} | "
                f"{r['min']:.2f}-{r['max']:.2f} |"
            )
    if "full" in result:
        print(f"full: {json.dumps(result['full'])}")


if __name__ == "__main__":
    main()
