"""The package's shape, checked: no import cycle, the layering rules of docs/architecture.md, light imports.

Every module under ``src/multihead`` is parsed with ``ast`` (nothing is imported), and every ``import`` and
``from ... import`` statement is read wherever it is: at module level, inside functions and methods, under
``if TYPE_CHECKING:``. Each gives an edge ``importer -> imported`` between ``multihead.*`` modules:

* ``import a.b`` and ``from a.b import name`` -> ``a.b`` (the module whose contents are read);
* ``from a import b`` where ``a.b`` is a module -> ``a.b`` (the package ``a`` only has to exist);
* relative imports are resolved against the importer's package.
"""

from __future__ import annotations

import ast
import functools
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = "multihead"


class Edge(NamedTuple):
    """``importer`` imports ``imported`` at ``line`` of the importer's file."""

    importer: str
    imported: str
    line: int

    def __str__(self) -> str:
        path = module_files()[self.importer].relative_to(SRC.parent)
        return f"{self.importer} -> {self.imported}  ({path}:{self.line})"


@functools.cache
def module_files() -> dict[str, Path]:
    """``{"multihead.core.attention": path}`` for every module of the package (packages by __init__.py)."""
    files = {}
    for path in sorted((SRC / PACKAGE).rglob("*.py")):
        parts = path.relative_to(SRC).with_suffix("").parts
        files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return files


def _base(importer: str, level: int) -> str:
    """The package a ``from .`` (level 1), ``from ..`` (level 2) ... import of ``importer`` starts from."""
    package = importer if module_files()[importer].name == "__init__.py" else importer.rpartition(".")[0]
    for _ in range(level - 1):
        package = package.rpartition(".")[0]
    return package


@functools.cache
def imports_of(importer: str) -> list[Edge]:
    """Every import of a ``multihead`` module by ``importer``, wherever the statement is in the file."""
    modules = module_files()
    tree = ast.parse(modules[importer].read_text(), filename=str(modules[importer]))
    edges = []
    for node in ast.walk(tree):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            source = node.module or ""
            if node.level:
                source = _base(importer, node.level) + (f".{source}" if source else "")
            for alias in node.names:
                sub = f"{source}.{alias.name}"
                targets.append(sub if sub in modules else source)
        for target in targets:
            if target == PACKAGE or target.startswith(PACKAGE + "."):
                assert target in modules, f"{importer}:{node.lineno} imports {target}, which does not exist"
                edges.append(Edge(importer, target, node.lineno))
    return edges


@functools.cache
def import_graph() -> list[Edge]:
    return [edge for module in module_files() for edge in imports_of(module)]


def find_cycles(edges: list[Edge]) -> list[list[Edge]]:
    """The cycles of the graph, each as its list of edges: in every strongly connected component, a
    shortest cycle through each member (each cycle listed once). [] when the graph is acyclic."""
    out: dict[str, list[Edge]] = {}
    for e in edges:
        out.setdefault(e.importer, []).append(e)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    components: list[set[str]] = []

    def strongconnect(node: str) -> None:  # Tarjan's algorithm
        index[node] = low[node] = len(index)
        stack.append(node)
        for e in out.get(node, []):
            if e.imported not in index:
                strongconnect(e.imported)
                low[node] = min(low[node], low[e.imported])
            elif e.imported in stack:
                low[node] = min(low[node], index[e.imported])
        if low[node] == index[node]:
            component = set()
            while True:
                member = stack.pop()
                component.add(member)
                if member == node:
                    break
            components.append(component)

    for node in sorted(out):
        if node not in index:
            strongconnect(node)
    cycles: list[list[Edge]] = []
    for c in components:  # a shortest cycle through each member, each cycle once
        if len(c) > 1 or any(e.imported in c for e in out.get(next(iter(c)), [])):
            for member in sorted(c):
                cycle = _cycle_in(member, c, out)
                if not any(set(cycle) == set(seen) for seen in cycles):
                    cycles.append(cycle)
    return cycles


