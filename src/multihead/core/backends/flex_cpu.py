"""Compiled FlexAttention on the CPU: which calls the ``flex`` backend takes there, and how it runs them.

``torch.compile`` turns ``flex_attention`` into a C++ kernel for the CPU (inductor's template: float32,
forward only). It skips the tiles a block mask lists as empty, runs the full ones unmasked and inlines the
mask function in the partial ones -- one loop, where the ``blocked`` backend makes one ATen kernel call per
block of queries with a materialised mask per span. Which of the two is faster depends on the CPU and the
mask (``benchmarks/results/flex_masks_cpu*``): on Zen 4 and Zen 5 EPYCs (AVX-512) the template won banded
and block-sparse masks, on long spans (prefix-LM, causal) ATen's fused kernel won on the Zen 4 (blocked took
0.85-0.98x flex's time) and the template on the Zen 5 (prefix-LM at L = 4,096: 111.6 against 141.0 ms); on a
Zen 1 EPYC (AVX2, no AVX-512) blocked took 0.41-0.59x the template's time on every mask, windows included.
So auto routing measures: the first hot call of a (function, shape) compiles, runs both
:data:`MEASURE_ROUNDS` times more, and the faster serves it from then on (:data:`LONG_SPAN` limits that to
tiles that see that many keys on average; 0, the default, measures every one).

It has two costs, which this module bounds:

* **a compile** (seconds, once per mask function and shape): it serves only calls of more than
  :data:`MIN_SCORES` scores (B*H*Lq*Lk: where ``sdpa`` stops serving mask functions densely and ``blocked``
  took them), and auto routing (:meth:`CpuFlex.defers`) leaves a call to ``blocked`` until its (function,
  shape) has been seen :data:`HOT` times -- a one-off or small call never waits for a compiler;
* **dynamo's recompile limit** (past it, ``flex_attention`` falls back to its eager form, which holds
  every (Lq, Lk) score): each (function, shape) gets a compiled entry point of its own (a fresh code
  object), so keys never share a cache, and at most :data:`CAPACITY` are kept (least recently used go).

A compile that fails (no C++ compiler, a mask function dynamo cannot trace) is reported once as a
warning, that key stays on ``blocked`` for good, and the call is answered by ``blocked``.

``ATEN_CPU_CAPABILITY`` (torch's CPU kernels forced, as the project's numerics job does, or to try a CPU
without AVX-512) also picks inductor's vector ISA. Under ``default`` nothing is compiled: inductor's flex
template does not build without vectors (``at::vec::transpose_block`` missing). Under ``avx2`` or
``avx512`` flex compiles with inductor's FX graph cache off (:func:`_compile_options`): that on-disk cache
is not keyed by the ISA, and a process with AVX2 forced was seen loading a graph compiled for AVX-512 with
wrong results (torch 2.13, max error 0.65 against eager FlexAttention; the regression test is the
numerics job itself, which reruns the compiled cases under ``avx2`` after the main suite has compiled them
for AVX-512). The C++ kernel cache, keyed by source and compiler flags, stays on. Before torch 2.13
(:data:`VERIFIED`) it is not used: torch 2.8's template emits C++ that does not compile.

Only calls whose sole masking is a mask function take this path: no dense mask or bias, segment ids,
causal flag, bias function, softcap or sinks; no autograd; float32; Dk == Dv. The function is the
``mask_mod`` with FlexAttention's meaning exactly (FlexAttention's own evaluation), and its block mask comes from the tile
structure (:func:`multihead.core.masks.blocks.structure`: interval arithmetic, cached) -- never from
evaluating the mask on the whole grid as ``create_block_mask`` does -- in :data:`TILE` x :data:`TILE` tiles
where they compute at most :data:`SPARES` of the pairs that :data:`COARSE` tiles do (a band's edges,
chunks: 6-11% less time at L = 4,096), else in :data:`COARSE` ones (prefix-LM, causal). A ``BlockMask``
passed as ``mask=`` keeps its meaning (its blocks, its ``mask_mod`` inside the partial ones), refined the
same way where its ``mask_mod`` can be bounded (:func:`~multihead.core.masks.blocks.refine`).

Dimensions: B batch, H query heads, Hkv kv heads, Lq/Lk lengths, D head dim, nq/nk tiles.
"""

