"""Ulysses attention: all-to-alls turn sequence shards into head shards, attention runs whole, and back.

Dimensions: B batch, H query heads, Hkv key/value heads (H % Hkv == 0), G = H // Hkv, P ranks in the
group, r this rank, L_q/L_k the total query/key lengths, Lq_r/Lk_r rank r's local lengths, H_r/Hkv_r
the query/key-value heads rank r attends for, w the query heads of one chunk, Dk/Dv head dims.

Before: rank r holds every head of its tokens, q (B, H, Lq_r, Dk). An all-to-all sends rank s the heads
it owns of every token this rank holds; after it rank r holds its heads of *every* token, in sequence
order. :func:`~multihead.core.attention.attention_with` computes exact attention over the whole sequence there (any
backend; causal, padding, packed ``segment_ids``, mask and bias functions of global positions, softcap
and sinks all as in one process), and an all-to-all returns every rank its tokens with all heads.
Backward is the same exchanges reversed.

The heads go in *chunks* (:mod:`.exchange`): exchange a chunk of w query heads (and the K/V slot they
read, once), attend, send the chunk's output home into the output buffer, next chunk. A rank so holds
one chunk's heads of the whole sequence at a time, not all H_r of them, and sends the same bytes as one
exchange of everything. ``head_chunks=None`` chooses the count from the size (chunks of about 1 MiB of
queries; one chunk for short sequences, where fewer messages matter more). A long sequence also moves
in windows of positions (:func:`~.exchange.auto_windows`): the chunk's K/V arrive window by window, then
each window of queries arrives, is attended against them and goes home before the next one. A window
[a, b) runs as the ring's blocks on a group of one (:class:`_WindowPlan`: with ``causal`` the keys
before it as a maskless rectangle and its diagonal as a triangle, merged by log-sum-exp); with mask or
bias functions, dropout or a named backend, as :func:`~multihead.core.attention.attention_with` on the keys it sees.

Without autograd (no rank records a backward) the windows run in K/V *phases* instead
(:mod:`.phased`): half the chunk's K/V head at a time, each window of queries attended against one half
and merged at home by log-sum-exp, the windows that see both halves sent twice.

Heads are split as evenly as ``torch.tensor_split`` cuts them, so any P works: H % P != 0 gives some
ranks one head more, H < P leaves ranks idle. A rank needs the key/value heads its query heads read;
when its query heads cover whole groups of G (always when Hkv % P == 0) it gets those Hkv_r heads
once; when a group is cut between ranks its key/value head goes to each of them (sent twice), and when
the cut leaves unequal parts of groups on one rank, its K/V are repeated per query head (Hkv_r = H_r):
the cost is the extra bytes sent, (H_r - Hkv_r) * L * (Dk + Dv) per rank, documented in
docs/distributed.md. On a group of one rank it is :func:`~multihead.core.attention.attention_with`, no exchange at all.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from ..core.attention import attention_with
from ..core.options import AttentionOptions
from .agree import Plan, Shard, check_head_chunks, make_plan
from .blocks import Block, SoftmaxState, make_block, shares_ids
from .exchange import (
    Attend,
    HeadShare,
    attend_in_chunks,
    auto_head_chunks,
    auto_windows,
    gather_tokens,
    head_split,
    rank_chunks,
)
from .phased import attend_in_phases, phases_for
from .ring import ring_forward, ring_with_plan
from .sharding import Region, check_layout, split_region, visible_region

__all__ = [
    "HeadShare",
    "alone",
    "and_keys",
    "attend_alone",
    "gather_tokens",
    "head_split",
    "keys_kept",
    "ulysses_attention",
    "ulysses_with_plan",
]


@dataclass(frozen=True)
class _OnHeads:
    """A mask or bias function of global heads and positions, called with a window's local head and
    query indices (heads from ``first``, queries from position ``start``)."""

    fn: Callable[..., Tensor]
    first: int
    start: int = 0

    def __call__(self, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return self.fn(b, h + self.first, q_idx + self.start, kv_idx)


def ulysses_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    causal: bool = False,
    group: Any = None,
    layout: str = "contiguous",
    valid_lens: Tensor | None = None,
    key_mask: Tensor | None = None,
    segment_ids: Tensor | tuple[Tensor, Tensor] | None = None,
    scale: float | None = None,
    softcap: float | None = None,
    sinks: Tensor | None = None,
    mask: Callable[..., Tensor] | None = None,
    bias: Callable[..., Tensor] | None = None,
    dropout: float = 0.0,
    backend: str = "auto",
    head_chunks: int | None = None,
) -> Tensor:
    """Exact attention over a sequence sharded across ``group``, by all-to-alls (every rank calls it).

    Args:
        q: (B, H, Lq_r, Dk) this rank's queries (its shard of the global sequence, cut by
            :func:`~multihead.distributed.shard` in ``layout``).
        k: (B, Hkv, Lk_r, Dk) this rank's keys; v: (B, Hkv, Lk_r, Dv) its values. Any H, Hkv and P:
            heads are split as evenly as they go (see :func:`head_split`); local lengths may differ.
        causal: bottom-right aligned over the *global* positions (as :func:`ring_attention`).
        group: the process group (default: the world). layout: as :func:`ring_attention`.
        valid_lens: int (B,) global key counts, or (B, Lq_r) for this rank's queries.
        key_mask: bool (B, Lk_r), True = real key (this rank's shard of a padding mask).
        segment_ids: int (B, Lq_r) (self-attention) or (q_ids (B, Lq_r), kv_ids (B, Lk_r)): this rank's
            shard of the packed sequences' ids; negative ids are padding.
        scale, softcap, sinks (H,), dropout, backend: as :func:`multihead.attention` (the local attention
            runs on ``backend``).
        mask, bias: *functions* ``fn(b, h, q_idx, kv_idx)`` of global heads and global positions
            (a flex ``mask_mod``/``score_mod`` style function); dense tensors are per rank and refused.
        head_chunks: how many chunks each rank's heads are exchanged and attended in (about: a chunk
            holds whole groups of query heads with their K/V head, or part of one group); None: chosen
            from the size (:func:`~multihead.distributed.exchange.auto_head_chunks`). The bytes sent do
            not depend on it; the peak memory does.

    Returns:
        (B, H, Lq_r, Dv): this rank's rows of ``multihead.attention`` over the whole sequences.
        Differentiable in q, k, v (and sinks); backward runs on every rank too.

    Memory per rank beyond its q, k, v and output: the K/V slot a chunk reads, over the whole sequence,
    and one window of the chunk's queries, output and messages (a short sequence is one window: then
    the chunk's queries and output over the whole sequence). A call that no rank's autograd records
    holds half that slot at a time (:mod:`~multihead.distributed.phased`), and sends the queries and
    outputs of the windows that see both halves of the keys twice.
    """
    options = AttentionOptions(
        mask=mask,
        bias=bias,
        causal=causal,
        scale=scale,
        softcap=softcap,
        sinks=sinks,
        dropout=dropout,
        valid_lens=valid_lens,
        segment_ids=segment_ids,
    )
    if alone(group):  # one rank: plain attention, no exchange and no copy
        check_head_chunks(head_chunks)
        return attend_alone(q, k, v, options, key_mask, layout, backend)
    plan = make_plan(
        q,
        k,
        v,
        causal=causal,
        group=group,
        layout=layout,
        valid_lens=valid_lens,
        key_mask=key_mask,
        scale=scale,
        segment_ids=segment_ids,
        strategy="ulysses",
        head_chunks=head_chunks,
    )
    return ulysses_with_plan(q, k, v, key_mask, plan, options, backend, head_chunks)


def alone(group: Any) -> bool:
    """Whether ``group`` is one rank (an initialized process group)."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) == 1


