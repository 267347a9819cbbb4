"""The head view's style, markup and script, shared by the page (:mod:`.page`) and the inline view
(:mod:`.inline`).

Everything is scoped: the style's rules apply under ``.mhv`` only, the markup names its parts with
``data-p`` attributes (no ``id``), and the script is one function, ``mhView(root, D, opts)``, that finds its
parts under ``root`` and keeps its state in its own closure (no global name, no window listener). So several
views share one document (a notebook) without clashing, and the page is one view filling ``<body>``.

``mhView(root, D, opts)``: ``D`` the data of :func:`~multihead.viz.page.page_data`; ``opts.status`` the element
whose ``data-status`` goes ``loading`` -> ``ready`` (or ``error``) and ``data-ms`` (ms since navigation) is set
when everything is drawn (default: ``root``); ``opts.hash`` a ``#module=2&heads=0,3`` to open on. On its first line
the script hides the static picture (``data-p="fallback"``) and shows the drawn view (``data-p="live"``): where
scripts do not run (an untrusted notebook, a GitHub preview) the picture stays. When done it dispatches
``mh-drawn`` (bubbling) on ``root``.
"""

STYLE = """
.mhv{--fg:#1d2330;--mut:#5b6475;--line:#d9dde5;--bg:#f6f7f9;--acc:#2f6fde;
 font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;color:var(--fg);background:#fff;text-align:left}
.mhv,.mhv *{box-sizing:border-box}
.mhv [hidden]{display:none !important}
.mhv .mh-hd{padding:16px 24px 10px;border-bottom:1px solid var(--line);background:var(--bg)}
.mhv .mh-h1{font-size:20px;font-weight:600;margin:0 0 6px}.mhv .mh-h2{font-size:16px;font-weight:600;margin:0 0 8px}
.mhv .facts{display:flex;flex-wrap:wrap;gap:6px 18px;color:var(--mut);font-size:13px}
.mhv .facts b{color:var(--fg);font-weight:600}
.mhv .mh-main{padding:14px 24px 40px}
.mhv .mh-sec{margin:0 0 22px}
.mhv .note{color:var(--mut);font-size:12.5px;margin:2px 0 8px}
.mhv .grid{display:grid;gap:6px;align-items:center;overflow-x:auto;padding-bottom:4px}
.mhv .grid .lab{font-size:12px;color:var(--mut);text-align:right;padding-right:4px;white-space:nowrap}
.mhv .grid .col{font-size:12px;color:var(--mut);text-align:center}
.mhv .thumb{position:relative;cursor:pointer;border:1px solid var(--line);border-radius:3px;background:#fff;
 line-height:0}
.mhv .thumb canvas{display:block;width:100%;height:auto;image-rendering:pixelated;border-radius:2px}
.mhv .thumb.sel{outline:3px solid var(--acc);outline-offset:1px}
.mhv .thumb .imp{position:absolute;left:0;bottom:0;height:3px;background:#e8590c;border-radius:0 2px 0 2px}
.mhv .layout{display:flex;gap:24px;flex-wrap:wrap;align-items:flex-start}
.mhv .hv{flex:0 1 500px;min-width:320px}
.mhv .hvbox{max-height:78vh;overflow-y:auto;border:1px solid var(--line);border-radius:4px;background:#fff}
.mhv .hvc{position:sticky;top:0;display:block}
.mhv .controls{display:flex;flex-wrap:wrap;gap:6px 10px;align-items:center;margin:0 0 8px}
.mhv .controls select{font:inherit;padding:2px 4px}
.mhv .chip{display:inline-flex;align-items:center;gap:4px;padding:1px 8px;border-radius:11px;
 border:1px solid var(--line);cursor:pointer;user-select:none;font-size:12.5px}
.mhv .chip i{display:inline-block;width:10px;height:10px;border-radius:2px}
.mhv .chip.off{opacity:.45}
.mhv .tbl{flex:1 1 520px;min-width:420px}
.mhv .tblbox{max-height:78vh;overflow:auto;border:1px solid var(--line);border-radius:4px}
.mhv table{border-collapse:collapse;width:100%;font-size:12.5px;font-variant-numeric:tabular-nums;
 table-layout:auto;margin:0;color:var(--fg)}
.mhv th,.mhv td{padding:3px 6px;border:0;border-bottom:1px solid #eceef2;text-align:right;white-space:nowrap}
.mhv th{position:sticky;top:0;background:var(--bg);cursor:pointer;user-select:none;font-weight:600}
.mhv th:first-child,.mhv td:first-child{text-align:left}
.mhv tbody tr{background:#fff}
.mhv tbody tr:hover{background:#eef3fd;cursor:pointer}
.mhv tbody tr.sel{background:#dde8fb}
.mhv th.asc:after{content:" \\25B2";font-size:9px}.mhv th.desc:after{content:" \\25BC";font-size:9px}
.mhv .bar{display:inline-block;height:8px;background:#9db8ec;vertical-align:middle;margin-left:4px;border-radius:1px}
.mhv .mh-status{color:var(--mut);font-size:12px}
.mhv .fallback{padding:10px 24px}.mhv .fallback img{max-width:100%;image-rendering:pixelated}
"""
"""The view's CSS, every rule under ``.mhv``."""

