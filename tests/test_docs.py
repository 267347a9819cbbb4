"""The guides run: every ```python block of each page executes, in order, in one namespace per page.

Blocks that must not run use another fence (```text, ```bash, ```java). A block that raises fails the
test with the page's line number of the block; the blocks' own asserts are the checks.
"""

import importlib.util
import re
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[1] / "docs"
FENCE = re.compile(r"^```(\w*)\n(.*?)^```[ \t]*$", flags=re.S | re.M)
KNOWN_FENCES = {"python", "text", "bash", "java"}
pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py

# page -> (optional extras it needs, the fewest python blocks it must have)
PAGES = {
    "transformer.md": ((), 12),
    "compat.md": (("keras", "onnxruntime", "onnxscript"), 7),
    "heads.md": (("matplotlib",), 7),
    "transformers.md": (("transformers", "matplotlib"), 8),
}


def python_blocks(text):
    """[(line of the block's first code line, code)] for every ```python fence, in page order."""
    return [
        (text.count("\n", 0, m.start(2)) + 1, m.group(2))
        for m in FENCE.finditer(text)
        if m.group(1) == "python"
    ]


@pytest.mark.parametrize("page", sorted(PAGES))
def test_fences_are_closed_and_labelled(page):
    text = (DOCS / page).read_text()
    fences = FENCE.findall(text)
    assert text.count("\n```") == 2 * len(fences), f"{page}: an unclosed or nested ``` fence"
    unknown = {lang for lang, _ in fences} - KNOWN_FENCES
    assert not unknown, f"{page}: fences {unknown} would silently not run; use python, text, bash or java"


@pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning", "ignore::FutureWarning")
@pytest.mark.parametrize("page", sorted(PAGES))
def test_page_runs(page, tmp_path, monkeypatch):
    extras, fewest = PAGES[page]
    missing = [name for name in extras if importlib.util.find_spec(name) is None]
    if missing:  # the optional extras multihead[keras], multihead[onnx]; requirements-dev installs them
        pytest.skip(f"{page} needs {missing} (not installed)")
    monkeypatch.setenv("KERAS_BACKEND", "torch")  # only matters if Keras is not imported yet
    monkeypatch.chdir(tmp_path)  # files the page writes (the .onnx export) land here
    blocks = python_blocks((DOCS / page).read_text())
    assert len(blocks) >= fewest, f"{page}: found {len(blocks)} python blocks, expected >= {fewest}"
    namespace = {"__name__": f"docs.{page}"}
    for line, code in blocks:
        # compile with the page as file name and the block's offset, so tracebacks point into the page
        exec(compile("\n" * (line - 1) + code, str(DOCS / page), "exec"), namespace)
