"""Attention backends behind one signature, and the small registry that picks one.

Dimensions: B batch, H query heads, Hkv key/value heads (H % Hkv == 0), G = H // Hkv,
Lq/Lk query/key lengths, Dk query/key head dim, Dv value head dim.

A backend is an object with a ``name``, a ``why_not(call) -> Iterable[str]`` that gives every reason it
cannot serve a call (none = it can; a generator lets :func:`select` stop at the first reason, so
choosing a backend costs no message formatting), and ``__call__(call) -> (output, weights | None)``.
``backend="auto"`` takes the first backend of :data:`AUTO_ORDER` with no reasons; a named backend that
cannot serve the call raises a ``ValueError`` listing its reasons -- a backend never guesses.
"""

from __future__ import annotations

from . import flex as _flex
from . import math as _math
from . import sdpa as _sdpa
from .base import AttentionCall, Backend

__all__ = ["AUTO_ORDER", "AttentionCall", "Backend", "available", "explain", "get", "register", "select"]


_REGISTRY: dict[str, Backend] = {}
AUTO_ORDER: list[str] = []


def register(backend: Backend, *, auto: bool = True) -> Backend:
    """Add ``backend`` to the registry (and to the ``auto`` order, by default at the end)."""
    _REGISTRY[backend.name] = backend
    if auto and backend.name not in AUTO_ORDER:
        AUTO_ORDER.append(backend.name)
    return backend


def get(name: str) -> Backend:
    """The registered backend called ``name``."""
    if name not in _REGISTRY:
        raise ValueError(f"backend must be 'auto' or one of {sorted(_REGISTRY)}, got {name!r}")
    return _REGISTRY[name]


def available() -> list[str]:
    """Names of every registered backend."""
    return sorted(_REGISTRY)


def explain(call: AttentionCall) -> dict[str, list[str]]:
    """For each backend, the reasons it cannot serve ``call`` (an empty list means it can)."""
    return {name: list(_REGISTRY[name].why_not(call)) for name in _REGISTRY}


def select(call: AttentionCall, name: str = "auto") -> Backend:
    """The backend that serves ``call``: the named one, or the first able one in :data:`AUTO_ORDER`."""
    if name == "auto":
        for candidate in AUTO_ORDER:
            backend = _REGISTRY[candidate]
            if next(iter(backend.why_not(call)), None) is None:  # no first reason: it serves the call
                return backend
        raise RuntimeError(f"no backend can serve this call: {explain(call)}")  # math serves all
    backend = get(name)
    reasons = list(backend.why_not(call))
    if reasons:
        raise ValueError(f"backend {name!r} cannot serve this call: " + "; ".join(reasons))
    return backend


# Registration order is the auto order: flex serves only CUDA calls with a mask or bias (block
# skipping), sdpa every call without weights, math everything else (weights included).
register(_flex.FlexBackend())
register(_sdpa.SDPABackend())
register(_math.MathBackend())
