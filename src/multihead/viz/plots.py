"""Attention and importance plots (matplotlib, the ``viz`` extra, imported inside the functions).

Dimensions: B batch, H heads, N attention modules (rows of a grid), Lq query length, Lk key length.
"""

from __future__ import annotations

import io
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from ..heads import attention_kind

if TYPE_CHECKING:
    from matplotlib.figure import Figure


# ------------------------------------------------------------------------------------------------
# Plots
# ------------------------------------------------------------------------------------------------


def new_figure(**kwargs: object) -> Figure:
    """A matplotlib ``Figure`` on the Agg canvas (no pyplot, no display); kwargs go to ``Figure``."""
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
    fig = new_figure(figsize=(cols * pw + 1.8, n * ph + (0.8 if title else 0.4)), layout="constrained")
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


def _heads_heatmap(
    fig: Figure, ax: object, grid: Tensor, labels: Sequence[str], *, cmap: str, signed: bool, text: bool
) -> None:
    """Draw (N, H) per-head values (NaN: no such head, grey) on ``ax``: one row per module, one column per
    head, a colour bar; ``signed``: the scale is symmetric around 0; ``text``: values written in the cells."""
    import numpy as np
    from matplotlib import colormaps

    finite = grid[~grid.isnan()]
    top = float(finite.abs().max()) if finite.numel() else 1.0
    low, high = (-top, top) if signed else (float(finite.min()) if finite.numel() else 0.0, top)
    image = ax.imshow(  # type: ignore[attr-defined]
        np.ma.masked_invalid(grid.numpy()), cmap=colormaps[cmap].with_extremes(bad="#dddddd"), aspect="auto",
        vmin=low, vmax=high or 1.0,
    )  # fmt: skip
    n, cols = grid.shape
    if text:
        for i in range(n):
            for j in range(cols):
                v = float(grid[i, j])
                if v == v:  # not NaN
                    dark = abs(v) > 0.6 * top if signed else v < (low + high) / 2
                    ax.text(
                        j, i, f"{v:.2f}", ha="center", va="center", fontsize=7, color="w" if dark else "k"
                    )  # type: ignore[attr-defined]
    ax.set_xticks(range(cols), [f"head {j}" for j in range(cols)], fontsize=8)  # type: ignore[attr-defined]
    ax.set_yticks(range(n), list(labels), fontsize=7)  # type: ignore[attr-defined]
    fig.colorbar(image, ax=ax, shrink=0.8)


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
    fig = new_figure(figsize=(1.6 + 0.75 * cols + 0.06 * max(map(len, names)), 0.9 + 0.4 * len(names)))
    fig.set_layout_engine("constrained")
    ax = fig.subplots()
    labels = [f"{n} ({attention_kind(n)})" for n in names]
    _heads_heatmap(fig, ax, grid, labels, cmap=cmap, signed=False, text=True)
    ax.set_title(title, fontsize=10)
    _save(fig, path, dpi)
    return fig


def plot_attribution(
    effects: Tensor,
    names: Sequence[str] | None = None,
    *,
    title: str = "per-head effect",
    path: str | Path | None = None,
    cmap: str = "RdBu",
    dpi: int = 100,
    panels: int = 12,
) -> Figure:
    """A heatmap of signed per-head values, red negative, blue positive, the scale symmetric around 0.

    Args:
        effects: (N, H) (``lens.patch_heads``, ``lens.attribution_patch``, a ``lens.Attribution``'s
            ``heads.mean(-1)``) or (N, H, P) per position: then one panel per position, at most ``panels``
            of them (the positions of the largest |value|, in order).
        names: the N module names (default ``module 0``, ...).
        title: the figure's title.
        path: if given, the PNG is written there.

    Returns:
        The ``matplotlib.figure.Figure`` (Agg canvas; no window is opened).
    """
    if not isinstance(effects, Tensor) or effects.dim() not in (2, 3):
        shape = tuple(effects.shape) if isinstance(effects, Tensor) else type(effects).__name__
        raise ValueError(f"effects must be a Tensor (N, H) or (N, H, P), got {shape}")
    e = effects.detach().to("cpu", torch.float64)
    e = e[..., None] if e.dim() == 2 else e  # (N, H, P)
    n, h, p = e.shape
    labels = [str(x) for x in names] if names is not None else [f"module {i}" for i in range(n)]
    if len(labels) != n:
        raise ValueError(
            f"names must name each of the {n} modules (effects' first dimension), got {len(labels)}"
        )
    shown = e.nan_to_num(0).abs().flatten(0, 1).amax(0).topk(min(p, panels)).indices.sort().values.tolist()
    width = 1.6 + 0.55 * h + 0.06 * max(map(len, labels))
    fig = new_figure(figsize=(width * len(shown), 0.9 + 0.3 * n), layout="constrained")
    axes = fig.subplots(1, len(shown), squeeze=False)[0]
    for ax, pos in zip(axes, shown):
        _heads_heatmap(fig, ax, e[..., pos], labels, cmap=cmap, signed=True, text=n * h <= 400)
        if p > 1:
            ax.set_title(f"position {pos}", fontsize=9)
    fig.suptitle(title, fontsize=10)
    _save(fig, path, dpi)
    return fig
