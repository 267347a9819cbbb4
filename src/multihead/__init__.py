"""multihead: multi-head attention that is correct, fast and inspectable.

The public names: the functional core :func:`attention` and its oracle :func:`attention_reference`, the
:class:`MultiHeadAttention` module, the :mod:`masks` builders, and the Transformer built on them
(:class:`Transformer`, its layers and stacks, :class:`KVCache`).

To work on the library, read ``docs/architecture.md`` first: the layers (``core`` -> ``nn`` ->
``transformer``/inspection/``distributed`` -> ``compat``/``integrations`` -> tools), the seam every
attention call goes through (:func:`multihead.nn.seam.attend`), and how to add a backend, an attention
function, an inspector or an integration.
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