from __future__ import annotations

import itertools
import logging
import os
import time
import types
import warnings
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial

import torch
from torch import Tensor

from ..checks import is_tracing
from ..masks.blocks import BlockMaskFunction, Blocks, refine, structure
from ._common import DENSE_LIMIT, needs_grad
from .base import AttentionCall, Deferral

__all__ = ["CAPACITY", "COARSE", "HOT", "LONG_SPAN", "MEASURE_ROUNDS", "MIN_SCORES", "TILE", "CpuFlex"]

log = logging.getLogger(__name__)

_TORCH = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])

VERIFIED = (2, 13)  # the first torch whose CPU flex kernel this library checked (2.8's does not build)
HOT = 2  # calls of one (function, shape) before auto routing compiles it
MIN_SCORES = DENSE_LIMIT  # B*H*Lq*Lk above which it serves: where sdpa's dense path stops serving functions
TILE = 64  # the small tile: queries and keys of one tile where it spares computed pairs ...
COARSE = 128  # ... else this one (FlexAttention's default): fewer tiles, less loop overhead
SPARES = 0.95  # the small tile serves when it computes at most this share of the coarse tile's pairs
CAPACITY = 32  # compiled (function, shape) entries kept
# mean keys a query tile sees at and above which the two are measured on the first hot call; 0: always. It was
# 2,048 (long spans only) until a Zen 1 EPYC (AVX2, no AVX-512) ran every banded mask on the compiled template
# at 1.7-2.4x blocked's time (docs/performance.md, "Which of the two on a CPU without AVX-512")
LONG_SPAN = 0
MEASURE_ROUNDS = 2  # calls of each (the fastest counts) when a (function, shape) is measured
_clock = time.perf_counter  # what measures them (tests put a fake one here)


@dataclass
class _Entry:
    """One (mask function, shape): how often auto routing saw it, its block mask (for the structure it was
    built from) and compiled entry point, or why it failed."""

    fn: object  # the function or BlockMask it serves (held: its id stays unique while cached)
    seen: int = 0
    block_mask: object | None = None
    span: float = 0.0  # mean keys a query tile of the block mask sees (its allowed tiles' keys)
    made_from: tuple = ()  # (structure or BlockMask, table versions) its block mask was made from
    run: Callable[..., Tensor] | None = None
    failed: str | None = None
    measured: dict[str, float] | None = None  # seconds per call of "flex" and "blocked", measured once


_MADE = itertools.count(1)  # entry points made: each gets a name (and code object) of its own


def _entry_point() -> Callable[..., Tensor]:
    """A fresh function, with a code object of its own, that calls ``flex_attention``: compiled, its dynamo
    cache (and recompile count) belongs to one key alone."""
    from torch.nn.attention.flex_attention import flex_attention

    def run(q: Tensor, k: Tensor, v: Tensor, block_mask: object, scale: float, enable_gqa: bool) -> Tensor:
        return flex_attention(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=enable_gqa)  # type: ignore[arg-type,return-value]

    code = run.__code__.replace(co_name=f"flex_cpu_{next(_MADE)}")
    fresh = types.FunctionType(code, run.__globals__, code.co_name, None, run.__closure__)
    return torch.compile(fresh, dynamic=False, fullgraph=True, options=_compile_options())


def _compile_options() -> dict[str, object] | None:
    """Inductor options: with ``ATEN_CPU_CAPABILITY`` forced, the FX graph cache off (it is not keyed by the
    vector ISA the capability picks: a graph compiled for another one is loaded, with wrong results)."""
    return {"fx_graph_cache": False} if os.environ.get("ATEN_CPU_CAPABILITY") else None


