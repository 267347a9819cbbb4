"""One self-contained HTML page of every attention head: data in, an HTML string out.

Dimensions: H heads, Lq query length, Lk key length.

The page works from ``file://`` with no network: the script and style are inline, written here. Each
head's weights travel quantised and compressed: rounded to uint8 (``q = round(255 * w)``, so an entry is
off by at most 1/510; most weights of a long text round to 0, which deflates well), deflated with
:mod:`zlib` and base64-encoded (a 512-token text on a 6 x 12-head model: about 2.9 MiB; 1,000 tokens on a
30 x 9-head causal LM: about 15 MiB). A module is encoded on its own (:func:`encode_module`: statistics
and blobs, no tensor kept), so a caller can encode each module as the model runs and never hold every
head's float weights at once. The page inflates a head only when it draws it (the browser's
``DecompressionStream``), keeps a few in memory, and draws on canvas: a model view (a thumbnail per
layer x head), a head view (token-to-token lines of the heads picked, opacity = weight, hover a token to
focus on it) and a sortable table of per-head statistics (:func:`head_stats`), with head importance when
given. Nothing here imports transformers or matplotlib.
"""

from __future__ import annotations

import base64
import html
import json
import math
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

__all__ = [
    "STAT_COLUMNS",
    "EncodedModule",
    "PageModule",
    "build_page",
    "encode_head",
    "encode_module",
    "head_stats",
]

STAT_COLUMNS = {
    "entropy": "mean entropy of a query's attention, in nats (0: one key; ln Lk: uniform)",
    "distance": "mean |query - key| position distance, weighted by attention (self-attention only)",
    "first": "mean weight on the first token",
    "special": "mean weight on the special tokens ([CLS], [SEP], <s>, ...)",
    "previous": "mean weight on the token just before the query (self-attention only)",
    "same": "mean weight a token gives to itself (self-attention only)",
}
"""The statistics of :func:`head_stats`, in table order, with the explanation the page shows."""


@dataclass(frozen=True)
class PageModule:
    """One attention module for the page: its weights (H, Lq, Lk) and which token sequences they join.

    ``queries`` and ``keys`` name sequences of :func:`build_page`'s ``sequences`` (``"input"``, or
    ``"encoder"`` / ``"decoder"`` for an encoder-decoder's cross-attention).
    """

    name: str
    kind: str
    weights: Tensor
    queries: str
    keys: str
    importance: Sequence[float] | None = field(default=None)

    @property
    def heads(self) -> int:
        """H, the number of heads."""
        return self.weights.shape[0]

    @property
    def shape(self) -> tuple[int, int]:
        """(Lq, Lk), one head's shape."""
        return (self.weights.shape[1], self.weights.shape[2])

    def encode(self, special: Sequence[bool]) -> EncodedModule:
        """This module as the page carries it (:func:`encode_module`); ``special`` (Lk,) flags the keys."""
        return encode_module(
            self.name, self.kind, self.weights, self.queries, self.keys, special, importance=self.importance
        )


@dataclass(frozen=True)
class EncodedModule:
    """One attention module as the page carries it: per-head statistics and compressed weights, no tensor.

    ``blobs`` hold one head each (:func:`encode_head`'s format) of ``shape`` (Lq, Lk); ``stats`` are
    ``{column of STAT_COLUMNS: H values}`` (None where undefined). At 1,000 tokens about 1/70 of the
    float32 weights' memory (most weights round to 0 and deflate away), so a whole model's fits where its
    float weights would not. Made by :func:`encode_module` or :meth:`PageModule.encode`.
    """

    name: str
    kind: str
    queries: str
    keys: str
    shape: tuple[int, int]
    stats: Mapping[str, Sequence[float | None]]
    blobs: Sequence[str]
    importance: Sequence[float] | None = field(default=None)

    @property
    def heads(self) -> int:
        """H, the number of heads."""
        return len(self.blobs)

    def encode(self, special: Sequence[bool]) -> EncodedModule:
        """Already encoded: itself (its statistics were computed with the key flags it was encoded with)."""
        return self

    def head(self, h: int) -> Tensor:
        """Head ``h``'s weights (Lq, Lk) float32 as the page reads them (within 1/510 of the original)."""
        raw = zlib.decompress(base64.b64decode(self.blobs[h]))
        q = torch.frombuffer(bytearray(raw), dtype=torch.uint8).reshape(self.shape[::-1])  # (Lk, Lq)
        return q.t().float() / 255  # (Lq, Lk)


