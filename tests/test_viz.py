import base64
import gc
import json
import math
import re
import weakref
import zlib
from html.parser import HTMLParser

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from toy_models import ToySeq2Seq, toy_inputs

import multihead as mh
from multihead import heads, viz
from multihead.nn import seam

PNG = b"\x89PNG\r\n\x1a\n"


def module_state(model):
    """Everything a hook could leave on the modules: attributes and hook dicts."""
    return [
        (
            name,
            sorted(vars(m)),
            [len(getattr(m, h)) for h in vars(m) if h.endswith("hooks") and getattr(m, h)],
        )
        for name, m in model.named_modules()
    ]


@pytest.mark.parametrize("config", [{}, {"kv_heads": 2, "kdim": 12}])
def test_capture_equals_return_weights_and_labels_kinds(config):
    torch.manual_seed(0)
    model = ToySeq2Seq(**config).eval()
    x, y = toy_inputs(model)
    want = {}
    with torch.no_grad():
        plain = model(x, y, weights=want)
        with viz.capture(model) as cap:
            out = model(x, y)
    torch.testing.assert_close(out, plain)  # capturing does not change the model's output
    assert cap.names() == list(want)
    for name, w in want.items():
        torch.testing.assert_close(cap.get(name), w, rtol=0, atol=1e-6)
    kinds = {name: cap.kind(name) for name in cap.names()}
    assert kinds["encoder.layers.1.self_attn"] == "encoder self"
    assert kinds["decoder.layers.0.self_attn"] == "decoder self"
    assert kinds["decoder.layers.1.cross_attn"] == "cross"
    assert cap.names("cross") == ["decoder.layers.0.cross_attn", "decoder.layers.1.cross_attn"]
    assert cap.by_kind("cross")["decoder.layers.0.cross_attn"].shape == (3, 4, 4, 5)  # (B, H, T, S)


def test_capture_leaves_nothing_behind():
    model = ToySeq2Seq()
    x, y = toy_inputs(model)
    before = module_state(model)
    with viz.capture(model) as cap:
        assert seam.current() is not None
        model(x, y).sum().backward()  # with autograd on: the captured weights must not hold the graph
    assert seam.current() is None
    assert module_state(model) == before
    assert all(not r.weights.requires_grad and r.weights.grad_fn is None for r in cap.records)
    captured = len(cap)
    assert captured == 6  # 2 encoder self, 2 decoder self, 2 cross
    with torch.no_grad():  # later forwards capture nothing: not into the old Capture, not into a new one
        model(x, y)
        with viz.capture(mh.MultiHeadAttention(8, 2)) as other:  # an inspector active, for another model
            model(x, y)
    assert len(cap) == captured and len(other) == 0
    ref = weakref.ref(cap.records[0].weights)
    del cap
    gc.collect()
    assert ref() is None  # only the Capture held the weights


def test_capture_ignores_other_models_and_joins_steps():
    torch.manual_seed(0)
    mha, other = mh.MultiHeadAttention(8, 2), mh.MultiHeadAttention(8, 2)
    x = torch.randn(1, 4, 8)
    with torch.no_grad(), viz.capture(mha) as cap:
        other(x)
        for t in range(4):  # a decoder stepping without a cache: query t sees keys 0..t
            mha(x[:, t : t + 1], x[:, : t + 1])
    assert cap.names() == [""] and len(cap) == 4
    w = cap.get("")  # (B, H, 4, 4): step rows padded on the right
    assert w.shape == (1, 2, 4, 4)
    assert torch.equal(w.triu(1), torch.zeros_like(w))
    torch.testing.assert_close(w.sum(-1), torch.ones(1, 2, 4))
    with pytest.raises(KeyError, match="no attention weights captured"):
        cap.get("nope")


def read_png_size(data):
    assert data.startswith(PNG)
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