def to_flex(blocks: Blocks, mask_mod: object) -> object:
    """A FlexAttention ``BlockMask`` with ``blocks``'s tiles (partial ones decided by ``mask_mod``)."""
    from torch.nn.attention.flex_attention import BlockMask

    def listed(table: Tensor) -> tuple[Tensor, Tensor]:  # (nq, nk) bool -> (1, 1, nq) counts, (1, 1, nq, nk)
        order = torch.argsort((~table).to(torch.int8), dim=-1, stable=True)  # listed tiles first, in order
        return table.sum(-1).to(torch.int32)[None, None], order.to(torch.int32)[None, None]

    partial, full = listed(blocks.allowed & ~blocks.full), listed(blocks.full)
    return BlockMask.from_kv_blocks(
        *partial, *full, BLOCK_SIZE=(blocks.block_q, blocks.block_k), mask_mod=mask_mod,
        seq_lengths=(blocks.lq, blocks.lk),
    )  # fmt: skip


class CpuFlex:
    """The ``flex`` backend's CPU policy and runner (see the module docstring)."""

    def __init__(
        self,
        *,
        hot: int = HOT,
        min_scores: int = MIN_SCORES,
        tile: int = TILE,
        capacity: int = CAPACITY,
        long_span: int = LONG_SPAN,
    ) -> None:
        self.hot, self.min_scores, self.tile, self.capacity = hot, min_scores, tile, capacity
        self.long_span = long_span
        self._entries: OrderedDict[tuple, _Entry] = OrderedDict()

    def why_not(self, call: AttentionCall) -> Iterator[str]:
        """Every reason compiled FlexAttention on the CPU cannot serve ``call``."""
        q, m = call.q, call.masks
        if _TORCH < VERIFIED:
            yield (
                f"compiled flex on the CPU needs torch >= {VERIFIED[0]}.{VERIFIED[1]} (on torch 2.8 inductor's "
                f"flex template emits C++ that does not build); this is {torch.__version__}, blocked serves"
            )
        if m.mask_fn is None:
            yield "compiled flex on the CPU serves calls with a mask function (mask=fn or a BlockMask)"
        scores = q.shape[0] * q.shape[1] * q.shape[2] * call.k.shape[2]
        if scores <= self.min_scores:
            yield (
                f"compiled flex on the CPU serves calls of more than {self.min_scores} scores (B*H*Lq*Lk), got "
                f"{scores}: smaller ones cost less on the dense and blocked paths than a compile"
            )
        extras = (m.mask is not None, m.bias is not None, m.bias_fn is not None, m.segments is not None,
                  m.causal, call.softcap is not None, call.sinks is not None)  # fmt: skip
        if any(extras):
            yield (
                "compiled flex on the CPU serves a mask function alone (no dense mask or bias, bias function, "
                "segment ids, causal flag, softcap or sinks: blocked serves those)"
            )
        if q.dtype != torch.float32:
            yield f"compiled flex on the CPU runs float32 only, got {q.dtype} (blocked serves it)"
        if q.shape[-1] != call.v.shape[-1]:
            yield f"compiled flex on the CPU needs Dk == Dv, got {q.shape[-1]} and {call.v.shape[-1]}"
        if needs_grad(q, call.k, call.v):
            yield "FlexAttention has no backward on the CPU (run under torch.no_grad(), or blocked serves it)"
        if is_tracing():
            yield "inside a trace or torch.compile the blocked backend serves (no nested compile)"
        if os.environ.get("ATEN_CPU_CAPABILITY") == "default":
            yield (
                "ATEN_CPU_CAPABILITY=default forces torch's CPU kernels without vectors: inductor's "
                "FlexAttention template does not build then, so blocked serves; unset it (or force avx2/avx512) "
                "to compile"
            )
        entry = self._entries.get(self._key(call)) if m.mask_fn is not None else None
        if entry is not None and entry.failed is not None:
            yield f"compiled flex failed for this mask function and shape: {entry.failed}"

    def defers(self, call: AttentionCall) -> Deferral | None:
        """For auto routing: ``blocked`` serves ``call`` until its (function, shape) is hot (this counts the
        sighting), or when the function's tile structure cannot be bounded."""
        entry = self._entry(call)
        entry.seen += 1
        if entry.run is None and entry.seen < self.hot:
            return Deferral("blocked", f"seen {entry.seen} < {self.hot} times: compiled once it repeats")
        if entry.block_mask is None and self._block_mask(call, entry) is None:
            return Deferral("blocked", "the mask function's tile structure cannot be bounded")
        if (
            entry.span >= self.long_span
            and entry.measured is not None
            and _faster(entry.measured) == "blocked"
        ):
            f, b = entry.measured["flex"], entry.measured["blocked"]
            return Deferral(
                "blocked",
                f"its query tiles see {entry.span:.0f} keys on average, and on this CPU "
                f"blocked's fused kernel ran it in {b * 1e3:.1f} ms against the compiled template's "
                f"{f * 1e3:.1f} ms",
            )
        return None  # not yet measured: this call compiles, and measures both (__call__)

    def __call__(self, call: AttentionCall, fallback: Callable[[AttentionCall], Tensor] | None) -> Tensor:
        """(B, H, Lq, D) through the compiled kernel; ``fallback(call)`` answers when compiling fails
        (without one, the error propagates)."""
        entry = self._entry(call)
        block_mask = self._block_mask(call, entry)
        if block_mask is None:  # named backend='flex' with an unboundable function: flex's own structure
            from torch.nn.attention.flex_attention import create_block_mask

            b, h, lq, lk = (*call.q.shape[:3], call.k.shape[2])
            block_mask = entry.block_mask = create_block_mask(call.masks.mask_fn, b, h, lq, lk, device="cpu")  # type: ignore[arg-type]
        try:
            if entry.run is None:
                entry.run = _entry_point()
            run = partial(
                entry.run, call.q, call.k, call.v, block_mask, call.scale, call.k.shape[1] != call.q.shape[1]
            )
            out = run()  # (B, H, Lq, D)
        except Exception as err:  # a compiler or tracer failure: the fallback answers, noted once
            if fallback is None:
                raise
            entry.failed, entry.run = (
                f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}",
                None,
            )
            warnings.warn(
                f"multihead: compiled FlexAttention failed on the CPU for mask function {_name(entry.fn)} "
                f"({entry.failed}); the blocked backend serves it from now on",
                RuntimeWarning,
                stacklevel=2,
            )
            return fallback(call)
        if entry.span >= self.long_span and entry.measured is None and fallback is not None:
            entry.measured = _measure({"flex": run, "blocked": partial(fallback, call)})  # outside the try:
        return out  # a failure of blocked's is not the compiler's

    # ------------------------------------------------------------------------------------------

    def _key(self, call: AttentionCall) -> tuple:
        return (id(_source(call)), tuple(call.q.shape), tuple(call.k.shape), call.scale)

    def _entry(self, call: AttentionCall) -> _Entry:
        key = self._key(call)
        entry = self._entries.get(key)
        if entry is None:
            entry = self._entries[key] = _Entry(_source(call))
            while len(self._entries) > self.capacity:
                self._entries.popitem(last=False)
        self._entries.move_to_end(key)
        return entry

    def _block_mask(self, call: AttentionCall, entry: _Entry) -> object | None:
        """The entry's block mask, made again only when what it was made from changed (a captured tensor
        written in place rebuilds the function's structure; a BlockMask's tables written in place), or
        ``None`` when the function's structure cannot be bounded."""
        fn = call.masks.mask_fn
        target = (*call.q.shape[:3], call.k.shape[2])
        if isinstance(fn, BlockMaskFunction):  # a BlockMask is wrapped anew on every call: its own identity
            coarse, inner, source = fn.blocks, fn.inner, fn.source
            made_from = (source, _versions(source)) if source is not None else (coarse, ())
        else:
            coarse, inner, source = structure(fn, target, COARSE, COARSE), fn, None  # type: ignore[arg-type]
            if coarse is None:
                return None
            made_from = (coarse, ())  # structure() is cached: the same object until a captured tensor changes
        if (
            entry.block_mask is not None
            and entry.made_from[0] is made_from[0]
            and entry.made_from[1] == made_from[1]
        ):
            return entry.block_mask
        fine = self._fine(coarse, inner, target)
        fine = None if fine is None else refine(coarse, fine)
        if fine is not None and _spares(coarse, fine):
            block_mask = to_flex(fine, inner)
        else:  # the user's BlockMask as given, or the coarse tiles
            block_mask = source if source is not None else to_flex(coarse, inner)
        entry.made_from, entry.block_mask, entry.span = made_from, block_mask, _span(coarse)
        log.debug("compiled flex on the CPU: a block mask for %s", _name(entry.fn))
        return block_mask

    def _fine(self, coarse: Blocks, inner: object, target: tuple[int, int, int, int]) -> Blocks | None:
        """``inner``'s structure in :data:`TILE` tiles where it refines ``coarse`` (whose partial tiles
        ``inner`` alone decides, the same for every row and head), else ``None``."""
        uniform = coarse.batch == 1 and coarse.heads == 1 and inner is not None
        if not uniform or coarse.block_q % self.tile or coarse.block_k % self.tile:
            return None
        if coarse.block_q == self.tile and coarse.block_k == self.tile:
            return None
        return structure(inner, target, self.tile, self.tile)  # type: ignore[arg-type]


