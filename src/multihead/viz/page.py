"""One self-contained HTML page of every attention head: data in, an HTML string out.

Dimensions: H heads, Lq query length, Lk key length.

The page works from ``file://`` with no network: the script and style are inline, written here. What it
carries of each module is made by :mod:`.encoding` (re-exported here): per-head statistics
(:func:`head_stats`), each head's weights as uint8, deflated and base64-encoded (:func:`encode_head`; a
512-token text on a 6 x 12-head model: about 2.8 MiB with the thumbnails; 1,000 tokens on a 30 x 9-head
causal LM: about 12.9 MiB), and each head's thumbnail, its weights max-pooled to at most 96 x 96 pixels,
packed the same way (:func:`thumbnail`). The page draws on canvas: a model view (the thumbnail of each
layer x head: opening the page inflates 9 KiB per head, not the head's weights), a head view
(token-to-token lines of the heads picked, opacity = weight, hover a token to focus on it; a head is
inflated by the browser's ``DecompressionStream`` only when it is shown there, a few kept in memory) and
a sortable table of per-head statistics, with head importance when given. Nothing here imports
transformers or matplotlib.
"""

from __future__ import annotations

import html
import json
from collections.abc import Mapping, Sequence

from .encoding import (
    STAT_COLUMNS,
    THUMB,
    EncodedModule,
    PageModule,
    encode_head,
    encode_module,
    head_stats,
    thumbnail,
)

