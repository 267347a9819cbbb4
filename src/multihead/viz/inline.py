"""The head view of ``multihead view`` inline in a notebook: for a capture, a lens cache, or a model and inputs.

Dimensions: B batch, H heads, Lq/Lk query/key lengths.

The view is the page's (:mod:`.page`, :mod:`.assets`): the same data (each head's weights as uint8, deflated,
base64; 96 x 96 thumbnails), the same script (a head is inflated only when the head view shows it, and only
the rows scrolled into view are drawn), scoped to its own root so that several views share a notebook. Until
the script runs, a PNG of every head's thumbnail drawn here (:func:`~.picture.model_view_png`) stands in.

Tokens are labelled by sequence: ``tokens`` for a model's one sequence; an encoder-decoder's (a model with
``"decoder self"`` or ``"cross"`` attention) ``source`` (the encoder's) and ``target`` (the decoder's). Without
labels, tokens are numbered.
"""

from __future__ import annotations

import base64
import html
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from ..heads import attention_kind
from ..heads.naming import attention_modules, module_kind
from . import encoding
from .assets import SCRIPT, STYLE
from .capture import AttentionRecord, Capture, stream
from .encoding import EncodedModule
from .page import page_data, view_markup
from .picture import model_view_grid, model_view_png
from .show import View, renders, short_name

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["AttentionView", "CacheView", "CaptureView", "HeadView", "encode_run", "sides"]

_SIDES = {
    "encoder self": ("encoder", "encoder"),
    "decoder self": ("decoder", "decoder"),
    "cross": ("decoder", "encoder"),
}


def sides(kind: str, seq2seq: bool) -> tuple[str, str]:
    """The sequences a module of ``kind`` joins, (queries, keys): ``("input", "input")`` in a model of one
    sequence; in an encoder-decoder (``seq2seq``) ``"encoder"``/``"decoder"`` by kind."""
    return _SIDES.get(kind, ("encoder", "encoder")) if seq2seq else ("input", "input")


def _seq2seq(kinds: Sequence[str]) -> bool:
    return any(k in ("decoder self", "cross") for k in kinds)


def _labels(
    tokens: Sequence[str] | None, source: Sequence[str] | None, target: Sequence[str] | None
) -> dict[str, list[str]]:
    given = {"input": tokens, "encoder": source, "decoder": target}
    return {side: [str(t) for t in v] for side, v in given.items() if v is not None}


def _flags(special: Sequence[bool] | Mapping[str, Sequence[bool]] | None, side: str, n: int) -> list[bool]:
    """The special-token flags of one side (``special``: one sequence's flags, or ``{side: flags}``)."""
    got = special.get(side) if isinstance(special, Mapping) else special
    flags = [False] * n if got is None else [bool(b) for b in got]
    if len(flags) != n:
        raise ValueError(f"special must flag each of the {n} {side} tokens, got {len(flags)} flags")
    return flags


def _sequences(
    modules: Sequence[EncodedModule], labels: Mapping[str, list[str]]
) -> tuple[dict[str, list[str]], list[str]]:
    """Each side's token labels, checked against the lengths the modules saw; the unused labels' names."""
    lengths: dict[str, set[int]] = {}
    for m in modules:
        lengths.setdefault(m.queries, set()).add(m.shape[0])
        lengths.setdefault(m.keys, set()).add(m.shape[1])
    arg = {"input": "tokens", "encoder": "source", "decoder": "target"}
    out = {}
    for side, seen in lengths.items():
        if len(seen) > 1:
            raise ValueError(
                f"the modules' {side} lengths differ ({sorted(seen)}): show them one at a time (a capture of "
                f"one call each)"
            )
        (n,) = seen
        got = labels.get(side)
        if got is not None and len(got) != n:
            raise ValueError(
                f"{arg[side]} has {len(got)} labels but the weights have {n} {side} tokens; pass one label per "
                f"token the model saw"
            )
        out[side] = got if got is not None else [str(i) for i in range(n)]
    return out, [arg[s] for s in labels if s not in lengths]


