"""Building a server and its action step: the one place that picks the step's strategy.

The action step is chosen once, here, from the policy's device and kind (``step.py``:
on the host or gathered on the device; ``recurrent_step.py``: the same with every env's
state), then compiled and captured before any batch is served. :func:`build_server` is
what every backend that serves a batching server calls (``backend.py`` in this
process, ``process.py`` in its own).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import torch

from rlcollect.inference.config import InferenceConfig
from rlcollect.inference.policy import PolicyRunner
from rlcollect.inference.recurrent import Leaves, StateStore
from rlcollect.inference.recurrent_step import RecurrentDeviceStep, RecurrentHostStep
from rlcollect.inference.server import InferenceServer
from rlcollect.inference.step import ActionStep, DeviceStep, HostStep, buckets_for
from rlcollect.transports.base import RequestEnd
from rlcollect.transports.layout import Field, Key, Path

# build_server is the backends' (backend.py, process.py), not the public API.
__all__ = ["build_action_step"]


def build_server(
    policy: torch.nn.Module, config: InferenceConfig, end: RequestEnd
) -> InferenceServer:
    """The server for ``policy`` (already on ``config.device``), not started yet: the
    action step is built (compiled, captured) here."""
    device = torch.device(config.device)
    runner = PolicyRunner(
        policy,
        device=device,
        observation_paths=config.observation_paths,
        exploration_type=config.exploration_type,
    )
    if runner.recurrent != config.recurrent:
        # The inference process builds its own policy: it must be the kind that was probed.
        has, kind = ("lacks", "recurrent") if config.recurrent else ("has", "feed-forward")
        raise ValueError(
            f"the served policy {has} initial_state(), but the policy probed at construction "
            f"was {kind}"
        )
    layout = config.layout
    step = build_action_step(
        runner,
        dict(config.observations),
        dict(config.outputs),
        capacity=config.capacity,
        compile_options=config.compile_options,
        cuda_graph=config.cuda_graph,
        num_envs=layout.num_workers * layout.columns,
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
        stall_timeout=config.stall_timeout,
    )


def build_action_step(
    runner: PolicyRunner,
    observations: Mapping[Path, Field],
    outputs: Mapping[Key, Field],
    *,
    capacity: int,
    compile_options: Mapping[str, Any] | None = None,
    cuda_graph: bool = False,
    num_envs: int | None = None,
    store_recurrent_state: bool = True,
    envs_may_repeat: bool = True,
) -> ActionStep:
    """The action step an :class:`~rlcollect.inference.server.InferenceServer` runs per
    batch: gather the observations, run the policy, return its outputs on the host.

    The strategy follows ``runner.device`` and ``runner.recurrent``, chosen once here:
    on the CPU the policy reads the gathered rows in place; on a CUDA device the batch
    is gathered on the GPU from the page-locked ring, optionally through ``torch.compile``
    and CUDA graphs (each padded batch size compiled or captured before any batch is
    served). The step is opaque: pass it to the server, which owns it from then on.

    Args:
        runner: the policy and its calling convention.
        observations: the ring's observation field for each of ``runner.paths``.
        outputs: the ring's field for each key the policy returns (``("action",)`` and
            any extra output).
        capacity: most rows one batch holds (at least the server's ``max_batch_size``).
        compile_options: ``torch.compile`` keyword arguments, or None for no compile
            (CUDA only).
        cuda_graph: capture the step as a CUDA graph per padded batch size (CUDA only).
        num_envs: envs served, for a recurrent policy (``runner.recurrent``): the step
            then holds every env's state (``inference/recurrent.py``).
        store_recurrent_state: a recurrent policy's step returns the state each action
            was computed from as the output ``("recurrent_state", *path)``.
        envs_may_repeat: one batch may name an env twice (worker restarts: a stale
            request of the restarted worker's predecessor), so a recurrent policy's step
            checks every batch for it.

    Returns:
        The step, for :class:`~rlcollect.inference.server.InferenceServer`.

    Raises:
        ValueError: the policy failed while being compiled, captured or warmed up, or
            ``compile_options`` or ``cuda_graph`` given for a policy off CUDA.

    Examples:
        A step for a policy on the CPU, over a ring of CountingEnv fields (see
        :class:`~rlcollect.inference.server.InferenceServer` for one being served):

        >>> import torch
        >>> from rlcollect.inference import PolicyRunner, build_action_step
        >>> from rlcollect.testing import counting_layout
        >>> layout = counting_layout(num_workers=1, columns=2, chunk_steps=4, slots=2)
        >>> fields = {field.key: field for field in layout.fields}
        >>> runner = PolicyRunner(
        ...     torch.nn.Identity(), device=torch.device("cpu"), observation_paths=((),)
        ... )
        >>> step = build_action_step(
        ...     runner,
        ...     {(): fields[("observation",)]},
        ...     {("action",): fields[("action",)]},
        ...     capacity=2,
        ... )
        >>> step.capacity
        2
        >>> build_action_step(runner, {}, {}, capacity=2, cuda_graph=True)
        Traceback (most recent call last):
        ...
        ValueError: compile_options and cuda_graph need a policy on a CUDA device; the ...
    """
    on_device = runner.device.type == "cuda"
    if not on_device and (compile_options is not None or cuda_graph):
        raise ValueError(
            f"compile_options and cuda_graph need a policy on a CUDA device; the runner's "
            f"is {runner.device}"
        )
    host: Callable[..., HostStep] = HostStep
    device: Callable[..., DeviceStep] = DeviceStep
    if runner.initial_state is not None:
        rows = buckets_for(capacity)[-1] if on_device else capacity  # padded batches too
        states = _state_store(
            runner, runner.initial_state, num_envs, rows, store_recurrent_state, envs_may_repeat
        )
        host = functools.partial(RecurrentHostStep, states=states)
        device = functools.partial(RecurrentDeviceStep, states=states)
    if not on_device:
        return host(runner, observations, capacity)
    try:  # compiling, capturing and warming up run the policy
        return device(
            runner,
            observations,
            outputs,
            capacity,
            compile_options=compile_options,
            cuda_graph=cuda_graph,
        )
    except Exception as exc:
        raise _failed(exc, compiled=compile_options is not None, cuda_graph=cuda_graph) from exc


def _state_store(
    runner: PolicyRunner,
    initial: Leaves,
    num_envs: int | None,
    capacity: int,
    store: bool,
    repeats: bool,
) -> StateStore:
    """Every env's state, for a recurrent policy's step (``inference/recurrent.py``)."""
    if num_envs is None:
        raise ValueError("a recurrent policy's action step needs num_envs")
    return StateStore(
        initial,
        num_envs=num_envs,
        capacity=capacity,
        store=store,
        flags=runner.tensordict_policy,  # only a TensorDictModule may read is_init
        repeats=repeats,
    )


def _failed(exc: Exception, *, compiled: bool, cuda_graph: bool) -> ValueError:
    """The policy's failure while a device step compiled, captured or warmed it up."""
    what = "capturing the action step as a CUDA graph" if cuda_graph else "warming up"
    if compiled:
        what = "compiling the action step" + (" and capturing it" if cuda_graph else "")
    return ValueError(f"the policy failed while {what}: {type(exc).__name__}: {exc}")
