"""Hybrid (USP) attention: Ulysses inside groups of ``ulysses_size`` ranks, the ring across the groups.

Dimensions: B batch, H query heads, Hkv key/value heads, P ranks, U = ulysses_size, R = P // U ring
length, r a rank of the group (r = g*U + i: Ulysses group g, index i in it), L_r rank r's local length,
N_g the tokens of Ulysses group g (the union of its members' shards), D head dim.

The P ranks form an R x U grid. Rank r = g*U + i:

1. exchanges with the other members of its Ulysses group g (all-to-alls, a chunk of heads at a time as
   :mod:`.exchange` cuts them): it then holds the chunk's heads for all N_g tokens of its group;
2. runs ring attention over the R ranks with the same index i (one per group), whose token sets are
   the groups' unions: exact attention over the whole sequence for the chunk's heads, the K/V shards
   travelling in pieces (as :func:`~.ring.ring_attention` streams them);
3. exchanges the chunk's output back: every head of its own L_r tokens, into the output.

Each rank sends (U-1)/U of its q, k, v and output once each way in the all-to-alls and (R-1) K/V blocks
of size ~L/R * Hkv/U around the ring: Ulysses needs no more than H ranks' worth of heads, the ring
takes the rest. ``ulysses_size=None`` picks the largest U that divides P, H and Hkv (no K/V repeated).
By default a chunk is a whole group of query heads with its K/V head, so each K/V head goes around the
ring once; ``head_chunks`` above the K/V heads a rank holds cuts groups, and then a K/V head goes around
once per chunk that reads it (less memory, more bytes: the planner counts them). U = 1 is the plain
ring, R = 1 plain Ulysses (no exchange, resp. no ring, at all), and one rank plain attention.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

from ..core.options import AttentionOptions
from .agree import Plan, check_head_chunks, make_plan
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
from .ring import auto_pieces, ring_with_plan
from .ulysses import alone, attend_alone, keys_kept, ulysses_with_plan

__all__ = ["HybridGroups", "choose_ulysses_size", "hybrid_attention", "hybrid_head_chunks"]


def choose_ulysses_size(heads: int, kv_heads: int, world: int) -> int:
    """The largest U dividing P = ``world`` with H % U == Hkv % U == 0: Ulysses without repeated K/V,
    the ring for the rest (1: a plain ring; P: plain Ulysses)."""
    return max(u for u in range(1, world + 1) if world % u == 0 and heads % u == 0 and kv_heads % u == 0)


@dataclass(frozen=True)
class HybridGroups:
    """The process groups of an R x U grid over ``group``: this rank's Ulysses group and ring group."""

    group: Any
    ulysses_size: int
    ulysses: Any  # the U ranks g*U .. g*U + U-1 of this rank's Ulysses group g
    ring: Any  # the R ranks with this rank's index i: i, U + i, 2U + i, ...

    @classmethod
    def create(cls, group: Any, ulysses_size: int) -> HybridGroups:
        """Make the subgroups (every rank of the *default* group must call this, in the same order)."""
        world = dist.get_world_size(group)
        if not isinstance(ulysses_size, int) or ulysses_size < 1 or world % ulysses_size:
            raise ValueError(
                f"ulysses_size must be a positive divisor of the group's {world} ranks, got {ulysses_size!r}"
            )
        rank = dist.get_rank(group)
        glob = (lambda r: dist.get_global_rank(group, r)) if group is not None else (lambda r: r)
        u = ulysses_size
        mine_u = mine_r = None
        for g in range(world // u):  # every rank creates every subgroup, in one order
            made = dist.new_group([glob(g * u + i) for i in range(u)])
            mine_u = made if rank // u == g else mine_u
        for i in range(u):
            made = dist.new_group([glob(g * u + i) for g in range(world // u)])
            mine_r = made if rank % u == i else mine_r
        return cls(group, u, mine_u, mine_r)


def _unions(pos_all: Sequence[Tensor], u: int) -> list[Tensor]:
    """Each Ulysses group's token positions, ascending: R tensors (N_g,)."""
    return [torch.cat(list(pos_all[g * u : (g + 1) * u])).sort().values for g in range(len(pos_all) // u)]


def hybrid_head_chunks(shares: Sequence[HeadShare], batch: int, length: int, dim: int) -> list[int]:
    """Each rank's chunk count by default: as Ulysses (:func:`~.exchange.auto_head_chunks` over the
    group's ``length`` tokens), but never more than its K/V heads (a K/V head goes around the ring once)."""
    most = max(s.heads for s in shares)
    auto = auto_head_chunks(batch, length, most, dim)
    return [max(1, min(auto, len(s.kv))) for s in shares]


def hybrid_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    groups: HybridGroups,
    causal: bool = False,
    layout: str = "contiguous",
    valid_lens: Tensor | None = None,
    key_mask: Tensor | None = None,
    segment_ids: Tensor | tuple[Tensor, Tensor] | None = None,
    scale: float | None = None,
    softcap: float | None = None,
    sinks: Tensor | None = None,
    head_chunks: int | None = None,
) -> Tensor:
    """Exact attention over a sequence sharded across ``groups.group``: Ulysses within, ring across.

    Same inputs and result as :func:`~multihead.distributed.ring_attention`: q (B, H, Lq_r, Dk),
    k (B, Hkv, Lk_r, Dk), v (B, Hkv, Lk_r, Dv) this rank's shards cut in ``layout`` -> (B, H, Lq_r, Dv),
    differentiable. ``groups`` from :meth:`HybridGroups.create` (made once, e.g. by
    :func:`~multihead.distributed.context_parallel`). ``ulysses_size`` may not exceed H.
    ``softcap``, ``sinks`` (H,): as :func:`~multihead.distributed.ring_attention`. ``head_chunks``: as
    :func:`~multihead.distributed.ulysses_attention` (None: one chunk per K/V head a rank holds, at long
    lengths).
    """
    if alone(groups.group):  # one rank: plain attention
        check_head_chunks(head_chunks)
        options = AttentionOptions(
            causal=causal,
            scale=scale,
            valid_lens=valid_lens,
            segment_ids=segment_ids,
            softcap=softcap,
            sinks=sinks,
        )
        return attend_alone(q, k, v, options, key_mask, layout, "auto")
    plan = make_plan(
        q,
        k,
        v,
        causal=causal,
        group=groups.group,
        layout=layout,
        valid_lens=valid_lens,
        key_mask=key_mask,
        scale=scale,
        segment_ids=segment_ids,
        strategy="hybrid",
        pieces=auto_pieces(k),
        softcap=softcap,
        sinks=sinks,
        head_chunks=head_chunks,
    )
    u = groups.ulysses_size
    if u > plan.heads:
        raise ValueError(
            f"hybrid_attention: ulysses_size={u} exceeds the H={plan.heads} query heads; pick ulysses_size <= "
            f"{plan.heads} (or None to choose)"
        )
    if u == 1:  # groups of one: the ring over every rank, no exchange
        return ring_with_plan(q, k, v, key_mask, plan, sinks)
    if u == plan.world:  # one group: Ulysses, no ring
        options = AttentionOptions(
            causal=causal, valid_lens=valid_lens, segment_ids=segment_ids, softcap=softcap, sinks=sinks
        )
        return ulysses_with_plan(q, k, v, key_mask, plan, options, "auto", head_chunks)
    return _ulysses_then_ring(
        q,
        k,
        v,
        plan,
        groups,
        key_mask=key_mask,
        valid_lens=valid_lens,
        causal=causal,
        layout=layout,
        softcap=softcap,
        sinks=sinks,
        head_chunks=head_chunks,
    )  # (B, H, Lq_r, Dv)


def _ulysses_then_ring(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    plan: Plan,
    groups: HybridGroups,
    *,
    key_mask: Tensor | None,
    valid_lens: Tensor | None,
    causal: bool,
    layout: str,
    softcap: float | None,
    sinks: Tensor | None,
    head_chunks: int | None,
) -> Tensor:
    """:func:`hybrid_attention` on a real grid (1 < U < P): the group's all-to-alls, a chunk of heads at a
    time, each chunk's heads attended by the ring over the groups -> (B, H, Lq_r, Dv)."""
    u = groups.ulysses_size
    grid = _group_view(plan, groups, k, key_mask, valid_lens)
    ring = functools.partial(
        _ring_over_groups,
        plan=plan,
        groups=groups,
        grid=grid,
        causal=causal,
        layout=layout,
        softcap=softcap,
        sinks=sinks,
    )
    shares = head_split(plan.heads, plan.kv_heads, u)
    n_g = sum(map(len, grid.rel_q))
    dim = max(plan.dk, plan.dv)
    counts = [head_chunks] * u if head_chunks else hybrid_head_chunks(shares, plan.batch, n_g, dim)
    w_most = max(len(c.q) for cs in rank_chunks(shares, counts) for c in cs)
    windows = auto_windows(plan.batch, n_g, w_most, dim, u)  # messages, not attention
    return attend_in_chunks(
        q,
        k,
        v,
        shares,
        (grid.rel_q, grid.rel_k),
        groups.ulysses,
        counts,
        ring,
        windows=windows,
        split=False,
    )  # (B, H, Lq_r, Dv)


def _ring_over_groups(
    x: Attend,
    *,
    plan: Plan,
    groups: HybridGroups,
    grid: _GroupView,
    causal: bool,
    layout: str,
    softcap: float | None,
    sinks: Tensor | None,
) -> Tensor:
    """The ring over the R groups for one chunk's heads: x.q (B, w, N_g, Dk), x.k, x.v (B, n, N_g, D) of
    the group's tokens -> (B, w, N_g, Dv). ``sinks``: (H,) every head's, or None."""
    ring = make_plan(
        x.q,
        x.k,
        x.v,
        causal=causal,
        group=groups.ring,
        layout=layout,
        valid_lens=grid.rows,
        key_mask=grid.keep,
        scale=plan.scale,
        segment_ids=grid.ids,
        strategy="hybrid",
        positions=(grid.q_union, grid.k_union),
        pieces=auto_pieces(x.k),
        softcap=softcap,
    )
    mine = None if sinks is None else sinks[x.first : x.first + x.q.shape[1]]  # the chunk's heads
    return ring_with_plan(x.q, x.k, x.v, grid.keep, ring, mine)  # (B, w, N_g, Dv)


class _GroupView(NamedTuple):
    """This rank's Ulysses group seen as one rank of the ring: the groups' token positions and the group's
    per-token inputs gathered over its members."""

    q_union: list[Tensor]  # R tensors (N_g,): each group's query positions, ascending
    k_union: list[Tensor]  # ... and key positions
    rel_q: list[Tensor]  # per member: its query tokens as indices into its group's union
    rel_k: list[Tensor]  # ... and its key tokens
    keep: Tensor | None  # (B, N_g) the group's real keys, where some rank has padding
    rows: Tensor | None  # valid_lens: (B,) as given, or (B, N_g) gathered from per-query (B, Lq_r)
    ids: tuple[Tensor, Tensor] | None  # segment ids (B, N_g) of the group's queries and keys


def _group_view(
    plan: Plan, groups: HybridGroups, k: Tensor, key_mask: Tensor | None, valid_lens: Tensor | None
) -> _GroupView:
    """Gather what the ring over the groups needs from this rank's group (collectives over
    ``groups.ulysses``: every member calls this)."""
    u = groups.ulysses_size
    g = plan.rank // u
    members = range(g * u, (g + 1) * u)
    q_union, k_union = _unions(plan.q_pos_all, u), _unions(plan.k_pos, u)
    # each member's tokens as indices into its group's union (a permutation of 0..N_g-1)
    rel_q = [torch.searchsorted(q_union[g], plan.q_pos_all[r]) for r in members]
    rel_k = [torch.searchsorted(k_union[g], plan.k_pos[r]) for r in members]
    keep = None
    if plan.has_key_mask:  # some rank has padding (a rank without key_mask has real keys only)
        keep = gather_tokens(keys_kept(key_mask, k), rel_k, groups.ulysses)  # (B, N_g)
    rows = valid_lens
    if valid_lens is not None and valid_lens.dim() == 2:
        rows = gather_tokens(valid_lens, rel_q, groups.ulysses)  # (B, N_g)
    ids = None
    if plan.q_ids is not None and plan.kv_ids is not None:
        ids = (
            gather_tokens(plan.q_ids, rel_q, groups.ulysses),
            gather_tokens(plan.kv_ids, rel_k, groups.ulysses),
        )
    return _GroupView(q_union, k_union, rel_q, rel_k, keep, rows, ids)
