"""The all-to-alls of Ulysses: sequence shards <-> head shards, a chunk of heads at a time.

Dimensions: B batch, H query heads, Hkv key/value heads (H % Hkv == 0), G = H // Hkv, P ranks in the
group, r this rank, L the total length, L_r rank r's local length, H_r/Hkv_r the query heads/key-value
slots rank r attends for, w the query heads of one chunk, N a tensor's heads, D head dim.

Heads are split over the ranks as evenly as ``torch.tensor_split`` cuts them (:func:`head_split`); each
rank's share is then cut into *chunks* (:func:`chunk_heads`): whole groups of G query heads with their
key/value slot, or, for chunks smaller than a group, parts of one group that share its slot. Chunk c of
every rank moves in exchange c, so a rank holds one chunk's heads of the whole sequence at a time
(:func:`auto_head_chunks` picks the count from the size). A K/V slot is sent once, with the first chunk
that reads it, and kept while the next chunks read it: the bytes are those of one exchange of all heads.

Each exchange is one ``all_to_all_single`` per tensor, inside an autograd function whose backward is the
reverse exchange (:func:`to_heads`, :func:`to_seq`). A zero-size *token* threads through every exchange
of a call, forward and backward: each exchange's backward waits for the next one's, so every rank runs
the reverse exchanges in one order (gloo and NCCL need the same order on every rank) and runs all of
them, even one whose result it did not use (a rank with no heads in a chunk).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

from .agree import answered

__all__ = [
    "CHUNK_ELEMENTS",
    "Attend",
    "Chunk",
    "HeadShare",
    "Route",
    "attend_in_chunks",
    "auto_head_chunks",
    "chunk_heads",
    "gather_tokens",
    "head_split",
    "rank_chunks",
    "to_heads",
    "to_seq",
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


class Chunk(NamedTuple):
    """One chunk of a rank's share: local query heads ``q``, the local K/V slots ``kv`` they read
    (query head ``q.start + j`` reads slot ``kv.start + j // (len(q) // len(kv))``), and whether the slots
    travel in this chunk's exchange (``False``: the previous chunk's slot is kept)."""

    q: range
    kv: range
    new_kv: bool


NO_CHUNK = Chunk(range(0), range(0), False)

CHUNK_ELEMENTS = 1 << 18
"""With ``head_chunks=None`` a rank's query heads of the whole sequence are exchanged in chunks of about
this many elements (1 MiB of float32), one query head at least."""


def auto_head_chunks(batch: int, length: int, heads: int, dim: int) -> int:
    """How many chunks a rank's ``heads`` query heads of the whole sequence (``batch`` x ``length`` x ``dim``
    elements each) go in: about :data:`CHUNK_ELEMENTS` each, at most one per head."""
    return max(1, min(heads, math.ceil(batch * length * heads * dim / CHUNK_ELEMENTS)))


def chunk_heads(share: HeadShare, count: int) -> list[Chunk]:
    """``share`` cut into about ``count`` chunks of w = ceil(H_r / count) query heads, along its groups.

    w >= G_r (the query heads per slot): whole groups, w // G_r slots a chunk, each slot sent once.
    w < G_r: every group cut into ceil(G_r / w) parts that share its slot (sent with the first part).
    H_r = 4 heads reading slots 0 0 1 1: count 2 -> heads 0-1 (slot 0), 2-3 (slot 1); count 4 -> heads
    0 (slot 0 sent), 1 (slot 0 kept), 2 (slot 1 sent), 3 (slot 1 kept).
    """
    h, slots = share.heads, len(share.kv)
    if h == 0:
        return []
    g = h // slots
    w = math.ceil(h / max(1, count))
    if w >= g:
        per = w // g
        return [
            Chunk(range(j * g, min(j + per, slots) * g), range(j, min(j + per, slots)), True)
            for j in range(0, slots, per)
        ]
    chunks = []
    for j in range(slots):
        for i, part in enumerate(torch.arange(g).tensor_split(math.ceil(g / w))):
            chunks.append(
                Chunk(range(j * g + int(part[0]), j * g + int(part[-1]) + 1), range(j, j + 1), i == 0)
            )
    return chunks


def rank_chunks(shares: Sequence[HeadShare], counts: Sequence[int]) -> list[list[Chunk]]:
    """Exchange c's chunk of every rank: ``[c][s]``, rank s's share cut into about ``counts[s]`` chunks
    (ranks with fewer chunks get empty ones)."""
    per_rank = [chunk_heads(s, n) for s, n in zip(shares, counts)]
    total = max(len(c) for c in per_rank)
    return [[c[i] if i < len(c) else NO_CHUNK for c in per_rank] for i in range(total)]


# ------------------------------------------------------------------------------------------------
# The exchanges
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Route:
    """Where the tokens of one exchange go: rank s holds the tokens at ``positions[s]`` of the whole
    sequence (each rank's in its own order) and attends for the heads ``heads_of[s]`` of the tensor."""

    heads_of: tuple[tuple[int, ...], ...]
    positions: tuple[Tensor, ...]
    group: Any
    rank: int

    @property
    def length(self) -> int:
        return sum(len(p) for p in self.positions)


def _all_to_all(
    sends: list[tuple[Tensor, int, Tensor | None]], shapes: list[tuple[int, ...]], group: Any
) -> Tensor:
    """Send to each rank s ``x.index_select(dim, index)`` of ``sends[s] = (x, dim, index)`` (``index``
    None: all of ``x``), packed straight into one message; return what rank s sent here, packed in rank
    order (sizes from ``shapes[s]``)."""
    out_shapes = []
    for x, dim, index in sends:
        shape = list(x.shape)
        if index is not None:
            shape[dim] = len(index)
        out_shapes.append(shape)
    counts = [math.prod(s) for s in out_shapes]
    like = sends[0][0]
    flat = like.new_empty(sum(counts))
    at = 0
    for (x, dim, index), shape, n in zip(sends, out_shapes, counts):
        view = flat[at : at + n].view(shape)
        if index is None:
            view.copy_(x)
        else:
            torch.index_select(x, dim, index, out=view)
        at += n
    recv = [math.prod(s) for s in shapes]
    got = like.new_empty(sum(recv))
    with answered("ulysses_attention"):
        dist.all_to_all_single(got, flat, recv, counts, group=group)
    return got


def _place(got: Tensor, route: Route, heads: int, b: int, d: int) -> Tensor:
    """(B, heads, L, D): the pieces of ``got`` (rank r's tokens, in rank order) at their positions."""
    whole = got.new_empty(b, heads, route.length, d)
    at = 0
    for pos in route.positions:
        n = b * heads * len(pos) * d
        whole.index_copy_(2, pos, got[at : at + n].view(b, heads, len(pos), d))
        at += n
    return whole


def _index(heads: Sequence[int], device: torch.device) -> Tensor:
    return torch.tensor(list(heads), dtype=torch.long, device=device)


def _heads_out(x: Tensor, route: Route) -> Tensor:
    """Forward of :func:`to_heads` (and backward of :func:`to_seq`): ``x`` (B, N, L_r, D) -> this rank's
    heads of every token (B, N_r, L, D)."""
    b, _, lr, d = x.shape
    mine = len(route.heads_of[route.rank])
    sends = [(x, 1, _index(h, x.device)) for h in route.heads_of]
    got = _all_to_all(sends, [(b, mine, len(p), d) for p in route.positions], route.group)
    return _place(got, route, mine, b, d)


def _tokens_out(whole: Tensor, route: Route, lr: int) -> Tensor:
    """Forward of :func:`to_seq` (and backward of :func:`to_heads`): this rank's heads of every token
    ``whole`` (B, N_r, L, D) -> rank s's heads of this rank's ``lr`` tokens, packed in rank order."""
    b, _, _, d = whole.shape
    sends = [(whole, 2, p) for p in route.positions]
    return _all_to_all(sends, [(b, len(h), lr, d) for h in route.heads_of], route.group)


class _ToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, token: Tensor, x: Tensor, route: Route) -> tuple[Tensor, Tensor]:
        ctx.route, ctx.shape = route, x.shape
        return token.new_empty(0), _heads_out(x, route)

    @staticmethod
    def backward(ctx: Any, token: Tensor, grad: Tensor) -> tuple[Tensor | None, ...]:
        route, (b, n, lr, d) = ctx.route, ctx.shape
        with torch.no_grad():
            got = _tokens_out(grad.contiguous(), route, lr)
            dx = got.new_zeros(b, n, lr, d)
            at = 0
            for heads in route.heads_of:  # a K/V head sent to several ranks sums their gradients
                size = b * len(heads) * lr * d
                dx.index_add_(1, _index(heads, dx.device), got[at : at + size].view(b, len(heads), lr, d))
                at += size
        return token, dx if ctx.needs_input_grad[1] else None, None


