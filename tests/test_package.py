"""Packaging: one version, the declared dependencies match the imports, the dev pins mirror the extras,
the docs state one Python version and point only inside the repository, every load is a safe load.

The wheel itself is built, installed beside torch alone and smoke-tested by ``make test``
(``tests/wheel_smoke.py``).
"""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

import multihead

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
PROJECT = PYPROJECT["project"]


def name_of(requirement: str) -> str:
    """``"Foo_Bar[x]>=1; extra == 'y'"`` -> ``"foo-bar"`` (PEP 503 normalised)."""
    return re.sub(r"[-_.]+", "-", re.match(r"[A-Za-z0-9._-]+", requirement).group(0)).lower()


def extra_names(extra: str) -> set[str]:
    """Every distribution an extra pulls in, its ``multihead[...]`` self-references expanded."""
    out: set[str] = set()
    for req in PROJECT["optional-dependencies"][extra]:
        inner = re.fullmatch(r"multihead\[([\w,]+)\]", req)
        out |= set().union(*map(extra_names, inner.group(1).split(","))) if inner else {name_of(req)}
    return out


def test_one_version_source():
    assert "version" not in PROJECT and PROJECT["dynamic"] == ["version"]
    source = ROOT / PYPROJECT["tool"]["hatch"]["version"]["path"]
    assert re.search(rf'^__version__ = "{re.escape(multihead.__version__)}"$', source.read_text(), re.M)


def test_license_and_typing_ship():
    assert PROJECT["license"] == "MIT" and PROJECT["license-files"] == ["LICENSE"]
    assert (ROOT / "LICENSE").read_text().startswith("MIT License")
    assert (ROOT / "src" / "multihead" / "py.typed").is_file()
    assert "Typing :: Typed" in PROJECT["classifiers"]


def test_core_depends_on_torch_only_and_extras_cover_the_optional_imports():
    assert [name_of(r) for r in PROJECT["dependencies"]] == ["torch"]
    extras = PROJECT["optional-dependencies"]
    assert extra_names("all") == set().union(*(extra_names(e) for e in extras if e not in ("all", "dev")))
    assert {"matplotlib"} <= extra_names("viz") and {"keras"} == extra_names("keras")
    assert {"onnx", "onnxruntime", "onnxscript"} <= extra_names("onnx")
    assert extra_names("transformers") == {"transformers"} and extra_names("safetensors") == {"safetensors"}


def test_requirements_dev_pins_exactly_the_dev_extra_and_torch():
    lines = [ln.split("#")[0].strip() for ln in (ROOT / "requirements-dev.txt").read_text().splitlines()]
    pins = [ln for ln in lines if ln]
    assert all(re.fullmatch(r"[A-Za-z0-9._-]+==[\w.+]+", p) for p in pins), "pin every line with =="
    assert "torch==2.13.0" in pins  # the local CPU build; an unpinned torch would pull a CUDA build
    assert {name_of(p) for p in pins} == extra_names("dev") | {"torch"}


def _pins(name: str) -> dict[str, str]:
    """A requirements file's ``name==version`` lines as {normalised name: version}."""
    lines = [ln.split("#")[0].strip() for ln in (ROOT / name).read_text().splitlines()]
    pins = [ln for ln in lines if ln]
    assert all(re.fullmatch(r"[A-Za-z0-9._-]+==[\w.+]+", p) for p in pins), f"{name}: pin every line with =="
    return {name_of(p): p.split("==")[1] for p in pins}


def _floor(requirement: str) -> str:
    """``"keras>=3.8"`` -> ``"3.8"``: the one lower bound a declared dependency has."""
    bound = re.fullmatch(r"[A-Za-z0-9._-]+>=([\w.]+)", requirement)
    assert bound, f"{requirement!r}: declare a floor as NAME>=VERSION"
    return bound.group(1)


def test_the_floor_job_pins_pyprojects_floors_and_otherwise_the_dev_pins():
    """requirements-floor.txt (``make test-floor``) installs torch and Keras at exactly the oldest release
    pyproject allows (so a floor is a version the suite has passed on), the rest as requirements-dev.txt."""
    floor, dev = _pins("requirements-floor.txt"), _pins("requirements-dev.txt")
    (torch_req,) = PROJECT["dependencies"]
    (keras_req,) = PROJECT["optional-dependencies"]["keras"]
    for name, req in (("torch", torch_req), ("keras", keras_req)):
        oldest = _floor(req) + ".0" * (2 - _floor(req).count("."))  # "3.15" -> "3.15.0"; "2.7.1" stays
        assert floor[name] == oldest, f"{name}: pyproject says {req!r}, the floor job pins {floor[name]}"
    # transformers: the floor job installs the newest release; its floor is the dev pin (`make test`)
    (hf_req,) = PROJECT["optional-dependencies"]["transformers"]
    assert "transformers" not in floor and dev["transformers"] == _floor(hf_req) + ".0"
    # the rest exactly as pinned for development, less what the floor job does not run (lint, TF, JAX) and
    # attn-gym, which needs torch 2.9's FlexAttention (tests/test_flex_semantics.py skips there), and the
    # documentation site's tools (`make docs` runs on the dev pins)
    not_on_floor = ("torch", "keras", "transformers", "ruff", "tensorflow-cpu", "jax", "jaxlib", "attn-gym")
    not_on_floor += ("mkdocs", "mkdocstrings", "mkdocstrings-python", "mkdocs-material")
    assert {n: v for n, v in floor.items() if n not in ("torch", "keras")} == {
        n: v for n, v in dev.items() if n not in not_on_floor
    }


IMPORT_CHECK = """\
import sys
import multihead, multihead.core, multihead.nn, multihead.transformer, multihead.heads, multihead.viz
import multihead.checkpoint, multihead.export, multihead.cli, multihead.demo.run, multihead.distributed
import multihead.compat.torch, multihead.compat.d2l
optional = {"matplotlib", "keras", "onnx", "onnxruntime", "onnxscript", "transformers", "safetensors",
            "tensorflow", "jax"}
print(sorted({m.split(".")[0] for m in sys.modules} & optional))
"""


def test_importing_the_package_imports_no_optional_dependency():
    """(numpy is left out here: torch imports it when installed; the wheel smoke test runs without it.)"""
    out = subprocess.run(
        [sys.executable, "-c", IMPORT_CHECK], capture_output=True, text=True, check=True,
        env={"PYTHONPATH": str(ROOT / "src"), "PATH": "/usr/bin:/bin"},
    ).stdout  # fmt: skip
    assert out.strip() == "[]"


def test_docs_state_the_python_version_of_pyproject_and_stay_inside_the_repository():
    assert PROJECT["requires-python"] == ">=3.11"
    readme = (ROOT / "README.md").read_text()
    stated = set(re.findall(r"Python (?:>= ?)?3\.\d+\+?", readme))
    assert stated == {"Python >= 3.11"}, stated
    pages = [ROOT / "README.md", *(ROOT / "docs").glob("*.md"), *(ROOT / "src").rglob("*.py")]
    for page in pages:
        text = page.read_text()
        assert "../shared" not in text and "DESIGN.md" not in text, page


def test_every_torch_load_in_the_library_and_docs_is_a_safe_load():
    pages = [ROOT / "README.md", *(ROOT / "docs").glob("*.md"), *(ROOT / "src").rglob("*.py")]
    for page in pages:
        for call in re.findall(r"torch\.load\([^)]*\)", page.read_text()):
            assert "weights_only=True" in call, f"{page.name}: {call}"