# ------------------------------------------------------------------------------------------------
# Data: statistics and encoding
# ------------------------------------------------------------------------------------------------


def head_stats(weights: Tensor, special: Sequence[bool], *, self_attention: bool) -> dict[str, Tensor]:
    """Per-head statistics of one module's weights (H, Lq, Lk), each averaged over the query rows.

    ``special`` (Lk,) marks the special key tokens. Returns ``{column of STAT_COLUMNS: (H,) float64}``;
    the position statistics (distance, previous, same) are NaN for cross-attention
    (``self_attention=False``), where query and key positions index different sequences. Each query's
    sum over the keys is taken in the weights' precision (float32 at least: about 1e-6 relative error),
    the means over the queries in float64.
    """
    w = weights.detach()
    w = w if w.dtype == torch.float64 else w.float()  # (H, Lq, Lk)
    f64 = torch.float64
    h, lq, lk = w.shape
    if len(special) != lk:
        raise ValueError(f"special must have one flag per key token (Lk={lk}), got {len(special)}")
    spec = torch.tensor(list(special), dtype=torch.bool)
    out = {
        "entropy": torch.special.entr(w).sum(-1).to(f64).mean(-1),  # -sum w ln w over the keys: (H,)
        "first": w[:, :, 0].to(f64).mean(-1),
        "special": w[:, :, spec].sum(-1).to(f64).mean(-1),
    }
    nan = torch.full((h,), math.nan, dtype=f64)
    if not self_attention or lq != lk:
        out.update(distance=nan, previous=nan, same=nan)
    else:
        pos = torch.arange(lq, dtype=w.dtype)  # exact: positions < 2**24
        dist = (pos[:, None] - pos[None, :]).abs()  # (Lq, Lk)
        out["distance"] = torch.einsum("hqk,qk->hq", w, dist).to(f64).mean(-1)  # sum_k w |q - k|: (H, Lq)
        out["previous"] = w.diagonal(offset=-1, dim1=1, dim2=2).to(f64).mean(-1) if lq > 1 else nan.clone()
        out["same"] = w.diagonal(dim1=1, dim2=2).to(f64).mean(-1)
    return {k: out[k] for k in STAT_COLUMNS}


def _quantize(weights: Tensor) -> Tensor:
    """Weights (..., Lq, Lk) in [0, 1] -> uint8 ``floor(255 w + 1/2)``, within 1/510 (+ one rounding of 255 w)."""
    w = weights.detach()
    w = w if w.dtype == torch.float64 else w.float()
    return w.mul(255).add_(0.5).clamp_(0, 255).to(torch.uint8)  # conversion truncates: floor of x >= 0


def _pack(q: Tensor) -> str:
    """uint8 (Lq, Lk) -> base64 of zlib (level 5) of its bytes key-major: row j holds key j's Lq weights.

    Key-major because a key's weights down the queries vary less than a query's along the keys (a key
    that draws attention draws it from many queries; a causal key gets none from the queries before it):
    on a 1,000-token text the deflated bytes are about a quarter fewer than row-major, and deflate faster.
    """
    return base64.b64encode(zlib.compress(q.t().contiguous().numpy().tobytes(), 5)).decode("ascii")


def encode_head(weights: Tensor) -> str:
    """One head's weights (Lq, Lk) as the page carries them: base64 of zlib(uint8 q, key-major).

    Decoding: base64, inflate, read Lk x Lq bytes (row j: key j's weight from each query), transpose to
    (Lq, Lk); the weight is ``q / 255``, within 1/510 of
    the input (weights lie in [0, 1]; float32 weights are scaled in float32, which adds at most 2**-24).
    """
    return _pack(_quantize(weights.cpu()))


def encode_module(
    name: str,
    kind: str,
    weights: Tensor,
    queries: str,
    keys: str,
    special: Sequence[bool],
    *,
    importance: Sequence[float] | None = None,
) -> EncodedModule:
    """One module's weights (H, Lq, Lk) (on any device) encoded for the page: statistics and one blob per head.

    ``special`` (Lk,) flags the special key tokens; the position statistics are computed when
    ``queries == keys`` (self-attention). The result holds no reference to ``weights``.
    """
    if weights.dim() != 3:
        raise ValueError(f"{name}: weights must be (H, Lq, Lk), got shape {tuple(weights.shape)}")
    w = weights.detach().cpu()
    stats = head_stats(w, special, self_attention=queries == keys)
    q = _quantize(w)  # (H, Lq, Lk) uint8
    return EncodedModule(
        name,
        kind,
        queries,
        keys,
        (w.shape[1], w.shape[2]),
        {k: [_finite(v) for v in s.tolist()] for k, s in stats.items()},
        [_pack(q[i]) for i in range(q.shape[0])],
        importance,
    )


