"""The seam: the one place every attention computation of a module goes through.

Dimensions: B batch, H query heads, Hkv key/value heads, Lq/Lk lengths, Dk/Dv head dims.

A module that attends (``MultiHeadAttention``, the torch and d2l drop-ins, the Hugging Face integration)
projects its inputs to heads and then calls :func:`attend`, which

1. calls the module's ``attention_fn`` -- any function with :func:`multihead.attention`'s signature
   (the default), e.g. ring attention installed by :func:`multihead.distributed.use_process_group`;
2. applies every active :class:`Inspector`: capture of per-head weights, head gates for importance and
   masking (:mod:`multihead.viz`, :mod:`multihead.heads`), and any user inspector.

Nothing is stored on the modules: an inspector is active only inside its ``with inspecting(...)`` block,
and leaving the block leaves no trace. Code that replaces the attention computation plugs in as an
``attention_fn``, never as a branch inside a module's ``forward``.

Inspectors compose; none is dropped. Open blocks form a stack, outermost first, and :func:`attend`
applies all of them in that order (the order the blocks were entered): each inspector's ``on_heads``
gets the heads as the inspectors entered before it left them, and the weights as the attention
function computed them (no inspector changes the weights). A block changes the model for the code
inside it, and an inspector entered inside it is part of that code: inside ``heads.masked(m, [0])``, a
capture or a user inspector sees the masked model. The attention function computes weights when the
caller or *any* active inspector wants them. Gates multiply, so the order of gates does not matter;
it matters only for an inspector that reads or changes the heads in other ways.

The stack is an immutable tuple in a context variable: each thread and each asyncio task sees only
the blocks it opened (a task starts with a copy of its creator's stack, as context variables do).
torch.compile reads it through ``property(ContextVar.get)``, whose getter is C code: Dynamo reads such
a property as a value and guards on it, so compiled code re-checks the calling thread's (and task's)
stack on every call and recompiles when it changes; with no block open it traces no inspection at all.

**Points.** An inspector may also read or replace the tensors *inside* the call (:mod:`multihead.lens` is
built on this): its ``points`` name which of ``"q"``, ``"k"``, ``"v"`` (as the attention function gets them:
after the projections, rotary and the KV cache; k/v with Hkv heads), ``"scores"`` (the logits after scale,
softcap and bias, ``-inf`` where masked) and ``"pattern"`` (the softmax weights) it wants, and
``on_point(module, point, tensor)`` gets each of them, outermost inspector first, and returns a replacement
or None. ``z``, each head's output, is what ``on_heads`` already gets. With no inspector asking for a point,
nothing of this runs. q, k and v are visited before the module's attention function is called, so any
function sees the edits; ``scores`` and ``pattern`` exist only on the explicit path
(:func:`multihead.core.attention.reference_with` with a visitor), so a call that asks for them is routed
there -- the module's own backend is skipped for that call, said once per module class -- and refused by name
where the module's attention function is not :func:`multihead.attention` (ring attention, a user's
function: the scores are inside it).

An attention function may carry ``sharded = True``: its inputs are one rank's shards of the sequences
(ring attention). A module whose positions are per call (rotary embeddings, a KV cache) cannot use such a
function, and :func:`check_positions` says so.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, Protocol

from torch import Tensor, nn

from ..core.attention import (
    attention,
    attention_with,
    output_and_weights,
    reference_with,
    unmasked_attention,
)
from ..core.options import AttentionFn, AttentionOptions, AttentionOutput, call_attention_fn, options_of

__all__ = [
    "INNER_POINTS",
    "INPUT_POINTS",
    "POINTS",
    "AttentionFn",
    "AttentionOptions",
    "Inspector",
    "active",
    "attend",
    "attend_unmasked",
    "check_positions",
    "current",
    "inspecting",
    "is_sharded",
]

_ACTIVE: ContextVar[tuple[Inspector, ...]] = ContextVar("multihead_inspectors")


class _Stack:
    """Reads the active stack in a way torch.compile can trace *and* guard on, per thread and task.

    Dynamo cannot trace ``ContextVar.get()`` (a graph break), but it reads a property whose getter is C
    code as a plain value and re-reads it in its guards before every call of the compiled code. The
    getter is ``_ACTIVE.get`` bound to the context variable; called as ``_ACTIVE.get(holder)`` it returns
    the holder itself when nothing was set in this context (a fresh thread), which means "no inspector".
    """

    stack = property(_ACTIVE.get)


_HOLDER = _Stack()


def _stack() -> tuple[Inspector, ...]:
    stack = _HOLDER.stack
    return () if stack is _HOLDER else stack


INPUT_POINTS = ("q", "k", "v")
"""Points an inspector's ``on_point`` gets before the attention function runs (any function sees the edits)."""
INNER_POINTS = ("scores", "pattern")
"""Points that exist only on the explicit path (:func:`~multihead.core.attention.reference_with`)."""
POINTS = (*INPUT_POINTS, *INNER_POINTS)
"""Every point ``Inspector.points`` may name, in the order a call reaches them (``z``: ``on_heads``)."""


