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

An attention function may carry ``sharded = True``: its inputs are one rank's shards of the sequences
(ring attention). A module whose positions are per call (rotary embeddings, a KV cache) cannot use such a
function, and :func:`check_positions` says so.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, Protocol

from torch import Tensor, nn

from ..core.attention import attention, attention_with, output_and_weights, unmasked_attention
from ..core.options import AttentionFn, AttentionOptions, call_attention_fn, options_of

__all__ = [
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


def _wants_weights(inspectors: tuple[Inspector, ...]) -> bool:
    for inspector in inspectors:
        if inspector.wants_weights:
            return True
    return False


class Inspector:
    """Base class: override :meth:`on_heads`. ``wants_weights`` makes every module compute weights."""

    wants_weights: bool = False

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
    asked = options.return_weights
    if not asked and _wants_weights(inspectors):
        options = options.replace(return_weights=True)
    # a module of another library (a Hugging Face attention module) carries neither: the defaults
    fn = attention_fn_of(module)
    backend = _read(module, "backend", "auto")
    if fn is attention:  # the default takes the record as it is (no keywords unpacked and packed again)
        res = attention_with(q, k, v, options, backend)
    else:
        res = call_attention_fn(fn, q, k, v, options, backend)
    heads, weights = output_and_weights(res)  # (B, H, Lq, Dv), (B, H, Lq, Lk) | None
    for inspector in inspectors:  # each sees the heads the inspectors before it left
        heads = inspector.on_heads(module, heads, weights)  # type: ignore[arg-type]
    return heads, (weights if asked else None)
