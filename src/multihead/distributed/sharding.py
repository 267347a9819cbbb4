"""Which positions of a sequence each rank holds: layouts, cutting and reassembling, causal regions.

Dimensions: P ranks, r a rank, L a total (global) sequence length, L_r rank r's local length,
n/m the query rows/key columns of one block (this rank's queries x one rank's keys).

A *layout* (:data:`LAYOUTS`) maps global positions to ranks. For L = 8 tokens over P = 2 ranks::

    contiguous  rank 0: 0 1 2 3    rank 1: 4 5 6 7      (one block each)
    zigzag      rank 0: 0 1 6 7    rank 1: 2 3 4 5      (chunks r and 2P-1-r of 2P chunks)
    striped     rank 0: 0 2 4 6    rank 1: 1 3 5 7      (every P-th token)

Positions ascend within every shard, so under a causal mask each query sees a *prefix* of another
rank's keys; :func:`visible_region` turns that into the rectangle (plus staircase) one block step
computes, and :func:`causal_work` counts it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = [
    "LAYOUTS",
    "Region",
    "causal_work",
    "check_layout",
    "gather_sequence",
    "layout_positions",
    "positions_from_lengths",
    "shard",
    "split_region",
    "unshard",
    "visible_region",
]

LAYOUTS = ("contiguous", "zigzag", "striped")


def check_layout(layout: object) -> str:
    """``layout`` if it is one of :data:`LAYOUTS`, else a ValueError naming them."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    return str(layout)


def layout_positions(total: int, world: int, layout: str) -> list[Tensor]:
    """Global positions (ascending) of each rank's shard of a sequence of ``total`` tokens: P tensors (L_r,)."""
    idx = torch.arange(total)  # (L,)
    if layout == "contiguous":
        return list(idx.tensor_split(world))
    if layout == "zigzag":
        chunks = idx.tensor_split(2 * world)
        return [torch.cat([chunks[r], chunks[2 * world - 1 - r]]) for r in range(world)]
    return [idx[r::world] for r in range(world)]  # striped


def positions_from_lengths(lengths: Sequence[int], layout: str, what: str) -> list[Tensor]:
    """Global positions of every rank's shard, given every rank's local length.

    ``contiguous`` accepts any lengths (rank r holds the next ``lengths[r]`` tokens); ``zigzag`` and
    ``striped`` need exactly the lengths :func:`shard` produces for the total.
    """
    lengths = [int(n) for n in lengths]
    total = sum(lengths)
    if layout == "contiguous":
        return list(torch.arange(total).split(lengths))
    expected = layout_positions(total, len(lengths), layout)
    if [len(p) for p in expected] != lengths:
        raise ValueError(
            f"{what}: layout {layout!r} over {len(lengths)} ranks for a total of {total} tokens expects local "
            f"lengths {[len(p) for p in expected]}, got {lengths}; cut the sequence with "
            f"multihead.distributed.shard(x, dim, rank, world, layout={layout!r})"
        )
    return expected


def shard(x: Tensor, dim: int, rank: int, world: int, layout: str = "contiguous") -> Tensor:
    """This rank's shard of the sequence axis ``dim`` of ``x``, in ``layout`` (see :data:`LAYOUTS`).

    Lengths need not divide: ``L`` tokens are cut into ``P`` (contiguous, striped) or ``2P`` (zigzag)
    chunks whose sizes differ by at most one, like ``torch.tensor_split``. For x of shape (B, 8, E)
    and ``world=2``, ``shard(x, 1, 0, 2, "zigzag")`` is ``x[:, [0, 1, 6, 7]]`` (B, 4, E).
    """
    check_layout(layout)
    if not isinstance(world, int) or world < 1 or not isinstance(rank, int) or not 0 <= rank < world:
        raise ValueError(f"need 0 <= rank < world, got rank={rank!r}, world={world!r}")
    pos = layout_positions(x.shape[dim], world, layout)[rank]
    return x.index_select(dim, pos.to(x.device))  # (..., L_r, ...)


def unshard(shards: Sequence[Tensor], dim: int, layout: str = "contiguous") -> Tensor:
    """Reassemble the sequence from every rank's shard (``shards[r]`` from rank r); inverse of :func:`shard`.

    ``unshard([shard(x, d, r, P, layout) for r in range(P)], d, layout)`` equals ``x``.
    """
    check_layout(layout)
    pos = positions_from_lengths([s.shape[dim] for s in shards], layout, "unshard")
    flat = torch.cat(list(shards), dim)  # (..., L, ...) in rank order
    order = torch.cat(pos).to(flat.device)  # (L,) global position of each row of `flat`
    return torch.empty_like(flat).index_copy_(dim, order, flat)  # (..., L, ...) in sequence order


def gather_sequence(x: Tensor, dim: int, *, layout: str = "contiguous", group: Any = None) -> Tensor:
    """All-gather every rank's shard of ``x`` along ``dim`` and :func:`unshard` it (not differentiable).

    Every rank of ``group`` must call it; shards may differ in length along ``dim``.
    """
    check_layout(layout)
    world = dist.get_world_size(group)
    length = torch.tensor([x.shape[dim]], device=x.device)
    lengths = [torch.zeros_like(length) for _ in range(world)]
    dist.all_gather(lengths, length, group=group)
    sizes = [int(n) for n in lengths]
    pad = list(x.shape)
    pad[dim] = max(sizes) - x.shape[dim]
    padded = torch.cat([x, x.new_zeros(pad)], dim).contiguous()  # (..., max L_r, ...)
    parts = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded, group=group)
    return unshard([p.narrow(dim, 0, n) for p, n in zip(parts, sizes)], dim, layout)


