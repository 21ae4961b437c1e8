"""Recurrent policies: every env's state held by the server, reset exactly at episode
starts, on every path a transition can take.

The policy under test (helpers.RecurrentCountingPolicy) counts in its state the steps
since its episode began and remembers the env it last saw; its action is computed from
that count. So a state reset one step late, reset where no episode starts, or landing
on another env (CountingEnvs have episodes of different lengths, 3 to 9 steps, so the
envs' counts differ) fails the row-by-row checks of check_recurrent_streams, and the
counting-stream checks as well (the action would be another one).
"""

import functools
import os
import warnings

import numpy as np
import pytest
import torch
from envs import CrashOnce
from helpers import (
    SERVER_LAYOUT,
    RecurrentCountingPolicy,
    check_counting_streams,
    check_recurrent_streams,
    check_state_kept_across_updates,
    check_vector_sub_envs_own_their_state,
    collect,
    counting_collector,
    counting_envs,
    streams,
)
from tensordict.nn import TensorDictModule

from rlcollect import AsyncBatchedCollector, InferenceError
from rlcollect.errors import WorkerRestartWarning
from rlcollect.inference.recurrent import StateStore
from rlcollect.testing import STEP, CountingVectorEnv, counting_layout
from rlcollect.transports.layout import request_envs, request_rows


def make(transport="thread", policy=None, n=4, **kwargs):
    kwargs.setdefault("frames_per_batch", 48)
    kwargs.setdefault("total_frames", 960)
    return counting_collector(transport, policy or RecurrentCountingPolicy(), n, **kwargs)


def from_factory(factory, n=4, **kwargs):
    """A collector whose inference process builds the policy with ``factory``."""
    return AsyncBatchedCollector(
        counting_envs(n),
        policy_factory=factory,
        frames_per_batch=48,
        total_frames=960,
        transport="process_slots",
        inference_backend="process",
        policy_device="cpu",
        **kwargs,
    )


# ---------------------------------------------------------------- the contract, row by row

