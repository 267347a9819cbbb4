"""Results drawn in a notebook (``viz.show`` and the ``_repr_html_``/``_repr_png_`` of the tools' results).

Each kind is drawn and read back on its own terms: the head views' embedded data decoded here (base64, zlib,
uint8, key-major, as documented) and compared with the captured weights; the heatmaps' cells read from the
SVG's tooltips; the circuit's edges from its table. Every view is checked to reference nothing outside itself,
several views in one page to have distinct ids, and a page of several views is drawn in headless Chromium with
every host name unresolvable: each view reports it drew, nothing was requested, and with its scripts removed
(a notebook frontend that does not run them) what was drawn on the server still shows.
"""

from __future__ import annotations

import base64
import io
import json
import os
import re
import subprocess
import sys
import zlib
from html.parser import HTMLParser

import numpy as np
import pytest
import torch
from browser import need_chromium
from toy_models import ToySeq2Seq, toy_inputs

from multihead import heads, lens, viz
from multihead.heads import PruneResult, PruneStep
from multihead.lens import Graph, Node
from multihead.lens.attribution import Attribution
from multihead.testing import render
from multihead.viz.show import page

PNG = b"\x89PNG\r\n\x1a\n"
SRC, TGT = ["<s>", "the", "cat", "sat", "."], ["<bos>", "le", "chat", "assis"]


@pytest.fixture(scope="module")
def toy():
    """A seq2seq of attention only (encoder self, decoder self, cross), its capture and lens cache."""
    torch.manual_seed(0)
    model = ToySeq2Seq().eval()
    x, y = toy_inputs(model)  # (3, 5, 16), (3, 4, 16)
    with torch.no_grad(), viz.capture(model) as cap:
        model(x, y)
    with torch.no_grad(), lens.cache(model, points=("pattern", "z")) as c:
        model(x, y)
    return model, {"x": x, "y": y}, cap, c


def graph():
    """A circuit over 2 layers of 3 heads with an MLP: scores only where the writer is upstream."""
    layers = [f"model.layers.{i}" for i in range(2)]
    writers = [Node("model.embed_tokens", "embed")]
    readers = []
    for name in layers:
        readers += [Node(f"{name}.self_attn", k, h) for k in "qkv" for h in range(3)]
        writers += [Node(f"{name}.self_attn", "head", h) for h in range(3)]
        readers.append(Node(f"{name}.mlp", "mlp"))
        writers.append(Node(f"{name}.mlp", "mlp"))
    readers.append(Node("lm_head", "logits"))
    order = {n: i for i, n in enumerate(dict.fromkeys(w.name for w in writers))}
    order["lm_head"] = len(order)
    upstream = torch.tensor(
        [[order[w.name] < order[r.name] for r in readers] for w in writers]
    )  # a writer feeds the readers of later modules
    g = torch.Generator().manual_seed(1)
    scores = torch.randn(len(writers), len(readers), generator=g) * upstream
    return Graph(writers, readers, scores, upstream=upstream, metric_clean=2.0, metric_corrupted=0.5)


def attribution():
    g = torch.Generator().manual_seed(2)
    heads = torch.randn(2, 4, 3, generator=g)  # (N, H, B)
    rest = torch.tensor([0.5, -1.0, 2.0])
    return Attribution(["layers.0.attn", "layers.1.attn"], heads, rest, heads.sum((0, 1)) + rest)


def prune_result(model):
    """What prune_iteratively returns after removing 3 heads (the model pruned for real, a copy)."""
    pruned = {"encoder.layers.0.self_attn": [1, 3], "decoder.layers.1.cross_attn": [0]}
    history = [PruneStep(2, 22, 0.9, True), PruneStep(1, 21, 0.8, True), PruneStep(3, 18, 0.2, False)]
    return PruneResult(heads.prune(model, pruned), pruned, 1.0, 0.8, history)


# ------------------------------------------------------------------------------------------------
# Reading a view back
# ------------------------------------------------------------------------------------------------