def _cycle_in(start: str, component: set[str], out: dict[str, list[Edge]]) -> list[Edge]:
    """A shortest cycle through ``start`` inside its component (breadth-first search back to ``start``)."""
    came: dict[str, Edge] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for node in frontier:
            for e in out.get(node, []):
                if e.imported == start:
                    path = [e]
                    while path[0].importer != start:
                        path.insert(0, came[path[0].importer])
                    return path
                if e.imported in component and e.imported not in came:
                    came[e.imported] = e
                    nxt.append(e.imported)
        frontier = nxt
    raise AssertionError(f"{start} is on no cycle of its component")


def _in(module: str, areas: tuple[str, ...]) -> bool:
    return any(module == a or module.startswith(a + ".") for a in areas)


# Layering: (the modules the rule is about, what they must not import, why)
_ABOVE_CORE = ("nn", "transformer", "heads", "viz", "lens", "distributed", "compat", "integrations")
_TOOLS = ("bench", "demo", "cli", "commands", "export", "testing")
LAYER_RULES = [
    (
        f"{PACKAGE}.core",
        tuple(f"{PACKAGE}.{m}" for m in _ABOVE_CORE + _TOOLS),
        "the core imports nothing above it; what extends it plugs in through the seam",
    ),
    (
        f"{PACKAGE}.nn",
        tuple(
            f"{PACKAGE}.{m}"
            for m in ("distributed", "heads", "viz", "lens", "compat", "integrations", "transformer")
        ),
        "the modules know only the core; ring attention and inspection plug in through nn.seam",
    ),
]
# The data flow of docs/architecture.md: a module may import only from its own rank or below.
RANKS = {
    "_extras": 0,  # optional-dependency checks: imports nothing of multihead, usable from every layer
    "progress": 0,  # the tools' progress bar: imports nothing of multihead
    "core": 0,
    "nn": 1,
    **dict.fromkeys(("transformer", "heads", "viz", "lens", "distributed"), 2),
    **dict.fromkeys(
        ("", "compat", "integrations", "checkpoint"), 3
    ),  # "": the package's __init__, the public names
    **dict.fromkeys(("export", "cli", "commands", "bench", "demo", "testing", "__main__"), 4),
}


def area(module: str) -> str:
    """``multihead.core.backends.math`` -> ``core``; the package itself -> ``""``."""
    return module.split(".")[1] if "." in module else ""


# Third-party packages a layer must not import (optional extras and heavy libraries)
FOREIGN_RULES = [(f"{PACKAGE}.core", ("keras", "matplotlib", "tensorflow", "jax", "transformers", "onnx"))]


def test_the_parser_reads_every_kind_of_import():
    """The graph sees relative, absolute, submodule and function-level imports (or the checks are blind)."""
    edges = {(e.importer, e.imported) for e in import_graph()}
    assert ("multihead.nn.attention", "multihead.nn.seam") in edges  # from . import seam
    assert ("multihead.nn.seam", "multihead.core.attention") in edges  # from ..core.attention import ...
    assert ("multihead", "multihead.core") in edges  # from .core import ...
    function_level = []
    for module, path in module_files().items():
        lines = {
            inner.lineno
            for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            for inner in ast.walk(node)
            if isinstance(inner, (ast.Import, ast.ImportFrom))
        }
        function_level += [e for e in imports_of(module) if e.line in lines]
    assert function_level, "no function-level import of a multihead module found: is the walk too shallow?"
    assert len(module_files()) >= 40


def test_find_cycle_finds_one():
    """The detector itself can fail: a planted two-module cycle and a self-import are found."""
    a_b, b_c, c_a, d_d = Edge("a", "b", 1), Edge("b", "c", 2), Edge("c", "a", 3), Edge("d", "d", 4)
    assert find_cycles([a_b, b_c]) == []
    assert find_cycles([a_b, b_c, c_a, d_d, Edge("c", "e", 5)]) == [[a_b, b_c, c_a], [d_d]]
    a_e, e_a = Edge("a", "e", 6), Edge("e", "a", 7)  # two cycles through a: both reported
    b_a = Edge("b", "a", 8)
    assert [set(c) for c in find_cycles([a_b, b_a, a_e, e_a])] == [{a_b, b_a}, {a_e, e_a}]


