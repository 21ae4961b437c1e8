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

    __version__: str

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
    if name == "__version__":
        # The installed distribution's version, from its metadata (so never out of step
        # with pyproject.toml), read on first use: importlib.metadata is slow to import
        # (it parses e-mail headers), and every env worker process imports this package.
        # Not in __all__, which lists the API's names.
        from importlib.metadata import version

        return version("rlcollect")
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'rlcollect' has no attribute {name!r}")
    return getattr(import_module(home), name)


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__, "__version__"])
