"""What a backend is: the call it receives (:class:`AttentionCall`) and the :class:`Backend` protocol.

Dimensions: B batch, H query heads, Hkv key/value heads (H % Hkv == 0), G = H // Hkv,
Lq/Lk query/key lengths, Dk query/key head dim, Dv value head dim.

The backends (``flex``, ``sdpa``, ``math``) import these from here, not from the package, so the
registry in ``backends/__init__.py`` can import the backends without an import cycle.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import NamedTuple, Protocol

from torch import Tensor

from ..masks import Normalized

__all__ = ["AttentionCall", "Backend", "Deferral"]


@dataclass
class AttentionCall:
    """One validated attention call: inputs, normalised masks and options."""

    q: Tensor  # (B, H, Lq, Dk)
    k: Tensor  # (B, Hkv, Lk, Dk)
    v: Tensor  # (B, Hkv, Lk, Dv)
    masks: Normalized
    scale: float
    dropout: float
    return_weights: bool
    softcap: float | None = None  # scores -> softcap * tanh(scores / softcap), after scaling, before bias
    sinks: Tensor | None = None  # (H,) per-head logits in every softmax denominator, with no value

    @property
    def groups(self) -> int:
        """G = H // Hkv query heads per key/value head (1 for plain multi-head attention)."""
        return self.q.shape[1] // self.k.shape[1]


class Deferral(NamedTuple):
    """An auto-routed call a backend can serve but leaves to the backend named ``to``, which serves it
    for less (``reason`` says why). The registry honours it only when ``to`` can serve the call."""

    to: str
    reason: str


class Backend(Protocol):
    """A backend: ``why_not(call)`` yields every reason it cannot serve ``call`` (none = it can),
    ``defers(call)`` names a backend that serves an auto-routed call it could serve for less (a
    :class:`Deferral`, or ``None``: it keeps the call; optional -- a backend without it never defers; an
    explicit ``backend=`` is served regardless), and ``backend(call)`` returns
    ``(output (B, H, Lq, Dv), weights (B, H, Lq, Lk) or None)``.

    Optional, for the unmasked lane (:func:`~multihead.core.backends.unmasked_route`): a backend that never
    serves an *unmasked* call -- no mask, bias, softcap, sinks, dropout or weights -- says so with
    ``serves_unmasked = False``; one that does may serve it directly with ``unmasked(q, k, v, causal,
    scale) -> (B, H, Lq, Dv)`` or ``None`` (not this call: it goes the whole way), skipping validation
    of masks it does not have and the registry walk.
    """

    name: str

    def why_not(self, call: AttentionCall) -> Iterable[str]:
        """Every reason this backend cannot serve ``call``; none: it can."""
        ...

    def defers(self, call: AttentionCall) -> Deferral | None:
        """A backend that serves this auto-routed call for less, or None (this one keeps it)."""
        ...

    def __call__(self, call: AttentionCall) -> tuple[Tensor, Tensor | None]: ...
