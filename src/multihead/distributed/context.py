"""``context_parallel``: every attention of a model sequence-parallel over a group, for one block.

Dimensions: B batch, L a sequence's total length, L_r this rank's tokens, H query heads, Hkv key/value
heads, P ranks.

Inside ``with context_parallel(model, group, strategy=...) as cp:`` each rank feeds the model its shard
of every sequence (``cp.shard(batch)`` cuts a batch dict) with *global* ``position_ids``, and gets its
rows of the single-process result. The block installs one sequence-parallel attention function
(:class:`~.modules.RingAttention`, :class:`~.modules.UlyssesAttention` or
:class:`~.modules.HybridAttention`) as the ``attention_fn`` of every attention module the head tools know
(:func:`multihead.heads.naming.attention_modules`: multihead's own modules and, once
:mod:`multihead.integrations.transformers` is imported, Hugging Face attention modules on
``attn_implementation="multihead"``), and leaving it puts every module back as it was. Token-wise layers
(embeddings, norms, MLPs, rotary from position ids) need nothing else. Only attention changes: the
training loop still reduces parameter gradients over the group (DDP/FSDP or an ``all_reduce``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ..heads.naming import attention_modules, check_routed, module_heads
from ..nn.attention import MultiHeadAttention
from ..nn.seam import check_positions
from .agree import STRATEGIES, agree_on
from .hybrid import HybridGroups, choose_ulysses_size
from .modules import HybridAttention, RingAttention, ShardedAttention, UlyssesAttention
from .sharding import LAYOUTS, check_layout, gather_sequence, shard

__all__ = ["ContextParallel", "context_parallel", "current", "shard_batch"]

_ACTIVE: ContextVar[ContextParallel | None] = ContextVar("multihead_context_parallel", default=None)
_MISSING = object()


def current() -> ContextParallel | None:
    """The innermost open :func:`context_parallel` block of this thread/task, or None."""
    return _ACTIVE.get()


def shard_batch(
    batch: Mapping[str, Any], rank: int, world: int, layout: str = "zigzag", *, ignore_index: int = -100
) -> dict[str, Any]:
    """This rank's part of a batch dict of full sequences: every (B, L, ...) tensor cut along dim 1.

    ``input_ids`` (B, L) (or the first tensor with two or more dims) gives L. ``position_ids`` are the
    *global* positions (``arange(L)`` when absent; pass your own for packed sequences, restarting at 0
    in each). ``labels`` (B, L) are shifted once over the whole sequence -- token i learns token i + 1,
    also across rank boundaries -- and returned as ``labels`` and ``shift_labels`` with
    ``num_items_in_batch``, the global count of labels != ``ignore_index``; a Hugging Face causal LM
    then divides each rank's token-loss sum by the global count, so the per-rank losses add up to the
    single-process loss. Other entries are passed through.

    For L = 8 over 2 ranks, zigzag: rank 0 gets positions 0 1 6 7, rank 1 positions 2 3 4 5.
    """
    lead = batch.get("input_ids")
    if not isinstance(lead, Tensor):
        lead = next((x for x in batch.values() if isinstance(x, Tensor) and x.dim() >= 2), None)
    if lead is None:
        raise ValueError("shard_batch needs a batch dict with input_ids (B, L) or another (B, L, ...) tensor")
    b, length = lead.shape[0], lead.shape[1]

    def cut(x: Tensor) -> Tensor:
        return shard(x, 1, rank, world, layout)

    out: dict[str, Any] = {}
    for name, x in batch.items():
        if name == "labels":
            pad = x.new_full((x.shape[0], 1), ignore_index)
            shifted = torch.cat([x[:, 1:], pad], dim=1)  # (B, L): the label of token i is token i + 1
            out["labels"] = out["shift_labels"] = cut(shifted)
            out["num_items_in_batch"] = (shifted != ignore_index).sum()
        elif isinstance(x, Tensor) and x.dim() >= 2 and x.shape[1] == length:
            out[name] = cut(x)  # (B, L_r, ...)
        else:
            out[name] = x
    if "position_ids" not in batch:
        out["position_ids"] = cut(torch.arange(length, device=lead.device).expand(b, length))  # (B, L_r)
    return out


@dataclass
class ContextParallel:
    """An open :func:`context_parallel` block: the group, the strategy's attention function, and helpers."""

    group: Any
    strategy: str
    layout: str
    attention_fn: ShardedAttention
    rank: int
    world: int
    _cache: list[Any] = field(default_factory=list, repr=False)

    def shard(self, batch: Mapping[str, Any], *, ignore_index: int = -100) -> dict[str, Any]:
        """This rank's part of ``batch`` (:func:`shard_batch` with this block's rank, world and layout)."""
        return shard_batch(batch, self.rank, self.world, self.layout, ignore_index=ignore_index)

    def from_global(self, local: Tensor, derive: Callable[[Tensor], Tensor | None]) -> Tensor | None:
        """``derive`` applied to the whole sequence of a per-token tensor, cut back to this rank.

        ``local`` (B, L_r) (e.g. position ids) is all-gathered into (B, L), ``derive`` maps it to another
        (B, L) tensor (e.g. the segment ids where positions restart) or None, and this rank's part is
        returned: every rank gets its part of one answer. The last answer is kept for the same ``local``
        tensor (the layers of one forward share it).
        """
        if self._cache and self._cache[0] is local:
            return self._cache[1]
        whole = derive(gather_sequence(local, 1, layout=self.layout, group=self.group))  # (B, L) | None
        mine = None if whole is None else shard(whole, 1, self.rank, self.world, self.layout)  # (B, L_r)
        self._cache[:] = [local, mine]
        return mine


