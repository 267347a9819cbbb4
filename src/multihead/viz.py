"""Look at attention: capture per-head weights, plot them, and write a self-contained HTML report.

Dimensions: B batch, H heads, N attention modules (rows of a grid), Lq query length, Lk key length.

matplotlib is an optional extra (``pip install 'multihead[viz]'``): it is imported inside the plotting
functions only, always through ``matplotlib.figure.Figure`` (the Agg canvas; no pyplot, no display, no
global state). :func:`capture` needs nothing beyond torch.
"""

from __future__ import annotations

import base64
import html
import io
import json
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from . import _inspect
from .heads import attention_kind, attention_modules

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = [
    "AttentionRecord",
    "Capture",
    "Panel",
    "capture",
    "panels",
    "plot_attention",
    "plot_importance",
    "write_report",
]


# ------------------------------------------------------------------------------------------------
# Capture
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class AttentionRecord:
    """One call of one attention module: its name, kind and weights (B, H, Lq, Lk) (detached, on CPU)."""

    name: str
    kind: str
    weights: Tensor


@dataclass
class Capture:
    """The attention weights seen inside a :func:`capture` block, one record per module call."""

    records: list[AttentionRecord] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.records)

    def names(self, kind: str | None = None) -> list[str]:
        """Modules that ran (optionally of one ``kind``), in the order they first ran."""
        return list(dict.fromkeys(r.name for r in self.records if kind is None or r.kind == kind))

    def kind(self, name: str) -> str:
        """``"encoder self"``, ``"decoder self"``, ``"cross"`` or ``"self"`` for a captured module."""
        return attention_kind(name)

    def get(self, name: str) -> Tensor:
        """All calls of module ``name`` joined along the queries: (B, H, sum of Lq, max Lk).

        One full forward gives that call's weights as they are. Step-by-step decoding with a KV cache gives
        one row per step; rows of earlier steps (shorter Lk) are padded with zeros on the right, so a
        decoder's self-attention reads as the usual lower-triangular (B, H, T, T) matrix.
        """
        parts = [r.weights for r in self.records if r.name == name]
        if not parts:
            raise KeyError(f"no attention weights captured for {name!r}; captured: {self.names()}")
        b, h = parts[0].shape[:2]
        if any(p.shape[:2] != (b, h) for p in parts):
            raise ValueError(
                f"calls of {name!r} have different (B, H): {[tuple(p.shape[:2]) for p in parts]}; read "
                f"the records one by one (capture.records) instead of joining them"
            )
        lk = max(p.shape[-1] for p in parts)
        padded = [torch.nn.functional.pad(p, (0, lk - p.shape[-1])) for p in parts]  # (B, H, Lq_i, lk)
        return torch.cat(padded, dim=2)  # (B, H, sum Lq_i, lk)

    def by_kind(self, kind: str) -> dict[str, Tensor]:
        """``{name: get(name)}`` for the modules of one kind, in run order."""
        return {name: self.get(name) for name in self.names(kind)}


class _Recorder(_inspect.Inspector):
    wants_weights = True

    def __init__(self, model: nn.Module, out: Capture) -> None:
        self.names = {m: name for name, m in attention_modules(model).items()}
        self.out = out

    def on_heads(self, module: nn.Module, heads: Tensor, weights: Tensor | None) -> Tensor:
        name = self.names.get(module)
        if name is not None and weights is not None:
            w = weights.detach().to("cpu", copy=True)  # (B, H, Lq, Lk), no graph, no shared storage
            self.out.records.append(AttentionRecord(name, attention_kind(name), w))
        return heads


@contextmanager
def capture(model: nn.Module) -> Iterator[Capture]:
    """Collect every attention module's per-head weights while the block runs.

    Records are labelled by the module's qualified name in ``model`` and its kind (encoder self,
    decoder self, cross). Nothing is attached to the modules: no hooks, no attributes, no tensors
    are left on them after the block (the :class:`Capture` you hold owns the weights)::

        with viz.capture(model) as cap:
            model(src, tgt)
        cap.get("decoder.layers.0.cross_attn")   # (B, H, T, S)

    Weights are the softmax probabilities before dropout, the same as ``return_weights=True`` gives.
    """
    out = Capture()
    with _inspect.inspecting(_Recorder(model, out)):
        yield out


# ------------------------------------------------------------------------------------------------
# Plots
# ------------------------------------------------------------------------------------------------


