"""The all-to-alls of Ulysses: sequence shards <-> head shards, a chunk of heads at a time.

Dimensions: B batch, H query heads, Hkv key/value heads (H % Hkv == 0), G = H // Hkv, P ranks in the
group, r this rank, L the total length, L_r rank r's local length, H_r/Hkv_r the query heads/key-value
slots rank r attends for, w the query heads of one chunk, N a tensor's heads, D head dim, W the windows
a sequence moves in, [a, b) one window's positions.

Heads are split over the ranks as evenly as ``torch.tensor_split`` cuts them (:func:`head_split`); each
rank's share is then cut into *chunks* (:func:`chunk_heads`): whole groups of G query heads with their
key/value slot, or, for chunks smaller than a group, parts of one group that share its slot. Chunk c of
every rank moves in exchange c, so a rank holds one chunk's heads of the whole sequence at a time
(:func:`auto_head_chunks` picks the count from the size). A K/V slot is sent once, with the first chunk
that reads it, and kept while the next chunks read it: the bytes are those of one exchange of all heads.

A long sequence moves in W *windows* of positions (:func:`auto_windows`): one ``all_to_all_single`` per
window, each window placed where it belongs as it arrives, so a message holds a window of tokens, not
all of them. Ulysses also *attends* one window of queries at a time (against the chunk's K/V of the whole
sequence) and sends its output home before the next window's queries arrive; the bytes are the same,
in W times as many messages.

Each exchange runs inside an autograd function whose backward is the reverse exchange (:func:`to_heads`,
:func:`to_seq`). A zero-size *token* threads through every exchange of a call, forward and backward:
each exchange's backward waits for the next one's, so every rank runs the reverse exchanges in one
order (gloo and NCCL need the same order on every rank) and runs all of them, even one whose result it
did not use (a rank with no heads in a chunk).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

from .agree import answered

__all__ = [
    "CHUNK_ELEMENTS",
    "WINDOWS",
    "WINDOW_ELEMENTS",
    "Attend",
    "Chunk",
    "HeadShare",
    "Route",
    "Sequences",
    "attend_in_chunks",
    "auto_head_chunks",
    "auto_windows",
    "chunk_heads",
    "from_owners",
    "gather_tokens",
    "head_split",
    "heads_out",
    "rank_chunks",
    "sequences",
    "to_heads",
    "to_seq",
    "tokens_out",
    "window_edges",
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


WINDOW_ELEMENTS = CHUNK_ELEMENTS
"""A chunk's exchanges (and Ulysses' attention) go in windows once the chunk's queries of the whole
sequence exceed this many elements; below that, in one."""

WINDOWS = 8
"""A long sequence is exchanged in this many windows per rank of the group: a window's queries and
output are then an eighth of the chunk's on every rank, the one whose tokens the window holds (and which
sends them to every rank) included; next to the K/V slot of the whole sequence that they read, that is
what Ulysses holds (the floor: docs/distributed.md)."""


def auto_windows(batch: int, length: int, heads: int, dim: int, ranks: int) -> int:
    """How many windows a chunk of ``heads`` query heads of ``length`` tokens is exchanged in over a group
    of ``ranks``: 1 while its ``batch * length * heads * dim`` elements fit in :data:`WINDOW_ELEMENTS`, else
    :data:`WINDOWS` per rank, but no window under an eighth of :data:`WINDOW_ELEMENTS` (every window is
    an all-to-all: short sequences get fewer) and none empty."""
    size = batch * length * heads * dim
    if size <= WINDOW_ELEMENTS:
        return 1
    return max(1, min(WINDOWS * ranks, length, math.ceil(size / max(1, WINDOW_ELEMENTS // 8))))


def window_edges(length: int, windows: int) -> tuple[int, ...]:
    """The W + 1 boundaries of ``windows`` ranges of the positions 0 .. ``length`` - 1, as even as they
    go: ``window_edges(10, 3) == (0, 4, 7, 10)``."""
    return tuple(-(-i * length // windows) for i in range(windows + 1))


# ------------------------------------------------------------------------------------------------
# The exchanges
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Route:
    """Where the tokens of one exchange go: rank s holds the tokens at ``positions[s]`` of the whole
    sequence (ascending) and attends for the heads ``heads_of[s]`` of the tensor; the sequence moves in
    windows of positions ``edges[i]`` .. ``edges[i + 1]`` - 1, one all-to-all each."""

    heads_of: tuple[tuple[int, ...], ...]
    positions: tuple[Tensor, ...]
    group: Any
    rank: int
    edges: tuple[int, ...]

    @cached_property
    def bounds(self) -> list[list[int]]:
        """``bounds[s][i]``: how many of rank s's tokens come before window i (its rows of window i are
        ``bounds[s][i]`` .. ``bounds[s][i + 1]`` - 1, positions ascending)."""
        edges = torch.tensor(self.edges, device=self.positions[0].device)
        return [torch.searchsorted(p, edges).tolist() for p in self.positions]

    def rows(self, s: int, i: int) -> slice:
        """Rank s's local rows in window i."""
        return slice(self.bounds[s][i], self.bounds[s][i + 1])

    def count(self, s: int, i: int) -> int:
        """How many of rank s's tokens window i holds."""
        return self.bounds[s][i + 1] - self.bounds[s][i]

    def placed(self, s: int, i: int, start: int) -> Tensor:
        """Where rank s's tokens of window i go in a tensor whose first row is position ``start``."""
        return self.positions[s][self.rows(s, i)] - start


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
        elif dim == 1 and not x.is_contiguous():  # heads of a window's rows: index_select would first
            for j, h in enumerate(index.tolist()):  # copy every head of them; one head at a time instead
                view[:, j].copy_(x[:, h])
        else:
            torch.index_select(x, dim, index, out=view)
        at += n
    recv = [math.prod(s) for s in shapes]
    got = like.new_empty(sum(recv))
    with answered("ulysses_attention"):
        dist.all_to_all_single(got, flat, recv, counts, group=group)
    return got


