"""Invariant 7: bad input fails at construction or first batch, naming the problem."""

import functools
import threading

import gymnasium as gym
import numpy as np
import pytest
import torch
from envs import (
    BadFlagLater,
    BadRewardLater,
    FarObservationLater,
    NoneRewardLater,
    OtherActions,
    PicksActionTypes,
    TrustingEnv,
    WrongShape,
    cartpole,
    far_observation_vector,
    trusting_vector,
)
from helpers import CountingPolicy, counting_envs

from rlcollect import AsyncBatchedCollector, WorkerError
from rlcollect.testing import CountingEnv


def build(env_fns=None, policy=None, **kwargs):
    kwargs.setdefault("frames_per_batch", 8)
    kwargs.setdefault("total_frames", 16)
    kwargs.setdefault("policy_device", "cpu")
    c = AsyncBatchedCollector(
        counting_envs(4) if env_fns is None else env_fns,
        CountingPolicy() if policy is None else policy,
        **kwargs,
    )
    return c


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"frames_per_batch": 0}, "frames_per_batch must be an int >= 1"),
        ({"frames_per_batch": 2.5}, "frames_per_batch"),
        ({"frames_per_batch": True}, "frames_per_batch"),
        ({"total_frames": 0}, "total_frames must be an int >= 1 or -1"),
        ({"transport": "tcp"}, r"transport must be one of \['process_slots', 'thread'\]"),
        ({"envs_per_worker": 3}, "4 envs cannot be split into workers of envs_per_worker=3"),
        ({"envs_per_worker": 0}, "envs_per_worker must be an int >= 1"),
        ({"worker_splits": 0}, "worker_splits must be an int >= 1 or None"),
        ({"worker_splits": 2.0}, "worker_splits must be an int"),
        ({"worker_splits": True}, "worker_splits must be an int"),
        ({"worker_splits": "many"}, 'worker_splits must be an int >= 1 or None, or "auto"'),
        ({"envs_per_worker": "all"}, 'envs_per_worker must be an int >= 1 or "auto"'),
        (
            {"envs_per_worker": 4, "worker_splits": 3},
            "worker_splits=3 does not divide envs_per_worker=4",
        ),
        (
            {"envs_per_worker": 1, "worker_splits": 2},
            "worker_splits=2 does not divide envs_per_worker=1",
        ),
        (
            {"envs_per_worker": 2, "transition_chunk_size": 3},
            "transition_chunk_size=3 is not a multiple of envs_per_worker=2",
        ),
        ({"transition_chunk_size": "big"}, 'transition_chunk_size must be "auto" or an int'),
        ({"transition_chunk_size": 0}, "transition_chunk_size"),
        (
            {"min_batch_size": 5, "max_batch_size": 2},
            r"min_batch_size \(5\) exceeds max_batch_size",
        ),
        ({"max_batch_size": 0}, "max_batch_size must be a positive int"),
        ({"batch_timeout": -1.0}, "batch_timeout must be a number >= 0"),
        ({"seed": -1}, "seed must be an int >= 0 or None"),
        ({"policy_device": "tpu:0"}, "policy_device 'tpu:0' is not a torch device"),
    ],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        build(**kwargs)