def _figure(**kwargs: object) -> Figure:
    try:
        from matplotlib.figure import Figure
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError(
            "multihead.viz plots need matplotlib: pip install 'multihead[viz]' (or pip install matplotlib)"
        ) from e
    return Figure(**kwargs)


def _png(fig: Figure, dpi: int = 100) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi, metadata={"Software": None})
    return buf.getvalue()


def _save(fig: Figure, path: str | Path | None, dpi: int) -> None:
    if path is not None:
        Path(path).write_bytes(_png(fig, dpi))


def _as_rows(weights: Tensor | Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Any accepted ``weights`` form -> ``{row label: (H, Lq, Lk) float tensor}``."""
    if isinstance(weights, Mapping):
        rows = dict(weights)
    elif isinstance(weights, Tensor):
        w = weights.detach()
        if w.dim() == 2:
            w = w[None, None]  # (1, 1, Lq, Lk)
        elif w.dim() == 3:
            w = w[None]  # (1, H, Lq, Lk)
        elif w.dim() != 4:
            raise ValueError(
                f"weights must be (Lq, Lk), (H, Lq, Lk), (N, H, Lq, Lk) or a mapping of (H, Lq, Lk), got "
                f"shape {tuple(w.shape)}; for a capture of a batch pick one example: w[0]"
            )
        rows = {f"layer {i}": w[i] for i in range(w.shape[0])}
    else:
        raise TypeError(f"weights must be a Tensor or a mapping of Tensors, got {type(weights).__name__}")
    if not rows:
        raise ValueError("weights is empty: nothing to plot")
    out = {}
    for label, w in rows.items():
        if not isinstance(w, Tensor) or w.dim() != 3:
            raise ValueError(
                f"weights[{label!r}] must be a (H, Lq, Lk) tensor, got "
                f"{tuple(w.shape) if isinstance(w, Tensor) else type(w).__name__}"
            )
        out[str(label)] = w.detach().float().cpu()
    if len({w.shape[1:] for w in out.values()}) != 1:
        raise ValueError(
            f"every row must share (Lq, Lk), got {[tuple(w.shape[1:]) for w in out.values()]}; plot rows "
            f"of different lengths separately"
        )
    return out


def _check_tokens(tokens: Sequence[str] | None, n: int, name: str, what: str) -> list[str]:
    if tokens is None:
        return [str(i) for i in range(n)]
    tokens = [str(t) for t in tokens]
    if len(tokens) != n:
        raise ValueError(
            f"{name} has {len(tokens)} tokens but the weights have {n} {what}; pass one label per "
            f"{what[:-1]} (crop padding from the weights, e.g. w[..., :{len(tokens)}, :])"
        )
    return tokens


def plot_attention(
    weights: Tensor | Mapping[str, Tensor],
    query_tokens: Sequence[str] | None = None,
    key_tokens: Sequence[str] | None = None,
    *,
    title: str | None = None,
    path: str | Path | None = None,
    cmap: str = "viridis",
    dpi: int = 100,
) -> Figure:
    """A grid of heatmaps, one row per layer and one column per head, with a shared colour bar.

    Args:
        weights: (Lq, Lk), (H, Lq, Lk), (N, H, Lq, Lk), or ``{row label: (H, Lq, Lk)}`` (rows may have
            different H, e.g. after pruning). Rows of a (B, ...) capture: pick an example first.
        query_tokens: Lq labels for the rows of each heatmap (the attending tokens).
        key_tokens: Lk labels for its columns (the attended tokens).
        title: the figure's title.
        path: if given, the PNG is written there.

    Returns:
        The ``matplotlib.figure.Figure`` (Agg canvas; no window is opened).

    Row i, column j shows ``weights[i][j]``: cell (q, k) is how much query token q attends to key token
    k; each row of a heatmap sums to 1 (or 0 for a fully masked query).
    """
    rows = _as_rows(weights)
    lq, lk = next(iter(rows.values())).shape[1:]
    qt = _check_tokens(query_tokens, lq, "query_tokens", "query rows")
    kt = _check_tokens(key_tokens, lk, "key_tokens", "key columns")
    n, cols = len(rows), max(w.shape[0] for w in rows.values())
    pw, ph = 0.9 + 0.2 * lk, 0.6 + 0.2 * lq  # inches per panel
    fig = _figure(figsize=(cols * pw + 1.8, n * ph + (0.8 if title else 0.4)), layout="constrained")
    axes = fig.subplots(n, cols, squeeze=False)
    vmax = max(float(w.max()) for w in rows.values()) or 1.0
    heads_per_row = [w.shape[0] for w in rows.values()]
    image = None
    for i, (label, w) in enumerate(rows.items()):
        for j in range(cols):
            ax = axes[i][j]
            if j >= w.shape[0]:
                ax.set_axis_off()  # this row has fewer heads
                continue
            image = ax.imshow(w[j].numpy(), cmap=cmap, vmin=0.0, vmax=vmax, aspect="auto")
            # token labels on the outer panels only (ticks are most of the drawing time)
            bottom = all(h <= j for h in heads_per_row[i + 1 :])
            if bottom:
                ax.set_xticks(range(lk), kt, rotation=90, fontsize=7)
            else:
                ax.set_xticks([])
            if j == 0:
                ax.set_yticks(range(lq), qt, fontsize=7)
                ax.set_ylabel(label, fontsize=8)
            else:
                ax.set_yticks([])
            if i == 0:
                ax.set_title(f"head {j}", fontsize=9)
    if image is not None:
        fig.colorbar(image, ax=axes, shrink=0.8, label="attention weight")
    if title:
        fig.suptitle(title, fontsize=10)
    _save(fig, path, dpi)
    return fig


def plot_importance(
    scores: Mapping[str, Tensor],
    *,
    title: str = "head importance",
    path: str | Path | None = None,
    cmap: str = "magma",
    dpi: int = 100,
) -> Figure:
    """A heatmap of per-head scores: one row per module, one column per head, values written in the cells.

    ``scores`` is ``{module name: (H,) scores}`` as :func:`multihead.heads.importance` or
    :func:`~multihead.heads.masking_drop` return; modules with fewer heads leave blank (grey) cells.
    """
    if not scores:
        raise ValueError("scores is empty: nothing to plot")
    names = list(scores)
    cols = max(int(s.numel()) for s in scores.values())
    grid = torch.full((len(names), cols), float("nan"))
    for i, name in enumerate(names):
        s = scores[name].detach().float().cpu().flatten()
        grid[i, : s.numel()] = s
    fig = _figure(figsize=(1.6 + 0.75 * cols + 0.06 * max(map(len, names)), 0.9 + 0.4 * len(names)))
    fig.set_layout_engine("constrained")
    ax = fig.subplots()
    import numpy as np

    data = np.ma.masked_invalid(grid.numpy())
    from matplotlib import colormaps

    image = ax.imshow(data, cmap=colormaps[cmap].with_extremes(bad="#dddddd"), aspect="auto")
    finite = grid[~grid.isnan()]
    mid = float(finite.min() + finite.max()) / 2 if finite.numel() else 0.0
    for i in range(len(names)):
        for j in range(cols):
            v = float(grid[i, j])
            if v == v:  # not NaN
                ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=7, color="k" if v > mid else "w")
    ax.set_xticks(range(cols), [f"head {j}" for j in range(cols)], fontsize=8)
    ax.set_yticks(range(len(names)), [f"{n} ({attention_kind(n)})" for n in names], fontsize=7)
    ax.set_title(title, fontsize=10)
    fig.colorbar(image, ax=ax, shrink=0.8)
    _save(fig, path, dpi)
    return fig


# ------------------------------------------------------------------------------------------------
# HTML report
# ------------------------------------------------------------------------------------------------


@dataclass
class Panel:
    """One attention module's weights for one example: (H, Lq, Lk) with its token labels."""

    name: str
    kind: str
    weights: Tensor
    query_tokens: list[str]
    key_tokens: list[str]


def panels(
    cap: Capture,
    source_tokens: Sequence[str],
    target_tokens: Sequence[str],
    *,
    index: int = 0,
    target_inputs: Sequence[str] | None = None,
) -> list[Panel]:
    """Example ``index`` of a capture as report panels, labelled by kind and cropped to the tokens given.

    Encoder self-attention (and plain ``"self"``) gets source x source labels, decoder self-attention
    target x ``target_inputs``, cross-attention target (queries) x source (keys). When decoding, label
    the query rows by the token each step produced and pass the decoder's inputs (``<bos>`` first) as
    ``target_inputs``, the keys of its self-attention; by default they are ``target_tokens``.
    """
    src, tgt = [str(t) for t in source_tokens], [str(t) for t in target_tokens]
    tin = tgt if target_inputs is None else [str(t) for t in target_inputs]
    labels = {"encoder self": (src, src), "self": (src, src), "decoder self": (tgt, tin), "cross": (tgt, src)}
    out = []
    for name in cap.names():
        kind = cap.kind(name)
        qt, kt = labels[kind]
        w = cap.get(name)[index]  # (H, Lq, Lk)
        if w.shape[1] < len(qt) or w.shape[2] < len(kt):
            raise ValueError(
                f"{name} ({kind}) has weights (H, Lq, Lk) = {tuple(w.shape)}, fewer than the {len(qt)} x "
                f"{len(kt)} tokens given; pass the tokens the model actually saw"
            )
        out.append(Panel(name, kind, w[:, : len(qt), : len(kt)], qt, kt))
    return out


_STYLE = """
body{font-family:system-ui,sans-serif;margin:1.5em;max-width:1400px;color:#222}
h1{font-size:1.4em}h2{font-size:1.15em;margin-top:1.6em;border-bottom:1px solid #ccc}
table.data{border-collapse:collapse;margin:.5em 0}table.data td,table.data th{border:1px solid #ccc;
padding:.25em .6em;text-align:right}table.data th{background:#f3f3f3}
table.heat{border-collapse:collapse;font-size:12px}table.heat td{width:26px;height:22px;text-align:center}
table.heat th{font-weight:normal;padding:0 4px}table.heat th.k{writing-mode:vertical-rl;transform:rotate(180deg)}
.controls label{margin-right:1em}img{max-width:100%;border:1px solid #eee}
.top{font-family:monospace;font-size:13px}.row{display:flex;gap:2em;flex-wrap:wrap;align-items:flex-start}
"""

_SCRIPT = """
const D = JSON.parse(document.getElementById('data').textContent);
const ex = document.getElementById('ex'), mod = document.getElementById('mod'), hd = document.getElementById('hd');
const STOPS = [[68,1,84],[59,82,139],[33,145,140],[94,201,98],[253,231,37]];
function colour(t){t=Math.max(0,Math.min(1,t))*(STOPS.length-1);const i=Math.min(Math.floor(t),STOPS.length-2),
  f=t-i,a=STOPS[i],b=STOPS[i+1];return 'rgb('+a.map((v,k)=>Math.round(v+(b[k]-v)*f)).join(',')+')';}
function esc(s){const d=document.createElement('span');d.textContent=s;return d.innerHTML;}
function fill(sel, items){sel.innerHTML='';items.forEach((t,i)=>{const o=document.createElement('option');
  o.value=i;o.textContent=t;sel.appendChild(o);});}
function onExample(){fill(mod, D[ex.value].panels.map(p=>p.name+' ('+p.kind+')'));onModule();}
function onModule(){const p=D[ex.value].panels[mod.value];fill(hd, p.weights.map((_,h)=>'head '+h));draw();}
function draw(){
  const p=D[ex.value].panels[mod.value], w=p.weights[hd.value];
  let m=0; w.forEach(r=>r.forEach(v=>{m=Math.max(m,v);})); m=m||1;
  let t='<table class="heat"><tr><th></th>'+p.key_tokens.map(k=>'<th class="k">'+esc(k)+'</th>').join('')+'</tr>';
  w.forEach((r,i)=>{t+='<tr><th>'+esc(p.query_tokens[i])+'</th>'+r.map(v=>'<td title="'+v.toFixed(3)+
    '" style="background:'+colour(v/m)+'"></td>').join('')+'</tr>';});
  document.getElementById('heat').innerHTML=t+'</table>';
  let s='<table class="data top"><tr><th>query token</th><th>strongest key tokens (weight)</th></tr>';
  w.forEach((r,i)=>{const top=r.map((v,j)=>[v,j]).sort((a,b)=>b[0]-a[0]).slice(0,3).filter(x=>x[0]>0);
    s+='<tr><td>'+esc(p.query_tokens[i])+'</td><td style="text-align:left">'+
    top.map(x=>esc(p.key_tokens[x[1]])+' ('+x[0].toFixed(2)+')').join(', ')+'</td></tr>';});
  document.getElementById('top').innerHTML=s+'</table>';
}
ex.onchange=onExample; mod.onchange=onModule; hd.onchange=draw;
fill(ex, D.map(e=>e.label)); onExample();
"""


def _img(data: bytes, alt: str) -> str:
    return f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{base64.b64encode(data).decode()}">'


def _table(rows: Sequence[Sequence[object]]) -> str:
    head, *body = [[html.escape(str(c)) for c in r] for r in rows]
    out = "<tr>" + "".join(f"<th>{c}</th>" for c in head) + "</tr>"
    out += "".join("<tr>" + "".join(f"<td>{c}</td>" for c in r) + "</tr>" for r in body)
    return f'<table class="data">{out}</table>'


def write_report(
    path: str | Path,
    examples: Mapping[str, Sequence[Panel]],
    *,
    importance: Mapping[str, Tensor] | None = None,
    drop: Mapping[str, Tensor] | None = None,
    tables: Mapping[str, Sequence[Sequence[object]]] | None = None,
    images: Mapping[str, Figure | bytes] | None = None,
    title: str = "multihead attention report",
) -> Path:
    """Write one self-contained HTML file: images inline (base64 PNG), data inline, no network needed.

    Args:
        path: where to write the ``.html`` file.
        examples: ``{label: panels}``, e.g. ``{"3 mar 2021 -> 2021-03-03": viz.panels(cap, src, tgt)}``.
            The page has an explorer: pick an example, a layer and a head to see its heatmap and, for each
            query (target) token, its three strongest key (source) tokens; below it, a static grid
            (layers x heads) per example and kind.
        importance: ``{name: (H,)}`` head importance, drawn as a heatmap (:func:`plot_importance`).
        drop: ``{name: (H,)}`` metric drop when masking each head, drawn likewise.
        tables: ``{caption: rows}``, first row the header (e.g. a before/after results table).
        images: ``{caption: Figure or PNG bytes}``, more inline images (e.g. a training curve).
        title: the page title.

    Returns:
        The path written.
    """
    if not examples:
        raise ValueError("examples is empty: the report needs at least one example with panels")
    parts = [f"<h1>{html.escape(title)}</h1>"]
    for caption, rows in (tables or {}).items():
        parts += [f"<h2>{html.escape(caption)}</h2>", _table(rows)]
    for caption, img in (images or {}).items():
        data = img if isinstance(img, bytes) else _png(img)
        parts += [f"<h2>{html.escape(caption)}</h2>", _img(data, caption)]
    data = [
        {
            "label": label,
            "panels": [
                {
                    "name": p.name,
                    "kind": p.kind,
                    "query_tokens": list(p.query_tokens),
                    "key_tokens": list(p.key_tokens),
                    "weights": torch.round(p.weights.detach().float().cpu(), decimals=4).tolist(),
                }
                for p in ps
            ],
        }
        for label, ps in examples.items()
    ]
    parts += [
        "<h2>Explore one head</h2>",
        '<div class="controls"><label>example <select id="ex"></select></label>'
        '<label>layer <select id="mod"></select></label><label>head <select id="hd"></select></label></div>',
        '<div class="row"><div id="heat"></div><div id="top"></div></div>',
        "<noscript>The explorer needs JavaScript; the static grids below do not.</noscript>",
    ]
    if importance is not None:
        parts += ["<h2>Head importance</h2>", _img(_png(plot_importance(importance)), "head importance")]
    if drop is not None:
        fig = plot_importance(drop, title="metric drop when masking each head alone", cmap="viridis")
        parts += ["<h2>Masking each head alone</h2>", _img(_png(fig), "masking drop")]
    parts.append("<h2>All heads</h2>")
    for label, ps in examples.items():
        for kind in dict.fromkeys(p.kind for p in ps):
            group = [p for p in ps if p.kind == kind]
            fig = plot_attention(
                {p.name: p.weights for p in group},
                group[0].query_tokens,
                group[0].key_tokens,
                title=f"{label}: {kind} attention",
            )
            parts.append(f"<h3>{html.escape(label)}: {html.escape(kind)}</h3>{_img(_png(fig), kind)}")
    payload = json.dumps(data, separators=(",", ":")).replace("</", "<\\/")
    page = (
        f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>'
        f"<style>{_STYLE}</style></head><body>\n"
        + "\n".join(parts)
        + f'\n<script type="application/json" id="data">{payload}</script>\n<script>{_SCRIPT}</script>\n'
        "</body></html>\n"
    )
    out = Path(path)
    out.write_text(page, encoding="utf-8")
    return out