class Parsed(HTMLParser):
    """Every tag's attributes, the ``data-p="data"`` JSON of head views, and the text of ``<title>``s."""

    def __init__(self, text):
        super().__init__()
        self.attrs, self.data, self.titles, self._in = [], [], [], None
        self.feed(text)
        self.close()

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        self.attrs.append((tag, a))
        self._in = "data" if (tag == "script" and a.get("data-p") == "data") else tag

    def handle_endtag(self, tag):
        self._in = None

    def handle_data(self, data):
        if self._in == "data":
            self.data.append(json.loads(data))
        elif self._in == "title":
            self.titles.append(data)


FETCHES = re.compile(
    r"@import|url\((?!#)|\bfetch\(|XMLHttpRequest|\bimport\(|new Worker|<link\b|<iframe\b|https?://"
)


def assert_offline(text):
    """Nothing in the HTML can make a request: every src/href inline (data:) or in-page (#), no CSS import or
    url() to a resource, no fetch/XHR/dynamic import/worker, no link or iframe, no http(s) address at all."""
    refs = [v for _, a in Parsed(text).attrs for k, v in a.items() if k in ("src", "href") and v]
    assert all(v.startswith(("data:", "#")) for v in refs), refs
    assert not FETCHES.search(text), FETCHES.search(text).group(0)


def heads_of(data):
    """A head view's heads decoded independently: ``{module: (H, Lq, Lk) float64}``."""
    out = {}
    for m in data["modules"]:
        lq, lk = len(data["sequences"][m["q"]]), len(data["sequences"][m["k"]])
        raw = [np.frombuffer(zlib.decompress(base64.b64decode(b)), dtype=np.uint8) for b in m["blobs"]]
        out[m["name"]] = np.stack([r.reshape(lk, lq).T for r in raw]) / 255.0  # key-major
    return out


def cells_of(text):
    """A heatmap's cells from their tooltips: ``{(module, head): value}`` (None where the head is absent)."""
    out = {}
    for t in Parsed(text).titles:
        found = re.fullmatch(r"(.+) head (\d+): (.*)", t)
        if found:
            out[found.group(1), int(found.group(2))] = float(found.group(3)) if found.group(3) else None
    return out


def png_image(data):
    from PIL import Image

    assert data[:8] == PNG
    image = Image.open(io.BytesIO(data))
    image.load()  # decodes every row: a broken stream raises
    return np.asarray(image.convert("RGB"))


# ------------------------------------------------------------------------------------------------
# Each kind
# ------------------------------------------------------------------------------------------------


def test_a_capture_draws_the_head_view_of_its_weights(toy):
    _, _, cap, _ = toy
    text = cap._repr_html_()  # the Capture displays itself through viz.show
    assert 'data-mh-view="CaptureView"' in text
    assert_offline(text)
    (data,) = Parsed(text).data
    assert data["sequences"] == {"encoder": list("01234"), "decoder": list("0123")}  # numbered: no labels
    labelled = Parsed(viz.show(cap, source=SRC, target=TGT, example=2)._repr_html_()).data[0]
    assert labelled["sequences"] == {"encoder": SRC, "decoder": TGT}
    sides = {m["name"]: (m["kind"], m["q"], m["k"]) for m in labelled["modules"]}
    assert sides["decoder.layers.1.cross_attn"] == ("cross", "decoder", "encoder")
    assert sides["encoder.layers.0.self_attn"] == ("encoder self", "encoder", "encoder")
    got = heads_of(labelled)
    assert list(got) == cap.names()
    for name, w in got.items():
        assert np.abs(w - cap.get(name)[2].double().numpy()).max() <= 1 / 510 + 1e-6, name


