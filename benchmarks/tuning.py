"""Tuning sweep: the measured effect of each collector knob, one knob at a time.

Each series varies one argument of ``AsyncBatchedCollector`` around a base layout and
keeps everything else fixed; the points of a series run interleaved, each in a fresh
process, ``--repeats`` times (the suite's runner: ``benchmarks/suite/runner.py``), so a
point's median and range come from one stretch of the machine. A run is timed with the
suite's protocol (``benchmarks/suite/measure.py``): start-up until the first batch, a
warm-up, then a fixed window.

Base: CartPole-v1, the small MLP policy of the CPU benchmarks (it samples its actions)
on the CPU, process-slot workers, ``frames_per_batch=512``. The ``pong`` series use the
pixel task of the suite (Pong 4x105x80 uint8 and its small CNN, ``frames_per_batch =
16 x num_envs``).

    python -m benchmarks.tuning                    # about 10 minutes on 2 cores
    python -m benchmarks.tuning --quick            # every series, tiny budgets, 1 repeat
    python -m benchmarks.tuning --series chunk     # a subset
    python -m benchmarks.tuning --tables benchmarks/results/tuning   # Markdown tables

Results: ``benchmarks/results/tuning/<series>.json`` (``--quick``: under ``build/``).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from benchmarks.suite.environment import ROOT
from benchmarks.suite.plans import Series

RESULTS = ROOT / "benchmarks" / "results" / "tuning"
BASE: dict[str, Any] = {
    "kind": "tuning",
    "env": "cartpole",
    "num_envs": 4,
    "frames_per_batch": 512,
    "transport": "process_slots",
    "envs_per_worker": 1,
    "worker_splits": None,
    "transition_chunk_size": "auto",
    "max_batch_size": None,
    "min_batch_size": 1,
    "batch_timeout": 1e-3,
    "inference_backend": "thread",
    "warmup_s": 0.5,
    "measure_s": 2.0,
}
# Collector arguments a run's configuration passes on as they are.
_ARGS = (
    "frames_per_batch",
    "transport",
    "envs_per_worker",
    "worker_splits",
    "transition_chunk_size",
    "max_batch_size",
    "min_batch_size",
    "batch_timeout",
    "inference_backend",
)


def run(config: dict[str, Any]) -> dict[str, Any]:
    """One point, in this (fresh) process: the collector timed by the suite's protocol."""
    from benchmarks.common import ENVS
    from benchmarks.policies import policy_for
    from benchmarks.suite.acting import acting_policy
    from benchmarks.suite.measure import measure_collector
    from rlcollect import AsyncBatchedCollector

    env = config["env"]
    policy = policy_for("cartpole") if env == "cartpole" else acting_policy("small_cnn")
    return measure_collector(
        lambda: AsyncBatchedCollector(
            [ENVS[env]] * config["num_envs"],
            policy,
            total_frames=-1,
            policy_device="cpu",
            seed=0,
            **{name: config[name] for name in _ARGS},
        ),
        config["warmup_s"],
        config["measure_s"],
    )


def _point(**changes: Any) -> dict[str, Any]:
    config = {**BASE, **changes}
    unknown = set(changes) - set(BASE)
    if unknown:
        raise ValueError(f"unknown tuning keys {sorted(unknown)}")
    return config


def _pong(**changes: Any) -> dict[str, Any]:
    n = changes.get("num_envs", 4)
    return _point(env="pong", frames_per_batch=16 * n, **changes)


