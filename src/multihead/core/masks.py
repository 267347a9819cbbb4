"""Mask builders and the one mask normalisation routine every backend uses.

Dimensions: B batch, H query heads, Lq query length, Lk key length.

The convention, everywhere in the library:

* a **bool** mask is ``True`` where a query *may* attend to a key; it broadcasts to (B, H, Lq, Lk);
* a **float** bias is added to the scores (``-inf`` entries forbid a key);
* ``valid_lens`` of shape (B,) or (B, Lq) keeps keys ``j < valid_len`` (the d2l meaning);
* ``causal=True`` is aligned to the **bottom right**: query ``i`` sees keys ``j <= i + (Lk - Lq)``;
* everything given combines with AND;
* ``segment_ids`` (B, L) or ``(q_ids (B, Lq), kv_ids (B, Lk))``: a query sees only keys of its own id;
  negative ids are padding;
* a query row with no allowed key gets output 0 and weight 0 (see :class:`Normalized`).

A mask or bias may also be a **function** ``fn(b, h, q_idx, kv_idx)`` of broadcastable int64 index
tensors (a FlexAttention ``mask_mod``/``score_mod`` body). The ``*_fn`` factories here build the common
ones (:func:`causal_fn`, :func:`sliding_window_fn`, :func:`chunked_fn`, :func:`prefix_lm_fn`,
:func:`segments_fn`, :func:`alibi_fn`, :func:`relative_position_fn`); :class:`MaskFunction` composes
with ``&``, ``|``, ``~``. Index functions see ``q_idx`` in [0, Lq) and ``kv_idx`` in [0, Lk): a factory
aligns to the bottom right when given ``lq``/``lk`` (``j <= i + (Lk - Lq)``), else it uses the square
rule ``j <= i`` (the same when Lq == Lk). FlexAttention's own causal example is top-left; ours is not.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = [
    "BiasFn",
    "BiasFunction",
    "MaskFn",
    "KeyBound",
    "MaskFunction",
    "Normalized",
    "alibi_fn",
    "alibi_slopes",
    "and_masks",
    "causal",
    "causal_fn",
    "check_mask",
    "check_segment_ids",
    "chunked_fn",
    "combine",
    "evaluate_block",
    "evaluate_fn",
    "from_valid_lens",
    "index_grid",
    "key_padding",
    "key_padding_from_tokens",
    "materialize",
    "normalize",
    "or_masks",
    "prefix_lm_fn",
    "relative_position_fn",
    "segment_mask",
    "segments_fn",
    "sliding_window",
    "sliding_window_fn",
    "tensor_fn",
    "to_bias",
]


def _offsets(lq: int, lk: int, device: torch.device | str | None) -> Tensor:
    """(Lq, Lk) long tensor of ``j - (i + Lk - Lq)``: 0 on the bottom-right aligned diagonal."""
    rows = torch.arange(lq, device=device).unsqueeze(1) + (lk - lq)  # (Lq, 1)
    cols = torch.arange(lk, device=device).unsqueeze(0)  # (1, Lk)
    return cols - rows  # (Lq, Lk)


def causal(lq: int, lk: int | None = None, *, device: torch.device | str | None = None) -> Tensor:
    """Causal mask of shape (Lq, Lk), aligned to the bottom right.

    Query ``i`` may attend to key ``j`` when ``j <= i + (Lk - Lq)``, so the last query sees every key
    (what a KV cache needs). With Lq = 2, Lk = 5::

        1 1 1 1 0
        1 1 1 1 1

    With Lq = Lk = 3 it is the usual lower triangle::

        1 0 0
        1 1 0
        1 1 1
    """
    lk = lq if lk is None else lk
    return _offsets(lq, lk, device) <= 0


def sliding_window(
    lq: int,
    lk: int | None = None,
    *,
    window: int,
    causal: bool = True,
    device: torch.device | str | None = None,
) -> Tensor:
    """Local attention mask of shape (Lq, Lk), aligned to the bottom right like :func:`causal`.

    With ``causal=True`` query ``i`` sees the ``window`` most recent keys up to its own position;
    with ``causal=False`` it sees keys within ``window - 1`` positions on either side.
    Lq = Lk = 5, window = 2, causal::

        1 0 0 0 0
        1 1 0 0 0
        0 1 1 0 0
        0 0 1 1 0
        0 0 0 1 1
    """
    if not isinstance(window, int) or window < 1:
        raise ValueError(f"window must be a positive int, got {window!r}")
    lk = lq if lk is None else lk
    off = _offsets(lq, lk, device)  # (Lq, Lk)
    if causal:
        return (off <= 0) & (off > -window)
    return off.abs() < window


def from_valid_lens(valid_lens: Tensor, lk: int, lq: int | None = None) -> Tensor:
    """Bool mask from d2l-style ``valid_lens``: keys at index >= valid_len are masked.

    ``valid_lens`` (B,) gives (B, 1, 1, Lk); (B, Lq) gives (B, 1, Lq, Lk). With valid_lens = [3, 1]
    and Lk = 4 the two rows are::

        1 1 1 0
        1 0 0 0
    """
    check_valid_lens(valid_lens, batch=None, lq=lq)
    keys = torch.arange(lk, device=valid_lens.device)  # (Lk,)
    if valid_lens.dim() == 1:
        return (keys < valid_lens[:, None]).view(-1, 1, 1, lk)  # (B, 1, 1, Lk)
    return (keys < valid_lens[:, :, None]).unsqueeze(1)  # (B, 1, Lq, Lk)


def key_padding(keep: Tensor) -> Tensor:
    """(B, Lk) bool, ``True`` for real keys, to a (B, 1, 1, Lk) attention mask.

    torch's ``key_padding_mask`` uses the opposite meaning (``True`` = padding); pass ``~mask``.
    """
    if keep.dtype != torch.bool or keep.dim() != 2:
        raise ValueError(
            f"key_padding expects a (B, Lk) bool tensor with True for real keys, got shape "
            f"{tuple(keep.shape)} dtype {keep.dtype}; convert with `keep = lengths_or_mask.bool()`"
        )
    return keep[:, None, None, :]  # (B, 1, 1, Lk)


def key_padding_from_tokens(tokens: Tensor, pad_id: int) -> Tensor:
    """(B, Lk) token ids to a (B, 1, 1, Lk) mask that hides the ``pad_id`` positions."""
    return key_padding(tokens != pad_id)


def combine(*masks: Tensor | None) -> Tensor | None:
    """AND of bool masks with broadcasting; ``None`` entries are skipped, all-``None`` gives ``None``.

    ``combine(causal(3), from_valid_lens(torch.tensor([2]), 3))`` is, for the one batch row::

        1 0 0
        1 1 0
        1 1 0
    """
    out: Tensor | None = None
    for m in masks:
        if m is None:
            continue
        if m.dtype != torch.bool:
            raise ValueError(f"combine takes bool masks, got dtype {m.dtype}; convert with `m.bool()`")
        out = m if out is None else out & m
    return out


def to_bias(mask: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """Bool mask to an additive float bias: 0 where allowed, ``-inf`` where masked."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))


