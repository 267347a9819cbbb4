"""Ring attention for modules: an ``attention_fn`` that modules call with this rank's shards.

Dimensions: B batch, H query heads, Hkv key/value heads, Lq/Lk this rank's local query/key lengths,
Dk/Dv head dims, E embedding width, L_r this rank's tokens.

:func:`use_process_group` installs a :class:`ShardedAttention` as the ``attention_fn`` of every
:class:`~multihead.MultiHeadAttention` in a model; the module then projects this rank's tokens and the
seam (:mod:`multihead.nn.seam`) calls ring attention with them. Nothing distributed lives in the module.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import Tensor, nn

from ..core import masks as _masks
from ..nn.attention import MultiHeadAttention
from ..nn.seam import check_positions
from .ring import ring_attention
from .sharding import check_layout

__all__ = ["ShardedAttention", "sharded_attention", "use_process_group"]


def sharded_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    group: Any,
    layout: str = "contiguous",
    mask: Tensor | None = None,
    bias: Tensor | None = None,
    valid_lens: Tensor | None = None,
    causal: bool = False,
    scale: float | None = None,
    dropout: float = 0.0,
    return_weights: bool = False,
    backend: str = "auto",
) -> Tensor:
    """:func:`multihead.attention`'s signature over sharded sequences, for modules; runs :func:`ring_attention`.

    ``mask`` may only be a key-padding mask, bool (B|1, 1, 1, Lk) for this rank's keys (what
    :func:`multihead.masks.key_padding` builds); ``bias``, other masks, ``dropout > 0`` and
    ``return_weights`` need the whole (Lq, Lk) score matrix on one rank and are rejected. ``backend``
    is ignored: each block step is the ring's own.
    """
    del backend
    problems = []
    if bias is not None:
        problems.append("bias= (a float bias over all keys) is not supported")
    if dropout:
        problems.append(f"dropout={dropout} is not supported: set the module's dropout to 0 or call .eval()")
    if return_weights:
        problems.append("return_weights=True is not supported: the full weights never exist on one rank")
    key_mask = None
    if mask is not None:
        b, lk = q.shape[0], k.shape[2]
        if not (
            isinstance(mask, Tensor) and mask.dim() == 4 and mask.shape[1:3] == (1, 1) and mask.shape[3] == lk
        ):
            got = tuple(mask.shape) if isinstance(mask, Tensor) else type(mask).__name__
            problems.append(
                f"mask= must be a key-padding mask of shape (B, 1, 1, Lk) = {(b, 1, 1, lk)} for this rank's "
                f"keys (multihead.masks.key_padding(keep_local)), got {got}; use causal= or valid_lens= "
                f"for the rest"
            )
        else:
            key_mask = _masks.check_mask(mask, (b, 1, 1, lk)).expand(b, 1, 1, lk)[:, 0, 0]  # (B, Lk)
    if problems:
        raise ValueError("attention over a process group: " + "; ".join(problems))
    return ring_attention(
        q,
        k,
        v,
        causal=causal,
        group=group,
        layout=layout,
        valid_lens=valid_lens,
        key_mask=key_mask,
        scale=scale,
    )


@dataclass(frozen=True)
class ShardedAttention:
    """An ``attention_fn`` for modules whose inputs are this rank's shards: ring attention over ``group``.

    Same signature as :func:`multihead.attention` (see :func:`sharded_attention` for what it refuses);
    ``local`` is the module's attention function before it was installed, restored by
    ``use_process_group(model, None)``.
    """

    group: Any
    layout: str
    local: Callable[..., Any]
    sharded: bool = True  # read by multihead.nn.seam: positions (rotary, KV cache) are per rank

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, **kwargs: Any) -> Tensor:
        return sharded_attention(q, k, v, group=self.group, layout=self.layout, **kwargs)


def use_process_group(model: nn.Module, group: Any, *, layout: str = "contiguous") -> list[str]:
    """Make every :class:`~multihead.MultiHeadAttention` inside ``model`` run ring attention over ``group``.

    It installs a :class:`ShardedAttention` as each module's ``attention_fn`` (the torch drop-in
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
                m, ShardedAttention(group, layout, m.attention_fn), rotary=m.rotary is not None, cache=False
            )
    for m in found.values():
        local = m.attention_fn.local if isinstance(m.attention_fn, ShardedAttention) else m.attention_fn
        m.attention_fn = local if group is None else ShardedAttention(group, layout, local)
    return list(found)
