"""Checks of one numeric value: one rule for every numeric keyword of the collector.

* A count (``frames_per_batch``, ``seed``, ``max_worker_restarts``...) is an int,
  Python's or numpy's; never a bool (which Python counts as an int) nor a float, even
  a whole one (``policy_lag=1.0`` is refused as ``frames_per_batch=2.0`` is).
* A number of seconds or a ratio is a real number, Python's or numpy's; never a bool;
  NaN fails every comparison and is refused with the rest.
* A flag is True or False, Python's or numpy's (``np.True_``).
* ``inf`` is accepted only where it means "never": ``stall_timeout=inf`` is no bound,
  as None is. ``batch_timeout`` and ``train_ratio`` must be finite.
* Anything else is a ``ValueError`` naming the keyword; each check returns the value as
  the plan uses it (a Python int or float), so that nothing after it sees numpy types.

``options.py`` gives each field of ``Options`` its check from here; ``checks.py`` checks
values together.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

__all__ = [
    "batch_size_of",
    "batch_timeout_of",
    "check_int",
    "check_stall_timeout",
    "is_auto",
    "is_flag",
    "is_int",
    "is_real",
    "policy_lag_of",
    "seed_of",
    "transition_chunk_size_of",
]


def is_int(value: Any) -> bool:
    """An int, Python's or numpy's, but no bool (which Python counts as an int)."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def is_real(value: Any) -> bool:
    """A real number, Python's or numpy's (ints included), but no bool."""
    return is_int(value) or isinstance(value, (float, np.floating))


def is_flag(value: Any) -> bool:
    """True or False, Python's or numpy's."""
    return isinstance(value, (bool, np.bool_))


def check_int(name: str, value: Any, *, minimum: int, extra: str = "") -> int:
    """``value`` as an int, once it is an int >= ``minimum`` (numpy's too)."""
    if not is_int(value) or value < minimum:
        raise ValueError(
            f"{name} must be an int >= {minimum}{' ' + extra if extra else ''}, got {value!r}"
        )
    return int(value)


_SEED_LIMIT = 2**64  # torch's generators take seeds below it (the policy's stream)


def seed_of(seed: Any) -> int | None:
    """``seed``: None, or an int from 0 to 2**64 - 1."""
    if seed is None:
        return None
    value = check_int("seed", seed, minimum=0, extra="or None")
    if value >= _SEED_LIMIT:
        raise ValueError(
            f"seed must be below 2**64 (the policy's random stream takes a 64-bit seed), "
            f"got {seed!r}"
        )
    return value


def batch_timeout_of(value: Any) -> float:
    """``batch_timeout``: seconds >= 0, finite: the server must answer every request."""
    if not is_real(value) or not value >= 0:
        raise ValueError(f"batch_timeout must be a number >= 0, got {value!r}")
    if not math.isfinite(value):
        raise ValueError(
            f"batch_timeout must be finite: the server calls the policy on fewer than "
            f"min_batch_size rows once it has passed; got {value!r}"
        )
    return float(value)


def batch_size_of(name: str, value: Any) -> int:
    """``max_batch_size`` or ``min_batch_size``: an int >= 1."""
    if not is_int(value) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return int(value)


def check_stall_timeout(value: Any) -> float | None:
    """``stall_timeout``: seconds > 0; None or inf: no bound (None is what the plan uses)."""
    if value is None:
        return None
    if not is_real(value) or not value > 0:
        raise ValueError(f"stall_timeout must be a number of seconds > 0, or None, got {value!r}")
    return None if math.isinf(value) else float(value)


def transition_chunk_size_of(chunk: Any) -> int | str:
    """``transition_chunk_size``: ``"auto"`` or an int >= 1."""
    if is_auto(chunk):
        return "auto"
    if not is_int(chunk) or chunk < 1:
        raise ValueError(f'transition_chunk_size must be "auto" or an int >= 1, got {chunk!r}')
    return int(chunk)


def policy_lag_of(policy_lag: Any) -> int:
    """``policy_lag``, 0 or 1."""
    if not is_int(policy_lag) or policy_lag not in (0, 1):
        raise ValueError(
            f"policy_lag must be 0 (each on-policy round starts when its batch is asked for) "
            f"or 1 (the next round starts as soon as a batch is handed out), got {policy_lag!r}"
        )
    return int(policy_lag)


def is_auto(value: Any) -> bool:
    """``value == "auto"``, for arguments that may also be ints or arrays."""
    return isinstance(value, str) and value == "auto"
