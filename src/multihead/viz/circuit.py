"""A circuit (``lens.edge_attribution``'s graph) drawn: its top edges between writers and readers, by layer.

Dimensions: W writers, R readers (of the graph), K edges drawn.

The picture is laid out once (:func:`circuit_layout`) and drawn twice: as inline SVG for a notebook
(:class:`GraphView`, no script) and as a matplotlib figure (:func:`plot_circuit`). Columns are the modules in
model order (the order the graph lists its writers, the output embedding last), so edges run left to right;
a column stacks the nodes of that module that the top edges touch: an attention module's heads (each head's
output, and the query, key and value inputs it reads), an MLP, the embedding, the logits. An edge's width is
its |score| over the largest drawn, its colour its sign (blue raises the metric, red lowers it), its dash the
input it reaches (query solid, key dashed, value dotted). The graph is read through its documented attributes
(``writers``, ``readers``: lists of ``lens.Node``; ``scores`` (W, R); ``top(k)``), so any object of that shape
draws.
"""

from __future__ import annotations

import html
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .show import View, renders, short_name

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["Circuit", "GraphView", "circuit_layout", "plot_circuit"]

_DASH = {"k": "5 3", "v": "1.5 2.5"}  # the reader's input: query (and mlp, logits) solid


@dataclass(frozen=True)
class Circuit:
    """A laid-out circuit: ``nodes`` (label, tooltip, column, row), ``edges`` (writer node, reader node, score,
    reader kind, tooltip), ``columns`` (one title per column) and ``rows`` (the tallest column's nodes)."""

    nodes: list[tuple[str, str, int, int]]
    edges: list[tuple[int, int, float, str, str]]
    columns: list[str]
    rows: int


def _visual(node: Any, merged: set[str]) -> tuple[str, str, int]:
    """The box a graph node is drawn in: (module, part, index). A head's output and its query input share
    one box ("h5"); its key and value inputs too where the module has as many key heads as query heads (no
    GQA), else a key/value head gets its own ("kv1"); an MLP's output and input share one."""
    kind, head = node.kind, -1 if node.head is None else node.head
    if kind in ("head", "q") or (kind in ("k", "v") and node.name in merged):
        return (node.name, "h", head)
    if kind in ("k", "v"):
        return (node.name, "kv", head)
    return (node.name, kind, head)


def _label(part: str, index: int) -> str:
    return {"h": f"H{index}", "kv": f"KV{index}", "embed": "embed", "mlp": "MLP", "logits": "logits"}.get(
        part, part
    )


def circuit_layout(graph: Any, top: int = 30) -> Circuit:
    """Lay out ``graph.top(top)``: its nodes in columns (modules in model order), its edges by score."""
    edges = [e for e in graph.top(top) if e[2] != 0]  # past the graph's edges, top() pads with zeros
    q_heads: dict[str, set[int]] = {}
    kv_heads: dict[str, set[int]] = {}
    for r in graph.readers:
        (q_heads if r.kind == "q" else kv_heads if r.kind == "k" else {}).setdefault(r.name, set()).add(
            r.head
        )
    merged = {n for n in q_heads if len(kv_heads.get(n, ())) == len(q_heads[n])}
    order = list(dict.fromkeys([w.name for w in graph.writers] + [r.name for r in graph.readers]))
    effects = {w: float(s) for w, s in zip(graph.writers, graph.scores.sum(1).tolist())}
    boxes: dict[tuple[str, str, int], list[str]] = {}
    for w, r, _ in edges:
        for node in (w, r):
            tip = f"{node.name or '<model>'} {node.kind}" + ("" if node.head is None else f" {node.head}")
            if node in effects:
                tip += f" (node effect {effects[node]:+.4g})"
            boxes.setdefault(_visual(node, merged), []).append(tip)
    names = sorted({b[0] for b in boxes}, key=order.index)
    parts = {"embed": 0, "h": 1, "kv": 2, "mlp": 3, "logits": 4}
    nodes, index = [], {}
    for col, name in enumerate(names):
        mine = sorted((b for b in boxes if b[0] == name), key=lambda b: (parts.get(b[1], 5), b[2]))
        for row, b in enumerate(mine):
            index[b] = len(nodes)
            nodes.append((_label(b[1], b[2]), "\n".join(dict.fromkeys(boxes[b])), col, row))
    drawn = [
        (index[_visual(w, merged)], index[_visual(r, merged)], s, r.kind, f"{w} -> {r}: {s:+.4g}")
        for w, r, s in edges
    ]
    columns = [_column_title(n, boxes) for n in names]
    rows = max((n[3] for n in nodes), default=-1) + 1
    return Circuit(nodes, drawn, columns, rows)


