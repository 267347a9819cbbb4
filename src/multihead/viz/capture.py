"""Record every attention module's per-head weights inside a ``with`` block.

Dimensions: B batch, H heads, Lq query length, Lk key length.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from ..heads.naming import attention_modules, check_routed, module_kind
from ..nn import seam

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

    def add(self, record: AttentionRecord) -> None:
        """Append one call's record (a Python method, not ``records.append``: torch.compile before 2.9 cannot
        call a builtin method held as an attribute)."""
        self.records.append(record)

    def names(self, kind: str | None = None) -> list[str]:
        """Modules that ran (optionally of one ``kind``), in the order they first ran."""
        return list(dict.fromkeys(r.name for r in self.records if kind is None or r.kind == kind))

    def kind(self, name: str) -> str:
        """``"encoder self"``, ``"decoder self"``, ``"cross"`` or ``"self"`` for a captured module."""
        for r in self.records:
            if r.name == name:
                return r.kind
        raise KeyError(f"no attention weights captured for {name!r}; captured: {self.names()}")

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

    def _repr_html_(self) -> str | None:
        """Drawn in a notebook by :func:`multihead.viz.show` (nothing to draw while empty)."""
        from .show import show

        return show(self)._repr_html_() if self.records else None

    def _repr_png_(self) -> bytes | None:
        from .show import show

        return show(self)._repr_png_() if self.records else None


class _Recorder(seam.Inspector):
    """Hands each call's weights, as an :class:`AttentionRecord`, to ``sink``; ``own``: a CPU copy."""

    wants_weights = True

    def __init__(self, model: nn.Module, sink: Callable[[AttentionRecord], None], *, own: bool) -> None:
        self.names = {m: name for name, m in attention_modules(model).items()}
        self.kinds = {m: module_kind(name, m) for m, name in self.names.items()}
        self.sink, self.own = sink, own

    def on_heads(self, module: nn.Module, heads: Tensor, weights: Tensor | None) -> Tensor:
        name = self.names.get(module)
        if name is not None and weights is not None:
            w = weights.detach()  # (B, H, Lq, Lk), no graph
            if self.own:
                w = w.to("cpu", copy=True)  # no shared storage: the capture owns it
            self.sink(AttentionRecord(name, self.kinds[module], w))
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
    A capture composes with every other inspector (:mod:`multihead.nn.seam`): inside
    ``heads.masked(...)`` it records the masked model's weights, and nested captures each record.
    """
    check_routed(model)
    out = Capture()
    with seam.inspecting(_Recorder(model, out.add, own=True)):
        yield out


@contextmanager
def stream(model: nn.Module, fn: Callable[[AttentionRecord], None]) -> Iterator[None]:
    """Call ``fn(record)`` with each attention call's weights (B, H, Lq, Lk) as the module runs; keep nothing.

    What :func:`capture` records, handed over one call at a time instead of held: ``fn`` turns the weights
    into what it needs (statistics, a compact encoding) and drops them, so a long text on a deep model
    never holds every module's weights at once. ``record.weights`` is detached but not copied: it lies on
    the device the attention ran on and is the tensor the module computed (do not modify it in place)::

        sums = {}
        with torch.no_grad(), viz.stream(model, lambda r: sums.update({r.name: r.weights.sum()})):
            model(x)
    """
    check_routed(model)
    with seam.inspecting(_Recorder(model, fn, own=False)):
        yield
