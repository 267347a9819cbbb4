"""The ``math`` backend: explicit scores, softmax and a second matmul. Serves every call (a call with
mask/bias functions or segment ids only up to a dense grid of ``dense_limit`` scores, unless it needs
weights or dropout: then always).

It is the backend that returns per-head weights: the output is computed from the same softmax in the
same pass, so ``return_weights=True`` costs one extra (B, H, Lq, Lk) tensor and nothing else.

Dimensions: B batch, H heads, Hkv kv heads, G = H // Hkv, Lq/Lk lengths, Dk/Dv head dims.

Equals, in plain PyTorch (with K/V repeated G times for grouped-query attention)::

    s = (q * scale) @ k.transpose(-2, -1)
    s = softcap * tanh(s / softcap)                                   # softcap given
    w = softmax(s + bias masked with -inf where not mask, dim=-1)
    w = w * sigmoid(logsumexp(s + bias, masked) - sink[h])           # sinks given: e^s / (sum e^s + e^sink)
    out = dropout(w) @ v
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from ..checks import is_int
from ..masks import causal, materialize
from ._common import (
    DENSE_LIMIT,
    call_needs_grad,
    dense_refusal,
    group_mask,
    group_queries,
    group_sinks,
    needs_grad,
    ungroup,
    unread_zeroed,
    zero_dead_rows,
)
from .base import AttentionCall


class MathBackend:
    """``block_bytes``: target size of one block of scores in the cache-blocked inference path (it
    should fit in cache; the registered instance uses the default, 4 MiB). ``dense_limit``: the largest
    B*H*Lq*Lk grid it evaluates mask/bias functions and segment ids on (see ``_common.dense_refusal``)."""

    name = "math"

    def __init__(self, *, block_bytes: int = 4 << 20, dense_limit: int = DENSE_LIMIT) -> None:
        if not is_int(block_bytes, 1):
            raise ValueError(
                f"block_bytes must be a positive int (bytes per block of scores), got {block_bytes!r}"
            )
        if not is_int(dense_limit, 1):
            raise ValueError(f"dense_limit must be a positive int (entries), got {dense_limit!r}")
        self.block_bytes = block_bytes
        self.dense_limit = dense_limit

    def blocked(self, call: AttentionCall) -> bool:
        """Whether ``call`` takes the cache-blocked inference path (CPU, no autograd, large scores)."""
        q, k = call.q, call.k
        if call.dropout > 0 or q.device.type != "cpu" or call_needs_grad(call):
            return False
        b, h, lq, _ = q.shape  # the grouped queries (B, Hkv, G*Lq, Dk) hold as many score rows
        return b * h * lq * k.shape[2] * q.element_size() > 2 * self.block_bytes

    def why_not(self, call: AttentionCall) -> list[str]:
        reason = dense_refusal(call, self.dense_limit, self.name)
        return [] if reason is None else [reason]

    def __call__(self, call: AttentionCall) -> tuple[Tensor, Tensor | None]:
        q, k, v = call.q, call.k, call.v
        b, h, hkv, lq, lk = q.shape[0], q.shape[1], k.shape[1], q.shape[2], k.shape[2]
        m = materialize(call.masks, (b, h, lq, lk), q.dtype, q.device)  # dense form (no-op without functions)
        q, k, v = unread_zeroed(q, k, v, m.mask, m.bias, m.row_ok, call.scale)  # hidden garbage: never read
        # Scaling q (B*H*Lq*Dk products) is cheaper than scaling the scores (B*H*Lq*Lk), and its
        # contiguous result makes the grouping below a view.
        qg = group_queries(q * call.scale, hkv)  # (B, Hkv, G*Lq, Dk)
        bias = m.bias
        if m.causal:  # only when Lq == Lk and nothing else masks: -inf added above the diagonal, which on
            # the CPU costs an eighth of a masked_fill with the same bool triangle (0.12 vs 1.0 ms at 256 keys)
            above = torch.full((lq, lk), float("-inf"), dtype=q.dtype, device=q.device).triu_(1)  # (Lq, Lk)
            bias = above.view(1, 1, lq, lk) if bias is None else bias + above
        bias = group_mask(bias, h, hkv, lq)  # (B|1, Hkv|1, G*Lq|1, Lk|1)
        keep = group_mask(m.mask, h, hkv, lq)  # (B|1, Hkv|1, G*Lq|1, Lk|1)
        extra = _Extras(
            call.softcap, group_sinks(call.sinks, hkv, lq), call.return_weights
        )  # (1, Hkv, G*Lq, 1)
        if self.blocked(call):
            out, weights = _attend_blocked(qg, k, v, bias, keep, extra, self.block_bytes)
        else:
            out, weights = _attend(qg, k, v, bias, keep, extra, call.dropout)
        out = zero_dead_rows(ungroup(out, h), m.row_ok)  # (B, H, Lq, Dv)
        if not call.return_weights:
            return out, None
        return out, zero_dead_rows(ungroup(weights, h), m.row_ok)  # (B, H, Lq, Lk)


class _Extras(NamedTuple):
    """Softcap (a float or None), grouped sinks (1, Hkv, G*Lq, 1) or None, and whether the weights are
    returned (with sinks they are then scaled too; otherwise only the output is)."""

    softcap: float | None = None
    sinks: Tensor | None = None
    weights_out: bool = True


_NO_EXTRAS = _Extras()


def _attend(
    qg: Tensor,
    k: Tensor,
    v: Tensor,
    bias: Tensor | None,
    keep: Tensor | None,
    extra: _Extras = _NO_EXTRAS,
    dropout: float = 0.0,
    out: tuple[Tensor, Tensor] | None = None,
    scale: float | None = None,
) -> tuple[Tensor, Tensor]:
    """softmax(capped(qg k^T) + bias, masked, sinks) (dropped out) @ v: (output (B, Hkv, G*Lq, Dv),
    weights (..., Lk)).

    ``out``: (output, weights) buffers to write into (no autograd then). ``scale``: multiplies the scores
    (``None``: ``qg`` comes scaled).
    """
    o_buf, w_buf = out if out is not None else (None, None)
    scores = torch.matmul(qg, k.transpose(-2, -1), out=w_buf)  # (B, Hkv, G*Lq, Lk), a fresh tensor
    if scale is not None:
        scores = scores.mul_(scale)  # in place: matmul's backward needs its inputs, not its output
    if extra.softcap is not None:
        c = extra.softcap
        scores = scores.div_(c).tanh_().mul_(c) if w_buf is not None else torch.tanh(scores / c) * c
    if bias is not None:
        scores = scores.add_(bias)  # in place: neither matmul's nor tanh's * c backward needs its output
    if keep is not None:
        scores = scores.masked_fill_(~keep, float("-inf"))
    # With a sink: e^s / (sum e^s + e^sink) = softmax(s) * sigmoid(logsumexp(s) - sink), a factor per row:
    # it scales the output (G*Lq x Dv) rather than the weights (G*Lq x Lk) unless those are returned.
    sink_share = None
    if extra.sinks is not None:  # the log-sum-exp in float32 at least: rounded to bf16 it is off by ~1%
        wide = scores.float() if scores.dtype in (torch.float16, torch.bfloat16) else scores
        lse = torch.logsumexp(wide, dim=-1, keepdim=True)  # (B, Hkv, G*Lq, 1)
        # a row with no key (Lk = 0) gets share 0, also in a head with no sink, where -inf - -inf is NaN
        gap = (lse - extra.sinks.to(lse.dtype)).masked_fill(torch.isneginf(lse), float("-inf"))
        sink_share = torch.sigmoid(gap).to(scores.dtype)  # (B, Hkv, G*Lq, 1)
    # In place where no backward pass needs the scores (a buffer given, or no autograd): a second (..., Lk)
    # tensor is a fresh allocation whose first touch costs as much as the softmax itself (page faults on
    # a VM: a cached pattern at 256 tokens took 2.5 ms a layer out of place, 0.7 ms in place)
    in_place = w_buf is not None or not scores.requires_grad
    weights = torch.softmax(scores, dim=-1, out=scores) if in_place else torch.softmax(scores, dim=-1)
    del scores  # the one (B, Hkv, G*Lq, Lk) tensor alive from here on is `weights`
    if sink_share is not None and extra.weights_out:
        weights = weights.mul_(sink_share) if in_place else weights * sink_share
        sink_share = None
    dropped = F.dropout(weights, p=dropout) if dropout > 0 else weights
    out_ = torch.matmul(dropped, v, out=o_buf)  # (B, Hkv, G*Lq, Dv)
    if sink_share is not None:
        out_ = out_.mul_(sink_share) if o_buf is not None else out_ * sink_share
    return out_, weights  # (B, Hkv, G*Lq, Dv), (B, Hkv, G*Lq, Lk)


SHORT_KEYS = 32  # keys at and below which ...
MANY_HEADS = 64  # ... and B*H at and above which short_attention beats the CPU's fused kernel


def _many_short_rows(b: int, h: int, lq: int, lk: int) -> bool:
    """B*H >= :data:`MANY_HEADS` rows of Lq >= 2 queries over 1..:data:`SHORT_KEYS` keys (no keys: the fused
    kernel's zeros, every row dead); a decode step (Lq = 1) and long rows leave at the first tests."""
    return 2 <= lq and 1 <= lk <= SHORT_KEYS and b * h >= MANY_HEADS


def serves_short(q: Tensor, k: Tensor, is_causal: bool) -> bool:
    """Whether :func:`short_attention` is the faster way to run q (B, H, Lq, D) against k (B, Hkv, Lk, D) on
    the CPU: many short rows (1 <= Lk <= :data:`SHORT_KEYS`, B*H >= :data:`MANY_HEADS`, Lq >= 2), where the
    fused kernel's per-head set-up costs more than the whole product (B=64, H=8, L=5: 0.26x its forward
    time, 0.37x forward+backward; it wins from about 128 keys on, and at Lq = 1)."""
    b, h, lq, _ = q.shape
    lk = k.shape[2]
    return (  # the shape first
        _many_short_rows(b, h, lq, lk)
        and (lq == lk or not is_causal)
        and q.dtype in (torch.float32, torch.float64)
        and q.device.type == "cpu"
    )


def short_attention(q: Tensor, k: Tensor, v: Tensor, is_causal: bool, scale: float) -> Tensor:
    """softmax(q k^T * scale, causal when asked, Lq == Lk) @ v with grouped K/V used as they are:
    q (B, H, Lq, Dk), k (B, Hkv, Lk, Dk), v (B, Hkv, Lk, Dv) -> (B, H, Lq, Dv) (see :func:`serves_short`).

    Laid out for ``bmm``: each of q, k, v copied once to (B*Hkv, rows, D) where it is a strided view (the
    module's heads of one fused projection), k used transposed as it is. The softmax over so few keys is
    written out (max, exp, sum): torch's kernel costs more than the two products on rows of 5 keys.
    At the seed shape (B=64, L=5, H=8, D=64, the module's strided heads) this takes 0.56x the time of
    ``_attend``'s 4-D matmuls when called alone in a loop, 0.8x interleaved with other kernels."""
    b, h, lq, dk = q.shape
    hkv, lk, dv = k.shape[1], k.shape[2], v.shape[-1]
    head_first = h == hkv and all(head_major(t) for t in (q, k, v))
    if head_first:  # (H, B, L, D) storage: batches in (H, B) order are views, nothing copied
        qg, kb, vb = (t.transpose(0, 1).reshape(h * b, t.shape[2], t.shape[3]) for t in (q, k, v))
    else:
        qg = group_queries(q, hkv).reshape(b * hkv, (h // hkv) * lq, dk)  # (B*Hkv, G*Lq, Dk)
        kb, vb = k.reshape(b * hkv, lk, dk), v.reshape(b * hkv, lk, dv)  # (B*Hkv, Lk, D*)
    s = torch.bmm(qg, kb.transpose(1, 2)).mul_(scale)  # (N, G*Lq, Lk), N = B*Hkv batches
    if is_causal:  # Lq == Lk: the same (Lq, Lk) triangle for each of the G query groups
        keep = group_mask(causal(lq, lk, device=q.device).view(1, 1, lq, lk), h, hkv, lq)  # (1, 1, G*Lq, Lk)
        s = s.masked_fill_(~keep.reshape(-1, lk), float("-inf"))  # (G*Lq, Lk) over (N, G*Lq, Lk)
    s = s.sub_(s.detach().amax(-1, keepdim=True))  # a constant shift per row: no gradient flows through it
    if torch.is_grad_enabled() and s.requires_grad:
        e = s.exp()
        w = e / e.sum(-1, keepdim=True)
    else:  # nothing to keep for a backward pass: in place
        w = s.exp_()
        w = w.div_(w.sum(-1, keepdim=True))
    out = torch.bmm(w, vb)  # (N, G*Lq, Dv)
    if head_first:
        return out.view(h, b, lq, dv).transpose(0, 1)  # (B, H, Lq, Dv), a view
    return ungroup(out.view(b, hkv, -1, dv), h)  # (B, H, Lq, Dv)


def head_major(t: Tensor) -> bool:
    """Whether heads (B, H, L, D) are stored head-major, as (H, B, L, D) contiguous (what
    :func:`project_head_major` gives): then (H*B, L, D) is a view."""
    return t.transpose(0, 1).is_contiguous()


HEAD_MAJOR_TOKENS = 1024  # tokens (B*L) up to which one GEMM per head beats the fused projection ...
HEAD_MAJOR_MIN_DIM = 16  # ... for heads of at least this many dims ...
HEAD_MAJOR_PRODUCTS = 48  # ... and at most this many products (H + 2*Hkv)


def serves_head_major(x: Tensor, weight: Tensor, bias: Tensor | None, heads: int, head_dim: int) -> bool:
    """Whether :func:`project_head_major` is the faster way to project ``x`` (B, L, E) with ``weight``
    (rows of ``heads`` query heads of ``head_dim`` and their keys and values, E) on this call: float32 on
    the CPU, no autograd, at most :data:`HEAD_MAJOR_TOKENS` tokens, heads of at least
    :data:`HEAD_MAJOR_MIN_DIM` dims in at most :data:`HEAD_MAJOR_PRODUCTS` products, and short rows of
    many heads (what :func:`serves_short` serves: its copies of q, k and v then go too).

    Measured on a Zen 4 (AMD EPYC family 25 model 17, 2 threads), the projection alone, one ``baddbmm``
    of the per-head (B*L, E) x (E, D) products against one ``linear``: 0.92-0.96x the time at 320 tokens
    and E = 512 with D >= 64, 0.76-0.85x at E = 1,024, 1.0x at 1,024 tokens, 1.17-1.33x at 4,096 (hence
    the token bound); with D = 8 it takes 2.6-4.1x, with D = 16 1.2-1.3x. The module, which also saves
    the three head copies, timed in rounds of random order against torch's MHA (B = 64, L = 5): at
    E = 512, H = 8 1.10-1.14x torch against 1.02-1.03x the fused way (one run 0.99x against 0.94x); at
    E = 256 with D = 64 1.05-1.21x against 0.98-1.01x, with D = 16 1.27x against 1.16x; at E = 512 with
    D = 32 (48 products) 1.03x against 0.95x; but 0.87x against 0.94x with 96 products of D = 16 (B = 16,
    L = 20, H = 32), 0.70x against 1.15x at D = 8 (E = 128) and 0.82x against 1.01x at D = 8 (E = 64)
    -- hence the bounds on D and on the products."""
    b, length, _ = x.shape
    return (
        _many_short_rows(b, heads, length, length)
        and b * length <= HEAD_MAJOR_TOKENS
        and head_dim >= HEAD_MAJOR_MIN_DIM
        and weight.shape[0] <= HEAD_MAJOR_PRODUCTS * head_dim
        and x.dtype == torch.float32
        and x.device.type == "cpu"
        and not needs_grad(x, weight, bias)
    )


def project_head_major(x: Tensor, weight: Tensor, bias: Tensor | None, heads: int) -> Tensor:
    """``linear(x, weight, bias)`` for ``x`` (B, L, E), ``weight`` (heads*D, E), split into heads and
    stored head-major: (B, heads, L, D), a view of (heads, B, L, D) contiguous storage."""
    b, length, e = x.shape
    d = weight.shape[0] // heads
    w = weight.view(heads, d, e).transpose(1, 2)  # (heads, E, D), a view
    xs = x.reshape(1, b * length, e).expand(heads, b * length, e)  # (heads, B*L, E), one copy of x at most
    y = torch.bmm(xs, w) if bias is None else torch.baddbmm(bias.view(heads, 1, d), xs, w)  # (heads, B*L, D)
    return y.view(heads, b, length, d).transpose(0, 1)  # (B, heads, L, D)


def _native_bf16() -> bool:
    """Whether this CPU multiplies bfloat16 in hardware (AVX-512 BF16 or AMX), where oneDNN's ``bmm`` runs at
    about twice the float32 rate; elsewhere bfloat16 products are widened in software."""
    probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")  # private, so looked up with care
    return any(bool(getattr(torch.cpu, name, lambda: False)()) for name in probes)


NATIVE_BF16 = _native_bf16()
BF16_BLOCK_BYTES = 2 << 20  # one block of bfloat16 scores: in L2, and under glibc's mmap threshold


def serves_bf16(q: Tensor, k: Tensor, v: Tensor, is_causal: bool) -> bool:
    """Whether :func:`bf16_attention` is the faster way to run an unmasked, non-causal bfloat16 call on
    this CPU: hardware bfloat16 products (:data:`NATIVE_BF16`), more than :data:`SHORT_KEYS` keys, and
    nothing to differentiate. There the fused kernel multiplies bfloat16 at about 90 GFLOP/s on a Zen 4
    (family 25 model 17, 2 threads) where oneDNN's ``bmm`` runs about twice as fast: B=8, H=8, L=512, D=64
    took 0.61-0.64x the fused kernel's time this way. Causal calls stay on the fused kernel, which skips
    the blocks above the diagonal; float16 and float32 too (they measured 8.4x and 1.5x its time)."""
    return (
        NATIVE_BF16
        and q.dtype == torch.bfloat16
        and q.device.type == "cpu"
        and not is_causal
        and k.shape[2] > SHORT_KEYS
        and not needs_grad(q, k, v)
    )


def bf16_attention(q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
    """softmax(q k^T * scale) @ v in blocks of :data:`BF16_BLOCK_BYTES` of scores (see :func:`serves_bf16`):
    q (B, H, Lq, Dk), k (B, Hkv, Lk, Dk), v (B, Hkv, Lk, Dv) -> (B, H, Lq, Dv), grouped K/V used as they are.

    q is scaled while it is copied to ``bmm`` layout (one pass); each block's scores are one ``bmm``, an
    in-place softmax (float32 inside, as torch's bfloat16 softmax is) and a ``bmm`` into the output, while
    the block is in cache. No (B, H, Lq, Lk) tensor is ever allocated."""
    b, h, lq, dk = q.shape
    hkv, lk, dv = k.shape[1], k.shape[2], v.shape[-1]
    rows = (h // hkv) * lq  # query rows per kv head
    qs = torch.mul(q, scale, out=q.new_empty(b, h, lq, dk))  # (B, H, Lq, Dk), contiguous
    qg = qs.view(b * hkv, rows, dk)  # (B*Hkv, G*Lq, Dk)
    kk, vv = k.reshape(b * hkv, lk, dk), v.reshape(b * hkv, lk, dv)  # (B*Hkv, Lk, D)
    out = q.new_empty(b * hkv, rows, dv)  # (B*Hkv, G*Lq, Dv)
    per_row = lk * q.element_size()
    pairs = max(1, BF16_BLOCK_BYTES // (rows * per_row))  # whole (batch, kv head) pairs per block ...
    step = rows if rows * per_row <= BF16_BLOCK_BYTES else max(16, BF16_BLOCK_BYTES // per_row)
    for i in range(0, b * hkv, pairs):  # ... or, where one pair's scores are larger, its rows in parts
        p = slice(i, i + pairs)
        for r in range(0, rows, step):
            s = torch.bmm(qg[p, r : r + step], kk[p].transpose(1, 2))  # (pairs, rows, Lk)
            torch.bmm(torch.softmax(s, -1, out=s), vv[p], out=out[p, r : r + step])
    return ungroup(out.view(b, hkv, rows, dv), h)  # (B, H, Lq, Dv)


def _sl(t: Tensor | None, dim: int, s: slice) -> Tensor | None:
    """Slice ``t`` along ``dim`` unless that dim broadcasts (size 1)."""
    return t if t is None or t.shape[dim] == 1 else t.narrow(dim, s.start, s.stop - s.start)


def _attend_blocked(
    qg: Tensor,
    k: Tensor,
    v: Tensor,
    bias: Tensor | None,
    keep: Tensor | None,
    extra: _Extras,
    block_bytes: int,
) -> tuple[Tensor, Tensor]:
    """:func:`_attend` over blocks of (batch, kv head) pairs written into preallocated outputs.

    Scores, softmax and the weights @ v product of one block run while the block is in cache;
    without blocking each is a pass over a (B, Hkv, G*Lq, Lk) tensor in main memory.
    """
    b, hkv, glq, _ = qg.shape
    lk = k.shape[2]
    weights = qg.new_empty(b, hkv, glq, lk)  # (B, Hkv, G*Lq, Lk)
    out = qg.new_empty(b, hkv, glq, v.shape[-1])  # (B, Hkv, G*Lq, Dv)
    per_head = glq * lk * qg.element_size()
    heads = max(1, min(hkv, block_bytes // per_head))  # kv heads per block
    for i in range(b):
        bi = slice(i, i + 1)
        for j in range(0, hkv, heads):
            hj = slice(j, min(hkv, j + heads))
            blk = [t[bi, hj] for t in (qg, k, v, out, weights)]
            mb, mk = (_sl(_sl(t, 0, bi), 1, hj) for t in (bias, keep))
            part = _Extras(extra.softcap, _sl(extra.sinks, 1, hj), extra.weights_out)
            _attend(blk[0], blk[1], blk[2], mb, mk, part, out=(blk[3], blk[4]))
    return out, weights