def _column_title(name: str, boxes: dict[tuple[str, str, int], list[str]]) -> str:
    parts = {b[1] for b in boxes if b[0] == name}
    if parts <= {"embed"}:
        return "embed"
    if parts <= {"logits"}:
        return "logits"
    return short_name(name)


COL_W, BOX_W, BOX_H, ROW_H, TOP = 132, 64, 22, 32, 34


def _xy(node: tuple[str, str, int, int]) -> tuple[float, float]:
    return 12 + node[2] * COL_W, TOP + node[3] * ROW_H


def circuit_svg(c: Circuit) -> str:
    """The laid-out circuit as inline SVG (tooltips on nodes and edges)."""
    if not c.edges:
        return '<div class="mhs-note">(no edge with a non-zero score)</div>'
    width, height = 24 + len(c.columns) * COL_W - (COL_W - BOX_W), TOP + c.rows * ROW_H + 4
    out = [f'<svg width="{width}" height="{height}" font-size="11">']
    for i, title in enumerate(c.columns):
        out.append(
            f'<text x="{12 + i * COL_W + BOX_W / 2}" y="14" text-anchor="middle" fill="#5b6475">'
            f"{html.escape(title)}</text>"
        )
    peak = max((abs(e[2]) for e in c.edges), default=1.0) or 1.0
    for w, r, s, kind, tip in sorted(c.edges, key=lambda e: abs(e[2])):  # the strongest on top
        (x0, y0), (x1, y1) = _xy(c.nodes[w]), _xy(c.nodes[r])
        x0, y0, y1 = x0 + BOX_W, y0 + BOX_H / 2, y1 + BOX_H / 2
        dx = max(30.0, (x1 - x0) / 2)
        dash = f' stroke-dasharray="{_DASH[kind]}"' if kind in _DASH else ""
        out.append(
            f'<path d="M{x0},{y0} C{x0 + dx},{y0} {x1 - dx},{y1} {x1},{y1}" fill="none" '
            f'stroke="{"#2166ac" if s >= 0 else "#b2182b"}" stroke-width="{0.8 + 5 * abs(s) / peak:.2f}" '
            f'stroke-opacity="0.7"{dash}><title>{html.escape(tip)}</title></path>'
        )
    for label, tip, col, row in c.nodes:
        x, y = _xy((label, tip, col, row))
        out.append(
            f'<g><title>{html.escape(tip)}</title><rect x="{x}" y="{y}" width="{BOX_W}" height="{BOX_H}" rx="4" '
            f'fill="#f6f7f9" stroke="#5b6475"/><text x="{x + BOX_W / 2}" y="{y + 15}" text-anchor="middle" '
            f'fill="#1d2330">{html.escape(label)}</text></g>'
        )
    return "".join(out) + "</svg>"


