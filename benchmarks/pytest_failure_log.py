"""A pytest plugin for the GPU session: every failure's report appended to ``$FAILURE_LOG`` as it happens,
so a run stopped at the lease's deadline (before pytest's summary) still says why each test failed.

Use: ``PYTHONPATH=benchmarks FAILURE_LOG=$OUT/failures.log pytest -p pytest_failure_log ...``.
"""

from __future__ import annotations

import os

import pytest


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    path = os.environ.get("FAILURE_LOG")
    if not path or not report.failed or os.environ.get("PYTEST_XDIST_WORKER"):  # the controller writes once
        return
    with open(path, "a") as f:
        f.write(f"=== {report.nodeid} ({report.when})\n{report.longreprtext[-3000:]}\n\n")
