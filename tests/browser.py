"""The page tests' one gate on headless Chromium (tests/test_view.py, test_notebook_display.py, test_notebooks.py)."""

from __future__ import annotations

import os

import pytest

from multihead.testing import chromium


def need_chromium(what: str) -> None:
    """Skip where no Chromium is on PATH (a developer's machine), fail under CI=true (CI installs it with
    ``make browser``); ``what`` says what is then not drawn."""
    if chromium() is None:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail("CI=true but no chromium on PATH: run `make browser` (apt-get install chromium)")
        pytest.skip(f"no chromium on PATH (apt-get install chromium, or make browser); {what} is not drawn")
