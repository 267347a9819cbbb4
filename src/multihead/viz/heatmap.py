"""Per-head values as a layers x heads heatmap for a notebook: patching effects, attributions, importance.

Dimensions: N modules (rows), H heads (columns), F frames (positions or examples, one shown at a time).

The heatmap is inline SVG drawn here (it shows without any script): one cell per head, coloured on a red -
white - blue scale around 0 for signed values (white-blue from 0 for scores that are never negative), its value
written in it when the grid is small, and the module's full name, the head and the value in the cell's tooltip.
Values with a third axis (a position, an example) get a slider; its script only recolours the cells from
colours computed here.
"""

from __future__ import annotations

import html
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from ..heads.prune import PruneResult
from .show import View, diverging, renders, sequential, short_name

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["AttributionView", "Frames", "PruneView", "ScoresView", "TensorView"]

CELL_W, CELL_H, HEAD_H = 40, 20, 18
_TEXT_CELLS = 600  # values are written in the cells up to this many cells


@dataclass(frozen=True)
class Frames:
    """What a heatmap shows: ``values`` (F, N, H) float64 (NaN where a module has fewer heads), one label per
    frame, the frame shown first, and the N module names."""

    values: Tensor
    labels: list[str]
    names: list[str]
    start: int = 0

    @property
    def signed(self) -> bool:
        """True when some value is negative: the colour scale is centred on 0."""
        return bool((self.values < 0).any())

    @property
    def top(self) -> float:
        """The largest |value| of every frame (the ends of the colour scale), 1 for an all-zero grid."""
        finite = self.values[~self.values.isnan()]
        return float(finite.abs().max()) if finite.numel() and float(finite.abs().max()) > 0 else 1.0

    def colours(self, f: int) -> list[str]:
        """Frame ``f``'s cell colours, row by row (N * H)."""
        return (diverging if self.signed else sequential)(self.values[f], self.top)


def _ink(fill: str) -> str:
    """Black or white text on a cell of colour ``fill`` (#rrggbb), by its luminance."""
    r, g, b = (int(fill[i : i + 2], 16) for i in (1, 3, 5))
    return "#000" if 0.299 * r + 0.587 * g + 0.114 * b > 140 else "#fff"


def _fmt(v: float) -> str:
    return "" if v != v else f"{v:.2g}" if abs(v) < 0.01 and v != 0 else f"{v:.2f}"


def grid_svg(uid: str, frames: Frames) -> str:
    """The heatmap of frame ``frames.start`` as SVG: rows the modules, columns the heads, a colour bar."""
    values, names = frames.values[frames.start], frames.names
    n, h = values.shape
    label_w = 12 + 7 * max(len(short_name(m)) for m in names)
    width, height = label_w + h * CELL_W + 70, HEAD_H + n * CELL_H + 4
    fills, text = frames.colours(frames.start), n * h <= _TEXT_CELLS
    out = [f'<svg width="{width}" height="{height}" font-size="11">']
    out += [
        f'<text x="{label_w + j * CELL_W + CELL_W / 2}" y="12" text-anchor="middle" fill="#5b6475">{j}</text>'
        for j in range(h)
    ]
    for i, name in enumerate(names):
        y = HEAD_H + i * CELL_H
        out.append(
            f'<text x="{label_w - 6}" y="{y + 14}" text-anchor="end" fill="#5b6475">'
            f"<title>{html.escape(name)}</title>{html.escape(short_name(name))}</text>"
        )
        for j in range(h):
            v, fill, x = float(values[i, j]), fills[i * h + j], label_w + j * CELL_W
            out.append(
                f'<rect class="cell" x="{x}" y="{y}" width="{CELL_W - 1}" height="{CELL_H - 1}" fill="{fill}">'
                f"<title>{html.escape(name)} head {j}: {'' if v != v else f'{v:+.4g}'}</title></rect>"
            )
            if text:
                out.append(
                    f'<text class="val" x="{x + CELL_W / 2}" y="{y + 14}" text-anchor="middle" font-size="10" '
                    f'fill="{_ink(fill)}" pointer-events="none">{_fmt(v)}</text>'
                )
    out.append(_colour_bar(uid, frames, label_w + h * CELL_W + 14, HEAD_H, n * CELL_H))
    return "".join(out) + "</svg>"


def _colour_bar(uid: str, frames: Frames, x: int, y: int, height: int) -> str:
    top = frames.top
    ends = torch.tensor([top, 0.0, -top] if frames.signed else [top, 0.0], dtype=torch.float64)
    stops = (diverging if frames.signed else sequential)(ends, top)
    grad = "".join(
        f'<stop offset="{k / (len(stops) - 1):.2f}" stop-color="{c}"/>' for k, c in enumerate(stops)
    )
    low = f"{-top:+.3g}" if frames.signed else "0"
    return (
        f'<defs><linearGradient id="{uid}-bar" x1="0" y1="0" x2="0" y2="1">{grad}</linearGradient></defs>'
        f'<rect x="{x}" y="{y}" width="12" height="{height}" fill="url(#{uid}-bar)" stroke="#d9dde5"/>'
        f'<text x="{x + 16}" y="{y + 10}" fill="#5b6475">{top:+.3g}</text>'
        f'<text x="{x + 16}" y="{y + height}" fill="#5b6475">{low}</text>'
    )