def test_no_import_cycle():
    cycles = find_cycles(import_graph())
    assert not cycles, "import cycles (function-level imports count):\n" + "\n".join(
        "  " + "\n  ".join(map(str, cycle)) + "\n" for cycle in cycles
    )


def against_rule(edges, layer: str, forbidden: tuple[str, ...]) -> list[Edge]:
    """The edges from ``layer`` into any of the ``forbidden`` areas."""
    return [e for e in edges if _in(e.importer, (layer,)) and _in(e.imported, forbidden)]


def upward(edges) -> list[Edge]:
    """The edges from a lower rank to a higher one."""
    return [e for e in edges if RANKS[area(e.importer)] < RANKS[area(e.imported)]]


def test_the_rules_catch_a_planted_import():
    """The layering checks can fail: a core -> viz and an nn -> distributed import are caught."""
    planted = [
        Edge("multihead.core.masks", "multihead.viz.plots", 1),
        Edge("multihead.nn.seam", "multihead.distributed.ring", 2),
    ]
    (core_rule, nn_rule) = LAYER_RULES
    assert against_rule(planted, *core_rule[:2]) == planted[:1]
    assert against_rule(planted, *nn_rule[:2]) == planted[1:]
    assert upward(planted) == planted
    assert upward([Edge("multihead.viz.capture", "multihead.heads.naming", 3)]) == []  # same rank


@pytest.mark.parametrize(("layer", "forbidden", "why"), LAYER_RULES, ids=[r[0] for r in LAYER_RULES])
def test_layering(layer, forbidden, why):
    bad = against_rule(import_graph(), layer, forbidden)
    assert not bad, f"{why}; offending imports:\n  " + "\n  ".join(map(str, bad))


def test_data_flows_one_way():
    unknown = sorted({area(m) for m in module_files()} - set(RANKS))
    assert not unknown, (
        f"new top-level modules {unknown}: give them a rank in RANKS here and in docs/architecture.md"
    )
    up = upward(import_graph())
    assert not up, "imports against the data flow (a lower layer importing a higher one):\n  " + "\n  ".join(
        f"{e}   [rank {RANKS[area(e.importer)]} -> {RANKS[area(e.imported)]}]" for e in up
    )


@pytest.mark.parametrize(("layer", "forbidden"), FOREIGN_RULES, ids=[r[0] for r in FOREIGN_RULES])
def test_core_imports_no_optional_library(layer, forbidden):
    bad = []
    for module, path in module_files().items():
        if not _in(module, (layer,)):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            bad += [
                f"{module} -> {n}  ({path.name}:{node.lineno})" for n in names if n.split(".")[0] in forbidden
            ]
    assert not bad, "the core depends on torch only; offending imports:\n  " + "\n  ".join(bad)


HEAVY = ("matplotlib", "keras", "tensorflow", "jax", "transformers", "onnx", "onnxruntime", "onnxscript")
LIGHT_IMPORTS = {
    "package": "multihead",
    # each extra is imported where it is used (a plot, a Keras layer, an export), not on import
    "torch-only parts": "multihead.heads, multihead.viz, multihead.lens, multihead.distributed, multihead.compat.torch, "
    "multihead.compat.d2l, multihead.testing, multihead.export, multihead.cli",
}


@pytest.mark.parametrize("modules", list(LIGHT_IMPORTS.values()), ids=list(LIGHT_IMPORTS))
def test_import_loads_no_optional_library(modules):
    """``import multihead`` in a fresh interpreter loads torch, not the extras (checked in sys.modules)."""
    code = f"import sys, {modules}; print(sorted(m for m in {HEAVY!r} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", f"import {modules} imported {out.stdout.strip()}"