MARKUP = """
<div class="mh-hd"><div class="mh-h1">{{TITLE}}</div><div class="facts">{{FACTS}}</div></div>
<div class="fallback" data-p="fallback">{{FALLBACK}}</div>
<div class="mh-main" data-p="live" hidden>
<div class="mh-sec"><div class="mh-h2">Model view</div>
<div class="note">Every attention module (rows) and head (columns): query tokens top to bottom, key tokens left to
right, darker = more weight (square root of the weight over the head's largest, or over 0.25 when that is smaller; a
pixel shows the largest weight of the cells it covers). The orange bar under a head is its importance. Click a head to
show it in the head view.</div>
<div data-p="models"></div></div>
<div class="layout">
<div class="mh-sec hv"><div class="mh-h2">Head view</div>
<div class="controls"><label>module <select data-p="modsel"></select></label><span data-p="chips"></span></div>
<div class="note">Lines join each query token (left) to the keys it attends to (right); opacity = weight.
Hover a token to see only its lines.</div>
<div class="hvbox" data-p="hvbox"><div data-p="hvspace"><canvas class="hvc" data-p="hv"></canvas></div></div></div>
<div class="mh-sec tbl"><div class="mh-h2">Head statistics</div>
<div class="note">Click a column to sort; click a row to show that head.</div>
<div class="tblbox"><table data-p="stats"><thead></thead><tbody></tbody></table></div></div>
</div>
<div class="mh-status" data-p="status">loading...</div>
</div>
"""
"""The view's markup inside its root; ``{{TITLE}}``, ``{{FACTS}}`` and ``{{FALLBACK}}`` are filled in."""

SCRIPT = """
function mhView(root, D, opts) {
const PALETTE = ["#2f6fde", "#e8590c", "#2b8a3e", "#c2255c", "#7048e8", "#0c8599", "#e67700", "#5c940d",
  "#a61e4d", "#1864ab", "#862e9c", "#d9480f"];
const $ = (p) => root.querySelector('[data-p="' + p + '"]');
const el = (tag, attrs, text) => { const e = document.createElement(tag); if (attrs) for (const k in attrs)
  e.setAttribute(k, attrs[k]); if (text !== undefined) e.textContent = text; return e; };
const status = opts.status || root;  // where data-status (loading, ready, error) and data-ms are set
function fail(msg) { status.dataset.status = "error"; $("status").textContent = "error: " + msg;
  console.error("multihead view: " + msg); }
const guard = (p) => p.catch((e) => fail(String(e)));  // a rejected draw marks this view, not the window
$("fallback").hidden = true; $("live").hidden = false;  // scripts run: the drawn view replaces the picture

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
      box.addEventListener("click", () => guard(select(mi, [h])));
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
modsel.addEventListener("change", () => guard(select(+modsel.value, cur.heads.filter((h) => h < D.modules[+modsel.value].heads))));
function chips() {
  const box = $("chips"); box.textContent = "";
  const m = D.modules[cur.mi];
  for (let h = 0; h < m.heads; h++) {
    const c = el("span", { class: "chip" + (cur.heads.includes(h) ? "" : " off") });
    const sw = el("i"); sw.style.background = PALETTE[h % PALETTE.length]; c.append(sw, "" + h);
    c.addEventListener("click", () => { const hs = cur.heads.includes(h) ? cur.heads.filter((x) => x !== h)
      : cur.heads.concat([h]); guard(select(cur.mi, hs)); });
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
  tr.addEventListener("click", () => guard(select(r.mi, [r.h])));
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
const started = (async function () {
  const t0 = performance.now();
  // page.html#module=2&heads=0,3 opens the head view on module 2, heads 0 and 3
  const arg = new URLSearchParams((opts.hash || "").slice(1)), mi = Math.min(D.modules.length - 1, +(arg.get("module") || 0));
  const hs = (arg.get("heads") || "0").split(",").map(Number).filter((h) => h >= 0 && h < D.modules[mi].heads);
  await select(mi >= 0 ? mi : 0, hs.length ? hs : [0]);
  await Promise.all(D.modules.map((m, mi) => drawThumbs(mi)));
  const ms = Math.round(performance.now());
  $("status").textContent = thumbs.length + " heads drawn in " + Math.round(performance.now() - t0) + " ms";
  if (status.dataset.status === "loading") { status.dataset.status = "ready"; status.dataset.ms = ms; }
})();
return guard(started).then(() =>
  root.dispatchEvent(new CustomEvent("mh-drawn", { bubbles: true, detail: status.dataset.status })));
}
"""
"""``function mhView(root, D, opts)``: draws one view (see the module docstring)."""
