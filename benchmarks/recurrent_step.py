"""The recurrent action step against the feed-forward step of the same network.

What the server adds for a recurrent policy (``rlcollect/inference/recurrent.py``): per
batch, the host fills the rows to read (each row's env, or the initial state's row
where an episode starts) and to write (each row's env); on the device, one upload of
both, then each state leaf is gathered (``index_select``) and written back
(``index_copy_``). To time only that, both steps run the
same network — an MLP encoder, a GRU cell and an actor head with Gumbel-max sampling, by
default 512 wide (Sample Factory's default encoder and core sizes) —:

``recurrent``
    ``initial_state()`` is a zero hidden state; ``forward(obs, state)`` runs the cell
    from the env's state and returns the new one (the server keeps it).
``feed_forward``
    the same module without ``initial_state()``: ``forward(obs)`` runs the cell from a
    zero hidden state each time (state ignored): the same FLOPs, no state kept.

Each is built by ``build_action_step`` as the collector builds it (eager, compiled,
graphed) and driven as the server drives it: ``load`` (the batch's ring rows) then
``run``, the time of both per batch, median of ``--iters`` after a warm-up; the two
steps take turns batch by batch on the same rows, so the machine's load hits both alike. The ring is
page-locked, so under ``cuda_graph`` a batch is one replay (index upload, gather,
state gather/reset/forward/write-back, outputs down). The target (issue 21): at batch
64 under a CUDA graph, recurrent / feed-forward <= 1.2.

    python benchmarks/recurrent_step.py --out benchmarks/results/h200   # on a GPU
    python benchmarks/recurrent_step.py --device cpu --iters 50        # smoke, eager only

Writes ``recurrent_step_<device>.json`` to ``--out`` (``_stored`` added with
``--store-state``: the recurrent step also returns each row's state, as the collector's
default ``store_recurrent_state=True`` does, which costs a device → host copy of it).
"""

from __future__ import annotations

import argparse
import json
import mmap
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine

from rlcollect.inference import PolicyRunner, build_action_step
from rlcollect.transports import Field

OBS = 64  # observation features (float32)
ACTIONS = 8
# mode: (torch.compile options, CUDA graph)
MODES: dict[str, tuple[dict[str, Any] | None, bool]] = {
    "eager": (None, False),
    "compiled": ({}, False),
    "graph": (None, True),
    "compiled+graph": ({}, True),
}


