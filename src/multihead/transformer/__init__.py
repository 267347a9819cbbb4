"""The Transformer on :class:`~multihead.MultiHeadAttention`.

* :mod:`.layers` -- positional encoding, feed-forward, encoder/decoder layers (torch interop);
* :mod:`.stacks` -- :class:`TransformerEncoder`, :class:`TransformerDecoder`;
* :mod:`.model` -- the sequence-to-sequence :class:`Transformer` (embed, encode, decode, generate);
* :mod:`.decoding` -- :func:`greedy` and :func:`beam_search`, free functions over a step function.
"""

from .decoding import Decoded, beam_search, greedy
from .layers import FeedForward, PositionalEncoding, TransformerDecoderLayer, TransformerEncoderLayer
from .model import Transformer
from .stacks import TransformerDecoder, TransformerEncoder

__all__ = [
    "Decoded",
    "FeedForward",
    "PositionalEncoding",
    "Transformer",
    "TransformerDecoder",
    "TransformerDecoderLayer",
    "TransformerEncoder",
    "TransformerEncoderLayer",
    "beam_search",
    "greedy",
]
