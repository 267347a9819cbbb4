"""Masks and biases as functions of ``(b, h, q_idx, kv_idx)``: FlexAttention's ``mask_mod`` and the body of
its ``score_mod``, and the library's factories of common ones.

Dimensions: B batch, H query heads, Lq query length, Lk key length.

Any callable ``fn(b, h, q_idx, kv_idx)`` is a mask (bool result) or a bias (float result). The factories
(:func:`causal_fn`, :func:`sliding_window_fn`, :func:`chunked_fn`, :func:`prefix_lm_fn`,
:func:`segments_fn`, :func:`alibi_fn`, :func:`relative_position_fn`) return a :class:`MaskFunction` or
:class:`BiasFunction`, which compose with ``&``, ``|``, ``~`` (``+`` for biases) and, for masks, carry a
``key_range`` that lets a block-skipping backend skip tiles without evaluating them. A factory aligns to
the bottom right when given ``lq``/``lk`` (``j <= i + (Lk - Lq)``), else it uses the square rule
``j <= i`` (the same when Lq == Lk). FlexAttention's own causal example is top-left; ours is not.
"""

from __future__ import annotations

import inspect
import operator
from collections.abc import Callable

import torch
from torch import Tensor

from ..checks import is_int
from .dense import bottom_right, causal_keep

__all__ = [
    "BiasFn",
    "BiasFunction",
    "KeyBound",
    "MaskFn",
    "MaskFunction",
    "alibi_fn",
    "alibi_slopes",
    "and_masks",
    "causal_fn",
    "check_callable",
    "check_signature",
    "chunked_fn",
    "fn_name",
    "or_masks",
    "prefix_lm_fn",
    "relative_position_fn",
    "segments_fn",
    "sliding_window_fn",
    "tensor_fn",
]


MaskFn = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]
"""``fn(b, h, q_idx, kv_idx) -> bool tensor`` (True = may attend): a FlexAttention ``mask_mod``, with the
meaning FlexAttention gives it (one call per scalar index, see :mod:`multihead.core.masks.evaluate`)."""

BiasFn = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]
"""``fn(b, h, q_idx, kv_idx) -> float tensor`` added to the scores (ALiBi, relative positions)."""

KeyBound = Callable[[int, int], "tuple[int, int] | None"]
"""``bound(q0, q1) -> (k0, k1)``: for queries ``q0:q1``, the keys ``k0:k1`` outside which a mask function
is surely False (a structural hint that lets a backend skip tiles without evaluating them)."""


def fn_name(fn: object) -> str:
    return str(getattr(fn, "name", None) or getattr(fn, "__name__", type(fn).__name__))


def check_callable(fn: object, kind: str) -> None:
    if isinstance(fn, Tensor) or not callable(fn):
        raise TypeError(
            f"a {kind} function must be callable as fn(b, h, q_idx, kv_idx), got {type(fn).__name__}; "
            f"a dense tensor becomes one with multihead.masks.tensor_fn(t)"
        )


def check_signature(fn: Callable[..., object], kind: str) -> None:
    """Refuse a ``kind`` function that cannot be called as ``fn(b, h, q_idx, kv_idx)``, before it runs.

    The common case is FlexAttention's ``score_mod(score, b, h, q_idx, kv_idx) -> new score`` (attention-gym's
    ``attn_gym.mods``) passed where a bias or mask goes: the error says how to pass it. A callable whose
    signature Python cannot read (some builtins) is left to the call itself.
    """
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return
    try:
        signature.bind(0, 0, 0, 0)
        return
    except TypeError:
        pass
    takes_score = len(signature.parameters) == 5 and not any(
        p.kind in (p.VAR_POSITIONAL, p.KEYWORD_ONLY) for p in signature.parameters.values()
    )
    if takes_score:
        what = "a FlexAttention score_mod (score, b, h, q_idx, kv_idx) -> new score"
        how = (
            "a score_mod that adds a term to the score (ALiBi, relative positions, score + f(b, h, q_idx, "
            "kv_idx)) is that term at score 0: bias=lambda b, h, q_idx, kv_idx: score_mod(0.0, b, h, q_idx, "
            "kv_idx); tanh soft-capping is softcap=c; other score_mods have no equivalent here"
        )
    else:
        what = "not 4 indices"
        how = "give it the four index parameters (b, h, q_idx, kv_idx), unused ones included"
    raise ValueError(
        f"the {kind} function {fn_name(fn)!r} has the signature {signature}: {what}. A {kind} is called as "
        f"fn(b, h, q_idx, kv_idx) -> "
        + (
            "a bool tensor, True = may attend (a mask_mod)"
            if kind == "mask"
            else "the term added to the score"
        )
        + f"; {how}"
    )


