"""The ``blocked`` backend: attention whose cost follows the allowed (query, key) pairs, on the CPU.

It serves CPU calls whose masking is given as functions (``mask=``/``bias=`` functions, segment ids)
and calls with a softcap or attention sinks, and it never forms a (Lq, Lk) tensor. Two paths:

* **varlen** -- packed sequences (segment ids that form one contiguous run per id in every batch row):
  each run is its own small dense attention (``scaled_dot_product_attention`` on the slices, its native
  causal kernel when the run's causal diagonal starts at its corner), so a packed batch costs the sum of
  its sequences. Inputs are cut with ``split`` and outputs joined with ``cat``, whose backwards are one
  ``cat`` and views: training on packed batches costs what the sequences cost one by one.
* **tiled** -- everything else: blocks of ``block_q`` queries against spans of at most ``span_k`` keys.
  Per block and span the mask pieces are evaluated on that tile's index grid only (the functions once
  for every batch row and head their result does not depend on: the result's broadcast shape), the
  keys no query of the block may see are cut off the span's ends (a span with none is skipped; keys
  beyond the causal diagonal or outside a library mask function's ``key_range`` -- sliding window,
  chunked, ... -- are never evaluated; on a structured call the function's values on partial tiles are
  kept across calls, :mod:`multihead.core.masks.memo`), and an online softmax (running max and
  denominator, flash-attention style) joins the spans. Sinks start the denominator; rows that see no
  key end with output 0. Autograd runs through the tile ops (it keeps tile-sized pieces, so training
  memory follows the visible pairs).

Dimensions: B batch, H query heads, Hkv kv heads, G = H // Hkv, Lq/Lk lengths, Dk/Dv head dims,
n queries of one block, w keys of one span.

Equals, for each query i of batch row b and head h (the dense formula, never formed)::

    s_ij = softcap * tanh(scale * q_i . k_j / softcap)  (or scale * q_i . k_j)  + bias[b, h, i, j]
    allowed_ij = mask[b, h, i, j] & mask_fn(b, h, i, j) & q_ids[b, i] == kv_ids[b, j] >= 0
                 & (j <= i + Lk - Lq if causal)
    out_i = sum_j exp(s_ij) v_j / (exp(sinks[h]) + sum_j exp(s_ij))   over allowed j; 0 if none
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from ..checks import is_int, is_tracing
from ..masks import MaskFunction, Normalized, attn_mask, causal, combine, evaluate_block, open_dead_rows
from ..masks.blocks import BlockMaskFunction, Blocks, captured_versions, structure
from ..masks.dense import index_grid
from ..masks.evaluate import call_fn
from ..segments import Run, packed_runs
from ._common import kv_for_cpu_kernel, unread_zeroed, zero_dead_rows
from ._fused import fused, serial
from ._online import OnlineSoftmax
from ._pieces import pieces
from .base import AttentionCall

__all__ = ["BlockedBackend", "packed_runs"]

_DTYPES = (torch.float32, torch.float64)
PROBE = 16384  # (query, key) pairs of one mask probe: half PyTorch's grain size, so it runs serially


class BlockedBackend:
    """``block_q`` queries per block, at most ``span_k`` keys per computed span (its scores are
    (B, H, block_q, span_k)); ``dense_min_pairs``: the Lq*Lk from which a call whose masks are all
    dense tensors but that has a softcap or sinks comes here rather than to ``math``.

    ``block_k``: the key granularity of the tile structure (empty / partial / full tiles); ``full_min``:
    the fewest keys a run of full tiles has to run unmasked as a kernel call of its own (narrower runs are
    masked with their partial neighbours: a call and a log-sum-exp merge cost more than the mask).

    256 queries a block: each block costs a fused-kernel call, so fewer, larger blocks amortise it, while
    smaller ones compute fewer masked pairs around a band's edges. With the tile structure, plain lambdas
    at L = 4,096 (H = 8, D = 64, one thread, CPU seconds, machine busy): causal window 512 0.120 / 0.107 /
    0.103, two-sided 0.186 / 0.176 / 0.185, chunked 0.084 / 0.062 / 0.062 at 384 / 256 / 128 queries a
    block; prefix-LM 0.282 / 0.283 / 0.322. (Before the structure, by probes: 384 was best.)"""

    name = "blocked"

    def __init__(
        self,
        *,
        block_q: int = 256,
        span_k: int = 2048,
        block_k: int = 128,
        full_min: int = 512,
        dense_min_pairs: int = 1 << 20,
    ) -> None:
        for arg, value in (
            ("block_q", block_q), ("span_k", span_k), ("block_k", block_k), ("full_min", full_min),
            ("dense_min_pairs", dense_min_pairs),
        ):  # fmt: skip
            if not is_int(value, 1):
                raise ValueError(f"{arg} must be a positive int, got {value!r}")
        self.full_min = full_min
        self.block_q, self.span_k, self.block_k, self.dense_min_pairs = (
            block_q,
            span_k,
            block_k,
            dense_min_pairs,
        )

    def why_not(self, call: AttentionCall) -> Iterator[str]:
        q, m = call.q, call.masks
        if q.device.type != "cpu":
            yield f"blocked runs on the CPU only; q is on {q.device.type} (flex serves CUDA calls with functions)"
        if call.return_weights:
            yield "blocked never forms the (Lq, Lk) weights: return_weights=True is served by math (dense)"
        if call.dropout > 0:
            yield "blocked has no attention dropout (use dropout=0.0, or backend='math' with dense masks)"
        if q.dtype not in _DTYPES:
            yield f"blocked supports dtypes {_DTYPES}, got {q.dtype} (math serves it)"
        extras = call.softcap is not None or call.sinks is not None
        if not m.has_functions and not extras:
            yield "no mask/bias function, segment ids, softcap or sinks: sdpa's fused kernel serves this faster"
        elif not m.has_functions and q.shape[2] * call.k.shape[2] < self.dense_min_pairs:
            yield (
                f"dense masks with softcap/sinks at Lq*Lk = {q.shape[2] * call.k.shape[2]} < "
                f"{self.dense_min_pairs}: math's single pass is faster at this size"
            )

    def __call__(self, call: AttentionCall) -> tuple[Tensor, Tensor | None]:
        m = call.masks
        q, k, v = unread_zeroed(call.q, call.k, call.v, m.mask, m.bias, m.row_ok, call.scale)
        if q is not call.q or k is not call.k or v is not call.v:  # hidden by the dense masks: never read
            call = replace(call, q=q, k=k, v=v)
        runs = packed_runs(*m.segments) if m.segments is not None else None
        out = self._varlen(call, runs) if runs is not None else self._tiled(call, _Frame.of(call))
        return zero_dead_rows(out, m.row_ok), None

    # ------------------------------------------------------------------------------------------
    # tiled path
    # ------------------------------------------------------------------------------------------

    def _tiled(self, call: AttentionCall, frame: _Frame, q: Tensor | None = None, k: Tensor | None = None,
               v: Tensor | None = None) -> Tensor:  # fmt: skip
        """Attention of q (Bs, H, Lq', Dk) on k/v (Bs, Hkv, Lk', D) -> (Bs, H, Lq', Dv), tile by tile."""
        q = call.q if q is None else q
        k = call.k if k is None else k
        v = call.v if v is None else v
        b, h, lq, dk = q.shape
        hkv, lk, dv = k.shape[1], k.shape[2], v.shape[3]
        g = h // hkv
        softcap, sinks = call.softcap, call.sinks
        factor = call.scale / softcap if softcap is not None else call.scale
        grad = torch.is_grad_enabled()  # out of place (autograd) or in place (inference)
        out = None if grad else q.new_empty(b, h, lq, dv)  # (Bs, H, Lq', Dv)
        blocks: list[Tensor] = []
        plan = self._plan(call, frame, lq, lk, q.dtype, grad)  # (i0, i1, spans) of each block of queries
        qs = ks = vs = None  # without autograd: plain slices as the blocks come
        if grad:  # every block planned first: q, k, v cut with one gradient buffer each (see _pieces)
            plan = list(plan)
            qs = pieces(q, [(i0, i1) for i0, i1, _ in plan])
            bounds = [(sp.j0, sp.j1) for _, _, spans in plan for sp in spans]
            ks, vs = pieces(k, bounds), pieces(v, bounds)

        def cut(j0: int, j1: int) -> tuple[Tensor, Tensor]:  # (Bs, Hkv, w, Dk), (Bs, Hkv, w, Dv)
            return (k[:, :, j0:j1], v[:, :, j0:j1]) if ks is None or vs is None else (ks[j0, j1], vs[j0, j1])

        for i0, i1, spans in plan:
            n = i1 - i0
            qb = q[:, :, i0:i1] if qs is None else qs[i0, i1]  # (Bs, H, n, Dk)
            dest = None if out is None else out[:, :, i0:i1]  # (Bs, H, n, Dv) view of the output
            if softcap is None and (grad and len(spans) == 1 and sinks is None or not grad and dk == dv):
                block = fused(qb, k, v, spans, call.scale, sinks, grad, cut, dest)
            else:
                dead = _rows_seeing_nothing(spans)  # (Bs|1, H|1, n, 1) or None
                qz = qb if dead is None else qb.masked_fill(dead, 0.0)  # their garbage: never read
                qt = (qz * factor).reshape(b, hkv, g * n, dk)  # (Bs, Hkv, G*n, Dk)
                state = OnlineSoftmax.start(b, h, n, dv, q, sinks)
                for j0, j1, keep, bias in spans:
                    kt, vt = cut(j0, j1)  # (Bs, Hkv, w, D); hidden garbage: never read
                    _, kt, vt = unread_zeroed(qb, kt, vt, keep, bias, None, factor)
                    s = torch.matmul(qt, kt.transpose(-2, -1)).view(b, h, n, j1 - j0)  # (Bs, H, n, w)
                    if softcap is not None:
                        s = s.tanh_().mul_(softcap) if not grad else torch.tanh(s) * softcap
                    if bias is not None:
                        s = s.add_(bias) if not grad else s + bias
                    if keep is not None:
                        s = (
                            s.masked_fill_(~keep, float("-inf"))
                            if not grad
                            else s.masked_fill(~keep, float("-inf"))
                        )
                    state.add(s, vt, g, grad)
                block = state.finish()  # (Bs, H, n, Dv)
            if dest is not None and block is not dest:
                with serial():
                    dest.copy_(block)
            else:
                blocks.append(block)
        if out is not None:
            return out
        return torch.cat(blocks, dim=2) if blocks else q.new_zeros(b, h, lq, dv)  # (Bs, H, Lq', Dv)

    def _plan(self, call: AttentionCall, frame: _Frame, lq: int, lk: int, dtype: torch.dtype,
              grad: bool) -> Iterator[tuple[int, int, list[_Span]]]:  # fmt: skip
        """(i0, i1, the key spans to compute) of each block of queries i0:i1."""
        tiles = frame.structure(self.block_q, self.block_k)  # which tiles are empty, partial, full
        fn = call.masks.mask_fn
        if isinstance(fn, BlockMaskFunction) and tiles is not None and not is_tracing():
            # a block mask's structure outlives what its functions read (a plain function's structure, and
            # the memo with it, is rebuilt by structure() instead): its kept tile values are checked here
            for f in (fn,) if fn.inner is fn else (fn, fn.inner):
                tiles.memo.serve(f, captured_versions(f))
        step = self.block_q if tiles is None else tiles.block_q * max(1, self.block_q // tiles.block_q)
        if tiles is not None and isinstance(fn, BlockMaskFunction) and fn.inner is not fn:
            step = tiles.block_q  # one row of a BlockMask's blocks: its mask_mod alone decides inside
        for i0 in range(0, lq, step):
            i1 = min(lq, i0 + step)
            with serial():  # the masks' ops, serially
                if tiles is None:  # no structure: the mask is probed tile by tile
                    spans = list(frame.spans(i0, i1, lk, self.span_k, dtype))  # [_Span]
                else:  # full tiles apart (no mask) where their log-sum-exp is merged; together under autograd
                    full_min = self.full_min if not grad else 0
                    spans = list(frame.block_spans(i0, i1, lk, self.span_k, dtype, tiles, full_min))
            yield i0, i1, spans

    # ------------------------------------------------------------------------------------------
    # varlen path
    # ------------------------------------------------------------------------------------------

    def _varlen(self, call: AttentionCall, runs: list[list[Run]]) -> Tensor:
        """Each packed sequence as its own attention; queries outside every run (padding, or an id with
        no keys) get output 0.

        Without autograd each run's output is written into one (B, Lq, H, Dv) buffer, returned as its
        (B, H, Lq, Dv) view: no ``cat`` of the pieces (a second copy of the output, 3.5% of the call at
        L = 4,096 in three documents), and the module's head merge after it is a view. With autograd the
        pieces are joined by ``cat``, whose backward is views."""
        q, k, v = call.q, call.k, call.v
        b, h, lq, lk, dv = q.shape[0], q.shape[1], q.shape[2], k.shape[2], v.shape[3]
        out = None if torch.is_grad_enabled() else q.new_empty(b, lq, h, dv).transpose(1, 2)  # (B, H, Lq, Dv)
        rows: list[Tensor] = []
        for bi, row in enumerate(runs):
            qcut = _cuts([(r[0], r[1]) for r in row], lq)
            kcut = _cuts([(r[2], r[3]) for r in row], lk)
            kp = dict(zip(kcut[0], k[bi].split(kcut[1], dim=1), strict=True))  # start -> (Hkv, len, Dk)
            vp = dict(zip(kcut[0], v[bi].split(kcut[1], dim=1), strict=True))  # start -> (Hkv, len, Dv)
            at = {r[0]: r for r in row}
            pieces = []
            for start, piece in zip(qcut[0], q[bi].split(qcut[1], dim=1), strict=True):  # (H, len, Dk)
                run, n = at.get(start), piece.shape[1]
                if run is None:  # padding, or an id with no keys: output 0
                    o = q.new_zeros(h, n, dv)
                else:
                    ki, vi = kp[run[2]][None], vp[run[2]][None]  # (1, Hkv, len, D)
                    o = self._one_run(call, bi, run, piece[None], ki, vi)[0]  # (H, len, Dv)
                if out is not None:
                    out[bi, :, start : start + n] = o
                else:
                    pieces.append(o)
            if out is None:
                rows.append(torch.cat(pieces, dim=1) if pieces else q.new_zeros(h, lq, dv))  # (H, Lq, Dv)
        if out is not None:
            return out
        if not rows:
            return q.new_zeros(b, h, lq, dv)  # B = 0
        return rows[0][None] if len(rows) == 1 else torch.stack(rows)  # (B, H, Lq, Dv)

    def _one_run(self, call: AttentionCall, bi: int, run: Run, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """q (1, H, n, Dk) against k/v (1, Hkv, w, D) of one packed sequence -> (1, H, n, Dv)."""
        qs, qe, ks, ke = run
        frame = replace(_Frame.of(call), b0=bi, b1=bi + 1, q0=qs, k0=ks, segments=False)
        if call.softcap is not None or call.sinks is not None:
            return self._tiled(call, frame, q, k, v)
        n, w = qe - qs, ke - ks
        keep, bias = replace(frame, causal=False).tile(0, n, 0, w, q.dtype)  # (1|1, H|1, n|1, w|1) or None
        is_causal = (  # torch's native causal kernel: NaN rows for a scale <= 0
            frame.is_causal and frame.diagonal == 0 and keep is None and bias is None and call.scale > 0
        )
        if frame.is_causal and not is_causal:  # the run's own triangle joins its mask
            keep = combine(keep, causal(n, w, diagonal=frame.diagonal, device=q.device).view(1, 1, n, w))
        keep, bias, row_ok = open_dead_rows(keep, bias)  # rows that see nothing: re-opened, zeroed below
        q, k, v = unread_zeroed(q, k, v, keep, bias, row_ok, call.scale)  # hidden garbage: never read
        k, v = kv_for_cpu_kernel(q, k, v)  # repeated to H heads before torch 2.9 only
        out = F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=attn_mask(keep, bias),
            is_causal=is_causal,
            scale=call.scale,
            enable_gqa=k.shape[1] != q.shape[1],
        )  # fmt: skip  (1, H, n, Dv)
        return zero_dead_rows(out, row_ok)


# ----------------------------------------------------------------------------------------------
# Packed runs
# ----------------------------------------------------------------------------------------------


def _cuts(spans: list[tuple[int, int]], length: int) -> tuple[list[int], list[int]]:
    """(starts, lengths) of the pieces that cut [0, length) at every edge of ``spans``, gaps included:
    one ``split`` by these lengths, whose backward is one ``cat``."""
    edges = sorted({0, length, *(e for span in spans for e in span)})
    return edges[:-1], [e - s for s, e in zip(edges, edges[1:], strict=False)]


# ----------------------------------------------------------------------------------------------
# The masking of a (sub-)problem, evaluated tile by tile in the call's global indices
# ----------------------------------------------------------------------------------------------


class _Span(NamedTuple):
    """Keys j0:j1 of one block of queries, computed together: ``keep`` (Bs|1, H|1, n, w) or ``None`` (all
    allowed) and ``bias`` (Bs|1, H|1, n|1, w) or ``None``."""

    j0: int
    j1: int
    keep: Tensor | None
    bias: Tensor | None


@dataclass
class _Frame:
    """Masks of the call restricted to batch rows b0:b1, local query i = global q0 + i, key j = k0 + j.

    ``causal`` (default: the call's) and ``segments`` (default: kept) may be switched off for a packed
    run, which applies them itself."""

    m: Normalized
    target: tuple[int, int, int, int]  # (B, H, Lq, Lk) of the whole call: tiles are in its indices
    device: torch.device
    b0: int
    b1: int
    q0: int = 0
    k0: int = 0
    causal: bool | None = None
    segments: bool = True

    @classmethod
    def of(cls, call: AttentionCall) -> _Frame:
        q = call.q
        return cls(call.masks, (*q.shape[:3], call.k.shape[2]), q.device, 0, q.shape[0])  # type: ignore[arg-type]

    @property
    def is_causal(self) -> bool:
        return self.m.causal if self.causal is None else self.causal

    @property
    def diagonal(self) -> int:
        """In local indices, causal lets query i see keys j <= i + diagonal."""
        return self.q0 + self.target[3] - self.target[2] - self.k0

    def tile(
        self, i0: int, i1: int, j0: int, j1: int, dtype: torch.dtype, *, keep: bool = True, bias: bool = True
    ) -> tuple[Tensor | None, Tensor | None]:
        """(keep (Bs|1, H|1, n|1, w|1), bias (Bs|1, H|1, n|1, w|1)) of local queries i0:i1 and keys j0:j1
        (:func:`multihead.masks.evaluate_block` on the tile's global indices)."""
        m = self.m
        if self.is_causal != m.causal or (not self.segments and m.segments is not None):
            m = replace(m, causal=self.is_causal, segments=m.segments if self.segments else None)
        return evaluate_block(
            m, self.target, slice(self.q0 + i0, self.q0 + i1), slice(self.k0 + j0, self.k0 + j1), dtype,
            self.device, batch=slice(self.b0, self.b1), keep=keep, bias=bias,
        )  # fmt: skip

    def spans(self, i0: int, i1: int, lk: int, span: int, dtype: torch.dtype) -> Iterator[_Span]:
        """For queries i0:i1, the key spans to compute: at most ``span`` keys each, with no key that no
        query of the block may see at either end.

        The mask is evaluated on probes of at most :data:`PROBE` (query, key) pairs: small enough to stay
        in cache and under PyTorch's grain size (no thread pool for them), so a probe that finds nothing
        allowed costs a few serial passes over 16K booleans. Probes past the causal diagonal never run.
        """
        n = i1 - i0
        lo, hi = self.key_range(i0, i1, lk)  # keys outside lo:hi: surely masked, never evaluated
        width = max(1, PROBE // n)
        start, end, pieces = 0, 0, []  # the span being gathered: keys start:end, its (width, keep, bias)
        for c0 in range(lo, hi, width):
            c1 = min(hi, c0 + width)
            keep, _ = self.tile(i0, i1, c0, c1, dtype, bias=False)
            a, z = 0, c1 - c0
            if keep is not None:
                cols = keep.reshape(-1, keep.shape[-1]).any(0)  # (w|1,) some query of the block sees key j
                seen = cols.nonzero()
                if seen.numel() == 0:
                    continue  # nothing allowed in this probe: never computed
                if cols.numel() > 1:
                    a, z = int(seen[0]), int(seen[-1]) + 1
                    keep = keep[..., a:z]
                if bool(keep.all()):
                    keep = None
            if pieces and (c0 + a != end or c0 + z - start > span):
                yield self._span(i0, i1, start, end, pieces, dtype)
                pieces = []
            if not pieces:
                start = c0 + a
            end = c0 + z
            pieces.append((z - a, keep))
        if pieces:
            yield self._span(i0, i1, start, end, pieces, dtype)

    def _span(self, i0: int, i1: int, j0: int, j1: int, pieces: list[tuple[int, Tensor | None]],
              dtype: torch.dtype) -> _Span:  # fmt: skip
        """The span of keys j0:j1 from its probes' (width, keep or None = all allowed), with its bias
        (evaluated on the span's keys only)."""
        return _Span(j0, j1, _joined(pieces), self.tile(i0, i1, j0, j1, dtype, keep=False)[1])

    def structure(self, block_q: int, block_k: int) -> Blocks | None:
        """The mask function's tile structure (:func:`multihead.core.masks.blocks.structure`) for a frame of
        the whole call, or ``None`` (no mask function, a packed run, or a function that cannot be bounded)."""
        fn = self.m.mask_fn
        if fn is None or self.q0 or self.k0 or self.b0 or self.b1 != self.target[0]:
            return None
        return structure(fn, self.target, block_q, block_k)

    def block_spans(self, i0: int, i1: int, lk: int, span: int, dtype: torch.dtype, tiles: Blocks,
                    full_min: int) -> Iterator[_Span]:  # fmt: skip
        """For queries i0:i1 (whole rows of ``tiles``), the key spans to compute from the mask function's
        tile structure: empty tiles never; full ones with no mask function (``split``: as spans of their
        own when at least ``full_min`` keys wide, else -- and with ``full_min`` 0 always -- joined with their
        partial neighbours); partial ones with it, evaluated on the span."""
        r0, r1 = i0 // tiles.block_q, -(-i1 // tiles.block_q)
        partial_rows = tiles.allowed[r0:r1] & ~tiles.full[r0:r1]  # (rows, nk)
        allowed, full = tiles.allowed[r0:r1].any(0), tiles.full[r0:r1].all(0)  # (nk,) for the whole block
        pure = partial_rows.all(0)  # partial in every row: the inner function alone decides there
        lo, hi = self.key_range(i0, i1, lk)
        bk = tiles.block_k
        cols = (
            allowed.byte() + (full & allowed & (full_min > 0)).byte()
        ).tolist()  # 0 empty, 1 partial, 2 full
        c0, c1 = lo // bk, -(-hi // bk)
        _narrow_full_to_partial(cols, c0, c1, -(-full_min // bk))
        start, cur = None, 0
        for c in range(c0, c1 + 1):
            here = cols[c] if c < c1 else 0
            if start is not None and (here != cur or (c - start) * bk >= span or here == 0):
                yield self._block_span(i0, i1, max(lo, start * bk), min(hi, c * bk), dtype, tiles,
                                       cur == 2, bool(pure[start:c].all()))  # fmt: skip
                start = None
            if start is None and here:
                start, cur = c, here

    def _block_span(self, i0: int, i1: int, j0: int, j1: int, dtype: torch.dtype, tiles: Blocks, full: bool,
                    pure: bool) -> _Span:  # fmt: skip
        """One span of a structured block: the mask function left out on full tiles, its inner function
        used where every tile is partial in every row (a BlockMask's mask_mod), the whole function else --
        its values from the structure's memo (:mod:`multihead.core.masks.memo`), evaluated on a miss."""
        fn = self.m.mask_fn
        inner = fn.inner if isinstance(fn, BlockMaskFunction) and pure else fn
        keep, bias = replace(self, m=replace(self.m, mask_fn=None)).tile(i0, i1, j0, j1, dtype)
        if full or inner is None:
            return _Span(j0, j1, keep, bias)

        def evaluate() -> Tensor:  # (B|1, H|1, n|1, w|1): the function alone on the tile
            idx = index_grid(self.target, self.device, queries=range(i0, i1), keys=range(j0, j1))
            return call_fn(inner, "mask", idx, self.m.mask_broadcast)

        if is_tracing():
            return _Span(j0, j1, combine(keep, evaluate()), bias)
        return _Span(
            j0, j1, combine(keep, tiles.memo.keep(inner, (self.target, i0, i1, j0, j1), evaluate)), bias
        )

    def key_range(self, i0: int, i1: int, lk: int) -> tuple[int, int]:
        """Local keys lo:hi outside which queries i0:i1 see nothing: the causal diagonal and the mask
        function's own key range (:meth:`multihead.masks.MaskFunction.key_range`), when it has one."""
        lo, hi = 0, min(lk, i1 + self.diagonal) if self.is_causal else lk  # keys past hi: beyond the diagonal
        fn = self.m.mask_fn
        bound = fn.key_range(self.q0 + i0, self.q0 + i1) if isinstance(fn, MaskFunction) else None
        if bound is not None:  # global key indices -> local
            lo, hi = max(lo, bound[0] - self.k0), min(hi, bound[1] - self.k0)
        return lo, max(lo, hi)


def _rows_seeing_nothing(spans: list[_Span]) -> Tensor | None:
    """(Bs|1, H|1, n, 1) True for the block's query rows that no span lets see a key, or None if there are
    none (or no span at all: then no query is read)."""
    seen = None
    for _, _, keep, bias in spans:
        allowed = (
            keep if bias is None else ~torch.isneginf(bias) if keep is None else keep & ~torch.isneginf(bias)
        )
        if allowed is None:
            return None
        row = allowed.any(dim=-1, keepdim=True)  # (Bs|1, H|1, n|1, 1)
        seen = row if seen is None else seen | row
    if seen is None or (not is_tracing() and bool(seen.all())):
        return None
    return ~seen


def _narrow_full_to_partial(cols: list[int], c0: int, c1: int, least: int) -> None:
    """Full runs of fewer than ``least`` tiles among ``cols[c0:c1]`` become partial, in place: a kernel call
    of its own and a log-sum-exp merge cost more than masking a few tiles with their neighbours."""
    c = c0
    while c < c1:
        if cols[c] != 2:
            c += 1
            continue
        end = c
        while end < c1 and cols[end] == 2:
            end += 1
        if end - c < least:
            cols[c:end] = [1] * (end - c)
        c = end


def _joined(pieces: list[tuple[int, Tensor | None]]) -> Tensor | None:
    """The keep mask of a span from its probes' (width, keep or None = all allowed) -> (Bs|1, H|1, n, w)."""
    masks = [m for _, m in pieces if m is not None]
    if not masks:
        return None
    if len(pieces) == 1:
        return masks[0]
    lead = torch.broadcast_shapes(*(m.shape[:-1] for m in masks))  # (Bs|1, H|1, n)
    parts = [torch.ones((), dtype=torch.bool, device=masks[0].device).expand(*lead, w) if m is None
             else m.expand(*lead, w) for w, m in pieces]  # fmt: skip
    return torch.cat(parts, dim=-1)
