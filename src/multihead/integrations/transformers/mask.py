"""The mask function multihead registers with transformers (``AttentionMaskInterface``)."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from transformers.masking_utils import causal_mask_function, sdpa_mask

from ...distributed.context import current
from .models import _check_config, _trusts_is_causal

# ------------------------------------------------------------------------------------------------
# The mask function
# ------------------------------------------------------------------------------------------------


def _splits_sequences(
    mask_function: Callable[..., Tensor], batch_size: int, length: int, device: Any
) -> bool:
    """Whether some query may not see the key just before it: packed sequences (or a chunk boundary).

    One probe per position, O(B L): ``mask_function`` is an index-based mask of transformers (evaluated
    on broadcast index tensors, as transformers does without vmap).
    """
    if length < 2:
        return False
    q = torch.arange(1, length, device=device)[None, None, :]  # (1, 1, L-1)
    b = torch.arange(batch_size, device=device)[:, None, None]  # (B, 1, 1)
    h = torch.zeros(1, dtype=torch.long, device=device)[None, :, None]  # (1, 1, 1)
    return not bool(mask_function(b, h, q, q - 1).all())


def mask_interface(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: Any = 0,
    kv_offset: Any = 0,
    mask_function: Callable[..., Tensor] | None = None,
    attention_mask: Tensor | None = None,
    allow_is_causal_skip: bool = True,
    config: Any = None,
    use_vmap: bool = False,
    device: Any = "cpu",
    **kwargs: Any,
) -> Tensor | Callable[..., Tensor] | None:
    """transformers' mask-function signature (``AttentionMaskInterface``) for multihead.

    Returns, as :func:`attention_forward` takes them:

    - a bool (B, 1, Lq, Lk) tensor, True = may attend (transformers' ``sdpa_mask``), or None where a plain
      causal or full mask needs none (a causal one is built where the modules' ``is_causal`` cannot be
      trusted: :func:`~.models._trusts_is_causal`); one built for rows without padding (a sliding window) is
      remembered (:func:`built_unpadded`), so that :func:`attention_forward` adds the packed sequences
      it finds in ``position_ids``, as it does for causal layers without a mask;
    - for packed sequences (padding-free batches: no padding mask, positions that restart) the index
      function itself, ``fn(b, h, q_idx, kv_idx) -> bool``: nothing (Lq, Lk)-sized is built, and
      :func:`attention_forward` adds the sequences as ``segment_ids``;
    - inside :func:`multihead.distributed.context_parallel`, only this rank's key padding (B, 1, 1, L_r)
      or None: causality and packing are over global positions, which the attention function knows.

    Also refuses, on the first call, a model family whose attention bypasses the interface.
    """
    if config is not None:
        _check_config(config)
    if (
        current() is not None
    ):  # inside context_parallel: this rank's key padding only (attention adds the rest)
        if attention_mask is None or bool(attention_mask.all()):
            return None
        return attention_mask[:, None, None, :].bool()  # (B, 1, 1, L_r)
    unpadded_square = (  # rows without padding, queries = keys from position 0 (training, a prefill)
        mask_function is not None
        and attention_mask is None
        and not use_vmap  # an index function (no overlays that need vmap)
        and isinstance(q_offset, int)
        and isinstance(kv_offset, int)
        and q_offset == kv_offset == 0
        and q_length == kv_length
    )
    if unpadded_square and not allow_is_causal_skip:  # transformers turns the skip off for packed rows
        if _splits_sequences(mask_function, batch_size, q_length, device):  # type: ignore[arg-type]
            return mask_function
    if allow_is_causal_skip and config is not None and not _trusts_is_causal(config):
        allow_is_causal_skip = False  # a causal mask, built: the modules' is_causal may say otherwise
    mask = sdpa_mask(
        batch_size=batch_size,
        q_length=q_length,
        kv_length=kv_length,
        q_offset=q_offset,
        kv_offset=kv_offset,
        mask_function=causal_mask_function if mask_function is None else mask_function,
        attention_mask=attention_mask,
        allow_is_causal_skip=allow_is_causal_skip,
        use_vmap=use_vmap,
        device=device,
        **kwargs,
    )
    if unpadded_square and isinstance(mask, Tensor) and not torch.compiler.is_compiling():
        _remember_unpadded(mask)  # a window (or chunk) mask over rows that may be packed
    return mask


_UNPADDED: list[weakref.ref[Tensor]] = []
"""The last dense masks :func:`mask_interface` built for rows without padding, queries = keys (a sliding
window's or a chunk's, which transformers must build densely): rows whose ``position_ids`` restart are
packed sequences there too, where transformers did not look for them (a cache on, or a model that never
hands it ``position_ids``). Weak references: a forward pass's masks die with it."""


def _remember_unpadded(mask: Tensor) -> None:
    _UNPADDED[:] = [r for r in _UNPADDED[-3:] if r() is not None] + [weakref.ref(mask)]


def built_unpadded(mask: Tensor) -> bool:
    """Whether ``mask`` is one :func:`mask_interface` built for rows without padding (see ``_UNPADDED``)."""
    if torch.compiler.is_compiling():
        return False  # none is remembered while compiling (see mask_interface)
    return any(r() is mask for r in _UNPADDED)
