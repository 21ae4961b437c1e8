"""Starting an inference backend: the only place that knows ``"thread"`` and ``"process"``.

Both backends serve the same server (:func:`~rlcollect.inference.build.build_server`),
built from the same :class:`~rlcollect.inference.config.InferenceConfig`: in this process
(``"thread"``), or in a process of its own that reads the workers' requests through the
transport's :class:`~rlcollect.transports.base.RequestChannel` (``"process"``).
What each backend is: ``inference/base.py``.
"""

from __future__ import annotations

from typing import Any

import torch

from rlcollect.inference.base import InferenceBackend
from rlcollect.inference.build import build_server
from rlcollect.inference.config import InferenceConfig
from rlcollect.inference.process import ProcessInference
from rlcollect.transports.base import ServerEnd, Transport

__all__ = ["start_backend"]


def start_backend(
    kind: str,
    config: InferenceConfig,
    *,
    served: torch.nn.Module | None,
    policy_source: Any,
    policy_is_factory: bool,
    transport: Transport,
    end: ServerEnd,
) -> InferenceBackend:
    """Start the ``kind`` backend serving ``end``'s workers; returns once it serves.

    ``"thread"`` serves ``served`` in this process; ``"process"`` sends
    ``policy_source`` (a policy, or a factory when ``policy_is_factory``) to a process of
    its own, which takes the transport's request channel over.
    """
    backend: InferenceBackend
    if kind == "thread":
        assert served is not None
        backend = build_server(served, config, end)
    elif kind == "process":
        backend = ProcessInference(
            transport.request_channel(),
            config,
            policy_source,
            policy_is_factory=policy_is_factory,
        )
    else:
        raise ValueError(f"unknown inference backend {kind!r}")
    try:
        backend.start()
    except BaseException:  # Ctrl-C included: nothing it started outlives the call
        backend.stop()
        raise
    return backend