def frames_script(uid: str, frames: Frames) -> str:
    """A slider over the frames and the script that recolours the cells (colours computed here)."""
    n_frames = frames.values.shape[0]
    data = {
        "labels": frames.labels,
        "fills": [frames.colours(f) for f in range(n_frames)],
        "vals": [[_fmt(v) for v in frames.values[f].flatten().tolist()] for f in range(n_frames)],
        "tips": [
            [f"{v:+.4g}" if v == v else "" for v in frames.values[f].flatten().tolist()]
            for f in range(n_frames)
        ],
    }
    payload = json.dumps(data, separators=(",", ":")).replace("</", "<\\/")
    return (
        f'<div class="mhs-ctl" data-p="ctl" hidden><input type="range" min="0" max="{n_frames - 1}" value="{frames.start}" '
        f'data-p="slider"><span data-p="frame">{html.escape(frames.labels[frames.start])}</span></div>'
        f'<script type="application/json" data-p="frames">{payload}</script>'
        f"<script>{_FRAMES_JS.replace('{{UID}}', uid)}</script>"
    )


_FRAMES_JS = """(function () {
"use strict";
const root = document.getElementById("{{UID}}");
try {
  const D = JSON.parse(root.querySelector('[data-p="frames"]').textContent);
  const cells = root.querySelectorAll("rect.cell"), vals = root.querySelectorAll("text.val");
  const slider = root.querySelector('[data-p="slider"]'), label = root.querySelector('[data-p="frame"]');
  const ink = (c) => { const n = parseInt(c.slice(1), 16);
    return 0.299 * (n >> 16) + 0.587 * ((n >> 8) & 255) + 0.114 * (n & 255) > 140 ? "#000" : "#fff"; };
  function draw(f) {
    cells.forEach((c, i) => { c.setAttribute("fill", D.fills[f][i]);
      const t = c.firstChild; t.textContent = t.textContent.replace(/: [^:]*$/, ": " + D.tips[f][i]); });
    vals.forEach((t, i) => { t.textContent = D.vals[f][i]; t.setAttribute("fill", ink(D.fills[f][i])); });
    label.textContent = D.labels[f];
  }
  slider.addEventListener("input", () => draw(+slider.value));
  root.querySelector('[data-p="ctl"]').hidden = false;  // no slider where scripts do not run
  draw(+slider.value);
  root.dataset.status = "ready";
} catch (e) { root.dataset.status = "error"; console.error("multihead view: " + e); }
root.dispatchEvent(new CustomEvent("mh-drawn", { bubbles: true }));
})();"""


class _GridView(View):
    """A heatmap of per-head values: ``frames`` (see :class:`Frames`), a note under the title, more HTML
    after the grid (``extra``)."""

    frames: Frames
    note: str = ""
    extra: str = ""

    @property
    def scripted(self) -> bool:  # type: ignore[override]
        return self.frames.values.shape[0] > 1

    def body(self, uid: str) -> str:
        parts = [f'<div class="mhs-title">{html.escape(self.title)}</div>']
        if self.note:
            parts.append(f'<div class="mhs-note">{html.escape(self.note)}</div>')
        if self.scripted:
            parts.append(frames_script(uid, self.frames))
        return "".join(parts) + grid_svg(uid, self.frames) + self.extra

    def figure(self) -> Figure:
        from .plots import plot_attribution

        f = self.frames
        return plot_attribution(f.values[f.start], f.names, title=f"{self.title} ({f.labels[f.start]})")


def _names(names: Sequence[str] | None, n: int) -> list[str]:
    if names is None:
        return [f"module {i}" for i in range(n)]
    names = [str(m) for m in names]
    if len(names) != n:
        raise ValueError(
            f"names must name each of the {n} modules (the values' first dimension), got {len(names)} names; "
            f"pass the names the result was computed for (e.g. lens.cache's c.names() or heads.head_counts(model))"
        )
    return names


