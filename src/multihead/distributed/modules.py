"""Sequence-parallel attention functions for modules: the ``attention_fn`` that modules call with shards.

Dimensions: B batch, H query heads, Hkv key/value heads, Lq/Lk this rank's local query/key lengths,
Dk/Dv head dims, E embedding width, L_r this rank's tokens.

Each strategy is an :class:`~multihead.core.options.OptionsAttention`: it receives the call's
:class:`~multihead.core.options.AttentionOptions` record from the seam (:mod:`multihead.nn.seam`) and
refuses by name what it cannot serve. :class:`ShardedAttention` holds what they share (the group, the
layout, the module's own function to restore); :class:`RingAttention` is the ring.

:func:`use_process_group` installs a :class:`RingAttention` as the ``attention_fn`` of every
:class:`~multihead.MultiHeadAttention` in a model; the module then projects this rank's tokens and the
seam calls ring attention with them. Nothing distributed lives in the module.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

from torch import Tensor, nn
from torch.nn.attention.flex_attention import BlockMask

from ..core import masks as _masks
from ..core.options import AttentionOptions, OptionsAttention
from ..nn.attention import MultiHeadAttention
from ..nn.seam import check_positions
from .hybrid import HybridGroups, hybrid_attention
from .ring import ring_attention
from .sharding import check_layout
from .ulysses import ulysses_attention

__all__ = [
    "HybridAttention",
    "RingAttention",
    "ShardedAttention",
    "UlyssesAttention",
    "key_mask_of",
    "sharded_attention",
    "use_process_group",
]


def key_mask_of(mask: Any, q: Tensor, k: Tensor) -> Tensor | None:
    """A key-padding ``mask`` (B|1, 1, 1, Lk) for this rank's keys as (B, Lk) bool; None without one.

    Raises ``ValueError`` for any other mask (a function, a per-query or per-head mask).
    """
    if mask is None:
        return None
    b, lk = q.shape[0], k.shape[2]
    if not (
        isinstance(mask, Tensor) and mask.dim() == 4 and mask.shape[1:3] == (1, 1) and mask.shape[3] == lk
    ):
        got = tuple(mask.shape) if isinstance(mask, Tensor) else type(mask).__name__
        raise ValueError(
            f"mask= must be a key-padding mask of shape (B, 1, 1, Lk) = {(b, 1, 1, lk)} for this rank's "
            f"keys (multihead.masks.key_padding(keep_local)), got {got}; use causal=, valid_lens= or "
            f"segment_ids= for the rest"
        )
    return _masks.check_mask(mask, (b, 1, 1, lk)).expand(b, 1, 1, lk)[:, 0, 0]  # (B, Lk)


@dataclass(frozen=True)
class ShardedAttention(OptionsAttention):
    """What every sequence-parallel attention function holds: q, k, v are this rank's shards.

    ``group`` the process group; ``layout`` how sequences are cut (:data:`~multihead.distributed.LAYOUTS`);
    ``local`` the module's attention function before :func:`use_process_group` installed this one (it
    restores it; :func:`~multihead.distributed.context_parallel` keeps its own record).
    Subclasses refuse, besides their own limits, what needs the whole (Lq, Lk) score matrix on one rank.
    """

    group: Any
    layout: str
    local: Callable[..., Any] | None = None
    sharded: ClassVar[bool] = True  # read by multihead.nn.seam: positions (rotary, KV cache) are per rank

    def why_not(self, q: Tensor, k: Tensor, v: Tensor, options: AttentionOptions) -> Iterator[str]:
        """Every reason this rank's shards with ``options`` cannot be served (none: they can)."""
        if options.return_weights:
            yield "return_weights=True is not supported: the full weights never exist on one rank"


@dataclass(frozen=True)
class RingAttention(ShardedAttention):
    """Ring attention over ``group`` (:func:`~multihead.distributed.ring_attention`), as an ``attention_fn``.

    Serves ``causal``, ``valid_lens``, ``segment_ids``, ``scale``, ``softcap``, ``sinks`` and a key-padding
    ``mask``; ``backend`` is ignored (each block step is the ring's own).
    """

    name: ClassVar[str] = "ring attention over a process group"

    def why_not(self, q: Tensor, k: Tensor, v: Tensor, options: AttentionOptions) -> Iterator[str]:
        yield from super().why_not(q, k, v, options)
        if options.bias is not None:
            yield "bias= (a float bias over all keys) is not supported"
        if options.dropout:
            yield f"dropout={options.dropout} is not supported: set the module's dropout to 0 or call .eval()"
        yield from _key_mask_problem(options.mask, q, k)

    def serve(self, q: Tensor, k: Tensor, v: Tensor, options: AttentionOptions, backend: str) -> Tensor:
        del backend
        return ring_attention(q, k, v, group=self.group, **self._keywords(q, k, options))

    def _keywords(self, q: Tensor, k: Tensor, options: AttentionOptions) -> dict[str, Any]:
        """The keywords the ring (and the hybrid) take from a call's options, the key mask cut from its mask."""
        return {
            "causal": options.causal,
            "layout": self.layout,
            "valid_lens": options.valid_lens,
            "key_mask": key_mask_of(options.mask, q, k),
            "segment_ids": options.segment_ids,
            "scale": options.scale,
            "softcap": options.softcap,
            "sinks": options.sinks,
        }