class _ToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, token: Tensor, whole: Tensor, route: Route, lr: int) -> tuple[Tensor, Tensor]:
        ctx.route, ctx.shape = route, whole.shape
        return token.new_empty(0), _tokens_out(whole, route, lr)

    @staticmethod
    def backward(ctx: Any, token: Tensor, grad: Tensor) -> tuple[Tensor | None, ...]:
        route, (b, n, _, d) = ctx.route, ctx.shape
        lr = len(route.positions[route.rank])
        with torch.no_grad():
            pieces, at = [], 0
            for heads in route.heads_of:  # rank s's heads of this rank's tokens, as forward received them
                size = b * len(heads) * lr * d
                pieces.append((grad[at : at + size].view(b, len(heads), lr, d), 1, None))
                at += size
            shapes = [(b, n, len(p), d) for p in route.positions]
            whole = _place(_all_to_all(pieces, shapes, route.group), route, n, b, d)
        return token, whole if ctx.needs_input_grad[1] else None, None, None


def to_heads(token: Tensor, x: Tensor, route: Route) -> tuple[Tensor, Tensor]:
    """Sequence shards to head shards: ``x`` (B, N, L_r, D), every head of this rank's tokens -> (token,
    (B, N_r, L, D)): heads ``route.heads_of[rank]`` of every token, in sequence order. Differentiable (the
    backward is the reverse exchange, after the one that ``token`` came from... see the module)."""
    token, whole = _ToHeads.apply(token, x, route)
    return token, whole