def _wants_points(inspectors: tuple[Inspector, ...]) -> bool:
    for inspector in inspectors:
        if inspector.points:
            return True
    return False


def _wants_weights(inspectors: tuple[Inspector, ...], module: object) -> bool:
    for inspector in inspectors:
        if inspector.weights_for(module):  # type: ignore[arg-type]
            return True
    return False


class Inspector:
    """Base class: override :meth:`on_heads`. ``wants_weights`` makes every module compute weights.

    ``points`` (a subset of :data:`POINTS`) makes :func:`attend` call :meth:`on_point` with each of them.
    An inspector that wants points or weights of some modules only overrides :meth:`points_for` and
    :meth:`weights_for` (then a module it does not ask about keeps its fast path): ``points`` must still
    hold every point it may ask for, which is what tells :func:`attend` to look.
    """

    wants_weights: bool = False
    points: frozenset[str] = frozenset()

    def points_for(self, module: nn.Module) -> frozenset[str]:
        """The points this inspector wants of ``module``'s call (default: :attr:`points`, every module)."""
        return self.points

    def weights_for(self, module: nn.Module) -> bool:
        """Whether ``module``'s call must compute weights for this inspector (default: :attr:`wants_weights`)."""
        return self.wants_weights

    def on_point(self, module: nn.Module, point: str, tensor: Tensor) -> Tensor | None:
        """``point`` one of ``self.points``: ``"q"`` (B, H, Lq, Dk), ``"k"`` (B, Hkv, Lk, Dk), ``"v"``
        (B, Hkv, Lk, Dv), ``"scores"`` or ``"pattern"`` (B, H, Lq, Lk). Return a tensor of the same shape to
        replace it downstream, or None to leave it (as the inspectors before this one left it)."""
        return None

    def on_heads(self, module: nn.Module, heads: Tensor, weights: Tensor | None) -> Tensor:
        """``heads`` (B, H, Lq, Dv) before merging, ``weights`` (B, H, Lq, Lk) or None; return heads.

        ``heads`` are as the inspectors entered before this one (outer blocks) left them.
        """
        return heads


def active() -> tuple[Inspector, ...]:
    """The active inspectors of this thread/task, outermost first (``()`` in the normal case)."""
    return _stack()


def current() -> Inspector | None:
    """The innermost active inspector, or None (the normal case: no overhead beyond this lookup)."""
    stack = _stack()
    return stack[-1] if stack else None


@contextmanager
def inspecting(inspector: Inspector) -> Iterator[Inspector]:
    """Make ``inspector`` active for the block, on top of those already active (none is replaced).

    Blocks nest and unwind (also on error); :func:`attend` applies every active inspector, outermost
    first. Only this thread (or asyncio task) sees the block, in eager and compiled code alike.
    """
    if not callable(getattr(inspector, "on_heads", None)):
        raise TypeError(
            f"inspector must be a multihead.nn.seam.Inspector (an object with on_heads(module, heads, "
            f"weights) and wants_weights), got {type(inspector).__name__}"
        )
    token = _ACTIVE.set((*_stack(), inspector))
    try:
        yield inspector
    finally:
        _ACTIVE.reset(token)


class AttentionModule(Protocol):
    """What :func:`attend` reads of a module: its attention function and backend choice (a module
    without them -- another library's -- gets :func:`multihead.attention` and ``"auto"``)."""

    attention_fn: AttentionFn
    backend: str


_MISSING = object()


_CLASS_HAS: dict[tuple[type, str], bool] = {}  # (module class, name) -> the class defines name


