"""Look at attention: capture per-head weights, plot them, and write a self-contained HTML report.

Dimensions: B batch, H heads, N attention modules (rows of a grid), Lq query length, Lk key length.

matplotlib is an optional extra (``pip install 'multihead[viz]'``): it is imported inside the plotting
functions only, always through ``matplotlib.figure.Figure`` (the Agg canvas; no pyplot, no display, no
global state). :func:`capture` (and :func:`stream`, which hands each call's weights over instead of
keeping them) needs nothing beyond torch.

In a notebook, :func:`show` draws a result inline, offline (:mod:`.show`): a capture, a lens cache, per-head
effects, importance scores, a circuit graph, a model's head view; Capture, lens.Cache, lens.Attribution and
lens.Graph display themselves through it.
"""

from . import heatmap, inline  # noqa: F401  (their views register with show)
from .capture import AttentionRecord, Capture, capture, stream
from .circuit import plot_circuit
from .plots import new_figure, plot_attention, plot_attribution, plot_importance
from .report import Panel, panels, write_report
from .show import View, show

__all__ = [
    "AttentionRecord",
    "Capture",
    "Panel",
    "capture",
    "new_figure",
    "panels",
    "View",
    "plot_attention",
    "plot_attribution",
    "plot_circuit",
    "plot_importance",
    "show",
    "stream",
    "write_report",
]