def test_a_lens_cache_draws_its_patterns_and_lists_every_point(toy):
    _, _, _, c = toy
    text = c._repr_html_()
    assert_offline(text)
    (data,) = Parsed(text).data
    for name, w in heads_of(data).items():
        assert np.abs(w - c[name, "pattern"][0].double().numpy()).max() <= 1 / 510 + 1e-6, name
    rows = re.findall(r"<tr><td>([^<]+)</td><td>([^<]+)</td><td>([^<]+)</td>", text)
    assert sorted(rows) == sorted((n, p, str(tuple(c[n, p].shape))) for n, p in c.keys())


def test_a_cache_without_patterns_is_a_table_of_its_points(toy):
    model, inputs, _, _ = toy
    with torch.no_grad(), lens.cache(model, points="z") as c:
        model(**inputs)
    view = viz.show(c)
    text = view._repr_html_()
    assert Parsed(text).data == [] and 'data-status="ready"' in text and view._repr_png_() is None
    assert all(f"<td>{n}</td><td>z</td>" in text for n in c.names())


def test_a_model_and_inputs_draw_what_a_capture_of_the_run_holds(toy):
    model, inputs, cap, _ = toy
    data = Parsed(viz.show(model, inputs, source=SRC, target=TGT, example=1)._repr_html_()).data[0]
    got = heads_of(data)
    assert list(got) == cap.names()
    for name, w in got.items():
        assert np.abs(w - cap.get(name)[1].double().numpy()).max() <= 1 / 510 + 1e-6, name


@pytest.mark.parametrize("shape", [(3, 4), (3, 4, 5)])
def test_per_head_values_draw_as_a_heatmap_with_names_and_values(shape):
    g = torch.Generator().manual_seed(3)
    effects = torch.randn(*shape, generator=g, dtype=torch.float64)
    names = [f"model.layers.{i}.self_attn" for i in range(3)]
    view = viz.show(effects, names=names, title="patching")
    text = view._repr_html_()
    assert_offline(text)
    cells = cells_of(text)
    shown = effects if effects.dim() == 2 else effects[..., effects.abs().amax((0, 1)).argmax()]  # the peak
    assert len(cells) == 12
    for (name, h), v in cells.items():
        assert v == pytest.approx(float(shown[names.index(name), h]), rel=1e-3, abs=1e-12)
    if effects.dim() == 3:  # a slider over the positions, the values of each in the data its script reads
        assert 'type="range"' in text and 'data-status="loading"' in text
        frames = json.loads(re.search(r'data-p="frames">(.*?)</script>', text).group(1))
        assert frames["labels"] == [f"position {p}" for p in range(5)]
        tips = np.array([[float(x) for x in f] for f in frames["tips"]])  # (P, N * H)
        assert np.allclose(tips, effects.permute(2, 0, 1).reshape(5, 12).numpy(), rtol=1e-3)
    else:
        assert 'type="range"' not in text and 'data-status="ready"' in text


def test_importance_scores_and_a_prune_result_draw_per_module(toy):
    model = toy[0]
    scores = {"enc.0.attn": torch.tensor([0.5, 0.25, 0.125]), "enc.1.attn": torch.tensor([1.0, 2.0])}
    cells = cells_of(viz.show(scores)._repr_html_())
    assert cells == {
        ("enc.0.attn", 0): 0.5,
        ("enc.0.attn", 1): 0.25,
        ("enc.0.attn", 2): 0.125,
        ("enc.1.attn", 0): 1.0,
        ("enc.1.attn", 1): 2.0,
        ("enc.1.attn", 2): None,  # a module with fewer heads: a grey cell
    }
    text = viz.show(prune_result(model))._repr_html_()
    removed = {k for k, v in cells_of(text).items() if v == 1.0}
    assert removed == {("encoder.layers.0.self_attn", 1), ("encoder.layers.0.self_attn", 3),
                       ("decoder.layers.1.cross_attn", 0)}  # fmt: skip
    assert "3 of 24 heads removed" in text and "<td>undone</td>" in text


