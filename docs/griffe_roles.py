"""Griffe extension: render the reST markup of rlcollect's docstrings as mkdocstrings does.

The docstrings are Google style, with two pieces of reST inside: roles such as
``:class:`~rlcollect.transports.Transport``` and literal blocks introduced by ``::``.
This extension rewrites both, once the whole package is loaded, before any docstring
is parsed:

* A role naming an rlcollect object becomes a cross-reference to that object's
  canonical path (a name is first looked up in the docstring's own scope, as Python
  would: members, then the module's names and imports). It links to the object's entry
  in the API reference, and shows as plain code where the reference has none. A member
  the class inherits links to the class's own entry for it (the collectors' pages show
  inherited members): its canonical path would be shown under every subclass. A role
  naming nothing that exists (a renamed or misspelt name) becomes a reference the
  build cannot resolve, which fails the strict build. A role naming another library's
  object (``tensordict.TensorDict``) becomes inline code: the site links no other
  library's documentation.
* ``text::`` ends in ``text:`` (as reST renders it), and the indented block after it
  stays a code block. ``Example::`` becomes a Google ``Example:`` section holding the
  block as fenced Python code.
"""

from __future__ import annotations

import importlib.util
import re
import textwrap
from typing import Any

import griffe

_PACKAGE = "rlcollect"
_ROLE = re.compile(r":(?:py:)?(?:class|meth|func|attr|mod|data|exc|obj):`(~?)([^`]+)`")
_EXAMPLE = re.compile(r"^(\s*)(Examples?)::\s*$")


class ReSTRoles(griffe.Extension):
    """Rewrites the reST roles and literal blocks of every docstring in the package."""

    def on_package(self, *, pkg: griffe.Module, loader: griffe.GriffeLoader, **kwargs: Any) -> None:
        if pkg.name != _PACKAGE:
            return
        objects = _walk(pkg)
        for obj in objects:
            if obj.docstring is not None:
                text = _roles(obj.docstring.value, obj, loader)
                obj.docstring.value = _literal_blocks(text)
        for obj in objects:
            if obj.is_class:
                _inherit_docstrings(obj)  # type: ignore[arg-type]


def _inherit_docstrings(cls: griffe.Class) -> None:
    """Give an undocumented method the docstring of the method it overrides, as
    ``inspect.getdoc`` does: ``ThreadQueueTransport.close`` is ``Transport.close``."""
    for name, member in cls.members.items():
        if member.is_alias or not member.is_function or member.docstring is not None:
            continue
        for base in cls.mro():
            inherited = base.members.get(name)
            if inherited is not None and inherited.docstring is not None:
                member.docstring = griffe.Docstring(
                    inherited.docstring.value, parent=member, lineno=inherited.docstring.lineno
                )
                break


def _walk(obj: griffe.Object) -> list[griffe.Object]:
    out = [obj]
    for member in obj.members.values():
        if not member.is_alias:
            out.extend(_walk(member))  # type: ignore[arg-type]
    return out


def _roles(text: str, scope: griffe.Object, loader: griffe.GriffeLoader) -> str:
    def replace(match: re.Match[str]) -> str:
        short, target = match.group(1) == "~", match.group(2).lstrip(".")
        title = target.rsplit(".", 1)[-1] if short else target
        resolved = _resolve(target, scope, loader)
        if resolved is None:
            return f"`{title}`"
        path, exists = resolved
        if exists:
            # Linked if the API reference shows it, plain code if not: not every
            # object that exists has a page.
            return f'<autoref identifier="{path}" optional><code>{title}</code></autoref>'
        return f"[`{title}`][{path}]"  # required: the build fails on it

    return _ROLE.sub(replace, text)


def _resolve(
    target: str, scope: griffe.Object, loader: griffe.GriffeLoader
) -> tuple[str, bool] | None:
    """Canonical path of ``target`` and whether that object exists; None for another
    library's object. A name that cannot be resolved comes back as written."""
    inherited = _inherited(target, scope)
    if inherited is not None:
        return inherited, True
    first, _, rest = target.partition(".")
    if first != _PACKAGE:
        try:
            first = scope.resolve(first)
        except griffe.NameResolutionError:
            # A dotted path that starts with an installed module is another library's.
            if rest and importlib.util.find_spec(first) is not None:
                return None
            return target, False
        if not first.startswith(_PACKAGE):
            return None
    path = f"{first}.{rest}" if rest else first
    try:
        return str(loader.modules_collection[path].canonical_path), True
    except (KeyError, griffe.AliasResolutionError, griffe.CyclicAliasError):
        return path, False


def _inherited(target: str, scope: griffe.Object) -> str | None:
    """``target``'s path under the class of ``scope`` when that class inherits it."""
    cls = scope if scope.is_class else scope.parent
    if cls is None or not cls.is_class:
        return None
    if target.partition(".")[0] not in cls.inherited_members:
        return None
    return f"{cls.path}.{target}"


def _literal_blocks(text: str) -> str:
    lines = text.splitlines()
    out: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        example = _EXAMPLE.match(line)
        if example is None:
            if line.strip() == "::":
                line = ""  # a bare marker: reST shows nothing
            elif line.rstrip().endswith("::"):
                line = line.rstrip()[:-1]  # "text::" shows as "text:"
            out.append(line)
            i += 1
            continue
        # The literal block: blank lines, then lines indented deeper than the title.
        indent = len(example.group(1))
        block: list[str] = []
        i += 1
        while i < len(lines) and (
            not lines[i].strip() or len(lines[i]) - len(lines[i].lstrip()) > indent
        ):
            block.append(lines[i])
            i += 1
        while block and not block[-1].strip():
            block.pop()
        code = textwrap.dedent("\n".join(block)).strip("\n")
        pad = " " * (indent + 4)
        out.append(f"{example.group(1)}{example.group(2)}:")
        out.append(f"{pad}```python")
        out.extend(f"{pad}{row}" if row else "" for row in code.splitlines())
        out.append(f"{pad}```")
        if i < len(lines):
            out.append("")
    return "\n".join(out)
