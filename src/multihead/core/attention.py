"""The functional core: :func:`attention` (fast, dispatching) and :func:`attention_reference` (the oracle).

Dimensions: B batch, H query heads, Hkv key/value heads (H % Hkv == 0; Hkv = 1 is multi-query
attention), Lq query length, Lk key length, Dk query/key head dim, Dv value head dim.

Mask convention (see :mod:`multihead.masks`): bool ``mask`` True = may attend; float ``bias`` added
to the scores; ``valid_lens`` (B,) or (B, Lq) hides keys ``j >= valid_len``; ``causal`` is bottom-right
aligned; all combine with AND; a query row with no allowed key gets output 0 and weights 0.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from . import backends as _backends
from . import masks as _masks
from .checks import check_dropout, check_scale

__all__ = ["AttentionOutput", "attention", "attention_reference", "explain_backends", "output_and_weights"]


class AttentionOutput(NamedTuple):
    """``output`` (B, H, Lq, Dv) -- or (B, Lq, E) from a module -- and per-head ``weights`` (B, H, Lq, Lk).

    ``weights`` are the softmax probabilities *before* dropout (the attention distribution itself).
    """

    output: Tensor
    weights: Tensor


def output_and_weights(res: Tensor | AttentionOutput) -> tuple[Tensor, Tensor | None]:
    """``attention(...)``'s result as ``(output, weights or None)``: the one place the union is unpacked."""
    if isinstance(res, AttentionOutput):
        return res.output, res.weights
    return res, None