def _finite(x: float) -> float | None:
    return None if math.isnan(x) else round(float(x), 5)


# ------------------------------------------------------------------------------------------------
# The page
# ------------------------------------------------------------------------------------------------


def build_page(
    modules: Sequence[PageModule | EncodedModule],
    sequences: Mapping[str, Sequence[str]],
    special: Mapping[str, Sequence[bool]],
    *,
    title: str = "multihead view",
    facts: Mapping[str, str] | None = None,
) -> str:
    """The page (an HTML string) for ``modules``, whose tokens are ``sequences[name]``.

    Args:
        modules: the attention modules in model order, with weights (H, Lq, Lk) (:class:`PageModule`) or
            already encoded (:class:`EncodedModule`, e.g. one module at a time while the model runs); Lq
            tokens of ``sequences[m.queries]`` and Lk of ``sequences[m.keys]``.
        sequences: ``{name: tokens}``, e.g. ``{"input": [...]}`` or ``{"encoder": [...], "decoder": [...]}``.
        special: ``{name: one bool per token}``: which tokens are special (for the statistics).
        title: the page's heading.
        facts: ``{label: value}`` shown under the heading (model folder, kind, token counts, ...).
    """
    if not modules:
        raise ValueError("modules is empty: nothing to show")
    meta_modules = []
    for m in modules:
        want = (len(sequences[m.queries]), len(sequences[m.keys]))
        if m.shape != want:
            raise ValueError(
                f"{m.name}: weights (H, Lq, Lk) = {(m.heads, *m.shape)} but sequences give "
                f"Lq={want[0]} ({m.queries}) and Lk={want[1]} ({m.keys})"
            )
        e = m.encode(special[m.keys])
        meta_modules.append(
            {
                "name": e.name,
                "kind": e.kind,
                "q": e.queries,
                "k": e.keys,
                "heads": e.heads,
                "stats": e.stats,
                "importance": None if e.importance is None else [round(float(x), 5) for x in e.importance],
                "blobs": list(e.blobs),
            }
        )
    data = {
        "title": title,
        "facts": dict(facts or {}),
        "sequences": {k: [str(t) for t in v] for k, v in sequences.items()},
        "special": {k: [bool(b) for b in v] for k, v in special.items()},
        "columns": STAT_COLUMNS,
        "modules": meta_modules,
    }
    payload = json.dumps(data, separators=(",", ":")).replace("</", "<\\/")  # safe inside <script>
    return _TEMPLATE.replace("{{TITLE}}", html.escape(title)).replace("{{DATA}}", payload)