def _strategy_fn(
    strategy: str, group: Any, layout: str, ulysses_size: int | None, heads: tuple[int, int]
) -> ShardedAttention:
    if strategy == "ring":
        return RingAttention(group, layout)
    if strategy == "ulysses":
        return UlyssesAttention(group, layout)
    world = dist.get_world_size(group)
    size = choose_ulysses_size(heads[0], heads[1], world) if ulysses_size is None else ulysses_size
    return HybridAttention(group, layout, groups=HybridGroups.create(group, size))


@contextmanager
def context_parallel(
    model: nn.Module,
    group: Any = None,
    *,
    strategy: str = "ring",
    layout: str = "zigzag",
    ulysses_size: int | None = None,
) -> Iterator[ContextParallel]:
    """Make every attention in ``model`` sequence-parallel over ``group`` for the block.

    Args:
        model: a module tree with :class:`~multihead.MultiHeadAttention` layers, or a Hugging Face model
            loaded with ``attn_implementation="multihead"`` (import :mod:`multihead.integrations.transformers`).
        group: the process group (None: the whole world).
        strategy: ``"ring"`` (:func:`~multihead.distributed.ring_attention`), ``"ulysses"``
            (:func:`~multihead.distributed.ulysses_attention`) or ``"hybrid"`` (Ulysses over groups of
            ``ulysses_size`` ranks, the ring across them; None: the largest size dividing P, H and Hkv).
        layout: how sequences are cut (:data:`~multihead.distributed.LAYOUTS`); zigzag balances causal work.

    Yields a :class:`ContextParallel`: ``cp.shard(batch)`` cuts a batch dict for this rank. Every rank
    feeds the model its shard with global ``position_ids`` and gets its rows of the single-process
    result. Leaving the block (also on error) restores every module's own attention function.
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
    check_layout(layout)
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "context_parallel needs an initialized torch.distributed process group: call "
            "torch.distributed.init_process_group(...) in every process (or start them with torchrun)"
        )
    group = dist.group.WORLD if group is None else group
    found = attention_modules(model)
    if not found:
        raise ValueError(
            f"{type(model).__name__} contains no attention module multihead knows (multihead.MultiHeadAttention, "
            f"or a Hugging Face model on attn_implementation='multihead' after importing "
            f"multihead.integrations.transformers)"
        )
    check_routed(model)
    heads = module_heads(next(iter(found.values())))
    choices = {"strategy": STRATEGIES.index(strategy), "layout": LAYOUTS.index(layout)}
    choices.update(
        ulysses_size=-1 if ulysses_size is None else ulysses_size if isinstance(ulysses_size, int) else -2,
        heads=heads[0],
        kv_heads=heads[1],
    )
    agree_on(group, "context_parallel", choices, {"strategy": STRATEGIES, "layout": LAYOUTS})
    fn = _strategy_fn(strategy, group, layout, ulysses_size, heads)
    for m in found.values():
        if isinstance(m, MultiHeadAttention):
            check_positions(m, fn, rotary=m.rotary is not None, cache=False)
    saved = {name: m.__dict__.get("attention_fn", _MISSING) for name, m in found.items()}
    cp = ContextParallel(group, strategy, layout, fn, dist.get_rank(group), dist.get_world_size(group))
    token = _ACTIVE.set(cp)
    try:
        for m in found.values():
            m.attention_fn = fn
        yield cp
    finally:
        _ACTIVE.reset(token)
        for name, m in found.items():
            if saved[name] is _MISSING:
                m.__dict__.pop("attention_fn", None)
            else:
                m.attention_fn = saved[name]
