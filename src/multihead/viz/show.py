"""Results that draw themselves in a notebook: :func:`show` and the :class:`View` each kind of result gets.

``viz.show(x, **labels)`` returns a :class:`View`: an object with ``_repr_html_`` (self-contained HTML: style,
data and script inline, no reference to any host) and ``_repr_png_`` (a matplotlib figure, the fallback where
HTML is not shown). Which view is picked by ``type(x)``: each view class registers the types it draws with
:func:`renders`, and :func:`show` walks ``type(x).__mro__`` to the first registered one. The lens's types
(``lens.Cache``, ``lens.Attribution``, ``lens.Graph``) are registered by their qualified names, as IPython's
``for_type_by_name`` does: those classes display themselves through :func:`show`, so viz must not import them.

Every ``_repr_html_`` call draws a new root ``<div class="mhs" id="mhv-...">`` with an id of its own, CSS
scoped under ``.mhs`` / ``.mhv`` and scripts that keep their state in a closure: several views (the same one
shown twice included) live in one notebook without clashing. The root's ``data-status`` is ``ready`` once the
view is drawn (at once for a static view; a scripted one sets it when its script has run), ``error`` if its
script failed. Where scripts do not run, what was drawn on the server (SVG, a PNG) stays visible.
"""

from __future__ import annotations

import html
import importlib.util
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from torch import Tensor

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["View", "diverging", "renders", "sequential", "short_name", "show", "view_class"]

V = TypeVar("V", bound="type[View]")

_VIEWS: dict[str, type[View]] = {}
"""``{"module.QualName" of a type: the view class that draws it}``."""