def test_plot_attention_writes_png(tmp_path):
    w = torch.rand(2, 3, 4, 5).softmax(-1)  # (N, H, Lq, Lk)
    path = tmp_path / "a.png"
    fig = viz.plot_attention(w, list("abcd"), ["k0", "k1", "k2", "k3", "k4"], title="t", path=path)
    width, height = read_png_size(path.read_bytes())
    assert width > 300 and height > 150
    panels = [ax for ax in fig.axes if ax.images and ax.get_label() != "<colorbar>"]
    assert len(panels) == 6
    assert [t.get_text() for t in panels[0].get_yticklabels()] == list("abcd")
    assert panels[0].get_title() == "head 0" and panels[0].get_ylabel() == "layer 0"
    assert any(ax.get_label() == "<colorbar>" for ax in fig.axes)


def test_plot_attention_rows_of_different_head_counts(tmp_path):
    rows = {"enc0": torch.rand(3, 2, 2), "enc1 (pruned)": torch.rand(1, 2, 2)}
    fig = viz.plot_attention(rows, ["a", "b"], ["c", "d"], path=tmp_path / "p.png")
    assert sum(1 for ax in fig.axes if ax.images) == 4  # 3 + 1 heatmaps
    bottom = [ax for ax in fig.axes if ax.images][1:3]  # heads 1, 2 of row 0 have nothing below them
    assert all([t.get_text() for t in ax.get_xticklabels()] == ["c", "d"] for ax in bottom)


@pytest.mark.parametrize(
    "weights, q, k, match",
    [
        (torch.rand(2, 2, 2, 3, 4), None, None, r"\(N, H, Lq, Lk\)"),
        (torch.rand(2, 3, 4), ["a"], None, "query_tokens has 1 tokens but the weights have 3"),
        (torch.rand(2, 3, 4), None, list("abc"), "key_tokens has 3 tokens but the weights have 4"),
        ({"a": torch.rand(1, 2, 2), "b": torch.rand(1, 3, 2)}, None, None, "share"),
    ],
)
def test_plot_attention_bad_input(weights, q, k, match):
    with pytest.raises(ValueError, match=match):
        viz.plot_attention(weights, q, k)


class _Collect(HTMLParser):
    def __init__(self):
        super().__init__()
        self.tags, self.srcs, self.open = [], [], []

    def handle_starttag(self, tag, attrs):
        self.tags.append(tag)
        self.srcs += [v for k, v in attrs if k in ("src", "href")]


def check_offline_html(text):
    """Valid enough to parse, every image inline PNG, no URL anywhere; returns the parser."""
    parser = _Collect()
    parser.feed(text)
    parser.close()
    assert {"html", "head", "body", "img", "select", "script"} <= set(parser.tags)
    assert parser.srcs, "no images"
    for src in parser.srcs:
        assert src.startswith("data:image/png;base64,")
        assert base64.b64decode(src.split(",", 1)[1]).startswith(PNG)
    assert not re.search(r"(https?|ftp|ws)://|src=\"//|url\(", text, re.I)
    return parser


def test_write_report_is_self_contained(tmp_path):
    torch.manual_seed(0)
    model = ToySeq2Seq(layers=1).eval()
    x, y = toy_inputs(model, batch=2)
    with torch.no_grad(), viz.capture(model) as cap:
        model(x, y)
    src, tgt = ["<s>", "tuesday", "3", "mar", "</s>"], ["2", "0", "</a>", "x"]
    scores = {n: torch.rand(h) for n, h in heads.head_counts(model).items()}
    path = viz.write_report(
        tmp_path / "r.html",
        {"example one": viz.panels(cap, src, tgt), "example two": viz.panels(cap, src[:3], tgt[:2], index=1)},
        importance=scores,
        drop=scores,
        tables={"results": [["model", "acc %"], ["full", "99.0"], ["pruned <b>", "98.5"]]},
        title="t <report>",
    )
    text = path.read_text(encoding="utf-8")
    parser = check_offline_html(text)
    assert parser.tags.count("img") == 2 + 2 * 3  # importance, drop, and (example x kind) grids
    assert "pruned &lt;b&gt;" in text and "t &lt;report&gt;" in text  # escaped
    data = json.loads(re.search(r'id="data">(.*?)</script>', text, re.S).group(1))
    assert [e["label"] for e in data] == ["example one", "example two"]
    cross = next(p for p in data[1]["panels"] if p["kind"] == "cross")
    assert (cross["query_tokens"], cross["key_tokens"]) == (tgt[:2], src[:3])
    assert torch.tensor(cross["weights"]).shape == (4, 2, 3)  # (H, Lq, Lk), cropped to the tokens