@dataclass(frozen=True)
class HybridAttention(RingAttention):
    """Hybrid (USP) attention as an ``attention_fn``: Ulysses within ``groups.ulysses_size`` ranks, the ring
    across (:func:`~multihead.distributed.hybrid.hybrid_attention`); serves what :class:`RingAttention`
    serves. ``groups`` are made once (:meth:`~multihead.distributed.hybrid.HybridGroups.create`)."""

    name: ClassVar[str] = "hybrid (ulysses x ring) attention over a process group"
    groups: HybridGroups | None = None

    def serve(self, q: Tensor, k: Tensor, v: Tensor, options: AttentionOptions, backend: str) -> Tensor:
        del backend
        if self.groups is None:
            raise ValueError("HybridAttention needs groups=HybridGroups.create(group, ulysses_size)")
        return hybrid_attention(q, k, v, groups=self.groups, **self._keywords(q, k, options))


def _key_mask_problem(mask: Any, q: Tensor, k: Tensor) -> Iterator[str]:
    try:
        key_mask_of(mask, q, k)
    except ValueError as exc:
        yield str(exc)


def _is_function(x: Any) -> bool:
    """A mask or bias *function* (b, h, q_idx, kv_idx), not a tensor nor a flex BlockMask (per rank)."""
    return callable(x) and not isinstance(x, (Tensor, BlockMask))


@dataclass(frozen=True)
class UlyssesAttention(ShardedAttention):
    """Ulysses attention over ``group`` (:func:`~multihead.distributed.ulysses_attention`), as an
    ``attention_fn``: all-to-all to head shards, the module's ``backend`` on the whole sequence, and back.

    Serves ``causal``, ``valid_lens``, ``segment_ids``, ``softcap``, ``sinks``, ``scale``, ``dropout``, a
    key-padding ``mask``, and ``mask``/``bias`` *functions* of global positions.
    """

    name: ClassVar[str] = "ulysses attention over a process group"

    def why_not(self, q: Tensor, k: Tensor, v: Tensor, options: AttentionOptions) -> Iterator[str]:
        yield from super().why_not(q, k, v, options)
        if options.bias is not None and not _is_function(options.bias):
            yield "bias= as a tensor is per rank; pass a function fn(b, h, q_idx, kv_idx) of global positions"
        if not _is_function(options.mask):
            yield from _key_mask_problem(options.mask, q, k)

    def serve(self, q: Tensor, k: Tensor, v: Tensor, options: AttentionOptions, backend: str) -> Tensor:
        fn = _is_function(options.mask)
        return ulysses_attention(
            q,
            k,
            v,
            causal=options.causal,
            group=self.group,
            layout=self.layout,
            valid_lens=options.valid_lens,
            key_mask=None if fn else key_mask_of(options.mask, q, k),
            segment_ids=options.segment_ids,
            scale=options.scale,
            softcap=options.softcap,
            sinks=options.sinks,
            mask=options.mask if fn else None,
            bias=options.bias,
            dropout=options.dropout,
            backend=backend,
        )


def sharded_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    group: Any,
    layout: str = "contiguous",
    backend: str = "auto",
    **options: Any,
) -> Tensor:
    """:func:`multihead.attention`'s signature over sharded sequences, for modules; runs :func:`ring_attention`.

    ``mask`` may only be a key-padding mask, bool (B|1, 1, 1, Lk) for this rank's keys (what
    :func:`multihead.masks.key_padding` builds); ``bias``, other masks, ``dropout > 0`` and
    ``return_weights`` need the whole (Lq, Lk) score matrix on one rank and are rejected
    (:class:`RingAttention` names what it refuses).
    """
    out = RingAttention(group, layout, ring_attention)(q, k, v, backend=backend, **options)
    assert isinstance(out, Tensor)
    return out


def use_process_group(model: nn.Module, group: Any, *, layout: str = "contiguous") -> list[str]:
    """Make every :class:`~multihead.MultiHeadAttention` inside ``model`` run ring attention over ``group``.

    It installs a :class:`RingAttention` as each module's ``attention_fn`` (the torch drop-in
    :class:`multihead.compat.torch.MultiheadAttention` included). Afterwards each rank feeds the model its
    shard of every sequence, (B, L_r, E), cut with :func:`shard` in the same ``layout``; token-wise layers
    (projections, feed-forward, norms) need nothing else. ``group=None`` restores each module's own
    attention function; pass ``torch.distributed.group.WORLD`` for all ranks. Modules with rotary
    embeddings are refused here (their positions would be per rank). Returns the names of the modules set.
    """
    check_layout(layout)
    found = {name: m for name, m in model.named_modules() if isinstance(m, MultiHeadAttention)}
    if not found:
        raise ValueError(f"{type(model).__name__} contains no multihead.MultiHeadAttention to set a group on")
    for m in found.values():
        if group is not None:
            check_positions(
                m, RingAttention(group, layout, m.attention_fn), rotary=m.rotary is not None, cache=False
            )
    for m in found.values():
        local = m.attention_fn.local if isinstance(m.attention_fn, ShardedAttention) else m.attention_fn
        m.attention_fn = local if group is None else RingAttention(group, layout, local)
    return list(found)
