"""The actions a worker hands its envs, checked against the action space first.

A policy that chooses an action outside a discrete action space (7 for
``Discrete(5)``, a ``MultiDiscrete`` entry past its ``nvec``) would otherwise reach the
env unchecked: many envs index a table with it and step on with wrong data, or fail
with an error that blames the env. The worker checks every action against the space's
bounds before the env sees it, at little cost: two integer comparisons per env step for
a ``Discrete`` space (the usual case; ``loop.py`` keeps them inline), one numpy
comparison per vector env step (``vector_env.py``). A ``Box``'s bounds are not checked:
continuous policies sample past them routinely, and clipping them is the env's (as
gymnasium's ``ClipAction`` does).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from gymnasium import spaces

__all__ = ["ActionBounds", "action_bounds", "outside", "outside_error"]

#: The lowest and highest action of each entry (ints, or arrays for ``MultiDiscrete``).
ActionBounds = tuple[Any, Any]


def action_bounds(space: Any) -> ActionBounds | None:
    """The bounds every action of ``space`` lies within, or None where none is checked
    (a ``Box``, any other space)."""
    if isinstance(space, spaces.Discrete):
        return int(space.start), int(space.start + space.n - 1)
    if isinstance(space, spaces.MultiDiscrete):
        return space.start, space.start + space.nvec - 1
    if isinstance(space, spaces.MultiBinary):
        return 0, 1
    return None


def outside(actions: np.ndarray, bounds: ActionBounds) -> np.ndarray:
    """Which of ``actions`` (one per row, each of the space's shape) lie outside."""
    low, high = bounds
    bad: np.ndarray = (actions < low) | (actions > high)
    if bad.ndim > 1:
        return np.asarray(bad.reshape(len(bad), -1).any(axis=1))
    return bad


def outside_error(action: Any, where: str, space: Any) -> ValueError:
    """The error for ``action``, chosen for ``where`` (``"env 3"``), outside ``space``."""
    shown = action.tolist() if isinstance(action, np.ndarray) else action
    return ValueError(
        f"the policy chose action {shown} for {where}, outside its action space {space}"
    )
