"""The action step of a recurrent policy: the feed-forward steps plus the state store.

The two strategies of ``step.py``, each with the :class:`~rlcollect.inference.recurrent.StateStore`
around the policy call (gather, reset, forward, write back). A feed-forward policy never
comes here: its step is exactly the one of ``step.py``.

``attach_envs`` binds the store to the ring (which env each request row is, and its
``is_init`` field); ``load`` also fills the store's host buffers (the env and ``is_init``
of each row), and every copy up of a batch's inputs also uploads them, whole: the padded
rows of a graphed batch then name scratch rows, never an env's. On a GPU, the store's
work is part of what ``compile`` compiles around (the policy call itself is compiled) and
of what ``cuda_graph`` captures, in both graphs of ``DeviceStep``: one upload of the
batch's read and write rows, then one ``index_select`` and one ``index_copy_`` per state
leaf.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch

from rlcollect.inference.policy import PolicyRunner
from rlcollect.inference.recurrent import StateStore
from rlcollect.inference.step import ActionStep, DeviceStep, HostStep, StepTimes
from rlcollect.transports.layout import Field, Key, Path, RingLayout, request_envs

__all__ = ["RecurrentDeviceStep", "RecurrentHostStep"]


class _WithStates(ActionStep):
    """What both recurrent steps add to theirs: the store bound to the ring, and filled
    per batch before the step's own gather."""

    _store: StateStore

    def attach_envs(self, layout: RingLayout, views: Mapping[Key, np.ndarray]) -> None:
        is_init = layout.request_sources(views, ("is_init",))
        self._store.bind(is_init, request_envs(layout, np.arange(len(is_init))))

    def load(self, flat: np.ndarray) -> int:
        self._store.load(flat)
        return super().load(flat)


class RecurrentHostStep(_WithStates, HostStep):
    """A recurrent policy on the CPU; the store's tensors are CPU tensors."""

    def __init__(
        self,
        runner: PolicyRunner,
        observations: Mapping[Path, Field],
        capacity: int,
        states: StateStore,
    ) -> None:
        super().__init__(runner, observations, capacity)
        self.states = self._store = states

    def run(self, rows: int) -> tuple[dict[Key, np.ndarray], StepTimes]:
        rng = self._rng
        if rng is not None:
            rng.swap_in()
        try:
            with torch.inference_mode():
                inputs = {path: t[:rows] for path, t in self._tensors.items()}
                out = self._store.run(self._runner.call_recurrent, inputs)
        finally:
            if rng is not None:
                rng.swap_out()
        return {key: value.detach().numpy() for key, value in out.items()}, (0.0, 0.0)


class RecurrentDeviceStep(_WithStates, DeviceStep):
    """A recurrent policy on a CUDA device: eager, compiled and/or graphed."""

    def __init__(
        self,
        runner: PolicyRunner,
        observations: Mapping[Path, Field],
        outputs: Mapping[Key, Field],
        capacity: int,
        *,
        states: StateStore,
        compile_options: Mapping[str, Any] | None,
        cuda_graph: bool,
    ) -> None:
        # Set before the base class warms up and captures: those runs use the store.
        # Its env rows are all scratch until the first batch, so they touch no env.
        self.states = self._store = states
        super().__init__(
            runner,
            observations,
            outputs,
            capacity,
            compile_options=compile_options,
            cuda_graph=cuda_graph,
        )
        self._store.reset()  # whatever the warm-up and capture runs wrote

    def _build_step(
        self, runner: PolicyRunner, compile_options: Mapping[str, Any] | None
    ) -> Callable[[Mapping[Path, torch.Tensor]], dict[Key, torch.Tensor]]:
        call: Any = runner.call_recurrent
        if compile_options is not None:
            # Only the policy is compiled; the store's indexing stays as written (and is
            # captured with it under cuda_graph).
            call = torch.compile(runner.call_recurrent, **compile_options)
        states = self._store

        def step(inputs: Mapping[Path, torch.Tensor]) -> dict[Key, torch.Tensor]:
            return states.run(call, inputs)

        return step

    def attach(self, rings: Mapping[Path, np.ndarray], *, register: bool = True) -> None:
        super().attach(rings, register=register)
        self._store.reset()  # the whole-step capture ran the step once

    def _copy_up(self, rows: int) -> None:
        super()._copy_up(rows)
        self._store.upload()
