"""Modules over the core: :class:`MultiHeadAttention` (projections and heads), :class:`KVCache`,
:class:`RotaryEmbedding`, and :mod:`~multihead.nn.seam`, the one place every attention call goes through."""

from .attention import MultiHeadAttention, merge_heads, split_heads
from .cache import KVCache
from .rotary import RotaryEmbedding

__all__ = ["KVCache", "MultiHeadAttention", "RotaryEmbedding", "merge_heads", "split_heads"]
