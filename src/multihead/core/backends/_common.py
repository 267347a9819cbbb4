"""Helpers shared by the backends: grouped-query reshapes, the dead-row epilogue, the dense-grid limit.

Dimensions: B batch, H query heads, Hkv key/value heads, G = H // Hkv, Lq/Lk lengths, D head dim.

Grouped-query attention without repeating K/V: the G query heads that share one key/value head are
stacked as extra query rows, (B, H, Lq, D) -> (B, Hkv, G*Lq, D). Every query row still attends to the
same keys, so one plain attention over (B, Hkv, G*Lq, D) x (B, Hkv, Lk, D) is exact, and K/V are never
copied G times.
"""

from __future__ import annotations

from torch import Tensor

from .base import AttentionCall


def group_queries(q: Tensor, hkv: int) -> Tensor:
    """(B, H, Lq, D) -> (B, Hkv, G*Lq, D)."""
    b, h, lq, d = q.shape
    return q.reshape(b, hkv, (h // hkv) * lq, d)  # (B, Hkv, G*Lq, D)


def ungroup(x: Tensor, h: int) -> Tensor:
    """(B, Hkv, G*Lq, X) -> (B, H, Lq, X), the inverse of :func:`group_queries`."""
    b, hkv, glq, last = x.shape
    return x.reshape(b, h, glq * hkv // h, last)  # (B, H, Lq, X)


def group_mask(m: Tensor | None, h: int, hkv: int, lq: int) -> Tensor | None:
    """A (B|1, H|1, Lq|1, Lk|1) mask or bias, laid out for grouped queries: (B|1, Hkv|1, G*Lq|1, Lk|1)."""
    if m is None or h == hkv:
        return m
    b, mh, ml, mk = m.shape
    if mh == 1 and ml == 1:
        return m  # the same for every query row: nothing to lay out
    g = h // hkv
    if mh == 1:
        return m.expand(b, g, lq, mk).reshape(b, 1, g * lq, mk)  # (B|1, 1, G*Lq, Lk)
    return m.expand(b, h, lq, mk).reshape(b, hkv, g * lq, mk)  # (B|1, Hkv, G*Lq, Lk)


def zero_dead_rows(x: Tensor | None, row_ok: Tensor | None) -> Tensor | None:
    """Rows with no allowed key -> 0 (output and weights), by a multiply so gradients stay finite."""
    if x is None or row_ok is None:
        return x
    return x * row_ok.to(x.dtype)  # (B, H, Lq, X) * (B|1, H|1, Lq|1, 1)


DENSE_LIMIT = 1 << 26
"""Default largest B*H*Lq*Lk a dense backend evaluates a function-mode call on (2**26 = 64M scores)."""


def dense_refusal(call: AttentionCall, limit: int, name: str) -> str | None:
    """Why backend ``name`` declines a function-mode ``call`` (mask/bias functions or segment ids): its
    dense (B, H, Lq, Lk) grid would exceed ``limit`` entries. ``None`` when it may serve: no functions,
    a grid within the limit, or weights/dropout that need the dense grid anyway."""
    if not call.masks.has_functions or call.return_weights or call.dropout > 0:
        return None
    b, h, lq, _ = call.q.shape
    n = b * h * lq * call.k.shape[2]
    if n <= limit:
        return None
    return (
        f"{name} would build a dense (B, H, Lq, Lk) grid of {n} entries for the mask/bias functions or "
        f"segment ids (limit {limit}); a block-skipping backend serves this call (flex on CUDA, blocked on "
        f"CPU), or pass return_weights=True to force a dense one"
    )


def group_sinks(sinks: Tensor | None, hkv: int, lq: int) -> Tensor | None:
    """Sinks (H,) laid out for grouped queries: (1, Hkv, G*Lq, 1), one logit per query row."""
    if sinks is None:
        return None
    g = sinks.shape[0] // hkv
    return sinks.view(hkv, g, 1).expand(hkv, g, lq).reshape(1, hkv, g * lq, 1)  # (1, Hkv, G*Lq, 1)