def to_seq(token: Tensor, whole: Tensor, route: Route) -> tuple[Tensor, Tensor]:
    """Head shards back to sequence shards: ``whole`` (B, N_r, L, D) -> (token, flat): rank s's heads
    ``route.heads_of[s]`` of this rank's tokens, (B, len(heads_of[s]), L_r, D) after one another."""
    lr = len(route.positions[route.rank])
    token, flat = _ToSeq.apply(token, whole, route, lr)
    return token, flat


def _order(positions: Sequence[Tensor], device: torch.device) -> Tensor:
    """(L,) the index, in rank-order concatenation of the shards, of each global position (the inverse
    permutation of ``cat(positions)``)."""
    flat = torch.cat(list(positions))  # (L,) global position of each concatenated row
    return torch.empty_like(flat).index_copy_(0, flat, torch.arange(len(flat))).to(device)


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


class Attend(NamedTuple):
    """One chunk's attention: query heads ``first`` .. ``first + w - 1`` (global) of every token."""

    q: Tensor  # (B, w, L_q, Dk)
    k: Tensor  # (B, n, L_k, Dk): the chunk's K/V slots (w % n == 0)
    v: Tensor  # (B, n, L_k, Dv)
    first: int


def attend_in_chunks(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    shares: Sequence[HeadShare],
    positions: tuple[Sequence[Tensor], Sequence[Tensor]],
    group: Any,
    counts: Sequence[int],
    attend: Any,
) -> Tensor:
    """Ulysses over ``group``, a chunk of heads at a time: q (B, H, Lq_r, Dk), k (B, Hkv, Lk_r, Dk),
    v (B, Hkv, Lk_r, Dv) this rank's tokens -> (B, H, Lq_r, Dv), every head of them.

    ``shares`` the head split over the group, ``positions`` (each rank's query positions, each rank's key
    positions) in the sequence the chunks attend over, ``counts`` each rank's chunks (:func:`rank_chunks`),
    ``attend(Attend) -> (B, w, L_q, Dv)`` the attention of one chunk over the whole sequence.
    """
    rank = dist.get_rank(group)
    device = q.device
    qp = tuple(p.to(device) for p in positions[0])
    kp = tuple(p.to(device) for p in positions[1])
    b, _, lq, _ = q.shape
    dv = v.shape[-1]
    out = q.new_empty(b, q.shape[1], lq, dv)  # (B, H, Lq_r, Dv): every chunk's heads are written in
    token = q.new_zeros(0)
    kh = vh = None
    for cs in rank_chunks(shares, counts):  # cs[s]: rank s's chunk in this exchange
        mine = cs[rank]
        if any(c.new_kv for c in cs):  # K/V first: a new slot replaces the last one before q arrives
            if mine.new_kv:
                kh = vh = None  # the slot the last chunk read is not read again
            kv_heads = tuple(s.kv[c.kv.start : c.kv.stop] if c.new_kv else () for s, c in zip(shares, cs))
            route = Route(kv_heads, kp, group, rank)
            token, kn = to_heads(token, k, route)  # (B, n, L_k, Dk)
            token, vn = to_heads(token, v, route)  # (B, n, L_k, Dv)
            if mine.new_kv:
                kh, vh = kn, vn
            del kn, vn
        q_heads = tuple(tuple(s.q[c.q.start : c.q.stop]) for s, c in zip(shares, cs))
        token, qh = to_heads(token, q, Route(q_heads, qp, group, rank))  # (B, w, L_q, Dk)
        if mine.q:
            assert kh is not None and vh is not None
            o = attend(Attend(qh, kh, vh, shares[rank].q.start + mine.q.start))  # (B, w, L_q, Dv)
        else:  # no heads in this exchange (more ranks than heads, or fewer chunks than others)
            o = qh.new_zeros(b, 0, sum(len(p) for p in qp), dv)
        del qh
        token, got = to_seq(token, o, Route(q_heads, qp, group, rank))  # rank s's chunk of my tokens
        del o
        at = 0
        for heads in q_heads:  # (B, w_s, Lq_r, Dv) each, into their heads of the output
            if heads:
                size = b * len(heads) * lq * dv
                out[:, heads[0] : heads[-1] + 1] = got[at : at + size].view(b, len(heads), lq, dv)
                at += size
        del got
    return out
