"""A native vector env's start-up: the collector's first batch against the env alone.

Issue 59 (item 2) and issue 63 (item 3) ask for a vector env's first batch within 1.5x
the env alone's first step. Each measurement runs in a fresh process, with torch
imported and the policy built before the clock starts (as a training script has them):

* ``env``: the vector env alone: built, reset, one step (``send``/``recv`` of one
  batch where driven asynchronously): seconds until that step returns.
* ``collector`` with each source tree named by ``--tree NAME=SRC`` (``src/`` of a
  checkout; the default is this one's): ``AsyncBatchedCollector`` with the defaults
  (every layout knob ``"auto"``), ``frames_per_batch`` one batch of the env, a tiny
  policy on ``--device``: seconds until its first batch, and until its constructor
  returned.

The rows alternate within each repeat, in an order rotated repeat by repeat; a
repeat's ratios divide each collector's time by the env's of the same repeat, and the
medians over the repeats are reported. Workloads (``--workload``):

* ``atari``: ale-py's ``AtariVectorEnv`` Pong (84x84 grayscale, 4 stacked frames),
  ``--envs`` games, ``--batch`` per ``recv``, ``--threads`` threads
  (``common.make_atari_vector``, annotated to return a ``VectorEnv``).
* ``slow``: a gymnasium ``SyncVectorEnv`` of ``--envs`` CartPole envs whose
  constructor takes ``--build-seconds`` more (a sleep: a stand-in for an env that
  loads assets), stepped whole.

Results go to ``--out`` (JSON) and a table to stdout. For example::

    git archive eeef3eb src | tar -x -C /tmp/before    # the tree before the change
    python benchmarks/vector_startup.py --workload atari --envs 8 --batch 4 \\
        --tree before=/tmp/before/src --tree after=src --repeats 5
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import gymnasium as gym

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from common import machine, make_atari_vector  # noqa: E402

MARK = "@@vector_startup "


class _SlowCartPole(gym.vector.SyncVectorEnv):
    """``n`` CartPole envs, stepped whole, whose construction takes ``seconds`` more."""

    def __init__(self, n: int, seconds: float) -> None:
        time.sleep(seconds)  # a benchmark's stand-in for loading assets
        super().__init__([functools.partial(gym.make, "CartPole-v1")] * n)


def factory(args: argparse.Namespace) -> Any:
    if args.workload == "atari":
        return functools.partial(make_atari_vector, args.envs, args.batch, args.threads)
    return functools.partial(_SlowCartPole, args.envs, args.build_seconds)


def policy(args: argparse.Namespace) -> Any:
    import torch

    shape = (4, 84, 84) if args.workload == "atari" else (4,)
    actions = 6 if args.workload == "atari" else 2
    size = 1
    for d in shape:
        size *= d
    net = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(size, actions))

    class Greedy(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = net

        def forward(self, obs: torch.Tensor) -> torch.Tensor:
            out: torch.Tensor = self.net(obs.float()).argmax(-1)
            return out

    return Greedy().to(args.device)


def env_alone(args: argparse.Namespace) -> dict[str, float]:
    import torch  # noqa: F401 (the same driver state as the collector's run)

    policy(args)
    fn = factory(args)
    t0 = time.perf_counter()
    env = fn()
    built = time.perf_counter() - t0
    try:
        env.reset(seed=0)
        actions = env.action_space.sample()
        if getattr(env, "batch_size", env.num_envs) < env.num_envs:
            env.send(actions[: env.batch_size])
            env.recv()
        else:
            env.step(actions)
        return {"first_step_seconds": time.perf_counter() - t0, "build_seconds": built}
    finally:
        env.close()


def collector(args: argparse.Namespace) -> dict[str, Any]:
    from rlcollect import AsyncBatchedCollector

    served = policy(args)
    fn = factory(args)
    batch = args.batch if args.workload == "atari" else args.envs
    t0 = time.perf_counter()
    c = AsyncBatchedCollector(
        [fn], served, frames_per_batch=batch, total_frames=-1, policy_device=args.device
    )
    constructed = time.perf_counter() - t0
    with c:
        next(iter(c))
        first = time.perf_counter() - t0
        layout = c.describe().arguments()
    return {"first_batch_seconds": first, "constructor_seconds": constructed, "layout": layout}


def fresh(kind: str, src: str | None, argv: list[str]) -> dict[str, Any]:
    env = dict(os.environ)
    if src is not None:
        # The tree's src first; whatever else the path held stays (installed packages
        # in a --target directory, say), except this checkout's own src.
        own = (HERE.parent / "src").resolve()
        kept = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
        kept = [p for p in kept if Path(p).resolve() != own]
        env["PYTHONPATH"] = os.pathsep.join([str(Path(src).resolve()), str(HERE), *kept])
    done = subprocess.run(
        [sys.executable, __file__, "--child", kind, *argv],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    for line in done.stdout.splitlines():
        if line.startswith(MARK):
            result: dict[str, Any] = json.loads(line[len(MARK) :])
            return result
    raise RuntimeError(f"{kind} failed:\n{done.stderr[-3000:]}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workload", choices=["atari", "slow"], default="atari")
    p.add_argument("--envs", type=int, default=8)
    p.add_argument("--batch", type=int, default=4, help="atari: games per recv")
    p.add_argument("--threads", type=int, default=2, help="atari: the env's threads")
    p.add_argument("--build-seconds", type=float, default=2.0, help="slow: added build time")
    p.add_argument("--device", default="cpu")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--tree", action="append", default=[], help="NAME=SRC, repeatable")
    p.add_argument("--out", default=str(HERE / "results" / "vector_startup.json"))
    p.add_argument("--child", choices=["env", "collector"], help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        run = env_alone if args.child == "env" else collector
        print(MARK + json.dumps(run(args)), flush=True)
        return
    argv = [
        *("--workload", args.workload, "--envs", str(args.envs), "--batch", str(args.batch)),
        *("--threads", str(args.threads), "--build-seconds", str(args.build_seconds)),
        *("--device", args.device),
    ]
    trees = dict(t.split("=", 1) for t in args.tree) or {"this": str(HERE.parent / "src")}
    rows = [("env", None), *trees.items()]
    repeats: list[dict[str, Any]] = []
    for r in range(args.repeats):
        order = rows[r % len(rows) :] + rows[: r % len(rows)]
        got = {}
        for name, src in order:
            got[name] = fresh("env" if src is None else "collector", src, argv)
        alone = got["env"]["first_step_seconds"]
        for name in trees:
            got[name]["ratio"] = got[name]["first_batch_seconds"] / alone
        repeats.append(got)
        print(json.dumps({k: v for k, v in got.items()}, default=str), flush=True)
    summary: dict[str, Any] = {
        "env_first_step_seconds": statistics.median(
            g["env"]["first_step_seconds"] for g in repeats
        ),
        "env_build_seconds": statistics.median(g["env"]["build_seconds"] for g in repeats),
    }
    for name in trees:
        summary[name] = {
            "first_batch_seconds": statistics.median(
                g[name]["first_batch_seconds"] for g in repeats
            ),
            "constructor_seconds": statistics.median(
                g[name]["constructor_seconds"] for g in repeats
            ),
            "ratio_to_env": statistics.median(g[name]["ratio"] for g in repeats),
            "ratio_range": [
                min(g[name]["ratio"] for g in repeats),
                max(g[name]["ratio"] for g in repeats),
            ],
            "layout": repeats[-1][name]["layout"],
        }
    result = {
        "benchmark": "vector_startup",
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "machine": machine(),
        "config": {k: v for k, v in vars(args).items() if k not in ("child", "out")},
        "summary": summary,
        "repeats": repeats,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(
        f"\nenv alone: first step {summary['env_first_step_seconds']:.2f} s (built in "
        f"{summary['env_build_seconds']:.2f} s); medians of {args.repeats}"
    )
    print("| tree | first batch, s | constructor, s | first batch / env's first step |")
    print("| --- | ---: | ---: | ---: |")
    for name in trees:
        s = summary[name]
        lo, hi = s["ratio_range"]
        print(
            f"| {name} | {s['first_batch_seconds']:.2f} | {s['constructor_seconds']:.2f} | "
            f"{s['ratio_to_env']:.2f} [{lo:.2f}-{hi:.2f}] |"
        )


if __name__ == "__main__":
    main()