MaskFn = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]
"""``fn(b, h, q_idx, kv_idx) -> bool tensor`` (True = may attend), called with broadcastable integer index
tensors; written with elementwise tensor operations it is also a valid FlexAttention ``mask_mod``."""

BiasFn = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]
"""``fn(b, h, q_idx, kv_idx) -> float tensor`` added to the scores (ALiBi, relative positions)."""

KeyBound = Callable[[int, int], "tuple[int, int] | None"]
"""``bound(q0, q1) -> (k0, k1)``: for queries ``q0:q1``, the keys ``k0:k1`` outside which a mask function
is surely False (a structural hint that lets a backend skip tiles without evaluating them)."""


# ----------------------------------------------------------------------------------------------
# Masks and biases as functions of (b, h, q_idx, kv_idx)
# ----------------------------------------------------------------------------------------------


def index_grid(
    target: tuple[int, int, int, int], device: torch.device | str | None = None
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The int64 index tensors a mask or bias function is called with on the full (B, H, Lq, Lk) grid:
    ``b`` (B, 1, 1, 1), ``h`` (1, H, 1, 1), ``q_idx`` (1, 1, Lq, 1), ``kv_idx`` (1, 1, 1, Lk)."""
    b, h, lq, lk = target
    return (
        torch.arange(b, device=device).view(b, 1, 1, 1),  # (B, 1, 1, 1)
        torch.arange(h, device=device).view(1, h, 1, 1),  # (1, H, 1, 1)
        torch.arange(lq, device=device).view(1, 1, lq, 1),  # (1, 1, Lq, 1)
        torch.arange(lk, device=device).view(1, 1, 1, lk),  # (1, 1, 1, Lk)
    )


def _fn_name(fn: object) -> str:
    return str(getattr(fn, "name", None) or getattr(fn, "__name__", type(fn).__name__))


def _check_callable(fn: object, kind: str) -> None:
    if isinstance(fn, Tensor) or not callable(fn):
        raise TypeError(
            f"a {kind} function must be callable as fn(b, h, q_idx, kv_idx), got {type(fn).__name__}; "
            f"a dense tensor becomes one with multihead.masks.tensor_fn(t)"
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
        _check_callable(fn, "mask")
        self.fn = fn
        self.name = name or _fn_name(fn)
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
        _check_callable(fn, "bias")
        self.fn = fn
        self.name = name or _fn_name(fn)

    def __call__(self, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return self.fn(b, h, q_idx, kv_idx)

    def __add__(self, other: BiasFn) -> BiasFunction:
        _check_callable(other, "bias")
        first, second = self.fn, other
        return BiasFunction(
            lambda b, h, q_idx, kv_idx: first(b, h, q_idx, kv_idx) + second(b, h, q_idx, kv_idx),
            f"{self.name} + {_fn_name(other)}",
        )

    __radd__ = __add__

    def __repr__(self) -> str:
        return f"BiasFunction({self.name})"


def and_masks(*fns: MaskFn) -> MaskFunction:
    """One mask function that allows a key where every one of ``fns`` allows it (AND)."""
    if not fns:
        raise ValueError("and_masks needs at least one mask function")
    for fn in fns:
        _check_callable(fn, "mask")

    def both(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        out = fns[0](b, h, q_idx, kv_idx)
        for fn in fns[1:]:
            out = out & fn(b, h, q_idx, kv_idx)
        return out

    bounds = [f.key_range for f in fns if isinstance(f, MaskFunction) and f.bound is not None]

    def meet(q0: int, q1: int) -> tuple[int, int] | None:  # AND: keys inside every known range
        ranges = [r for r in (key_range(q0, q1) for key_range in bounds) if r is not None]
        return (max(r[0] for r in ranges), min(r[1] for r in ranges)) if ranges else None

    name = " & ".join(_fn_name(f) for f in fns) if len(fns) > 1 else _fn_name(fns[0])
    return MaskFunction(both, name, meet if bounds else None)


def or_masks(*fns: MaskFn) -> MaskFunction:
    """One mask function that allows a key where any one of ``fns`` allows it (OR)."""
    if not fns:
        raise ValueError("or_masks needs at least one mask function")
    for fn in fns:
        _check_callable(fn, "mask")

    def either(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        out = fns[0](b, h, q_idx, kv_idx)
        for fn in fns[1:]:
            out = out | fn(b, h, q_idx, kv_idx)
        return out

    bounded = all(isinstance(f, MaskFunction) and f.bound is not None for f in fns)

    def hull(q0: int, q1: int) -> tuple[int, int] | None:  # OR: the smallest range holding every one
        ranges = [f.key_range(q0, q1) for f in fns if isinstance(f, MaskFunction)]
        if any(r is None for r in ranges):
            return None
        live = [r for r in ranges if r is not None and r[1] > r[0]]
        return (min(r[0] for r in live), max(r[1] for r in live)) if live else (0, 0)

    return MaskFunction(either, "(" + " | ".join(_fn_name(f) for f in fns) + ")", hull if bounded else None)


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
        return t[tuple(i if n > 1 else zero for i, n in zip((b, h, q_idx, kv_idx), sizes, strict=True))]

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
    if not (isinstance(lq, int) and isinstance(lk, int) and lq >= 0 and lk >= 0):
        raise ValueError(f"lq and lk must be non-negative ints, got lq={lq!r}, lk={lk!r}")
    return lk - lq


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
        return kv_idx <= q_idx + off

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
        d = kv_idx - (q_idx + off)  # 0 on the aligned diagonal
        return ((d <= 0) & (d > -window)) if causal else (d.abs() < window)

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
        return (same & (kv_idx <= pos)) if causal else same

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
        return (kv_idx <= q_idx + off) | (kv_idx < p)

    def bound(q0: int, q1: int) -> tuple[int, int]:  # up to the diagonal or the longest prefix
        longest = (int(prefix.max()) if prefix.numel() else 0) if isinstance(prefix, Tensor) else prefix
        return -(1 << 62), max(q1 + off, longest)

    return MaskFunction(prefix_lm, "prefix_lm", bound)


def segments_fn(q_ids: Tensor, kv_ids: Tensor | None = None) -> MaskFunction:
    """Document (packed-sequence) mask from segment ids: query ``i`` of row ``b`` sees key ``j`` when
    ``q_ids[b, i] == kv_ids[b, j]`` and both are >= 0 (a negative id is padding). ``q_ids`` (B, Lq),
    ``kv_ids`` (B, Lk) (default: ``q_ids``). ids = [[0, 0, 1, -1]]::

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

    def segments(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        qi, ki = q_ids[b, q_idx], kv_ids[b, kv_idx]  # (B, 1, Lq, 1), (B, 1, 1, Lk)
        return (qi == ki) & (qi >= 0) & (ki >= 0)

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
        return -table[h] * (q_idx + off - kv_idx).abs()

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


def check_fn_output(out: object, fn: object, kind: str, index_shape: tuple[int, ...]) -> Tensor:
    """Check what a ``kind`` ("mask" or "bias") function returned for index tensors broadcasting to
    ``index_shape``; return it as a 4-D tensor."""
    name = _fn_name(fn)
    if not isinstance(out, Tensor):
        raise TypeError(
            f"the {kind} function {name!r} must return a torch.Tensor, got {type(out).__name__}; build it "
            f"from the index tensors with elementwise ops, e.g. `kv_idx <= q_idx`"
        )
    if kind == "mask" and out.dtype != torch.bool:
        raise ValueError(
            f"the mask function {name!r} must return a bool tensor (True = may attend), got dtype "
            f"{out.dtype}; return a comparison (e.g. `x != 0`), or pass a float result as bias="
        )
    if kind == "bias" and not out.is_floating_point():
        raise TypeError(
            f"the bias function {name!r} must return a floating-point tensor (added to the scores), got "
            f"dtype {out.dtype}; convert with `.float()`, or pass a bool result as mask="
        )
    if not _broadcastable(tuple(out.shape), index_shape):
        raise ValueError(
            f"the {kind} function {name!r} returned shape {tuple(out.shape)} for index tensors that "
            f"broadcast to {index_shape}; it must be elementwise in (b, h, q_idx, kv_idx), e.g. "
            f"`t[b, h, q_idx, kv_idx]` rather than `t`"
        )
    return out.reshape((1,) * (4 - out.dim()) + tuple(out.shape))


def evaluate_fn(
    fn: MaskFn | BiasFn,
    target: tuple[int, int, int, int],
    kind: str,
    device: torch.device | str | None = None,
) -> Tensor:
    """A mask or bias function evaluated on the full grid: (B|1, H|1, Lq|1, Lk|1) bool or float.

    ``kind`` is "mask" or "bias" (what the result is checked to be). This builds (Lq, Lk) entries;
    backends do it only at lengths where that is acceptable (see :func:`materialize`).
    """
    return check_fn_output(fn(*index_grid(target, device)), fn, kind, target)


def _probe_fn(
    fn: object, target: tuple[int, int, int, int], kind: str, device: torch.device | str | None
) -> None:
    """Call ``fn`` on a few (first, last) query/key indices of every batch row and head, to give a clear
    error before any kernel runs; costs B*H*4 entries, never (Lq, Lk)."""
    _check_callable(fn, kind)
    b, h, lq, lk = target
    if 0 in target:
        return
    qs = sorted({0, lq - 1})
    ks = sorted({0, lk - 1})
    idx = (
        torch.arange(b, device=device).view(b, 1, 1, 1),  # (B, 1, 1, 1)
        torch.arange(h, device=device).view(1, h, 1, 1),  # (1, H, 1, 1)
        torch.tensor(qs, device=device).view(1, 1, len(qs), 1),  # (1, 1, 1|2, 1)
        torch.tensor(ks, device=device).view(1, 1, 1, len(ks)),  # (1, 1, 1, 1|2)
    )
    check_fn_output(fn(*idx), fn, kind, (b, h, len(qs), len(ks)))  # type: ignore[operator]


def segment_mask(q_ids: Tensor, kv_ids: Tensor) -> Tensor:
    """(B, 1, Lq, Lk) bool from segment ids ``q_ids`` (B, Lq), ``kv_ids`` (B, Lk): the same id, both >= 0."""
    qi, ki = q_ids[:, None, :, None], kv_ids[:, None, None, :]  # (B, 1, Lq, 1), (B, 1, 1, Lk)
    return (qi == ki) & (qi >= 0) & (ki >= 0)  # (B, 1, Lq, Lk)


def check_segment_ids(
    segment_ids: object, batch: int, lq: int, lk: int, device: torch.device | str | None = None
) -> tuple[Tensor, Tensor]:
    """``segment_ids`` as ``(q_ids (B, Lq), kv_ids (B, Lk))`` int64 on ``device``.

    Accepts one int tensor (B, L) for self-attention (Lq == Lk == L) or a pair ``(q_ids, kv_ids)``.
    """
    if isinstance(segment_ids, (tuple, list)):
        if len(segment_ids) != 2:
            raise ValueError(
                f"segment_ids must be an int tensor (B, L) or a pair (q_ids (B, Lq), kv_ids (B, Lk)), got a "
                f"{type(segment_ids).__name__} of {len(segment_ids)} items"
            )
        q_ids, kv_ids = segment_ids
        pair = True
    else:
        q_ids = kv_ids = segment_ids
        pair = False
    for name, ids, length in (("q_ids", q_ids, lq), ("kv_ids", kv_ids, lk)):
        label = f"segment_ids {name}" if pair else "segment_ids"
        if not isinstance(ids, Tensor):
            raise TypeError(
                f"{label} must be an integer torch.Tensor of shape ({batch}, {length}), got {type(ids).__name__}"
            )
        if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
            raise TypeError(
                f"{label} must be an integer tensor, got dtype {ids.dtype}; convert with `.long()`"
            )
        if not pair and lq != lk:
            raise ValueError(
                f"one segment_ids tensor (B, L) is for self-attention (Lq == Lk), got Lq={lq}, Lk={lk}; pass "
                f"a pair segment_ids=(q_ids (B, Lq), kv_ids (B, Lk))"
            )
        if tuple(ids.shape) != (batch, length):
            raise ValueError(
                f"{label} must have shape (B, {'Lq' if name == 'q_ids' else 'Lk'}) = ({batch}, {length}), got "
                f"{tuple(ids.shape)}; a single sequence is ids[None] (1, L)"
            )
    q64 = q_ids.to(device=device, dtype=torch.int64)  # type: ignore[union-attr]
    kv64 = q64 if kv_ids is q_ids else kv_ids.to(device=device, dtype=torch.int64)  # type: ignore[union-attr]
    return q64, kv64


# ----------------------------------------------------------------------------------------------
# Validation helpers (shared by attention(), attention_reference() and the modules)
# ----------------------------------------------------------------------------------------------


def _broadcastable(shape: tuple[int, ...], target: tuple[int, ...]) -> bool:
    if len(shape) > len(target):
        return False
    return all(s in (1, t) for s, t in zip(reversed(shape), reversed(target)))


def check_mask(mask: Tensor, target: tuple[int, int, int, int], name: str = "mask") -> Tensor:
    """Check a bool ``mask`` broadcasts to ``target`` (B, H, Lq, Lk); return it as a 4-D view."""
    if not isinstance(mask, Tensor):
        raise TypeError(
            f"{name} must be a bool torch.Tensor or a function fn(b, h, q_idx, kv_idx) -> bool tensor, got "
            f"{type(mask).__name__}"
        )
    if mask.dtype != torch.bool:
        if mask.is_floating_point():
            fix = (
                f"a float {name} is an additive bias: pass it as `bias=` instead, or make a bool mask "
                f"with `{name} == 0` (0 = keep) or `{name} > -inf`"
            )
        else:
            fix = (
                f"convert with `{name}.bool()` if nonzero means 'may attend', or `{name} == 0` if "
                f"nonzero means 'masked out' (torch/Keras padding style)"
            )
        raise ValueError(f"{name} must be a bool tensor (True = may attend), got dtype {mask.dtype}; {fix}")
    if not _broadcastable(tuple(mask.shape), target):
        raise ValueError(
            f"{name} of shape {tuple(mask.shape)} does not broadcast to (B, H, Lq, Lk) = {target}; "
            f"give it shape (Lq, Lk), (B, 1, Lq, Lk), (B, 1, 1, Lk) or (B, H, Lq, Lk)"
        )
    return mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))  # (B|1, H|1, Lq|1, Lk|1)


