"""Registering multihead with transformers under an attention-implementation name."""

from __future__ import annotations

from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from .attention import attention_forward
from .mask import mask_interface
from .models import _BUILTIN

# ------------------------------------------------------------------------------------------------
# Registration
# ------------------------------------------------------------------------------------------------


def register(name: str = "multihead") -> str:
    """Register multihead's attention and mask functions with transformers under ``name``; returns it.

    Idempotent. After it, ``attn_implementation=name`` works in ``from_config``/``from_pretrained`` and
    ``model.set_attn_implementation(name)``, for every model whose attention goes through transformers'
    ``AttentionInterface``; other models are refused (:func:`check_model`).
    """
    if not isinstance(name, str) or not name:
        raise TypeError(f"name must be a non-empty str, got {name!r}")
    if name in _BUILTIN:
        raise ValueError(
            f"name {name!r} is one of transformers' own attention implementations {_BUILTIN}; pick another "
            f"name, e.g. register('multihead')"
        )
    taken = ALL_ATTENTION_FUNCTIONS.get(name) if name in ALL_ATTENTION_FUNCTIONS else None
    if taken is not None and taken is not attention_forward:
        raise ValueError(
            f"name {name!r} is already registered with transformers for {getattr(taken, '__name__', taken)}; "
            f"pick another name"
        )
    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, mask_interface)
    return name


def is_registered(name: str) -> bool:
    """Whether ``name`` is an attention implementation registered by :func:`register`."""
    return (
        isinstance(name, str)
        and name in ALL_ATTENTION_FUNCTIONS
        and ALL_ATTENTION_FUNCTIONS[name] is attention_forward
    )