def plan() -> dict[str, Series]:
    """Every series of the sweep: name -> runs (label -> configuration)."""
    common = (
        "CartPole-v1 unless the run's name says pong; MLP 4-64-64-2 sampling policy on the "
        "CPU (pong: the suite's small CNN); process_slots, frames_per_batch=512 unless "
        "varied; every other argument at its default.",
    )
    series = [
        Series(
            "num_envs",
            "num_envs (one env per worker process)",
            {f"num_envs={n}": _point(num_envs=n) for n in (1, 2, 4, 8, 16)},
            notes=common,
        ),
        Series(
            "envs_per_worker",
            "envs_per_worker at 16 envs",
            {
                f"envs_per_worker={k}": _point(num_envs=16, envs_per_worker=k)
                for k in (1, 2, 4, 8, 16)
            },
            notes=common,
        ),
        Series(
            "worker_splits",
            "worker_splits at 8 envs, 4 per worker",
            {
                f"worker_splits={s}": _point(num_envs=8, envs_per_worker=4, worker_splits=s)
                for s in (1, 2, 4)
            },
            notes=common,
        ),
        Series(
            "chunk",
            "transition_chunk_size at 4 envs (auto resolves to 64)",
            {
                f"transition_chunk_size={c}": _point(transition_chunk_size=c)
                for c in (1, 4, 16, 64, 256)
            },
            notes=common,
        ),
        Series(
            "batch",
            "max_batch_size, min_batch_size and batch_timeout at 8 envs",
            {
                "max=8 (default),min=1": _point(num_envs=8),
                "max=1": _point(num_envs=8, max_batch_size=1),
                "max=4": _point(num_envs=8, max_batch_size=4),
                "min=4,timeout=1ms": _point(num_envs=8, min_batch_size=4),
                "min=8,timeout=1ms": _point(num_envs=8, min_batch_size=8),
                "min=8,timeout=0.1ms": _point(num_envs=8, min_batch_size=8, batch_timeout=1e-4),
                "min=8,timeout=10ms": _point(num_envs=8, min_batch_size=8, batch_timeout=1e-2),
            },
            notes=common,
        ),
        Series(
            "transport",
            "transport and inference_backend at 4 envs",
            {
                "thread": _point(transport="thread"),
                "process_slots": _point(),
                "process_slots,inference_backend=process": _point(inference_backend="process"),
                "pong,thread": _pong(transport="thread"),
                "pong,process_slots": _pong(),
                "pong,process_slots,inference_backend=process": _pong(inference_backend="process"),
            },
            notes=common,
        ),
    ]
    return {s.name: s for s in series}


def _quick(series: Series) -> Series:
    runs = {
        name: {**config, "warmup_s": 0.1, "measure_s": 0.3, "num_envs": min(config["num_envs"], 4)}
        for name, config in list(series.runs.items())[:2]
    }
    for config in runs.values():  # keep the layouts valid at the smaller size
        config["envs_per_worker"] = min(config["envs_per_worker"], config["num_envs"])
        if config["worker_splits"] is not None:
            config["worker_splits"] = min(config["worker_splits"], config["envs_per_worker"])
    return Series(series.name, series.title, runs, series.ratios, series.notes)


def tables(results: Path) -> str:
    """Markdown tables of every series JSON under ``results``: medians over the repeats
    and the frames/s range, as the tuning guide quotes them."""
    import json
    import statistics

    out = []
    for name in plan():
        path = results.resolve() / f"{name}.json"
        if not path.exists():
            continue
        doc = json.loads(path.read_text())
        load = doc["environment"]["loadavg_at_start"][0], doc["loadavg_at_end"][0]
        out += [
            f"**{doc['title']}** ({doc['repeats']} repeats, load average {load[0]:.1f} → "
            f"{load[1]:.1f}, `{path.relative_to(ROOT)}`)",
            "",
            "| run | frames/s | range | driver CPU ms/frame | mean inference batch "
            "| request p50 µs | start-up s | others' CPU share |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        for run_name, row in doc["summary"].items():
            ok = [r for r in doc["runs"][run_name] if "error" not in r]
            fps = row["frames_per_second"]
            p50 = statistics.median(r["request_latency_p50"] for r in ok) * 1e6
            others = statistics.median(r["other_cpu_share"] for r in ok)
            out.append(
                f"| `{run_name}` | {fps['median']:,.0f} | {fps['range'][0]:,.0f}\u2013"
                f"{fps['range'][1]:,.0f} | {row['driver_cpu_ms_per_frame']['median']:.3f} | "
                f"{row['mean_batch_size']['median']:.1f} | {p50:.0f} | "
                f"{row['startup_seconds']['median']:.2f} | {others:.0%} |"
            )
        out.append("")
    return "\n".join(out)


def main() -> None:
    from benchmarks.suite.runner import run_series

    series = plan()
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.tuning", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--series", nargs="+", choices=list(series), default=list(series))
    parser.add_argument("--repeats", type=int, help="fresh-process repeats (default 3)")
    parser.add_argument("--quick", action="store_true", help="two points a series, tiny windows")
    parser.add_argument("--out", help=f"directory for the JSON (default {RESULTS})")
    parser.add_argument(
        "--tables", metavar="DIR", help="print the Markdown tables of DIR's JSON; run nothing"
    )
    args = parser.parse_args()
    if args.tables:
        print(tables(Path(args.tables)))
        return
    repeats = args.repeats or (1 if args.quick else 3)
    default_out = ROOT / "build" / "tuning_quick" if args.quick else RESULTS
    out = Path(args.out) if args.out else default_out
    started = time.monotonic()
    for name in args.series:
        s = _quick(series[name]) if args.quick else series[name]
        path = run_series(
            s, suite="tuning", repeats=repeats, out_dir=out, peers_path=None, deadline=None
        )
        print(f"wrote {path}", flush=True)
    print(f"tuning sweep done in {time.monotonic() - started:.0f} s", flush=True)


if __name__ == "__main__":
    main()