def _pieces(got: Tensor, shapes: Sequence[tuple[int, ...]]) -> list[Tensor]:
    """``got`` cut into the tensors of ``shapes``, one after another (views)."""
    out, at = [], 0
    for shape in shapes:
        n = math.prod(shape)
        out.append(got[at : at + n].view(shape))
        at += n
    return out


def _index(heads: Sequence[int], device: torch.device) -> Tensor:
    return torch.tensor(list(heads), dtype=torch.long, device=device)


def heads_out(x: Tensor, route: Route, windows: range) -> Tensor:
    """Forward of :func:`to_heads` (and backward of :func:`to_seq`): ``x`` (B, N, L_r, D) -> this rank's
    heads of every token in ``windows`` (B, N_r, b - a, D), [a, b) the windows' positions, in order."""
    b, _, _, d = x.shape
    me = route.rank
    start = route.edges[windows.start]
    mine = len(route.heads_of[me])
    index = [_index(h, x.device) for h in route.heads_of]
    whole = None
    for i in windows:
        part = x[:, :, route.rows(me, i)]  # (B, N, my rows of window i, D)
        shapes = [(b, mine, route.count(s, i), d) for s in range(len(index))]
        got = _all_to_all([(part, 1, ix) for ix in index], shapes, route.group)
        if whole is None:  # after the first message: its send buffer is gone already
            whole = x.new_empty(b, mine, route.edges[windows.stop] - start, d)
        for s, piece in enumerate(_pieces(got, shapes)):
            whole.index_copy_(2, route.placed(s, i, start), piece)
        del got
    assert whole is not None
    return whole


def tokens_out(whole: Tensor, route: Route, i: int, start: int) -> Tensor:
    """Forward of :func:`to_seq` (and backward of :func:`to_heads`): this rank's heads of window i's
    tokens, in ``whole`` (B, N_r, *, D) whose first row is position ``start`` -> rank s's heads of this
    rank's tokens of window i, packed in rank order."""
    b, _, _, d = whole.shape
    me = route.rank
    n = route.count(me, i)
    sends = [(whole, 2, route.placed(s, i, start)) for s in range(len(route.heads_of))]
    return _all_to_all(sends, [(b, len(h), n, d) for h in route.heads_of], route.group)


def from_owners(got: Tensor, route: Route, i: int, d: int, b: int) -> list[Tensor]:
    """What :func:`tokens_out` returned for window i, as rank s's (B, len(heads_of[s]), rows, D)."""
    n = route.count(route.rank, i)
    return _pieces(got, [(b, len(h), n, d) for h in route.heads_of])


