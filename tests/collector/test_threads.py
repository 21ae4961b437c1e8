"""The warning about torch's thread pool in the training process competing with the env
workers (docs/tuning.md, Torch threads). Each case runs in a fresh interpreter: the
warning is given once per process."""

import subprocess
import sys
import textwrap

SCRIPT = """
import functools
import os
import warnings

import torch

from rlcollect import AsyncBatchedCollector
from rlcollect.testing import CountingEnv

torch.set_num_threads({threads})
cores = len(os.sched_getaffinity(0))


class Zero(torch.nn.Module):
    def forward(self, observation):
        return torch.zeros(observation.shape[0], dtype=torch.int64)


with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    for _ in range(2):  # a second collector: no second warning
        with AsyncBatchedCollector(
            [functools.partial(CountingEnv, i) for i in range(cores)],  # one worker per core
            Zero(),
            frames_per_batch=8,
            total_frames=8,
            transport="thread",
            policy_device="cpu",
        ) as c:
            list(c)
ours = [w for w in caught if "intra-op threads" in str(w.message)]
print(len(ours), ours[0].category.__name__ if ours else "", str(ours[0].message) if ours else "")
"""


def run(threads: int) -> list[str]:
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(SCRIPT.format(threads=threads))],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip().split(" ", 2)


def test_a_learner_pool_beside_busy_workers_is_warned_of_once():
    count, category, message = run(threads=2)
    assert (count, category) == ("1", "RuntimeWarning")
    assert "torch.set_num_threads(1)" in message and "docs/tuning.md" in message


def test_one_torch_thread_is_not_warned_of():
    assert run(threads=1)[0] == "0"