class AttentionView(View):
    """Encoded attention modules as the page's head view, inline; figure: every head's thumbnail."""

    scripted = True

    def __init__(
        self,
        modules: Sequence[EncodedModule],
        labels: Mapping[str, list[str]],
        special: Sequence[bool] | Mapping[str, Sequence[bool]] | None,
        *,
        title: str,
        extra: str = "",
    ) -> None:
        sequences, unused = _sequences(modules, labels)
        if unused:
            raise ValueError(
                f"{', '.join(unused)} label no sequence of these modules (they see {list(sequences)})"
            )
        flags = {side: _flags(special, side, len(t)) for side, t in sequences.items()}
        lengths = ", ".join(f"{len(v)} {k} tokens" for k, v in sequences.items())
        facts = {"heads": f"{len(modules)} modules, {sum(m.heads for m in modules)} heads", "text": lengths}
        self.modules, self.title, self.extra = list(modules), title, extra
        self.data = page_data(self.modules, sequences, flags, title=title, facts=facts)

    def body(self, uid: str) -> str:
        png = base64.b64encode(model_view_png(self.modules)).decode("ascii")
        rows = ", ".join(short_name(m.name) for m in self.modules)
        fallback = (
            f'<div class="note">Every head (rows: {html.escape(rows)}; columns: heads). The interactive view '
            f'needs scripts, which this page does not run.</div><img alt="every head\'s attention" '
            f'src="data:image/png;base64,{png}">'
        )
        script = (
            f'(function () {{\n"use strict";\n{SCRIPT}\nconst outer = document.getElementById("{uid}"), '
            f'root = outer.querySelector(".mhv");\ntry {{ mhView(root, JSON.parse(root.querySelector(\'[data-p="data"]\')'
            f'.textContent), {{ status: outer }}); }}\ncatch (e) {{ outer.dataset.status = "error"; '
            f'console.error("multihead view: " + e); }}\n}})();'
        )
        markup = view_markup(self.data, fallback=fallback)
        return f'<style>{STYLE}</style><div class="mhv">{markup}</div>{self.extra}<script>{script}</script>'

    def figure(self) -> Figure:
        from .plots import new_figure

        grid = model_view_grid(self.modules)
        n, cols = len(self.modules), max(m.heads for m in self.modules)
        fig = new_figure(figsize=(1.8 + 0.5 * cols, 0.8 + 0.45 * n), layout="constrained")
        ax = fig.subplots()
        ax.imshow(grid.numpy(), cmap="Blues", vmin=0, vmax=1, interpolation="nearest")
        ax.set_xticks([(h + 0.5) * grid.shape[1] / cols for h in range(cols)], [f"{h}" for h in range(cols)])
        ax.set_yticks(
            [(i + 0.5) * grid.shape[0] / n for i in range(n)], [short_name(m.name) for m in self.modules]
        )
        ax.tick_params(length=0, labelsize=7)
        ax.set_xlabel("head", fontsize=8)
        for spine in ax.spines.values():
            spine.set_visible(False)
        ax.set_title(self.title, fontsize=10)
        return fig


def _encode(name: str, kind: str, w: Tensor, seq2seq: bool, special: Any) -> EncodedModule:
    """One module's weights (H, Lq, Lk) encoded for the view, its sequences by kind."""
    q, k = sides(kind, seq2seq)
    return encoding.encode_module(name, kind, w, q, k, _flags(special, k, w.shape[-1]))


def _example(w: Tensor, example: int, name: str) -> Tensor:
    if not -w.shape[0] <= example < w.shape[0]:
        raise ValueError(f"example must index the batch of {w.shape[0]} ({name}), got {example}")
    return w[example]  # (H, Lq, Lk)


@renders(Capture)
class CaptureView(AttentionView):
    """A ``viz.capture`` result: every module's weights of example ``example`` as the head view. Labels:
    ``tokens`` (or ``source``/``target`` for an encoder-decoder), ``special`` (flags of special tokens)."""

    def __init__(
        self,
        capture: Capture,
        *,
        tokens: Sequence[str] | None = None,
        source: Sequence[str] | None = None,
        target: Sequence[str] | None = None,
        special: Sequence[bool] | Mapping[str, Sequence[bool]] | None = None,
        example: int = 0,
        title: str = "attention",
    ) -> None:
        names = capture.names()
        if not names:
            raise ValueError("the capture is empty: run the model inside `with viz.capture(model) as cap:`")
        s2s = _seq2seq([capture.kind(n) for n in names])
        modules = [
            _encode(n, capture.kind(n), _example(capture.get(n), example, n), s2s, special) for n in names
        ]
        super().__init__(modules, _labels(tokens, source, target), special, title=title)


