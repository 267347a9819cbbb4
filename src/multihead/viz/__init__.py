"""Look at attention: capture per-head weights, plot them, and write a self-contained HTML report.

Dimensions: B batch, H heads, N attention modules (rows of a grid), Lq query length, Lk key length.

matplotlib is an optional extra (``pip install 'multihead[viz]'``): it is imported inside the plotting
functions only, always through ``matplotlib.figure.Figure`` (the Agg canvas; no pyplot, no display, no
global state). :func:`capture` (and :func:`stream`, which hands each call's weights over instead of
keeping them) needs nothing beyond torch.
"""

from .capture import AttentionRecord, Capture, capture, stream
from .plots import new_figure, plot_attention, plot_importance
from .report import Panel, panels, write_report

__all__ = [
    "AttentionRecord",
    "Capture",
    "Panel",
    "capture",
    "new_figure",
    "panels",
    "plot_attention",
    "plot_importance",
    "stream",
    "write_report",
]