def attend_alone(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    options: AttentionOptions,
    key_mask: Tensor | None,
    layout: str,
    backend: str,
) -> Tensor:
    """A group of one rank: :func:`~multihead.core.attention.attention_with` on q (B, H, L, Dk), k (B, Hkv, L, Dk),
    v (B, Hkv, L, Dv), ``key_mask`` (B, L) joined to ``options.mask`` -> (B, H, L, Dv)."""
    check_layout(layout)
    if key_mask is not None:
        options = options.replace(mask=and_keys(options.mask, key_mask))
    out = attention_with(q, k, v, options, backend)
    assert isinstance(out, Tensor)
    return out


def ulysses_with_plan(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    key_mask: Tensor | None,
    plan: Plan,
    options: AttentionOptions,
    backend: str,
    head_chunks: int | None,
) -> Tensor:
    """Ulysses over an agreed :class:`~.agree.Plan` (what :func:`ulysses_attention` runs after agreeing);
    ``options`` as the caller gave them (global heads, this rank's ``valid_lens`` and ``segment_ids``)."""
    group = plan.group
    shares = head_split(plan.heads, plan.kv_heads, plan.world)
    qp, kp = plan.q_pos_all, plan.k_pos
    options = options.replace(scale=plan.scale, segment_ids=None)
    if options.valid_lens is not None and options.valid_lens.dim() == 2:  # (B, Lq_r): this rank's rows
        options = options.replace(valid_lens=gather_tokens(options.valid_lens, qp, group))  # (B, L_q)
    if plan.q_ids is not None and plan.kv_ids is not None:
        ids = (gather_tokens(plan.q_ids, qp, group), gather_tokens(plan.kv_ids, kp, group))
        options = options.replace(segment_ids=ids)  # (B, L_q), (B, L_k)
    keep = None
    if plan.has_key_mask:  # some rank has padding (a rank without key_mask has real keys only)
        keep = gather_tokens(keys_kept(key_mask, k), kp, group)  # (B, L_k)
    most = max(s.heads for s in shares)
    lq_all, lk_all = sum(map(len, qp)), sum(map(len, kp))
    count = head_chunks or auto_head_chunks(plan.batch, lq_all, most, max(plan.dk, plan.dv))
    exchanges = rank_chunks(shares, [count] * plan.world)
    w_most = max(len(c.q) for cs in exchanges for c in cs)
    windows = auto_windows(plan.batch, lq_all, w_most, max(plan.dk, plan.dv), plan.world)
    mask, bias, sinks = options.mask, options.bias, options.sinks
    causal = plan.causal_offset is not None
    # attend window by window where a window runs without a (rows, keys) mask: full attention on any
    # device; causal on the CPU's fused kernel in the working dtype, as two ring blocks. Elsewhere the
    # chunk is attended at once (windows still cut its messages). Only what every rank agreed on decides
    # it: the order of the exchanges follows from it.
    fused = plan.kernel == "flash" and plan.compute_dtype == q.dtype
    split = windows > 1 and (not causal or fused)
    ring_kernels = options.dropout == 0 and backend == "auto" and mask is None and bias is None
    blocks = split and causal and options.softcap is None and ring_kernels
    phases = 1
    if split and not plan.grad and ring_kernels and plan.compute_dtype == q.dtype:
        phases = phases_for(exchanges)
    if phases > 1:  # no rank records a backward: K/V in phases, a part of the slot held at a time (.phased)
        return _in_phases(q, k, v, keep, plan, options, shares, (count, windows, phases))

    def attend(x: Attend) -> Tensor:
        w, (a, z) = x.q.shape[1], (x.rows.start, x.rows.stop)
        mine = None if sinks is None else sinks[x.first : x.first + w]
        vl = options.valid_lens
        if vl is not None and vl.dim() == 2:
            vl = vl[:, a:z]  # (B, z - a): the window's rows
        ids = options.segment_ids
        if blocks:
            assert ids is None or isinstance(ids, tuple)
            local = _window_plan(plan, x, range(lk_all), vl, ids, keep is not None, options.softcap)
            return ring_with_plan(x.q, x.k, x.v, keep, local, mine)  # (B, w, z - a, Dv)
        m = lk_all  # the keys some query of the window may see: bottom-right causal stops at z + L_k - L_q
        if causal and (a, z) != (0, lq_all):
            m = min(lk_all, z + lk_all - lq_all)
        if m <= 0:  # no query of the window sees a key: output 0, as in one process
            return x.q.new_zeros(*x.q.shape[:3], x.v.shape[-1])
        if isinstance(ids, tuple):
            ids = (ids[0][:, a:z], ids[1][:, :m])  # (B, z - a), (B, m)
        local = options.replace(
            mask=None if mask is None else _OnHeads(mask, x.first, a),
            bias=None if bias is None else _OnHeads(bias, x.first, a),
            sinks=mine,
            valid_lens=vl,
            segment_ids=ids,
        )
        if keep is not None:
            local = local.replace(mask=and_keys(local.mask, keep[:, :m]))
        out = attention_with(x.q, x.k[:, :, :m], x.v[:, :, :m], local, backend)  # (B, w, z - a, Dv)
        assert isinstance(out, Tensor)
        return out

    return attend_in_chunks(
        q, k, v, shares, (qp, kp), group, [count] * plan.world, attend, windows=windows, split=split
    )  # (B, H, Lq_r, Dv)


