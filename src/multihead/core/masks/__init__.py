"""Masks: builders, functions, and the one normalisation every backend uses (``multihead.masks``).

Dimensions: B batch, H query heads, Lq query length, Lk key length.

The convention, everywhere in the library:

* a **bool** mask is ``True`` where a query *may* attend to a key; it broadcasts to (B, H, Lq, Lk);
* a **float** bias is added to the scores (``-inf`` entries forbid a key);
* ``valid_lens`` of shape (B,) or (B, Lq) keeps keys ``j < valid_len`` (the d2l meaning);
* ``causal=True`` is aligned to the **bottom right**: query ``i`` sees keys ``j <= i + (Lk - Lq)``;
* everything given combines with AND;
* ``segment_ids`` (B, L) or ``(q_ids (B, Lq), kv_ids (B, Lk))``: a query sees only keys of its own id;
  negative ids are padding;
* a query row with no allowed key gets output 0 and weight 0 (see :class:`Normalized`).

A mask or bias may also be a **function** ``fn(b, h, q_idx, kv_idx)``: a FlexAttention ``mask_mod``, or
the body of a ``score_mod``, with the meaning FlexAttention gives it (see :mod:`.evaluate`). The ``*_fn``
factories build the common ones (:func:`causal_fn`, :func:`sliding_window_fn`, :func:`chunked_fn`,
:func:`prefix_lm_fn`, :func:`segments_fn`, :func:`alibi_fn`, :func:`relative_position_fn`);
:class:`MaskFunction` composes with ``&``, ``|``, ``~``. Index functions see ``q_idx`` in [0, Lq) and
``kv_idx`` in [0, Lk): a factory aligns to the bottom right when given ``lq``/``lk``
(``j <= i + (Lk - Lq)``), else it uses the square rule ``j <= i`` (the same when Lq == Lk).
FlexAttention's own causal example is top-left; ours is not.

The modules, one job each: :mod:`.dense` (bool tensors), :mod:`.functions` (mask and bias functions),
:mod:`.evaluate` (calling them, dead rows), :mod:`.normalize` (one call's masks in canonical form, one
tile of them); the argument validators live in :mod:`multihead.core.checks`.
"""

from ..checks import check_bias, check_mask, check_segment_ids, check_valid_lens
from .blocks import BlockMaskFunction, Blocks, block_mask
from .dense import (
    bottom_right,
    causal,
    causal_keep,
    combine,
    from_valid_lens,
    index_grid,
    key_padding,
    key_padding_from_tokens,
    key_prefix,
    segment_mask,
    sliding_window,
    to_bias,
)
from .evaluate import DeadRows, attn_mask, call_fn, evaluate_fn, open_dead_rows
from .functions import (
    BiasFn,
    BiasFunction,
    KeyBound,
    MaskFn,
    MaskFunction,
    alibi_fn,
    alibi_slopes,
    and_masks,
    causal_fn,
    chunked_fn,
    or_masks,
    prefix_lm_fn,
    relative_position_fn,
    segments_fn,
    sliding_window_fn,
    tensor_fn,
)
from .normalize import Normalized, evaluate_block, materialize, normalize

__all__ = [
    "BiasFn",
    "BlockMaskFunction",
    "Blocks",
    "BiasFunction",
    "DeadRows",
    "KeyBound",
    "MaskFn",
    "MaskFunction",
    "Normalized",
    "alibi_fn",
    "alibi_slopes",
    "and_masks",
    "attn_mask",
    "block_mask",
    "bottom_right",
    "call_fn",
    "causal",
    "causal_fn",
    "causal_keep",
    "check_bias",
    "check_mask",
    "check_segment_ids",
    "check_valid_lens",
    "chunked_fn",
    "combine",
    "evaluate_block",
    "evaluate_fn",
    "from_valid_lens",
    "index_grid",
    "key_padding",
    "key_padding_from_tokens",
    "key_prefix",
    "materialize",
    "normalize",
    "open_dead_rows",
    "or_masks",
    "prefix_lm_fn",
    "relative_position_fn",
    "segment_mask",
    "segments_fn",
    "sliding_window",
    "sliding_window_fn",
    "tensor_fn",
    "to_bias",
]
