"""Calling the policy: both calling conventions, and the checks of what it returns.

A plain ``nn.Module`` receives the batched observation (a tensor, or a TensorDict for
dict observation spaces) on the policy device and returns the action tensor, or a
mapping / TensorDict holding ``action`` and extra outputs. A ``TensorDictModule``
receives a TensorDict holding ``observation`` and writes its ``out_keys``, which must
include ``action``. Either way the runner returns ``{key: tensor [B, ...]}``.

A recurrent policy (one with ``initial_state()``, see ``recurrent.py``) is called with
the batch's state too: a plain module as ``forward(observation, state)``, returning
``(outputs, new_state)``; a ``TensorDictModule`` with ``recurrent_state`` and ``is_init``
in its TensorDict, writing ``("next", "recurrent_state")``. ``outputs`` follow the rules
above; ``new_state`` must have the structure, shapes and dtypes of the state it got.

A ``TensorDictModule`` is called under an exploration type (tensordict's
``set_interaction_type``, which TorchRL's ``set_exploration_type`` is): ``"random"`` by
default, as TorchRL's own collectors act, so that a ``ProbabilisticActor`` samples its
actions and an exploration module (``EGreedyModule``, ``AdditiveGaussianModule``) adds
its noise; ``"deterministic"``, ``"mode"`` or ``"mean"`` for evaluation. The type is
set around the module's call inside :meth:`PolicyRunner.call`, the function the action
steps compile and capture, so it is in force whichever backend serves the policy and
while a CUDA graph is captured; eager calls of this process take turns (the setting is
the process's, see ``_INTERACTION_LOCK``). A plain ``nn.Module`` is called as it is: it
draws its own noise.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch

from rlcollect._tensordict import (
    InteractionType,
    TensorDict,
    TensorDictBase,
    TensorDictModuleBase,
    set_interaction_type,
)
from rlcollect.inference.recurrent import (
    IS_INIT_KEY,
    STATE_KEY,
    Leaves,
    check_new_state,
    flatten_state,
    initial_state_of,
    unflatten_state,
)
from rlcollect.transports.layout import Field, Key, Path

__all__ = ["PolicyRunner"]

#: The exploration types a ``TensorDictModule`` may be served under (tensordict's
#: ``InteractionType`` values): ``"random"`` samples, the others are for evaluation.
EXPLORATION_TYPES = ("random", "deterministic", "mode", "mean")

#: Keys the collector writes itself, and the ring's name for staged copies (vector envs);
#: a policy output may not use them.
RESERVED_KEYS = frozenset(
    {"observation", "next", "env_index", "episode", "step", "policy_version", "staged"}
)
#: Keys the collector writes for recurrent policies; their outputs may not use them either.
RECURRENT_KEYS = frozenset({STATE_KEY, IS_INIT_KEY})


class PolicyRunner:
    """Runs ``policy`` on numpy observation batches and returns its outputs by key.

    Both calling conventions of the collector: a plain module gets the observation
    tensor (a TensorDict for dict observations), a ``TensorDictModule`` a TensorDict
    holding ``observation``.

    Args:
        policy: a ``torch.nn.Module`` or a ``TensorDictModule``.
        device: where the policy runs; observations are moved there.
        observation_paths: the observation leaves, ``((),)`` for a plain array, else
            one name path per leaf of a dict observation space.
        exploration_type: what a ``TensorDictModule`` is called under (one of
            ``EXPLORATION_TYPES``); a plain module ignores it.

    A policy with ``initial_state()`` is recurrent (:attr:`initial_state` holds one env's
    state, checked here); call it with :meth:`call_recurrent`.

    Raises:
        TypeError: ``policy`` is not a module, or its ``initial_state()`` is not a tensor
            or a nested dict of tensors.
        ValueError: its ``initial_state()`` raised or returned an empty dict.

    Examples:
        >>> import numpy as np
        >>> import torch
        >>> from rlcollect.inference import PolicyRunner
        >>> class Greedy(torch.nn.Module):
        ...     def forward(self, observation):
        ...         return {"action": observation.argmax(-1), "value": observation.max(-1).values}
        >>> runner = PolicyRunner(Greedy(), device=torch.device("cpu"), observation_paths=((),))
        >>> outputs = runner({(): np.array([[0.1, 0.9], [0.7, 0.3]], dtype=np.float32)})
        >>> sorted(outputs), outputs[("action",)].tolist()
        ([('action',), ('value',)], [1, 0])
    """

    def __init__(
        self,
        policy: torch.nn.Module,
        *,
        device: torch.device,
        observation_paths: tuple[Path, ...],
        exploration_type: str = "random",
    ) -> None:
        if not isinstance(policy, torch.nn.Module):
            raise TypeError(
                f"policy must be a torch.nn.Module or a TensorDictModule, got {type(policy)!r}"
            )
        self.policy = policy
        self.device = device
        self.paths = observation_paths
        self.tensordict_policy = isinstance(policy, TensorDictModuleBase)
        self.exploration_type = exploration_type_of(exploration_type)
        self._interaction = InteractionType(self.exploration_type)
        self._dict_obs = observation_paths != ((),)
        #: One env's initial state by leaf, on ``device``; None for a feed-forward policy.
        self.initial_state: Leaves | None = initial_state_of(policy, device)

    def _call_module(self, td: TensorDictBase) -> Any:
        """The ``TensorDictModule`` on ``td``, under this runner's exploration type."""
        if torch.compiler.is_compiling():
            with set_interaction_type(self._interaction):
                return self.policy(td)
        with _INTERACTION_LOCK, set_interaction_type(self._interaction):
            return self.policy(td)

    @property
    def recurrent(self) -> bool:
        """True for a policy with ``initial_state()``."""
        return self.initial_state is not None

    def __call__(self, observations: Mapping[Path, np.ndarray]) -> dict[Key, torch.Tensor]:
        """``observations[path]`` is ``[B, *shape]``; returns every output as ``[B, ...]``.

        Raises:
            KeyError: the policy returned no ``action``.
            TypeError: the policy returned something other than a tensor, a mapping of
                tensors or a TensorDict.
            ValueError: an output lacks the leading batch dimension ``B``.
        """
        tensors = {
            path: torch.from_numpy(arr).to(self.device) for path, arr in observations.items()
        }
        with torch.inference_mode():
            if self.initial_state is None:
                return self.call(tensors)
            # A recurrent policy, every row at the start of an episode.
            batch = next(iter(tensors.values())).shape[0]
            state = {p: t.expand(batch, *t.shape).clone() for p, t in self.initial_state.items()}
            is_init = torch.ones(batch, dtype=torch.bool, device=self.device)
            return self.call_recurrent(tensors, state, is_init)[0]

    def call(self, tensors: Mapping[Path, torch.Tensor]) -> dict[Key, torch.Tensor]:
        """The policy on observation tensors already on the device (graph-capturable)."""
        batch = next(iter(tensors.values())).shape[0]
        if self.tensordict_policy:
            td = TensorDict(
                {("observation", *path): t for path, t in tensors.items()},
                batch_size=[batch],
                device=self.device,
            )
            out = self._call_module(td)
            return _outputs_of_tensordict(out if out is not None else td, batch)
        if self._dict_obs:
            arg: Any = TensorDict(dict(tensors), batch_size=[batch], device=self.device)
        else:
            arg = tensors[()]
        return _outputs(self.policy(arg), batch)

    def call_recurrent(
        self, tensors: Mapping[Path, torch.Tensor], state: Leaves, is_init: torch.Tensor
    ) -> tuple[dict[Key, torch.Tensor], Leaves]:
        """A recurrent policy on observations and the batch's ``state`` (leaves ``[B,
        *shape]``), all on the device (graph-capturable): its outputs and new state.

        Raises:
            TypeError: a plain module returned something other than ``(outputs,
                new_state)``, or a ``new_state`` that is no tensor or dict of tensors.
            ValueError: a ``TensorDictModule`` wrote no ``("next", "recurrent_state")``;
                ``new_state`` differs from ``state`` in structure, shape, dtype or
                device; or an output named like a key the collector writes.
        """
        assert self.initial_state is not None, "call_recurrent needs a recurrent policy"
        batch = next(iter(tensors.values())).shape[0]
        if self.tensordict_policy:
            td = TensorDict(
                {("observation", *path): t for path, t in tensors.items()},
                batch_size=[batch],
                device=self.device,
            )
            for path, value in state.items():
                td.set((STATE_KEY, *path), value)
            td.set(IS_INIT_KEY, is_init)
            result = self._call_module(td)
            result = result if result is not None else td
            nxt = (("next", STATE_KEY, *path) for path in self.initial_state)
            if any(key not in result.keys(include_nested=True) for key in nxt):
                raise ValueError(
                    "a recurrent TensorDictModule must write ('next', 'recurrent_state') (the "
                    "new state, structured like initial_state()); this one wrote "
                    f"{sorted(map(str, result.keys(include_nested=True, leaves_only=True)))}"
                )
            new = {path: result.get(("next", STATE_KEY, *path)) for path in self.initial_state}
            outputs = _outputs_of_tensordict(result, batch, given=_given_with_state)
        else:
            if self._dict_obs:
                arg: Any = TensorDict(dict(tensors), batch_size=[batch], device=self.device)
            else:
                arg = tensors[()]
            returned = self.policy(arg, unflatten_state(state))
            if not isinstance(returned, tuple) or len(returned) != 2:
                raise TypeError(
                    "a recurrent policy (it has initial_state()) must return (outputs, "
                    f"new_state); it returned {_describe(returned)}"
                )
            outputs = _outputs(returned[0], batch)
            new = flatten_state(returned[1], "new_state")
        check_new_state(new, self.initial_state, batch, self.device)
        for key in outputs:
            if key[0] in RECURRENT_KEYS:
                raise ValueError(
                    f"policy output {key} is named like a key the collector writes for "
                    "recurrent policies; rename that output"
                )
        return outputs, new


