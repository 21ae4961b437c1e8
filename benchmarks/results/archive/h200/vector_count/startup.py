"""Where a collector's start-up goes with one AtariVectorEnv of 64 (the suite's
configuration): the driver's probe of env 0, each build of the env (with its start and
end in seconds after the constructor was called), and the first batch. Call 4 ran it
from the project root, once per configuration:

    python startup.py {thread|process_slots} {thread|worker} cuda
"""

import json
import os
import sys
import time
from typing import Any

sys.path.insert(0, ".")
import rlcollect.collector.plan as plan
from benchmarks.suite.acting import acting_policy
from benchmarks.suite.vectors import pong_vector
from rlcollect import AsyncBatchedCollector

marks: dict[str, Any] = {}
probe_env = plan.probe_env


def timed_probe(*args: Any, **kwargs: Any) -> Any:
    start = time.time()
    result = probe_env(*args, **kwargs)
    marks["probe_s"] = time.time() - start
    return result


plan.probe_env = timed_probe  # type: ignore[assignment]


class Factory:
    """Builds the env and appends when it started and ended to ``path`` (the worker
    process's builds are seen through the file)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __call__(self) -> Any:
        start = time.time()
        env = pong_vector(64, 32, 16)
        with open(self.path, "a") as f:
            f.write(json.dumps({"build_start": start, "build_end": time.time()}) + "\n")
        return env


transport, backend, device = sys.argv[1], sys.argv[2], sys.argv[3]
path = f"/tmp/startup_{os.getpid()}.jsonl"
t0 = time.time()
collector = AsyncBatchedCollector(
    [Factory(path)],
    acting_policy("nature_cnn"),
    frames_per_batch=1024,
    total_frames=-1,
    transport=transport,
    inference_backend=backend,
    policy_device=device,
    cuda_graph=device == "cuda",
    seed=0,
)
marks["construct_s"] = time.time() - t0
next(iter(collector))
marks["first_batch_s"] = time.time() - t0
with open(path) as f:
    builds = [json.loads(line) for line in f]
marks["builds"] = [(round(b["build_start"] - t0, 2), round(b["build_end"] - t0, 2)) for b in builds]
collector.__exit__(None, None, None)
marks["closed_s"] = time.time() - t0
shown = {k: round(v, 2) if isinstance(v, float) else v for k, v in marks.items()}
print(transport, backend, shown, flush=True)