def check_qkv(q: Tensor, k: Tensor, v: Tensor) -> None:
    """Validate q (B, H, Lq, Dk), k (B, Hkv, Lk, Dk), v (B, Hkv, Lk, Dv) with H % Hkv == 0."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(
                f"{name} must be 4-D (B, H, L, D), got shape {tuple(t.shape)}; split heads first, e.g. "
                f"x.view(B, L, H, D).transpose(1, 2), or use multihead.MultiHeadAttention on (B, L, E) inputs"
            )
        if not t.is_floating_point():
            raise TypeError(
                f"{name} must be a floating-point tensor, got dtype {t.dtype}; use {name}.float()"
            )
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(
            f"q, k and v must share one dtype, got q {q.dtype}, k {k.dtype}, v {v.dtype}; "
            f"convert with k.to(q.dtype), v.to(q.dtype)"
        )
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k and v must be on one device, got {q.device}, {k.device}, {v.device}")
    (b, h, _, dk), (bk, hkv, lk, dk2), (bv, hv, lv, _) = q.shape, k.shape, v.shape
    if not (b == bk == bv):
        raise ValueError(
            f"q, k, v must share the batch size B, got {b}, {bk}, {bv} (shapes q {tuple(q.shape)}, "
            f"k {tuple(k.shape)}, v {tuple(v.shape)})"
        )
    if hkv != hv or lk != lv:
        raise ValueError(
            f"k (B, Hkv, Lk, Dk) and v (B, Hkv, Lk, Dv) must agree on Hkv and Lk, got k {tuple(k.shape)} "
            f"and v {tuple(v.shape)}"
        )
    if dk != dk2:
        raise ValueError(f"q and k must share the head dim Dk, got q {tuple(q.shape)} and k {tuple(k.shape)}")
    if hkv == 0 or h % hkv:
        raise ValueError(
            f"query heads H={h} must be a multiple of key/value heads Hkv={hkv} (grouped-query attention); "
            f"got q {tuple(q.shape)} and k {tuple(k.shape)}"
        )


def prepare(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    mask: Tensor | None = None,
    bias: Tensor | None = None,
    valid_lens: Tensor | None = None,
    causal: bool = False,
    scale: float | None = None,
    dropout: float = 0.0,
    return_weights: bool = False,
) -> _backends.AttentionCall:
    """Validate an attention call and normalise its masks into an :class:`~multihead.backends.AttentionCall`."""
    check_qkv(q, k, v)
    target = (q.shape[0], q.shape[1], q.shape[2], k.shape[2])  # (B, H, Lq, Lk)
    norm = _masks.normalize(
        target,
        mask=mask,
        bias=bias,
        valid_lens=valid_lens,
        causal=bool(causal),
        dtype=q.dtype,
        device=q.device,
    )
    return _backends.AttentionCall(
        q, k, v, norm, check_scale(scale, q.shape[-1]), check_dropout(dropout), bool(return_weights)
    )


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    mask: Tensor | None = None,
    bias: Tensor | None = None,
    valid_lens: Tensor | None = None,
    causal: bool = False,
    scale: float | None = None,
    dropout: float = 0.0,
    return_weights: bool = False,
    backend: str = "auto",
) -> Tensor | AttentionOutput:
    """Scaled dot-product attention over heads, with every mask kind, GQA/MQA and a choice of backend.

    Args:
        q: (B, H, Lq, Dk) queries.
        k: (B, Hkv, Lk, Dk) keys; H % Hkv == 0 (Hkv < H is grouped-query, Hkv == 1 multi-query).
        v: (B, Hkv, Lk, Dv) values; Dv may differ from Dk.
        mask: bool, True = may attend, broadcastable to (B, H, Lq, Lk). E.g. (Lq, Lk) = (2, 3)::

                1 1 0
                1 1 1

        bias: float, added to the scores, broadcastable to (B, H, Lq, Lk) (ALiBi, relative positions,
            ``-inf`` entries forbid keys).
        valid_lens: int (B,) or (B, Lq): keys at index >= valid_len are masked (d2l).
        causal: query i sees keys j <= i + (Lk - Lq) (bottom-right aligned).
        scale: score scale, default 1/sqrt(Dk).
        dropout: probability of dropping attention weights; applied only when > 0 (pass 0 in eval).
        return_weights: also return the per-head weights (B, H, Lq, Lk), before dropout.
        backend: ``"auto"`` (the fused SDPA kernel whenever it can serve the call, else ``"math"``),
            ``"sdpa"`` or ``"math"``; every backend gives the same answer.

    Returns:
        (B, H, Lq, Dv) output, or ``AttentionOutput(output, weights)`` with ``return_weights=True``.
        A query row with no allowed key has output 0 and weights 0 (finite gradients), on every backend.

    Equals ``softmax(q @ k^T * scale + bias, masked) @ v`` with K/V repeated H // Hkv times; see
    :func:`attention_reference`.
    """
    call = prepare(
        q,
        k,
        v,
        mask=mask,
        bias=bias,
        valid_lens=valid_lens,
        causal=causal,
        scale=scale,
        dropout=dropout,
        return_weights=return_weights,
    )
    if not isinstance(backend, str):
        raise TypeError(f"backend must be a str ('auto', {', '.join(map(repr, _backends.available()))})")
    out, weights = _backends.select(call, backend)(call)
    if return_weights:
        assert weights is not None
        return AttentionOutput(out, weights)
    return out


def explain_backends(q: Tensor, k: Tensor, v: Tensor, **kwargs: object) -> dict[str, list[str]]:
    """For the call ``attention(q, k, v, **kwargs)``: each backend and why it cannot serve it ([] = it can)."""
    kwargs.pop("backend", None)
    return _backends.explain(prepare(q, k, v, **kwargs))  # type: ignore[arg-type]


def attention_reference(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    mask: Tensor | None = None,
    bias: Tensor | None = None,
    valid_lens: Tensor | None = None,
    causal: bool = False,
    scale: float | None = None,
    dropout: float = 0.0,
    return_weights: bool = False,
) -> Tensor | AttentionOutput:
    """Plain, readable attention: the oracle every fast path is tested against.

    Same arguments and results as :func:`attention` (without ``backend``). It repeats K/V for grouped
    heads, materialises the full (B, H, Lq, Lk) mask and applies softmax directly; nothing clever.
    """
    check_qkv(q, k, v)
    b, h, lq, dk = q.shape
    hkv, lk = k.shape[1], k.shape[2]
    target = (b, h, lq, lk)
    scale = check_scale(scale, dk)
    dropout = check_dropout(dropout)

    k = k.repeat_interleave(h // hkv, dim=1)  # (B, H, Lk, Dk)
    v = v.repeat_interleave(h // hkv, dim=1)  # (B, H, Lk, Dv)
    scores = torch.matmul(q, k.transpose(-2, -1)) * scale  # (B, H, Lq, Lk)

    allowed = torch.ones(target, dtype=torch.bool, device=q.device)  # (B, H, Lq, Lk)
    if mask is not None:
        allowed = allowed & _masks.check_mask(mask, target)
    if valid_lens is not None:
        _masks.check_valid_lens(valid_lens, b, lq)
        allowed = allowed & _masks.from_valid_lens(valid_lens.to(q.device), lk, lq)
    if causal:
        allowed = allowed & _masks.causal(lq, lk, device=q.device)
    if bias is not None:
        bias = _masks.check_bias(bias, target, q.dtype)
        scores = scores + bias
        allowed = allowed & ~torch.isneginf(bias)

    row_ok = allowed.any(dim=-1, keepdim=True)  # (B, H, Lq, 1)
    scores = scores.masked_fill(~allowed, float("-inf"))
    scores = scores.masked_fill(~row_ok, 0.0)  # a dead row: finite scores, zeroed below
    weights = torch.softmax(scores, dim=-1) * row_ok  # (B, H, Lq, Lk)
    dropped = torch.nn.functional.dropout(weights, p=dropout) if dropout > 0 else weights
    out = torch.matmul(dropped, v)  # (B, H, Lq, Dv)
    return AttentionOutput(out, weights) if return_weights else out
