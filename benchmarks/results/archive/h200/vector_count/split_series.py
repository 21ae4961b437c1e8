"""Split call 1's vector_throughput.json (8 runs, measured before the series was split)
into the two series the suite now has, vector_throughput and vector_layouts: each keeps
the runs its plan names, exactly as measured, with the summary and ratios recomputed by
the suite's runner. Run from the project root:

    PYTHONPATH=. python benchmarks/results/archive/h200/vector_count/split_series.py SOURCE OUT_DIR
"""

import json
import os
import sys
from pathlib import Path

from benchmarks.suite import plans
from benchmarks.suite.runner import _ratios, _summary

source, out = json.loads(Path(sys.argv[1]).read_text()), Path(sys.argv[2])
cores = source["environment"]["cpus"]
os.sched_getaffinity = lambda pid: set(range(cores))  # the plans' sizes for that machine
machine = plans.machine("gpu", False, 1.0)
for make in (plans.vector_throughput, plans.vector_layouts):
    series = make(machine)
    configs = json.loads(json.dumps(series.runs))
    assert all(source["configs"][name] == configs[name] for name in configs), series.name
    runs = {name: source["runs"][name] for name in configs}
    split = (
        "Split from one run of the series before it was split in two (8 configurations in "
        "one device call, whose deadline cut the last repeats); its minutes are that run's."
    )
    doc = dict(source, series=series.name, title=series.title, notes=[*series.notes, split])
    doc.update(
        configs=configs,
        runs=runs,
        summary=_summary(runs),
        ratios=_ratios(series, runs),
        complete=all(len(r) == source["repeats"] for r in runs.values()),
    )
    (out / f"{series.name}.json").write_text(json.dumps(doc, indent=1) + "\n")
    print(series.name, "complete" if doc["complete"] else "incomplete", len(runs), "runs")
