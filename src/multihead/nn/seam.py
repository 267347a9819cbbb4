"""The seam: the one place every attention computation of a module goes through.

Dimensions: B batch, H query heads, Hkv key/value heads, Lq/Lk lengths, Dk/Dv head dims.

A module that attends (``MultiHeadAttention``, the torch and d2l drop-ins, the Hugging Face integration)
projects its inputs to heads and then calls :func:`attend`, which

1. calls the module's ``attention_fn`` -- any function with :func:`multihead.attention`'s signature
   (the default), e.g. ring attention installed by :func:`multihead.distributed.use_process_group`;
2. applies the active :class:`Inspector`, if any: capture of per-head weights, head gates for
   importance and masking (:mod:`multihead.viz`, :mod:`multihead.heads`).

Nothing is stored on the modules: an inspector is active only inside its ``with inspecting(...)`` block
(a context variable), and leaving the block leaves no trace. Code that replaces the attention
computation plugs in as an ``attention_fn``, never as a branch inside a module's ``forward``.

An attention function may carry ``sharded = True``: its inputs are one rank's shards of the sequences
(ring attention). A module whose positions are per call (rotary embeddings, a KV cache) cannot use such a
function, and :func:`check_positions` says so.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Protocol

import torch
from torch import Tensor, nn

from ..core.attention import AttentionOutput, attention, output_and_weights

__all__ = ["AttentionFn", "Inspector", "attend", "check_positions", "current", "inspecting", "is_sharded"]

AttentionFn = Callable[..., Tensor | AttentionOutput]
"""``fn(q, k, v, *, mask, bias, valid_lens, causal, scale, dropout, return_weights, backend)`` as
:func:`multihead.attention`: q (B, H, Lq, Dk), k (B, Hkv, Lk, Dk), v (B, Hkv, Lk, Dv) -> (B, H, Lq, Dv)."""

_ACTIVE: ContextVar[Inspector | None] = ContextVar("multihead_inspector", default=None)
# torch.compile cannot trace ContextVar.get. How many inspecting() blocks are open in any thread or task,
# and the innermost inspector (a mirror of the context variable), are plain globals that it can read and
# guard on: while no block is open (the normal case) attend() never reads the context variable; while
# compiling it reads the mirror, so a compiled module recompiles when inspection starts or stops.
_OPEN_BLOCKS = 0
_MIRROR: Inspector | None = None
_OPEN_LOCK = threading.Lock()


def _active() -> Inspector | None:
    if not _OPEN_BLOCKS:
        return None
    if torch.compiler.is_compiling():
        return _MIRROR
    return _ACTIVE.get()


class Inspector:
    """Base class: override :meth:`on_heads`. ``wants_weights`` makes every module compute weights."""

    wants_weights: bool = False

    def on_heads(self, module: nn.Module, heads: Tensor, weights: Tensor | None) -> Tensor:
        """``heads`` (B, H, Lq, Dv) before merging, ``weights`` (B, H, Lq, Lk) or None; return heads."""
        return heads


def current() -> Inspector | None:
    """The active inspector, or None (the normal case: no overhead beyond this lookup)."""
    return _active()


@contextmanager
def inspecting(inspector: Inspector) -> Iterator[Inspector]:
    """Make ``inspector`` active for the block (nested blocks stack and unwind)."""
    global _OPEN_BLOCKS, _MIRROR
    token = _ACTIVE.set(inspector)
    with _OPEN_LOCK:
        _OPEN_BLOCKS += 1
        _MIRROR = inspector
    try:
        yield inspector
    finally:
        _ACTIVE.reset(token)
        with _OPEN_LOCK:
            _OPEN_BLOCKS -= 1
            _MIRROR = _ACTIVE.get()


class AttentionModule(Protocol):
    """What :func:`attend` reads of a module: its attention function and backend choice (a module
    without them -- another library's -- gets :func:`multihead.attention` and ``"auto"``)."""

    attention_fn: AttentionFn
    backend: str


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
    *,
    mask: Tensor | None = None,
    bias: Tensor | None = None,
    valid_lens: Tensor | None = None,
    causal: bool = False,
    segment_ids: Tensor | tuple[Tensor, Tensor] | None = None,
    softcap: float | None = None,
    sinks: Tensor | None = None,
    scale: float | None = None,
    dropout: float = 0.0,
    return_weights: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """Attention of one module call: q (B, H, Lq, Dk), k (B, Hkv, Lk, Dk), v (B, Hkv, Lk, Dv).

    Returns ``(heads (B, H, Lq, Dv), weights (B, H, Lq, Lk) or None)``: the heads after the active
    inspector (if any) saw them, and the weights only when ``return_weights``. The inspector may ask for
    weights (``wants_weights``); the module's caller still gets them only if it asked.
    ``segment_ids``, ``softcap`` and ``sinks`` reach ``attention_fn`` only when given (not None), so an
    attention function written before them (ring attention) keeps working for calls that do not use them.
    """
    inspector = _active()
    want = return_weights or (inspector is not None and inspector.wants_weights)
    modern = {"segment_ids": segment_ids, "softcap": softcap, "sinks": sinks}
    # a module of another library (a Hugging Face attention module) carries neither: the defaults
    res = getattr(module, "attention_fn", attention)(
        q,
        k,
        v,
        mask=mask,
        bias=bias,
        valid_lens=valid_lens,
        causal=causal,
        scale=scale,
        dropout=dropout,
        return_weights=want,
        backend=getattr(module, "backend", "auto"),
        **{name: value for name, value in modern.items() if value is not None},
    )
    heads, weights = output_and_weights(res)  # (B, H, Lq, Dv), (B, H, Lq, Lk) | None
    if inspector is not None:
        heads = inspector.on_heads(module, heads, weights)  # type: ignore[arg-type]
    return heads, (weights if return_weights else None)
