"""The ``sdpa`` backend: PyTorch's fused ``scaled_dot_product_attention``.

PyTorch picks its own kernel (flash / memory-efficient / cuDNN on CUDA, a flash-style kernel on CPU),
so no (B, H, Lq, Lk) tensor is kept for long sequences. It cannot return per-head weights.

Dimensions: B batch, H heads, Hkv kv heads, G = H // Hkv, Lq/Lk lengths, Dk/Dv head dims.

Equals::

    F.scaled_dot_product_attention(q, k, v, attn_mask=bias masked with -inf where not mask,
                                   dropout_p=dropout, is_causal=causal, scale=scale)

with grouped-query heads stacked as query rows (see ``_common.group_queries``) and rows that have no
allowed key set to zero.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ..masks import causal
from . import AttentionCall
from ._common import group_mask, group_queries, ungroup, zero_dead_rows

_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


class SDPABackend:
    name = "sdpa"

    def why_not(self, call: AttentionCall) -> list[str]:
        reasons = []
        if call.return_weights:
            reasons.append(
                "sdpa cannot return attention weights (use return_weights=False or backend='math')"
            )
        if call.q.dtype not in _DTYPES:
            reasons.append(f"sdpa supports dtypes {_DTYPES}, got {call.q.dtype}")
        return reasons

    def __call__(self, call: AttentionCall) -> tuple[Tensor, Tensor | None]:
        q, k, v, m = call.q, call.k, call.v, call.masks
        h, hkv, lq = q.shape[1], k.shape[1], q.shape[2]
        attn_mask: Tensor | None = m.bias
        if m.mask is not None:
            attn_mask = m.mask if attn_mask is None else attn_mask.masked_fill(~m.mask, float("-inf"))
        native_causal = m.causal and h == hkv
        if m.causal and not native_causal:  # grouped query rows are not in causal order: spell it out
            attn_mask = causal(lq, k.shape[2], device=q.device).view(1, 1, lq, -1)  # (1, 1, Lq, Lk)
        out = F.scaled_dot_product_attention(
            group_queries(q, hkv),  # (B, Hkv, G*Lq, Dk)
            k,
            v,
            attn_mask=group_mask(attn_mask, h, hkv, lq),
            dropout_p=call.dropout,
            is_causal=native_causal,
            scale=call.scale,
        )  # (B, Hkv, G*Lq, Dv)
        return zero_dead_rows(ungroup(out, h), m.row_ok), None
