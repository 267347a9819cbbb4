"""MkDocs hooks of the documentation site (mkdocs.yml).

* The home page is README.md itself (its ``docs/...`` links made site-relative), so the two never drift.
* Files the guides link outside docs/ (``../benchmarks/results/...``, ``../tests/...``) are published under
  ``repo/`` and the links point there: the site stays whole offline, and a link to a file that is not in
  the repository still fails the strict build.
* Every public name an API page documents must have a docstring: a missing one is a warning, which the
  strict build turns into a failure. Public: a module's ``__all__`` (else its names without a leading
  underscore), a class's methods and properties without one. A method that overrides a documented one of
  a base class in multihead, or a hook torch or Keras documents (:data:`FRAMEWORK_HOOKS`), needs none.
"""

from __future__ import annotations

import logging
import re
from functools import cache
from pathlib import Path

import griffe
from mkdocs.structure.files import File, Files

log = logging.getLogger("mkdocs.hooks.multihead")
ROOT = Path(__file__).resolve().parents[2]
OUTSIDE = re.compile(r"\]\(\.\./([^)#\s]+)")  # a page's markdown link into the repository, outside docs/
DIRECTIVE = re.compile(r"^:::\s+([\w.]+)", flags=re.M)
# methods of torch.nn.Module and keras.Layer that a subclass overrides under the framework's documentation
FRAMEWORK_HOOKS = {"extra_repr", "build", "call", "compute_output_shape", "get_config"}


def _readme() -> str:
    text = (ROOT / "README.md").read_text()
    return re.sub(r"\]\(docs/", "](", text)  # docs/guide.md -> guide.md, docs/images/... -> images/...


def on_files(files: Files, config: object) -> Files:
    files.append(File.generated(config, "index.md", content=_readme()))
    outside = set()
    for page in (ROOT / "docs").glob("*.md"):
        outside |= set(OUTSIDE.findall(page.read_text()))
    for target in sorted(outside):
        path = ROOT / target
        if path.is_file():  # a missing one stays a broken link: the strict build names it
            files.append(File.generated(config, f"repo/{target}", abs_src_path=str(path)))
    return files


def on_page_markdown(markdown: str, page: object, config: object, files: Files) -> str:
    src = page.file.src_uri
    if src.startswith("repo/"):
        # a published repository file: its own links to other repository files stay as written text
        return re.sub(r"\]\((?!https?:)([^)]*)\)", r"] (\1)", markdown)
    if "/" not in src:
        markdown = OUTSIDE.sub(r"](repo/\1", markdown)
    for path in DIRECTIVE.findall(markdown):
        for name in undocumented(path):
            log.warning("%s: the public name %s has no docstring", src, name)
    return markdown


@cache
def _package() -> griffe.Module:
    return griffe.load("multihead", search_paths=[str(ROOT / "src")], resolve_aliases=True)


def _public(obj: griffe.Object) -> list[griffe.Object]:
    """The members an API page shows for ``obj``: a module's ``__all__`` (else its public names defined in
    it), a class's public methods and properties; never submodules or plain attributes."""
    if obj.is_module:
        names = obj.exports if obj.exports is not None else [n for n in obj.members if not n.startswith("_")]
        members = [obj.members[n] for n in names if n in obj.members]
    elif obj.is_class:
        members = [m for n, m in obj.members.items() if not n.startswith("_")]
    else:
        return []
    out = []
    for member in members:
        target = member.final_target if member.is_alias else member
        if not target.is_module and not target.is_attribute:
            out.append(target)
    return out


@cache
def undocumented(path: str) -> tuple[str, ...]:
    """Paths under ``path`` (one API page's object) of public functions and classes without a docstring."""
    obj = _package()[path.removeprefix("multihead.")] if path != "multihead" else _package()
    return missing_docstrings(obj)


def missing_docstrings(obj: griffe.Object) -> tuple[str, ...]:
    """Paths of ``obj`` and the public functions and classes under it that have no docstring."""
    obj = obj.final_target if obj.is_alias else obj
    missing, todo, seen = [], [obj], set()
    while todo:
        current = todo.pop()
        if current.path in seen:
            continue
        seen.add(current.path)
        if not current.docstring and not current.is_module and not _inherits_docs(current):
            missing.append(current.path)
        todo += _public(current)
    return tuple(sorted(missing))


def _inherits_docs(obj: griffe.Object) -> bool:
    """A method whose documentation is its base class's (in multihead) or its framework's."""
    cls = obj.parent
    if not (obj.is_function and cls is not None and cls.is_class):
        return False
    if obj.name in FRAMEWORK_HOOKS:
        return True
    try:
        bases = cls.mro()
    except ValueError:  # a base outside the package: nothing to inherit from here
        return False
    return any(obj.name in base.members and base.members[obj.name].docstring for base in bases)
