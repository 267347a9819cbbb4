"""A self-contained HTML report: every picture inline, no network references."""

from __future__ import annotations

import base64
import html
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from .capture import Capture
from .plots import _png, plot_attention, plot_importance

if TYPE_CHECKING:
    from matplotlib.figure import Figure


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
