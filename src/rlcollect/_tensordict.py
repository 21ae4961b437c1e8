"""tensordict, imported without importing ``torch._dynamo``.

Importing tensordict (0.15) marks a few of its functions for the compiler: two
functorch wrappers and ``_foreach_copy_`` with ``torch.compiler.allow_in_graph``, one
function with ``torch.compiler.assume_constant_result``. ``allow_in_graph`` imports
``torch._dynamo`` to do so: about 1.4 s of the 1.6 s that importing tensordict takes,
paid by every process that builds a collector, whether anything compiles or not.

Here tensordict is imported with those two functions of ``torch.compiler`` replaced by
stand-ins for the duration of the import. ``assume_constant_result`` sets the one
attribute the real one sets (``torch._dynamo.assume_constant_result`` needs nothing
else). ``allow_in_graph`` records the function; the records are handed to the real
``allow_in_graph`` right after ``torch._dynamo`` is imported — by ``compile=`` here or
by anyone's ``torch.compile`` — before anything can be traced, so compiled code sees
tensordict exactly as after a plain import. Where ``torch._dynamo`` is already imported,
tensordict is imported plainly.

A module that may be the first to import tensordict takes its names from here.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import threading
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

import torch
import torch.compiler

__all__ = [
    "InteractionType",
    "TensorDict",
    "TensorDictBase",
    "TensorDictModuleBase",
    "is_non_tensor",
    "set_interaction_type",
]

_DYNAMO = "torch._dynamo"
_lock = threading.Lock()
#: Functions tensordict marked with allow_in_graph while torch._dynamo was not imported.
_pending: list[Callable[..., Any]] = []
#: Functions it marked with assume_constant_result meanwhile.
_pending_constant: list[Callable[..., Any]] = []
#: Set once torch._dynamo is imported and ``_pending`` was handed over.
_handed_over = False


def _allow_in_graph_later(fn: Any) -> Any:
    """``torch.compiler.allow_in_graph``, deferred until ``torch._dynamo`` is imported."""
    if isinstance(fn, (list, tuple)):
        return [_allow_in_graph_later(f) for f in fn]
    with _lock:
        if not _handed_over:
            _pending.append(fn)
            return fn
    return _real_allow_in_graph(fn)


def _assume_constant_result(fn: Any) -> Any:
    """``torch._dynamo.assume_constant_result``, which (torch 2.11-2.13) only marks
    ``fn``; the real one is applied too once ``torch._dynamo`` is imported, in case a
    later torch does more."""
    fn._dynamo_marked_constant = True
    with _lock:
        if not _handed_over:
            _pending_constant.append(fn)
            return fn
    return _real_assume_constant_result(fn)


def _hand_over() -> None:
    """Registers the recorded functions with the real allow_in_graph (once)."""
    global _handed_over
    with _lock:
        if _handed_over:
            return
        _handed_over = True
        pending, constant = list(_pending), list(_pending_constant)
        _pending.clear()
        _pending_constant.clear()
    for fn in pending:
        _real_allow_in_graph(fn)
    for fn in constant:
        _real_assume_constant_result(fn)


class _HandOverOnDynamoImport(importlib.abc.MetaPathFinder):
    """Finds ``torch._dynamo`` through the other finders and makes its loader call
    ``_hand_over`` right after the package has run; then leaves ``sys.meta_path``."""

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None,
        target: ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != _DYNAMO:
            return None
        for finder in list(sys.meta_path):
            find = getattr(finder, "find_spec", None)
            if finder is self or find is None:
                continue
            spec: importlib.machinery.ModuleSpec | None = find(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        exec_module = loader.exec_module

        def exec_then_hand_over(module: ModuleType) -> None:
            exec_module(module)
            del loader.exec_module  # the class's method again
            if self in sys.meta_path:
                sys.meta_path.remove(self)
            _hand_over()

        loader.exec_module = exec_then_hand_over  # type: ignore[method-assign]
        return spec


def _real_allow_in_graph(fn: Any) -> Any:
    import torch._dynamo

    return torch._dynamo.allow_in_graph(fn)  # type: ignore[no-untyped-call]


def _real_assume_constant_result(fn: Any) -> Any:
    import torch._dynamo

    return torch._dynamo.assume_constant_result(fn)  # type: ignore[no-untyped-call]


def _import_tensordict() -> None:
    if "tensordict" in sys.modules or _DYNAMO in sys.modules:
        return  # imported already, or nothing to spare: the plain import below
    sys.meta_path.insert(0, _HandOverOnDynamoImport())
    compiler: Any = torch.compiler
    allow, constant = compiler.allow_in_graph, compiler.assume_constant_result
    compiler.allow_in_graph, compiler.assume_constant_result = (
        _allow_in_graph_later,
        _assume_constant_result,
    )
    try:
        import tensordict  # noqa: F401
    finally:
        compiler.allow_in_graph, compiler.assume_constant_result = allow, constant


_import_tensordict()

from tensordict import TensorDict, TensorDictBase, is_non_tensor  # noqa: E402
from tensordict.nn import (  # noqa: E402
    InteractionType,
    TensorDictModuleBase,
    set_interaction_type,
)
