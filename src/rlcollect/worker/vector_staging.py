"""The vector loop's staging: each env's two staging cells and the request index.

Why staging: a vector env's result names an arbitrary subset of its sub-envs, so the
columns of a request do not line up with per-env chunk columns
(``transports/layout.py``, *Staged*). The server reads each observation from, and
writes each action into, a cell of that env's own, which routes every action to the env
whose observation chose it. The price is one more copy of each observation (staging
cell → chunk) than the in-place loop makes.

The protocol, per request ``g`` (one per vector env of the worker):

1. The worker copies each returned observation into its env's *other* cell (env
   ``e``'s are ``e`` and ``e + k``, ``k`` the worker's columns, used in turn), sets the
   cells' ``is_init`` where a recurrent policy's state must be reset, and names the
   cells in row ``g`` of the request index (:meth:`Staging.stage`). Only then does it
   make request ``g``: the transport's request makes every write before it visible to
   the server.
2. The server reads the cells the index names and writes the actions (and the policy
   outputs and version) into the same cells; the worker reads the actions only after
   ``wait_response`` says they are written (:meth:`Staging.actions`).
3. Meanwhile the worker copies the transitions the result finished out of the cells
   of the step before (``vector_rows.py``). No outstanding request names those: a
   vector env has at most one, and it names the cells just staged.

Two cells per env, used in turn, let the request go out before the finished
transitions are copied out of the other cell: from a result to its actions, the worker
copies each observation once.

This module imports no torch: it runs in worker processes.
"""

from __future__ import annotations

import numpy as np

from rlcollect.transports.base import WorkerEnd
from rlcollect.transports.layout import STAGED, Key
from rlcollect.worker.casts import cast_loss
from rlcollect.worker.spec import IS_INIT, WorkerSpec, observation_key
from rlcollect.worker.vector_env import VectorEnvDriver

__all__ = ["Staging"]


class Staging:
    """The worker's staging cells, its request index, and which cell each env uses."""

    def __init__(self, end: WorkerEnd, spec: WorkerSpec) -> None:
        k = spec.num_envs
        self.k = k
        # Each staged field's cells, [2 * k, *shape]: the observations and the outputs.
        self.staged = {key[1:]: a for key, a in end.buffers.items() if key[0] == STAGED}
        self.request_index = self.staged.pop(("rows",))
        # Only with a recurrent policy: set with each staged observation that starts an
        # episode, read by the server (to reset the env's state) and copied into the chunk.
        self.is_init = self.staged.get(IS_INIT.key)
        self.obs_keys = [observation_key(p) for p in spec.observation_paths]
        self.cell = np.arange(k)  # each env's staging cell in use: env e's are e and e + k

    def stage(
        self, g: int, cols: np.ndarray, leaves: list[np.ndarray], starts: np.ndarray | None
    ) -> tuple[np.ndarray, np.ndarray]:
        """Copy each observation of ``cols`` into its env's other staging cell, which
        becomes its cell in use, and name the cells in request ``g``'s index; returns
        the cells of the step before and the new ones. ``starts``: which observations
        start an episode (given where ``is_init`` is staged)."""
        old_cells = self.cell[cols]
        new_cells = (old_cells + self.k) % (2 * self.k)
        for key, leaf in zip(self.obs_keys, leaves, strict=True):
            self.staged[key][new_cells] = leaf
        if self.is_init is not None:
            self.is_init[new_cells] = starts
        self.request_index[g] = new_cells
        self.cell[cols] = new_cells
        return old_cells, new_cells

    def actions(self, cells: np.ndarray) -> np.ndarray:
        """The answered actions of the request of ``cells``, in its result's order."""
        actions: np.ndarray = self.staged[("action",)][cells]  # a copy
        return actions

    def checked(self, driver: VectorEnvDriver, leaf: object, key: Key, rows: int) -> np.ndarray:
        """Observation leaf ``key`` of a result of ``rows`` rows, as the staged field's
        dtype; fails the worker where its shape or dtype does not fit the space's."""
        arr = np.asarray(leaf)
        want = self.staged[key].shape[1:]
        if arr.shape != (rows, *want):
            raise driver.fail("the observation check") from ValueError(
                f"{'/'.join(key)} of shape {arr.shape} for {rows} sub-envs; the observation "
                f"space says {want} per sub-env"
            )
        if arr.dtype != self.staged[key].dtype:
            try:
                cast = arr.astype(self.staged[key].dtype, casting="same_kind")
            except TypeError as exc:
                raise driver.fail("the observation check") from exc
            lost = cast_loss(arr, cast)
            if lost is not None:
                raise driver.fail("the observation check") from ValueError(
                    f"the vector env returned an observation {'/'.join(key)} {lost}"
                )
            arr = cast
        return arr
