"""The mask function multihead registers with transformers (``AttentionMaskInterface``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from transformers.masking_utils import causal_mask_function, sdpa_mask

from ...distributed.context import current
from .models import _check_config

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
      causal or full mask needs none;
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
    packed = (
        mask_function is not None
        and attention_mask is None
        and not allow_is_causal_skip  # transformers turns the causal skip off for packed sequences
        and not use_vmap  # an index function (no overlays that need vmap)
        and isinstance(q_offset, int)
        and isinstance(kv_offset, int)
        and q_offset == kv_offset == 0
        and q_length == kv_length
        and _splits_sequences(mask_function, batch_size, q_length, device)
    )
    if packed:
        return mask_function
    return sdpa_mask(
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
