"""The Transformer on :class:`~multihead.MultiHeadAttention`: layers, stacks, the seq2seq model, decoding."""

from .model import (
    FeedForward,
    PositionalEncoding,
    Transformer,
    TransformerDecoder,
    TransformerDecoderLayer,
    TransformerEncoder,
    TransformerEncoderLayer,
)

__all__ = [
    "FeedForward",
    "PositionalEncoding",
    "Transformer",
    "TransformerDecoder",
    "TransformerDecoderLayer",
    "TransformerEncoder",
    "TransformerEncoderLayer",
]