@renders("multihead.lens.cache.Cache")
class CacheView(View):
    """A ``lens.cache`` result: its ``"pattern"`` point, where cached, as the head view (labels as
    :class:`CaptureView`), and every point it holds in a table (shape, dtype, calls, mean |x|)."""

    def __init__(
        self,
        cache: Any,
        *,
        tokens: Sequence[str] | None = None,
        source: Sequence[str] | None = None,
        target: Sequence[str] | None = None,
        special: Sequence[bool] | Mapping[str, Sequence[bool]] | None = None,
        example: int = 0,
        title: str = "lens cache",
    ) -> None:
        names = [n for n in cache.names() if (n, "pattern") in cache]
        kinds = [attention_kind(n) for n in names]
        s2s = _seq2seq(kinds)
        modules = [
            _encode(n, k, _example(cache[n, "pattern"], example, n).float(), s2s, special)
            for n, k in zip(names, kinds)
        ]
        labels = _labels(tokens, source, target)
        self.heads = AttentionView(modules, labels, special, title=title) if modules else None
        self.title, self.table = title, _points_table(cache)
        self.scripted = self.heads is not None

    def body(self, uid: str) -> str:
        if self.heads is None:
            return f'<div class="mhs-title">{html.escape(self.title)}</div>{self.table}'
        return self.heads.body(uid) + f'<div style="padding:8px 14px">{self.table}</div>'

    def figure(self) -> Figure | None:
        return None if self.heads is None else self.heads.figure()


def _points_table(cache: Any) -> str:
    rows = []
    for name, point in cache.keys():
        t = cache[name, point]
        mean = float(t.detach().float().nan_to_num(0, posinf=0, neginf=0).abs().mean()) if t.numel() else 0.0
        calls = len(cache.calls(name, point))
        rows.append(
            (name, point, str(tuple(t.shape)), str(t.dtype).removeprefix("torch."), calls, f"{mean:.4g}")
        )
    head = "".join(f"<th>{c}</th>" for c in ("module", "point", "shape", "dtype", "calls", "mean |x|"))
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in r) + "</tr>" for r in rows)
    return (
        f'<div class="mhs-note" style="margin-top:14px">Every point cached ({cache.nbytes() / 2**20:.2f} MiB)'
        f'</div><table class="mhs-t"><tr>{head}</tr>{body}</table>'
    )


def encode_run(
    model: nn.Module, inputs: Any, *, special: Any = None, example: int = 0
) -> list[EncodedModule]:
    """Run ``model`` on ``inputs`` (a dict of keyword inputs, or one positional input) inside
    :func:`~multihead.viz.stream`, without gradients: each module's weights of example ``example`` are
    encoded for the view as soon as it has run and dropped, so only one module's float weights are held."""
    kinds = [module_kind(n, m) for n, m in attention_modules(model).items()]
    s2s, out = _seq2seq(kinds), {}

    def encode(record: AttentionRecord) -> None:
        if record.name in out:
            raise ValueError(f"{record.name} ran twice in one forward; the view shows one call per module")
        w = _example(record.weights, example, record.name)
        out[record.name] = _encode(record.name, record.kind, w, s2s, special)

    with torch.no_grad(), stream(model, encode):
        model(**inputs) if isinstance(inputs, Mapping) else model(inputs)
    if not out:
        raise ValueError(f"no attention module of {type(model).__name__} ran on multihead: nothing to show")
    return list(out.values())


@renders(nn.Module)
class HeadView(AttentionView):
    """``viz.show(model, inputs, tokens=...)``: the head view of ``multihead view`` for one run of ``model`` on
    ``inputs`` (a dict of keyword inputs, or one input tensor), labels as :class:`CaptureView`."""

    def __init__(
        self,
        model: nn.Module,
        inputs: Any,
        *,
        tokens: Sequence[str] | None = None,
        source: Sequence[str] | None = None,
        target: Sequence[str] | None = None,
        special: Sequence[bool] | Mapping[str, Sequence[bool]] | None = None,
        example: int = 0,
        title: str | None = None,
    ) -> None:
        modules = encode_run(model, inputs, special=special, example=example)
        title = f"{type(model).__name__}: every head" if title is None else title
        super().__init__(modules, _labels(tokens, source, target), special, title=title)
