"""A griffe extension for the API reference: the docstrings' Sphinx roles become links, and a role that
names nothing fails the build.

The docstrings write cross-references as Sphinx does (``:func:`attention```, ``:class:`~.ring.Plan```,
``:mod:`multihead.heads```, ``:data:`PRESETS```, relative to the module they are in). Each is resolved the
way a reader would: the written path as absolute, then inside the enclosing class, the module, and each
package above it. A resolved one becomes an optional autoref (a link where the reference documents that
name, plain code where it does not, e.g. a private module); a name of another library (torch, transformers,
...) stays code; anything else is reported as a warning, which the strict build turns into a failure.
reST's ``text::`` before an indented block (which Markdown shows as code anyway) loses one colon.
"""

from __future__ import annotations

import builtins
import logging
import re
from typing import Any

import griffe

log = logging.getLogger("mkdocs.hooks.multihead.roles")
ROLE = re.compile(r":(?:py:)?(func|class|meth|mod|data|attr|exc|obj|const|type):`(~?)([^`<>]+?)`")
LITERAL = re.compile(r"(?<=\S)::$", flags=re.M)  # reST's "text::" before an indented block: shown as "text:"
OTHER_LIBRARIES = ("torch", "transformers", "keras", "numpy", "jax", "tensorflow", "safetensors", "onnx")
OTHER_LIBRARIES += ("onnxruntime", "matplotlib", "typing", "collections", "dataclasses", "functools", "math")
OTHER_LIBRARIES += tuple(dir(builtins))  # ImportError, dict, ...
# names another branch is adding: shown as code until they exist, then resolved as links (none now)
PENDING: tuple[str, ...] = ()


class SphinxRoles(griffe.Extension):
    """Rewrites every docstring of the package once it is loaded (:meth:`on_package`)."""

    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
        todo: list[griffe.Object] = [pkg]
        while todo:
            obj = todo.pop()
            if obj.docstring is not None:
                value = ROLE.sub(lambda m, o=obj: _link(o, pkg, m), obj.docstring.value)
                obj.docstring.value = LITERAL.sub(":", value)
            todo += [m for m in obj.members.values() if not m.is_alias]


def _link(obj: griffe.Object, pkg: griffe.Module, match: re.Match[str]) -> str:
    _, tilde, written = match.groups()
    written = written.strip().rstrip("()")
    shown = written.lstrip(".").rsplit(".", 1)[-1] if tilde else written.lstrip(".")
    code = f"<code>{shown}</code>"
    if written.lstrip(".").split(".")[0] in OTHER_LIBRARIES:
        return code
    found = _resolve(obj, pkg, written)
    if found is None and written.lstrip(".").startswith(PENDING):
        return code
    if found is None:
        log.warning("%s: its docstring refers to %r, which names nothing in multihead", obj.path, written)
        return code
    return f'<autoref identifier="{found}" optional>{code}</autoref>'


def _resolve(obj: griffe.Object, pkg: griffe.Module, written: str) -> str | None:
    """The full path ``written`` names, seen from ``obj``, or None."""
    name = written.lstrip(".")
    scopes = [""]
    here: griffe.Object | None = obj
    while here is not None:  # the object itself, its class, its module, each package above it
        scopes.append(here.path + ".")
        here = here.parent
    for scope in scopes:
        path = scope + name
        if path == pkg.path or path.startswith(pkg.path + "."):
            try:
                target = pkg[path.removeprefix(pkg.path + ".")] if path != pkg.path else pkg
            except (KeyError, ValueError):
                continue
            return target.path
    return None
