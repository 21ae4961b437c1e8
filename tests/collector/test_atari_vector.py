"""ale-py's AtariVectorEnv driven with send/recv (batch_size < num_envs), on both transports.

Frame stacks tell on the collector: within an episode the next observation of a
transition is the observation of the following one, and every stack is the previous one
shifted by one frame. Episodes are cut at 200 frames, 50 steps, so an extra transition
(a NextStep reset step) or a missing one shows as an episode of another length; a reset
stack starts with three blank frames, so a reset observation in place of a final one
shows too.
"""

import functools
import os

import pytest
import torch
from envs import atari_vector
from helpers import lowest_niceness_allowed, streams

from rlcollect import AsyncBatchedCollector
from rlcollect.transports import ProcessSlotTransport
from rlcollect.worker.vector_priority import DRIVER_NICE

pytestmark = pytest.mark.slow

EPISODE_STEPS = 50


class FramePolicy(torch.nn.Module):
    """Deterministic, and varied: the action is the last frame's pixel sum modulo 6."""

    def forward(self, obs):
        return obs[:, -1].long().sum((1, 2)) % 6


@functools.cache
def run(transport, mode, rows_per_env=150, limit=20_000):
    """Each sub-env's stream, once every sub-env has delivered ``rows_per_env`` rows (three
    episodes' worth): an asynchronous vector env serves whichever sub-envs are ready, and
    on a busy machine not fairly, so a shared budget could leave one short."""
    with AsyncBatchedCollector(
        [functools.partial(atari_vector, mode)],
        FramePolicy(),
        frames_per_batch=100,
        total_frames=-1,
        transport=transport,
        policy_device="cpu",
        seed=5,
    ) as c:
        assert c.num_envs == 4
        batches, counts = [], torch.zeros(4, dtype=torch.long)
        while int(counts.min()) < rows_per_env:
            batches.append(next(c))
            counts += torch.bincount(batches[-1]["env_index"], minlength=4)
            assert len(batches) * 100 < limit, f"a sub-env starved: rows {counts.tolist()}"
        return streams(torch.cat(batches))


@pytest.mark.parametrize("mode", ["NextStep", "SameStep"])
def test_frame_stacks_line_up_and_episodes_are_whole(transport, mode):
    per_env = run(transport, mode)
    assert sorted(per_env) == [0, 1, 2, 3]
    for i, rows in per_env.items():
        obs, nxt = rows["observation"], rows["next", "observation"]
        ep, st, done = rows["episode"], rows["step"], rows["next", "done"]
        assert obs.shape[1:] == (4, 84, 84) and obs.dtype == torch.uint8
        # every next stack is the current one shifted by one frame, final ones included
        assert torch.equal(nxt[:, :3], obs[:, 1:]), f"env {i}: a stack does not shift"
        # gapless: within an episode the next observation is the following observation
        inner = ~done[:-1]
        assert torch.equal(nxt[:-1][inner], obs[1:][inner]), f"env {i}: a step is missing"
        assert ep[0] == 0 and st[0] == 0
        follows = torch.where(
            done[:-1],
            (ep[1:] == ep[:-1] + 1) & (st[1:] == 0),
            (ep[1:] == ep[:-1]) & (st[1:] == st[:-1] + 1),
        )
        assert bool(follows.all()), f"env {i}: episode/step counters jump"
        # each finished episode holds exactly its 50 steps: no reset step among them
        assert done.sum() >= 2, f"env {i}: too few episodes to check"
        assert torch.equal(st[done], torch.full_like(st[done], EPISODE_STEPS - 1))
        assert bool(rows["next", "truncated"][done].all())
        # an episode starts from a reset stack (three blank frames) ...
        starts = st == 0
        assert int(obs[starts][:, :3].sum()) == 0
        # ... and ends on its true final stack, which has none
        assert bool((nxt[done][:, :3].flatten(1).sum(1) > 0).all())
        assert torch.equal(rows["action"], FramePolicy()(obs))


def test_each_env_stream_is_reproducible_though_results_come_in_any_order():
    """Results of an asynchronous vector env come in an order that varies from run to
    run, but each sub-env's own stream depends only on its seed and its own actions."""
    a, b = run("thread", "NextStep"), run("process_slots", "NextStep")
    for i in range(4):
        n = min(len(a[i]), len(b[i]))
        assert n > 100
        for key in ("observation", "action", ("next", "reward"), ("next", "done")):
            assert torch.equal(a[i][key][:n], b[i][key][:n]), f"env {i} differs in {key}"


@pytest.mark.skipif(not hasattr(os, "SCHED_BATCH"), reason="Linux scheduling policies")
def test_a_vector_worker_preempts_its_env_threads():
    # Worker processes run as SCHED_BATCH, and the vector env's threads inherit it; the
    # thread that feeds them actions goes back to the normal policy, so that it runs as
    # soon as its actions arrive even when every core is stepping sub-envs.
    transport = ProcessSlotTransport()
    with AsyncBatchedCollector(
        [functools.partial(atari_vector, "NextStep")],
        FramePolicy(),
        frames_per_batch=100,
        total_frames=-1,
        transport=transport,
        policy_device="cpu",
    ) as c:
        next(iter(c))
        pid = transport.pids[0]
        policy = {int(t): os.sched_getscheduler(int(t)) for t in os.listdir(f"/proc/{pid}/task")}
    assert policy.pop(pid) == os.SCHED_OTHER
    assert len(policy) >= 2 and set(policy.values()) == {os.SCHED_BATCH}  # 2 env threads


@pytest.mark.skipif(not hasattr(os, "SCHED_BATCH"), reason="Linux niceness per thread")
@pytest.mark.parametrize(
    "backend, batch_size", [("worker", 2), ("thread", 2), ("worker", 4)], ids=str
)
def test_a_vector_worker_that_runs_its_policy_outranks_its_env_threads(backend, batch_size):
    # With the policy in the worker, the thread that drives a vector env through
    # send/recv also runs the forwards and writes the transitions while the env's threads
    # step the other sub-envs; it asks for a lower niceness than those threads, which
    # keep theirs. Served by a server, or stepping its env whole (its threads then wait
    # for it), it does not.
    transport = ProcessSlotTransport()
    mode = "NextStep" if batch_size < 4 else "SameStep"  # stepped whole: not NextStep
    with AsyncBatchedCollector(
        [functools.partial(atari_vector, mode, 4, batch_size)],
        FramePolicy(),
        frames_per_batch=100,
        total_frames=-1,
        transport=transport,
        policy_device="cpu",
        inference_backend=backend,
    ) as c:
        next(iter(c))
        pid = transport.pids[0]
        tasks = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
        nice = {t: os.getpriority(os.PRIO_PROCESS, t) for t in tasks}
    own = os.getpriority(os.PRIO_PROCESS, 0)  # this thread's, which the worker inherits
    # Raised as far as this process may lower a niceness, down to DRIVER_NICE.
    raised = backend == "worker" and batch_size < 4
    assert nice.pop(pid) == (lowest_niceness_allowed(DRIVER_NICE) if raised else own)
    assert len(nice) >= 2 and set(nice.values()) == {own}  # the 2 env threads, and others