def _in_phases(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    keep: Tensor | None,
    plan: Plan,
    options: AttentionOptions,
    shares: list[HeadShare],
    sizes: tuple[int, int, int],
) -> Tensor:
    """Ulysses in K/V phases (:func:`~.phased.attend_in_phases`), each window of queries on the ring's
    blocks against one phase's keys; ``keep`` (B, L_k) gathered key padding, ``options`` with the gathered
    ``valid_lens`` and ``segment_ids``, ``sizes`` (head chunks, windows, phases).
    q (B, H, Lq_r, Dk) -> (B, H, Lq_r, Dv)."""
    count, windows, phases = sizes

    def attend(x: Attend) -> SoftmaxState:
        keys = x.keys if x.keys is not None else range(sum(map(len, plan.k_pos)))
        vl = options.valid_lens
        if vl is not None and vl.dim() == 2:
            vl = vl[:, x.rows.start : x.rows.stop]  # (B, b - a): the window's rows
        ids = options.segment_ids
        assert ids is None or isinstance(ids, tuple)
        local = _window_plan(plan, x, keys, vl, ids, keep is not None, options.softcap)
        kept = None if keep is None else keep[:, keys.start : keys.stop]  # (B, |keys|)
        return ring_forward(x.q, x.k, x.v, kept, local)  # (B, w, b - a, Dv), (B, w, b - a)

    return attend_in_phases(
        q,
        k,
        v,
        shares,
        (plan.q_pos_all, plan.k_pos),
        plan.group,
        [count] * plan.world,
        attend,
        windows=windows,
        phases=phases,
        offset=plan.causal_offset,
        sinks=options.sinks,
    )  # (B, H, Lq_r, Dv)


