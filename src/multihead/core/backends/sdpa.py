"""The ``sdpa`` backend: PyTorch's fused ``scaled_dot_product_attention``.

PyTorch picks its own kernel: on CPU a flash-style kernel that skips the blocks above the diagonal when
causal and never keeps a (B, H, Lq, Lk) tensor, forward or backward; on CUDA the flash, cuDNN or
memory-efficient kernels (tried in that order for float16/bfloat16). It cannot return per-head weights.

Dimensions: B batch, H heads, Hkv kv heads, G = H // Hkv, Lq/Lk lengths, Dk/Dv head dims.

Equals::

    F.scaled_dot_product_attention(q, k, v, attn_mask=bias masked with -inf where not mask,
                                   dropout_p=dropout, is_causal=causal, scale=scale,
                                   enable_gqa=Hkv < H)

with rows that have no allowed key set to zero. Grouped-query heads use ``enable_gqa``: K/V are never
repeated, q is never copied, and the native causal kernel still applies.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import Tensor

from ._common import zero_dead_rows
from .base import AttentionCall

_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _cuda_kernels() -> contextlib.AbstractContextManager:
    """On CUDA: prefer flash, then cuDNN, then memory-efficient attention, then the math fallback."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    order = [
        SDPBackend.FLASH_ATTENTION,
        SDPBackend.CUDNN_ATTENTION,
        SDPBackend.EFFICIENT_ATTENTION,
        SDPBackend.MATH,
    ]
    try:
        return sdpa_kernel(order, set_priority=True)
    except TypeError:  # torch < 2.6 has no priority order; let it choose among the same kernels
        return sdpa_kernel(order)


class SDPABackend:
    name = "sdpa"

    def why_not(self, call: AttentionCall) -> Iterator[str]:
        if call.return_weights:
            yield "sdpa cannot return attention weights (use return_weights=False or backend='math')"
        if call.q.dtype not in _DTYPES:
            yield f"sdpa supports dtypes {_DTYPES}, got {call.q.dtype}"

    def __call__(self, call: AttentionCall) -> tuple[Tensor, Tensor | None]:
        q, k, v, m = call.q, call.k, call.v, call.masks
        attn_mask: Tensor | None = m.bias  # (B|1, H|1, Lq|1, Lk|1)
        if m.mask is not None:
            attn_mask = m.mask if attn_mask is None else attn_mask.masked_fill(~m.mask, float("-inf"))
        fused = q.device.type == "cuda" and q.dtype in (torch.float16, torch.bfloat16)
        with _cuda_kernels() if fused else contextlib.nullcontext():
            out = F.scaled_dot_product_attention(
                q,  # (B, H, Lq, Dk), any strides with a contiguous last dim
                k,  # (B, Hkv, Lk, Dk)
                v,  # (B, Hkv, Lk, Dv)
                attn_mask=attn_mask,
                dropout_p=call.dropout,
                is_causal=m.causal,
                scale=call.scale,
                enable_gqa=k.shape[1] != q.shape[1],
            )  # (B, H, Lq, Dv)
        return zero_dead_rows(out, m.row_ok), None