class Core(torch.nn.Module):
    """MLP encoder + GRU cell + actor head, sampling by Gumbel-max (capturable)."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.hidden = hidden
        self.encoder = torch.nn.Sequential(
            torch.nn.Linear(OBS, hidden),
            torch.nn.ReLU(),
            torch.nn.Linear(hidden, hidden),
            torch.nn.ReLU(),
        )
        self.cell = torch.nn.GRUCell(hidden, hidden)
        self.actor = torch.nn.Linear(hidden, ACTIONS)

    def act(
        self, obs: torch.Tensor, h: torch.Tensor
    ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        h = self.cell(self.encoder(obs), h)
        logits = self.actor(h)
        u = torch.rand_like(logits).clamp_(1e-9, 1.0)
        action = (logits - torch.log(-torch.log(u))).argmax(-1)
        return {"action": action, "logits": logits}, h


class Recurrent(Core):
    def initial_state(self) -> torch.Tensor:
        return torch.zeros(self.hidden)

    def forward(
        self, obs: torch.Tensor, state: torch.Tensor
    ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        return self.act(obs, state)


class FeedForward(Core):
    def forward(self, obs: torch.Tensor) -> dict[str, torch.Tensor]:
        h = torch.zeros(obs.shape[0], self.hidden, device=obs.device)
        return self.act(obs, h)[0]


def build_step(
    recurrent: bool,
    mode: str,
    *,
    device: torch.device,
    hidden: int,
    capacity: int,
    num_envs: int,
    ring: np.ndarray,
    is_init: np.ndarray,
    store: bool,
) -> Any:
    """The action step the collector would build, bound to ``ring`` as the server binds it."""
    compile_options, graph = MODES[mode]
    net = (Recurrent if recurrent else FeedForward)(hidden).to(device)
    runner = PolicyRunner(net, device=device, observation_paths=((),))
    obs = {(): Field(("observation",), (OBS,), np.dtype(np.float32))}
    outputs = {
        ("action",): Field(("action",), (), np.dtype(np.int64)),
        ("logits",): Field(("logits",), (ACTIONS,), np.dtype(np.float32)),
    }
    if recurrent and store:
        outputs[("recurrent_state",)] = Field(("recurrent_state",), (hidden,), np.dtype(np.float32))
    step = build_action_step(
        runner,
        obs,
        outputs,
        capacity=capacity,
        compile_options=compile_options,
        cuda_graph=graph,
        num_envs=num_envs,
        store_recurrent_state=store,  # False: the same outputs as the feed-forward step
        envs_may_repeat=False,  # no worker restarts, as by default
    )
    if step.states is not None:
        step.states.bind(is_init, np.arange(len(ring)) % num_envs)
    step.attach({(): ring})
    return step


def _copy_of(ring: np.ndarray) -> np.ndarray:
    storage = mmap.mmap(-1, ring.nbytes)  # page-aligned, like the ring
    copy = np.frombuffer(storage, dtype=ring.dtype).reshape(ring.shape)
    copy[...] = ring
    return copy


def step_latency(
    mode: str,
    *,
    device: torch.device,
    hidden: int,
    sizes: list[int],
    num_envs: int,
    iters: int,
    store: bool,
) -> dict[str, dict[int, float]]:
    """Median seconds per batch of each step, by batch size. The two steps take turns,
    batch by batch, on the same rows: a change in the machine's load hits both alike."""
    rng = np.random.default_rng(0)
    rows = 2 * num_envs  # ring row r is env r % num_envs (two positions per env)
    storage = mmap.mmap(-1, rows * OBS * 4)  # page-aligned, like the ring
    ring = np.frombuffer(storage, dtype=np.float32).reshape(rows, OBS)
    ring[...] = rng.standard_normal(ring.shape, dtype=np.float32)
    is_init = rng.random(rows) < 0.02  # episodes of ~50 steps
    kinds = {"feed_forward": False, "recurrent": True}
    steps = {
        kind: build_step(
            recurrent,
            mode,
            device=device,
            hidden=hidden,
            capacity=max(sizes),
            num_envs=num_envs,
            # A ring of its own (the same rows): a collector's step page-locks its ring,
            # and one range cannot be page-locked twice.
            ring=_copy_of(ring),
            is_init=is_init,
            store=store,
        )
        for kind, recurrent in kinds.items()
    }
    ring_action = np.zeros(rows, np.int64)
    ring_logits = np.zeros((rows, ACTIONS), np.float32)
    out: dict[str, dict[int, float]] = {kind: {} for kind in kinds}
    for size in sizes:
        times: dict[str, list[float]] = {kind: [] for kind in kinds}
        for i in range(iters + 10):
            envs = rng.permutation(num_envs)[:size]  # distinct envs, as in any batch
            flat = envs + num_envs * rng.integers(0, 2, size)
            for kind, step in steps.items():
                t0 = time.perf_counter()
                n = step.load(flat)
                result, _ = step.run(n)
                ring_action[flat] = result[("action",)]  # the server's scatter, for both
                ring_logits[flat] = result[("logits",)]
                if i >= 10:
                    times[kind].append(time.perf_counter() - t0)
        for kind in kinds:
            out[kind][size] = statistics.median(times[kind])
    for step in steps.values():
        step.close()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--hidden", type=int, default=512, help="encoder and GRU width")
    p.add_argument("--envs", type=int, default=1024, help="envs whose state the server holds")
    p.add_argument("--sizes", default="1,16,64,256", help="batch sizes")
    p.add_argument("--modes", default=None, help="default: every mode the device has")
    p.add_argument("--iters", type=int, default=500)
    # the collector's default (store_recurrent_state=True) also copies each row's state
    # to the host: not part of the step the target is about, measured on request
    p.add_argument("--store-state", action="store_true", help="recurrent_state out too")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = p.parse_args()
    device = torch.device(args.device)
    if device.type != "cuda":
        torch.set_num_threads(1)  # as the server's thread runs on a CPU
    modes = args.modes.split(",") if args.modes else (
        list(MODES) if device.type == "cuda" else ["eager"]
    )  # fmt: skip
    sizes = [int(s) for s in args.sizes.split(",")]
    latency: dict[str, dict[str, dict[int, float]]] = {}
    for mode in modes:
        latency[mode] = step_latency(
            mode,
            device=device,
            hidden=args.hidden,
            sizes=sizes,
            num_envs=args.envs,
            iters=args.iters,
            store=args.store_state,
        )
    ratios = {
        mode: {s: t["recurrent"][s] / t["feed_forward"][s] for s in sizes}
        for mode, t in latency.items()
    }
    target = ratios.get("graph", {}).get(64)
    result = {
        "config": {**{k: str(v) for k, v in vars(args).items()}, "obs": OBS, "actions": ACTIONS},
        "machine": machine(),
        "latency_seconds": latency,
        "recurrent_over_feed_forward": ratios,
        "target": {
            "what": "recurrent / feed-forward step time, batch 64, cuda_graph=True",
            "ratio": target,
            "limit": 1.2,
            "met": None if target is None else target <= 1.2,
        },
    }
    print("| mode | batch | feed-forward (us) | recurrent (us) | ratio |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for mode, t in latency.items():
        for s in sizes:
            ff, rec = t["feed_forward"][s] * 1e6, t["recurrent"][s] * 1e6
            print(f"| {mode} | {s} | {ff:.1f} | {rec:.1f} | {rec / ff:.2f} |")
    args.out.mkdir(parents=True, exist_ok=True)
    suffix = "_stored" if args.store_state else ""
    path = args.out / f"recurrent_step_{device.type}{suffix}.json"
    path.write_text(json.dumps(result, indent=1))
    print(f"written: {path}")


if __name__ == "__main__":
    main()