# One rule for every numeric keyword: ints (Python or numpy) for counts, real numbers
# for seconds and ratios, inf only where it means "never", and a ValueError naming the
# keyword for anything else, raised by the constructor before any part starts.
@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"stall_timeout": float("nan")}, "stall_timeout must be a number of seconds > 0"),
        ({"stall_timeout": np.True_}, "stall_timeout must be a number of seconds > 0"),
        ({"seed": 2**64}, r"seed must be below 2\*\*64"),
        ({"seed": 1.0}, "seed must be an int >= 0 or None"),
        ({"batch_timeout": float("inf")}, "batch_timeout must be finite"),
        ({"batch_timeout": True}, "batch_timeout must be a number >= 0"),
        ({"batch_timeout": float("nan")}, "batch_timeout must be a number >= 0"),
        ({"max_batch_size": 2.0}, "max_batch_size must be a positive int"),
        ({"min_batch_size": np.float64(1)}, "min_batch_size must be a positive int"),
        ({"max_worker_restarts": 1.0}, "max_worker_restarts must be an int >= 0"),
        ({"learning_starts": 0.5, "train_ratio": 1.0}, "learning_starts must be an int >= 0"),
        ({"on_policy": True, "policy_lag": 1.0}, "policy_lag must be 0"),
        ({"on_policy": True, "policy_lag": np.True_}, "policy_lag must be 0"),
        (
            {"frames_per_batch": 10**12, "total_frames": -1},
            r"frames_per_batch=1000000000000: .* GiB, but .* GiB of memory available",
        ),
    ],
)
def test_every_numeric_keyword_follows_one_rule(kwargs, match):
    if "train_ratio" in kwargs:
        from rlcollect import ReplayBuffer

        kwargs["replay_buffer"] = ReplayBuffer(100)
    with pytest.raises(ValueError, match=match):
        build(transport="thread", **kwargs)


def test_numpy_numbers_and_an_endless_stall_timeout_are_accepted():
    """numpy integers wherever an int goes, numpy floats and bools wherever a number or
    a flag goes, ``stall_timeout=inf`` (no bound, as None), the largest 64-bit seed."""
    kwargs = {
        "frames_per_batch": np.int64(8),
        "total_frames": np.int32(16),
        "envs_per_worker": np.int64(2),
        "worker_splits": np.int64(1),
        "transition_chunk_size": np.int64(4),
        "max_batch_size": np.int64(4),
        "min_batch_size": np.int64(1),
        "batch_timeout": np.float32(1e-3),
        "seed": np.uint64(2**64 - 1),
        "max_worker_restarts": np.int64(0),
        "stall_timeout": float("inf"),
        "store_recurrent_state": np.True_,
        "cuda_graph": np.False_,
        "compile": np.False_,
    }
    with build(transport="thread", **kwargs) as c:
        data = torch.cat(list(c))
    assert data.batch_size[0] == 16
    assert type(c.frames_per_batch) is int and type(c.total_frames) is int
    assert type(c.transition_chunk_size) is int and c.transition_chunk_size == 4


def test_numpy_flags_and_ints_for_on_policy_rounds():
    with build(transport="thread", on_policy=np.True_, policy_lag=np.int64(1)) as c:
        assert c.policy_lag == 1 and type(c.policy_lag) is int
        assert all(b.batch_size[0] == 4 for b in c)  # [num_envs, T] = [4, 2]


def test_unknown_keyword_and_positional_configuration():
    with pytest.raises(TypeError, match="unexpected keyword argument 'frames_per_batches'"):
        AsyncBatchedCollector(counting_envs(2), CountingPolicy(), frames_per_batches=8)
    with pytest.raises(TypeError):
        AsyncBatchedCollector(counting_envs(2), CountingPolicy(), 8)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_requested_without_cuda():
    with pytest.raises(ValueError, match="CUDA is not available"):
        build(policy_device="cuda")


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"cuda_graph": True}, "compile and cuda_graph need a CUDA policy_device"),
        ({"compile": True}, "compile and cuda_graph need a CUDA policy_device"),
        ({"compile": "max"}, "compile must be True, False or a dict"),
        ({"cuda_graph": 1}, "cuda_graph must be True or False"),
    ],
)
def test_gpu_options_on_the_cpu(kwargs, match):
    with pytest.raises(ValueError, match=match):
        build(policy_device="cpu", **kwargs)


@pytest.mark.parametrize(
    ("env_fns", "error", "match"),
    [
        ([], ValueError, "env_fns is empty"),
        (cartpole, TypeError, "env_fns must be a sequence"),
        ([cartpole, 3], TypeError, r"env_fns\[1\] is a int, not a callable"),
        ([lambda: "not an env"], TypeError, "without gymnasium observation_space"),
        ([lambda: gym.make("NoSuchEnv-v0")], ValueError, "env_fns\\[0\\] raised while building"),
    ],
)
def test_bad_env_fns(env_fns, error, match):
    with pytest.raises(error, match=match):
        build(env_fns=env_fns, transport="thread")


