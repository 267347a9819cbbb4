"""Helpers shared by the backends: grouped-query reshapes, the dead-row epilogue, the dense-grid limit.

Dimensions: B batch, H query heads, Hkv key/value heads, G = H // Hkv, Lq/Lk lengths, D head dim.

Grouped-query attention without repeating K/V: the G query heads that share one key/value head are
stacked as extra query rows, (B, H, Lq, D) -> (B, Hkv, G*Lq, D). Every query row still attends to the
same keys, so one plain attention over (B, Hkv, G*Lq, D) x (B, Hkv, Lk, D) is exact, and K/V are never
copied G times.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ..checks import is_tracing
from .base import AttentionCall

FUSED_CPU_TAKES_GROUPS = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 9)
"""Whether PyTorch's fused CPU attention kernel takes grouped K/V (Hkv < H): from torch 2.9 (pytorch PR
157893). Before that, ``scaled_dot_product_attention(enable_gqa=True)`` on CPU falls back to its math path
(a (B, H, Lq, Lk) tensor and K/V copies), and the raw kernel reads past K/V's heads (NaN, heap corruption:
seen on 2.5.1, 2.6.0, 2.7.1)."""


def needs_grad(*tensors: Tensor | None) -> bool:
    """Whether autograd is on and any of ``tensors`` (None skipped) requires a gradient: whether a backward
    pass may need what a backend computes from them."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def call_needs_grad(call: AttentionCall) -> bool:
    """:func:`needs_grad` of a call's q, k, v, dense bias and sinks -- or autograd on and a bias function,
    which may close over parameters (learned slopes, tables)."""
    bias_fn = call.masks.bias_fn is not None and torch.is_grad_enabled()
    return bias_fn or needs_grad(call.q, call.k, call.v, call.masks.bias, call.sinks)


def kv_for_cpu_kernel(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """K/V as this torch's fused CPU kernel takes them: as they are (grouped or not; any device but CPU
    before torch 2.9), or repeated to H heads, (B, H, Lk, Dk) and (B, H, Lk, Dv) -- one copy of K/V, where
    the fallback would hold every (query, key) score."""
    if FUSED_CPU_TAKES_GROUPS:
        return k, v
    g = q.shape[1] // k.shape[1]
    if g == 1 or q.device.type != "cpu":
        return k, v
    return k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)  # (B, H, Lk, Dk), (B, H, Lk, Dv)


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


def unread_zeroed(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    keep: Tensor | None,
    bias: Tensor | None,
    row_ok: Tensor | None,
    scale: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """q (B, H, Lq, Dk), k (B, Hkv, Lk, Dk), v (B, Hkv, Lk, Dv) with what no allowed (query, key) pair reads
    set to 0 where it could reach a result: the keys and values hidden from every query of their batch row
    and kv head (padding, a cache's unused slots), and the queries of rows with no allowed key -- so
    whatever they hold (NaN, Inf, a finite value whose score overflows) never reaches an output or a
    gradient through a kernel's ``score + (-inf)``, ``0 * value`` or a re-opened dead row.

    ``keep`` (B|1, H|1, Lq|1, Lk|1) bool and ``bias`` (B|1, H|1, Lq|1, Lk|1) as in a dense
    :class:`~multihead.core.masks.Normalized` (dead rows re-opened, ``row_ok`` (B|1, H|1, Lq|1, 1) False on
    them). Looks before it copies: the hidden keys and dead queries are read (a gather of those alone, the
    largest |q| -- and |k| where rows are dead -- for the overflow bound, one host read), and copied zeroed
    only when they hold non-finite or overflowing values.

    On the CPU only (outside tracing): elsewhere the look would make the host wait for the device on every
    masked call, and zeroing without it would copy K and V on every one (a decode step's whole cost,
    twice); there hidden keys and dead queries must hold finite values, as for torch's kernels."""
    if not _on_host(k):
        return q, k, v
    dead = _hidden_keys(keep, bias, row_ok, k.shape[1])  # (B|1, Hkv|1, Lk, 1) or None
    if dead is None and row_ok is None:
        return q, k, v
    keys_ok, rows_ok = _harmless(q, k, v, dead, row_ok, scale)
    if not rows_ok:
        q = q.masked_fill(~row_ok, 0.0)  # (B, H, Lq, Dk): a dead row's query reads nothing
    if not keys_ok:
        k, v = k.masked_fill(dead, 0.0), v.masked_fill(dead, 0.0)
    return q, k, v


def _on_host(t: Tensor) -> bool:
    return t.device.type == "cpu" and not is_tracing()


def _hidden_keys(keep: Tensor | None, bias: Tensor | None, row_ok: Tensor | None, hkv: int) -> Tensor | None:
    """(B|1, Hkv|1, Lk, 1) True for the keys no query of their batch row and kv head may see, or None."""
    closed = keep
    if bias is not None:
        finite = ~torch.isneginf(bias)
        closed = finite if closed is None else closed & finite
    if closed is None:
        return None
    if row_ok is not None:
        closed = closed & row_ok  # re-opened dead rows see nothing
    dead = ~closed.any(dim=2)  # (B|1, H|1, Lk)
    b, h, lk = dead.shape
    if h > 1:
        dead = dead.view(b, hkv, h // hkv, lk).all(dim=2)  # (B|1, Hkv, Lk): hidden from all G heads
    if not bool(dead.any()):
        return None
    return dead.unsqueeze(-1)  # (B|1, Hkv|1, Lk, 1)


def _harmless(
    q: Tensor, k: Tensor, v: Tensor, dead: Tensor | None, row_ok: Tensor | None, scale: float
) -> tuple[bool, bool]:
    """(the hidden keys are harmless, the dead rows' queries are): finite, and no score with them can
    overflow (the largest |entries| of its two factors, times Dk and |scale|, stay finite)."""
    q, k, v = q.detach(), k.detach(), v.detach()
    parts = [_largest(q)]
    if dead is not None:
        at = dead.squeeze(-1).expand(k.shape[0], k.shape[1], k.shape[2])  # (B, Hkv, Lk)
        parts += [_largest(k[at]), _largest(v[at])]  # the hidden keys alone
    if row_ok is not None:
        rows = (~row_ok).squeeze(-1).expand(q.shape[0], q.shape[1], q.shape[2])  # (B, H, Lq)
        parts += [_largest(q[rows]), _largest(k)]  # a dead row sees every key
    top = torch.stack(parts).tolist()  # one read on the host
    factor, limit = k.shape[3] * abs(scale), torch.finfo(q.dtype).max / 4
    keys_ok = dead is None or (top[2] < math.inf and top[1] * top[0] * factor < limit)
    rows_ok = row_ok is None or top[-2] * top[-1] * factor < limit
    return keys_ok, rows_ok


def _largest(t: Tensor) -> Tensor:
    """max |t| as a 0-d float64 tensor (0 for an empty one; NaN if t holds one), in one pass."""
    if t.numel() == 0:
        return torch.zeros((), dtype=torch.float64, device=t.device)
    lo, hi = torch.aminmax(t)
    return torch.maximum(-lo, hi).double()