class _ToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, token: Tensor, x: Tensor, route: Route, windows: range) -> tuple[Tensor, Tensor]:
        ctx.route, ctx.shape, ctx.windows = route, x.shape, windows
        return token.new_empty(0), heads_out(x, route, windows)

    @staticmethod
    def backward(ctx: Any, token: Tensor, grad: Tensor) -> tuple[Tensor | None, ...]:
        route, (b, n, lr, d), windows = ctx.route, ctx.shape, ctx.windows
        start = route.edges[windows.start]
        with torch.no_grad():
            dx = grad.new_zeros(b, n, lr, d)
            grad = grad.contiguous()
            for i in windows:
                got = tokens_out(grad, route, i, start)
                rows = dx[:, :, route.rows(route.rank, i)]  # (B, N, my rows of window i, D), a view
                for heads, piece in zip(route.heads_of, from_owners(got, route, i, d, b)):
                    rows.index_add_(1, _index(heads, dx.device), piece)  # a K/V head sent twice: sums
        return token, dx if ctx.needs_input_grad[1] else None, None, None


class _ToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, token: Tensor, whole: Tensor, route: Route, i: int) -> tuple[Tensor, Tensor]:
        ctx.route, ctx.shape, ctx.window = route, whole.shape, i
        return token.new_empty(0), tokens_out(whole, route, i, route.edges[i])

    @staticmethod
    def backward(ctx: Any, token: Tensor, grad: Tensor) -> tuple[Tensor | None, ...]:
        route, (b, n, _, d), i = ctx.route, ctx.shape, ctx.window
        with torch.no_grad():  # rank s's heads of this rank's tokens, as forward received them: back
            pieces = [(p, 1, None) for p in from_owners(grad.contiguous(), route, i, d, b)]
            shapes = [(b, n, route.count(s, i), d) for s in range(len(pieces))]
            got = _all_to_all(pieces, shapes, route.group)
            whole = got.new_empty(b, n, route.edges[i + 1] - route.edges[i], d)
            for s, piece in enumerate(_pieces(got, shapes)):
                whole.index_copy_(2, route.placed(s, i, route.edges[i]), piece)
        return token, whole if ctx.needs_input_grad[1] else None, None, None


def to_heads(token: Tensor, x: Tensor, route: Route, windows: range) -> tuple[Tensor, Tensor]:
    """Sequence shards to head shards: ``x`` (B, N, L_r, D), every head of this rank's tokens -> (token,
    (B, N_r, b - a, D)): heads ``route.heads_of[rank]`` of the tokens of ``windows`` (positions [a, b)),
    in sequence order, one all-to-all per window. Differentiable (the backward is the reverse exchange,
    after the one that ``token`` came from: see the module)."""
    token, whole = _ToHeads.apply(token, x, route, windows)
    return token, whole


def to_seq(token: Tensor, whole: Tensor, route: Route, i: int) -> tuple[Tensor, Tensor]:
    """Head shards back to sequence shards, window i: ``whole`` (B, N_r, b - a, D) -> (token, flat):
    rank s's heads ``route.heads_of[s]`` of this rank's tokens of window i, (B, len(heads_of[s]), rows,
    D) after one another."""
    token, flat = _ToSeq.apply(token, whole, route, i)
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
    """One chunk's attention: query heads ``first`` .. ``first + w - 1`` (global) of the tokens at
    positions ``rows`` (a window, or the whole sequence), against the chunk's K/V of every token."""

    q: Tensor  # (B, w, b - a, Dk)
    k: Tensor  # (B, n, L_k, Dk): the chunk's K/V slots (w % n == 0)
    v: Tensor  # (B, n, L_k, Dv)
    first: int
    rows: range  # [a, b): the queries' positions
    keys: range | None = None  # the positions of k and v (None: the whole sequence, 0 .. L_k - 1)


class Sequences(NamedTuple):
    """Where the tokens of a sequence-parallel call are: each rank's query and key positions (ascending,
    on the call's device) and the edges of the windows the query and key sequences move in."""

    q_pos: tuple[Tensor, ...]
    k_pos: tuple[Tensor, ...]
    q_edges: tuple[int, ...]
    k_edges: tuple[int, ...]


def sequences(
    positions: tuple[Sequence[Tensor], Sequence[Tensor]], windows: int, device: torch.device
) -> Sequences:
    """The :class:`Sequences` of ``positions`` (each rank's query positions, each rank's key positions)
    moved in ``windows`` windows (fewer for a sequence shorter than that); a ``ValueError`` where some
    rank's positions do not ascend."""
    qp, kp = (_ascending([p.to(device) for p in side]) for side in positions)
    lq, lk = sum(len(p) for p in qp), sum(len(p) for p in kp)
    return Sequences(qp, kp, window_edges(lq, min(windows, lq)), window_edges(lk, min(windows, lk)))