# tensordict keeps the interaction type in one setting per process: two threads of this
# process serving TensorDictModules (in-worker policies on worker threads, two
# collectors' servers) would each set and restore it around the other's call, and a
# call could run under the other's type or none, with the setting left changed after
# both. Held around every eager call, this lock keeps those calls apart. Compiled code and
# CUDA graphs read the type once, when traced or captured (inside the same call), so a
# compiled call takes no lock (dynamo would break its graph at one).
_INTERACTION_LOCK = threading.Lock()


def exploration_type_of(value: Any) -> str:
    """``value`` as the name of an exploration type (a name of ``EXPLORATION_TYPES``,
    or tensordict's ``InteractionType`` / TorchRL's ``ExplorationType`` member for it).

    Raises:
        ValueError: any other value.
    """
    name = getattr(value, "value", value)  # an InteractionType member: its name
    if not isinstance(name, str) or name.lower() not in EXPLORATION_TYPES:
        raise ValueError(
            f"exploration_type must be one of {list(EXPLORATION_TYPES)} (or tensordict's "
            f"InteractionType / TorchRL's ExplorationType of one), got {value!r}"
        )
    return name.lower()


def _describe(value: Any) -> str:
    if isinstance(value, tuple):
        return f"a tuple of {len(value)}"
    return f"a {type(value).__name__}"


