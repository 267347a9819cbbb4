"""Ulysses attention: an all-to-all turns sequence shards into head shards, attention runs whole, and back.

Dimensions: B batch, H query heads, Hkv key/value heads (H % Hkv == 0), G = H // Hkv, P ranks in the
group, r this rank, L_q/L_k the total query/key lengths, Lq_r/Lk_r rank r's local lengths, H_r/Hkv_r
the query/key-value heads rank r attends for, Dk/Dv head dims.

Before: rank r holds every head of its tokens, q (B, H, Lq_r, Dk). One all-to-all sends rank s the
heads it owns of every token this rank holds; after it rank r holds its heads of *every* token,
(B, H_r, L_q, Dk), in sequence order. :func:`multihead.attention_with` computes exact attention over
the whole sequence there (any backend; causal, padding, packed ``segment_ids``, mask and bias functions
of global positions, softcap and sinks all as in one process), and a second all-to-all returns every
rank its tokens with all heads. Backward is the same two exchanges reversed.

Heads are split as evenly as ``torch.tensor_split`` cuts them, so any P works: H % P != 0 gives some
ranks one head more, H < P leaves ranks idle. A rank needs the key/value heads its query heads read;
when its query heads cover whole groups of G (always when Hkv % P == 0) it gets those Hkv_r heads
once; when a group is cut between ranks its key/value head goes to each of them (sent twice), and when
the cut leaves unequal parts of groups on one rank, its K/V are repeated per query head (Hkv_r = H_r):
the cost is the extra bytes sent, (H_r - Hkv_r) * L * (Dk + Dv) per rank, documented in
docs/distributed.md.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

from ..core.attention import attention_with
from ..core.options import AttentionOptions
from .agree import answered, make_plan

__all__ = [
    "HeadShare",
    "Part",
    "exchange",
    "gather_tokens",
    "head_split",
    "heads_to_seq",
    "seq_to_heads",
    "ulysses_attention",
]


@dataclass(frozen=True)
class HeadShare:
    """The heads one rank attends for: query heads ``q`` (a range of H) and key/value heads ``kv``.

    ``kv`` (Hkv_r,) indexes the Hkv heads; query head ``q.start + j`` reads local kv head ``j // (H_r //
    Hkv_r)``, as in grouped-query attention.
    """

    q: range
    kv: tuple[int, ...]

    @property
    def heads(self) -> int:
        return len(self.q)


def head_split(heads: int, kv_heads: int, world: int) -> list[HeadShare]:
    """Each rank's :class:`HeadShare` of H = ``heads`` query heads over ``world`` ranks.

    H = 8, Hkv = 2 over P = 4: ranks get query heads 0-1, 2-3, 4-5, 6-7 and kv heads (0,), (0,), (1,),
    (1,). H = 6, Hkv = 2 over P = 4: 0-1 (0,), 2-3 (0, 1) read kv 0 and 1 once each, 4 (1,), 5 (1,).
    """
    group = heads // kv_heads
    shares = []
    for chunk in torch.arange(heads).tensor_split(world):
        reads = [int(h) // group for h in chunk]  # the kv head of each query head
        kv = sorted(set(reads))
        counts = {u: reads.count(u) for u in kv}
        if len(set(counts.values())) > 1:  # unequal parts of groups: one kv head per query head
            kv = reads
        q = range(int(chunk[0]), int(chunk[-1]) + 1) if len(chunk) else range(0)
        shares.append(HeadShare(q, tuple(kv)))
    return shares


class _Exchange(torch.autograd.Function):
    """``all_to_all_single`` of a flat tensor with per-rank sizes; its backward is the reverse exchange."""

    @staticmethod
    def forward(ctx: Any, flat: Tensor, send: list[int], recv: list[int], group: Any) -> Tensor:
        ctx.send, ctx.recv, ctx.group = send, recv, group
        out = flat.new_empty(sum(recv))
        with answered("ulysses_attention"):
            dist.all_to_all_single(out, flat.contiguous(), recv, send, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        back = grad.new_empty(sum(ctx.send))
        with answered("ulysses_attention (backward)"):
            dist.all_to_all_single(back, grad.contiguous(), ctx.send, ctx.recv, group=ctx.group)
        return back, None, None, None


def exchange(
    pieces: list[list[Tensor]], shapes: Sequence[Sequence[tuple[int, ...]]], group: Any
) -> list[list[Tensor]]:
    """Send ``pieces[s]`` (tensors of one dtype) to rank s; return what each rank r sent here, viewed
    at ``shapes[r]``. Differentiable: the gradients go back by the reverse exchange. ``pieces`` is
    emptied once packed into the message (copies among them are freed before the transfer)."""
    send = [sum(t.numel() for t in dest) for dest in pieces]
    flat = torch.cat([t.reshape(-1) for dest in pieces for t in dest])  # one message, in rank order
    pieces.clear()
    recv = [sum(_numel(s) for s in src) for src in shapes]
    got = _Exchange.apply(flat, send, recv, group)
    del flat  # the send buffer: the transfer is done
    out, at = [], 0
    for src in shapes:
        views = []
        for shape in src:
            n = _numel(shape)
            views.append(got[at : at + n].view(shape))
            at += n
        out.append(views)
    return out


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _order(positions: Sequence[Tensor], device: torch.device) -> Tensor:
    """(L,) the index, in rank-order concatenation of the shards, of each global position (the inverse
    permutation of ``cat(positions)``)."""
    flat = torch.cat(list(positions))  # (L,) global position of each concatenated row
    return torch.empty_like(flat).index_copy_(0, flat, torch.arange(len(flat))).to(device)


class Part(NamedTuple):
    """One tensor to move from sequence shards to head shards."""

    x: Tensor  # (B, N, L_r, D): every head of this rank's tokens
    heads_of: Sequence[Sequence[int]]  # the heads rank s gets, for each rank s
    positions: Sequence[Tensor]  # rank s's global positions, for each rank s


def seq_to_heads(parts: Sequence[Part], group: Any) -> list[Tensor]:
    """Sequence shards to head shards, every part in one all-to-all (one collective, forward and back).

    Returns, for each part, (B, N_r, L, D): this rank's heads of every token, in sequence order.
    """
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    pieces = [[_heads(p.x, p.heads_of[s]) for p in parts] for s in range(world)]  # (B, N_s, L_r, D)
    shapes = [
        [(p.x.shape[0], len(p.heads_of[rank]), len(p.positions[r]), p.x.shape[3]) for p in parts]
        for r in range(world)
    ]
    got = exchange(pieces, shapes, group)
    out = []
    for i, p in enumerate(parts):
        whole = got[0][i].new_empty(shapes[0][i][:2] + (sum(map(len, p.positions)), p.x.shape[3]))
        for r in range(world):  # each rank's tokens to their places: (B, N_r, L, D) in sequence order
            whole.index_copy_(2, p.positions[r].to(whole.device), got[r][i])
        out.append(whole)
    return out


def _heads(x: Tensor, heads: Sequence[int]) -> Tensor:
    """``x[:, heads]``: a view when the heads are consecutive (no copy before the message is packed)."""
    heads = list(heads)
    if not heads:
        return x[:, :0]
    first = heads[0]
    if heads == list(range(first, first + len(heads))):
        return x[:, first : first + len(heads)]
    return x[:, heads]


def heads_to_seq(out: Tensor, heads: Sequence[int], positions: Sequence[Tensor], group: Any) -> Tensor:
    """Head shards back to sequence shards: ``out`` (B, H_r, L, D) in global order, ``heads[s]`` = H_s.

    Returns (B, H, L_r, D): every head of this rank's tokens.
    """
    rank = dist.get_rank(group)
    b, _, _, d = out.shape
    pieces = [[out.index_select(2, p.to(out.device))] for p in positions]  # (B, H_r, L_s, D) for rank s
    del out  # the caller's reference remains; without grad, the pieces are all that is needed
    shapes = [[(b, h, len(positions[rank]), d)] for h in heads]
    got = exchange(pieces, shapes, group)
    return torch.cat([g[0] for g in got], dim=1)  # (B, H, L_r, D)


def gather_tokens(x: Tensor, positions: Sequence[Tensor], group: Any) -> Tensor:
    """All-gather a per-token tensor ``x`` (B, L_r) (ids, masks, counts; not differentiable) and put it
    in sequence order: (B, L). ``positions[s]`` are rank s's global positions."""
    dtype = x.dtype
    wire = x.to(torch.int64) if dtype == torch.bool else x  # gloo sends no bool
    longest = max(len(p) for p in positions)
    padded = torch.cat([wire, wire.new_zeros(wire.shape[0], longest - wire.shape[1])], 1).contiguous()
    parts = [torch.empty_like(padded) for _ in positions]
    with answered("ulysses_attention"):
        dist.all_gather(parts, padded, group=group)
    flat = torch.cat([p[:, : len(pos)] for p, pos in zip(parts, positions)], 1)  # (B, L) in rank order
    return flat.index_select(1, _order(positions, x.device)).to(dtype)  # (B, L)