def check_bias(bias: Tensor, target: tuple[int, int, int, int], dtype: torch.dtype) -> Tensor:
    """Check a float ``bias`` broadcasts to ``target``; return it 4-D in the working ``dtype``."""
    if not isinstance(bias, Tensor):
        raise TypeError(
            f"bias must be a floating-point torch.Tensor or a function fn(b, h, q_idx, kv_idx) -> float "
            f"tensor, got {type(bias).__name__}"
        )
    if not bias.is_floating_point():
        raise TypeError(
            f"bias must be a floating-point tensor added to the scores, got dtype {bias.dtype}; "
            f"for a keep/drop mask pass a bool tensor as `mask=`"
        )
    if not _broadcastable(tuple(bias.shape), target):
        raise ValueError(
            f"bias of shape {tuple(bias.shape)} does not broadcast to (B, H, Lq, Lk) = {target}; "
            f"give it shape (Lq, Lk), (H, Lq, Lk), (B, 1, Lq, Lk) or (B, H, Lq, Lk)"
        )
    bias = bias.reshape((1,) * (4 - bias.dim()) + tuple(bias.shape))  # (B|1, H|1, Lq|1, Lk|1)
    return bias.to(dtype)


def _is_tracing() -> bool:
    return bool(torch.jit.is_tracing() or torch.compiler.is_compiling() or torch.onnx.is_in_onnx_export())