__all__ = [
    "STAT_COLUMNS",
    "THUMB",
    "EncodedModule",
    "PageModule",
    "build_page",
    "encode_head",
    "encode_module",
    "head_stats",
    "thumbnail",
]


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
                "thumb": list(e.thumb_shape),
                "thumbs": e.thumbs,
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
.thumb canvas{display:block;width:100%;height:auto;image-rendering:pixelated;border-radius:2px}
.thumb.sel{outline:3px solid var(--acc);outline-offset:1px}
.thumb .imp{position:absolute;left:0;bottom:0;height:3px;background:#e8590c;border-radius:0 2px 0 2px}
.layout{display:flex;gap:24px;flex-wrap:wrap;align-items:flex-start}
.hv{flex:0 1 500px;min-width:320px}
.hvbox{max-height:78vh;overflow-y:auto;border:1px solid var(--line);border-radius:4px;background:#fff}
#hv{position:sticky;top:0;display:block}
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
<div class="hvbox" id="hvbox"><div id="hvspace"><canvas id="hv"></canvas></div></div></section>
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

// ---- decoding: base64 -> inflate -> uint8 bytes of the length the module says ----
async function inflate(b64, n, what) {
  const bin = atob(b64), bytes = new Uint8Array(bin.length);
  for (let i = 0; i < bin.length; i++) bytes[i] = bin.charCodeAt(i);
  const stream = new Blob([bytes]).stream().pipeThrough(new DecompressionStream("deflate"));
  const out = new Uint8Array(await new Response(stream).arrayBuffer());
  if (out.length !== n) throw new Error(what + ": " + out.length + " bytes, not " + n);
  return out;
}
// a head: {q: uint8 (Lk*Lq) key-major, weight of (i, j) = q[j * lq + i] / 255}; the last few kept
const cache = new Map(), CACHE_MAX = 6;
async function head(mi, h) {
  const key = mi + ":" + h;
  if (cache.has(key)) { const v = cache.get(key); cache.delete(key); cache.set(key, v); return v; }
  const mod = D.modules[mi], lq = D.sequences[mod.q].length, lk = D.sequences[mod.k].length;
  const v = { q: await inflate(mod.blobs[h], lq * lk, mod.name + " head " + h), lq: lq, lk: lk };
  cache.set(key, v);
  if (cache.size > CACHE_MAX) cache.delete(cache.keys().next().value);
  return v;
}

// ---- header ----
$("title").textContent = D.title;
for (const k in D.facts) { const s = el("span"); s.append(el("b", null, k + ": "), D.facts[k]); $("facts").append(s); }

// ---- model view: each head's thumbnail, its weights max-pooled to at most 96 x 96 by the command ----
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
      const cv = el("canvas", { width: m.thumb[1], height: m.thumb[0] });
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

async function drawThumbs(mi) {  // one module's: one blob, (heads, R, C) row by row
  const m = D.modules[mi], [R, C] = m.thumb, px = await inflate(m.thumbs, m.heads * R * C, m.name + " thumbnails");
  for (const t of thumbs) if (t.mi === mi) drawThumb(t, px.subarray(t.h * R * C, (t.h + 1) * R * C));
}
function drawThumb(t, px) {
  const W = t.cv.width, H = t.cv.height, ctx = t.cv.getContext("2d"), img = ctx.createImageData(W, H);
  let top = 64;  // the head's largest weight, at least 0.25: a uniform head stays pale
  for (let p = 0; p < W * H; p++) if (px[p] > top) top = px[p];
  for (let p = 0; p < W * H; p++) {
    const x = Math.sqrt(px[p] / top), o = 4 * p;
    img.data[o] = 255 - x * 243; img.data[o + 1] = 255 - x * 194; img.data[o + 2] = 255 - x * 110; img.data[o + 3] = 255;
  }
  ctx.putImageData(img, 0, 0);
}

// ---- head view: tokens in two columns, lines for the selected heads ----
const hv = $("hv"), hctx = hv.getContext("2d"), hvbox = $("hvbox"), hvspace = $("hvspace");
let cur = { mi: 0, heads: [0] }, hover = null, geom = null, shown = null;
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
  const mi = cur.mi, m = D.modules[mi], data = [];
  for (const h of cur.heads) data.push([h, await head(mi, h)]);
  if (mi !== cur.mi) return;
  const qt = D.sequences[m.q], kt = D.sequences[m.k], n = Math.max(qt.length, kt.length), rowH = 18;
  hctx.font = "13px system-ui, sans-serif";
  let tw = 40;
  for (const t of qt.concat(kt)) tw = Math.max(tw, Math.min(160, hctx.measureText(t).width + 12));
  geom = { tw: tw, gap: 180, rowH: rowH, W: 2 * tw + 180, H: n * rowH + 12, nq: qt.length, nk: kt.length };
  shown = { qt: qt, kt: kt, data: data };
  hvspace.style.width = geom.W + "px"; hvspace.style.height = geom.H + "px";
  paint();
}
// the canvas covers only the rows scrolled into view (1,000 tokens are 18,000 pixels tall): only the
// lines that cross them are drawn, and the view is painted again as the box scrolls
function paint() {
  if (!shown) return;
  const g = geom, top = hvbox.scrollTop, vh = Math.min(g.H, hvbox.clientHeight || 800);
  const dpr = window.devicePixelRatio || 1, ctx = hctx;
  hv.width = g.W * dpr; hv.height = vh * dpr; hv.style.width = g.W + "px"; hv.style.height = vh + "px";
  ctx.setTransform(dpr, 0, 0, dpr, 0, -top * dpr);  // from here on, y is in the whole view's pixels
  const yOf = (i) => 6 + i * g.rowH + g.rowH / 2, x0 = g.tw, x1 = g.tw + g.gap, lo = top - g.rowH, hi = top + vh + g.rowH;
  const qk = hover && hover.side === "q" ? hover.i : -1, kk = hover && hover.side === "k" ? hover.i : -1;
  for (const [h, v] of shown.data) {
    ctx.strokeStyle = PALETTE[h % PALETTE.length]; ctx.lineWidth = 1.6;
    const paths = new Map();  // the lines of one weight (uint8) in one path: one stroke each, not one per line
    for (let j = kk < 0 ? 0 : kk; j < (kk < 0 ? v.lk : kk + 1); j++) {
      const col = v.q.subarray(j * v.lq, (j + 1) * v.lq), yj = yOf(j);  // key j's weight from every query
      for (let i = qk < 0 ? 0 : qk; i < (qk < 0 ? v.lq : qk + 1); i++) {
        const x = col[i], yi = yOf(i);
        if (x / 255 < 0.01 || Math.max(yi, yj) < lo || Math.min(yi, yj) > hi) continue;  // faint, or not in view
        let p = paths.get(x);
        if (!p) { p = new Path2D(); paths.set(x, p); }
        p.moveTo(x0, yi); p.lineTo(x1, yj);
      }
    }
    for (const [x, p] of paths) { ctx.globalAlpha = Math.min(1, x / 255 * (shown.data.length > 1 ? 0.8 : 1)); ctx.stroke(p); }
  }
  ctx.globalAlpha = 1; ctx.textBaseline = "middle";
  const label = (t, x, i, align, on) => { ctx.textAlign = align; ctx.fillStyle = on ? "#2f6fde" : "#1d2330";
    ctx.font = (on ? "600 " : "") + "13px system-ui, sans-serif"; ctx.fillText(clip(t, g.tw - 12), x, yOf(i)); };
  const first = Math.max(0, Math.floor(lo / g.rowH)), last = Math.ceil(hi / g.rowH);
  for (let i = first; i < Math.min(last, g.nq); i++) label(shown.qt[i], x0 - 6, i, "right", qk === i);
  for (let i = first; i < Math.min(last, g.nk); i++) label(shown.kt[i], x1 + 6, i, "left", kk === i);
}
function clip(t, w) { if (hctx.measureText(t).width <= w) return t; while (t.length > 1 &&
  hctx.measureText(t + "\\u2026").width > w) t = t.slice(0, -1); return t + "\\u2026"; }
let frame = 0;
hvbox.addEventListener("scroll", () => { if (!frame) frame = requestAnimationFrame(() => { frame = 0; paint(); }); });
hv.addEventListener("mousemove", (e) => {
  if (!geom) return;
  const r = hv.getBoundingClientRect(), x = e.clientX - r.left, y = e.clientY - r.top + hvbox.scrollTop;
  const i = Math.floor((y - 6) / geom.rowH);
  let h = null;
  if (x < geom.tw && i >= 0 && i < geom.nq) h = { side: "q", i: i };
  else if (x > geom.tw + geom.gap && i >= 0 && i < geom.nk) h = { side: "k", i: i };
  if (JSON.stringify(h) !== JSON.stringify(hover)) { hover = h; paint(); }
});
hv.addEventListener("mouseleave", () => { if (hover) { hover = null; paint(); } });

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

// ---- start: head view of the first module, and every thumbnail ----
(async function () {
  const t0 = performance.now();
  // page.html#module=2&heads=0,3 opens the head view on module 2, heads 0 and 3
  const arg = new URLSearchParams(location.hash.slice(1)), mi = Math.min(D.modules.length - 1, +(arg.get("module") || 0));
  const hs = (arg.get("heads") || "0").split(",").map(Number).filter((h) => h >= 0 && h < D.modules[mi].heads);
  await select(mi >= 0 ? mi : 0, hs.length ? hs : [0]);
  await Promise.all(D.modules.map((m, mi) => drawThumbs(mi)));
  const ms = Math.round(performance.now());
  $("status").textContent = thumbs.length + " heads drawn in " + Math.round(performance.now() - t0) + " ms";
  if (document.body.dataset.status === "loading") { document.body.dataset.status = "ready"; document.body.dataset.ms = ms; }
})();
})();
</script>
</body></html>
"""
