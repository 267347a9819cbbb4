"""The ``math`` backend: explicit scores, softmax and a second matmul. Serves every call.

It is the backend that returns per-head weights: the output is computed from the same softmax in the
same pass, so ``return_weights=True`` costs one extra (B, H, Lq, Lk) tensor and nothing else.

Dimensions: B batch, H heads, Hkv kv heads, G = H // Hkv, Lq/Lk lengths, Dk/Dv head dims.

Equals, in plain PyTorch (with K/V repeated G times for grouped-query attention)::

    w = softmax((q * scale) @ k.transpose(-2, -1) + bias masked with -inf where not mask, dim=-1)
    out = dropout(w) @ v
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ..masks import causal
from . import AttentionCall
from ._common import group_mask, group_queries, ungroup, zero_dead_rows


class MathBackend:
    name = "math"

    def why_not(self, call: AttentionCall) -> list[str]:
        return []

    def __call__(self, call: AttentionCall) -> tuple[Tensor, Tensor | None]:
        q, k, v, m = call.q, call.k, call.v, call.masks
        h, hkv, lq, lk = q.shape[1], k.shape[1], q.shape[2], k.shape[2]
        # Scaling q (B*H*Lq*Dk products) is cheaper than scaling the scores (B*H*Lq*Lk), and its
        # contiguous result makes the grouping below a view.
        qg = group_queries(q * call.scale, hkv)  # (B, Hkv, G*Lq, Dk)
        scores = torch.matmul(qg, k.transpose(-2, -1))  # (B, Hkv, G*Lq, Lk), a fresh tensor
        bias = group_mask(m.bias, h, hkv, lq)
        if bias is not None:
            scores = scores.add_(bias)  # in place: matmul's backward does not need its output
        keep = m.mask
        if m.causal:  # only when Lq == Lk and nothing else masks
            keep = causal(lq, lk, device=q.device).view(1, 1, lq, lk)  # (1, 1, Lq, Lk)
        keep = group_mask(keep, h, hkv, lq)
        if keep is not None:
            scores = scores.masked_fill_(~keep, float("-inf"))
        weights = torch.softmax(scores, dim=-1)  # (B, Hkv, G*Lq, Lk)
        del scores  # the one (B, H, Lq, Lk) tensor alive from here on is `weights`
        dropped = F.dropout(weights, p=call.dropout) if call.dropout > 0 else weights
        out = ungroup(torch.matmul(dropped, v), h)  # (B, H, Lq, Dv)
        out = zero_dead_rows(out, m.row_ok)
        if not call.return_weights:
            return out, None
        return out, zero_dead_rows(ungroup(weights, h), m.row_ok)  # (B, H, Lq, Lk)
