"""Collection spread over the nodes of a Ray cluster (the optional extra ``rlcollect[ray]``).

Examples:
    >>> from rlcollect.distributed import RayCollector
    >>> RayCollector.__module__
    'rlcollect.distributed.collector'
"""

from __future__ import annotations

try:
    import ray  # noqa: F401  (only to say what is missing, before anything else fails)
except ImportError as exc:
    raise ImportError(
        "rlcollect.distributed needs Ray, which is not installed: pip install rlcollect[ray]"
    ) from exc

from rlcollect.distributed.collector import RayCollector

__all__ = ["RayCollector"]
