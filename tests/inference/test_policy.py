"""PolicyRunner: both calling conventions and what the policy may return."""

import numpy as np
import pytest
import torch
from tensordict import TensorDict
from tensordict.nn import InteractionType, TensorDictModule
from tensordict.nn.probabilistic import interaction_type

from rlcollect.inference.policy import PolicyRunner, output_fields


class Fn(torch.nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x)


OBS = {(): np.arange(12, dtype=np.float32).reshape(3, 4)}


def run(fn, obs=OBS, paths=((),)):
    return PolicyRunner(Fn(fn), device=torch.device("cpu"), observation_paths=paths)(obs)


def test_tensor_output_is_the_action():
    out = run(lambda x: x[:, 0].long())
    assert list(out) == [("action",)]
    assert out[("action",)].tolist() == [0, 4, 8]


def test_mapping_and_tensordict_outputs_keep_every_key():
    out = run(lambda x: {"action": x[:, 0].long(), "value": x.sum(-1)})
    assert set(out) == {("action",), ("value",)}
    out = run(lambda x: TensorDict({"action": x[:, 0], "aux": {"h": x}}, batch_size=[3]))
    assert set(out) == {("action",), ("aux", "h")}


def test_tensordict_module_reads_observation_and_writes_out_keys():
    module = TensorDictModule(
        lambda o: (o.sum(-1), o * 2), in_keys=["observation"], out_keys=["action", "double"]
    )
    out = PolicyRunner(module, device=torch.device("cpu"), observation_paths=((),))(OBS)
    assert set(out) == {("action",), ("double",)}
    assert torch.equal(out[("double",)], torch.from_numpy(OBS[()]) * 2)


def test_dict_observations_reach_a_plain_module_as_a_tensordict():
    obs = {("a",): np.ones((2, 3), np.float32), ("b", "c"): np.zeros((2, 1), np.uint8)}
    seen = {}

    def fn(td):
        seen["td"] = td
        return td["a"][:, 0].long()

    run(fn, obs, paths=(("a",), ("b", "c")))
    assert seen["td"]["b", "c"].dtype == torch.uint8


def test_output_fields_check_the_action_space():
    import gymnasium as gym

    outputs = {("action",): torch.zeros(2, 3), ("value",): torch.zeros(2, dtype=torch.float64)}
    action, extras = output_fields(outputs, gym.spaces.Box(-1, 1, (3,), np.float32))
    assert action.dtype == np.float32 and action.shape == (3,)
    assert extras[0].key == ("value",) and extras[0].dtype == np.float64
    with pytest.raises(ValueError, match="needs \\(2,\\)"):
        output_fields(outputs, gym.spaces.MultiDiscrete([2, 2]))
    with pytest.raises(TypeError, match="numpy cannot hold"):
        output_fields(
            {("action",): torch.zeros(2, 3), ("x",): torch.zeros(2, dtype=torch.bfloat16)},
            gym.spaces.Box(-1, 1, (3,), np.float32),
        )
    with pytest.raises(TypeError, match="not supported"):
        output_fields(outputs, gym.spaces.Text(5))


class RecordsInteractionType(torch.nn.Module):
    """Records tensordict's interaction type at each call; recurrent with ``state``."""

    def __init__(self, recurrent=False):
        super().__init__()
        self.seen = []
        if recurrent:
            self.initial_state = lambda: {"h": torch.zeros(1)}

    def forward(self, obs, h=None):
        self.seen.append(interaction_type())
        action = obs[:, 0].long()
        return action if h is None else (action, h + 1)


@pytest.mark.parametrize("recurrent", [False, True])
def test_a_tensordict_module_is_called_under_the_exploration_type(recurrent):
    inner = RecordsInteractionType(recurrent)
    in_keys, out_keys = ["observation"], ["action"]
    if recurrent:
        in_keys.append(("recurrent_state", "h"))
        out_keys.append(("next", "recurrent_state", "h"))
    module = TensorDictModule(inner, in_keys=in_keys, out_keys=out_keys)
    if recurrent:
        module.initial_state = inner.initial_state
    for kind in ("random", "deterministic", "MODE"):
        runner = PolicyRunner(
            module, device=torch.device("cpu"), observation_paths=((),), exploration_type=kind
        )
        runner(OBS)
    assert inner.seen == [InteractionType.RANDOM, InteractionType.DETERMINISTIC, "mode"]
    assert interaction_type() is None  # the caller's own type, restored


def test_a_plain_module_is_called_as_it_is():
    inner = RecordsInteractionType()
    PolicyRunner(inner, device=torch.device("cpu"), observation_paths=((),))(OBS)
    assert inner.seen == [None]


def test_an_exploration_type_is_one_of_tensordicts():
    with pytest.raises(ValueError, match=r"exploration_type must be one of \['random'"):
        PolicyRunner(
            Fn(lambda x: x), device=torch.device("cpu"), observation_paths=((),),
            exploration_type="median-ish",
        )  # fmt: skip
