"""Starting an inference backend: the only place that knows ``"thread"`` and ``"process"``.

Both backends serve the same server (:func:`build_server`), built from the same
:class:`~rlcollect.inference.process.InferenceConfig`: in this process
(``"thread"``), or in a process of its own that reads the workers' requests through the
transport's :class:`~rlcollect.transports.base.RequestChannel` (``"process"``).
What each backend is: ``inference/base.py``.
"""

from __future__ import annotations

from typing import Any

import torch

from rlcollect.inference.base import InferenceBackend
from rlcollect.inference.policy import PolicyRunner
from rlcollect.inference.process import InferenceConfig, ProcessInference
from rlcollect.inference.server import InferenceServer
from rlcollect.inference.step import build_action_step
from rlcollect.transports.base import RequestEnd, ServerEnd, Transport

__all__ = ["build_server", "start_backend"]


def build_server(
    policy: torch.nn.Module, config: InferenceConfig, end: RequestEnd
) -> InferenceServer:
    """The server for ``policy`` (already on ``config.device``), not started yet: the
    action step is built (compiled, captured) here."""
    device = torch.device(config.device)
    runner = PolicyRunner(policy, device=device, observation_paths=config.observation_paths)
    if runner.recurrent != config.recurrent:
        # The inference process builds its own policy: it must be the kind that was probed.
        kind = "recurrent" if config.recurrent else "feed-forward"
        raise ValueError(
            f"the served policy {'lacks' if config.recurrent else 'has'} initial_state(), "
            f"but the policy probed at construction was {kind}"
        )
    layout = config.layout
    step = build_action_step(
        runner,
        dict(config.observations),
        dict(config.outputs),
        capacity=config.capacity,
        compile_options=config.compile_options,
        cuda_graph=config.cuda_graph,
        num_envs=layout.num_workers * layout.envs_per_worker,
        store_recurrent_state=config.store_recurrent_state,
        envs_may_repeat=config.restarts,
    )
    return InferenceServer(
        runner,
        step,
        end,
        layout=config.layout,
        batching=config.batching,
        output_keys=frozenset(key for key, _ in config.outputs),
        seed=config.seed,
    )


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
