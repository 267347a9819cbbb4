"""multihead: multi-head attention that is correct, fast and inspectable.

The public names (``docs/architecture.md`` maps the package): the functional core :func:`attention` and its oracle
:func:`attention_reference`, the :class:`MultiHeadAttention` module, the :mod:`masks` builders, and the
Transformer built on them (:class:`Transformer`, its layers and stacks, :class:`KVCache`).
"""

from .core import AttentionOutput, attention, attention_reference, masks
from .nn import KVCache, MultiHeadAttention, RotaryEmbedding
from .transformer import (
    FeedForward,
    PositionalEncoding,
    Transformer,
    TransformerDecoder,
    TransformerDecoderLayer,
    TransformerEncoder,
    TransformerEncoderLayer,
)

__version__ = "0.1.0"

__all__ = [
    "AttentionOutput",
    "FeedForward",
    "KVCache",
    "MultiHeadAttention",
    "PositionalEncoding",
    "RotaryEmbedding",
    "Transformer",
    "TransformerDecoder",
    "TransformerDecoderLayer",
    "TransformerEncoder",
    "TransformerEncoderLayer",
    "attention",
    "attention_reference",
    "masks",
]
