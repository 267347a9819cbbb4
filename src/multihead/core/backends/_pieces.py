"""Pieces of q, k or v along the sequence for the ``blocked`` backend's loop, with one gradient buffer.

Dimensions: B batch, H heads, L length, D head dim; a piece is ``t[:, :, a:b]`` (B, H, b - a, D).

Under autograd, slicing ``t[:, :, a:b]`` once per block of queries and once per key span costs, in the
backward pass, a zero-filled tensor of ``t``'s whole size for every slice (``slice_backward``) and an add of
each into ``t``'s gradient. At L = 4,096 (H = 8, D = 64, 16 blocks) that is 48 fills of 8 MiB and 45 adds
per training step: a third of the causal-window step's CPU time (torch.profiler, AMD EPYC Zen 4), and fresh
pages each time (page faults, the part a busy machine slows most). :func:`pieces` hands out the same views;
its backward adds every piece's gradient into one buffer of ``t``'s size.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor

__all__ = ["pieces"]


class _Pieces(torch.autograd.Function):
    """``t`` -> its pieces ``t[:, :, a:b]`` for every (a, b) of ``bounds`` (views); the backward writes their
    gradients into one zero-filled tensor of ``t``'s shape (overlapping pieces add up)."""

    @staticmethod
    def forward(ctx: Any, t: Tensor, bounds: tuple[tuple[int, int], ...]) -> tuple[Tensor, ...]:  # type: ignore[override]
        ctx.bounds, ctx.shape = bounds, t.shape
        ctx.set_materialize_grads(False)  # a piece nothing used sends None, not a zero tensor
        return tuple(t.narrow(2, a, b - a) for a, b in bounds)  # (B, H, b - a, D) each

    @staticmethod
    def backward(ctx: Any, *grads: Tensor | None) -> tuple[Tensor | None, None]:  # type: ignore[override]
        total: Tensor | None = None
        for (a, b), g in zip(ctx.bounds, grads, strict=True):
            if g is None:
                continue
            if total is None:
                total = g.new_zeros(ctx.shape)  # (B, H, L, D)
            total.narrow(2, a, b - a).add_(g)
        return total, None


def pieces(t: Tensor, bounds: Iterable[tuple[int, int]]) -> dict[tuple[int, int], Tensor]:
    """{(a, b): t[:, :, a:b]} for t (B, H, L, D): plain views where no gradient flows to ``t``, else views
    whose backward shares one gradient buffer (see the module docstring)."""
    keys = tuple(dict.fromkeys(bounds))  # distinct, in order
    if not (torch.is_grad_enabled() and t.requires_grad) or len(keys) < 2:
        return {(a, b): t[:, :, a:b] for a, b in keys}
    return dict(zip(keys, _Pieces.apply(t, keys), strict=True))