def test_an_attribution_draws_the_mean_and_each_example():
    att = attribution()
    text = att._repr_html_()
    assert_offline(text)
    for (name, h), v in cells_of(text).items():  # first shown: the mean over the examples
        assert v == pytest.approx(float(att.heads[att.names.index(name), h].mean()), rel=1e-3)
    frames = json.loads(re.search(r'data-p="frames">(.*?)</script>', text).group(1))
    assert frames["labels"] == ["mean over 3 examples", "example 0", "example 1", "example 2"]
    assert f"<td>{float(att.rest[1]):.4g}</td>" in text and f"<td>{float(att.logit[2]):.4g}</td>" in text


def test_a_graph_draws_its_top_edges_between_its_nodes():
    g = graph()
    view = viz.show(g, top=12)
    text = g._repr_html_()  # the Graph displays itself (30 edges by default)
    assert_offline(text)
    rows = re.findall(r"<tr><td>([^<]+)</td><td>([^<]+)</td><td>([^<]+)</td></tr>", view._repr_html_())
    assert [(w, r, float(s)) for w, r, s in rows] == [
        (str(w), str(r), pytest.approx(s, rel=1e-3)) for w, r, s in g.top(12)
    ]
    titles = Parsed(view._repr_html_()).titles
    assert sum(" -> " in t for t in titles) == 12  # one path per edge, its score on hover
    for w, r, s in g.top(12):
        for node in (w, r):
            tips = [
                line.split(" (node effect")[0] for t in titles for line in t.splitlines()
            ]  # each node a box draws
            assert f"{node.name} {node.kind} {node.head}".removesuffix(" None") in tips, node
        assert f"{w} -> {r}: {s:+.4g}" in titles


def test_the_same_view_twice_and_several_views_have_distinct_ids(toy):
    _, _, cap, c = toy
    views = [viz.show(cap), viz.show(cap), viz.show(c), viz.show(torch.ones(2, 3, 4)), viz.show(graph())]
    text = page(views + views[:1])
    ids = [a["id"] for _, a in Parsed(text).attrs if "id" in a]
    assert len(ids) == len(set(ids)) >= 6
    assert all(i.startswith("mhv-") or i.split("-bar")[0] in ids for i in ids)  # SVG ids carry their view's


@pytest.mark.parametrize("kind", ["capture", "cache", "tensor", "scores", "attribution", "graph", "prune"])
def test_every_view_has_a_png_fallback(toy, kind):
    model, _, cap, c = toy
    x = {
        "capture": cap,
        "cache": c,
        "tensor": torch.randn(3, 4, 6),
        "scores": {"a.0": torch.rand(4), "a.1": torch.rand(2)},
        "attribution": attribution(),
        "graph": graph(),
        "prune": prune_result(model),
    }[kind]
    image = png_image(viz.show(x)._repr_png_())
    assert image.shape[0] > 50 and image.shape[1] > 50 and image.std() > 10  # drawn, not blank


def test_the_head_view_fallback_picture_has_every_head(toy):
    """The PNG a head view shows where scripts do not run: one tile per module x head, in the data URI."""
    _, _, cap, _ = toy
    text = viz.show(cap)._repr_html_()
    (src,) = [a["src"] for tag, a in Parsed(text).attrs if tag == "img"]
    image = png_image(base64.b64decode(src.removeprefix("data:image/png;base64,")))
    blank = (image == 255).all(-1)  # (Y, X): white gaps between the tiles
    rows = np.diff(np.concatenate([[1], blank.all(1).astype(int)])) == -1  # a run of tile rows starts
    cols = np.diff(np.concatenate([[1], blank.all(0).astype(int)])) == -1
    assert (rows.sum(), cols.sum()) == (len(cap.names()), 4)


