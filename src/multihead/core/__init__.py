"""The functional core: :func:`attention`, its oracle :func:`attention_reference`, masks and backends.

Nothing here knows about modules, caches, inspection, distribution or other libraries; everything
above plugs in through :class:`multihead.MultiHeadAttention`'s ``attention_fn`` seam
(see ``docs/architecture.md``).
"""

from . import masks, segments
from .attention import AttentionOutput, attention, attention_reference, explain_backends

__all__ = ["AttentionOutput", "attention", "attention_reference", "explain_backends", "masks", "segments"]