_TEMPLATE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{{TITLE}}</title>
<style>
:root{--fg:#1d2330;--mut:#5b6475;--line:#d9dde5;--bg:#f6f7f9;--acc:#2f6fde}
*{box-sizing:border-box}
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;color:var(--fg);margin:0;background:#fff}
header{padding:16px 24px 10px;border-bottom:1px solid var(--line);background:var(--bg)}
h1{font-size:20px;margin:0 0 6px}h2{font-size:16px;margin:0 0 8px}
.facts{display:flex;flex-wrap:wrap;gap:6px 18px;color:var(--mut);font-size:13px}
.facts b{color:var(--fg);font-weight:600}
main{padding:14px 24px 40px}
section{margin:0 0 22px}
.note{color:var(--mut);font-size:12.5px;margin:2px 0 8px}
.grid{display:grid;gap:6px;align-items:center;overflow-x:auto;padding-bottom:4px}
.grid .lab{font-size:12px;color:var(--mut);text-align:right;padding-right:4px;white-space:nowrap}
.grid .col{font-size:12px;color:var(--mut);text-align:center}
.thumb{position:relative;cursor:pointer;border:1px solid var(--line);border-radius:3px;background:#fff;
 line-height:0}
.thumb canvas{width:100%;height:auto;image-rendering:pixelated;border-radius:2px}
.thumb.sel{outline:3px solid var(--acc);outline-offset:1px}
.thumb .imp{position:absolute;left:0;bottom:0;height:3px;background:#e8590c;border-radius:0 2px 0 2px}
.layout{display:flex;gap:24px;flex-wrap:wrap;align-items:flex-start}
.hv{flex:0 1 500px;min-width:320px}
.hvbox{max-height:78vh;overflow-y:auto;border:1px solid var(--line);border-radius:4px;background:#fff}
.controls{display:flex;flex-wrap:wrap;gap:6px 10px;align-items:center;margin:0 0 8px}
.controls select{font:inherit;padding:2px 4px}
.chip{display:inline-flex;align-items:center;gap:4px;padding:1px 8px;border-radius:11px;border:1px solid var(--line);
 cursor:pointer;user-select:none;font-size:12.5px}
.chip i{display:inline-block;width:10px;height:10px;border-radius:2px}
.chip.off{opacity:.45}
.tbl{flex:1 1 520px;min-width:420px}
.tblbox{max-height:78vh;overflow:auto;border:1px solid var(--line);border-radius:4px}
table{border-collapse:collapse;width:100%;font-size:12.5px;font-variant-numeric:tabular-nums}
th,td{padding:3px 6px;border-bottom:1px solid #eceef2;text-align:right;white-space:nowrap}
th{position:sticky;top:0;background:var(--bg);cursor:pointer;user-select:none;font-weight:600}
th:first-child,td:first-child{text-align:left}
tbody tr:hover{background:#eef3fd;cursor:pointer}
tbody tr.sel{background:#dde8fb}
th.asc:after{content:" \\25B2";font-size:9px}th.desc:after{content:" \\25BC";font-size:9px}
.bar{display:inline-block;height:8px;background:#9db8ec;vertical-align:middle;margin-left:4px;border-radius:1px}
#status{color:var(--mut);font-size:12px}
</style></head>
<body data-status="loading">
<header><h1 id="title"></h1><div class="facts" id="facts"></div></header>
<main>
<section><h2>Model view</h2>
<div class="note">Every attention module (rows) and head (columns): query tokens top to bottom, key tokens left to
right, darker = more weight (square root of the weight over the head's largest, or over 0.25 when that is smaller; a pixel shows the largest
weight of the cells it covers). The orange bar under a head is its importance. Click a head to
show it in the head view.</div>
<div id="models"></div></section>
<div class="layout">
<section class="hv"><h2>Head view</h2>
<div class="controls"><label>module <select id="modsel"></select></label><span id="chips"></span></div>
<div class="note">Lines join each query token (left) to the keys it attends to (right); opacity = weight.
Hover a token to see only its lines.</div>
<div class="hvbox"><canvas id="hv"></canvas></div></section>
<section class="tbl"><h2>Head statistics</h2>
<div class="note" id="colnote">Click a column to sort; click a row to show that head.</div>
<div class="tblbox"><table id="stats"><thead></thead><tbody></tbody></table></div></section>
</div>
<div id="status">loading...</div>
</main>
<script type="application/json" id="mh-data">{{DATA}}</script>
<script>
"use strict";
(function () {
const D = JSON.parse(document.getElementById("mh-data").textContent);
const PALETTE = ["#2f6fde", "#e8590c", "#2b8a3e", "#c2255c", "#7048e8", "#0c8599", "#e67700", "#5c940d",
  "#a61e4d", "#1864ab", "#862e9c", "#d9480f"];
const $ = (id) => document.getElementById(id);
const el = (tag, attrs, text) => { const e = document.createElement(tag); if (attrs) for (const k in attrs)
  e.setAttribute(k, attrs[k]); if (text !== undefined) e.textContent = text; return e; };
function fail(msg) { document.body.dataset.status = "error"; $("status").textContent = "error: " + msg; }
window.addEventListener("error", (e) => fail(e.message));
window.addEventListener("unhandledrejection", (e) => fail(String(e.reason)));

// ---- decoding: base64 -> inflate -> {q: uint8 (Lk*Lq) key-major, weight of (i, j) = q[j * lq + i] / 255} ----
const cache = new Map(), CACHE_MAX = 6;
async function head(mi, h) {
  const key = mi + ":" + h;
  if (cache.has(key)) { const v = cache.get(key); cache.delete(key); cache.set(key, v); return v; }
  const b64 = D.modules[mi].blobs[h], bin = atob(b64), bytes = new Uint8Array(bin.length);
  for (let i = 0; i < bin.length; i++) bytes[i] = bin.charCodeAt(i);
  const stream = new Blob([bytes]).stream().pipeThrough(new DecompressionStream("deflate"));
  const buf = await new Response(stream).arrayBuffer();
  const mod = D.modules[mi], lq = D.sequences[mod.q].length, lk = D.sequences[mod.k].length;
  const v = { q: new Uint8Array(buf), lq: lq, lk: lk };
  if (v.q.length !== lq * lk) throw new Error(mod.name + " head " + h + ": " + v.q.length + " bytes, not " + lq * lk);
  cache.set(key, v);
  if (cache.size > CACHE_MAX) cache.delete(cache.keys().next().value);
  return v;
}

// ---- header ----
$("title").textContent = D.title;
for (const k in D.facts) { const s = el("span"); s.append(el("b", null, k + ": "), D.facts[k]); $("facts").append(s); }

// ---- model view: one canvas per head, block-averaged to at most T x T pixels ----
const T = 96;
const thumbs = [];
let maxImp = 0;
for (const m of D.modules) if (m.importance) for (const x of m.importance) maxImp = Math.max(maxImp, x);
const groups = [];
D.modules.forEach((m, mi) => { let g = groups.find((g) => g.kind === m.kind);
  if (!g) { g = { kind: m.kind, items: [] }; groups.push(g); } g.items.push(mi); });
for (const g of groups) {
  const maxH = Math.max(...g.items.map((mi) => D.modules[mi].heads));
  if (groups.length > 1) $("models").append(el("div", { class: "note", style: "margin-top:10px" }, g.kind));
  const grid = el("div", { class: "grid" });
  grid.style.gridTemplateColumns = "max-content repeat(" + maxH + ", minmax(44px, 72px))";
  grid.append(el("div"));
  for (let h = 0; h < maxH; h++) grid.append(el("div", { class: "col" }, "head " + h));
  for (const mi of g.items) {
    const m = D.modules[mi];
    grid.append(el("div", { class: "lab", title: m.name }, shortName(m.name)));
    for (let h = 0; h < maxH; h++) {
      if (h >= m.heads) { grid.append(el("div")); continue; }
      const box = el("div", { class: "thumb", title: m.name + " head " + h });
      const lq = D.sequences[m.q].length, lk = D.sequences[m.k].length;
      const cv = el("canvas", { width: Math.min(T, lk), height: Math.min(T, lq) });
      box.append(cv);
      if (m.importance && maxImp > 0) {
        const bar = el("div", { class: "imp" }); bar.style.width = (100 * m.importance[h] / maxImp) + "%";
        box.append(bar); box.title += " (importance " + m.importance[h].toFixed(3) + ")";
      }
      box.addEventListener("click", () => select(mi, [h]));
      grid.append(box);
      thumbs.push({ mi: mi, h: h, cv: cv, box: box });
    }
  }
  $("models").append(grid);
}
function shortName(n) { const p = n.split("."), num = p.filter((x) => /^\\d+$/.test(x));
  const side = p.slice(0, -1).find((x) => x === "encoder" || x === "decoder");
  return (side ? side + " " : "") + (num.length ? "layer " + num.join(".") + " " : "") + p[p.length - 1]; }

async function drawThumb(t) {
  const v = await head(t.mi, t.h), W = t.cv.width, H = t.cv.height;
  const ctx = t.cv.getContext("2d"), img = ctx.createImageData(W, H);
  const acc = new Uint8Array(W * H);  // the largest weight of each pixel's block of (query, key) cells
  const py = new Int32Array(v.lq);  // query -> offset of its pixel row
  for (let i = 0; i < v.lq; i++) py[i] = Math.floor(i * H / v.lq) * W;
  for (let j = 0; j < v.lk; j++) {
    const x0 = Math.floor(j * W / v.lk), col = v.q.subarray(j * v.lq, (j + 1) * v.lq);  // key j, every query
    for (let i = 0; i < v.lq; i++) { const x = col[i]; if (x !== 0 && x > acc[py[i] + x0]) acc[py[i] + x0] = x; }
  }
  let top = 64;  // the head's largest weight, at least 0.25: a uniform head stays pale
  for (let p = 0; p < W * H; p++) if (acc[p] > top) top = acc[p];
  for (let p = 0; p < W * H; p++) {
    const x = Math.sqrt(acc[p] / top), o = 4 * p;
    img.data[o] = 255 - x * 243; img.data[o + 1] = 255 - x * 194; img.data[o + 2] = 255 - x * 110; img.data[o + 3] = 255;
  }
  ctx.putImageData(img, 0, 0);
}

// ---- head view: tokens in two columns, lines for the selected heads ----
const hv = $("hv"), hctx = hv.getContext("2d");
let cur = { mi: 0, heads: [0] }, hover = null, geom = null;
const modsel = $("modsel");
D.modules.forEach((m, mi) => modsel.append(el("option", { value: mi }, m.name + " (" + m.kind + ")")));
modsel.addEventListener("change", () => select(+modsel.value, cur.heads.filter((h) => h < D.modules[+modsel.value].heads)));
function chips() {
  const box = $("chips"); box.textContent = "";
  const m = D.modules[cur.mi];
  for (let h = 0; h < m.heads; h++) {
    const c = el("span", { class: "chip" + (cur.heads.includes(h) ? "" : " off") });
    const sw = el("i"); sw.style.background = PALETTE[h % PALETTE.length]; c.append(sw, "" + h);
    c.addEventListener("click", () => { const hs = cur.heads.includes(h) ? cur.heads.filter((x) => x !== h)
      : cur.heads.concat([h]); select(cur.mi, hs); });
    box.append(c);
  }
}
async function select(mi, hs) {
  cur = { mi: mi, heads: hs.slice().sort((a, b) => a - b) };
  modsel.value = mi; chips();
  for (const t of thumbs) t.box.classList.toggle("sel", t.mi === mi && cur.heads.includes(t.h));
  for (const r of rows) r.tr.classList.toggle("sel", r.mi === mi && cur.heads.includes(r.h));
  await drawHeadView();
}
async function drawHeadView() {
  const m = D.modules[cur.mi], qt = D.sequences[m.q], kt = D.sequences[m.k];
  const want = cur.mi, data = [];
  for (const h of cur.heads) data.push([h, await head(cur.mi, h)]);
  if (want !== cur.mi) return;
  // a canvas side stays under 32,767 device pixels (browsers refuse larger): long texts get lower rows
  const n = Math.max(qt.length, kt.length), rowH = Math.max(2, Math.min(18, Math.floor(32000 / (n + 1))));
  const dpr = Math.min(window.devicePixelRatio || 1, 32000 / (n * rowH + 12));
  hctx.font = "13px system-ui, sans-serif";
  let tw = 40;
  for (const t of qt.concat(kt)) tw = Math.max(tw, Math.min(160, hctx.measureText(t).width + 12));
  const gap = 180, W = 2 * tw + gap, H = n * rowH + 12;
  hv.width = W * dpr; hv.height = H * dpr; hv.style.width = W + "px"; hv.style.height = H + "px";
  geom = { tw: tw, gap: gap, rowH: rowH, W: W, nq: qt.length, nk: kt.length };
  const ctx = hctx; ctx.setTransform(dpr, 0, 0, dpr, 0, 0); ctx.clearRect(0, 0, W, H);
  ctx.font = "13px system-ui, sans-serif"; ctx.textBaseline = "middle";
  const yOf = (i) => 6 + i * rowH + rowH / 2, x0 = tw, x1 = tw + gap;
  for (const [h, v] of data) {
    ctx.strokeStyle = PALETTE[h % PALETTE.length]; ctx.lineWidth = 1.6;
    for (let i = 0; i < v.lq; i++) {
      if (hover && hover.side === "q" && hover.i !== i) continue;
      for (let j = 0; j < v.lk; j++) {
        if (hover && hover.side === "k" && hover.i !== j) continue;
        const w = v.q[j * v.lq + i] / 255;
        if (w < 0.01) continue;
        ctx.globalAlpha = Math.min(1, w * (data.length > 1 ? 0.8 : 1));
        ctx.beginPath(); ctx.moveTo(x0, yOf(i)); ctx.lineTo(x1, yOf(j)); ctx.stroke();
      }
    }
  }
  ctx.globalAlpha = 1;
  const label = (t, x, i, align, on) => { ctx.textAlign = align; ctx.fillStyle = on ? "#2f6fde" : "#1d2330";
    ctx.font = (on ? "600 " : "") + "13px system-ui, sans-serif"; ctx.fillText(clip(t, tw - 12), x, yOf(i)); };
  qt.forEach((t, i) => label(t, x0 - 6, i, "right", hover && hover.side === "q" && hover.i === i));
  kt.forEach((t, i) => label(t, x1 + 6, i, "left", hover && hover.side === "k" && hover.i === i));
}
function clip(t, w) { if (hctx.measureText(t).width <= w) return t; while (t.length > 1 &&
  hctx.measureText(t + "\\u2026").width > w) t = t.slice(0, -1); return t + "\\u2026"; }
hv.addEventListener("mousemove", (e) => {
  if (!geom) return;
  const r = hv.getBoundingClientRect(), x = e.clientX - r.left, y = e.clientY - r.top;
  const i = Math.floor((y - 6) / geom.rowH);
  let h = null;
  if (x < geom.tw && i >= 0 && i < geom.nq) h = { side: "q", i: i };
  else if (x > geom.tw + geom.gap && i >= 0 && i < geom.nk) h = { side: "k", i: i };
  if (JSON.stringify(h) !== JSON.stringify(hover)) { hover = h; drawHeadView(); }
});
hv.addEventListener("mouseleave", () => { if (hover) { hover = null; drawHeadView(); } });

// ---- statistics table ----
const cols = Object.keys(D.columns);
const hasImp = D.modules.some((m) => m.importance);
const header = ["module", "head"].concat(cols).concat(hasImp ? ["importance"] : []);
const rows = [];
D.modules.forEach((m, mi) => { for (let h = 0; h < m.heads; h++) { const vals = cols.map((c) => m.stats[c][h]);
  if (hasImp) vals.push(m.importance ? m.importance[h] : null); rows.push({ mi: mi, h: h, name: m.name, vals: vals }); } });
const colMax = header.slice(2).map((_, c) => Math.max(1e-12, ...rows.map((r) => r.vals[c] == null ? 0 : r.vals[c])));
const htr = el("tr");
header.forEach((c, ci) => { const th = el("th", { title: D.columns[c] || (c === "importance" ?
  "gradient importance of the head on this text (normalised per module)" : "") }, c);
  th.addEventListener("click", () => sortBy(ci, th)); htr.append(th); });
$("stats").tHead.append(htr);
for (const r of rows) {
  const tr = el("tr"); tr.append(el("td", { title: r.name }, shortName(r.name)), el("td", null, "" + r.h));
  r.vals.forEach((v, c) => { const td = el("td", null, v == null ? "\\u2013" : v.toFixed(3));
    if (v != null) { const b = el("span", { class: "bar" }); b.style.width = Math.round(18 * v / colMax[c]) + "px"; td.append(b); }
    tr.append(td); });
  tr.addEventListener("click", () => { select(r.mi, [r.h]); });
  r.tr = tr; $("stats").tBodies[0].append(tr);
}
let sortState = { col: -1, dir: 1 };
function sortBy(ci, th) {
  sortState = { col: ci, dir: sortState.col === ci ? -sortState.dir : (ci < 2 ? 1 : -1) };
  const key = (r) => ci === 0 ? r.mi : ci === 1 ? r.h : r.vals[ci - 2];
  rows.sort((a, b) => { const x = key(a), y = key(b);
    if (x == null || y == null) return (x == null) - (y == null);
    return (x < y ? -1 : x > y ? 1 : (a.mi - b.mi) || (a.h - b.h)) * sortState.dir; });
  const tb = $("stats").tBodies[0]; for (const r of rows) tb.append(r.tr);
  for (const t of htr.children) t.classList.remove("asc", "desc");
  th.classList.add(sortState.dir > 0 ? "asc" : "desc");
}

// ---- start: head view of the first module, then every thumbnail in turn ----
(async function () {
  const t0 = performance.now();
  // page.html#module=2&heads=0,3 opens the head view on module 2, heads 0 and 3
  const arg = new URLSearchParams(location.hash.slice(1)), mi = Math.min(D.modules.length - 1, +(arg.get("module") || 0));
  const hs = (arg.get("heads") || "0").split(",").map(Number).filter((h) => h >= 0 && h < D.modules[mi].heads);
  await select(mi >= 0 ? mi : 0, hs.length ? hs : [0]);
  for (const t of thumbs) await drawThumb(t);
  const ms = Math.round(performance.now());
  $("status").textContent = thumbs.length + " heads drawn in " + Math.round(performance.now() - t0) + " ms";
  if (document.body.dataset.status === "loading") { document.body.dataset.status = "ready"; document.body.dataset.ms = ms; }
})();
})();
</script>
</body></html>
"""