def check_valid_lens(valid_lens: Tensor, batch: int | None, lq: int | None) -> None:
    """``valid_lens`` must be an integer tensor of shape (B,) or (B, Lq) with no negative entry."""
    if not isinstance(valid_lens, Tensor):
        raise TypeError(
            f"valid_lens must be an integer torch.Tensor of shape (B,) or (B, Lq), got "
            f"{type(valid_lens).__name__}; wrap it with torch.tensor(...)"
        )
    if valid_lens.is_floating_point() or valid_lens.is_complex() or valid_lens.dtype == torch.bool:
        raise TypeError(
            f"valid_lens must be an integer tensor, got dtype {valid_lens.dtype}; convert with "
            f"`valid_lens.long()`"
        )
    expected = "(B,) or (B, Lq)" if batch is None else f"({batch},) or ({batch}, {lq})"
    ok_rank = valid_lens.dim() in (1, 2)
    ok_batch = batch is None or (ok_rank and valid_lens.shape[0] == batch)
    ok_lq = valid_lens.dim() != 2 or lq is None or valid_lens.shape[1] == lq
    if not (ok_rank and ok_batch and ok_lq):
        raise ValueError(f"valid_lens must have shape {expected}, got {tuple(valid_lens.shape)}")
    if not _is_tracing() and valid_lens.numel() and bool((valid_lens < 0).any()):
        raise ValueError(f"valid_lens must be >= 0, got minimum {int(valid_lens.min())}")


