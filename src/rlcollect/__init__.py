"""rlcollect: fast asynchronous reinforcement-learning data collection.

The names below are re-exported lazily: worker processes import parts of this package
and must not pay for (or be able to see) torch, which the collector itself needs.

Examples:
    >>> import rlcollect
    >>> rlcollect.__all__
    ['AsyncBatchedCollector', 'CollectorError', 'InferenceError', 'ReplayBuffer', 'WorkerError']
    >>> from rlcollect import AsyncBatchedCollector, ReplayBuffer
    >>> AsyncBatchedCollector.__module__
    'rlcollect.collector.collector'
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rlcollect.collector.collector import AsyncBatchedCollector
    from rlcollect.errors import CollectorError, InferenceError, WorkerError
    from rlcollect.replay.buffer import ReplayBuffer

__all__ = [
    "AsyncBatchedCollector",
    "CollectorError",
    "InferenceError",
    "ReplayBuffer",
    "WorkerError",
]

_HOMES = {
    "AsyncBatchedCollector": "rlcollect.collector.collector",
    "CollectorError": "rlcollect.errors",
    "InferenceError": "rlcollect.errors",
    "ReplayBuffer": "rlcollect.replay.buffer",
    "WorkerError": "rlcollect.errors",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'rlcollect' has no attribute {name!r}")
    return getattr(import_module(home), name)


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
