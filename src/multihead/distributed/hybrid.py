"""Hybrid (USP) attention: Ulysses inside groups of ``ulysses_size`` ranks, the ring across the groups.

Dimensions: B batch, H query heads, Hkv key/value heads, P ranks, U = ulysses_size, R = P // U ring
length, r a rank of the group (r = g*U + i: Ulysses group g, index i in it), L_r rank r's local length,
N_g the tokens of Ulysses group g (the union of its members' shards), D head dim.

The P ranks form an R x U grid. Rank r = g*U + i:

1. exchanges with the other members of its Ulysses group g (one all-to-all): afterwards it holds its
   share of the heads (:func:`~.ulysses.head_split` over U) for all N_g tokens of its group;
2. runs ring attention over the R ranks with the same index i (one per group), whose token sets are
   the groups' unions: exact attention over the whole sequence for its heads;
3. exchanges back (one all-to-all): every head of its own L_r tokens.

Each rank sends (U-1)/U of its q, k, v and output once each way in the all-to-alls and (R-1) K/V blocks
of size ~L/R * Hkv/U around the ring: Ulysses needs no more than H ranks' worth of heads, the ring
takes the rest. ``ulysses_size=None`` picks the largest U that divides P, H and Hkv (no K/V repeated).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from .agree import make_plan
from .ring import ring_with_plan
from .ulysses import Part, gather_tokens, head_split, heads_to_seq, keys_kept, seq_to_heads

__all__ = ["HybridGroups", "choose_ulysses_size", "hybrid_attention"]


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
) -> Tensor:
    """Exact attention over a sequence sharded across ``groups.group``: Ulysses within, ring across.

    Same inputs and result as :func:`~multihead.distributed.ring_attention`: q (B, H, Lq_r, Dk),
    k (B, Hkv, Lk_r, Dk), v (B, Hkv, Lk_r, Dv) this rank's shards cut in ``layout`` -> (B, H, Lq_r, Dv),
    differentiable. ``groups`` from :meth:`HybridGroups.create` (made once, e.g. by
    :func:`~multihead.distributed.context_parallel`). ``ulysses_size`` may not exceed H.
    """
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
    )
    u = groups.ulysses_size
    if u > plan.heads:
        raise ValueError(
            f"hybrid_attention: ulysses_size={u} exceeds the H={plan.heads} query heads; pick ulysses_size <= "
            f"{plan.heads} (or None to choose)"
        )
    g = plan.rank // u
    members = range(g * u, (g + 1) * u)
    q_union, k_union = _unions(plan.q_pos_all, u), _unions(plan.k_pos, u)
    # each member's tokens as indices into its group's union (a permutation of 0..N_g-1)
    rel_q = [torch.searchsorted(q_union[g], plan.q_pos_all[r]) for r in members]
    rel_k = [torch.searchsorted(k_union[g], plan.k_pos[r]) for r in members]
    shares = head_split(plan.heads, plan.kv_heads, u)
    kv_of = [s.kv for s in shares]
    qh, kh, vh = seq_to_heads(
        [Part(q, [s.q for s in shares], rel_q), Part(k, kv_of, rel_k), Part(v, kv_of, rel_k)], groups.ulysses
    )  # (B, H_i, N_g, Dk), (B, Hkv_i, N_g, Dk), (B, Hkv_i, N_g, Dv)
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
    ring = make_plan(
        qh,
        kh,
        vh,
        causal=causal,
        group=groups.ring,
        layout=layout,
        valid_lens=rows,
        key_mask=keep,
        scale=plan.scale,
        segment_ids=ids,
        strategy="hybrid",
        positions=(q_union, k_union),
    )
    out = ring_with_plan(qh, kh, vh, keep, ring)  # (B, H_i, N_g, Dv)
    return heads_to_seq(out, [s.heads for s in shares], rel_q, groups.ulysses)  # (B, H, Lq_r, Dv)
