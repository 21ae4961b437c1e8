"""env_throughput: the envs' own speed, and an env that fails reaches the caller."""

import functools

import gymnasium as gym
import pytest

from rlcollect.envspeed import env_throughput
from rlcollect.errors import CollectorError, RemoteTraceback
from rlcollect.testing import CountingEnv


def test_seconds_is_keyword_only():
    make_env = functools.partial(gym.make, "CartPole-v1")
    with pytest.raises(TypeError, match="positional argument"):
        env_throughput([make_env], 0.1)  # type: ignore[misc]


def test_an_env_that_raises_while_stepping_is_named_with_its_traceback():
    good = functools.partial(CountingEnv, 0)
    bad = functools.partial(CountingEnv, 1, fail_at=(0, 2))  # its third step raises
    with pytest.raises(CollectorError) as info:
        env_throughput([good, bad], seconds=0.5)
    assert str(info.value) == (
        "env_throughput: env 1 raised RuntimeError: CountingEnv 1 failed on purpose in step"
    )
    assert isinstance(info.value.__cause__, RemoteTraceback)
    assert "failed on purpose in step" in info.value.__cause__.tb


def test_an_env_that_cannot_be_built_stops_the_others_and_is_named():
    # The good env waits for the bad one at the start barrier, which the bad one breaks:
    # the error names the env that failed, not the one that was left waiting.
    good = functools.partial(CountingEnv, 0)
    bad = functools.partial(CountingEnv, 1, num_actions=0)  # Discrete(0) is refused
    with pytest.raises(CollectorError, match=r"^env_throughput: env 1 raised \w+"):
        env_throughput([good, bad], seconds=0.5)