def test_unpicklable_env_factory_names_the_env():
    lock = threading.Lock()

    def make():
        with lock:
            return CountingEnv(0)

    fns = [*counting_envs(2), make]
    with pytest.raises(TypeError, match=r"env_fns\[2\] cannot be pickled .* transport='thread'"):
        build(env_fns=fns, transport="process_slots")
    with build(env_fns=fns, transport="thread", total_frames=9, frames_per_batch=9) as c:
        assert len(list(c)) == 1  # threads need no pickling


class Returns(torch.nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, obs):
        return self.fn(obs)


@pytest.mark.parametrize(
    ("fn", "error", "match"),
    [
        (lambda o: {"logits": o.float()}, ValueError, "policy output has no 'action'"),
        (
            lambda o: o[:, :2].float().softmax(-1).argmax(-1, keepdim=True),
            ValueError,
            r"actions of shape \(1,\) per env; the action space Discrete\(5\) needs \(\)",
        ),
        (lambda o: o[:, 0].float(), TypeError, "float32 actions for the integer action space"),
        (lambda o: {"action": o[:, 0], "step": o[:, 0]}, ValueError, "a key the collector fills"),
        (lambda o: {"action": o[:, 0], "note": "hi"}, ValueError, "policy output 'note' is a str"),
        (lambda o: o[:1, 0], ValueError, "expected a leading batch dimension of 2"),
        (
            lambda o: torch.nn.functional.linear(o.float(), torch.zeros(2, 7)),
            ValueError,
            "policy failed on a batch of 2 sampled observations .*int64",
        ),
        (lambda o: [o[:, 0]], ValueError, "must return the action tensor, or a mapping"),
    ],
)
def test_bad_policies(fn, error, match):
    with pytest.raises(error, match=match):
        build(policy=Returns(fn), transport="thread")


def test_policy_that_is_not_a_module():
    with pytest.raises(TypeError, match=r"policy must be a torch\.nn\.Module"):
        build(policy=lambda obs: obs, transport="thread")


def test_replay_buffer_without_extend():
    with pytest.raises(TypeError, match="replay_buffer must have an extend"):
        build(replay_buffer={}, transport="thread")


def test_env_spaces_must_match(transport):
    fns = [*counting_envs(2), functools.partial(OtherActions, 2)]
    c = build(env_fns=fns, transport=transport, total_frames=-1)
    with pytest.raises(WorkerError, match=r"env 2 .*action_space Discrete\(3\), but env 0 has"):
        list(c)


def test_env_observation_of_the_wrong_shape(transport):
    fns = [*counting_envs(1), functools.partial(WrongShape, 1)]
    c = build(env_fns=fns, transport=transport, total_frames=-1)
    with pytest.raises(WorkerError, match=r"env 1 returned an observation of shape \(3,\)") as e:
        list(c)
    assert e.value.env_index == 1


@pytest.mark.parametrize(
    ("env", "match"),
    [(BadRewardLater, r"reward='a lot'"), (BadFlagLater, r"terminated='no'")],
    ids=["reward", "flag"],
)
def test_env_step_results_of_the_wrong_kind_name_the_env(transport, env, match):
    fns = [*counting_envs(1), functools.partial(env, 1)]
    c = build(env_fns=fns, transport=transport, total_frames=-1)
    with pytest.raises(WorkerError, match=rf"env 1 returned .*{match}.*real number") as e:
        list(c)
    assert e.value.env_index == 1
    assert "the step results check" in str(e.value)


def test_a_reward_of_none_is_refused_not_stored_as_nan(transport):
    """numpy would store None as NaN (and add it to the episode's return): refused like
    any other reward that is no real number."""
    fns = [*counting_envs(1), functools.partial(NoneRewardLater, 1)]
    # No frame budget: env 0 alone may fill any budget before env 1's worker has started
    # (a process spawn on a busy machine); collection ends on env 1's error.
    c = build(env_fns=fns, transport=transport, total_frames=-1)
    with pytest.raises(WorkerError, match=r"env 1 returned reward=None.*real number") as e:
        for batch in c:
            assert not batch["next", "reward"].isnan().any(), "None was stored as NaN"
    assert e.value.env_index == 1
    assert "the step results check" in str(e.value)


