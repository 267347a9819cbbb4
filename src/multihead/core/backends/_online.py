"""Online softmax (running max and denominator, flash-attention style) over the key spans of one block of
queries: the ``blocked`` backend's path where its spans are not joined by the fused kernel's log-sum-exp.

Dimensions: Bs batch rows, H query heads, Hkv kv heads, G = H // Hkv, n queries of one block, w keys of one
span, Dv value head dim.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["OnlineSoftmax"]


@dataclass
class OnlineSoftmax:
    """Running row max ``top`` (no gradient: the result does not depend on it), denominator ``total``
    and unnormalised output ``acc`` of one block of queries: (Bs, H, n, 1), (Bs, H, n, 1), (Bs, H, n, Dv)."""

    top: Tensor
    total: Tensor
    acc: Tensor

    @classmethod
    def start(cls, b: int, h: int, n: int, dv: int, like: Tensor, sinks: Tensor | None) -> OnlineSoftmax:
        acc = like.new_zeros(b, h, n, dv)
        if sinks is None:
            return cls(like.new_full((b, h, n, 1), float("-inf")), like.new_zeros(b, h, n, 1), acc)
        sink = sinks.to(like.dtype).view(1, h, 1, 1)  # (1, H, 1, 1)
        top = sink.detach()
        # a head with no sink (-inf): exp(-inf - 0) = 0, where exp(-inf - -inf) would be NaN
        shift = top.masked_fill(torch.isneginf(top), 0.0)
        total = torch.exp(sink - shift)  # exp(0) = 1 for a finite sink, with its gradient
        return cls(top.expand(b, h, n, 1), total.expand(b, h, n, 1), acc)

    def add(self, s: Tensor, v: Tensor, g: int, grad: bool) -> None:
        """Join the scores s (Bs, H, n, w) of one span with its values v (Bs, Hkv, w, Dv)."""
        b, h, n, w = s.shape
        with torch.no_grad():
            top = torch.maximum(self.top, s.amax(dim=-1, keepdim=True))  # (Bs, H, n, 1)
            shift = top.masked_fill(torch.isneginf(top), 0.0)  # rows with nothing allowed yet: exp(-inf) = 0
            alpha = torch.exp(self.top - shift)  # rescales what came before
        p = s.sub_(shift).exp_() if not grad else torch.exp(s - shift)  # (Bs, H, n, w)
        pv = torch.matmul(p.view(b, h // g, g * n, w), v).view(b, h, n, v.shape[-1])  # (Bs, H, n, Dv)
        if grad:
            self.total = self.total * alpha + p.sum(dim=-1, keepdim=True)
            self.acc = self.acc * alpha + pv
        else:
            self.total = self.total.mul(alpha).add_(p.sum(dim=-1, keepdim=True))
            self.acc = self.acc.mul_(alpha).add_(pv)
        self.top = top

    def finish(self) -> Tensor:
        """acc / total, 0 in rows that saw no key and no sink (Bs, H, n, Dv)."""
        return self.acc / self.total.masked_fill(self.total == 0, 1.0)
