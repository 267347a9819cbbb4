"""Spans of a block of queries through PyTorch's fused CPU attention kernel, joined by their log-sum-exp
(the ``blocked`` backend's fast path, :mod:`.blocked`).

Dimensions: Bs batch rows, H query heads, Hkv kv heads, G = H // Hkv, n queries of a block, w keys of a
span, Dk/Dv head dims.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from ..masks import attn_mask, open_dead_rows
from ._common import group_mask, unread_zeroed, zero_dead_rows

__all__ = ["fused", "serial"]

Span = tuple[int, int, "Tensor | None", "Tensor | None"]  # keys j0:j1, keep, bias (blocked._Span)


@contextlib.contextmanager
def serial() -> Iterator[None]:
    """One torch thread inside: a tile's mask ops (a few hundred thousand elements each) are cheaper run
    serially than as parallel regions that wait for the other threads (on a busy machine, by far: 3x for
    a band's forward at load 7, 1.25x for its training step, on 2 cores).

    torch's thread count is process-wide, so it is changed only while the calling thread is the process's
    only Python thread: no other thread can observe it or race on restoring it. With other threads alive
    (a server, a data-loading thread) the ops run on the shared pool, at the cost above."""
    threads = torch.get_num_threads()
    if threads == 1 or threading.active_count() > 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def fused(qb: Tensor, k: Tensor, v: Tensor, spans: Sequence[Span], scale: float, sinks: Tensor | None,
           grad: bool, cut: Callable[[int, int], tuple[Tensor, Tensor]],
           dest: Tensor | None = None) -> Tensor:  # fmt: skip
    """One block of queries qb (Bs, H, n, Dk) over its spans, each through PyTorch's fused CPU attention
    kernel (the G query heads of a kv head stacked as rows) with the span's mask and bias as one additive
    mask -> (Bs, H, n, Dv).

    Without autograd the spans (and the sinks) are joined by their log-sum-exp, which the kernel returns,
    in place in ``dest`` (Bs, H, n, Dv), the block's rows of the call's output (:func:`_span_into`). With
    autograd (whose log-sum-exp has no gradient) there is one span and no sink (the caller checks).
    """
    b, h, n, dk = qb.shape
    hkv, dv = k.shape[1], v.shape[3]
    qg = qb.reshape(b, hkv, h // hkv * n, dk)  # (Bs, Hkv, G*n, Dk), heads stacked
    if not grad and dest is None:
        dest = qb.new_empty(b, h, n, dv)  # (Bs, H, n, Dv)
    lse: Tensor | None = None
    for j0, j1, keep, bias in spans:
        with serial():
            keep, bias, row_ok = open_dead_rows(
                keep, bias
            )  # rows that see nothing here: re-opened, zeroed below
            mask = attn_mask(keep, bias, qg.dtype)  # the bias (or 0) where allowed, -inf elsewhere
        if mask is not None:
            mask = group_mask(mask.expand(*mask.shape[:3], j1 - j0), h, hkv, n)  # (Bs|1, Hkv|1, G*n|1, w)
        qs, kt, vt = unread_zeroed(qb, *cut(j0, j1), keep, bias, row_ok, scale)  # (Bs, *, w, D)
        qs = qg if qs is qb else qs.reshape(b, hkv, h // hkv * n, dk)  # hidden garbage: never read
        if grad:
            o = F.scaled_dot_product_attention(qs, kt, vt, attn_mask=mask, scale=scale)  # (Bs, Hkv, G*n, Dv)
            return zero_dead_rows(o.reshape(b, h, n, dv), row_ok)  # (Bs, H, n, Dv)
        assert dest is not None
        lse = _span_into(dest, lse, qs, kt, vt, mask, row_ok, scale)
    assert dest is not None
    if lse is None:
        return dest.zero_()
    if sinks is not None:
        sink = sinks.to(qg.dtype).view(1, h, 1, 1).expand(b, h, n, 1)  # (Bs, H, n, 1)
        _join(dest, lse, None, sink)
    return dest


KERNEL_OUT = 1 << 17
"""Bytes of one fused-kernel output without autograd: a block's kv heads go through the kernel a few at a
time, so what it returns beside the call's output stays this small (two heads of 256 queries x 64 in
float32), in at most :data:`CALLS` calls a span (see :func:`_span_into`)."""

CALLS = 4
"""Most kernel calls one span is split into: four cost 7-11% of a two-sided window's time at H = 8 (Zen 1);
a model with many or wide heads gets larger pieces rather than a call per head."""


def _span_into(dest: Tensor, lse: Tensor | None, qs: Tensor, kt: Tensor, vt: Tensor, mask: Tensor | None,
               row_ok: Tensor | None, scale: float) -> Tensor:  # fmt: skip
    """One span of a block, without autograd: qs (Bs, Hkv, G*n, Dk) against kt/vt (Bs, Hkv, w, D) through
    the fused kernel, joined in place into ``dest`` (Bs, H, n, Dv) by the log-sum-exps ``lse`` (Bs, H, n, 1)
    of the spans before it (``None``: the first, written as it is) -> the log-sum-exps with this span.

    A block holds one kernel output of at most :data:`KERNEL_OUT` bytes beside the call's output (its kv
    heads a few at a time) and no partial sums. Joined out of place (``acc * exp(..) + o * exp(..)``: five
    block-sized tensors at once) a two-sided window of 512 at L = 16,384 (H = 8, D = 64, float32) grew
    35.8-37.9 MiB against the unmasked call's 32.7-32.9 (Zen 1, fresh processes); in place, all heads at
    once, 33.5-34.1; two heads at a time, see docs/performance.md.
    """
    b, h, n, dv = dest.shape
    hkv = qs.shape[1]
    g = h // hkv
    per_head = max(1, b * g * n * dv * dest.element_size())  # bytes of one kv head's kernel output
    step = max(-(-hkv // CALLS), KERNEL_OUT // per_head)  # kv heads a kernel call: at most CALLS calls
    first = lse is None
    if first:
        lse = dest.new_empty(b, h, n, 1)
    assert lse is not None
    for c0 in range(0, hkv, step):
        c1 = min(hkv, c0 + step)
        m = mask if mask is None or mask.shape[1] == 1 else mask[:, c0:c1]
        o, part = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            qs[:, c0:c1], kt[:, c0:c1], vt[:, c0:c1], 0.0, False, attn_mask=m, scale=scale
        )  # (Bs, c, G*n, Dv), (Bs, c, G*n)
        heads = slice(c0 * g, c1 * g)
        o, part = o.reshape(b, (c1 - c0) * g, n, dv), part.reshape(b, (c1 - c0) * g, n, 1)
        if row_ok is not None:
            ok = row_ok if row_ok.shape[1] == 1 else row_ok[:, heads]
            o, part = o.mul_(ok), part.masked_fill_(~ok, float("-inf"))
        with serial():
            if first:
                dest[:, heads].copy_(o)
                lse[:, heads].copy_(part)
            else:
                lse[:, heads].copy_(_join(dest[:, heads], lse[:, heads], o, part)[1])
        del o, part  # before the next kernel call makes its own
    return lse


def _join(acc: Tensor, lse: Tensor, o: Tensor | None, part: Tensor) -> tuple[Tensor, Tensor]:
    """Two normalised partial outputs (Bs, H, n, Dv) with their log-sum-exps (Bs, H, n, 1) -> one, in place
    in ``acc`` (``o`` is rescaled in place too; ``None``: a sink, which carries no value)."""
    with serial():
        total = torch.logaddexp(lse, part)  # (Bs, H, n, 1)
        shift = total.masked_fill(torch.isneginf(total), 0.0)  # rows with nothing so far stay 0
        acc.mul_(torch.exp(lse - shift))
        if o is not None:
            acc.add_(o.mul_(torch.exp(part - shift)))
        return acc, total