class ZeroPolicy(torch.nn.Module):
    def forward(self, observation):
        return torch.zeros(len(observation), dtype=torch.int64)


def test_an_observation_beyond_its_spaces_dtype_is_refused_not_stored_as_inf(transport):
    """A float64 observation for a float32 space is cast, as numpy does, unless a value
    would turn into inf: then the env is named, never an inf stored without a word."""
    fns = [functools.partial(FarObservationLater, i) for i in range(2)]
    c = build(env_fns=fns, policy=ZeroPolicy(), transport=transport, total_frames=-1)
    with pytest.raises(WorkerError, match=r"env \d returned an observation .*1e\+300.* inf"):
        for batch in c:
            assert batch["next", "observation"].isfinite().all(), "an inf was stored"


def test_a_vector_envs_observation_beyond_its_spaces_dtype_is_refused():
    c = build(env_fns=[far_observation_vector], policy=ZeroPolicy(), total_frames=800)
    with pytest.raises(WorkerError, match=r"observation .*1e\+300.* inf"):
        for batch in c:
            assert batch["next", "observation"].isfinite().all(), "an inf was stored"


class PastTheSpaceLater(CountingPolicy):
    """From its third call on, chooses actions 5 to 9 for a Discrete(5) space."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def forward(self, obs):
        out = super().forward(obs)
        self.calls += 1
        if self.calls >= 3:
            out["action"] = out["action"] + 5
        return out


@pytest.mark.parametrize(
    ("transport", "backend", "vector"),
    [
        ("thread", "thread", False),
        ("process_slots", "thread", False),
        ("process_slots", "worker", False),
        ("thread", "thread", True),
    ],
)
def test_an_action_outside_the_action_space_never_reaches_the_env(transport, backend, vector):
    fns = [functools.partial(TrustingEnv, i) for i in range(2)]
    if vector:
        fns = [trusting_vector]
    c = build(
        env_fns=fns,
        policy=PastTheSpaceLater(),
        transport=transport,
        inference_backend=backend,
        total_frames=800,
    )
    match = r"the policy chose action [5-9] for .*, outside its action space Discrete\(5\)"
    with pytest.raises(WorkerError, match=match) as e:
        for batch in c:
            assert (batch["next", "observation"][:, 3] < 5).all(), "the env got the action"
    assert "the action check" in str(e.value)


@pytest.mark.parametrize(
    ("transport", "backend"),
    [("thread", "thread"), ("process_slots", "thread"), ("thread", "worker")],
)
def test_a_discrete_action_reaches_the_env_as_a_numpy_int64(transport, backend):
    fns = [functools.partial(PicksActionTypes, i) for i in range(2)]
    c = build(env_fns=fns, transport=transport, inference_backend=backend, total_frames=64)
    with c:
        rows = sum(batch.numel() for batch in c)
    assert rows == 64  # every step took its action as given (the env raises otherwise)


def _vector_env_with(**attributes):
    from rlcollect.testing import CountingVectorEnv

    env = CountingVectorEnv(0, 4, 2)
    for name, value in attributes.items():
        setattr(env, name, value)
    return env


@pytest.mark.parametrize(
    ("attributes", "error", "match"),
    [
        ({"num_envs": 0}, TypeError, r"env_fns\[0\] returned a vector env with num_envs=0"),
        (
            {"batch_size": 5},
            ValueError,
            r"vector env with batch_size=5; it must be an int from 1 to num_envs=4",
        ),
    ],
)
def test_bad_vector_env_factories(attributes, error, match):
    with pytest.raises(error, match=match):
        build(env_fns=[functools.partial(_vector_env_with, **attributes)], transport="thread")