@renders("multihead.lens.graph.Graph")
class GraphView(View):
    """A ``lens.edge_attribution`` graph: its ``top`` edges by |score| drawn between writers and readers by
    layer (inline SVG, tooltips on every node and edge), and the same edges in a table."""

    def __init__(self, graph: Any, *, top: int = 30, title: str = "circuit") -> None:
        if not isinstance(top, int) or isinstance(top, bool) or top < 1:
            raise ValueError(f"top must be a positive int (how many edges to draw), got {top!r}")
        self.graph, self.top, self.title = graph, top, title
        self.layout = circuit_layout(graph, top)

    def body(self, uid: str) -> str:
        g = self.graph
        metric = ""
        if getattr(g, "metric_clean", None) is not None and getattr(g, "metric_corrupted", None) is not None:
            metric = f"; metric clean {g.metric_clean:.4g}, corrupted {g.metric_corrupted:.4g}"
        note = (
            f"the {len(self.layout.edges)} edges of largest |score| of {len(g.writers)} writers x "
            f"{len(g.readers)} readers{metric}. Blue raises the metric, red lowers it; width = |score|; "
            "into a query solid, a key dashed, a value dotted."
        )
        rows = "".join(
            f"<tr><td>{html.escape(str(w))}</td><td>{html.escape(str(r))}</td><td>{s:+.4g}</td></tr>"
            for w, r, s in g.top(self.top)
        )
        table = (
            f'<details><summary class="mhs-note">the {len(self.layout.edges)} edges</summary><table class="mhs-t">'
            f"<tr><th>writer</th><th>reader</th><th>score</th></tr>{rows}</table></details>"
        )
        return (
            f'<div class="mhs-title">{html.escape(self.title)}</div><div class="mhs-note">{html.escape(note)}</div>'
            + circuit_svg(self.layout)
            + table
        )

    def figure(self) -> Figure:
        return plot_circuit(self.graph, top=self.top, title=self.title)


def plot_circuit(
    graph: Any, *, top: int = 30, title: str = "circuit", path: str | Path | None = None, dpi: int = 100
) -> Figure:
    """The ``top`` edges of a ``lens.edge_attribution`` graph as a matplotlib figure, laid out as the inline
    view (:func:`circuit_layout`): modules in columns, edges blue (+) or red (-), width = |score|.

    Returns:
        The ``matplotlib.figure.Figure`` (Agg canvas; no window is opened); written to ``path`` as PNG if given.
    """
    from matplotlib.patches import FancyBboxPatch, PathPatch
    from matplotlib.path import Path as MPath

    from .plots import _save, new_figure

    c = circuit_layout(graph, top)
    fig = new_figure(figsize=(1.0 + 1.45 * len(c.columns), 1.0 + 0.42 * max(c.rows, 1)), layout="constrained")
    ax = fig.subplots()
    peak = max((abs(e[2]) for e in c.edges), default=1.0) or 1.0
    styles = {"k": (0, (4, 2)), "v": (0, (1, 2))}
    for w, r, s, kind, _ in sorted(c.edges, key=lambda e: abs(e[2])):
        (x0, y0), (x1, y1) = (c.nodes[w][2] + 0.5, c.nodes[w][3]), (c.nodes[r][2], c.nodes[r][3])
        dx = max(0.25, (x1 - x0) / 2)
        verts = [(x0, y0), (x0 + dx, y0), (x1 - dx, y1), (x1, y1)]
        curve = MPath(verts, [MPath.MOVETO, MPath.CURVE4, MPath.CURVE4, MPath.CURVE4])
        ax.add_patch(
            PathPatch(curve, fill=False, alpha=0.7, lw=0.6 + 4 * abs(s) / peak, ls=styles.get(kind, "-"),
                      edgecolor="#2166ac" if s >= 0 else "#b2182b")
        )  # fmt: skip
    for label, _, col, row in c.nodes:
        ax.add_patch(
            FancyBboxPatch((col, row - 0.3), 0.5, 0.6, boxstyle="round,pad=0.02", fc="#f6f7f9", ec="#5b6475")
        )
        ax.text(col + 0.25, row, label, ha="center", va="center", fontsize=7)
    ax.set_xticks([i + 0.25 for i in range(len(c.columns))], c.columns, fontsize=7, rotation=30, ha="left")
    ax.xaxis.tick_top()
    ax.set_xlim(-0.2, len(c.columns) - 0.3)
    ax.set_ylim(max(c.rows, 1) - 0.4, -0.6)
    ax.set_yticks([])
    for spine in ax.spines.values():
        spine.set_visible(False)
    ax.set_title(title, fontsize=10)
    _save(fig, path, dpi)
    return fig
