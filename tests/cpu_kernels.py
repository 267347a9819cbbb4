"""The numerics tests under every CPU kernel torch may pick on this machine (`make test` runs this).

torch compiles its CPU kernels once per ``ATEN_CPU_CAPABILITY`` (default, avx2, avx512 on x86) and runs the
best one the CPU has; users' CPUs pick others, and a tolerance tuned on one kernel can fail on another (the
suite once passed on an AMD CPU and failed on an Intel one). The suite itself runs under torch's own pick;
this runs the tests marked ``numerics`` (those that compare with the float64 reference) under each other
capability the CPU has, so every kernel a user may get is checked here.

One pytest run does it: an xdist worker per capability (``--tx popen//env:ATEN_CPU_CAPABILITY=...``) and
``--dist each``, which hands every test to every worker, so the capabilities run side by side, one core
each (with a single other capability, two workers under it share the tests: :func:`workers`), and the
test files are collected once per capability (two capabilities one after the other, two workers each, took
101 s on the 2-core machine; side by side: see docs/development.md). tests/conftest.py
checks in each worker that torch took the capability asked for and names it in a failure's report.

    python tests/cpu_kernels.py [pytest arguments...]   (arguments: they choose the tests, not the files
                                                          that mark tests numerics)
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from multihead.testing import cpu_capabilities


def main(argv: list[str]) -> int:
    caps = cpu_capabilities()
    own, others = caps[-1], caps[:-1]  # torch's own pick: the one the suite ran under
    print(f"CPU capabilities here: {', '.join(caps)}; the suite ran under {own} (torch's pick)")
    if not others:
        print("no other capability to rerun the numerics tests under")
        return 0
    root = Path(__file__).resolve().parent.parent
    files = numerics_files(root / "tests") if not argv else []
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "numerics", "-p", "no:cacheprovider"] + workers(others)
    start = time.perf_counter()
    status = subprocess.run(cmd + files + argv, cwd=root).returncode
    names = ", ".join(f"gw{i} {cap}" for i, cap in enumerate(others * 2 if len(others) == 1 else others))
    print(f"numerics tests under ATEN_CPU_CAPABILITY={'+'.join(others)} ({names}): "
          f"{time.perf_counter() - start:.0f} s")  # fmt: skip
    if status:
        print(
            "FAILED: each failure names its ATEN_CPU_CAPABILITY; rerun with that variable set to see it alone"
        )
    return status


def workers(others: list[str]) -> list[str]:
    """The xdist workers: one per capability, each given every test (``--dist each``), so the capabilities
    run side by side; with one other capability (an AVX2-only CPU: default alone), two workers under it
    share the tests (``--dist worksteal``), so both cores work (one worker alone took 438 s on a Zen 1)."""
    if len(others) == 1:
        return ["--dist", "worksteal", "--tx", f"2*popen//env:ATEN_CPU_CAPABILITY={others[0]}"]
    tx = [arg for cap in others for arg in ("--tx", f"popen//env:ATEN_CPU_CAPABILITY={cap}")]
    return ["--dist", "each", *tx]  # worker gw<i> runs under others[i]


def numerics_files(tests: Path) -> list[str]:
    """The test files that mark tests ``numerics``: only they are collected (collecting the whole suite, its
    optional libraries imported on each worker, cost about 13 s of CPU a capability for no test)."""
    return [
        str(p.relative_to(tests.parent))
        for p in sorted(tests.glob("test_*.py"))
        if "mark.numerics" in p.read_text()
    ]


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
