"""multihead: multi-head attention that is correct, fast and inspectable.

The public names: the functional core :func:`attention` and its oracle :func:`attention_reference`, the
:class:`MultiHeadAttention` module, the :mod:`masks` builders (tensors and functions), the :mod:`segments`
packing helpers, and the Transformer built on them
(:class:`Transformer`, its layers and stacks, :class:`KVCache`).

To work on the library, read ``docs/architecture.md`` first: the layers (``core`` -> ``nn`` ->
``transformer``/inspection/``distributed`` -> ``compat``/``integrations`` -> tools), the seam every
attention call goes through (:func:`multihead.nn.seam.attend`), and how to add a backend, an attention
function, an inspector or an integration.

Every public name, and every subpackage (``multihead.heads``, ``multihead.viz``, ...), is loaded on first
use (PEP 562), so ``import multihead`` imports nothing heavy: a Keras user on TensorFlow or JAX imports
``multihead.compat.keras`` without PyTorch installed, while ``multihead.attention`` and the rest import
torch the moment they are touched.
"""

from __future__ import annotations

import importlib as _importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # what the lazy names resolve to, for type checkers and IDEs
    from .core import AttentionOutput, attention, attention_reference, masks, segments
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

#: public name -> the subpackage that defines it (each imports torch)
_PUBLIC = {
    "AttentionOutput": "core",
    "attention": "core",
    "attention_reference": "core",
    "masks": "core",
    "segments": "core",
    "KVCache": "nn",
    "MultiHeadAttention": "nn",
    "RotaryEmbedding": "nn",
    "FeedForward": "transformer",
    "PositionalEncoding": "transformer",
    "Transformer": "transformer",
    "TransformerDecoder": "transformer",
    "TransformerDecoderLayer": "transformer",
    "TransformerEncoder": "transformer",
    "TransformerEncoderLayer": "transformer",
}
#: subpackages and modules reachable as attributes of ``multihead`` (imported on first access)
_SUBMODULES = (
    "bench",
    "cli",
    "compat",
    "core",
    "demo",
    "distributed",
    "export",
    "heads",
    "integrations",
    "nn",
    "testing",
    "transformer",
    "viz",
)

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
    "segments",
]
assert sorted(__all__) == sorted(_PUBLIC)


def __getattr__(name: str) -> Any:
    """Import a public name's subpackage (or a subpackage itself) on first access, then cache it here."""
    if name in _PUBLIC:
        value = getattr(_importlib.import_module(f".{_PUBLIC[name]}", __name__), name)
    elif name in _SUBMODULES:
        value = _importlib.import_module(f".{name}", __name__)
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_PUBLIC, *_SUBMODULES})
