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

from collections.abc import Callable

from torch import Tensor

from . import blocked as _blocked
from . import flex as _flex
from . import math as _math
from . import sdpa as _sdpa
from .base import AttentionCall, Backend, Deferral

__all__ = [
    "AUTO_ORDER",
    "AttentionCall",
    "Backend",
    "Deferral",
    "available",
    "explain",
    "get",
    "register",
    "select",
    "unmasked_route",
    "unregister",
]


_REGISTRY: dict[str, Backend] = {}
AUTO_ORDER: list[str] = []
_CHANGES = [0]  # bumped by every register/unregister: the unmasked route is recomputed after one

UnmaskedFn = Callable[[Tensor, Tensor, Tensor, bool, float], "Tensor | None"]


def register(
    backend: Backend, *, auto: bool = True, before: str | None = None, after: str | None = None
) -> Backend:
    """Add ``backend`` to the registry and, with ``auto``, to :data:`AUTO_ORDER`.

    Where in the auto order: at the end by default, or just ahead of the backend named ``before`` (for
    instance ``before="math"``: tried after the fast kernels, before the dense fallback), or just after
    the one named ``after``. Registering a name again replaces the backend; its place in the order stays
    unless ``before``/``after`` move it (``auto=False`` takes it out of the order).
    """
    name = getattr(backend, "name", None)
    if not isinstance(name, str) or not name or name == "auto":
        raise ValueError(f"a backend needs a `name` str other than 'auto', got {name!r}")
    if not (callable(getattr(backend, "why_not", None)) and callable(backend)):
        raise TypeError(
            f"backend {name!r} must have a why_not(call) method and be callable as backend(call) "
            f"(see multihead.core.backends.Backend)"
        )
    if before is not None and after is not None:
        raise ValueError(f"give `before` or `after`, not both (got before={before!r}, after={after!r})")
    anchor = before if before is not None else after
    if anchor is not None:
        if not auto:
            raise ValueError(
                f"before/after place a backend in the auto order: they need auto=True ({name!r})"
            )
        if anchor == name or anchor not in AUTO_ORDER:
            others = [n for n in AUTO_ORDER if n != name]
            raise ValueError(
                f"{'before' if before is not None else 'after'}={anchor!r} must name another backend of the "
                f"auto order {others}"
            )
    _REGISTRY[name] = backend
    _CHANGES[0] += 1
    if not auto:
        if name in AUTO_ORDER:
            AUTO_ORDER.remove(name)
        return backend
    if anchor is None:
        if name not in AUTO_ORDER:
            AUTO_ORDER.append(name)
        return backend
    if name in AUTO_ORDER:
        AUTO_ORDER.remove(name)
    at = AUTO_ORDER.index(anchor)
    AUTO_ORDER.insert(at if before is not None else at + 1, name)
    return backend


def unregister(name: str) -> Backend:
    """Remove the backend called ``name`` from the registry and the auto order; returns it."""
    backend = get(name)
    del _REGISTRY[name]
    _CHANGES[0] += 1
    if name in AUTO_ORDER:
        AUTO_ORDER.remove(name)
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


def _serves(backend: Backend, call: AttentionCall) -> bool:
    """Whether ``backend`` can serve ``call``: its ``why_not`` yields no reason (only the first is drawn; a
    ``for`` loop rather than ``next(gen, None)``, which ``torch.compile`` before 2.9 cannot trace)."""
    for _reason in backend.why_not(call):
        return False
    return True


def _deferred(backend: Backend, call: AttentionCall) -> Backend:
    """The backend that serves an auto-routed call ``backend`` can serve: itself, or the registered one its
    optional ``defers(call)`` names (:class:`~.base.Deferral`), when that one can serve the call."""
    defers = getattr(backend, "defers", None)
    deferral = None if defers is None else defers(call)
    if deferral is None or deferral.to not in _REGISTRY:
        return backend
    other = _REGISTRY[deferral.to]
    return other if _serves(other, call) else backend


_ROUTE: list[tuple[int, UnmaskedFn | None]] = [(-1, None)]


def unmasked_route() -> UnmaskedFn | None:
    """The ``unmasked(q, k, v, causal, scale)`` method of the backend auto routing gives an unmasked call
    (no mask, bias, softcap, sinks, dropout or weights), or ``None`` where that backend has none.

    Walks :data:`AUTO_ORDER` past the backends that declare ``serves_unmasked = False``; any other backend
    ahead of one with the method (a user's, say) takes the lane away. Recomputed after the registry changes.
    """
    changes, route = _ROUTE[0]
    if changes == _CHANGES[0]:
        return route
    route = None
    for name in AUTO_ORDER:
        backend = _REGISTRY[name]
        if getattr(backend, "serves_unmasked", True):
            route = getattr(backend, "unmasked", None)
            break
    _ROUTE[0] = (_CHANGES[0], route)
    return route


def select(call: AttentionCall, name: str = "auto") -> Backend:
    """The backend that serves ``call``: the named one, or the first able one in :data:`AUTO_ORDER`."""
    if name == "auto":
        for candidate in AUTO_ORDER:
            backend = _REGISTRY[candidate]
            if _serves(backend, call):
                return _deferred(backend, call)
        raise RuntimeError(f"no backend can serve this call: {explain(call)}")  # math serves all
    backend = get(name)
    reasons = list(backend.why_not(call))
    if reasons:
        raise ValueError(f"backend {name!r} cannot serve this call: " + "; ".join(reasons))
    return backend


# The auto order: flex serves CUDA calls with a mask or bias (block skipping) and hot, large CPU calls
# with a mask function alone (compiled; see flex_cpu), sdpa every call without
# weights that its fused kernel can run, blocked the CPU calls with mask/bias functions, segment ids,
# softcap or sinks (cost follows the allowed pairs), math everything else (weights included).
_BLOCKED = _blocked.BlockedBackend()
register(_flex.FlexBackend(fallback=_BLOCKED))  # on the CPU, blocked answers where a compile failed
register(_sdpa.SDPABackend())
register(_math.MathBackend())
register(_BLOCKED, before="math")