def _read(module: object, name: str, default: Any) -> Any:
    """``getattr(module, name, default)``, without the exception ``nn.Module.__getattr__`` raises and
    catches for a name a module lacks (a few microseconds on every call of a Hugging Face module, which has
    neither ``attention_fn`` nor ``backend``): an instance attribute, else a class attribute or
    descriptor, else a registered parameter, buffer or submodule, else ``default``."""
    cls = type(module)
    state = getattr(module, "__dict__", None)
    if state is None or cls.__getattr__ is not nn.Module.__getattr__:  # type: ignore[comparison-overlap]
        return getattr(module, name, default)  # not a plain module: its own rules
    found = state.get(name, _MISSING)
    if found is not _MISSING:
        return found
    on_class = _CLASS_HAS.get((cls, name))
    if on_class is None:
        on_class = _CLASS_HAS[(cls, name)] = hasattr(cls, name)
    if on_class:
        return getattr(module, name)
    for store in ("_parameters", "_buffers", "_modules"):
        found = state.get(store, {}).get(name, _MISSING)
        if found is not _MISSING:
            return found
    return default


def attention_fn_of(module: object) -> AttentionFn:
    """The attention function :func:`attend` calls for ``module``: its ``attention_fn``, or
    :func:`multihead.attention` for a module without one (another library's)."""
    return _read(module, "attention_fn", attention)


def attend_unmasked(
    module: object, q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float | None
) -> Tensor | None:
    """:func:`attend` of a call with nothing to mask (``causal`` and ``scale`` only), in the case where
    nothing stands between the module and the kernel: no inspector active, the module on the default
    attention function and backend. Then it is the core's unmasked lane
    (:func:`~multihead.core.attention.unmasked_attention`) -> heads (B, H, Lq, Dv), what :func:`attend`
    would return; ``None`` where :func:`attend` has work to do (or the lane does not serve the call).

    For callers that pay per call in Python (a decoding step of a Hugging Face model): it skips the options
    record and the inspector loop, nothing else.
    """
    if _stack() or attention_fn_of(module) is not attention or _read(module, "backend", "auto") != "auto":
        return None
    return unmasked_attention(q, k, v, causal, scale)


def is_sharded(fn: AttentionFn) -> bool:
    """Whether ``fn`` takes one rank's shards of the sequences (ring attention)."""
    return bool(getattr(fn, "sharded", False))


def check_positions(module: nn.Module, fn: AttentionFn, *, rotary: bool, cache: bool) -> None:
    """Refuse a sharded attention function on a module whose positions are per call (rotary, KV cache)."""
    if is_sharded(fn) and (rotary or cache):
        what = "a KV cache" if cache else "rotary=True"
        raise ValueError(
            f"{type(module).__name__} with ring attention over sharded sequences cannot use {what}: "
            "positions and cached keys are per rank; decode in a single process "
            "(multihead.distributed.use_process_group(model, None)) and add positions by global index "
            "before sharding (see docs/distributed.md)"
        )


def _compute(
    fn: AttentionFn, q: Tensor, k: Tensor, v: Tensor, options: AttentionOptions, backend: str
) -> Tensor | AttentionOutput:
    """The module's attention function on the call; the default takes the record as it is (no keywords
    unpacked and packed again)."""
    if fn is attention:
        return attention_with(q, k, v, options, backend)
    return call_attention_fn(fn, q, k, v, options, backend)


def attend(
    module: AttentionModule,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    options: AttentionOptions | None = None,
    /,
    **keywords: Any,
) -> tuple[Tensor, Tensor | None]:
    """Attention of one module call: q (B, H, Lq, Dk), k (B, Hkv, Lk, Dk), v (B, Hkv, Lk, Dv).

    ``options`` is the call's :class:`~multihead.core.options.AttentionOptions`; a caller without one
    passes :func:`multihead.attention`'s keywords instead (``mask=...``, ``causal=...``), which become
    the record. The module's ``attention_fn`` gets every option, None-valued ones included
    (:func:`~multihead.core.options.call_attention_fn`).

    Returns ``(heads (B, H, Lq, Dv), weights (B, H, Lq, Lk) or None)``: the heads after every active
    inspector saw them (outermost first), and the weights only when ``return_weights``. An inspector may
    ask for weights (``wants_weights``); the module's caller still gets them only if it asked.
    """
    options = options_of(options, keywords)
    inspectors = _stack()  # outermost first; () in the normal case
    if inspectors and _wants_points(inspectors):
        return _attend_points(module, q, k, v, options, inspectors)
    asked = options.return_weights
    if not asked and inspectors and _wants_weights(inspectors, module):
        options = options.replace(return_weights=True)
    # a module of another library (a Hugging Face attention module) carries neither: the defaults
    res = _compute(attention_fn_of(module), q, k, v, options, _read(module, "backend", "auto"))
    heads, weights = output_and_weights(res)  # (B, H, Lq, Dv), (B, H, Lq, Lk) | None
    for inspector in inspectors:  # each sees the heads the inspectors before it left
        heads = inspector.on_heads(module, heads, weights)  # type: ignore[arg-type]
    return heads, (weights if asked else None)


