"""The numerics tests under every CPU kernel torch may pick on this machine (`make test` runs this).

torch compiles its CPU kernels once per ``ATEN_CPU_CAPABILITY`` (default, avx2, avx512 on x86) and runs the
best one the CPU has; users' CPUs pick others, and a tolerance tuned on one kernel can fail on another (the
suite once passed on an AMD CPU and failed on an Intel one). The suite itself runs under torch's own pick;
this runs the tests marked ``numerics`` (those that compare with the float64 reference) under each other
capability the CPU has, so every kernel a user may get is checked here: about 20 s a capability on 2 cores.

    python tests/cpu_kernels.py [pytest arguments...]   (arguments: they choose the tests, not the files
                                                          that mark tests numerics)
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from multihead.testing import cpu_capabilities


def main(argv: list[str]) -> int:
    caps = cpu_capabilities()
    own = caps[-1]  # torch's own pick: the one the suite ran under
    print(f"CPU capabilities here: {', '.join(caps)}; the suite ran under {own} (torch's pick)")
    root = Path(__file__).resolve().parent.parent
    files = numerics_files(root / "tests") if not argv else []
    for cap in caps[:-1]:
        start = time.perf_counter()
        cmd = [sys.executable, "-m", "pytest", "-q", "-m", "numerics", "-n", "2", "-p", "no:cacheprovider"]
        cmd += files
        env = {**os.environ, "ATEN_CPU_CAPABILITY": cap}
        status = subprocess.run(cmd + argv, cwd=root, env=env).returncode
        print(f"numerics tests under ATEN_CPU_CAPABILITY={cap}: {time.perf_counter() - start:.0f} s")
        if status:
            print(f"FAILED under ATEN_CPU_CAPABILITY={cap}: rerun with that variable set to see it alone")
            return status
    return 0


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