# ----------------------------------------------------------------------------------------------
# Normalisation: the one place masks are interpreted
# ----------------------------------------------------------------------------------------------


@dataclass
class Normalized:
    """Masks of one attention call in a single canonical form.

    ``mask``: bool (B|1, H|1, Lq|1, Lk) or ``None`` -- everything dense that forbids keys, causal
    included unless ``causal`` below is still ``True``.
    ``bias``: float (B|1, H|1, Lq|1, Lk|1) or ``None``; finite in rows that have no allowed key.
    ``causal``: without functions (``has_functions`` False), ``True`` only when causality is the *only*
    constraint and Lq == Lk, so a backend may use its native causal kernel (top-left and bottom-right
    agree then).
    ``row_ok``: bool (B|1, H|1, Lq|1, 1) or ``None``: ``False`` for query rows with no allowed key.
    Such rows have been re-opened in ``mask``/``bias`` (so kernels never see an all ``-inf`` row and
    gradients stay finite); the backend multiplies their output and weights by ``row_ok`` -> 0.

    The function part (never expanded to a dense (Lq, Lk) tensor here; ``None`` = absent):
    ``mask_fn``: a :data:`MaskFn` that ANDs with ``mask``; ``bias_fn``: a :data:`BiasFn` added with ``bias``;
    ``segments``: ``(q_ids (B, Lq), kv_ids (B, Lk))`` int64 packed-sequence ids (a query sees only keys of
    its own id; negative ids are padding: never attended, and a padding query has no allowed key).

    **Function mode** (``has_functions`` True): ``mask``/``bias`` hold only the dense tensors given
    (``mask``, ``bias``, ``valid_lens``), and ``causal=True`` keeps its user meaning as a flag: the
    bottom-right aligned causal rule ``j <= i + (Lk - Lq)``, ANDed with everything else, for any Lq, Lk.
    ``row_ok`` covers the dense part only: rows that the functions, segments or causality leave with no
    allowed key are unknown until evaluated, and a backend serving the call must give them output 0
    (weights 0, finite gradients) itself. :func:`materialize` turns this into the dense form;
    :func:`evaluate_block` gives one block of it (a block-skipping backend's view);
    :func:`multihead.segments.segment_runs` gives the contiguous runs of ``segments`` (varlen kernels).
    The allowed set is ``mask & mask_fn & segments & causal & (bias + bias_fn > -inf)``.
    """

    mask: Tensor | None
    bias: Tensor | None
    causal: bool
    row_ok: Tensor | None
    mask_fn: MaskFn | None = None
    bias_fn: BiasFn | None = None
    segments: tuple[Tensor, Tensor] | None = None

    @property
    def has_functions(self) -> bool:
        """Whether part of the masking is given as functions or segment ids (not as dense tensors)."""
        return self.mask_fn is not None or self.bias_fn is not None or self.segments is not None


