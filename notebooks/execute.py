"""Execute the notebooks with a real kernel of this Python (``make notebooks``; tests/test_notebooks.py).

The kernel is ``sys.executable -m ipykernel_launcher`` from a kernel spec written to a temporary folder, never
a kernel installed for the user. Run: ``python notebooks/execute.py [--tiny] [--save] [NAME ...]``:
``--tiny`` sets ``MULTIHEAD_NOTEBOOKS=tiny`` (the suite's short form: a tiny model, few training steps),
``--save`` writes each executed notebook back in place, with its outputs.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
NOTEBOOKS = sorted(HERE.glob("[0-9]*.ipynb"))
KERNEL = "multihead-notebooks"
TIMEOUT_S = 900  # per cell
MAX_BYTES = 2_000_000  # a committed notebook's size limit (outputs included)


@dataclass
class Executed:
    """One executed notebook: its cells with outputs (an ``nbformat`` node), the kernel's CPU seconds and the
    wall seconds."""

    notebook: object
    cpu_s: float
    wall_s: float


@contextmanager
def kernel_spec() -> Iterator[object]:
    """A ``KernelSpecManager`` that knows one kernel, :data:`KERNEL`: this Python with ipykernel."""
    from jupyter_client.kernelspec import KernelSpecManager

    with tempfile.TemporaryDirectory(prefix="multihead-kernel-") as tmp:
        folder = Path(tmp) / KERNEL
        folder.mkdir()
        spec = {
            "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
            "display_name": "multihead (this Python)",
            "language": "python",
        }
        (folder / "kernel.json").write_text(json.dumps(spec))
        yield KernelSpecManager(kernel_dirs=[tmp])


def _kernel_cpu(km: object) -> float:
    """CPU seconds the kernel process (and the children it waited for) used so far, from ``/proc`` (Linux;
    NaN elsewhere)."""
    try:
        pid = km.provisioner.process.pid  # type: ignore[attr-defined]
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (AttributeError, OSError):
        return float("nan")
    utime, stime, cutime, cstime = map(int, fields[11:15])  # stat fields 14-17, after "pid (comm)"
    return (utime + stime + cutime + cstime) / os.sysconf("SC_CLK_TCK")


def execute(path: Path, *, tiny: bool) -> Executed:
    """Run every cell of ``path`` in a fresh kernel started in the notebook's folder; raise
    ``nbclient.exceptions.CellExecutionError`` at the first cell that fails."""
    import nbformat
    from jupyter_client.manager import KernelManager
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    env = dict(os.environ, MULTIHEAD_NOTEBOOKS="tiny" if tiny else "full", PYTHONWARNINGS="ignore")
    with kernel_spec() as specs:
        km = KernelManager(kernel_name=KERNEL, kernel_spec_manager=specs)
        cpu = [float("nan")]

        def after_cell(cell_index: int = -1, **_: object) -> None:  # the kernel's CPU so far, while it lives
            cpu.append(_kernel_cpu(km))
            if os.environ.get("MULTIHEAD_NOTEBOOKS_TRACE"):
                print(f"  cell {cell_index}: {cpu[-1]:.1f} s CPU", file=sys.stderr, flush=True)

        client = NotebookClient(
            nb,
            km=km,
            timeout=TIMEOUT_S,
            resources={"metadata": {"path": str(path.parent)}},
            on_cell_executed=after_cell,
        )
        start = time.perf_counter()
        client.execute(env=env)
        wall = time.perf_counter() - start
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    return Executed(nb, cpu[-1], wall)


_FETCHING_SCRIPT = re.compile(
    r"<script\b[^>]*\bsrc=[\"']https?://[^>]*>.*?</script>"  # require.js, MathJax from a CDN
    r"|<script\b[^>]*>(?:(?!</script>).)*?\bimport\(\s*[\"']https?://.*?</script>",  # mermaid, imported from one
    re.S,
)


def offline_html(notebook: object) -> str:
    """``notebook`` (executed) as one HTML page that loads nothing: nbconvert's JupyterLab template with images
    embedded, less the template's scripts that load from a CDN (require.js, MathJax, mermaid; the outputs here
    need none of them). A notebook's own outputs are kept as they are."""
    from nbconvert import HTMLExporter

    body, _ = HTMLExporter(template_name="lab", embed_images=True).from_notebook_node(notebook)
    return _FETCHING_SCRIPT.sub("", body)


def save(executed: Executed, path: Path) -> int:
    """Write the executed notebook to ``path``; its size in bytes (refused above :data:`MAX_BYTES`)."""
    import nbformat

    text = nbformat.writes(executed.notebook) + "\n"
    if len(text.encode()) > MAX_BYTES:
        raise ValueError(
            f"{path.name}: {len(text.encode()):,} bytes with outputs, over {MAX_BYTES:,}: show less in it"
        )
    path.write_text(text, encoding="utf-8")
    return len(text.encode())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="the suite's short form")
    p.add_argument("--save", action="store_true", help="write the outputs into the notebooks")
    p.add_argument("names", nargs="*", help="notebook file names (default: all)")
    args = p.parse_args(argv)
    paths = [HERE / n for n in args.names] if args.names else NOTEBOOKS
    for path in paths:
        done = execute(path, tiny=args.tiny)
        size = f", {save(done, path):,} bytes saved" if args.save else ""
        print(f"{path.name}: {done.cpu_s:.1f} s CPU (kernel), {done.wall_s:.1f} s wall{size}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