def _given(key: Key) -> bool:
    """What :meth:`PolicyRunner.call` put in a TensorDict: the observations."""
    return key[0] == "observation"


def _given_with_state(key: Key) -> bool:
    """What :meth:`PolicyRunner.call_recurrent` put in a TensorDict (the observations,
    the state and ``is_init``), and the new state the policy wrote."""
    return key[0] == "observation" or key[0] in RECURRENT_KEYS or key[:2] == ("next", STATE_KEY)


def _outputs_of_tensordict(
    td: TensorDictBase, batch: int, *, given: Callable[[Key], bool] = _given
) -> dict[Key, torch.Tensor]:
    """The leaves of ``td`` the policy wrote as outputs: every one but those ``given``
    names (the call's own inputs)."""
    out: dict[Key, torch.Tensor] = {}
    for key in td.keys(include_nested=True, leaves_only=True):
        tkey = (key,) if isinstance(key, str) else tuple(key)
        if not given(tkey):
            out[tkey] = td.get(key)
    return _check_batch(out, batch)


def _outputs(result: Any, batch: int) -> dict[Key, torch.Tensor]:
    if isinstance(result, torch.Tensor):
        return _check_batch({("action",): result}, batch)
    if isinstance(result, TensorDictBase):
        return _outputs_of_tensordict(result, batch)
    if isinstance(result, Mapping):
        out: dict[Key, torch.Tensor] = {}
        for key, value in result.items():
            if not isinstance(value, torch.Tensor):
                raise TypeError(f"policy output {key!r} is a {type(value).__name__}, not a tensor")
            out[(key,) if isinstance(key, str) else tuple(key)] = value
        return _check_batch(out, batch)
    raise TypeError(
        "policy must return the action tensor, or a mapping or TensorDict holding 'action'; "
        f"it returned {type(result).__name__}"
    )