def test_panels_reject_more_tokens_than_weights():
    model = ToySeq2Seq(layers=1)
    x, y = toy_inputs(model, src=2, tgt=2)
    with torch.no_grad(), viz.capture(model) as cap:
        model(x, y)
    with pytest.raises(ValueError, match="fewer than"):
        viz.panels(cap, list("abc"), list("ab"))


def test_plot_importance(tmp_path):
    scores = {
        "encoder.layers.0.self_attn": torch.tensor([0.1, 0.9]),
        "decoder.layers.0.cross_attn": torch.rand(1),
    }
    fig = viz.plot_importance(scores, path=tmp_path / "i.png")
    read_png_size((tmp_path / "i.png").read_bytes())
    texts = [t.get_text() for t in fig.axes[0].texts]
    assert texts == ["0.10", "0.90", f"{float(scores['decoder.layers.0.cross_attn']):.2f}"]  # NaN cell blank


# ------------------------------------------------------------------------------------------------
# The page's thumbnails (multihead.viz.page): max-pooled uint8 weights in an indexed PNG
# ------------------------------------------------------------------------------------------------


def pool_by_hand(w, rows, cols):
    """A head's weights (Lq, Lk) in [0, 1] as the documented thumbnail: each cell quantised to
    round(255 w), pixel (r, c) the largest of the cells with floor(i rows / Lq) == r, floor(j cols / Lk) == c."""
    lq, lk = len(w), len(w[0])
    out = [[0] * cols for _ in range(rows)]
    for i in range(lq):
        for j in range(lk):
            r, c = i * rows // lq, j * cols // lk
            out[r][c] = max(out[r][c], int(math.floor(255 * float(w[i][j]) + 0.5)))
    return out


@settings(max_examples=30, deadline=None)
@given(lq=st.integers(1, 60), lk=st.integers(1, 60), side=st.integers(1, 25), seed=st.integers(0, 2**16))
def test_thumbnail_is_the_max_of_each_block(lq, lk, side, seed):
    from multihead.viz import page

    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 256, (2, lq, lk), dtype=torch.uint8, generator=g)  # (H, Lq, Lk)
    got = page.thumbnail(q, side)
    assert got.shape == (2, min(side, lq), min(side, lk)) and got.dtype == torch.uint8
    for h in range(2):
        assert got[h].tolist() == pool_by_hand(q[h].double().div(255).tolist(), min(side, lq), min(side, lk))


@pytest.mark.parametrize(
    ("lq", "lk", "queries"), [(250, 250, "a"), (130, 97, "b"), (40, 300, "b"), (5, 7, "b")]
)
def test_page_thumbnails_are_the_pooled_weights(lq, lk, queries):
    """Decoded by hand (base64, zlib, H x R x C bytes, head by head, row by row): each head's thumbnail is the by-hand
    max-pooling of its weights to at most 96 x 96; a one-cell diagonal keeps its full weight."""
    from multihead.viz import page

    torch.manual_seed(lq + lk)
    w = torch.softmax(torch.randn(3, lq, lk) * 4, dim=-1)  # (H, Lq, Lk)
    if queries == "a":
        w[2] = torch.eye(lq)  # a sharp diagonal, one cell wide
    e = page.encode_module("m", "self", w, queries, "a", [False] * lk)
    rows, cols = min(96, lq), min(96, lk)
    assert e.thumb_shape == (rows, cols)
    raw = zlib.decompress(base64.b64decode(e.thumbs))
    for h in range(3):
        pixels = np.frombuffer(raw, dtype=np.uint8).reshape(3, rows, cols)[h]
        assert pixels.tolist() == pool_by_hand(w[h].tolist(), rows, cols)
    if queries == "a":
        assert (np.diagonal(pixels) == 255).all()  # the diagonal survives the pooling at full strength


def test_thumbnail_refuses_a_side_under_one_pixel():
    from multihead.viz import page

    with pytest.raises(ValueError, match="side must be at least 1 pixel, got 0"):
        page.thumbnail(torch.zeros(2, 3, dtype=torch.uint8), 0)