def _ascending(positions: Sequence[Tensor]) -> tuple[Tensor, ...]:
    for p in positions:
        if len(p) > 1 and not bool((p[1:] > p[:-1]).all()):
            raise ValueError("attend_in_chunks: every rank's positions must ascend (as every layout's do)")
    return tuple(positions)


def attend_in_chunks(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    shares: Sequence[HeadShare],
    positions: tuple[Sequence[Tensor], Sequence[Tensor]],
    group: Any,
    counts: Sequence[int],
    attend: Any,
    *,
    windows: int = 1,
    split: bool = True,
) -> Tensor:
    """Ulysses over ``group``, a chunk of heads at a time: q (B, H, Lq_r, Dk), k (B, Hkv, Lk_r, Dk),
    v (B, Hkv, Lk_r, Dv) this rank's tokens -> (B, H, Lq_r, Dv), every head of them.

    ``shares`` the head split over the group, ``positions`` (each rank's query positions, each rank's key
    positions, ascending) in the sequence the chunks attend over, ``counts`` each rank's chunks
    (:func:`rank_chunks`), ``attend(Attend) -> (B, w, b - a, Dv)`` the attention of one chunk's queries
    at positions [a, b) over the whole sequence. The sequence moves in ``windows`` windows (every rank
    passes the same); with ``split`` each window of queries is attended and sent home on its own
    (Ulysses), without it the chunk's queries are attended at once (hybrid: its ring needs them all).
    """
    rank = dist.get_rank(group)
    qp, kp, q_edges, k_edges = sequences(positions, windows, q.device)
    b, _, lq, _ = q.shape
    dv = v.shape[-1]
    out = q.new_empty(b, q.shape[1], lq, dv)  # (B, H, Lq_r, Dv): every chunk's heads are written in
    token = q.new_zeros(0)
    kh = vh = None
    w_all = range(len(q_edges) - 1)
    parts = [range(i, i + 1) for i in w_all] if split else [w_all]
    for cs in rank_chunks(shares, counts):  # cs[s]: rank s's chunk in this exchange
        mine = cs[rank]
        if any(c.new_kv for c in cs):  # K/V first: a new slot replaces the last one before q arrives
            if mine.new_kv:
                kh = vh = None  # the slot the last chunk read is not read again
            kv_heads = tuple(s.kv[c.kv.start : c.kv.stop] if c.new_kv else () for s, c in zip(shares, cs))
            route = Route(kv_heads, kp, group, rank, k_edges)
            every = range(len(k_edges) - 1)
            token, kn = to_heads(token, k, route, every)  # (B, n, L_k, Dk)
            token, vn = to_heads(token, v, route, every)  # (B, n, L_k, Dv)
            if mine.new_kv:
                kh, vh = kn, vn
            del kn, vn
        q_heads = tuple(tuple(s.q[c.q.start : c.q.stop]) for s, c in zip(shares, cs))
        route = Route(q_heads, qp, group, rank, q_edges)
        for part in parts:
            a, z = q_edges[part.start], q_edges[part.stop]
            token, qh = to_heads(token, q, route, part)  # (B, w, z - a, Dk)
            if mine.q:
                assert kh is not None and vh is not None
                first = shares[rank].q.start + mine.q.start
                o = attend(Attend(qh, kh, vh, first, range(a, z)))  # (B, w, z - a, Dv)
            else:  # no heads in this exchange (more ranks than heads, or fewer chunks than others)
                o = qh.new_zeros(b, 0, z - a, dv)
            del qh
            for i in part:  # each window's output home: rank s's chunk of my tokens of window i
                lo, hi = q_edges[i] - a, q_edges[i + 1] - a
                token, got = to_seq(token, o if len(part) == 1 else o[:, :, lo:hi], route, i)
                rows = route.rows(rank, i)
                for heads, piece in zip(q_heads, from_owners(got, route, i, dv, b)):
                    if heads:  # (B, w_s, rows, Dv) into their heads of the output
                        out[:, heads[0] : heads[-1] + 1, rows] = piece
                del got
            del o
    return out