@renders(Tensor)
class TensorView(_GridView):
    """Per-head values (N, H) or (N, H, P) (``lens.patch_heads``, ``lens.attribution_patch``, per position with
    P): a layers x heads heatmap; P by a slider (``axis`` names it), opened on the position of the largest
    |value|. ``names``: the N module names (default ``module 0``, ...)."""

    def __init__(
        self,
        values: Tensor,
        *,
        names: Sequence[str] | None = None,
        title: str = "per-head effect",
        axis: str = "position",
    ) -> None:
        if values.dim() not in (2, 3) or values.is_complex():
            raise ValueError(
                f"viz.show draws a Tensor of per-head values (N, H) or (N, H, P), got shape {tuple(values.shape)}; "
                f"for attention weights (B, H, Lq, Lk) show the capture or lens cache instead"
            )
        v = values.detach().to("cpu", torch.float64)
        v = v[None] if v.dim() == 2 else v.permute(2, 0, 1)  # (F, N, H)
        labels = [f"{axis} {p}" for p in range(v.shape[0])] if values.dim() == 3 else ["all"]
        peak = v.nan_to_num(0).abs().flatten(1).amax(1)  # (F,)
        self.frames = Frames(
            v, labels, _names(names, v.shape[1]), int(peak.argmax()) if v.shape[0] > 1 else 0
        )
        self.title = title
        self.note = f"{v.shape[1]} modules x {v.shape[2]} heads" + (
            f", {v.shape[0]} {axis}s (slider)" if v.shape[0] > 1 else ""
        )


@renders(dict)
class ScoresView(_GridView):
    """``{module: (H,) scores}`` (``heads.importance``, ``heads.masking_drop``): the heatmap, one row per
    module; modules with fewer heads leave grey cells."""

    def __init__(self, scores: Mapping[str, Tensor], *, title: str = "head importance") -> None:
        if not scores or not all(isinstance(s, Tensor) and s.dim() == 1 for s in scores.values()):
            raise TypeError(
                "viz.show draws a dict as {module name: (H,) per-head scores} (heads.importance's result); "
                f"got {[(k, type(s).__name__) for k, s in list(scores.items())[:3]]}"
            )
        cols = max(s.numel() for s in scores.values())
        grid = torch.full((1, len(scores), cols), float("nan"), dtype=torch.float64)
        for i, s in enumerate(scores.values()):
            grid[0, i, : s.numel()] = s.detach().to("cpu", torch.float64)
        self.frames = Frames(grid, ["all"], [str(k) for k in scores])
        self.scores, self.title = scores, title
        self.note = f"{len(scores)} modules, {sum(s.numel() for s in scores.values())} heads"

    def figure(self) -> Figure:
        from .plots import plot_importance

        return plot_importance(self.scores, title=self.title)


def _table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    head = "".join(f"<th>{html.escape(str(c))}</th>" for c in header)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in r) + "</tr>" for r in rows)
    return f'<table class="mhs-t"><tr>{head}</tr>{body}</table>'


@renders("multihead.lens.attribution.Attribution")
class AttributionView(_GridView):
    """A ``lens.logit_attribution`` result: each head's direct share of the target logit (N, H), the mean over
    the examples first and each example by the slider; a table of each example's logit, heads' sum and rest."""

    def __init__(self, attribution: Any, *, title: str = "direct logit attribution") -> None:
        heads = attribution.heads.detach().to("cpu", torch.float64)  # (N, H, B)
        b = heads.shape[-1]
        frames = heads.permute(2, 0, 1)  # (B, N, H)
        labels = [f"example {i}" for i in range(b)]
        if b > 1:
            frames = torch.cat([frames.mean(0, keepdim=True), frames])
            labels = [f"mean over {b} examples", *labels]
        self.frames = Frames(frames, labels, list(attribution.names))
        self.title = title
        self.note = (
            f"{heads.shape[0]} modules x {heads.shape[1]} heads; each head's share of the target logit"
        )
        total = heads.sum((0, 1))
        rows = [
            (
                i,
                f"{float(attribution.logit[i]):.4g}",
                f"{float(total[i]):.4g}",
                f"{float(attribution.rest[i]):.4g}",
            )
            for i in range(b)
        ]
        self.extra = _table(["example", "target logit", "heads", "rest"], rows)


@renders(PruneResult)
class PruneView(_GridView):
    """A ``heads.prune_iteratively`` result: the heads it removed (dark) per module, and each step it tried."""

    def __init__(self, result: PruneResult, *, title: str = "pruned heads") -> None:
        from ..heads import head_counts

        counts = head_counts(result.model)
        names = list(dict.fromkeys([*result.pruned, *counts]))
        total = {n: counts.get(n, 0) + len(result.pruned.get(n, [])) for n in names}  # heads before pruning
        grid = torch.full((1, len(names), max(total.values())), float("nan"), dtype=torch.float64)
        for i, n in enumerate(names):
            grid[0, i, : total[n]] = 0.0
            grid[0, i, list(result.pruned.get(n, []))] = 1.0
        self.frames = Frames(grid, ["all"], names)
        self.title = title
        self.note = (
            f"{result.num_pruned} of {sum(total.values())} heads removed (dark); metric {result.baseline:.4g} -> "
            f"{result.metric:.4g}"
        )
        rows = [
            (s.removed, s.heads_left, f"{s.metric:.4g}", "kept" if s.accepted else "undone")
            for s in result.history
        ]
        self.extra = _table(["removed", "heads left", "metric", "step"], rows) if rows else ""