def test_bad_input_is_refused_by_name(toy):
    _, _, cap, _ = toy
    with pytest.raises(ValueError, match=r"names must name each of the 3 modules .* got 2"):
        viz.show(torch.zeros(3, 4), names=["a", "b"])
    with pytest.raises(ValueError, match=r"\(N, H\) or \(N, H, P\), got shape \(1, 2, 3, 4\)"):
        viz.show(torch.zeros(1, 2, 3, 4))
    with pytest.raises(ValueError, match=r"source has 2 labels but the weights have 5 encoder tokens"):
        viz.show(cap, source=["a", "b"])
    with pytest.raises(ValueError, match=r"tokens label no sequence"):
        viz.show(cap, tokens=list("abcde"))
    with pytest.raises(ValueError, match=r"example must index the batch of 3"):
        viz.show(cap, example=3)
    with pytest.raises(TypeError, match=r"viz.show cannot draw a str"):
        viz.show("text")
    with pytest.raises(ValueError, match=r"top must be a positive int"):
        viz.show(graph(), top=0)
    g = graph()
    empty = Graph(g.writers, g.readers, torch.zeros_like(g.scores))
    assert "no edge with a non-zero score" in empty._repr_html_()  # nothing to draw, said so
    assert viz.Capture()._repr_html_() is None  # an empty capture shows as its repr