class Region(NamedTuple):
    """The part of one (Lq_r, Lk_s) block that a causal mask leaves visible.

    ``rows`` [i0, Lq_r) are the queries that see at least one of the keys, ``cols`` [0, j1) the keys at
    least one of them sees. ``seen`` (n,) is how many of the keys each visible row sees (a staircase),
    None when every visible row sees all of ``cols``; ``triangle`` marks the plain top-left triangle
    (n == m, row i sees columns <= i) that fused kernels apply without a mask tensor. The parts
    :func:`split_region` cuts may start past key 0 (a triangle's tiles on its diagonal).
    """

    rows: slice
    cols: slice
    seen: Tensor | None
    triangle: bool

    @property
    def size(self) -> int:
        """Score entries computed for this region (per batch row and head)."""
        return (self.rows.stop - self.rows.start) * (self.cols.stop - self.cols.start)


def visible_region(q_pos: Tensor, k_pos: Tensor, causal_offset: int | None) -> Region | None:
    """Region of queries at global positions ``q_pos`` (n,) x keys at ``k_pos`` (m,) that is visible.

    ``causal_offset`` = L_k - L_q (totals) for bottom-right causal attention (query i sees keys
    j <= i + offset), None without a causal mask. Returns None when the mask hides the whole block.
    """
    lq, lk = len(q_pos), len(k_pos)
    if causal_offset is None:
        return Region(slice(0, lq), slice(0, lk), None, False)
    # Positions ascend within a shard, so query i sees a prefix of the keys: its first `seen[i]`.
    seen = torch.searchsorted(k_pos.contiguous(), q_pos + causal_offset, right=True)  # (Lq,)
    i0 = int(torch.searchsorted(seen, 1))  # first row that sees a key (seen is non-decreasing)
    if i0 == lq:
        return None
    j1 = int(seen[-1])
    rows, cols = slice(i0, lq), slice(0, j1)
    if int(seen[i0]) == j1:  # every visible row sees every visible key: a rectangle
        return Region(rows, cols, None, False)
    if i0 == 0 and j1 == lq and torch.equal(seen, torch.arange(1, lq + 1)):
        return Region(rows, cols, None, True)  # the plain triangle
    return Region(rows, cols, seen[i0:], False)  # a staircase


def split_region(region: Region, tile: int | None = None) -> list[Region]:
    """A staircase region as its staircase rows (a triangle where they form one) and the rows below them
    that see every visible key (a rectangle): the parts a kernel runs without a (rows, keys) mask.

    Rows that see all of ``region.cols`` form a suffix (``seen`` is non-decreasing). With ``tile``, a
    rectangle is further cut into tiles of at most ``tile`` rows (what a block allocates -- its output
    rows -- stays that small), and so is a triangle: each tile of its rows as the rectangle left of the
    diagonal and a small triangle on it (the fused kernel computes a whole triangle of up to 512 keys
    either way, so the tiles cost no more than the triangle).
    """
    if region.triangle:
        return _triangle_tiles(region.rows.start, region.rows.stop - region.rows.start, tile)
    if region.seen is None:
        return _tiles(region, tile)
    seen, full, start = region.seen, region.cols.stop, region.rows.start
    k = int(torch.searchsorted(seen, full))  # rows [start, start + k) see only part of the keys
    parts = []
    if k:
        stair = seen[:k]
        j1 = int(stair[-1])
        triangle = k == j1 and torch.equal(stair, torch.arange(1, k + 1))
        if triangle:
            parts += _triangle_tiles(start, k, tile)
        else:
            parts.append(Region(slice(start, start + k), slice(0, j1), stair, False))
    if k < len(seen):
        parts += _tiles(Region(slice(start + k, region.rows.stop), slice(0, full), None, False), tile)
    return parts


def _triangle_tiles(start: int, n: int, tile: int | None) -> list[Region]:
    """The triangle of rows [start, start + n) x keys [0, n) (row i sees keys <= i - start) in tiles of at
    most ``tile`` rows: for the tile at offset i, the keys [0, i) as a rectangle and [i, i + t) as a
    triangle, whose rows and keys start together (the top-left triangle a fused kernel applies)."""
    if tile is None or n <= tile:
        return [Region(slice(start, start + n), slice(0, n), None, True)]
    parts = []
    for i in range(0, n, tile):
        e = min(i + tile, n)
        if i:
            parts.append(Region(slice(start + i, start + e), slice(0, i), None, False))
        parts.append(Region(slice(start + i, start + e), slice(i, e), None, True))
    return parts


def _tiles(region: Region, tile: int | None) -> list[Region]:
    """A rectangle (no staircase, no triangle) cut into tiles of at most ``tile`` rows."""
    rows = region.rows
    if tile is None or region.seen is not None or rows.stop - rows.start <= tile:
        return [region]
    starts = range(rows.start, rows.stop, tile)
    return [Region(slice(i, min(i + tile, rows.stop)), region.cols, None, False) for i in starts]


def causal_work(total: int, world: int, layout: str = "contiguous") -> list[int]:
    """Score entries each rank computes (per batch row and head) for causal self-attention.

    ``total`` tokens cut by :func:`shard` over ``world`` ranks; blocks the causal mask hides entirely
    are skipped, as :func:`~multihead.distributed.ring_attention` does. For 8 tokens over 2 ranks,
    contiguous gives ``[16, 32]`` (rank 1 does twice the work) and zigzag ``[24, 24]``.
    """
    pos = layout_positions(total, world, check_layout(layout))
    regions = [[visible_region(pos[r], pos[s], 0) for s in range(world)] for r in range(world)]
    return [sum(reg.size for reg in row if reg is not None) for row in regions]
