"""The pages run: every ```python block of README.md and of each docs/*.md page executes, in page order,
in one namespace per page.

Pages are found by globbing, so a new page is covered the day it is added. A block that imports a package
that is not installed skips the rest of its page, naming the package (the blocks before it have run). Blocks that must not run use
another fence (```text for pictures and output, ```bash for shell, ```java). A block that raises fails
the test with the page's line number of the block; the blocks' own asserts are the checks.
"""

import ast
import importlib.util
import re
import sys
import textwrap
import types
from pathlib import Path

import pytest
import torchvision_env

ROOT = Path(__file__).resolve().parents[1]
PAGES = {  # the guides, the API reference's pages (docs/api/), any page added under docs/
    p.relative_to(ROOT).as_posix(): p for p in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
}
FENCE = re.compile(r"^[ \t]*```(\w*)\n(.*?)^[ \t]*```[ \t]*$", flags=re.S | re.M)
KNOWN_FENCES = {"python", "text", "bash", "java"}
# What a page needs that its blocks do not import by name (torch.onnx.export uses onnxscript).
HIDDEN_NEEDS = {"docs/compat.md": ("onnxscript",)}
pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py


def python_blocks(text):
    """[(line of the block's first code line, code)] for every ```python fence, in page order."""
    return [
        (text.count("\n", 0, m.start(2)) + 1, textwrap.dedent(m.group(2)))
        for m in FENCE.finditer(text)
        if m.group(1) == "python"
    ]


def imported_packages(blocks):
    """Top-level package names the blocks import (``import a.b`` and ``from a.b import c`` -> ``a``)."""
    names = set()
    for _, code in blocks:
        for node in ast.walk(ast.parse(code)):
            if isinstance(node, ast.Import):
                names |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
    return names


def test_every_page_is_found():
    assert "README.md" in PAGES and "docs/guide.md" in PAGES and "docs/architecture.md" in PAGES
    assert len(PAGES) >= 10, sorted(PAGES)


@pytest.mark.parametrize("page", sorted(PAGES))
def test_fences_are_closed_and_labelled(page):
    text = PAGES[page].read_text()
    fences = FENCE.findall(text)
    assert len(re.findall(r"^[ \t]*```", text, flags=re.M)) == 2 * len(fences), (
        f"{page}: an unclosed or nested ``` fence"
    )
    unknown = {lang or "(no label)" for lang, _ in fences} - KNOWN_FENCES
    assert not unknown, f"{page}: fences {unknown} would silently not run; use python, text, bash or java"


@pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning", "ignore::FutureWarning")
@pytest.mark.parametrize("page", sorted(PAGES))
def test_page_runs(page, tmp_path, monkeypatch):
    text = PAGES[page].read_text()
    blocks = python_blocks(text)
    assert len(blocks) == text.count("```python"), f"{page}: a ```python fence the parser did not read"
    # the optional extras (multihead[keras], multihead[onnx], ...; requirements-dev installs them) and the real
    # models of the convert section (torchvision, open_clip: requirements-vision.txt); the floor job has not all
    missing = _missing(HIDDEN_NEEDS.get(page, ()))
    if missing:
        pytest.skip(f"{page} needs {missing} (not installed)")
    monkeypatch.setenv("KERAS_BACKEND", "torch")  # only matters if Keras is not imported yet
    monkeypatch.chdir(tmp_path)  # files a page writes (an .onnx export, a plot) land here
    # the page is an importable module while it runs: torch's compiler looks a function's module up
    page_module = types.ModuleType("docs." + page.removeprefix("docs/").removesuffix(".md").replace("/", "."))
    monkeypatch.setitem(sys.modules, page_module.__name__, page_module)
    namespace = page_module.__dict__
    for line, code in blocks:
        needs = imported_packages([(line, code)])
        vision = needs & {"torchvision", "open_clip"}  # requirements-vision.txt, a folder of their own
        missing = sorted(
            {n for n in vision if not torchvision_env.available(n)} | set(_missing(needs - vision))
        )
        if missing:  # the blocks before it ran; those after it may use its names, so they skip with it
            pytest.skip(f"{page} from line {line} on needs {missing} (not installed)")
        if vision:
            torchvision_env.load()  # torchvision's CUDA wheel beside the CPU torch (see that module)
        # compile with the page as file name and the block's offset, so tracebacks point into the page
        exec(compile("\n" * (line - 1) + code, str(PAGES[page]), "exec"), namespace)


def _missing(packages):
    return sorted(n for n in packages if n not in sys.modules and importlib.util.find_spec(n) is None)


TEST_REFERENCE = re.compile(r"\b(test_\w+\.py)::(test_\w+)")


@pytest.mark.parametrize("page", sorted(PAGES))
def test_tests_a_page_cites_exist(page):
    """A claim backed by ``test_file.py::test_name`` names a test that is there (renames leave no stale cite)."""
    tests = ROOT / "tests"
    missing = [
        f"{file}::{name}"
        for file, name in TEST_REFERENCE.findall(PAGES[page].read_text())
        if not (tests / file).exists() or f"def {name}(" not in (tests / file).read_text()
    ]
    assert not missing, f"{page} cites tests that do not exist: {missing}"


def test_the_guide_lists_every_backend():
    """docs/guide.md's backend table has a row for every backend the library defines (a class with a ``name``
    in ``core/backends/``; read from the source: the registry at run time may hold a test's or a page's own)."""
    names = set()
    for path in (ROOT / "src" / "multihead" / "core" / "backends").glob("*.py"):
        for cls in (n for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.ClassDef)):
            for stmt in cls.body:
                if isinstance(stmt, ast.Assign) and [getattr(t, "id", None) for t in stmt.targets] == [
                    "name"
                ]:
                    names.add(ast.literal_eval(stmt.value))
    assert names >= {"flex", "sdpa", "blocked", "math"}, names
    rows = re.findall(r'^\| `"(\w+)"`', PAGES["docs/guide.md"].read_text(), flags=re.M)
    assert names | {"auto"} == set(rows), rows
