"""The public API as a whole: ``__all__`` exact, every public name on an API page, every
public class and function documented with a runnable example.

The examples themselves run as doctests (``--doctest-modules`` on ``src``); this file
checks that none is missing and that the API reference (``docs/api/*.md``) shows every
name a user can import from a public module, and every name in the ``__all__`` of the
modules those names are defined in (a submodule's ``__all__`` is API too: what it lists
is documented, what it does not is the package's own business).
"""

from __future__ import annotations

import importlib
import inspect
import textwrap
import types
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]

# The modules users import from; each has an exact __all__.
PUBLIC_MODULES = (
    "rlcollect",
    "rlcollect.errors",
    "rlcollect.transports",
    "rlcollect.inference",
    "rlcollect.replay",
    "rlcollect.testing",
    "rlcollect.envspeed",
    "rlcollect.interop",
)
# Packages whose __init__ only re-exports: __all__ is every public name they hold.
REEXPORTING = ("rlcollect.transports", "rlcollect.inference", "rlcollect.replay")


def _resolve(path: str) -> Any:
    """The object at dotted ``path``: the longest importable module, then attributes."""
    parts = path.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj: Any = importlib.import_module(".".join(parts[:i]))
        except ModuleNotFoundError:
            continue
        for name in parts[i:]:
            obj = getattr(obj, name)
        return obj
    raise ImportError(path)


def _api_pages() -> list[tuple[str, dict[str, Any]]]:
    """Every ``::: identifier`` of docs/api/*.md with its options."""
    out = []
    for page in sorted((ROOT / "docs" / "api").glob("*.md")):
        lines = page.read_text().splitlines()
        for i, line in enumerate(lines):
            if not line.startswith("::: "):
                continue
            block = []
            for follow in lines[i + 1 :]:
                if follow and not follow.startswith(" "):
                    break
                block.append(follow)
            config = yaml.safe_load(textwrap.dedent("\n".join(block))) or {}
            out.append((line[4:].strip(), config.get("options", {})))
    return out


def _documented() -> list[Any]:
    """The objects the API reference shows (by identity)."""
    shown: list[Any] = []
    for identifier, options in _api_pages():
        obj = _resolve(identifier)
        shown.append(obj)
        if isinstance(obj, types.ModuleType):
            members = options.get("members")
            if members is False:
                continue
            names = members if isinstance(members, list) else getattr(obj, "__all__", [])
            shown.extend(getattr(obj, name) for name in names)
    return shown


def _home_modules() -> list[str]:
    """The modules that define the public classes and functions, besides the public ones."""
    homes = {
        obj.__module__
        for module in PUBLIC_MODULES
        for name in _module(module).__all__
        if inspect.isclass(obj := getattr(_module(module), name)) or inspect.isfunction(obj)
    }
    return sorted(home for home in homes if home.startswith("rlcollect."))


def _public_names() -> list[tuple[str, str]]:
    modules = dict.fromkeys([*PUBLIC_MODULES, *_home_modules()])
    return [(module, name) for module in modules for name in _module(module).__all__]


def test_home_modules_are_the_expected_ones():
    # A new home module appears here first: its __all__ is then held to the same rules.
    assert set(_home_modules()) - set(PUBLIC_MODULES) == {
        "rlcollect.collector.collector",
        "rlcollect.inference.build",
        "rlcollect.inference.policy",
        "rlcollect.inference.server",
        "rlcollect.replay.buffer",
        "rlcollect.replay.counting",
        "rlcollect.replay.sink",
        "rlcollect.testing.conformance",
        "rlcollect.testing.envs",
        "rlcollect.testing.programs",
        "rlcollect.transports.base",
        "rlcollect.transports.layout",
        "rlcollect.transports.process_slots",
        "rlcollect.transports.thread_queue",
    }


def _module(name: str) -> types.ModuleType:
    return importlib.import_module(name)


@pytest.mark.parametrize("module_name", PUBLIC_MODULES)
def test_all_is_exact(module_name: str) -> None:
    module = _module(module_name)
    exported = module.__all__
    assert len(set(exported)) == len(exported), f"{module_name}.__all__ repeats a name"
    for name in exported:
        assert getattr(module, name) is not None, f"{module_name}.{name} does not import"
    public = {
        name
        for name, value in vars(module).items()
        if not name.startswith("_")
        and not isinstance(value, types.ModuleType)
        and name != "annotations"  # from __future__
    }
    if module_name == "rlcollect":
        # Lazy re-exports: nothing is bound until first use; dir() lists what resolves.
        assert set(exported) <= set(dir(module))
        return
    if module_name in REEXPORTING:
        missing = public - set(exported)
    else:
        defined = {
            name
            for name in public
            if getattr(vars(module)[name], "__module__", module_name) == module_name
            and (inspect.isclass(vars(module)[name]) or inspect.isfunction(vars(module)[name]))
        }
        missing = defined - set(exported)
    assert not missing, f"{module_name} has public names outside __all__: {sorted(missing)}"


def test_every_public_name_is_on_an_api_page() -> None:
    shown = _documented()
    missing = [
        f"{module}.{name}"
        for module, name in _public_names()
        if not any(getattr(_module(module), name) is obj for obj in shown)
    ]
    assert not missing, f"not in the API reference (docs/api/*.md): {missing}"


def _documentable() -> list[tuple[str, Any]]:
    seen: dict[int, tuple[str, Any]] = {}
    for module, name in _public_names():
        obj = getattr(_module(module), name)
        if inspect.isclass(obj) or inspect.isfunction(obj):
            seen.setdefault(id(obj), (f"{module}.{name}", obj))
    return sorted(seen.values(), key=lambda item: item[0])


@pytest.mark.parametrize(("path", "obj"), _documentable(), ids=[p for p, _ in _documentable()])
def test_public_class_or_function_has_a_runnable_example(path: str, obj: Any) -> None:
    doc = inspect.getdoc(obj) or ""
    assert doc, f"{path} has no docstring"
    assert "Examples:" in doc and ">>> " in doc, f"{path} has no runnable (>>>) example"
    if inspect.isclass(obj):
        for name, member in vars(obj).items():
            if name.startswith("_") or not (
                inspect.isfunction(member) or isinstance(member, property)
            ):
                continue
            # getdoc looks an undocumented override's docstring up in the base classes
            assert inspect.getdoc(getattr(obj, name)), f"{path}.{name} has no docstring"
