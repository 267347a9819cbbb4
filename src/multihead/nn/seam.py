"""A context-scoped hook into every ``MultiHeadAttention`` forward, for tools that look inside heads.

An :class:`Inspector` made active with :func:`inspecting` sees each attention module's per-head output
before the heads are merged (and may scale it: head gates for importance scores), and, if it asks for
them, the per-head weights. Nothing is stored on the modules: leaving the ``with`` block leaves no trace.

Dimensions: B batch, H heads, Lq/Lk lengths, Dv value head dim.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

from torch import Tensor, nn

_ACTIVE: ContextVar[Inspector | None] = ContextVar("multihead_inspector", default=None)


class Inspector:
    """Base class: override :meth:`on_heads`. ``wants_weights`` makes every module compute weights."""

    wants_weights: bool = False

    def on_heads(self, module: nn.Module, heads: Tensor, weights: Tensor | None) -> Tensor:
        """``heads`` (B, H, Lq, Dv) before merging, ``weights`` (B, H, Lq, Lk) or None; return heads."""
        return heads


def current() -> Inspector | None:
    """The active inspector, or None (the normal case: no overhead beyond this lookup)."""
    return _ACTIVE.get()


@contextmanager
def inspecting(inspector: Inspector) -> Iterator[Inspector]:
    """Make ``inspector`` active for the block (nested blocks stack and unwind)."""
    token = _ACTIVE.set(inspector)
    try:
        yield inspector
    finally:
        _ACTIVE.reset(token)