LAYOUTS = {
    "one env per worker": {},
    "envs_per_worker=2": {"envs_per_worker": 2},
    "worker_splits=2": {"envs_per_worker": 2, "worker_splits": 2, "n": 4},
    "batches of 2 envs": {"max_batch_size": 2, "n": 6},  # batches mix envs dynamically
    # a chunk of one step: a batch takes every env's stream in many pieces
    "envs_per_worker=3, chunk of 1 step": {
        "envs_per_worker": 3,
        "n": 6,
        "transition_chunk_size": 3,
    },
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_state_is_its_env_s_own_and_reset_at_step_0(transport, layout):
    with make(transport, **LAYOUTS[layout]) as c:
        data = collect(c)
    check_counting_streams(data)
    check_recurrent_streams(data)
    assert int(data["is_init"].sum()) > 2 * c.num_envs  # every env started episodes


@pytest.mark.parametrize("layout", ["one env per worker", "worker_splits=2"])
def test_the_process_backend(layout):
    with make("process_slots", inference_backend="process", **LAYOUTS[layout]) as c:
        data = collect(c)
    check_counting_streams(data)
    check_recurrent_streams(data)


def test_a_tensor_state_and_a_policy_factory_in_the_inference_process():
    factory = functools.partial(RecurrentCountingPolicy, tensor_state=True)
    with from_factory(factory) as c:
        data = collect(c)
    assert data["recurrent_state"].shape == (data.shape[0], 2)
    check_counting_streams(data)
    check_recurrent_streams(data)


def test_store_recurrent_state_false_leaves_the_state_out_and_keeps_is_init(transport):
    with make(transport, store_recurrent_state=False) as c:
        data = collect(c)
    check_counting_streams(data)
    check_recurrent_streams(data, stored=False)


@pytest.mark.parametrize("mode", ["NextStep", "SameStep", "Disabled"])
def test_vector_env_sub_envs_each_own_their_state(transport, mode):
    check_vector_sub_envs_own_their_state(transport, mode, policy_device="cpu")


def test_asynchronous_vector_envs_returning_any_subset(transport):
    # recv returns 2 sub-envs of 4 in a seeded, arbitrary order: requests name any envs
    fns = [functools.partial(CountingVectorEnv, 4 * i, 4, 2) for i in range(2)]
    with AsyncBatchedCollector(
        fns,
        RecurrentCountingPolicy(),
        frames_per_batch=32,
        total_frames=960,
        transport=transport,
        envs_per_worker=2,
        policy_device="cpu",
    ) as c:
        data = collect(c)
    check_counting_streams(data)
    check_recurrent_streams(data)


def test_a_tensordict_module_reads_the_state_and_is_init_and_writes_next_state():
    class Counter(torch.nn.Module):
        def initial_state(self):
            return {"count": torch.zeros((), dtype=torch.int64), "env": torch.tensor(-1)}

        def forward(self, obs, count, env, is_init):
            # is_init is the server's flag: the state it gets is already the initial one
            assert bool((count[is_init] == 0).all())
            action = (obs[:, 0] * 7 + obs[:, 1] * 3 + count) % 5
            return action, count.clone(), count + 1, obs[:, 0].clone()

    policy = TensorDictModule(
        Counter(),
        in_keys=["observation", ("recurrent_state", "count"), ("recurrent_state", "env"),
                 "is_init"],
        out_keys=["action", "count", ("next", "recurrent_state", "count"),
                  ("next", "recurrent_state", "env")],
    )  # fmt: skip
    with make(policy=policy) as c:
        data = collect(c)
    check_counting_streams(data)
    check_recurrent_streams(data)
    assert "next" not in data["recurrent_state"].keys()  # noqa: SIM118 (a TensorDict)


@pytest.mark.parametrize(
    ("transport", "backend"),
    [("thread", "thread"), ("process_slots", "thread"), ("process_slots", "process")],
)
def test_the_state_is_kept_across_weight_updates(transport, backend):
    policy = RecurrentCountingPolicy()
    c = make(transport, policy, total_frames=-1, frames_per_batch=16, inference_backend=backend)
    data = check_state_kept_across_updates(c, policy, batches=40, min_version=20)
    # episodes that straddle an update: the count did not restart there
    straddling = 0
    for rows in streams(data).values():
        changed = (rows["policy_version"].diff() != 0) & (rows["step"][1:] > 0)
        straddling += int(changed.sum())
    assert straddling > 5


def test_a_restarted_worker_s_envs_start_from_the_initial_state(transport, tmp_path):
    fns = [functools.partial(CrashOnce, i, str(tmp_path / f"crash{i}"), (1, 2)) for i in range(3)]
    fns.append(functools.partial(CrashOnce, 3, str(tmp_path / "crash3"), (2, 1)))
    with (
        warnings.catch_warnings(),
        AsyncBatchedCollector(
            fns,
            RecurrentCountingPolicy(),
            frames_per_batch=16,
            total_frames=-1,
            transport=transport,
            policy_device="cpu",
            max_worker_restarts=4,
            **SERVER_LAYOUT,  # four restarts, one per env
        ) as c,
    ):
        warnings.simplefilter("ignore", WorkerRestartWarning)
        # until every env has 20 rows after the last of the 4 restarts (a restarted
        # worker process takes a while to start)
        batches, after = [], torch.zeros(4, dtype=torch.long)
        while not bool((after >= 20).all()):
            batches.append(next(c))
            if c.stats()["worker_restarts"] == 4:
                after += torch.bincount(batches[-1]["env_index"], minlength=4)
            assert len(batches) < 2000, "the crashes did not happen"
    data = collect(batches)
    check_recurrent_streams(data)
    obs = data["observation"]
    assert torch.equal(data["step"], obs[:, STEP])  # the env's own step: rebuilt envs too
    assert torch.equal(data["action"], (obs[:, 0] * 7 + obs[:, 1] * 3 + obs[:, 2]) % 5)
    # every rebuilt env's first row is a step 0 with the initial state
    for rows in streams(data).values():
        own_episode = rows["observation"][:, 1]
        rebuilt = (own_episode[1:] == 0) & (rows["episode"][1:] > 0) & (rows["step"][1:] == 0)
        assert int(rebuilt.sum()) >= 1


# ---------------------------------------------------------------- the checks are sharp


def test_the_row_checks_catch_a_late_reset_and_a_state_on_the_wrong_env():
    with make() as c:
        data = collect(c)
    check_recurrent_streams(data)
    late = data.clone()
    first = (late["step"] == 1).nonzero().flatten()[:3]
    late["count"][first] = 0  # the reset applied at step 1 instead of 0
    with pytest.raises(AssertionError, match="not their env's"):
        check_recurrent_streams(late)
    swapped = data.clone()
    a = (swapped["env_index"] == 0) & (swapped["step"] == 2)
    b = (swapped["env_index"] == 1) & (swapped["step"] == 2)
    i, j = a.nonzero()[0, 0], b.nonzero()[0, 0]
    state = swapped["recurrent_state", "env"]
    state[i], state[j] = state[j].clone(), state[i].clone()
    with pytest.raises(AssertionError, match="another env"):
        check_recurrent_streams(swapped)


# ---------------------------------------------------------------- the store, unit by unit


def test_the_env_of_a_request_row():
    layout = counting_layout(num_workers=3, columns=4, chunk_steps=5, slots=2, splits=2)
    views = layout.views(bytearray(layout.nbytes))
    workers, requests = np.array([2, 0, 1]), np.array([7, 0, 19])
    rows = request_rows(layout, views, workers, requests)
    # request q = p * splits + g names split g's two columns of worker w
    assert request_envs(layout, rows).tolist() == [10, 11, 0, 1, 6, 7]
    env_index = views[("env_index",)].reshape(-1)
    env_index[:] = np.repeat(np.arange(3), 10 * 4) * 4 + np.tile(np.arange(4), 30)
    assert np.array_equal(request_envs(layout, rows), env_index[rows])


def store_for(num_envs=4, capacity=4):
    initial = {("count",): torch.zeros((), dtype=torch.int64)}
    store = StateStore(initial, num_envs=num_envs, capacity=capacity, store=True)
    ring_is_init = np.zeros(16, dtype=bool)
    store.bind(ring_is_init, np.arange(16) % num_envs)  # ring row r is env r % 4
    return store, ring_is_init


def count_step(inputs, state, is_init):
    return {("action",): state[("count",)].clone()}, {("count",): state[("count",)] + 1}


def test_padded_rows_go_to_scratch_rows_and_touch_no_env():
    store, _ = store_for()
    store.load(np.array([1]))
    store.upload()
    for _ in range(3):  # a padded batch of 4 whose valid row is env 1's
        out = store.run(count_step, {(): torch.zeros(4, 1)})
    counts = store.states[("count",)]
    assert counts[:4].tolist() == [0, 3, 0, 0], "only env 1 advanced"
    assert out[("recurrent_state", "count")].tolist()[0] == 2
    assert store.rows[1].tolist() == [1, 6, 7, 8]  # one scratch row each, past row 4's
    assert store.states[("count",)][4].item() == 0  # the initial state's row, untouched


def test_is_init_resets_before_the_forward_and_an_env_twice_keeps_the_later_row():
    store, is_init = store_for()
    store.load(np.array([2, 3]))
    store.run(count_step, {(): torch.zeros(2, 1)})
    store.load(np.array([2, 3]))
    store.run(count_step, {(): torch.zeros(2, 1)})
    is_init[6] = True  # ring row 6: env 2, a new episode
    store.load(np.array([6, 3]))
    assert store.rows.tolist() == [[4, 3, 7, 8], [2, 3, 7, 8]]  # read the initial state
    out = store.run(count_step, {(): torch.zeros(2, 1)})
    assert out[("action",)].tolist() == [0, 2]
    # A restarted worker's predecessor's stale request for env 3, then the new worker's
    # own (step 0) in the same batch: the later row alone writes env 3's state.
    is_init[7] = True
    store.load(np.array([3, 7]))
    assert store.rows[1].tolist()[:2] == [5, 3]  # the earlier row writes a scratch row
    out = store.run(count_step, {(): torch.zeros(2, 1)})
    assert out[("action",)].tolist()[1] == 0
    assert store.states[("count",)][3].item() == 1


# ---------------------------------------------------------------- bad input


class Recurrent(torch.nn.Module):
    """A recurrent policy whose parts a test replaces."""

    def __init__(self, state=None, step=None):
        super().__init__()
        self._state = state if state is not None else {"h": torch.zeros(3)}
        self._step = step or (lambda obs, s: ((obs[:, 2] % 5), s))

    def initial_state(self):
        return self._state() if callable(self._state) else self._state

    def forward(self, obs, state):
        return self._step(obs, state)


def add_one(s):
    return {"h": s["h"] + 1}


@pytest.mark.parametrize(
    ("policy", "error", "match"),
    [
        (Recurrent(state=[torch.zeros(3)]), TypeError, r"initial_state\(\) must be a tensor"),
        (Recurrent(state={"h": np.zeros(3)}), TypeError, r"\['h'\] is a ndarray"),
        (Recurrent(state={}), ValueError, "empty dict"),
        (Recurrent(state=lambda: 1 / 0), ValueError, r"initial_state\(\) raised"),
        (Recurrent(step=lambda obs, s: obs[:, 2] % 5), ValueError, r"return \(outputs, new_st"),
        (Recurrent(step=lambda obs, s: (obs[:, 2] % 5, {"x": s["h"]})), ValueError, "leaves"),
        (Recurrent(step=lambda obs, s: (obs[:, 2] % 5, s["h"])), ValueError, "leaves"),
        (
            Recurrent(step=lambda obs, s: (obs[:, 2] % 5, {"h": s["h"][:, :2]})),
            ValueError,
            r"new_state\['h'\] has shape \(2, 2\); expected \(2, 3\)",
        ),
        (
            Recurrent(step=lambda obs, s: (obs[:, 2] % 5, {"h": s["h"].double()})),
            ValueError,
            r"new_state\['h'\] has dtype torch.float64; initial_state\(\) has torch.float32",
        ),
        (
            Recurrent(step=lambda obs, s: ({"action": obs[:, 2] % 5, "is_init": obs}, s)),
            ValueError,
            "named like a key the collector writes",
        ),
    ],
)
def test_bad_recurrent_policies_fail_at_construction_naming_the_problem(policy, error, match):
    with pytest.raises(error, match=match):
        make(policy=policy)


def test_a_state_numpy_cannot_hold_needs_store_recurrent_state_false():
    class Half(RecurrentCountingPolicy):
        def initial_state(self):
            return {**super().initial_state(), "memory": torch.zeros(3, dtype=torch.bfloat16)}

        def forward(self, obs, state):
            out, new = super().forward(obs, state)
            return out, {**new, "memory": state["memory"] + 1}

    with pytest.raises(ValueError, match=r"\['memory'\] has dtype torch.bfloat16.*store_rec"):
        make(policy=Half())
    with make(policy=Half(), store_recurrent_state=False) as c:
        data = collect(c)
    check_recurrent_streams(data, stored=False)


def test_store_recurrent_state_must_be_a_bool():
    with pytest.raises(ValueError, match="store_recurrent_state must be True or False, got 1"):
        make(store_recurrent_state=1)


def test_a_tensordict_module_that_writes_no_next_state_fails_at_construction():
    policy = TensorDictModule(
        lambda obs, h: obs[:, 2] % 5,
        in_keys=["observation", ("recurrent_state", "h")],
        out_keys=["action"],
    )
    policy.initial_state = lambda: {"h": torch.zeros(2)}
    with pytest.raises(ValueError, match=r"must write \('next', 'recurrent_state'\)"):
        make(policy=policy)


def test_a_state_that_turns_bad_after_the_probe_fails_at_its_batch():
    class TurnsBad(RecurrentCountingPolicy):
        def forward(self, obs, state):
            out, new = super().forward(obs, state)
            if bool((state["count"] >= 2).any()):
                new = {"count": new["count"].float(), "env": new["env"]}
            return out, new

    bad = r"new_state\['count'\] has dtype torch.float32"
    with pytest.raises(InferenceError, match=bad), make(policy=TurnsBad()) as c:
        collect(c)


def test_the_inference_process_checks_the_policy_it_builds_is_recurrent_too():
    driver = os.getpid()

    def factory():  # recurrent in the driver's probe, feed-forward in the inference process
        import os

        from helpers import CountingPolicy, RecurrentCountingPolicy

        return RecurrentCountingPolicy() if os.getpid() == driver else CountingPolicy()

    with pytest.raises(ValueError, match=r"lacks initial_state\(\)"):
        from_factory(factory, n=2)