def _is_fn(x: object) -> bool:
    return x is not None and not isinstance(x, Tensor) and callable(x)


def _dense(keep: Tensor | None, bias: Tensor | None) -> Normalized:
    """The dense form of ``keep`` and ``bias``: dead rows found, re-opened and recorded in ``row_ok``."""
    if keep is None and bias is None:
        return Normalized(None, None, False, None)
    allowed = keep  # rows with no allowed key: from the bool mask, and from -inf entries of the bias
    if bias is not None:
        finite = ~torch.isneginf(bias)
        allowed = finite if allowed is None else allowed & finite
    assert allowed is not None
    row_ok: Tensor | None = allowed.any(dim=-1, keepdim=True)  # (B|1, H|1, Lq|1, 1)
    if not _is_tracing() and allowed.device.type == "cpu" and bool(row_ok.all()):
        return Normalized(keep, bias, False, None)  # common case: no dead row, nothing to patch
    assert row_ok is not None
    if keep is not None:
        keep = keep | ~row_ok  # re-open dead rows: their output is zeroed by row_ok
    if bias is not None:
        bias = bias.masked_fill(~row_ok, 0.0)
    return Normalized(keep, bias, False, row_ok)


def normalize(
    target: tuple[int, int, int, int],
    *,
    mask: Tensor | MaskFn | None = None,
    bias: Tensor | BiasFn | None = None,
    valid_lens: Tensor | None = None,
    causal: bool = False,
    segment_ids: Tensor | tuple[Tensor, Tensor] | None = None,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
) -> Normalized:
    """Validate and merge ``mask``, ``bias``, ``valid_lens``, ``causal`` and ``segment_ids`` for ``target``.

    ``target`` is (B, H, Lq, Lk). Returns a :class:`Normalized`. This is the only function that
    interprets masks; every backend and the reference go through it. A function ``mask``/``bias`` or
    ``segment_ids`` give the function mode (see :class:`Normalized`): nothing of size (Lq, Lk) is built
    here; the functions are only probed on a few indices for a clear error.
    """
    b, _, lq, lk = target
    if causal and lq == 1 and lk >= 1:
        causal = False  # one query, bottom-right aligned, sees every key: a decoding step needs no mask
    mask_fn = mask if _is_fn(mask) else None
    bias_fn = bias if _is_fn(bias) else None
    for fn, kind in ((mask_fn, "mask"), (bias_fn, "bias")):
        if fn is not None:
            _probe_fn(fn, target, kind, device)
    segments = None if segment_ids is None else check_segment_ids(segment_ids, b, lq, lk, device)
    keep = check_mask(mask, target) if mask is not None and mask_fn is None else None  # type: ignore[arg-type]
    dense_bias = check_bias(bias, target, dtype) if bias is not None and bias_fn is None else None  # type: ignore[arg-type]
    if valid_lens is not None:
        check_valid_lens(valid_lens, b, lq)
        keep = combine(keep, from_valid_lens(valid_lens.to(device), lk, lq))
    if mask_fn is not None or bias_fn is not None or segments is not None:  # function mode
        norm = _dense(keep, dense_bias)
        norm.causal, norm.mask_fn, norm.bias_fn, norm.segments = causal, mask_fn, bias_fn, segments
        return norm
    if causal and (keep is not None or dense_bias is not None or lq != lk):
        keep = combine(keep, (_offsets(lq, lk, device) <= 0).view(1, 1, lq, lk))  # bottom-right causal
        causal = False
    if keep is None and dense_bias is None:
        return Normalized(None, None, causal, None)
    return _dense(keep, dense_bias)