def _measure(contenders: dict[str, Callable[[], object]], rounds: int = MEASURE_ROUNDS) -> dict[str, float]:
    """Seconds per call of each contender: the fastest of ``rounds`` calls, in alternating order (each warm:
    ``blocked`` served the call's first sightings, ``flex`` has just compiled and run)."""
    best = dict.fromkeys(contenders, float("inf"))
    names = list(contenders)
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            start = _clock()
            contenders[name]()
            best[name] = min(best[name], _clock() - start)
    log.debug("compiled flex on the CPU against blocked, measured: %s", best)
    return best


def _faster(measured: dict[str, float]) -> str:
    return min(measured, key=measured.__getitem__)


def _source(call: AttentionCall) -> object:
    """What a call's mask function was made from: a FlexAttention BlockMask (wrapped anew on every call),
    else the function itself."""
    fn = call.masks.mask_fn
    return getattr(fn, "source", None) or fn


def _spares(coarse: Blocks, fine: Blocks) -> bool:
    """Whether ``fine``'s tiles compute at most :data:`SPARES` of the pairs ``coarse``'s tiles do: then
    their extra loop overhead pays (a band's edges, chunks); else (prefix-LM, causal) it does not."""
    area = int(fine.allowed.sum()) * fine.block_q * fine.block_k
    return area <= SPARES * int(coarse.allowed.sum()) * coarse.block_q * coarse.block_k


def _span(blocks: Blocks) -> float:
    """Mean keys a query tile of ``blocks`` sees (its allowed tiles' keys; over every row, batch and head)."""
    return min(float(blocks.allowed.float().sum(-1).mean()) * blocks.block_k, float(blocks.lk))


def _versions(block_mask: object | None) -> tuple:
    """The in-place versions of a FlexAttention BlockMask's block tables (``()`` for ``None``)."""
    names = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices")
    tables = (getattr(block_mask, n, None) for n in names) if block_mask is not None else ()
    return tuple(t._version if isinstance(t, Tensor) else None for t in tables)


def _name(fn: object) -> str:
    return getattr(fn, "name", None) or getattr(fn, "__name__", None) or type(fn).__name__
