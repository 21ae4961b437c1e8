"""The one-call GPU check's summary (``benchmarks/check.py``): one table of the parts,
one of the ratios (medians of the repeats, ratios paired within a repeat), one of the
rows' frames/s, with the commit measured; written to ``summary.md`` and
``gpu_check.json`` and printed."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

ORDER = ("install", "tests", "rows", "ppo", "replay")


def _environment() -> dict[str, Any]:
    """The machine and the commit (``RLCOLLECT_BENCH_COMMIT`` where the tree has no git)."""
    try:
        from benchmarks.suite.environment import environment

        return environment(None)
    except Exception as error:  # the summary is written whatever broke before it
        return {"error": f"{type(error).__name__}: {error}"}


def _result_line(name: str, part: dict[str, Any]) -> str:
    """One cell: what the part found, in words."""
    result = part.get("result")
    if part.get("why"):
        return str(part["why"])
    if result is None:
        return "no result (see its log)"
    if name == "tests":
        return str(result["summary_line"])
    if name == "rows":
        counts = [len(runs) for runs in result["runs"].values()]
        done = f"{min(counts, default=0)}-{max(counts, default=0)}"
        return f"{len(counts)} runs, {done} of {result['repeats']} repeats each"
    if name == "ppo":
        s = result["summary"]
        return (
            f"{s['steps_per_second_after_first_rollout']:,.0f} steps/s after the first "
            f"rollout ({s['steps_per_second']:,.0f} with start-up, {s['startup_seconds']:.1f} s "
            f"of it); {s['env_steps']:,} steps in {s['wall_seconds']:.0f} s on {s['device']}; "
            f"mean return {_mean_return(s)}"
        )
    if name == "replay":
        sample = result.get("sample", {})
        ratios = ", ".join(
            f"sample({n}) {s['frame_stack_ratio']['median']:.2f}x" for n, s in sample.items()
        )
        return (
            f"frame_stack / rows at {result['config']['capacity']:,} on "
            f"{result['config']['device']}: {ratios}; same rows: {result.get('same_rows')}"
        )
    return ""


def _mean_return(summary: dict[str, Any]) -> str:
    values = [v for k, v in summary.items() if k.startswith("mean_return_last_")]
    return "none yet" if not values or values[0] is None else f"{values[0]:.1f}"


def _ratio_rows(doc: dict[str, Any]) -> list[str]:
    rows = ["| workload | ratio | median | range | repeats |", "| --- | --- | ---: | --- | ---: |"]
    order = [name.split("[", 1)[1] for name in doc.get("runs", {})]  # the workloads in turn
    ratios = sorted(
        doc.get("ratios", {}).values(), key=lambda r: order.index(r["numerator"].split("[", 1)[1])
    )
    for ratio in ratios:
        top, bottom = ratio["numerator"], ratio["denominator"]
        kind_top, workload = top.split("[", 1)
        kind_bottom, other = bottom.split("[", 1)
        name = kind_bottom if other == workload else bottom
        low, high = ratio["range"]
        rows.append(
            f"| {workload.rstrip(']')} | {kind_top} / {name} | {ratio['median']:.2f} | "
            f"{low:.2f}-{high:.2f} | {len(ratio['per_repeat'])} |"
        )
    return rows


def _frame_rows(doc: dict[str, Any]) -> list[str]:
    rows = [
        "| run | frames/s (median) | range | repeats | layout (rule) |",
        "| --- | ---: | --- | ---: | --- |",
    ]
    for name, row in doc.get("summary", {}).items():
        fps = row.get("frames_per_second")
        runs = [r for r in doc["runs"][name] if "error" not in r]
        chosen = ""
        if runs and runs[-1].get("layout"):
            layout = ", ".join(f"{k}={v}" for k, v in runs[-1]["layout"].items())
            chosen = f"{layout} ({runs[-1].get('rule')})"
        if fps is None:
            errors = [r["error"] for r in doc["runs"][name] if "error" in r]
            why = "; ".join(errors)[:120] or "not reached within the part's budget"
            rows.append(f"| {name} | - | - | 0 | {why} |")
            continue
        low, high = fps["range"]
        rows.append(
            f"| {name} | {fps['median']:,.0f} | {low:,.0f}-{high:,.0f} | {row['repeats']} "
            f"| {chosen} |"
        )
    return rows


def render(parts: dict[str, dict[str, Any]], env: dict[str, Any], dry: bool) -> str:
    """The summary as markdown."""
    gpu = (env.get("gpu") or {}).get("name", "no GPU")
    commit = env.get("git_commit") or "unknown commit"
    dirty = " (uncommitted changes)" if env.get("git_dirty") else ""
    lines = [
        f"# GPU check of {commit}{dirty}",
        "",
        f"{gpu}, {env.get('cpu_affinity', '?')} CPUs, {env.get('date', '')}; "
        f"torch {(env.get('versions') or {}).get('torch')}."
        + (" Dry run on the CPU: the plumbing only, no figure to keep." if dry else ""),
        "",
        "| part | status | seconds | budget | result |",
        "| --- | --- | ---: | ---: | --- |",
    ]
    for name in ORDER:
        part = parts.get(name, {"status": "skipped"})
        seconds = f"{part['seconds']:.0f}" if "seconds" in part else ""
        budget = f"{part['budget_s']:.0f}" if "budget_s" in part else ""
        status = part["status"]
        if status == "cut":
            status = "**cut at its budget**"
        elif status == "failed":
            status = f"**failed (exit {part.get('returncode')})**"
        lines.append(f"| {name} | {status} | {seconds} | {budget} | {_result_line(name, part)} |")
    doc = parts.get("rows", {}).get("result")
    if doc:
        lines += ["", "Ratios of frames/s, paired within each repeat:", ""]
        lines += _ratio_rows(doc)
        lines += ["", "Rows:", ""]
        lines += _frame_rows(doc)
    return "\n".join(lines) + "\n"


def write_summary(
    out: Path, parts: dict[str, dict[str, Any]], budgets: Any, total: float, *, dry: bool
) -> int:
    """Write ``summary.md`` and ``gpu_check.json`` to ``out``, print the summary; the
    exit status: 0 where every part that ran ended well, else 1."""
    env = _environment()
    text = render(parts, env, dry)
    (out / "summary.md").write_text(text)
    document = {
        "commit": env.get("git_commit"),
        "environment": env,
        "dry_run": dry,
        "deadline_s": total,
        "budgets": asdict(budgets),
        "parts": parts,
    }
    (out / "gpu_check.json").write_text(json.dumps(document, indent=1, default=str) + "\n")
    print("\n" + text, flush=True)
    print(f"written to {out}: {', '.join(sorted(p.name for p in out.iterdir()))}", flush=True)
    bad = [n for n, p in parts.items() if p["status"] in ("cut", "failed")]
    return 1 if bad else 0