@dataclass(frozen=True)
class _OnHeads:
    """A mask or bias function of global heads, called with this rank's local head index."""

    fn: Callable[..., Tensor]
    first: int

    def __call__(self, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return self.fn(b, h + self.first, q_idx, kv_idx)


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
) -> Tensor:
    """Exact attention over a sequence sharded across ``group``, by two all-to-alls (every rank calls it).

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

    Returns:
        (B, H, Lq_r, Dv): this rank's rows of ``multihead.attention`` over the whole sequences.
        Differentiable in q, k, v (and sinks); backward runs on every rank too.

    Memory per rank: its H_r heads of the whole sequence, the same size as its shard of every head.
    """
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
    )
    shares = head_split(plan.heads, plan.kv_heads, plan.world)
    mine = shares[plan.rank]
    qp, kp = plan.q_pos_all, plan.k_pos
    options = AttentionOptions(
        mask=None if mask is None else _OnHeads(mask, mine.q.start),
        bias=None if bias is None else _OnHeads(bias, mine.q.start),
        causal=causal,
        scale=plan.scale,
        softcap=softcap,
        sinks=None if sinks is None else sinks[mine.q.start : mine.q.stop],
        dropout=dropout,
        valid_lens=valid_lens,
    )
    if valid_lens is not None and valid_lens.dim() == 2:  # (B, Lq_r): this rank's queries' counts
        options = options.replace(valid_lens=gather_tokens(valid_lens, qp, group))  # (B, L_q)
    if plan.q_ids is not None and plan.kv_ids is not None:
        ids = (gather_tokens(plan.q_ids, qp, group), gather_tokens(plan.kv_ids, kp, group))
        options = options.replace(segment_ids=ids)  # (B, L_q), (B, L_k)
    if plan.has_key_mask:  # some rank has padding (a rank without key_mask has real keys only)
        keep = gather_tokens(keys_kept(key_mask, k), kp, group)  # (B, L_k)
        options = options.replace(mask=_and_keys(options.mask, keep))
    kv_of = [s.kv for s in shares]
    qh, kh, vh = seq_to_heads(
        [Part(q, [s.q for s in shares], qp), Part(k, kv_of, kp), Part(v, kv_of, kp)], group
    )  # (B, H_r, L_q, Dk), (B, Hkv_r, L_k, Dk), (B, Hkv_r, L_k, Dv)
    if mine.heads:
        out = attention_with(qh, kh, vh, options, backend)  # (B, H_r, L_q, Dv)
        assert isinstance(out, Tensor)
        del qh, kh, vh  # without grad they are free now (with grad, attention saved what it needs)
    else:  # more ranks than heads: this rank attends for none
        out = qh.new_zeros(qh.shape[:3] + (v.shape[-1],))  # (B, 0, L_q, Dv)
        out = out + 0 * (qh.sum() + kh.sum() + vh.sum())  # keep the exchanges in the graph (their backward)
    return heads_to_seq(out, [s.heads for s in shares], qp, group)  # (B, H, Lq_r, Dv)


def keys_kept(key_mask: Tensor | None, k: Tensor) -> Tensor:
    """``key_mask`` (B, Lk_r), or all True when None."""
    return (
        torch.ones(k.shape[0], k.shape[2], dtype=torch.bool, device=k.device)
        if key_mask is None
        else key_mask
    )


def _and_keys(mask: Callable[..., Tensor] | None, keep: Tensor) -> Any:
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
