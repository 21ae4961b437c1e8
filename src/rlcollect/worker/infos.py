"""``info_keys``: numeric entries of an env's ``info`` carried as ``("next", "info", name)``.

Each name's per-env shape and dtype come from env 0's probe (``probe.py``: one reset and
one step in the driver); the ring holds one field per name. The worker loops write the
step's entry next to its reward. An entry that is missing, or is not a number (bools,
integers, floats, or arrays of them) of the probed shape, fails the worker with an
``EnvError`` naming the env and the entry: silently writing a zero or a cast value
would hand the learner data the env never produced.

A vector env returns ``info`` as a dict of arrays with one row per result row, and a
boolean mask ``info["_name"]`` saying which rows hold the entry (gymnasium's
convention); a row whose mask is False counts as missing. With the ``SameStep``
autoreset a finished sub-env's row holds the *reset's* info, and the finished step's
own is in ``info["final_info"]`` (same layout): that one is carried.

This module imports no torch: it runs in worker processes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from rlcollect.errors import EnvError
from rlcollect.transports.base import text_of
from rlcollect.transports.layout import Key
from rlcollect.worker.spec import info_key

__all__ = ["InfoWriter", "NUMERIC_KINDS", "VectorInfoWriter", "vector_entry"]

#: numpy dtype kinds an ``info`` entry may have: bool, signed, unsigned, float.
NUMERIC_KINDS = "biuf"


class InfoWriter:
    """Writes a plain env's ``info`` entries into its ring fields, checking each one."""

    def __init__(self, buffers: Mapping[tuple[str, ...], np.ndarray], names: tuple[str, ...]):
        self._fields = [(name, buffers[("next", "info", name)]) for name in names]

    def write(self, position: int, env: int, info: Any, env_index: int) -> None:
        for name, dst in self._fields:
            try:
                value = info[name]
            except (KeyError, TypeError, IndexError):
                has = sorted(map(str, info)) if isinstance(info, dict) else repr(info)
                raise EnvError(env_index, "the info check") from KeyError(
                    f"env {env_index} returned an info without {name!r}, which info_keys "
                    f"asks for; its info holds {has}"
                )
            store(dst[position, env, ...], value, name, env_index)


def store(dst: np.ndarray, value: Any, name: str, env_index: int) -> None:
    """Copy one env's entry ``value`` into ``dst`` (its cell in the ring), checked."""
    arr = np.asarray(value)
    if arr.dtype.kind not in NUMERIC_KINDS or arr.shape != dst.shape:
        raise EnvError(env_index, "the info check") from TypeError(
            f"env {env_index} returned info[{name!r}] = {text_of(value, quoted=True)} "
            f"({arr.dtype}, shape "
            f"{arr.shape}); info_keys carries numbers of the dtype and shape env 0 gave at "
            f"its probe: {dst.dtype}, shape {dst.shape}"
        )
    try:
        np.copyto(dst, arr, casting="same_kind")
    except TypeError as exc:
        raise EnvError(env_index, "the info check") from TypeError(
            f"env {env_index} returned info[{name!r}] of dtype {arr.dtype}; env 0 gave "
            f"{dst.dtype} at its probe, and {arr.dtype} does not fit it ({exc})"
        )


def vector_entry(info: Any, name: str) -> tuple[np.ndarray | None, np.ndarray | None]:
    """The entry ``name`` of a vector env's ``info`` and its row mask (None where absent)."""
    if not isinstance(info, dict) or name not in info:
        return None, None
    mask = info.get("_" + name)
    return np.asarray(info[name]), None if mask is None else np.asarray(mask, dtype=bool)


class VectorInfoWriter:
    """Writes a vector env's ``info`` entries into rows of the chunk, checking each one.

    ``chunk`` holds every transition field as ``[rows, *shape]`` (the vector loop's view
    of the ring, rows in chunk order); ``offset`` is the collector index of the worker's
    column 0.
    """

    def __init__(
        self, chunk: Mapping[Key, np.ndarray], names: tuple[str, ...], offset: int
    ) -> None:
        self._fields = [(name, chunk[info_key(name)]) for name in names]
        self._offset = offset

    def write(
        self,
        dst: slice,
        cols: np.ndarray,
        rows: np.ndarray,
        done: np.ndarray,
        info: Any,
        *,
        same_step: bool,
        envs: tuple[int, int],
    ) -> None:
        """Write the entries of result rows ``rows`` (the worker's columns ``cols``, their
        episode ends ``done``) into chunk rows ``dst``. ``same_step``: the vector env's
        autoreset is ``SameStep``; ``envs``: the first and last env of the vector env."""
        final = None
        if same_step and done.any():
            final = info.get("final_info") if isinstance(info, dict) else None
        for name, field in self._fields:
            value, mask = vector_entry(info, name)
            have = np.zeros(len(rows), bool)
            values: np.ndarray | None = None
            if value is not None:
                values = value[rows]
                have[:] = True if mask is None else mask[rows]
            if final is not None:
                # SameStep: a finished sub-env's row holds the reset's info; its last
                # step's own entry is in final_info.
                f_value, f_mask = vector_entry(final, name)
                have[done] = False
                if f_value is not None:
                    f_have = np.ones(len(rows), bool) if f_mask is None else f_mask[rows]
                    have[done] = f_have[done]
                    if values is None:
                        values = f_value[rows].copy()
                    else:
                        values = values.copy()
                        values[done] = f_value[rows][done]
            if values is None or not have.all():
                env = int(self._offset + cols[np.flatnonzero(~have)[0]])
                raise EnvError(env, "the info check") from KeyError(
                    f"env {env} (a sub-env of the vector env of envs {envs[0]}-{envs[1]}) "
                    f"returned an info without {name!r}, which info_keys asks for"
                )
            out = field[dst]
            if values.dtype.kind not in NUMERIC_KINDS or values.shape[1:] != out.shape[1:]:
                env = int(self._offset + cols[0])
                raise EnvError(env, "the info check") from TypeError(
                    f"env {env} returned info[{name!r}] of dtype {values.dtype} and shape "
                    f"{values.shape[1:]} per sub-env; info_keys carries numbers of the dtype "
                    f"and shape env 0 gave at its probe: {out.dtype}, {out.shape[1:]}"
                )
            try:
                np.copyto(out, values, casting="same_kind")
            except TypeError as exc:
                raise EnvError(int(self._offset + cols[0]), "the info check") from exc
