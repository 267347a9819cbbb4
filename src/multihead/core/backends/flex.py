"""The ``flex`` backend: FlexAttention on CUDA for masks and biases the fused SDPA kernels cannot skip.

A bool ``mask`` becomes a block mask (``create_block_mask``), so whole blocks that a sliding window,
a causal band or key padding forbids are never computed; a float ``bias`` becomes a ``score_mod`` that
adds ``bias[b, h, i, j]`` to each score. The kernel is compiled by ``torch.compile`` (Triton) on first
use for each shape. It serves CUDA only (elsewhere ``sdpa`` does the same work) and never returns weights.

Dimensions: B batch, H heads, Hkv kv heads, Lq/Lk lengths, Dk/Dv head dims.

Equals::

    flex_attention(q, k, v, score_mod=lambda s, b, h, i, j: s + bias[b, h, i, j],
                   block_mask=create_block_mask(lambda b, h, i, j: mask[b, h, i, j], B, H, Lq, Lk),
                   scale=scale, enable_gqa=Hkv < H)

with broadcast (size-1) mask/bias dimensions indexed at 0 and rows with no allowed key set to zero.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator

import torch
from torch import Tensor

from ._common import zero_dead_rows
from .base import AttentionCall

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _flex_module() -> object | None:
    try:
        from torch.nn.attention import flex_attention
    except ImportError:  # torch < 2.5
        return None
    return flex_attention


@functools.cache
def _compiled_flex() -> Callable[..., Tensor]:
    flex = _flex_module()
    assert flex is not None
    return torch.compile(flex.flex_attention, dynamic=False)  # type: ignore[attr-defined]


def _indexer(t: Tensor) -> Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]:
    """``(b, h, i, j) -> t[b, h, i, j]`` for a (B|1, H|1, Lq|1, Lk|1) tensor, size-1 dims read at 0."""
    nb, nh, nq, nk = t.shape

    def at(b: Tensor, h: Tensor, i: Tensor, j: Tensor) -> Tensor:
        return t[b if nb > 1 else 0, h if nh > 1 else 0, i if nq > 1 else 0, j if nk > 1 else 0]

    return at


class FlexBackend:
    name = "flex"

    def __init__(self, *, compiled: bool = True) -> None:
        self.compiled = compiled  # False: eager FlexAttention (slow, for testing the mask plumbing)

    def why_not(self, call: AttentionCall) -> Iterator[str]:
        if call.q.device.type != "cuda" and self.compiled:
            yield f"flex runs on CUDA only (Triton kernels); q is on {call.q.device.type}, where sdpa serves"
        if _flex_module() is None:
            yield f"torch {torch.__version__} has no torch.nn.attention.flex_attention (needs 2.5+)"
        if call.masks.mask is None and call.masks.bias is None:
            yield "no mask or bias to skip blocks by: the fused sdpa kernels serve this call faster"
        if call.return_weights:
            yield "flex cannot return attention weights (use backend='math')"
        if call.dropout > 0:
            yield "flex has no attention dropout (use dropout=0.0 or backend='sdpa')"
        if call.q.dtype not in _DTYPES:
            yield f"flex supports dtypes {_DTYPES}, got {call.q.dtype}"

    def __call__(self, call: AttentionCall) -> tuple[Tensor, Tensor | None]:
        flex = _flex_module()
        assert flex is not None
        q, k, v, m = call.q, call.k, call.v, call.masks
        b, h, lq, lk = q.shape[0], q.shape[1], q.shape[2], k.shape[2]
        block_mask = None
        if m.mask is not None:
            keep = _indexer(m.mask)
            mb, mh = m.mask.shape[0], m.mask.shape[1]
            block_mask = flex.create_block_mask(  # type: ignore[attr-defined]
                lambda bi, hi, i, j: keep(bi, hi, i, j), mb if mb > 1 else None, mh if mh > 1 else None,
                lq, lk, device=q.device,
            )  # fmt: skip
        score_mod = None
        if m.bias is not None:
            add = _indexer(m.bias)

            def score_mod(s: Tensor, bi: Tensor, hi: Tensor, i: Tensor, j: Tensor) -> Tensor:
                return s + add(bi, hi, i, j)

        run = _compiled_flex() if self.compiled else flex.flex_attention  # type: ignore[attr-defined]
        out = run(
            q,  # (B, H, Lq, Dk)
            k,  # (B, Hkv, Lk, Dk)
            v,  # (B, Hkv, Lk, Dv)
            score_mod=score_mod,
            block_mask=block_mask,
            scale=call.scale,
            enable_gqa=k.shape[1] != h,
        )  # (B, H, Lq, Dv)
        del b
        return zero_dead_rows(out, m.row_ok), None
