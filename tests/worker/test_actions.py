"""Actions are checked against the bounds of discrete action spaces, never a Box's."""

import numpy as np
from gymnasium import spaces

from rlcollect.worker.actions import action_bounds, outside, outside_error


def test_the_bounds_of_each_discrete_space():
    assert action_bounds(spaces.Discrete(5, start=-2)) == (-2, 2)
    low, high = action_bounds(spaces.MultiDiscrete([3, 4], start=[1, 0]))
    assert low.tolist() == [1, 0] and high.tolist() == [3, 3]
    assert action_bounds(spaces.MultiBinary(3)) == (0, 1)
    assert action_bounds(spaces.Box(-1, 1, (2,))) is None  # clipping is the env's


def test_outside_names_each_row_past_the_bounds():
    bounds = action_bounds(spaces.MultiDiscrete([3, 4]))
    rows = np.array([[0, 3], [3, 0], [2, -1]])
    assert outside(rows, bounds).tolist() == [False, True, True]
    assert outside(np.array([4, 5, -1]), (0, 4)).tolist() == [False, True, True]
    message = str(outside_error(np.array([3, 0]), "env 2", spaces.MultiDiscrete([3, 4])))
    assert (
        message
        == "the policy chose action [3, 0] for env 2, outside its action space MultiDiscrete([3 4])"
    )
