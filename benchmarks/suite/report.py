"""docs/results.md and its plots, generated from the suite's JSON (``python -m benchmarks report``).

Reads ``benchmarks/results/suite_gpu/*.json`` and ``suite_cpu/*.json`` (whichever
exist), writes one section per suite with the machine and the date, a table per series
and PNG plots into ``docs/results/``. ``docs/results/headline.png`` is the headline
plot of the GPU suite where it has run, else of the CPU suite; the README shows it.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

from benchmarks.suite.plans import SERIES

SUITES = (
    ("gpu", "GPU suite"),
    ("cpu", "CPU suite"),
    ("cpu_busy", "CPU suite beside two CPU-busy processes"),
)
SHARED = 0.10  # other work's share of the machine's CPU time above which a section warns
X, DASH = "\u00d7", "\u2013"  # the multiplication sign and the en dash, for the tables
PUBLISHED_CHUNK_MS = (0.226, 0.037)  # TorchRL AsyncBatchedCollector, chunk 1 -> 64
PUBLISHED_ASYNC_FPS = {2: 85.2, 16: 53.1}  # DreamerV3 async, 8 envs, inference batch 1
COMMANDS = {
    "cpu": "`make bench`",  # = python -m benchmarks cpu && python -m benchmarks report
    "gpu": "`python -m benchmarks gpu --part 1|2|3|4|5|6|7|8 --peers-path .peers "
    "--sf-python .peers-sf/bin/python`, one device call per part (`--resume` continues a "
    "part cut short by its deadline)",
    "cpu_busy": "`python -m benchmarks cpu --series defaults --busy 2`",
}


#: (series, section heading, plot title, image alt text) of the series rendered as a bar
#: plot with their frames/s and ratios tables, in page order
AGAINST_THE_ENVS = (
    (
        "throughput",
        "Throughput against the envs' own speed",
        "Against the envs' own speed",
        "throughput",
    ),
    (
        "vector_throughput",
        "Native vector envs against their own speed",
        "AtariVectorEnv against its own speed",
        "vector throughput",
    ),
    (
        "vector_layouts",
        "Native vector envs: several in processes",
        "Several AtariVectorEnvs against the env alone",
        "vector layouts",
    ),
    (
        "defaults",
        "The defaults against the best documented layout and the plain loops",
        "No layout arguments, the documented layout, the loops",
        "defaults",
    ),
    (
        "sample_factory",
        "Sample Factory's sampler beside rlcollect",
        "Sample Factory's sampler and rlcollect against the envs' own speed",
        "sample factory",
    ),
)


def _fmt(value: float | None, digits: int = 0) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return ""
    return f"{value:,.{digits}f}"


def _metric(row: dict[str, Any], metric: str, key: str = "median") -> float | None:
    found = row.get(metric)
    return None if found is None else found[key]


def _range(row: dict[str, Any], metric: str = "frames_per_second", digits: int = 0) -> str:
    found = row.get(metric)
    if found is None:
        return ""
    lo, hi = found["range"]
    return f"{_fmt(lo, digits)}{DASH}{_fmt(hi, digits)}"


def _load(results: Path, suite: str) -> dict[str, dict[str, Any]]:
    folder = results / f"suite_{suite}"
    if not folder.is_dir():
        return {}
    return {p.stem: json.loads(p.read_text()) for p in sorted(folder.glob("*.json"))}


def _machine(doc: dict[str, Any]) -> str:
    env = doc["environment"]
    gpu = env.get("gpu")
    parts = [f"{env['cpus']} CPUs ({env['cpu_model']})"]
    if gpu:
        parts.append(f"{gpu['name']} (CUDA {gpu['cuda']})")
    versions = ", ".join(f"{k} {v}" for k, v in env["versions"].items() if v)
    return f"Machine: {', '.join(parts)}, {env['platform']}. Python {env['python']}; {versions}."


def _when(doc: dict[str, Any]) -> str:
    env = doc["environment"]
    load = ", ".join(f"{x:.2f}" for x in env["loadavg_at_start"])
    end = ", ".join(f"{x:.2f}" for x in doc["loadavg_at_end"])
    commit = (env.get("git_commit") or "unknown")[:10]
    commit += " with local changes" if env.get("git_dirty") else ""
    text = (
        f"*Measured {env['date']}, {doc['seconds'] / 60:.1f} min, {doc['repeats']} repeats; "
        f"load average (1, 5, 15 min) {load} at the start, {end} at the end; code {commit}.*"
    )
    shares = sorted(r["other_cpu_share"] for rs in doc["runs"].values() for r in rs
                    if "other_cpu_share" in r)  # fmt: skip
    for later in doc.get("resumed", []):
        text += (
            f" *Resumed {later['date']} (code {(later.get('git_commit') or 'unknown')[:10]}) "
            "for the repeats the first call lacked, on a machine that may have been "
            "another of its kind: compare the ratios, which pair runs of one call, more "
            "than absolute figures across repeats.*"
        )
    if shares and shares[len(shares) // 2] > SHARED:
        text += (
            f'\n\n!!! warning "Shared machine"\n    Other work on this machine took '
            f"{100 * shares[len(shares) // 2]:.0f}% of its CPU time during the median run "
            f"(up to {100 * shares[-1]:.0f}%): each run had only a share of the cores, so "
            "these figures are lower and noisier than the machine's own; the ranges show "
            "how much."
        )
    return text


def _notes(doc: dict[str, Any]) -> list[str]:
    lines = [f"- {note}" for note in doc["notes"]]
    lines += [f"- **Skipped** `{name}`: {why}." for name, why in doc["skipped"].items()]
    for name, row in doc["summary"].items():
        if row["failures"]:
            errors = {r["error"] for r in doc["runs"][name] if "error" in r}
            lines.append(
                f"- **{row['failures']} failed repeat(s)** of `{name}`: {'; '.join(errors)}"
            )
    if not doc["complete"]:
        # Name the short configurations: their medians rest on fewer repeats than the rest.
        short = [
            f"`{name}` ({row['repeats'] + row['failures']} of {doc['repeats']})"
            for name, row in doc["summary"].items()
            if row["repeats"] + row["failures"] < doc["repeats"]
        ]
        lines.append(
            "- **Incomplete**: the run reached its deadline before its last repeats; "
            f"repeats run: {', '.join(short) or 'see the JSON'}."
        )
    return lines


def _execution_note(config: dict[str, Any], result: list[dict[str, Any]]) -> str:
    ok = [r for r in result if "error" not in r]
    notes = []
    if config["kind"] in ("rlcollect", "torchrl"):
        chunk = ok[0].get("transition_chunk_size", config["chunk"]) if ok else config["chunk"]
        notes.append(f"chunk {chunk}")
        batch = [r["mean_batch_size"] for r in ok if r.get("mean_batch_size")]
        if batch:
            notes.append(f"mean batch {sorted(batch)[len(batch) // 2]:.1f}")
        if config.get("inference_backend") == "process" or config["kind"] == "torchrl":
            notes.append("server in its own process")
    if config["kind"] in ("atari_vector", "envpool_loop") and ok:
        notes.append(f"C++ envs, batch {ok[0]['batch_size']}, {ok[0]['env_threads']} threads")
    if config["kind"] == "sample_factory":
        notes.append(f"rollout {config['rollout']}, inference in its own process")
    if config["kind"] == "env_only":
        notes.append("random actions, no policy")
    startup = [r["startup_seconds"] for r in ok if "startup_seconds" in r]
    if startup:
        notes.append(f"first batch after {sorted(startup)[len(startup) // 2]:.1f} s")
    return ", ".join(notes)


def _fps_table(doc: dict[str, Any]) -> list[str]:
    lines = [
        "| run | frames/s | run range | driver CPU ms/frame | execution notes |",
        "| --- | ---: | ---: | ---: | --- |",
    ]
    for name, row in doc["summary"].items():
        lines.append(
            f"| `{name}` | {_fmt(_metric(row, 'frames_per_second'))} | {_range(row)} | "
            f"{_fmt(_metric(row, 'driver_cpu_ms_per_frame'), 3)} | "
            f"{_execution_note(doc['configs'][name], doc['runs'][name])} |"
        )
    return lines


def _ratio_table(doc: dict[str, Any]) -> list[str]:
    lines = [
        "| rlcollect run | against | ratio (median) | range over repeats |",
        "| --- | --- | ---: | ---: |",
    ]
    for ratio in doc["ratios"].values():
        lo, hi = ratio["range"]
        lines.append(
            f"| `{ratio['numerator']}` | `{ratio['denominator']}` | "
            f"**{ratio['median']:.2f}{X}** | {lo:.2f}{DASH}{hi:.2f} |"
        )
    return lines


def _chunking_table(doc: dict[str, Any]) -> list[str]:
    pairs = []
    patterns = (
        ("rlcollect", r"rlcollect\[process_slots-chunk(\d+)-eager-process_server\]"),
        ("TorchRL", r"torchrl\[process_slots-chunk(\d+)-eager\]"),
    )
    for lib, pattern in patterns:
        found = {int(m.group(1)): n for n in doc["summary"] if (m := re.fullmatch(pattern, n))}
        if 1 in found and 64 in found:
            pairs.append((lib, found[1], found[64]))
    if not pairs:
        return []
    lines = [
        "| collector | driver CPU ms/frame, chunk 1 | chunk 64 | reduction "
        "| frames/s, chunk 1 | chunk 64 |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for lib, one, many in pairs:
        a = _metric(doc["summary"][one], "driver_cpu_ms_per_frame")
        b = _metric(doc["summary"][many], "driver_cpu_ms_per_frame")
        reduction = f"{a / b:.1f}{X}" if a and b else ""
        lines.append(
            f"| {lib} (this run) | {_fmt(a, 3)} | {_fmt(b, 3)} | {reduction} | "
            f"{_fmt(_metric(doc['summary'][one], 'frames_per_second'))} | "
            f"{_fmt(_metric(doc['summary'][many], 'frames_per_second'))} |"
        )
    a, b = PUBLISHED_CHUNK_MS
    lines.append(f"| TorchRL (published) | {a:.3f} | {b:.3f} | {a / b:.1f}{X} | | |")
    return lines


def _dqn_points(doc: dict[str, Any]) -> list[tuple[int, dict[str, Any], dict[str, Any]]]:
    points = []
    for name, row in doc["summary"].items():
        if name.startswith("blocking[") and row.get("frames_per_second"):
            n = int(name.split("[")[1].split()[0])
            other = doc["summary"].get(f"rlcollect[{n} envs]", {})
            if other.get("frames_per_second"):
                points.append((n, row, other))
    return sorted(points, key=lambda p: p[0])


def _dqn_table(doc: dict[str, Any]) -> list[str]:
    lines = [
        "| num_envs | blocking frames/s (mean ± 95% CI) | rlcollect frames/s (mean ± 95% CI) "
        "| rlcollect / blocking (median, range) |",
        "| ---: | ---: | ---: | ---: |",
    ]
    for n, blocking, fed in _dqn_points(doc):
        ratio = doc["ratios"].get(f"rlcollect[{n} envs] / blocking[{n} envs]")
        shown = (
            f"{ratio['median']:.2f}{X} ({ratio['range'][0]:.2f}{DASH}{ratio['range'][1]:.2f})"
            if ratio
            else ""
        )
        cells = []
        for row in (blocking, fed):
            fps = row["frames_per_second"]
            half = fps["ci95_half_width"]
            cells.append(
                f"{_fmt(fps['mean'])} ± {_fmt(half)}"
                if not math.isnan(half)
                else f"{_fmt(fps['mean'])} (one run)"
            )
        lines.append(f"| {n} | {cells[0]} | {cells[1]} | {shown} |")
    return lines


def _async_table(doc: dict[str, Any]) -> list[str]:
    lines = [
        "| run | env frames/s | run range | learner updates/s | rows sampled per row collected "
        "| published analogue (DreamerV3) |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, row in doc["summary"].items():
        ratio = doc["configs"][name]["train_ratio"]
        achieved = [
            r["train_ratio_achieved"] for r in doc["runs"][name] if r.get("train_ratio_achieved")
        ]
        shown = f"{sorted(achieved)[len(achieved) // 2]:.1f}" if achieved else ""
        lines.append(
            f"| `{name}` | {_fmt(_metric(row, 'frames_per_second'), 1)} | "
            f"{_range(row, digits=1)} | "
            f"{_fmt(_metric(row, 'updates_per_second'), 1)} | {shown} | "
            f"{PUBLISHED_ASYNC_FPS.get(ratio, '')} frames/s |"
        )
    return lines


def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig: Any, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=110, metadata={"Software": None})  # no version stamp: stable bytes
    _plt().close(fig)


def _bar_plot(doc: dict[str, Any], path: Path, title: str, *, headline: bool = False) -> None:
    """Frames/s per run; ``headline``: without the runs kept for the chunking table."""
    plt = _plt()
    rows = [
        (n, r)
        for n, r in doc["summary"].items()
        if r.get("frames_per_second")
        and not (headline and doc["configs"][n].get("role") == "chunking")
    ]
    names = [n for n, _ in rows]
    medians = [r["frames_per_second"]["median"] for _, r in rows]
    ranges = [r["frames_per_second"]["range"] for _, r in rows]
    errs = [
        [m - lo for m, (lo, _) in zip(medians, ranges, strict=True)],
        [hi - m for m, (_, hi) in zip(medians, ranges, strict=True)],
    ]
    colors = [
        "#2a7ab9"
        if n.startswith(("rlcollect", "pixels"))
        else "#999999"
        if n.startswith("env_only")
        else "#e08a2c"
        for n in names
    ]
    fig, ax = plt.subplots(figsize=(9, 0.42 * len(names) + 1.4))
    ax.barh(range(len(names)), medians, xerr=errs, color=colors, capsize=3)
    ax.set_yticks(range(len(names)), names, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("frames/s (median of repeats; bars: run range)")
    ax.set_title(title, fontsize=10)
    _save(fig, path)


def _dqn_plot(doc: dict[str, Any], path: Path, title: str) -> None:
    plt = _plt()
    points = _dqn_points(doc)
    fig, ax = plt.subplots(figsize=(7, 4))
    for label, index, color in (
        ("blocking step() loop", 1, "#e08a2c"),
        ("same loop fed by rlcollect", 2, "#2a7ab9"),
    ):
        xs = [p[0] for p in points]
        means = [p[index]["frames_per_second"]["mean"] for p in points]
        ci = [p[index]["frames_per_second"]["ci95_half_width"] for p in points]
        ci = [0.0 if math.isnan(c) else c for c in ci]
        ax.errorbar(xs, means, yerr=ci, marker="o", capsize=3, label=label, color=color)
    ax.set_xscale("log", base=2)
    ax.set_xticks([p[0] for p in points], [str(p[0]) for p in points])
    ax.set_yscale("log")
    ax.set_xlabel("num_envs")
    ax.set_ylabel("env frames/s with learning (mean, 95% CI)")
    ax.set_title(title, fontsize=10)
    ax.legend()
    ax.grid(alpha=0.3, which="both")
    _save(fig, path)


def _block(doc: dict[str, Any], heading: str, image: str | None, tables: list[str]) -> list[str]:
    """One series on the page: its heading, when it ran, its figure, tables and notes."""
    out = [f"### {heading}", "", _when(doc), ""]
    if image is not None:
        out += [image, ""]
    return [*out, *tables, "", *_notes(doc), ""]


def _fps_and_ratios(doc: dict[str, Any]) -> list[str]:
    return [
        *_fps_table(doc),
        "",
        "Ratios computed within each repeat, then the median:",
        "",
        *_ratio_table(doc),
    ]


def _section(suite: str, label: str, docs: dict[str, dict[str, Any]], images: Path) -> list[str]:
    first = next(iter(docs.values()))
    env = first["environment"]
    where = env["gpu"]["name"] if env.get("gpu") else f"{env['cpus']} CPUs"
    out = [f"## {label}: {where}, {env['date'].split()[0]}", ""]
    out += [
        f"Command: {COMMANDS[suite]}. Every figure is the median over fresh-process "
        "repeats, with the run range (lowest to highest repeat).",
        "",
        _machine(first),
        "",
    ]
    rel = f"{images.name}/{suite}"
    if "peers" in docs:
        doc = docs["peers"]
        day = doc["environment"]["date"].split()[0]
        title = f"rlcollect and its peers, Pong pixels, same run ({where}, {day})"
        _bar_plot(doc, images / f"{suite}_headline.png", title, headline=True)
        out += _block(
            doc,
            "rlcollect and its peers, same task, same run",
            f"![peers]({rel}_headline.png)",
            _fps_and_ratios(doc),
        )
        chunking = _chunking_table(doc)
        if chunking:
            out += [
                "### Driver CPU cost of chunking",
                "",
                "From the same run: the driver process's CPU time per frame with one "
                "transition per message and with 64, the inference server in a process "
                "of its own on both collectors.",
                "",
                *chunking,
                "",
            ]
    if "pixels" in docs:
        doc = docs["pixels"]
        _bar_plot(doc, images / f"{suite}_pixels.png", f"Pixel collection matrix ({where})")
        out += _block(
            doc,
            f"Pixel collection: transports {X} chunk {X} envs per worker",
            f"![pixels]({rel}_pixels.png)",
            _fps_table(doc),
        )
    if "dqn_loop" in docs:
        doc = docs["dqn_loop"]
        _dqn_plot(doc, images / f"{suite}_dqn_loop.png", f"DQN on Pong ({where})")
        out += _block(
            doc,
            "DQN training loop: blocking `step()` vs rlcollect",
            f"![dqn loop]({rel}_dqn_loop.png)",
            _dqn_table(doc),
        )
    if "async_training" in docs:
        doc = docs["async_training"]
        out += _block(doc, "Async training at train ratio 2 and 16", None, _async_table(doc))
    # the series against the envs' own speed: a bar plot, frames/s and ratios each
    for name, heading, plot_title, alt in AGAINST_THE_ENVS:
        if name in docs:
            _bar_plot(docs[name], images / f"{suite}_{name}.png", f"{plot_title} ({where})")
            out += _block(
                docs[name], heading, f"![{alt}]({rel}_{name}.png)", _fps_and_ratios(docs[name])
            )
    expected = ("defaults",) if suite == "cpu_busy" else SERIES  # --busy runs one series
    missing = [name for name in expected if name not in docs]
    if missing:  # say what the suite has not measured here rather than leave it out silently
        names = ", ".join(f"`{name}`" for name in missing)
        out += [f"Not run yet on this machine: {names} ({COMMANDS[suite]}).", ""]
    raw = ", ".join(f"[`{n}.json`](../benchmarks/results/suite_{suite}/{n}.json)" for n in docs)
    out += [f"Raw results (every repeat, every configuration): {raw}.", ""]
    return out


def _gpu_check(results: Path) -> list[str]:
    """The latest one-call GPU check (``benchmarks/gpu_check.sh``): its summary as it
    printed it, headings one level down, and where its files are."""
    found = sorted((results / "gpu_check").glob("*/summary.md"))
    if not found:
        return []
    latest = found[-1]
    out = [f"## The one-call GPU check: {latest.parent.name}", ""]
    for line in latest.read_text().splitlines():
        if line.startswith("# "):
            continue  # the check's own title: the heading above replaces it
        if line.startswith("written to "):
            continue  # where the device wrote it, not where it is kept
        out.append("#" + line if line.startswith("#") else line)
    where = f"../benchmarks/results/gpu_check/{latest.parent.name}"
    out += [
        "",
        f"Its files, and how each was made: [`{latest.parent.name}`]({where}/README.txt).",
        "",
    ]
    return out


def write_report(results: Path, docs_dir: Path) -> Path:
    """Write ``docs_dir/results.md`` and its plots from ``results/suite_*``; returns the page."""
    images = docs_dir / "results"
    images.mkdir(parents=True, exist_ok=True)
    page = [
        "# Results",
        "",
        "<!-- Generated by `python -m benchmarks report` from benchmarks/results/suite_*/; "
        "edit benchmarks/suite/report.py, not this page. -->",
        "",
        "The benchmark suite's measurements, rendered from its JSON. Each series runs its "
        "configurations in fresh processes, interleaved repeat by repeat, so ratios come "
        "from one run of one machine. The [benchmarks page](benchmarks.md) explains the "
        "older standalone scripts; `python -m benchmarks --help` lists the options.",
        "",
    ]
    page += _gpu_check(results)
    headline: Path | None = None
    for suite, label in SUITES:
        docs = _load(results, suite)
        if not docs:
            page += [f"## {label}", "", f"Not run yet: {COMMANDS[suite]}.", ""]
            continue
        page += _section(suite, label, docs, images)
        if headline is None and (images / f"{suite}_headline.png").exists():
            headline = images / f"{suite}_headline.png"
    if headline is not None:
        (images / "headline.png").write_bytes(headline.read_bytes())
    path = docs_dir / "results.md"
    path.write_text("\n".join(page).rstrip() + "\n")
    print(f"wrote {path} and plots in {images}")
    return path