class MaskFunction:
    """A mask given as a function: ``fn(b, h, q_idx, kv_idx) -> bool tensor``, True = may attend.

    Composable: ``a & b`` (both allow), ``a | b`` (either allows), ``~a`` (the complement); the result
    is again a :class:`MaskFunction`, and a valid FlexAttention ``mask_mod`` when the parts are.
    ``causal_fn() & sliding_window_fn(2)`` with Lq = Lk = 4::

        1 0 0 0
        1 1 0 0
        0 1 1 0
        0 0 1 1
    """

    def __init__(self, fn: MaskFn, name: str | None = None, bound: KeyBound | None = None) -> None:
        check_callable(fn, "mask")
        self.fn = fn
        self.name = name or fn_name(fn)
        self.bound = bound

    def __call__(self, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return self.fn(b, h, q_idx, kv_idx)

    def key_range(self, q0: int, q1: int) -> tuple[int, int] | None:
        """For the queries ``q0:q1``: keys ``[k0, k1)`` outside which this mask is surely False (the
        bounds may exceed ``[0, Lk)``; ``k1 <= k0`` means no key), or ``None`` when unknown (a plain
        function, ``~``). A block-skipping backend evaluates the function only inside this range."""
        return None if self.bound is None else self.bound(q0, q1)

    def __and__(self, other: MaskFn) -> MaskFunction:
        return and_masks(self, other)

    def __rand__(self, other: MaskFn) -> MaskFunction:
        return and_masks(other, self)

    def __or__(self, other: MaskFn) -> MaskFunction:
        return or_masks(self, other)

    def __ror__(self, other: MaskFn) -> MaskFunction:
        return or_masks(other, self)

    def __invert__(self) -> MaskFunction:
        fn = self.fn  # the complement of a bounded mask is unbounded: no key range
        return MaskFunction(lambda b, h, q_idx, kv_idx: ~fn(b, h, q_idx, kv_idx), f"~{self.name}")

    def __repr__(self) -> str:
        return f"MaskFunction({self.name})"


class BiasFunction:
    """A bias given as a function: ``fn(b, h, q_idx, kv_idx) -> float tensor`` added to the scores.

    ``a + b`` adds two biases; the result is again a :class:`BiasFunction` (a valid FlexAttention
    ``score_mod`` body: ``score + fn(b, h, q_idx, kv_idx)``).
    """

    def __init__(self, fn: BiasFn, name: str | None = None) -> None:
        check_callable(fn, "bias")
        self.fn = fn
        self.name = name or fn_name(fn)

    def __call__(self, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return self.fn(b, h, q_idx, kv_idx)

    def __add__(self, other: BiasFn) -> BiasFunction:
        check_callable(other, "bias")
        first, second = self.fn, other
        return BiasFunction(
            lambda b, h, q_idx, kv_idx: first(b, h, q_idx, kv_idx) + second(b, h, q_idx, kv_idx),
            f"{self.name} + {fn_name(other)}",
        )

    __radd__ = __add__

    def __repr__(self) -> str:
        return f"BiasFunction({self.name})"


def _fold(fns: tuple[MaskFn, ...], op: Callable[[Tensor, Tensor], Tensor], what: str) -> MaskFn:
    """One function applying ``op`` (``&`` or ``|``) across ``fns``' results, after checking them."""
    if not fns:
        raise ValueError(f"{what} needs at least one mask function")
    for fn in fns:
        check_callable(fn, "mask")

    def folded(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        out = fns[0](b, h, q_idx, kv_idx)
        for fn in fns[1:]:
            out = op(out, fn(b, h, q_idx, kv_idx))
        return out

    return folded


def and_masks(*fns: MaskFn) -> MaskFunction:
    """One mask function that allows a key where every one of ``fns`` allows it (AND)."""
    both = _fold(fns, operator.and_, "and_masks")
    bounds = [f.key_range for f in fns if isinstance(f, MaskFunction) and f.bound is not None]

    def meet(q0: int, q1: int) -> tuple[int, int] | None:  # AND: keys inside every known range
        ranges = [r for r in (key_range(q0, q1) for key_range in bounds) if r is not None]
        return (max(r[0] for r in ranges), min(r[1] for r in ranges)) if ranges else None

    name = " & ".join(fn_name(f) for f in fns) if len(fns) > 1 else fn_name(fns[0])
    return MaskFunction(both, name, meet if bounds else None)


def or_masks(*fns: MaskFn) -> MaskFunction:
    """One mask function that allows a key where any one of ``fns`` allows it (OR)."""
    either = _fold(fns, operator.or_, "or_masks")
    bounded = all(isinstance(f, MaskFunction) and f.bound is not None for f in fns)

    def hull(q0: int, q1: int) -> tuple[int, int] | None:  # OR: the smallest range holding every one
        ranges = [f.key_range(q0, q1) for f in fns if isinstance(f, MaskFunction)]
        if any(r is None for r in ranges):
            return None
        live = [r for r in ranges if r is not None and r[1] > r[0]]
        return (min(r[0] for r in live), max(r[1] for r in live)) if live else (0, 0)

    return MaskFunction(either, "(" + " | ".join(fn_name(f) for f in fns) + ")", hull if bounded else None)


def tensor_fn(t: Tensor) -> Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]:
    """``(b, h, q_idx, kv_idx) -> t[b, h, q_idx, kv_idx]`` for a (B|1, H|1, Lq|1, Lk|1) tensor (a dense
    mask or bias as a function; size-1 dimensions are read at index 0). A bool ``t`` gives a
    :class:`MaskFunction`, a float one a :class:`BiasFunction`."""
    if not isinstance(t, Tensor) or t.dim() != 4:
        got = tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__
        raise ValueError(f"tensor_fn takes a 4-D tensor (B|1, H|1, Lq|1, Lk|1), got {got}")
    sizes = tuple(t.shape)

    def at(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        # FlexAttention calls a mask_mod/score_mod with 0-d index tensors (under vmap, or traced by its
        # compiler). There every index must be a tensor: before torch 2.13 an int among them is read with
        # .item() (an error under vmap, a data-dependent guard under compile). Broadcast index tensors (the
        # library's own blocks) keep the int 0, so a size-1 dimension adds no extent to the result.
        zero = torch.zeros_like(q_idx) if q_idx.dim() == 0 else 0
        return t[tuple(i if n != 1 else zero for i, n in zip((b, h, q_idx, kv_idx), sizes, strict=True))]

    return MaskFunction(at, "tensor") if t.dtype == torch.bool else BiasFunction(at, "tensor")


def _offset(lq: int | None, lk: int | None) -> int:
    """How far the bottom-right diagonal is shifted: ``Lk - Lq`` when both lengths are given, else 0."""
    if (lq is None) != (lk is None):
        raise ValueError(
            f"give both lq and lk (to align to the bottom right when Lq != Lk) or neither (Lq == Lk), "
            f"got lq={lq!r}, lk={lk!r}"
        )
    if lq is None or lk is None:
        return 0
    if not (is_int(lq, 0) and is_int(lk, 0)):
        raise ValueError(f"lq and lk must be non-negative ints, got lq={lq!r}, lk={lk!r}")
    return bottom_right(lq, lk)


def causal_fn(lq: int | None = None, lk: int | None = None) -> MaskFunction:
    """Causal mask as a function: query ``i`` sees key ``j <= i + (Lk - Lq)``.

    Bottom-right aligned like :func:`causal` when ``lq``/``lk`` are given; without them it is the
    square rule ``j <= i`` (the two agree when Lq == Lk). FlexAttention's own ``causal_mask`` is the
    top-left rule; this library keeps the bottom-right one everywhere. With lq = 2, lk = 4::

        1 1 1 0
        1 1 1 1
    """
    off = _offset(lq, lk)

    def causal(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return causal_keep(q_idx, kv_idx, off)

    return MaskFunction(causal, "causal", lambda q0, q1: (-(1 << 62), q1 + off))


def sliding_window_fn(
    window: int, *, causal: bool = True, lq: int | None = None, lk: int | None = None
) -> MaskFunction:
    """:func:`sliding_window` as a function: the ``window`` most recent keys up to the query's own
    position (``causal=True``), or keys within ``window - 1`` positions on either side. Aligned like
    :func:`causal_fn`. window = 2, Lq = Lk = 4, causal::

        1 0 0 0
        1 1 0 0
        0 1 1 0
        0 0 1 1
    """
    if not isinstance(window, int) or isinstance(window, bool) or window < 1:
        raise ValueError(f"window must be a positive int, got {window!r}")
    off = _offset(lq, lk)

    def sliding_window(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        if causal:
            return causal_keep(q_idx, kv_idx, off, window)
        return (kv_idx - (q_idx + off)).abs() < window

    def bound(q0: int, q1: int) -> tuple[int, int]:  # keys within the window of the first/last query
        return q0 + off - window + 1, q1 + off + (0 if causal else window - 1)

    return MaskFunction(sliding_window, f"sliding_window({window})", bound)


def chunked_fn(
    chunk: int, *, causal: bool = True, lq: int | None = None, lk: int | None = None
) -> MaskFunction:
    """Chunked (local) attention as a function: a query sees only keys of its own chunk of ``chunk``
    positions (Llama 4's local layers), causally by default. Aligned like :func:`causal_fn`.
    chunk = 2, Lq = Lk = 4, causal::

        1 0 0 0
        1 1 0 0
        0 0 1 0
        0 0 1 1
    """
    if not isinstance(chunk, int) or isinstance(chunk, bool) or chunk < 1:
        raise ValueError(f"chunk must be a positive int, got {chunk!r}")
    off = _offset(lq, lk)

    def chunked(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        pos = q_idx + off  # the query's position among the keys
        same = torch.div(pos, chunk, rounding_mode="floor") == torch.div(kv_idx, chunk, rounding_mode="floor")
        return (same & causal_keep(q_idx, kv_idx, off)) if causal else same

    def bound(q0: int, q1: int) -> tuple[int, int]:  # from the first query's chunk to the last one's
        end = (q1 - 1 + off) // chunk * chunk + chunk
        return (q0 + off) // chunk * chunk, min(end, q1 + off) if causal else end

    return MaskFunction(chunked, f"chunked({chunk})", bound)


def prefix_lm_fn(prefix: int | Tensor, *, lq: int | None = None, lk: int | None = None) -> MaskFunction:
    """Prefix-LM mask as a function: every query sees the first ``prefix`` keys (bidirectional
    prefix), and the rest causally. ``prefix`` is an int or an int tensor (B,) per sequence. Aligned
    like :func:`causal_fn`. prefix = 2, Lq = Lk = 4::

        1 1 0 0
        1 1 0 0
        1 1 1 0
        1 1 1 1
    """
    off = _offset(lq, lk)
    if isinstance(prefix, Tensor):
        if prefix.dim() != 1 or prefix.is_floating_point() or prefix.dtype == torch.bool:
            raise ValueError(
                f"prefix must be an int or an int tensor of shape (B,), got dtype {prefix.dtype} shape "
                f"{tuple(prefix.shape)}"
            )
    elif isinstance(prefix, bool) or not isinstance(prefix, int) or prefix < 0:
        raise ValueError(f"prefix must be a non-negative int or an int tensor (B,), got {prefix!r}")

    def prefix_lm(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        p = prefix[b] if isinstance(prefix, Tensor) else prefix  # (B, 1, 1, 1) or an int
        return causal_keep(q_idx, kv_idx, off) | (kv_idx < p)

    def bound(q0: int, q1: int) -> tuple[int, int]:  # up to the diagonal or the longest prefix
        longest = (int(prefix.max()) if prefix.numel() else 0) if isinstance(prefix, Tensor) else prefix
        return -(1 << 62), max(q1 + off, longest)

    return MaskFunction(prefix_lm, "prefix_lm", bound)


def segments_fn(q_ids: Tensor, kv_ids: Tensor | None = None) -> MaskFunction:
    """Document (packed-sequence) mask from segment ids: query ``i`` of row ``b`` sees key ``j`` when
    ``q_ids[b, i] == kv_ids[b, j]`` and both are >= 0 (a negative id is padding). ``q_ids`` (B, Lq),
    ``kv_ids`` (B, Lk) (default: ``q_ids``), read when the function is made. ids = [[0, 0, 1, -1]]::

        1 1 0 0
        1 1 0 0
        0 0 1 0
        0 0 0 0

    This is what ``segment_ids=`` means; pass it there (backends then skip whole blocks and serve
    packed rows as separate sequences) rather than as ``mask=segments_fn(...)``.
    """
    kv_ids = q_ids if kv_ids is None else kv_ids
    for name, ids in (("q_ids", q_ids), ("kv_ids", kv_ids)):
        if (
            not isinstance(ids, Tensor)
            or ids.dim() != 2
            or ids.is_floating_point()
            or ids.dtype == torch.bool
        ):
            got = (
                f"dtype {ids.dtype} shape {tuple(ids.shape)}"
                if isinstance(ids, Tensor)
                else type(ids).__name__
            )
            raise ValueError(f"{name} must be an int tensor of shape (B, L), got {got}")

    # padding as -1 among the queries and -2 among the keys: then equal ids alone decide, one comparison
    # per pair (read here, once: an in-place change of the ids later is not seen)
    q_key = q_ids.long().masked_fill(q_ids < 0, -1)  # (B, Lq)
    kv_key = kv_ids.long().masked_fill(kv_ids < 0, -2)  # (B, Lk)

    def segments(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return q_key[b, q_idx] == kv_key[b, kv_idx]  # (B, 1, Lq, 1) == (B, 1, 1, Lk)

    return MaskFunction(segments, "segments")


def alibi_slopes(num_heads: int) -> Tensor:
    """ALiBi's per-head slopes (H,), float32: the geometric sequence ``2**(-8 (i + 1) / H)`` for a power
    of two H; otherwise those of the nearest lower power of two P, then every other slope of 2P."""
    if isinstance(num_heads, bool) or not isinstance(num_heads, int) or num_heads < 1:
        raise ValueError(f"num_heads must be a positive int, got {num_heads!r}")

    def geometric(n: int) -> list[float]:
        return [2.0 ** (-8.0 * (i + 1) / n) for i in range(n)]

    p = 1 << (num_heads.bit_length() - 1)  # the largest power of two <= H
    slopes = geometric(p) + geometric(2 * p)[0::2][: num_heads - p]
    return torch.tensor(slopes, dtype=torch.float32)


def alibi_fn(slopes: int | Tensor, *, lq: int | None = None, lk: int | None = None) -> BiasFunction:
    """ALiBi bias as a function: ``-slope[h] * |i + (Lk - Lq) - j|`` (0 on the aligned diagonal, more
    negative with distance). ``slopes``: a float tensor (H,) (learnable if it requires grad) or a number
    of heads for :func:`alibi_slopes`. Aligned like :func:`causal_fn`; combine with ``causal=True`` for
    a decoder."""
    if not isinstance(slopes, Tensor):
        slopes = alibi_slopes(slopes)
    if slopes.dim() != 1 or not slopes.is_floating_point():
        raise ValueError(
            f"slopes must be a float tensor (H,), got dtype {slopes.dtype} shape {tuple(slopes.shape)}"
        )
    off = _offset(lq, lk)
    table = slopes

    def alibi(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        # the slopes follow the index tensors' device (alibi_fn(H) makes them on the CPU; a no-op there)
        return -table.to(h.device)[h] * (q_idx + off - kv_idx).abs()

    return BiasFunction(alibi, "alibi")


def relative_position_fn(table: Tensor, *, lq: int | None = None, lk: int | None = None) -> BiasFunction:
    """Learned relative-position bias as a function: ``table[h, clamp(j - i - (Lk - Lq), -M, M) + M]``
    with ``table`` (H, 2M + 1) float (T5/Shaw style, clipped at distance M). Aligned like
    :func:`causal_fn`. Gradients flow to ``table``."""
    if (
        not isinstance(table, Tensor)
        or table.dim() != 2
        or table.shape[1] % 2 == 0
        or not table.is_floating_point()
    ):
        got = (
            f"dtype {table.dtype} shape {tuple(table.shape)}"
            if isinstance(table, Tensor)
            else type(table).__name__
        )
        raise ValueError(f"table must be a float tensor (H, 2M + 1) (an odd number of distances), got {got}")
    off = _offset(lq, lk)
    m = (table.shape[1] - 1) // 2

    def relative_position(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        rel = (kv_idx - q_idx - off).clamp(-m, m) + m  # (1, 1, Lq, Lk) in [0, 2M]
        return table[h, rel]  # (1, H, Lq, Lk)

    return BiasFunction(relative_position, "relative_position")
