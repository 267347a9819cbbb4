"""PyTorch's own MultiheadAttention tests, run against torch's class and against the drop-in.

An outside check of :class:`multihead.compat.torch.MultiheadAttention`: PyTorch's test file
``test/nn/test_multihead_attention.py`` is run twice with pytest, once as written (torch's class) and once
with ``torch.nn.MultiheadAttention`` replaced by the drop-in, and the per-test outcomes are compared.
Tests that mock torch's private fast-path op (``torch._native_multi_head_attention``) are left out: they
check which kernel torch picks, not what the class computes.

Nothing is downloaded: pass the path of a local copy of the test file (from a PyTorch source checkout of
the installed version, or saved from GitHub). Its imports (``torch.testing._internal``) need the
``expecttest`` package; point ``--site`` at a folder that holds it if it is not installed::

    python benchmarks/peer_torch_mha.py /tmp/test_multihead_attention.py [--site /tmp/site] [--only ours]

Prints one line per test (torch's outcome, the drop-in's) and the counts: the drop-in passes X of the Y
tests that torch's class passes. Exit status 0 when it passes every one of them.

Used with ``-p peer_torch_mha`` (this folder on the path and ``PEER_TORCH_MHA=ours`` in the environment)
the module is the pytest plugin that makes the substitution, before the test file is imported.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

HERE = Path(__file__).resolve().parent
SRC = HERE.parent / "src"
ENV = "PEER_TORCH_MHA"
EXCLUDE = "not fast_path_mock"  # tests that mock torch's private fast-path op


def _substitute() -> None:
    """The plugin's work: torch.nn.MultiheadAttention (both places the test file reads it) -> the drop-in."""
    import torch.nn
    import torch.nn.modules.activation

    from multihead.compat.torch import MultiheadAttention

    torch.nn.MultiheadAttention = MultiheadAttention  # type: ignore[misc]
    torch.nn.modules.activation.MultiheadAttention = MultiheadAttention  # type: ignore[misc]


if os.environ.get(ENV) == "ours" and __name__ != "__main__":  # imported by pytest as a plugin
    _substitute()


def _outcomes(junit: Path) -> dict[str, str]:
    """test name -> passed / failed / skipped, from a JUnit XML report."""
    result = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        name = f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}"
        tags = {child.tag for child in case}
        result[name] = (
            "failed" if tags & {"failure", "error"} else "skipped" if "skipped" in tags else "passed"
        )
    return result


def run(test_file: Path, which: str, site: str | None) -> tuple[dict[str, str], float]:
    """Run the test file with ``which`` ("torch" or "ours") as torch.nn.MultiheadAttention."""
    paths = [str(HERE), str(SRC), *([site] if site else []), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, ENV: which, "PYTHONPATH": os.pathsep.join(p for p in paths if p)}
    with tempfile.TemporaryDirectory() as tmp:
        junit = Path(tmp) / "report.xml"
        args = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "peer_torch_mha"]
        args += ["-k", EXCLUDE, f"--junitxml={junit}", str(test_file)]
        start = time.perf_counter()
        proc = subprocess.run(args, env=env, cwd=test_file.parent, capture_output=True, text=True)
        seconds = time.perf_counter() - start
        if not junit.exists():
            sys.exit(f"pytest did not run ({which}):\n{(proc.stdout + proc.stderr)[-3000:]}")
        return _outcomes(junit), seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("test_file", type=Path, help="a local copy of PyTorch's test_multihead_attention.py")
    parser.add_argument("--site", help="a folder to put on the path (one holding expecttest)")
    parser.add_argument("--only", choices=("torch", "ours"), help="run one side only")
    args = parser.parse_args(argv)
    if not args.test_file.is_file():
        parser.error(f"no such file: {args.test_file}")
    sides = [args.only] if args.only else ["torch", "ours"]
    results = {}
    for which in sides:
        results[which], seconds = run(args.test_file.resolve(), which, args.site)
        print(f"{which}: {sum(v == 'passed' for v in results[which].values())} passed in {seconds:.0f} s")
    names = sorted(set().union(*(r.keys() for r in results.values())))
    for name in names:
        print("  " + "  ".join(f"{results[w].get(name, '-'):8}" for w in sides) + "  " + name)
    if len(sides) == 2:
        baseline = [n for n in names if results["torch"].get(n) == "passed"]
        ours = [n for n in baseline if results["ours"].get(n) == "passed"]
        extra = [n for n in names if results["ours"].get(n) == "passed" and n not in baseline]
        print(f"the drop-in passes {len(ours)} of the {len(baseline)} tests torch's class passes", end="")
        print(f" (and {len(extra)} that torch's class fails)" if extra else "")
        return 0 if len(ours) == len(baseline) else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
