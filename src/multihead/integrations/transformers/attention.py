"""The attention function multihead registers with transformers (``AttentionInterface``).

Dimensions: B batch, H query heads, Hkv key/value heads, Lq/Lk query/key lengths, D head dim.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor, nn

from ...core import masks as _masks
from ...core.options import AttentionOptions
from ...distributed.context import current
from ...nn import seam
from .internals import _recording_attentions
from .mask import built_unpadded
from .models import _check_config

# ------------------------------------------------------------------------------------------------
# The attention function
# ------------------------------------------------------------------------------------------------


def _weights_requested(kwargs: Mapping[str, Any]) -> bool:
    """``output_attentions`` reaches the attention function only in some models; the rest record weights
    with hooks (:func:`_recording_attentions`)."""
    return bool(kwargs.get("output_attentions")) or _recording_attentions()


def segments_from_positions(position_ids: Tensor) -> Tensor:
    """(B, L) sequence ids of a packed batch: a new sequence starts where a position does not follow on.

    ``[[0, 1, 2, 0, 1, 0]]`` -> ``[[0, 0, 0, 1, 1, 2]]`` (transformers' rule for padding-free batches).
    """
    first = position_ids[:, :1] - 1  # (B, 1): the first position always "follows on"
    step = torch.diff(position_ids, prepend=first, dim=-1)  # (B, L)
    return (step != 1).cumsum(-1)  # (B, L)


def _packed_segments(position_ids: Tensor) -> Tensor | None:
    """(B, L) sequence ids where positions restart, or None when every row is one sequence."""
    if not bool((torch.diff(position_ids, dim=-1) != 1).any()):
        return None  # the common case, in two small ops
    return segments_from_positions(position_ids)  # (B, L)


_LAST_IDS: list[tuple[Tensor, int, int, Tensor | None]] = []  # (position_ids, its version, B, ids)


def _version(t: Tensor) -> int | None:
    try:
        return t._version
    except RuntimeError:  # an inference tensor keeps no version counter
        return None


def _ids_of_positions(positions: Tensor, batch: int) -> Tensor | None:
    """:func:`_packed_segments` of ``positions`` (B|1, L) for ``batch`` rows; the layers of one forward pass
    get the same ``position_ids`` tensor, so its answer is kept for the next layer (while the tensor is
    unchanged: the same object, the same version)."""
    version = None if torch.compiler.is_compiling() else _version(positions)
    if version is not None and _LAST_IDS:
        last, last_version, last_batch, ids = _LAST_IDS[0]
        if last is positions and last_version == version and last_batch == batch:
            return ids
    ids = _packed_segments(positions.expand(batch, -1))  # (B, L) | None
    if version is not None:
        _LAST_IDS[:] = [(positions, version, batch, ids)]
    return ids


def _segments(kwargs: Mapping[str, Any], batch: int, length: int) -> Tensor | None:
    """Sequence ids (B, L) of a packed batch from ``position_ids`` or ``cu_seq_lens_q``; None if absent or
    when every row is one sequence."""
    positions = kwargs.get("position_ids")
    if isinstance(positions, Tensor) and positions.dim() == 2 and positions.shape[-1] == length:
        return _ids_of_positions(positions, batch)  # (B, L) | None
    starts = kwargs.get("cu_seq_lens_q")
    if isinstance(starts, Tensor) and batch == 1 and int(starts[-1]) == length:
        index = torch.arange(length, device=starts.device)  # (L,)
        ids = torch.searchsorted(starts[1:], index, right=True)[None]  # (1, L)
        return ids if bool(ids[:, -1].any()) else None
    return None


_OTHER_OPTIONS = (
    "sliding_window",
    "position_bias",
    "softcap",
    "s_aux",
    "sinks",
    "cache",
    "output_attentions",
)


def _nothing_else(kwargs: Mapping[str, Any]) -> bool:
    """Whether transformers passed none of the options that change a call without a mask (a window, a
    position bias, softcap, sinks, a paged cache, weights) and records no weights."""
    for name in _OTHER_OPTIONS:
        if kwargs.get(name) is not None and kwargs.get(name) is not False:
            return False
    return not _recording_attentions()


def _without_mask(
    module: nn.Module, query: Tensor, key: Tensor, is_causal: bool | None, kwargs: Mapping[str, Any]
) -> tuple[Tensor | None, bool, Tensor | None]:
    """``(mask, causal, segment_ids)`` of a call transformers gave no mask: causal when the module is (for
    Lq > 1), top-left into an empty static cache, a sliding window where one applies, and packed rows where
    ``position_ids`` restart."""
    lq, lk = query.shape[2], key.shape[2]
    wants_causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
    window = kwargs.get("sliding_window")
    mask = segment_ids = None
    causal = False
    if wants_causal and lq > 1 and lk > lq:
        # prefill into an empty static cache: the keys after Lq are future slots (top-left causal)
        mask = _masks.causal(lq, lk, diagonal=0, device=query.device)  # (Lq, Lk)
    elif wants_causal and window is not None and lk > window:
        mask = _masks.sliding_window(lq, lk, window=window, device=query.device)  # (Lq, Lk), bottom right
    else:
        causal = bool(wants_causal) and lq > 1
    if wants_causal and lq == lk > 1:
        # no mask: transformers saw no padding, and no packing when a cache is on (it then skips its
        # packed-sequence check); positions that restart still mean packed rows
        segment_ids = _segments(kwargs, query.shape[0], lq)  # (B, L) | None: one sequence per row
    return mask, causal, segment_ids


def attention_forward(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | Callable[..., Tensor] | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[Tensor, Tensor | None]:
    """transformers' attention-function signature over :func:`multihead.nn.seam.attend`.

    Args:
        module: the Hugging Face attention module (its ``is_causal`` is read when no mask is given).
        query: (B, H, Lq, D); key, value: (B, Hkv, Lk, D) -- grouped-query heads are used as they are,
            K/V are never repeated.
        attention_mask: what :func:`mask_interface` returns -- bool (B|1, 1, Lq, Lk), True = may attend;
            an index function of packed sequences; or None: causal when the module is, for Lq > 1 --
            or a float mask, added to the scores (the dtype's minimum is treated as -inf).
        dropout: on the weights (transformers passes 0 in eval mode).
        scaling: score scale (default 1/sqrt(D)).
        kwargs: ``sliding_window`` (applied when no mask carries it), ``position_bias`` (added to the
            scores), ``softcap`` (Gemma 2), ``s_aux``/``sinks`` (gpt-oss's per-head sink logits (H,)),
            ``position_ids``/``cu_seq_lens_q`` (packed sequences: a new sequence where the positions
            restart, also when transformers, with a cache on, did not look), ``output_attentions``.

    Returns:
        ``(output (B, Lq, H, D), weights (B, H, Lq, Lk) or None)``: weights whenever transformers asks
        for them (``output_attentions=True``) -- otherwise the fused path runs.
    """
    config = getattr(module, "config", None)
    if config is not None:
        _check_config(config)
    if seam.is_sharded(seam.attention_fn_of(module)):  # inside multihead.distributed.context_parallel
        return _sharded_forward(
            module, query, key, value, attention_mask, dropout, scaling, is_causal, kwargs
        )
    if kwargs.get("cache") is not None:
        raise ValueError(
            "multihead attention does not serve transformers' paged cache (continuous batching); use "
            "attn_implementation='sdpa' or 'eager' for generate_batch"
        )
    lq, lk = query.shape[2], key.shape[2]
    mask = bias = segment_ids = None
    causal = False
    if attention_mask is None:
        mask, causal, segment_ids = _without_mask(module, query, key, is_causal, kwargs)
        if mask is None and segment_ids is None and not dropout and _nothing_else(kwargs):
            # a decoding step, a plain prefill: the seam's unmasked entry, unless it has work to do
            heads = seam.attend_unmasked(module, query, key, value, causal, scaling)  # (B, H, Lq, D) | None
            if heads is not None:
                return heads.transpose(1, 2).contiguous(), None  # (B, Lq, H, D)
    elif not isinstance(attention_mask, Tensor):
        mask = attention_mask  # packed sequences: transformers' index function (see mask_interface)
        segment_ids = _segments(kwargs, query.shape[0], lq) if lq == lk else None  # (B, L)
    elif attention_mask.dtype == torch.bool:
        mask = attention_mask  # (B|1, 1, Lq, Lk)
        if lq == lk and built_unpadded(attention_mask):  # a window over rows that may be packed
            segment_ids = _segments(kwargs, query.shape[0], lq)  # (B, L) | None
    else:
        floor = torch.finfo(attention_mask.dtype).min
        bias = attention_mask.masked_fill(attention_mask <= floor, float("-inf"))  # (B|1, 1, Lq, Lk)
    position_bias = kwargs.get("position_bias")
    if position_bias is not None:
        bias = position_bias if bias is None else bias + position_bias  # (B|1, H|1, Lq, Lk)
    sinks = kwargs.get("s_aux", kwargs.get("sinks"))
    if sinks is not None and tuple(sinks.shape) != (query.shape[1],):
        raise ValueError(
            f"{type(module).__name__} passes attention sinks of shape {tuple(sinks.shape)}; multihead takes one "
            f"sink logit per query head, shape ({query.shape[1]},) (gpt-oss's s_aux); run this model with "
            f"attn_implementation='eager'"
        )
    softcap = kwargs.get("softcap")
    if mask is None and bias is None and segment_ids is None and softcap is None and sinks is None:
        options = AttentionOptions.unmasked(causal, scaling, dropout, _weights_requested(kwargs))
    else:
        options = AttentionOptions(
            mask=mask,
            bias=bias,
            causal=causal,
            scale=scaling,
            dropout=dropout,
            segment_ids=segment_ids,
            softcap=softcap,
            sinks=sinks,
            return_weights=_weights_requested(kwargs),
        )
    heads, weights = seam.attend(module, query, key, value, options)  # type: ignore[arg-type]
    # (B, H, Lq, D), (B, H, Lq, Lk) | None
    return heads.transpose(1, 2).contiguous(), weights  # (B, Lq, H, D)


def _sharded_forward(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | Callable[..., Tensor] | None,
    dropout: float,
    scaling: float | None,
    is_causal: bool | None,
    kwargs: Mapping[str, Any],
) -> tuple[Tensor, None]:
    """:func:`attention_forward` on this rank's shard, inside :func:`multihead.distributed.context_parallel`.

    query (B, H, L_r, D), key/value (B, Hkv, L_r, D): this rank's tokens. Causal over the global
    positions when the module is; ``attention_mask`` is the key-padding mask (B, 1, 1, L_r) that
    :func:`~.mask.mask_interface` returns in the block; packed sequences are found where the *global*
    ``position_ids`` restart (across rank boundaries too). Sliding windows, position biases and caches
    are per rank and refused.
    """
    for name in ("sliding_window", "position_bias", "cache"):
        if kwargs.get(name) is not None:
            raise ValueError(
                f"{type(module).__name__} passes {name}= to its attention, which context_parallel does not serve "
                f"(it would be per rank); run this model without context parallelism"
            )
    positions = kwargs.get("position_ids")
    if not isinstance(positions, Tensor):
        raise ValueError(
            "inside context_parallel a Hugging Face model needs the GLOBAL position_ids of this rank's tokens: "
            "call model(**cp.shard(batch)) (it cuts input_ids, position_ids and labels)"
        )
    cp = current()
    if cp is None:
        raise RuntimeError("a sharded attention function is installed outside a context_parallel block")
    ids = cp.from_global(positions.expand(query.shape[0], -1), _packed_segments)  # (B, L_r) | None
    options = AttentionOptions(
        mask=attention_mask if isinstance(attention_mask, Tensor) else None,
        causal=bool(getattr(module, "is_causal", True) if is_causal is None else is_causal),
        segment_ids=ids,
        scale=scaling,
        dropout=dropout,
        softcap=kwargs.get("softcap"),
        sinks=kwargs.get("s_aux", kwargs.get("sinks")),
        return_weights=bool(kwargs.get("output_attentions")),
    )
    heads, _ = seam.attend(module, query, key, value, options)  # type: ignore[arg-type]  # (B, H, L_r, D)
    return heads.transpose(1, 2).contiguous(), None  # (B, L_r, H, D)
