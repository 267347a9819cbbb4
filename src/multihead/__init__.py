"""multihead: multi-head attention that is correct, fast and inspectable.

The public names (see ``DESIGN.md``): the functional core :func:`attention` and its oracle
:func:`attention_reference`, the :class:`MultiHeadAttention` module and the :mod:`masks` builders.
"""

from . import masks
from .attention import MultiHeadAttention
from .functional import AttentionOutput, attention, attention_reference

__version__ = "0.1.0"

__all__ = [
    "AttentionOutput",
    "MultiHeadAttention",
    "attention",
    "attention_reference",
    "masks",
]
