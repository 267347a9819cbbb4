"""Bounds of a mask function over whole tiles: which tiles it surely forbids, and which it surely allows.

Dimensions: Lq/Lk lengths, bq/bk a tile's queries/keys, nq = ceil(Lq / bq), nk = ceil(Lk / bk) tiles.

A mask function is called once with :class:`Span` objects in place of its index tensors: ``q_idx`` is the
span ``[q0, q1]`` of each query tile (nq, 1), ``kv_idx`` that of each key tile (1, nk), ``b`` and ``h`` every
batch row and head. Arithmetic on spans gives spans that hold every value the expression can take on the
tile (interval arithmetic: ``a - b`` is ``[a.lo - b.hi, a.hi - b.lo]``, ...), and a comparison gives a
:class:`Maybe`: whether it *can* be true and whether it *can* be false somewhere on the tile. So the
result says per tile: surely nothing allowed (never computed), surely everything allowed (computed with no
mask at all), or partial (the function is evaluated on that tile). Interval arithmetic only ever widens,
so a tile with an allowed pair is never called empty and a tile with a forbidden pair never full
(``tests/test_block_structure.py`` checks it with hypothesis). The cost is a few operations on (nq, nk)
tensors: nothing of size (Lq, Lk).

Supported: ``+ - *``, ``//`` and ``%`` by a positive int, unary ``-``, ``abs``, ``clamp``,
``minimum``/``maximum``, comparisons, ``& | ^ ~`` and ``torch.where``, and indexing a captured 1-D tensor
(or an n-D one whose other indices are the same on every tile, e.g. ``ids[b, q_idx]``) by a span.
Anything else (``.item()``, ``if`` on an index, reductions, ...) raises :class:`Unsupported`, and the
caller falls back to evaluating the function on every tile.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

__all__ = ["Maybe", "Span", "Unsupported", "tile_bounds"]


class Unsupported(Exception):
    """The function did something spans cannot bound."""


def _const(x: object) -> Span | Maybe:
    if isinstance(x, (Span, Maybe)):
        return x
    if isinstance(x, bool) or (isinstance(x, Tensor) and x.dtype == torch.bool):
        t = torch.as_tensor(x)
        return Maybe(t, ~t)
    if isinstance(x, int) or (isinstance(x, Tensor) and not x.is_floating_point() and not x.is_complex()):
        t = torch.as_tensor(x, dtype=torch.int64)
        return Span(t, t)
    raise Unsupported(f"a {type(x).__name__} operand")


def _span(x: object) -> Span:
    s = _const(x)
    if not isinstance(s, Span):
        raise Unsupported("a bool where an integer was expected")
    return s


def _maybe(x: object) -> Maybe:
    m = _const(x)
    if not isinstance(m, Maybe):
        raise Unsupported("an integer where a bool was expected")
    return m


def _positive_int(x: object) -> int:
    if isinstance(x, Tensor) and x.dim() == 0 and not x.is_floating_point():
        x = int(x)
    if isinstance(x, bool) or not isinstance(x, int) or x <= 0:
        raise Unsupported(f"division by {x!r}")
    return x


class Maybe:
    """A bool expression over a tile: ``can_true`` / ``can_false``, bool tensors broadcastable to (nq, nk)."""

    def __init__(self, can_true: Tensor, can_false: Tensor) -> None:
        self.can_true, self.can_false = can_true, can_false

    @classmethod
    def __torch_function__(
        cls, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        return _dispatch(func, args, kwargs or {})

    def __and__(self, other: object) -> Maybe:
        o = _maybe(other)
        return Maybe(self.can_true & o.can_true, self.can_false | o.can_false)

    def __or__(self, other: object) -> Maybe:
        o = _maybe(other)
        return Maybe(self.can_true | o.can_true, self.can_false & o.can_false)

    def __xor__(self, other: object) -> Maybe:
        o = _maybe(other)
        return Maybe(
            (self.can_true & o.can_false) | (self.can_false & o.can_true),
            (self.can_true & o.can_true) | (self.can_false & o.can_false),
        )

    __rand__, __ror__, __rxor__ = __and__, __or__, __xor__

    def __invert__(self) -> Maybe:
        return Maybe(self.can_false, self.can_true)

    def __eq__(self, other: object) -> Maybe:  # type: ignore[override]
        return ~(self ^ other)

    def __ne__(self, other: object) -> Maybe:  # type: ignore[override]
        return self ^ other

    def __bool__(self) -> bool:
        raise Unsupported("Python control flow on a mask value")

    __hash__ = None  # type: ignore[assignment]


class Span:
    """An integer expression over a tile: every value lies in ``[lo, hi]``, int64 tensors broadcastable to
    (nq, nk)."""

    def __init__(self, lo: Tensor, hi: Tensor) -> None:
        self.lo, self.hi = lo, hi

    @classmethod
    def __torch_function__(
        cls, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        return _dispatch(func, args, kwargs or {})

    def __add__(self, other: object) -> Span:
        o = _span(other)
        return Span(self.lo + o.lo, self.hi + o.hi)

    __radd__ = __add__

    def __sub__(self, other: object) -> Span:
        o = _span(other)
        return Span(self.lo - o.hi, self.hi - o.lo)

    def __rsub__(self, other: object) -> Span:
        return _span(other) - self

    def __neg__(self) -> Span:
        return Span(-self.hi, -self.lo)

    def __mul__(self, other: object) -> Span:
        o = _span(other)
        products = (self.lo * o.lo, self.lo * o.hi, self.hi * o.lo, self.hi * o.hi)
        lo = hi = products[0]
        for p in products[1:]:
            lo, hi = torch.minimum(lo, p), torch.maximum(hi, p)
        return Span(lo, hi)

    __rmul__ = __mul__

    def __floordiv__(self, other: object) -> Span:
        c = _positive_int(other)
        return Span(
            torch.div(self.lo, c, rounding_mode="floor"), torch.div(self.hi, c, rounding_mode="floor")
        )

    def __mod__(self, other: object) -> Span:
        c = _positive_int(other)
        same = torch.div(self.lo, c, rounding_mode="floor") == torch.div(self.hi, c, rounding_mode="floor")
        zero = torch.zeros((), dtype=torch.int64)
        return Span(torch.where(same, self.lo % c, zero), torch.where(same, self.hi % c, zero + c - 1))

    def abs(self) -> Span:
        lo = torch.where(self.lo >= 0, self.lo, torch.where(self.hi <= 0, -self.hi, 0))
        return Span(lo, torch.maximum(self.hi, -self.lo))

    __abs__ = abs

    def clamp(self, min: object = None, max: object = None) -> Span:  # noqa: A002 (torch's names)
        out = self
        if min is not None:
            m = _span(min)
            out = Span(torch.maximum(out.lo, m.lo), torch.maximum(out.hi, m.hi))
        if max is not None:
            m = _span(max)
            out = Span(torch.minimum(out.lo, m.lo), torch.minimum(out.hi, m.hi))
        return out

    clip = clamp

    def _compare(self, other: object) -> Span:
        return self - _span(other)  # the sign of self - other decides every comparison

    def __lt__(self, other: object) -> Maybe:
        d = self._compare(other)
        return Maybe(d.lo < 0, d.hi >= 0)

    def __le__(self, other: object) -> Maybe:
        d = self._compare(other)
        return Maybe(d.lo <= 0, d.hi > 0)

    def __gt__(self, other: object) -> Maybe:
        d = self._compare(other)
        return Maybe(d.hi > 0, d.lo <= 0)

    def __ge__(self, other: object) -> Maybe:
        d = self._compare(other)
        return Maybe(d.hi >= 0, d.lo < 0)

    def __eq__(self, other: object) -> Maybe:  # type: ignore[override]
        d = self._compare(other)
        return Maybe((d.lo <= 0) & (d.hi >= 0), (d.lo != 0) | (d.hi != 0))

    def __ne__(self, other: object) -> Maybe:  # type: ignore[override]
        return ~(self == other)

    def __bool__(self) -> bool:
        raise Unsupported("Python control flow on an index")

    def __index__(self) -> int:
        raise Unsupported("an index used as a Python int")

    __hash__ = None  # type: ignore[assignment]

    @property
    def uniform(self) -> bool:
        """The same range on every tile (``b`` and ``h`` are)."""
        return bool((self.lo == self.lo.flatten()[0]).all() and (self.hi == self.hi.flatten()[0]).all())


def _where(cond: object, a: object, b: object) -> Span | Maybe:
    c = _maybe(cond)
    both, only_a = c.can_true & c.can_false, c.can_true & ~c.can_false
    x, y = _const(a), _const(b)
    if isinstance(x, Span) and isinstance(y, Span):
        lo = torch.where(both, torch.minimum(x.lo, y.lo), torch.where(only_a, x.lo, y.lo))
        hi = torch.where(both, torch.maximum(x.hi, y.hi), torch.where(only_a, x.hi, y.hi))
        return Span(lo, hi)
    if isinstance(x, Maybe) and isinstance(y, Maybe):
        t = torch.where(both, x.can_true | y.can_true, torch.where(only_a, x.can_true, y.can_true))
        f = torch.where(both, x.can_false | y.can_false, torch.where(only_a, x.can_false, y.can_false))
        return Maybe(t, f)
    raise Unsupported("torch.where over an integer and a bool")


def _minmax(fn: Callable[[Tensor, Tensor], Tensor]) -> Callable[[object, object], Span]:
    def both(a: object, b: object) -> Span:
        x, y = _span(a), _span(b)
        return Span(fn(x.lo, y.lo), fn(x.hi, y.hi))

    return both


def _range_reduce(table: Tensor, lo: Tensor, hi: Tensor) -> tuple[Tensor, Tensor]:
    """min and max of the 1-D ``table`` over ``[lo, hi]`` for every element of lo/hi (any shape)."""
    if bool((lo < 0).any()) or bool((hi >= table.shape[0]).any()):
        raise Unsupported("an index that may fall outside the captured tensor")
    flat_lo, flat_hi = lo.flatten().tolist(), hi.flatten().tolist()
    mins, maxs = {}, {}
    for a, z in set(zip(flat_lo, flat_hi, strict=True)):
        piece = table[a : z + 1]
        mins[(a, z)], maxs[(a, z)] = piece.min(), piece.max()
    pairs = list(zip(flat_lo, flat_hi, strict=True))
    return (
        torch.stack([mins[p] for p in pairs]).view(lo.shape),
        torch.stack([maxs[p] for p in pairs]).view(lo.shape),
    )


def _index(table: Tensor, index: object) -> Span | Maybe:
    """``table[index]``: a captured tensor read at spans (at most one varying from tile to tile)."""
    items = index if isinstance(index, tuple) else (index,)
    if len(items) != table.dim() or table.is_floating_point() or table.is_complex():
        raise Unsupported("indexing other than an integer or bool tensor with one index per dimension")
    spans = [_span(i) for i in items]
    varying = [d for d, s in enumerate(spans) if not s.uniform]
    if len(varying) > 1:
        raise Unsupported("indexing with two indices that vary from tile to tile")
    t = table.long() if table.dtype == torch.bool else table
    for d in reversed(range(t.dim())):  # reduce every uniform index over its (one) range
        if d in varying:
            continue
        a, z = int(spans[d].lo.flatten()[0]), int(spans[d].hi.flatten()[0])
        if a < 0 or z >= t.shape[d]:
            raise Unsupported("an index that may fall outside the captured tensor")
        piece = t.narrow(d, a, z - a + 1)
        t = torch.stack([piece.amin(dim=d), piece.amax(dim=d)], dim=d)  # low and high along d
    # now t's uniform dims hold (min, max) pairs; reduce them into one min and max table
    lo_t, hi_t = t, t
    for d in reversed(range(t.dim())):
        if d not in varying:
            lo_t, hi_t = lo_t.amin(dim=d), hi_t.amax(dim=d)
    if varying:
        s = spans[varying[0]]
        lo, _ = _range_reduce(lo_t, s.lo, s.hi)
        _, hi = _range_reduce(hi_t, s.lo, s.hi)
    else:
        lo, hi = lo_t, hi_t
    if table.dtype == torch.bool:
        return Maybe(hi.bool(), ~lo.bool())
    return Span(lo, hi)


def _dispatch(func: Callable, args: tuple, kwargs: dict) -> Any:
    if func is Tensor.__getitem__ and isinstance(args[0], Tensor):
        return _index(args[0], args[1])
    table: dict[Callable, Callable[..., Any]] = {
        torch.where: _where,
        torch.minimum: _minmax(torch.minimum),
        torch.maximum: _minmax(torch.maximum),
        torch.abs: lambda x: _span(x).abs(),
        Tensor.abs: lambda x: _span(x).abs(),
        torch.clamp: lambda x, min=None, max=None: _span(x).clamp(min, max),  # noqa: A006
        Tensor.clamp: lambda x, min=None, max=None: _span(x).clamp(min, max),  # noqa: A006
        torch.logical_and: lambda a, b: _maybe(a) & b,
        torch.logical_or: lambda a, b: _maybe(a) | b,
        torch.logical_not: lambda a: ~_maybe(a),
        torch.logical_xor: lambda a, b: _maybe(a) ^ b,
        Tensor.__and__: lambda a, b: _maybe(a) & b,
        Tensor.__or__: lambda a, b: _maybe(a) | b,
        Tensor.__xor__: lambda a, b: _maybe(a) ^ b,
        Tensor.__rand__: lambda a, b: _maybe(a) & b,
        Tensor.__ror__: lambda a, b: _maybe(a) | b,
        Tensor.__add__: lambda a, b: _span(a) + b,
        Tensor.__radd__: lambda a, b: _span(a) + b,
        Tensor.__sub__: lambda a, b: _span(a) - b,
        Tensor.__rsub__: lambda a, b: _span(b) - a,
        Tensor.__mul__: lambda a, b: _span(a) * b,
        Tensor.__rmul__: lambda a, b: _span(a) * b,
        Tensor.__lt__: lambda a, b: _span(a) < b,
        Tensor.__le__: lambda a, b: _span(a) <= b,
        Tensor.__gt__: lambda a, b: _span(a) > b,
        Tensor.__ge__: lambda a, b: _span(a) >= b,
        Tensor.__eq__: lambda a, b: _const(a) == b,
        Tensor.__ne__: lambda a, b: _const(a) != b,
    }
    if func is torch.div and kwargs.get("rounding_mode") == "floor":
        return _span(args[0]) // args[1]
    if func in (torch.remainder, Tensor.__mod__, Tensor.remainder):
        return _span(args[0]) % args[1]
    if func is Tensor.__floordiv__:
        return _span(args[0]) // args[1]
    handler = table.get(func)
    if handler is None:
        raise Unsupported(f"{getattr(func, '__name__', func)}")
    return handler(*args, **kwargs)


def tile_bounds(
    fn: Callable[..., object], batch: int, heads: int, queries: Tensor, keys: Tensor
) -> tuple[Tensor, Tensor]:
    """``(can_allow, can_forbid)`` bool (nq, nk) of the mask function ``fn`` over tiles: the tiles' query
    spans ``queries`` (nq, 2) and key spans ``keys`` (nk, 2) (inclusive [first, last] indices), for any batch
    row in [0, batch) and head in [0, heads). Raises :class:`Unsupported` (or the function's own error)
    when ``fn`` cannot be bounded this way."""
    b = Span(torch.tensor(0), torch.tensor(batch - 1))
    h = Span(torch.tensor(0), torch.tensor(heads - 1))
    q = Span(queries[:, :1], queries[:, 1:])  # (nq, 1)
    kv = Span(keys[:, 0].view(1, -1), keys[:, 1].view(1, -1))  # (1, nk)
    out = fn(b, h, q, kv)
    if isinstance(out, Tensor) and out.dtype == torch.bool and out.numel() == 1:
        out = _maybe(out.reshape(()))
    if not isinstance(out, Maybe):
        raise Unsupported(f"the function returned {type(out).__name__}, not a bool expression")
    shape = (queries.shape[0], keys.shape[0])
    return out.can_true.expand(shape), out.can_false.expand(shape)
