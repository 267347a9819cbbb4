"""Give the wheel's smoke-test venv this environment's torch, and nothing else (``make smoke``).

    .venv/bin/python tests/smoke_env.py SMOKE_VENV

Links torch and its own dependencies (their closure under torch's declared requirements: filelock, sympy,
networkx, jinja2, ...) from this environment's site-packages into ``SMOKE_VENV/torch-only/`` and puts that
folder on the venv's path with a ``.pth`` file. pip then finds torch installed when it installs the wheel with
its declared dependencies, and the smoke test imports torch compiled once, here: installing the pinned torch
into the venv again took 11 s and compiling it on first import (nothing writes .pyc files where
PYTHONDONTWRITEBYTECODE is set) most of the smoke test's 20 s, on the 2-core machine.
"""

from __future__ import annotations

import importlib.metadata as md
import subprocess
import sys
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name


def closure(root: str) -> list[md.Distribution]:
    """``root`` and every distribution it requires here, transitively (markers evaluated, no extras)."""
    seen: dict[str, md.Distribution] = {}
    todo = [root]
    while todo:
        name = canonicalize_name(todo.pop())
        if name in seen:
            continue
        seen[name] = dist = md.distribution(name)
        for line in dist.requires or []:
            req = Requirement(line)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return list(seen.values())


def link(dists: list[md.Distribution], into: Path) -> int:
    """Symlink each distribution's top-level files and folders (``__pycache__`` entries one by one)."""
    count = 0
    for dist in dists:
        site = Path(dist.locate_file(""))
        for top in sorted({f.parts[0] if f.parts[0] != "__pycache__" else str(f) for f in dist.files or []}):
            if top.startswith(".."):  # console scripts in bin/: not needed to import
                continue
            target = into / top
            target.parent.mkdir(parents=True, exist_ok=True)
            if not target.exists() and (site / top).exists():
                target.symlink_to(site / top)
                count += 1
    return count


def main(venv: str) -> int:
    purelib = subprocess.run(
        [f"{venv}/bin/python", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    into = Path(venv).resolve() / "torch-only"
    dists = closure("torch")
    link(dists, into)
    (Path(purelib) / "torch-only.pth").write_text(f"{into}\n")
    print(f"smoke venv: linked {', '.join(sorted(d.metadata['Name'] for d in dists))} from this environment")
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