@dataclass(frozen=True, kw_only=True)
class _WindowPlan(Plan):
    """The ring's blocks (:mod:`.ring`) on a group of one, no message: one window of queries, at
    positions ``q_pos`` = [a, b), against a chunk's keys at positions ``k_pos`` (0 .. L_k - 1, or one
    phase's keys: :mod:`.phased`). With ``causal`` the window is a maskless rectangle (the keys every row
    of it sees) and the diagonal triangle, merged by their log-sum-exp, so no (rows, keys) mask exists:
    ``multihead.attention`` would build one for a bottom-right causal mask with fewer queries than keys."""

    def blocks(self, src: int, shard: Shard, device: torch.device, piece: int = 0) -> list[Block]:
        q_pos, k_pos, off = self.q_pos, self.k_pos[0], self.causal_offset
        n, lk, rows = len(q_pos), len(k_pos), slice(0, len(q_pos))
        c0 = None if off is None else int(q_pos[0]) + off - int(k_pos[0])  # row i sees local keys .. c0 + i
        if c0 is None or c0 >= lk - 1:  # every row sees every key
            regions = [Region(rows, slice(0, lk), None, False)]
        elif 0 <= c0 and c0 + n <= lk:
            regions = [Region(rows, slice(0, c0), None, False)] if c0 else []
            regions.append(Region(rows, slice(c0, c0 + n), None, True))
        else:  # rows before the first key or past the last (L_k < L_q): the ring's own cut
            region = visible_region(q_pos, k_pos, off)
            regions = [] if region is None else split_region(region)
        ids = None if self.q_ids is None or shard.kv_ids is None else (self.q_ids, shard.kv_ids)
        return [
            make_block(
                r, k_pos, valid_lens=self.valid_lens, key_mask=shard.key_mask, segments=ids, device=device
            )
            for r in regions
            if ids is None or shares_ids(ids[0][:, r.rows], ids[1][:, r.cols])
        ]


def _window_plan(
    plan: Plan,
    x: Attend,
    keys: range,
    valid_lens: Tensor | None,
    ids: tuple[Tensor, Tensor] | None,
    has_key_mask: bool,
    softcap: float | None,
) -> _WindowPlan:
    """The :class:`_WindowPlan` of one window ``x`` (queries at ``x.rows``, keys at ``keys``):
    ``valid_lens`` (B,) or the window's (B, b - a), ``ids`` (q_ids (B, L_q), kv_ids (B, L_k)) or None."""
    a, z = x.rows.start, x.rows.stop
    fields = {f.name: getattr(plan, f.name) for f in dataclasses.fields(plan)}
    return _WindowPlan(
        **fields
        | {
            "group": None,
            "rank": 0,
            "world": 1,
            "next_peer": 0,
            "prev_peer": 0,
            "q_pos_all": [torch.arange(a, z)],
            "k_pos": [torch.arange(keys.start, keys.stop)],
            "heads": x.q.shape[1],
            "kv_heads": x.k.shape[1],
            "valid_lens": valid_lens,
            "has_key_mask": has_key_mask,
            "q_ids": None if ids is None else ids[0][:, a:z],
            "kv_ids": None if ids is None else ids[1][:, keys.start : keys.stop],
            "pieces": 1,
            "softcap": softcap,
            "kernel": "math" if softcap is not None else plan.kernel,
        }
    )


def keys_kept(key_mask: Tensor | None, k: Tensor) -> Tensor:
    """``key_mask`` (B, Lk_r), or all True when None."""
    return (
        torch.ones(k.shape[0], k.shape[2], dtype=torch.bool, device=k.device)
        if key_mask is None
        else key_mask
    )


def and_keys(mask: Callable[..., Tensor] | None, keep: Tensor) -> Any:
    """A key-padding mask (B, L_k) joined with a mask function: the key-padding tensor (B, 1, 1, L_k) or,
    with a function, one function of both."""
    pad = keep[:, None, None, :]  # (B, 1, 1, L_k)
    if mask is None:
        return pad
    return _KeysAnd(mask, keep)


@dataclass(frozen=True)
class _KeysAnd:
    fn: Callable[..., Tensor]
    keep: Tensor  # (B, L_k)

    def __call__(self, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return self.fn(b, h, q_idx, kv_idx) & self.keep[b, kv_idx]
