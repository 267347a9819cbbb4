"""The ``sdpa`` backend: PyTorch's fused ``scaled_dot_product_attention``.

PyTorch picks its own kernel: on CPU a flash-style kernel that skips the blocks above the diagonal when
causal and never keeps a (B, H, Lq, Lk) tensor, forward or backward; on CUDA the flash, cuDNN or
memory-efficient kernels (tried in that order for float16/bfloat16). It cannot return per-head weights.
One exception on the CPU: an unmasked call of many short rows (B*H >= 64, Lk <= 32, Lq >= 2, float32 or
float64) runs as two matmuls and a softmax (:func:`~multihead.core.backends.math.short_attention`), where
the fused kernel's per-head set-up costs more than the product; its (B, H, Lq, Lk) scores are at most
32 keys wide. And an unmasked, non-causal bfloat16 call without autograd on a CPU that multiplies
bfloat16 in hardware runs as blocks of two ``bmm`` and a softmax
(:func:`~multihead.core.backends.math.bf16_attention`): the fused kernel's bfloat16 products run at
about half oneDNN's rate there.

Dimensions: B batch, H heads, Hkv kv heads, G = H // Hkv, Lq/Lk lengths, Dk/Dv head dims.

Equals::

    F.scaled_dot_product_attention(q, k, v, attn_mask=bias masked with -inf where not mask,
                                   dropout_p=dropout, is_causal=causal, scale=scale,
                                   enable_gqa=Hkv < H)

with rows that have no allowed key set to zero. On the CPU, right-padded keys given by a bool mask alone
(``valid_lens``, a key-padding mask, an encoder's padding mask from transformers) run row by row against
each row's real keys, unmasked, where that saves more than the extra kernel calls cost: a padded batch
costs its real keys. Grouped-query heads use ``enable_gqa``: K/V are never
repeated, q is never copied, and the native causal kernel still applies.

Sinks (per-head logits in the softmax denominator) are exact here: one extra key of zeros with value
zeros whose bias is ``sink[h]`` -- its logit is the sink, and it adds nothing to the output. It cannot
soft-cap scores (``softcap``): ``math`` or ``flex`` serve those calls. Mask/bias functions and segment
ids are evaluated densely (:func:`multihead.masks.materialize`) up to ``dense_limit`` scores.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor

from ..checks import is_tracing
from ..masks import attn_mask as additive
from ..masks import causal, key_prefix, materialize, to_bias
from ..segments import packed_runs
from ._common import DENSE_LIMIT, dense_refusal, kv_for_cpu_kernel, unread_zeroed, zero_dead_rows
from .base import AttentionCall, Deferral
from .math import bf16_attention, serves_bf16, serves_short, short_attention

if TYPE_CHECKING:
    from ..masks import Normalized

_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _with_sink_key(
    q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None, is_causal: bool, sinks: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """K/V with one more key of zeros (score 0, value 0) and the attention bias with ``sinks[h]`` for it:
    k (B, Hkv, Lk+1, Dk), v (B, Hkv, Lk+1, Dv), bias (B|1, H, Lq|1, Lk+1)."""
    b, h, lq, _ = q.shape
    hkv, lk = k.shape[1], k.shape[2]
    k = torch.cat([k, k.new_zeros(b, hkv, 1, k.shape[3])], dim=2)  # (B, Hkv, Lk+1, Dk)
    v = torch.cat([v, v.new_zeros(b, hkv, 1, v.shape[3])], dim=2)  # (B, Hkv, Lk+1, Dv)
    if is_causal:  # the native flag would misplace the extra key: spell causality out
        attn_mask = causal(lq, lk, device=q.device).view(1, 1, lq, lk)  # (1, 1, Lq, Lk)
    if attn_mask is None:
        attn_mask = q.new_zeros(1, 1, 1, lk)  # (1, 1, 1, Lk)
    elif attn_mask.dtype == torch.bool:
        attn_mask = to_bias(attn_mask, q.dtype)
    mb, mq = attn_mask.shape[0], attn_mask.shape[2]
    sink = sinks.view(1, h, 1, 1).expand(mb, h, mq, 1)  # (B|1, H, Lq|1, 1)
    return k, v, torch.cat([attn_mask.expand(mb, h, mq, lk), sink], dim=-1)  # (B|1, H, Lq|1, Lk+1)


def _packed_on_cpu(call: AttentionCall) -> bool:
    """Whether a CPU call with segment ids is packed sequences (one contiguous run per id) that a
    per-sequence backend serves for less than the dense grid: its runs' pairs at most half the row's."""
    q, segments = call.q, call.masks.segments
    if segments is None or q.device.type != "cpu":
        return False
    runs = packed_runs(*segments)
    if runs is None:
        return False
    pairs = sum((qe - qs) * (ke - ks) for row in runs for qs, qe, ks, ke in row)
    return 2 * pairs <= q.shape[0] * q.shape[2] * call.k.shape[2]


ROW_CALL_FLOPS = 4e6
"""The work one kernel call of its own costs, in FLOPs a row's truncation must save to pay for it (about
40 us of call overhead against ~50 GFLOP/s of attention on a CPU core, with a margin of 2)."""


def _short_rows(call: AttentionCall, m: Normalized) -> Tensor | None:
    """(B,) key counts where ``call`` is right-padded keys -- every query of row b sees keys 0..n[b]-1,
    by a bool mask alone (``valid_lens``, a key-padding mask, transformers' encoder padding) -- on the CPU,
    and cutting each row's keys to n[b] saves more work than the B kernel calls cost; else ``None``."""
    q, k = call.q, call.k
    if q.device.type != "cpu" or m.mask is None or m.bias is not None or m.causal or call.sinks is not None:
        return None
    b, h, lq, dk = q.shape
    per_key = 2 * h * lq * (dk + call.v.shape[3])  # FLOPs one key of one row costs
    if is_tracing() or m.mask.shape[3] != k.shape[2] or per_key * k.shape[2] <= ROW_CALL_FLOPS:
        return (
            None  # (the last: even a row cut to no key would not pay for its call -- no pass over the mask)
        )
    n = key_prefix(m.mask)  # (B|1,)
    if n is None:
        return None
    n = n.expand(b)  # (B,)
    saved = per_key * int(b * k.shape[2] - n.sum())
    return n if saved > ROW_CALL_FLOPS * b else None


def _by_rows(call: AttentionCall, lengths: Tensor) -> Tensor:
    """Each batch row b against its first ``lengths[b]`` keys, unmasked (rows with none: output 0)
    -> (B, H, Lq, Dv); slices of K/V's rows and one ``cat`` of the outputs (autograd follows)."""
    q, k, v = call.q, call.k, call.v
    out = []
    for b, n in enumerate(lengths.tolist()):
        if n == 0:
            out.append(q.new_zeros(1, q.shape[1], q.shape[2], v.shape[3]))
            continue
        kb, vb = kv_for_cpu_kernel(q[b : b + 1], k[b : b + 1, :, :n], v[b : b + 1, :, :n])
        out.append(
            F.scaled_dot_product_attention(
                q[b : b + 1],
                kb,
                vb,
                dropout_p=call.dropout,
                scale=call.scale,
                enable_gqa=kb.shape[1] != q.shape[1],
            )  # fmt: skip
        )  # (1, H, Lq, Dv)
    return torch.cat(out)  # (B, H, Lq, Dv)


class SDPABackend:
    """``dense_limit``: the largest B*H*Lq*Lk grid it evaluates mask/bias functions and segment ids on."""

    name = "sdpa"

    def __init__(self, *, dense_limit: int = DENSE_LIMIT) -> None:
        self.dense_limit = dense_limit

    def why_not(self, call: AttentionCall) -> Iterator[str]:
        if call.return_weights:
            yield "sdpa cannot return attention weights (use return_weights=False or backend='math')"
        if call.q.dtype not in _DTYPES:
            yield f"sdpa supports dtypes {_DTYPES}, got {call.q.dtype}"
        if call.softcap is not None:
            yield f"sdpa cannot soft-cap scores (softcap={call.softcap}); use backend='math' (or flex on CUDA)"
        reason = dense_refusal(call, self.dense_limit, self.name)
        if reason is not None:
            yield reason

    def defers(self, call: AttentionCall) -> Deferral | None:
        """The backend auto routing gives a call sdpa could serve, when that one serves it for less
        (``backend='sdpa'`` still serves it), or ``None``."""
        if _packed_on_cpu(call):
            return Deferral(
                "blocked",
                "packed segment ids on CPU: blocked's per-sequence path costs only the real tokens "
                "(sdpa would evaluate every (query, key) pair of the row)",
            )
        return None

    def __call__(self, call: AttentionCall) -> tuple[Tensor, Tensor | None]:
        q, k, v = call.q, call.k, call.v
        m = materialize(call.masks, (*q.shape[:3], k.shape[2]), q.dtype, q.device)  # no-op without functions
        lengths = _short_rows(call, m)
        if lengths is not None:  # right-padded keys: each row attends its real keys only
            return zero_dead_rows(_by_rows(call, lengths), m.row_ok), None  # re-opened dead rows: 0
        q, k, v = unread_zeroed(q, k, v, m.mask, m.bias, m.row_ok, call.scale)  # hidden garbage: never read
        attn_mask = additive(m.mask, m.bias)  # (B|1, H|1, Lq|1, Lk|1) bool or float, or None
        is_causal = m.causal
        if call.sinks is not None:
            k, v, attn_mask = _with_sink_key(q, k, v, attn_mask, is_causal, call.sinks)
            is_causal = False
        out = _kernel(q, k, v, attn_mask, is_causal, call.dropout, call.scale)  # (B, H, Lq, Dv)
        return zero_dead_rows(out, m.row_ok), None

    def unmasked(self, q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> Tensor | None:
        """The unmasked lane (:func:`~multihead.core.backends.unmasked_route`): q (B, H, Lq, Dk), k/v
        (B, Hkv, Lk, D) already checked, ``causal`` only with Lq == Lk -> (B, H, Lq, Dv); ``None`` for a
        dtype this backend does not serve. The same kernel call as :meth:`__call__` makes for such a call."""
        if q.dtype not in _DTYPES:
            return None
        return _kernel(q, k, v, None, causal, 0.0, scale)


def _kernel(
    q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None, is_causal: bool, dropout: float, scale: float
) -> Tensor:
    """PyTorch's fused attention on q (B, H, Lq, Dk), k (B, Hkv, Lk, Dk), v (B, Hkv, Lk, Dv) -> (B, H, Lq, Dv):
    grouped K/V as this torch's CPU kernel takes them. On CUDA the kernel is torch's own choice, within
    whatever ``torch.nn.attention.sdpa_kernel`` the caller set: torch orders its kernels per GPU, and a
    fixed order of ours (flash first, until this was measured on an H200) cost up to 1.5x there. Many short
    rows on the CPU (:func:`~multihead.core.backends.math.serves_short`) run as two matmuls instead."""
    if attn_mask is None and not dropout and serves_short(q, k, is_causal):
        return short_attention(q, k, v, is_causal, scale)  # (B, H, Lq, Dv)
    if attn_mask is None and not dropout and serves_bf16(q, k, v, is_causal) and not is_tracing():
        return bf16_attention(q, k, v, scale)  # (B, H, Lq, Dv)
    if is_causal and scale <= 0:  # torch's causal kernel gives NaN rows for a scale <= 0 (2.13, CPU)
        attn_mask, is_causal = (
            causal(q.shape[2], k.shape[2], device=q.device).view(1, 1, q.shape[2], -1),
            False,
        )
    k, v = kv_for_cpu_kernel(q, k, v)  # repeated to H heads on CPU before torch 2.9 only
    return _fused(q, k, v, attn_mask, is_causal, dropout, scale)


def _fused(
    q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None, is_causal: bool, dropout: float, scale: float
) -> Tensor:
    return F.scaled_dot_product_attention(
        q,  # (B, H, Lq, Dk), any strides with a contiguous last dim
        k,  # (B, Hkv, Lk, Dk), Lk + 1 with sinks
        v,  # (B, Hkv, Lk, Dv)
        attn_mask=attn_mask,
        dropout_p=dropout,
        is_causal=is_causal,
        scale=scale,
        enable_gqa=k.shape[1] != q.shape[1],
    )  # (B, H, Lq, Dv)
