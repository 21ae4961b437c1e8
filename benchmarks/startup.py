"""Start-up time by number of envs: rlcollect's worker processes against AsyncVectorEnv.

For each ``--envs`` count, in a fresh process per measurement, Pong 4x105x80 envs:

* ``rlcollect``: ``AsyncBatchedCollector`` (process-slot transport, one env per worker,
  ``frames_per_batch = num_envs``, a policy on ``--device``, as the DQN loop of the
  suite runs it): seconds until the constructor returns (the driver's own share: it
  lays out the ring and starts the worker processes) and until the first batch (the
  workers' interpreters starting, importing and building their envs too), and the
  worker processes started (``ProcessSlotTransport.pids``).
* ``async_vector``: gymnasium's ``AsyncVectorEnv`` over the same factories: seconds until
  its first ``step`` returns.

The driver creates its CUDA context (when ``--device cuda``) before either starts, as
a training script does. Results go to ``--out``/startup.json and a table to stdout::

    python benchmarks/startup.py --envs 16 64 256 --device cuda --out DIR
    python benchmarks/startup.py --envs 4 16            # the CPU, small
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine, make_pong

MARK = "@@startup "


def rlcollect_startup(n: int, device: str) -> dict[str, Any]:
    from rlcollect import AsyncBatchedCollector
    from rlcollect.transports import ProcessSlotTransport

    transport = ProcessSlotTransport()
    policy = Greedy().to(device)  # the CUDA context exists before the collector starts
    t0 = time.perf_counter()
    collector = AsyncBatchedCollector(
        [make_pong] * n,
        policy,
        frames_per_batch=n,
        total_frames=-1,
        transport=transport,
        policy_device=device,
        seed=0,
    )
    constructed = time.perf_counter() - t0
    with collector:
        next(iter(collector))
        first = time.perf_counter() - t0
        workers = len(transport.pids)
    return {"constructor_seconds": constructed, "first_batch_seconds": first, "workers": workers}


class Greedy(torch.nn.Module):
    """uint8 frames in, the argmax of a linear layer out: cheap, so start-up dominates."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(4 * 105 * 80, 6))

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.net(obs.float()).argmax(-1)
        return out


def async_vector_startup(n: int, device: str) -> dict[str, Any]:
    import gymnasium as gym

    if device == "cuda":
        torch.zeros(1, device=device)  # the same driver state as the rlcollect run
    t0 = time.perf_counter()
    envs = gym.vector.AsyncVectorEnv([make_pong] * n)
    try:
        envs.reset(seed=0)
        envs.step(envs.action_space.sample())
        return {"first_step_seconds": time.perf_counter() - t0}
    finally:
        envs.close()


def child(kind: str, n: int, device: str) -> None:
    run = rlcollect_startup if kind == "rlcollect" else async_vector_startup
    print(MARK + json.dumps(run(n, device)), flush=True)


def fresh(kind: str, n: int, device: str) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, __file__, "--child", kind, "--envs", str(n), "--device", device],
        capture_output=True,
        text=True,
        timeout=900,
    )
    for line in done.stdout.splitlines():
        if line.startswith(MARK):
            result: dict[str, Any] = json.loads(line[len(MARK) :])
            return result
    raise RuntimeError(f"{kind} with {n} envs failed:\n{done.stderr[-3000:]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--envs", type=int, nargs="+", default=[4, 16])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--child", choices=["rlcollect", "async_vector"], help=argparse.SUPPRESS)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "startup"))
    args = parser.parse_args()
    if args.child:
        child(args.child, args.envs[0], args.device)
        return
    rows = {}
    for n in args.envs:
        rows[n] = {
            "rlcollect": fresh("rlcollect", n, args.device),
            "async_vector": fresh("async_vector", n, args.device),
        }
        print(f"{n} envs: {rows[n]}", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {
        "benchmark": "startup",
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "machine": machine(),
        "config": {"envs": args.envs, "device": args.device, "env": "Pong 4x105x80"},
        "results": rows,
    }
    (out / "startup.json").write_text(json.dumps(result, indent=2) + "\n")
    print("\n| envs | rlcollect first batch, s | its constructor, s | AsyncVectorEnv, s |")
    print("| ---: | ---: | ---: | ---: |")
    for n, row in rows.items():
        r, a = row["rlcollect"], row["async_vector"]
        print(
            f"| {n} | {r['first_batch_seconds']:.1f} | {r['constructor_seconds']:.2f} | "
            f"{a['first_step_seconds']:.1f} |"
        )


if __name__ == "__main__":
    main()