def materialize(
    norm: Normalized,
    target: tuple[int, int, int, int],
    dtype: torch.dtype,
    device: torch.device | str | None = None,
) -> Normalized:
    """A function-mode :class:`Normalized` in the ordinary dense form (``has_functions`` False).

    Evaluates ``mask_fn``/``bias_fn`` on the full (B, H, Lq, Lk) grid, turns ``segments`` into a
    (B, 1, Lq, Lk) bool mask and folds ``causal`` in, then finds, re-opens and records the rows with no
    allowed key (``row_ok``). Builds (Lq, Lk) entries: backends call it only at lengths where a dense
    score matrix is acceptable. A dense ``norm`` is returned as is.
    """
    if not norm.has_functions:
        return norm
    keep, bias = evaluate_block(norm, target, slice(None), slice(None), dtype, device)
    return _dense(keep, bias)


def evaluate_block(
    norm: Normalized,
    target: tuple[int, int, int, int],
    q: slice,
    kv: slice,
    dtype: torch.dtype,
    device: torch.device | str | None = None,
) -> tuple[Tensor | None, Tensor | None]:
    """Everything ``norm`` says about one block of queries ``q`` x keys ``kv`` (slices of [0, Lq), [0, Lk)).

    Returns ``(keep, bias)``: bool (B|1, H|1, q_len|1, kv_len|1) -- the dense mask and dense dead rows,
    the mask function, the segment ids and bottom-right causality, ANDed -- and float (B|1, H|1,
    q_len|1, kv_len|1) in ``dtype`` -- the dense bias plus the bias function -- each ``None`` if nothing
    applies. A block-skipping backend calls this per block; :func:`materialize` calls it once for the
    whole grid. Dead rows are *not* handled here (a row is dead only if all its blocks are).
    """
    b, h, lq, lk = target
    q0, q1, _ = q.indices(lq)
    k0, k1, _ = kv.indices(lk)

    def cut(t: Tensor | None) -> Tensor | None:  # (B|1, H|1, Lq|1, Lk|1) -> (B|1, H|1, q_len|1, kv_len|1)
        if t is not None and t.shape[2] > 1:
            t = t[:, :, q0:q1]
        if t is not None and t.shape[3] > 1:
            t = t[:, :, :, k0:k1]
        return t

    keep = combine(cut(norm.mask), cut(norm.row_ok))  # dense rows found dead stay dead
    bias = cut(norm.bias)
    shape = (b, h, q1 - q0, k1 - k0)
    idx = (
        torch.arange(b, device=device).view(b, 1, 1, 1),  # (B, 1, 1, 1)
        torch.arange(h, device=device).view(1, h, 1, 1),  # (1, H, 1, 1)
        torch.arange(q0, q1, device=device).view(1, 1, q1 - q0, 1),  # (1, 1, q_len, 1)
        torch.arange(k0, k1, device=device).view(1, 1, 1, k1 - k0),  # (1, 1, 1, kv_len)
    )
    if norm.mask_fn is not None:
        keep = combine(keep, check_fn_output(norm.mask_fn(*idx), norm.mask_fn, "mask", shape))
    if norm.segments is not None:
        q_ids, kv_ids = norm.segments
        keep = combine(keep, segment_mask(q_ids[:, q0:q1], kv_ids[:, k0:k1]))  # (B, 1, q_len, kv_len)
    if norm.causal:
        keep = combine(keep, idx[3] - idx[2] <= lk - lq)  # (1, 1, q_len, kv_len), bottom-right causal
    if norm.bias_fn is not None:
        extra = check_fn_output(norm.bias_fn(*idx), norm.bias_fn, "bias", shape).to(dtype)
        bias = extra if bias is None else bias + extra
    return keep, bias
