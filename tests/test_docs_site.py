"""The documentation site's own checks (docs/_mkdocs/): what makes `make docs` fail in strict mode.

`make docs` (part of `make test`) builds the site; these tests show, on planted code, that its two checks
catch what they are for: a public name without a docstring, a docstring reference that names nothing.
They need the site's tools (requirements-dev.txt) and skip without them.
"""

import importlib.util
import sys
import textwrap
from pathlib import Path

import pytest

griffe = pytest.importorskip("griffe")
pytest.importorskip("mkdocs")

ROOT = Path(__file__).resolve().parents[1]


def _load(name):
    spec = importlib.util.spec_from_file_location(f"_site_{name}", ROOT / "docs" / "_mkdocs" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


hooks, roles = _load("hooks"), _load("roles")

PLANTED = '''\
"""A planted package: see :func:`helper`, :class:`~planted.Thing` and :func:`nothing_here`."""

__all__ = ["Thing", "documented", "helper"]


def helper(x: int) -> int:
    return x


def documented(x: int) -> int:
    """Documented."""
    return x


class Thing:
    """A class."""

    def method(self) -> None:
        pass

    def extra_repr(self) -> str:
        return ""
'''


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    folder = tmp_path_factory.mktemp("src")
    (folder / "planted").mkdir()
    (folder / "planted" / "__init__.py").write_text(textwrap.dedent(PLANTED))
    return griffe.load("planted", search_paths=[str(folder)])


def test_a_public_name_without_a_docstring_is_named(planted):
    # extra_repr: a torch hook documented by torch; documented(): has one
    assert hooks.missing_docstrings(planted) == ("planted.Thing.method", "planted.helper")


def test_a_reference_resolves_or_is_reported(planted, caplog):
    assert roles._resolve(planted, planted, "helper") == "planted.helper"
    assert roles._resolve(planted["Thing"], planted, "~planted.Thing".lstrip("~")) == "planted.Thing"
    assert roles._resolve(planted, planted, "nothing_here") is None
    roles.SphinxRoles().on_package(pkg=planted)
    text = planted.docstring.value
    assert '<autoref identifier="planted.helper" optional><code>helper</code></autoref>' in text
    assert "<code>Thing</code></autoref>" in text  # ~ shows the last part
    assert "'nothing_here', which names nothing" in caplog.text


def test_the_library_has_no_undocumented_public_name_on_its_api_pages():
    pages = sorted((ROOT / "docs" / "api").glob("*.md"))
    paths = [p for page in pages for p in hooks.DIRECTIVE.findall(page.read_text())]
    assert len(paths) >= 12, paths
    missing = {p: hooks.undocumented(p) for p in paths if hooks.undocumented(p)}
    assert not missing, missing