def test_showing_needs_no_matplotlib_until_a_png_is_asked():
    code = (
        "import sys, torch\nfrom multihead import viz\n"
        "viz.show(torch.ones(2, 3), names=['a', 'b'])._repr_html_()\n"
        "assert 'matplotlib' not in sys.modules\n"
        "viz.show(torch.ones(2, 3))._repr_png_()\nassert 'matplotlib' in sys.modules\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    subprocess.run([sys.executable, "-c", code], check=True, env=env)


def test_plots_for_files():
    from matplotlib.patches import PathPatch

    effects = torch.randn(3, 4, 20, generator=torch.Generator().manual_seed(4))
    fig = viz.plot_attribution(effects, [f"l.{i}" for i in range(3)], panels=4)
    panels = [ax.get_title() for ax in fig.axes if ax.get_label() != "<colorbar>"]
    peaks = sorted(range(20), key=lambda p: -float(effects[..., p].abs().max()))[:4]
    assert panels == [f"position {p}" for p in sorted(peaks)]  # the 4 positions of largest |value|
    with pytest.raises(ValueError, match=r"names must name each of the 3 modules"):
        viz.plot_attribution(torch.randn(3, 4), ["a"])
    fig = viz.plot_circuit(graph(), top=5)
    assert sum(isinstance(p, PathPatch) for p in fig.axes[0].patches) == 5  # one curve per edge
    labels = {t.get_text() for t in fig.axes[0].texts}
    for node in {n for e in graph().top(5) for n in e[:2]}:
        want = {"embed": "embed", "mlp": "MLP", "logits": "logits"}.get(node.kind, f"H{node.head}")
        assert want in labels, node


def test_real_lens_results_display_themselves():
    """A logit attribution and an edge attribution graph of a tiny Llama (GQA: 4 heads, 2 key/value heads)."""
    T = pytest.importorskip("transformers")
    from test_hf_families import V, tiny_config

    from multihead.integrations import transformers as mhtf

    torch.manual_seed(0)
    config = tiny_config(T.LlamaConfig, final_logit_softcapping=None)
    model = T.AutoModelForCausalLM.from_config(config, attn_implementation=mhtf.register()).eval()
    ids = torch.randint(3, V, (2, 7), generator=torch.Generator().manual_seed(1))
    att = lens.logit_attribution(model, {"input_ids": ids}, torch.tensor([5, 6]))
    cells = cells_of(att._repr_html_())
    n_heads = att.heads.shape[1]
    assert set(cells) == {(n, h) for n in att.names for h in range(n_heads)}
    for (name, h), v in cells.items():
        assert v == pytest.approx(float(att.heads[att.names.index(name), h].mean()), rel=1e-3, abs=1e-9)

    corrupted = {"input_ids": ids.flip(0)}
    g = lens.edge_attribution(model, {"input_ids": ids}, corrupted, lambda out: out.logits[:, -1, 5])
    text = g._repr_html_()
    assert_offline(text)
    rows = re.findall(r"<tr><td>([^<]+)</td><td>([^<]+)</td><td>([^<]+)</td></tr>", text)
    assert [(w, r) for w, r, _ in rows] == [(str(w), str(r)) for w, r, _ in g.top(30)]
    titles = Parsed(text).titles
    assert sum(" -> " in t for t in titles) == sum(s != 0 for _, _, s in g.top(30))  # each edge drawn
    assert any(t.startswith(f"{w} -> {r}: ") for w, r, _ in g.top(1) for t in titles)
    assert png_image(g._repr_png_()).std() > 10


# ------------------------------------------------------------------------------------------------
# In a browser
# ------------------------------------------------------------------------------------------------

_REQUESTS = """<script>
new PerformanceObserver((list) => { for (const e of list.getEntries())
  document.body.dataset.status = "requested " + e.name; }).observe({ type: "resource", buffered: true });
</script>"""


def test_several_views_draw_offline_in_chromium_and_request_nothing(toy, tmp_path):
    """Two head views of one capture, a heatmap with a slider, importance and a circuit in one page: each
    view's script reports it drew (the page's status is ready only when every view's is), the console is
    empty, no resource was requested (any would be reported by the observer); with the scripts removed the
    server-drawn pictures still show."""
    from PIL import Image

    need_chromium("the views")
    model, inputs, cap, _ = toy
    views = [
        viz.show(cap, source=SRC, target=TGT),
        viz.show(model, inputs, source=SRC, target=TGT, example=1),
        viz.show(torch.randn(4, 4, 6), names=cap.names()[:4]),
        viz.show({n: torch.rand(4) for n in cap.names()}),
        viz.show(graph()),
    ]
    out, shot = tmp_path / "views.html", tmp_path / "views.png"
    out.write_text(page(views).replace("</body>", _REQUESTS + "</body>"), encoding="utf-8")
    got = render(out, screenshot=shot, window=(1300, 2400))
    assert got.status == "ready" and got.console == [], got
    image = np.asarray(Image.open(shot).convert("RGB"), dtype=np.int16)
    assert image.std() > 20 and len(np.unique(image.reshape(-1, 3), axis=0)) > 50  # not blank
    drawn = out.read_text(encoding="utf-8")
    bare = re.sub(r"<script\b(?![^>]*application/json)[^>]*>.*?</script>", "", drawn, flags=re.S)
    out.write_text(bare, encoding="utf-8")
    render(out, screenshot=shot, window=(1300, 2400))
    image = np.asarray(Image.open(shot).convert("RGB"), dtype=np.int16)
    page_blue = (np.abs(image - [12, 61, 145]).sum(-1) < 30).sum()  # the fallback's darkest tiles
    assert page_blue > 100, page_blue


def test_a_view_that_fails_says_so_and_the_others_still_draw(toy, tmp_path):
    need_chromium("the views")
    _, _, cap, _ = toy
    good, bad = viz.show(cap), viz.show(cap)._repr_html_()
    thumbs = Parsed(bad).data[0]["modules"][0]["thumbs"]
    out = tmp_path / "broken.html"
    text = page([good, viz.show(torch.ones(2, 3, 4))])
    text = text.replace("</body>", bad.replace(thumbs, thumbs[:40]) + "</body>")  # one view's data cut short
    out.write_text(text, encoding="utf-8")
    got = render(out)
    assert got.status == "error" and got.console, got  # that view reports it, the page says so


def test_without_matplotlib_a_view_has_no_png_and_still_saves(monkeypatch, tmp_path):
    import importlib.util

    find = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else find(name, *a)
    )
    view = viz.show(torch.ones(2, 3), names=["a.0", "a.1"])
    assert view._repr_png_() is None  # the notebook shows the HTML, and no formatter error
    text = view.save(tmp_path / "heat.html").read_text(encoding="utf-8")
    assert text.startswith("<!DOCTYPE html>") and "a.1 head 2: +1" in text
