"""The collector's options are defined once (rlcollect/collector/options.py): the
signature, RayCollector's split and docs/arguments.md are held to that definition."""

import dataclasses
import importlib.util
import inspect
from pathlib import Path

import numpy as np
import pytest

from rlcollect import AsyncBatchedCollector
from rlcollect.collector.options import Options, arguments_table, driver_options

ROOT = Path(__file__).resolve().parents[2]


def _keyword_parameters() -> list[inspect.Parameter]:
    params = inspect.signature(AsyncBatchedCollector.__init__).parameters.values()
    return [p for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY]


def test_the_signature_is_the_options_in_order_with_their_defaults_and_types():
    fields = dataclasses.fields(Options)
    params = _keyword_parameters()
    assert [p.name for p in params] == [f.name for f in fields]
    for param, field in zip(params, fields, strict=True):
        default = inspect.Parameter.empty if field.default is dataclasses.MISSING else field.default
        assert param.default == default, param.name
        assert param.annotation == field.type, param.name  # both modules: string annotations


def test_every_option_has_a_one_line_help():
    for field in dataclasses.fields(Options):
        text = field.metadata["help"]
        assert text and "\n" not in text, field.name


def test_options_of_takes_the_options_and_leaves_the_rest():
    options = Options.of({"self": object(), "env_fns": [], "frames_per_batch": 8, "seed": 3})
    assert options.frames_per_batch == 8 and options.seed == 3
    assert options.total_frames == -1  # the default


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"frames_per_batch": 0}, "frames_per_batch must be an int >= 1"),
        ({"total_frames": 0}, "total_frames must be an int >= 1 or -1"),
        ({"seed": -1}, "seed must be an int >= 0"),
        ({"on_policy": 1}, "on_policy must be True or False"),
        ({"policy_lag": 2}, "policy_lag must be 0"),
        ({"inference_backend": "gpu"}, "inference_backend must be one of"),
        ({"stall_timeout": 0}, "stall_timeout must be a number of seconds > 0"),
    ],
)
def test_checked_names_the_option_that_is_wrong(kwargs, message):
    options = Options(**{"frames_per_batch": 8, **kwargs})
    with pytest.raises(ValueError, match=message):
        options.checked()


def test_checked_gives_each_value_as_the_plan_uses_it():
    options = Options(frames_per_batch=8, info_keys=["lives"], stall_timeout=5).checked()
    assert options.info_keys == ("lives",) and options.stall_timeout == 5.0
    assert isinstance(options.stall_timeout, float)


def test_checked_gives_python_numbers_and_an_endless_stall_timeout_as_none():
    options = Options(
        frames_per_batch=np.int64(8),
        seed=np.uint64(3),
        stall_timeout=float("inf"),
        on_policy=np.True_,
        policy_lag=np.int64(1),
        batch_timeout=np.float32(0.5),
    ).checked()
    assert type(options.frames_per_batch) is int and type(options.seed) is int
    assert options.stall_timeout is None  # no bound, as None
    assert options.on_policy is True and type(options.policy_lag) is int
    assert type(options.batch_timeout) is float and options.batch_timeout == 0.5


def test_the_driver_keeps_the_buffer_its_throttle_and_the_seed():
    assert driver_options() == {"replay_buffer", "train_ratio", "learning_starts", "seed"}


def test_the_arguments_page_is_generated_from_the_options():
    spec = importlib.util.spec_from_file_location("arguments", ROOT / "docs" / "arguments.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    page = (ROOT / "docs" / "arguments.md").read_text()
    assert page == module.page(), "docs/arguments.md is stale: run python docs/arguments.py"
    for field in dataclasses.fields(Options):
        assert f"| `{field.name}` |" in arguments_table()


def test_the_collectors_docstring_describes_every_option():
    doc = AsyncBatchedCollector.__doc__ or ""
    args = doc.split("Args:")[1].split("Attributes:")[0]
    for field in dataclasses.fields(Options):
        assert f"\n        {field.name}: " in args, field.name