def _key(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def renders(*types: type | str) -> Callable[[V], V]:
    """Class decorator: the view draws objects of ``types`` (a type, or its ``"module.QualName"`` where
    importing the type here would make an import cycle)."""

    def register(view: V) -> V:
        for t in types:
            _VIEWS[t if isinstance(t, str) else _key(t)] = view
        return view

    return register


def view_class(x: object) -> type[View]:
    """The view class registered for ``type(x)`` or its nearest base class."""
    for cls in type(x).__mro__:
        found = _VIEWS.get(_key(cls))
        if found is not None:
            return found
    kinds = ", ".join(sorted(k.rsplit(".", 1)[-1] for k in _VIEWS))
    raise TypeError(
        f"viz.show cannot draw a {type(x).__name__}; it draws: {kinds} (a Tensor (N, H) or (N, H, P) of "
        f"per-head values with names=, a dict {{module: (H,) scores}}, or a model with its inputs)"
    )


def show(x: object, *args: Any, **labels: Any) -> View:
    """``x`` drawn for a notebook: the :class:`View` of its kind, built with ``args`` and ``labels``.

    What it draws (each class's docstring lists its labels):

    * a ``viz.capture`` result, a ``lens.Cache``: every head's pattern as the head view of ``multihead view``
      (thumbnails of every layer x head, token-to-token lines, a table of statistics), ``tokens=`` labelling
      the tokens (``source=``/``target=`` for an encoder-decoder); a Cache's other points as a table;
    * ``(model, inputs, tokens=...)``: the same head view of a run of ``model`` on ``inputs``;
    * a Tensor (N, H) or (N, H, P) of per-head values (``lens.patch_heads``, ``lens.attribution_patch``) with
      ``names=`` (the N modules): a layers x heads heatmap, values and names on hover, P by a slider;
    * a dict ``{module: (H,) scores}`` (``heads.importance``): the same heatmap;
    * a ``lens.Attribution``: each head's share of the target logit, by example;
    * a ``lens.Graph``: the circuit, writers and readers by layer, the top edges by score;
    * a ``heads.PruneResult``: which heads went, and each step tried.
    """
    return view_class(x)(x, *args, **labels)


class View:
    """A result drawn for a notebook. A subclass sets ``title`` and writes :meth:`body` (HTML, given the
    view's unique id, for ids and script lookups) and :meth:`figure` (a matplotlib figure)."""

    title: str = ""
    scripted: bool = False
    """True when :meth:`body` has a script that sets the root's ``data-status`` to ``ready`` (else the view
    is drawn on the server and is ready as it is)."""

    def body(self, uid: str) -> str:
        """The view's HTML inside its root (``uid`` is the root's id, new for every rendering)."""
        raise NotImplementedError

    def figure(self) -> Figure | None:
        """The view as a matplotlib figure (the ``viz`` extra); None where a table says it all."""
        raise NotImplementedError

    def _repr_html_(self) -> str:
        uid = f"mhv-{uuid.uuid4().hex[:12]}"
        status = "loading" if self.scripted else "ready"
        return (
            f'<div class="mhs" id="{uid}" data-mh-view="{type(self).__name__}" data-status="{status}">'
            f"<style>{STYLE}</style>{self.body(uid)}</div>"
        )

    def _repr_png_(self) -> bytes | None:
        """The PNG fallback; None (no picture, no error in the notebook) without the ``viz`` extra."""
        if importlib.util.find_spec("matplotlib") is None:
            return None
        from .plots import _png

        fig = self.figure()
        return None if fig is None else _png(fig)

    def save(self, path: str | Path) -> Path:
        """Write the view as a standalone HTML page (works offline, from ``file://``)."""
        out = Path(path)
        out.write_text(page([self]), encoding="utf-8")
        return out

    def __repr__(self) -> str:
        return f"<{type(self).__name__}: {self.title}>"


def page(views: Sequence[View], *, title: str = "multihead") -> str:
    """A standalone HTML page of ``views`` one under the other; its ``<body data-status>`` turns ``ready``
    once every view is drawn, ``error`` if one fails (what :func:`multihead.testing.render` reads)."""
    parts = "\n".join(v._repr_html_() for v in views)
    return (
        f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>'
        f'</head><body data-status="loading" style="margin:16px;background:#fff">\n{parts}\n'
        f"<script>{_PAGE_STATUS}</script></body></html>\n"
    )


_PAGE_STATUS = """(function () {
const views = () => Array.from(document.querySelectorAll("[data-mh-view]"));
function check() {
  const s = views().map((v) => v.dataset.status);
  if (s.includes("error")) document.body.dataset.status = "error";
  else if (s.every((x) => x === "ready")) {
    document.body.dataset.status = "ready"; document.body.dataset.ms = Math.round(performance.now());
  }
}
document.addEventListener("mh-drawn", check); check();
})();"""

STYLE = """
.mhs{font:13px/1.4 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;color:#1d2330;background:#fff;
 text-align:left;padding:8px 10px;border:1px solid #d9dde5;border-radius:6px;margin:4px 0;max-width:100%;
 overflow-x:auto}
.mhs .mhs-title{font-size:15px;font-weight:600;margin:0 0 4px}
.mhs .mhs-note{color:#5b6475;font-size:12px;margin:0 0 6px}
.mhs svg{display:block;max-width:none;height:auto}
.mhs svg text{font-family:system-ui,-apple-system,"Segoe UI",Roboto,sans-serif}
.mhs svg .cell:hover{stroke:#1d2330;stroke-width:1.5}
.mhs table.mhs-t{border-collapse:collapse;font-size:12px;font-variant-numeric:tabular-nums;margin:6px 0;
 table-layout:auto;color:#1d2330}
.mhs table.mhs-t th,.mhs table.mhs-t td{padding:2px 8px;border:0;border-bottom:1px solid #eceef2;
 text-align:right;white-space:nowrap;background:#fff}
.mhs table.mhs-t th{background:#f6f7f9;font-weight:600}
.mhs table.mhs-t td:first-child,.mhs table.mhs-t th:first-child{text-align:left}
.mhs [hidden]{display:none !important}
.mhs .mhs-ctl{display:flex;gap:10px;align-items:center;font-size:12px;margin:4px 0}
.mhs .mhs-ctl input{width:260px}
.mhs > .mhv{margin:-8px -10px;border-radius:6px;overflow:hidden}
.mhs .mhv .mh-main{padding-bottom:12px}
.mhs .mhv [data-p="models"]{max-height:440px;overflow-y:auto}  /* in a notebook: the head view stays near */
.mhs .mhv .hvbox,.mhs .mhv .tblbox{max-height:min(78vh,520px)}
"""
"""The CSS every view shares, every rule under ``.mhs``."""


# ------------------------------------------------------------------------------------------------
# Helpers the views share
# ------------------------------------------------------------------------------------------------


def short_name(name: str) -> str:
    """A module's name as a row label: its side (encoder/decoder), layer numbers and last part, as the
    page labels rows: ``"model.decoder.layers.3.encoder_attn"`` -> ``"decoder 3 encoder_attn"``."""
    parts = name.split(".")
    side = [p for p in parts[:-1] if p in ("encoder", "decoder")][:1]
    return " ".join(side + [p for p in parts if p.isdigit()] + [parts[-1]]) or "<model>"


def _hex(rgb: Tensor) -> list[str]:
    """(..., 3) floats in [0, 255] -> ``["#rrggbb", ...]`` flattened."""
    q = rgb.round().clamp(0, 255).to(torch.int64).reshape(-1, 3).tolist()
    return [f"#{r:02x}{g:02x}{b:02x}" for r, g, b in q]


def _ramp(t: Tensor, stops: Sequence[tuple[int, int, int]]) -> Tensor:
    """t in [0, 1] (any shape) -> (..., 3) colours linearly between ``stops`` (evenly spaced)."""
    s = torch.tensor(stops, dtype=torch.float64)  # (S, 3)
    x = t.double().nan_to_num(0.0).clamp(0, 1) * (len(stops) - 1)  # NaN: coloured by the caller
    i = x.floor().clamp(max=len(stops) - 2).long()
    f = (x - i)[..., None]
    return s[i] * (1 - f) + s[i + 1] * f


_RDBU = [(178, 24, 43), (239, 138, 98), (253, 219, 199), (247, 247, 247), (209, 229, 240), (103, 169, 207),
         (33, 102, 172)]  # fmt: skip
_BLUES = [(247, 251, 255), (198, 219, 239), (107, 174, 214), (33, 113, 181), (8, 48, 107)]
_NAN = "#e6e6e6"


def diverging(values: Tensor, top: float) -> list[str]:
    """Colours of ``values`` on a red (negative) - white (0) - blue (positive) scale, +-``top`` at the ends;
    NaN grey. Flattened, one ``"#rrggbb"`` per value."""
    v = values.double()
    out = _hex(_ramp((v / (top or 1.0) + 1) / 2, _RDBU))
    return [_NAN if bad else c for c, bad in zip(out, v.isnan().flatten().tolist())]


def sequential(values: Tensor, top: float) -> list[str]:
    """Colours of non-negative ``values`` from white (0) to dark blue (``top``); NaN grey. Flattened."""
    v = values.double()
    out = _hex(_ramp(v / (top or 1.0), _BLUES))
    return [_NAN if bad else c for c, bad in zip(out, v.isnan().flatten().tolist())]
