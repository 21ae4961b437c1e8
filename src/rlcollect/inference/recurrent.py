"""Recurrent policies: every env's state, held by the inference server on the policy device.

A policy is recurrent when it has a method ``initial_state()`` returning the state of ONE
env: a tensor, or a (nested) dict of tensors, without a batch dimension. Its forward is
then ``forward(observation, state) -> (outputs, new_state)``; a ``TensorDictModule``
reads ``recurrent_state`` (and may read ``is_init``) and writes
``("next", "recurrent_state")`` instead (``policy.py`` calls both forms).

The server is the one place that knows which env each row of a batch is, so the state
lives there, in a :class:`StateStore`: one tensor per state leaf, on the policy device,
``[num_envs + 1 + capacity, *shape]``: a row per env, then a row that always holds
``initial_state()``, then scratch rows. Per batch (``StateStore.run``, capturable in a
CUDA graph: indices only, no host sync)::

    gather   state = store[read_rows]           (index_select; the reset is in the index)
    forward  outputs, new_state = policy(observation, state)
    write    store[write_rows] = new_state      (index_copy_)

``write_rows`` is each row's env, ``read_rows`` the same except where ``is_init`` is set
(its observation has step 0): there it is the initial-state row, so the reset costs no
kernel of its own. Both are filled on the host by :meth:`StateStore.load` from the
batch's ring rows, and uploaded as one ``[2, capacity]`` copy: the env of a row is a
function of where it sits in the ring (``transports.layout.request_envs``), and
``is_init`` a ring field the worker writes next to the observation (``step == 0``).
Rows that are not an env's (the padding of a graphed batch) read and write scratch rows,
one per row, so they never touch an env's state (nor the initial-state row) and
``index_copy_`` never sees an index twice. The state an action was computed from (after
the reset) goes out as the policy output ``recurrent_state``.

Nothing else changes a state: weight updates leave the store alone (an env's memory
carries over to the new weights), and a restarted worker's envs start at ``step == 0``,
so they start from ``initial_state()``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch

from rlcollect.transports.layout import Field, Key, Path

__all__ = ["StateStore", "flatten_state", "initial_state_of", "state_fields", "unflatten_state"]

#: State leaves by path inside the state: ``{(): tensor}`` for a bare tensor state.
Leaves = dict[Path, torch.Tensor]
#: ``call(observations, state, is_init) -> (outputs, new_state)``, as ``PolicyRunner`` has it.
RecurrentCall = Callable[
    [Mapping[Path, torch.Tensor], Leaves, torch.Tensor], tuple[dict[Key, torch.Tensor], Leaves]
]
STATE_KEY = "recurrent_state"
IS_INIT_KEY = "is_init"


def _where(what: str, path: Path) -> str:
    return what + "".join(f"[{name!r}]" for name in path)


def flatten_state(state: Any, what: str) -> Leaves:
    """``state`` (a tensor or a nested mapping of tensors) as its leaves by path.

    Raises:
        TypeError: a leaf that is not a tensor, or a key that is not a string, named by
            its path inside ``what``.
        ValueError: an empty mapping.
    """
    if isinstance(state, torch.Tensor):
        return {(): state}
    if not isinstance(state, Mapping):
        raise TypeError(f"{what} must be a tensor or a dict of tensors, got {type(state).__name__}")
    leaves: Leaves = {}

    def walk(path: Path, sub: Any) -> None:
        if isinstance(sub, torch.Tensor):
            leaves[path] = sub
            return
        if not isinstance(sub, Mapping):
            raise TypeError(
                f"{_where(what, path)} is a {type(sub).__name__}; a state holds tensors only"
            )
        if not sub:
            raise ValueError(f"{_where(what, path)} is an empty dict; a state holds tensors")
        for name, child in sub.items():
            if not isinstance(name, str) or not name:
                raise TypeError(f"{_where(what, path)} has the key {name!r}; use non-empty str")
            walk((*path, name), child)

    # a TensorDict is a Mapping too: its items() yields tensors and sub-TensorDicts
    walk((), state)
    return leaves


def unflatten_state(leaves: Mapping[Path, torch.Tensor]) -> Any:
    """The state as the policy sees it: the tensor itself, or nested dicts."""
    if () in leaves:
        return leaves[()]
    out: dict[str, Any] = {}
    for path, tensor in leaves.items():
        node = out
        for name in path[:-1]:
            node = node.setdefault(name, {})
        node[path[-1]] = tensor
    return out


def initial_state_of(policy: torch.nn.Module, device: torch.device) -> Leaves | None:
    """The policy's ``initial_state()`` as leaves on ``device``; None for a feed-forward
    policy (no ``initial_state`` attribute).

    Raises:
        TypeError: ``initial_state`` is not callable, or returns something other than a
            tensor or a nested dict of tensors.
        ValueError: it raised, or returned an empty dict.
    """
    method = getattr(policy, "initial_state", None)
    if method is None:
        return None
    if not callable(method):
        raise TypeError(
            f"policy.initial_state is a {type(method).__name__}; a recurrent policy's "
            "initial_state must be a method returning one env's state"
        )
    try:
        state = method()
    except Exception as exc:
        raise ValueError(f"policy.initial_state() raised {type(exc).__name__}: {exc}") from exc
    leaves = flatten_state(state, "policy.initial_state()")
    return {path: tensor.detach().to(device).clone() for path, tensor in leaves.items()}


def state_fields(initial: Mapping[Path, torch.Tensor]) -> tuple[Field, ...]:
    """Ring fields of the ``recurrent_state`` output: ``("recurrent_state", *path)``.

    Raises:
        ValueError: a leaf of a dtype numpy cannot hold (the ring is numpy's), named.
    """
    fields = []
    for path, tensor in initial.items():
        try:
            dtype = torch.empty(0, dtype=tensor.dtype).numpy().dtype
        except TypeError as exc:
            raise ValueError(
                f"{_where('policy.initial_state()', path)} has dtype {tensor.dtype}, which the "
                "ring (numpy) cannot hold for recurrent_state; use float32, say, or "
                "store_recurrent_state=False"
            ) from exc
        fields.append(Field((STATE_KEY, *path), tuple(tensor.shape), dtype))
    return tuple(fields)


def check_new_state(
    new: Leaves, initial: Mapping[Path, torch.Tensor], batch: int, device: torch.device
) -> None:
    """``new`` must have ``initial``'s leaves, each ``[batch, *shape]`` of its dtype.

    Raises:
        ValueError: the structure, a shape, a dtype or a device differs; the message names
            the leaf and both values.
    """
    if new.keys() != initial.keys():
        got_leaves = sorted(_where("new_state", p) for p in new)
        want_leaves = sorted(_where("new_state", p) for p in initial)
        raise ValueError(
            f"the policy returned a new_state with leaves {got_leaves}; initial_state() has "
            f"{want_leaves}"
        )
    for path, want in initial.items():
        got = new[path]
        name = _where("new_state", path)
        if tuple(got.shape) != (batch, *want.shape):
            raise ValueError(
                f"{name} has shape {tuple(got.shape)}; expected {(batch, *want.shape)} (a "
                "batch dimension, then initial_state()'s shape)"
            )
        if got.dtype != want.dtype:
            raise ValueError(f"{name} has dtype {got.dtype}; initial_state() has {want.dtype}")
        if got.device != want.device:
            raise ValueError(f"{name} is on {got.device}; the policy runs on {want.device}")


class StateStore:
    """Every env's recurrent state, ``[num_envs + 1 + capacity, *shape]`` per leaf, on the
    policy device: env ``i``'s row ``i``, the initial state's row ``num_envs``, then
    scratch rows for rows that are no env's.

    Args:
        initial: one env's initial state by leaf, on the policy device.
        num_envs: envs in the collector (env ``i`` owns row ``i``).
        capacity: most rows one batch holds (padded batches included).
        store: whether the state an action was computed from goes out as the
            ``recurrent_state`` policy output.
        flags: whether the policy reads ``is_init`` (a ``TensorDictModule`` may): it is
            then computed on the device from the read rows; otherwise never.
        repeats: whether one batch may name an env twice (only with worker restarts):
            checked per batch then.
    """

    def __init__(
        self,
        initial: Mapping[Path, torch.Tensor],
        *,
        num_envs: int,
        capacity: int,
        store: bool,
        flags: bool = False,
        repeats: bool = True,
    ) -> None:
        self.initial = dict(initial)
        self.num_envs = num_envs
        self.capacity = capacity
        self.store = store
        self._flags = flags
        device = next(iter(self.initial.values())).device
        self.device = device
        self.init_row = num_envs
        total = num_envs + 1 + capacity
        with torch.no_grad():
            self.states = {
                path: t.expand(total, *t.shape).clone() for path, t in self.initial.items()
            }
        self._scratch = np.arange(num_envs + 1, total, dtype=np.int64)
        # [read rows; write rows], filled per batch on the host and uploaded in one copy
        # (the same tensor on a CPU). Tail rows stay scratch: a padded replay reads them.
        host = torch.from_numpy(np.stack([self._scratch, self._scratch]))
        if device.type == "cuda":
            host = host.pin_memory()
        self._host = host
        self._rows_np = host.numpy()
        self.rows = host.to(device) if device.type == "cuda" else host
        self._is_init_np = np.zeros(capacity, dtype=bool)
        self._seen = np.full(num_envs, -1, dtype=np.int64)
        self._order = np.arange(capacity, dtype=np.int64)
        self._repeats = repeats
        self._loaded = capacity  # rows the last batch named (all, before any batch)
        self._is_init_rows: np.ndarray | None = None
        self._env_of_row: np.ndarray | None = None
        self._settle()

    def _settle(self) -> None:
        # Written on this thread's stream; the server's own stream must see it done.
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def bind(self, is_init_rows: np.ndarray, env_of_row: np.ndarray) -> None:
        """Bind to the ring: its ``is_init`` field as ``[rows]``, and the env of each row
        (``[rows]`` int64: a lookup per batch is one ``np.take``)."""
        self._is_init_rows = is_init_rows
        self._env_of_row = env_of_row.astype(np.int64, copy=False)

    def load(self, flat: np.ndarray) -> None:
        """Host side of a batch: the read and write rows of ring rows ``flat``. It is on
        the critical path of every batch, so it is one lookup per array."""
        assert self._env_of_row is not None and self._is_init_rows is not None, "bind() first"
        n = len(flat)
        read, write = self._rows_np
        envs = write[:n]
        np.take(self._env_of_row, flat, out=envs, mode="clip")
        if self._repeats:
            self._drop_repeats(envs)
        if n < self._loaded:  # the rows a larger batch named: scratch again
            read[n : self._loaded] = write[n : self._loaded] = self._scratch[n : self._loaded]
        self._loaded = n
        read[:n] = envs
        is_init = self._is_init_np[:n]
        np.take(self._is_init_rows, flat, out=is_init, mode="clip")
        np.putmask(read[:n], is_init, self.init_row)

    def _drop_repeats(self, envs: np.ndarray) -> None:
        """An env named twice in one batch writes from its later row only; the earlier
        one writes a scratch row. That happens only with worker restarts: a request of
        the restarted worker's predecessor and the new worker's own, in this order
        (transports/generations.py), so the new worker's alone may write the state."""
        order = self._order[: len(envs)]
        self._seen[envs] = order
        if (self._seen[envs] == order).all():
            return
        last: dict[int, int] = {}
        for i, env in enumerate(envs.tolist()):
            last[env] = i
        for i, env in enumerate(envs.tolist()):
            if last[env] != i:
                envs[i] = self._scratch[i]

    def upload(self) -> None:
        """Copy the batch's rows to the device (asynchronously, on the current stream;
        capturable). Nothing to do on a CPU."""
        if self.rows is not self._host:
            self.rows.copy_(self._host, non_blocking=True)

    def reset(self) -> None:
        """Every row back to the initial state; the host's rows to scratch."""
        with torch.no_grad():
            for path, t in self.states.items():
                t.copy_(self.initial[path].expand_as(t))
        self._rows_np[:] = self._scratch
        self._loaded = self.capacity
        self._settle()

    def run(self, call: RecurrentCall, inputs: Mapping[Path, torch.Tensor]) -> dict[Key, Any]:
        """Gather (with the reset), forward, write back, for the first ``B`` rows (``B``
        from ``inputs``). Device ops on static buffers only: capturable in a CUDA graph."""
        batch = next(iter(inputs.values())).shape[0]
        read, write = self.rows[0, :batch], self.rows[1, :batch]
        state = {path: store.index_select(0, read) for path, store in self.states.items()}
        is_init = read == self.init_row if self._flags else _NO_FLAGS
        outputs, new_state = call(inputs, state, is_init)
        for path, store in self.states.items():
            store.index_copy_(0, write, new_state[path])
        if self.store:
            for path, value in state.items():
                outputs[(STATE_KEY, *path)] = value
        return outputs


#: Stands for ``is_init`` where the policy does not read it (a plain module).
_NO_FLAGS = torch.empty(0, dtype=torch.bool)
