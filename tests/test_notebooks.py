"""The notebooks (notebooks/*.ipynb) run in a real kernel, their results draw themselves, and their HTML export
draws offline in headless Chromium.

Each notebook runs in its short form (``MULTIHEAD_NOTEBOOKS=tiny``: a tiny model, a few training steps) in a
fresh ipykernel of this Python (``notebooks/execute.py``: a kernel spec written to a temporary folder, not a
kernel installed for the user). A cell that raises fails the test, naming the cell. Every result the notebooks
display through multihead (``viz.show``, a capture, a lens cache, a circuit graph) carries self-contained HTML
and a PNG fallback. The lens notebook, which shows every kind of view, is also exported with nbconvert and opened
in headless Chromium with no host name resolvable: each view reports that it drew, the console is empty and no
resource was requested.
"""

from __future__ import annotations

import base64
import re
import sys
from pathlib import Path

import pytest
from browser import need_chromium

for _name in ("nbclient", "nbformat", "nbconvert", "ipykernel"):
    pytest.importorskip(_name)

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "notebooks"))
import execute  # noqa: E402  (notebooks/execute.py)

from multihead.testing import render  # noqa: E402

NOTEBOOKS = [p.name for p in execute.NOTEBOOKS]
LENS = "005_lens_and_circuits.ipynb"
VIEWS = {  # the multihead views each notebook displays (at least)
    "000_keras.ipynb": 2,
    "001_pytorch_from_scratch.ipynb": 2,
    "002_tensorflow_fused_qkv.ipynb": 2,
    "003_d2l_java_djl.ipynb": 1,
    "004_d2l_tensorflow.ipynb": 3,
    LENS: 5,
}
REQUESTS = re.compile(r"""\bsrc=["']https?://|\bimport\(\s*["']https?://|<link\b[^>]*\bhref=["']https?://""")

# Reports the first resource the page requests (none should be) and, once every view has settled, the page's
# status: "ready N" with N views drawn, or "error".
CHECK = """<script>
new PerformanceObserver((list) => { for (const e of list.getEntries())
  document.body.dataset.status = "requested " + e.name; }).observe({ type: "resource", buffered: true });
function settle() {
  if ((document.body.dataset.status || "").startsWith("requested")) return;
  const s = Array.from(document.querySelectorAll("[data-mh-view]")).map((v) => v.dataset.status);
  if (s.includes("error")) document.body.dataset.status = "error";
  else if (s.every((x) => x === "ready")) document.body.dataset.status = "ready " + s.length;
  else setTimeout(settle, 50);
}
window.addEventListener("load", settle);
</script>"""


def test_every_notebook_is_listed():
    assert sorted(VIEWS) == NOTEBOOKS


def _outputs(nb):
    return [(i, o) for i, cell in enumerate(nb.cells) if cell.cell_type == "code" for o in cell.outputs]


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_runs_and_its_results_draw_themselves(name, tmp_path):
    done = execute.execute(execute.HERE / name, tiny=True)  # raises CellExecutionError at a failing cell
    outputs = _outputs(done.notebook)
    errors = [(i, o.ename, o.evalue) for i, o in outputs if o.output_type == "error"]
    assert not errors, errors
    tracebacks = [(i, o.text) for i, o in outputs if o.output_type == "stream" and "Traceback" in o.text]
    assert not tracebacks, tracebacks
    views = [(i, o.data) for i, o in outputs if "data-mh-view" in o.get("data", {}).get("text/html", "")]
    assert len(views) >= VIEWS[name], [i for i, _ in views]
    for i, data in views:
        assert not re.search(r"https?://", data["text/html"]), f"cell {i}: an address in a view"
        png = base64.b64decode(data["image/png"])
        assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 1000, f"cell {i}: no PNG fallback"
    if name == LENS:
        _export_draws_offline(done.notebook, tmp_path)


def _export_draws_offline(notebook, tmp_path):
    """The nbconvert export (JupyterLab template, images embedded, no CDN script) in headless Chromium."""
    text = execute.offline_html(notebook)
    assert not REQUESTS.search(text), REQUESTS.search(text).group(0)
    n = text.count("data-mh-view=")
    assert n >= VIEWS[LENS]
    need_chromium("the export")
    page, shot = tmp_path / "lens.html", tmp_path / "lens.png"
    page.write_text(text.replace("</body>", CHECK + "</body>"), encoding="utf-8")
    got = render(page, screenshot=shot, window=(1200, 1600))
    assert got.status == f"ready {n}" and got.console == [], got
    import numpy as np
    from PIL import Image

    image = np.asarray(Image.open(shot).convert("RGB"), dtype=np.int16)
    assert image.std() > 20 and len(np.unique(image.reshape(-1, 3), axis=0)) > 50  # drawn, not blank