def _visit(module: object, inspectors: tuple[Inspector, ...], point: str, tensor: Tensor) -> Tensor:
    """``tensor`` after every inspector that asks for ``point`` read or replaced it, outermost first."""
    for inspector in inspectors:
        if point in inspector.points_for(module):  # type: ignore[arg-type]
            new = inspector.on_point(module, point, tensor)  # type: ignore[arg-type]
            if new is not None:
                if not isinstance(new, Tensor) or new.shape != tensor.shape:
                    got = tuple(new.shape) if isinstance(new, Tensor) else type(new).__name__
                    raise ValueError(
                        f"{type(inspector).__name__}.on_point returned {got} for point {point!r} of "
                        f"{type(module).__name__}; expected a tensor of shape {tuple(tensor.shape)} (or None "
                        f"to leave it)"
                    )
                tensor = new
    return tensor


_ROUTED: set[tuple[type, str]] = set()  # (module class, backend) already told that points reroute its call


def _explicit_path(module: object, fn: AttentionFn, backend: str) -> None:
    """Refuse (by name) a module whose attention function hides its scores; say once per module class and
    backend that its calls with scores or pattern asked take the explicit path."""
    if fn is not attention:
        name = getattr(fn, "__qualname__", type(fn).__name__)
        raise ValueError(
            f"the points 'scores' and 'pattern' of {type(module).__name__} cannot be read: its attention_fn "
            f"is {name}, not multihead.attention, and computes them inside itself (ring attention, a user's "
            f"function); ask for q, k, v, z or result there, or run the module with the default attention_fn"
        )
    key = (type(module), backend)
    if key not in _ROUTED:
        _ROUTED.add(key)
        warnings.warn(
            f"multihead: calls of {type(module).__name__} that read or edit 'scores' or 'pattern' run on the "
            f"explicit path (multihead.attention_reference's formulation) instead of backend {backend!r}; "
            f"the same values, without a fused kernel (said once per module class)",
            stacklevel=4,
        )


def _attend_points(
    module: AttentionModule,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    options: AttentionOptions,
    inspectors: tuple[Inspector, ...],
) -> tuple[Tensor, Tensor | None]:
    """:func:`attend` where an inspector asks for points: q, k, v visited before the attention function,
    scores and pattern on the explicit path when asked for, then ``on_heads`` as always."""
    q = _visit(module, inspectors, "q", q)  # (B, H, Lq, Dk)
    k = _visit(module, inspectors, "k", k)  # (B, Hkv, Lk, Dk)
    v = _visit(module, inspectors, "v", v)  # (B, Hkv, Lk, Dv)
    asked = options.return_weights
    fn = attention_fn_of(module)
    backend = _read(module, "backend", "auto")
    inner = any(point in i.points_for(module) for i in inspectors for point in INNER_POINTS)  # type: ignore[arg-type]
    if inner:
        _explicit_path(module, fn, backend)
        res = reference_with(
            q,
            k,
            v,
            options.replace(return_weights=True),
            lambda point, tensor: _visit(module, inspectors, point, tensor),
        )
    else:
        if not asked and _wants_weights(inspectors, module):
            options = options.replace(return_weights=True)
        res = _compute(fn, q, k, v, options, backend)
    heads, weights = output_and_weights(res)  # (B, H, Lq, Dv), (B, H, Lq, Lk) | None
    for inspector in inspectors:
        heads = inspector.on_heads(module, heads, weights)  # type: ignore[arg-type]
    return heads, (weights if asked else None)