def _check_batch(out: dict[Key, torch.Tensor], batch: int) -> dict[Key, torch.Tensor]:
    if ("action",) not in out:
        raise KeyError(f"policy output has no 'action' (it has {sorted(out)})")
    for key, value in out.items():
        if value.ndim == 0 or value.shape[0] != batch:
            raise ValueError(
                f"policy output {key} has shape {tuple(value.shape)}; expected a leading batch "
                f"dimension of {batch}"
            )
    return out


def action_dtype(space: Any) -> np.dtype[Any]:
    """Ring dtype of actions of ``space``: int64 for discrete kinds, float32 for Box."""
    from gymnasium import spaces

    if isinstance(space, (spaces.Discrete, spaces.MultiDiscrete)):
        return np.dtype(np.int64)
    if isinstance(space, spaces.MultiBinary):
        return np.dtype(np.int8)
    if isinstance(space, spaces.Box):
        return np.dtype(np.float32)
    raise TypeError(
        f"action_space {space} is not supported; use Discrete, MultiDiscrete, MultiBinary or Box"
    )


def output_fields(
    outputs: Mapping[Key, torch.Tensor], action_space: Any
) -> tuple[Field, tuple[Field, ...]]:
    """Check a probe's outputs against ``action_space``; return the action and extra fields."""
    dtype = action_dtype(action_space)
    action = outputs[("action",)]
    want_shape = tuple(action_space.shape)
    if tuple(action.shape[1:]) != want_shape:
        raise ValueError(
            f"policy returned actions of shape {tuple(action.shape[1:])} per env; the action "
            f"space {action_space} needs {want_shape}"
        )
    if dtype.kind in "iu" and action.dtype.is_floating_point:
        raise TypeError(
            f"policy returned {action.dtype} actions for the integer action space "
            f"{action_space}; return integer actions (e.g. argmax or a sample)"
        )
    extras = []
    for key, value in outputs.items():
        if key == ("action",):
            continue
        if key[0] in RESERVED_KEYS:
            raise ValueError(
                f"policy writes {key}, a key the collector fills itself; rename that output"
            )
        try:
            np_dtype = torch.empty(0, dtype=value.dtype).numpy().dtype
        except TypeError as exc:
            raise TypeError(
                f"policy output {key} has dtype {value.dtype}, which numpy cannot hold; cast it"
            ) from exc
        extras.append(Field(key, tuple(value.shape[1:]), np_dtype))
    return Field(("action",), want_shape, dtype), tuple(extras)
