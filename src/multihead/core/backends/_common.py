"""Helpers shared by the backends: grouped-query reshapes and the dead-row epilogue.

Dimensions: B batch, H query heads, Hkv key/value heads, G = H // Hkv, Lq/Lk lengths, D head dim.

Grouped-query attention without repeating K/V: the G query heads that share one key/value head are
stacked as extra query rows, (B, H, Lq, D) -> (B, Hkv, G*Lq, D). Every query row still attends to the
same keys, so one plain attention over (B, Hkv, G*Lq, D) x (B, Hkv, Lk, D) is exact, and K/V are never
copied G times.
"""

from __future__ import annotations

from torch import Tensor


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
