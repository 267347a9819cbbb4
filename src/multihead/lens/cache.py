"""Caching the points of every attention call: :func:`cache` and the :class:`Cache` it fills.

Dimensions: N modules, B batch, H query heads, Hkv key/value heads, Lq/Lk lengths, D head dim, O output width.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch
from torch import Tensor, nn

from .sites import Context, ModuleSelection, check_points, select, tapping

_KEY_POINTS = ("k", "v")
_PAD = {"scores": float("-inf"), "pattern": 0.0}  # what an earlier (shorter) call's missing keys hold


class Cache:
    """The tensors a :func:`cache` block kept: ``c[name, point]``, ``c.calls(name, point)``, ``c.stack(point)``.

    Only what was asked is kept, detached from autograd, on the device it was computed on, in its own dtype.
    A module called several times in the block (decoding with a KV cache; a layer shared across depth):

    * ``c.calls(name, point)``: every call's tensor, in order;
    * ``c[name, point]``: one call's tensor as it is; several calls joined along the queries (dim 2), as
      :func:`multihead.viz.capture` does (scores and pattern of earlier calls padded on the right to the longest
      call's keys, with -inf and 0); for ``"k"`` and ``"v"`` the last call's, when each call's keys extend the
      previous call's (a KV cache: the last covers every key), else refused.
    """

    def __init__(self) -> None:
        self._kept: dict[tuple[str, str], list[Tensor]] = {}
        self._order: dict[str, None] = {}  # module names in the order they first ran

    def keep(self, tensor: Tensor, ctx: Context) -> None:
        """The handler of every cached site (k and v are copied: a cache may write its buffers in place)."""
        kept = tensor.detach()
        if ctx.point in _KEY_POINTS:
            kept = kept.clone()
        self._order.setdefault(ctx.name)
        self._kept.setdefault((ctx.name, ctx.point), []).append(kept)

    def names(self) -> list[str]:
        """Modules that ran inside the block, in the order they first ran."""
        return list(self._order)

    def keys(self) -> list[tuple[str, str]]:
        """Every ``(name, point)`` held."""
        return list(self._kept)

    def __contains__(self, key: object) -> bool:
        return key in self._kept

    def nbytes(self) -> int:
        """Bytes held by the kept tensors (what the cache costs in memory)."""
        return sum(t.numel() * t.element_size() for calls in self._kept.values() for t in calls)

    def calls(self, name: str, point: str) -> list[Tensor]:
        """Every call's tensor of ``point`` of module ``name``, in call order."""
        found = self._kept.get((name, point))
        if found is None:
            have = sorted({p for _, p in self._kept}) or "nothing"
            raise KeyError(
                f"nothing cached for ({name!r}, {point!r}); modules that ran: {self.names()}, points: {have}"
            )
        return found

    def __getitem__(self, key: tuple[str, str]) -> Tensor:
        if not (isinstance(key, tuple) and len(key) == 2):
            raise TypeError(f"index a Cache with (name, point), e.g. c['layers.0.attn', 'z'], got {key!r}")
        name, point = key
        parts = self.calls(name, point)
        if len(parts) == 1:
            return parts[0]
        if point in _KEY_POINTS:
            return _last_of_growing(parts, name, point)
        return _join_queries(parts, name, point)

    def stack(self, point: str) -> Tensor:
        """``point`` of every module that ran, in run order, stacked: (N, ...) where the shapes agree."""
        parts = [(name, self[name, point]) for name in self.names() if (name, point) in self._kept]
        if not parts:
            raise KeyError(f"no module has {point!r} cached; cached: {self.keys()}")
        shapes = {tuple(t.shape) for _, t in parts}
        if len(shapes) > 1:
            listed = ", ".join(f"{name!r}: {tuple(t.shape)}" for name, t in parts)
            raise ValueError(
                f"cannot stack {point!r}: the modules' shapes differ ({listed}); index them one by one, "
                f"c[name, {point!r}]"
            )
        return torch.stack([t for _, t in parts])

    def _repr_html_(self) -> str | None:
        """Drawn in a notebook by :func:`multihead.viz.show`."""
        from ..viz.show import show

        return show(self)._repr_html_()

    def _repr_png_(self) -> bytes | None:
        from ..viz.show import show

        return show(self)._repr_png_()


def _last_of_growing(parts: list[Tensor], name: str, point: str) -> Tensor:
    """k or v of several calls: the last one, when the keys grow call after call (a KV cache)."""
    lengths = [t.shape[2] for t in parts]
    if all(a < b for a, b in zip(lengths, lengths[1:])):
        return parts[-1]
    raise ValueError(
        f"{name!r} was called {len(parts)} times with keys of lengths {lengths}, not a growing KV cache: read "
        f"each call's {point!r} with c.calls({name!r}, {point!r})"
    )


def _join_queries(parts: list[Tensor], name: str, point: str) -> Tensor:
    """Several calls joined along the queries (dim 2); scores/pattern padded on the right to the longest keys."""
    if len({(t.shape[:2], t.shape[3:] if point not in _PAD else ()) for t in parts}) > 1:
        raise ValueError(
            f"the calls of {name!r} differ in shape ({[tuple(t.shape) for t in parts]}) and cannot be joined "
            f"along the queries; read them with c.calls({name!r}, {point!r})"
        )
    if point in _PAD:
        lk = max(t.shape[-1] for t in parts)
        parts = [torch.nn.functional.pad(t, (0, lk - t.shape[-1]), value=_PAD[point]) for t in parts]
    return torch.cat(parts, dim=2)  # (B, H, sum of Lq, ...)


@contextmanager
def cache(
    model: nn.Module, points: Iterable[str] | str = ("pattern", "z"), modules: ModuleSelection = None
) -> Iterator[Cache]:
    """Keep ``points`` of the attention modules ``modules`` (names, a predicate on the name, or None: all) while
    the block runs::

        with lens.cache(model, points=("pattern", "z")) as c:
            model(x)
        c["layers.0.attn", "pattern"]   # (B, H, Lq, Lk)
        c.stack("z")                    # (N modules, B, H, Lq, Dv)

    Points (see :mod:`multihead.lens`): q (B, H, Lq, Dk), k/v (B, Hkv, Lk, D), scores/pattern (B, H, Lq, Lk),
    z (B, H, Lq, Dv), result (B, H, Lq, O). Only the modules asked change path, and only as far as the points
    need: q, k, v and z keep the module's own backend; pattern alone comes from the weights the attention function
    returns; scores take the explicit path (:func:`multihead.attention_reference`'s formulation). Composes with
    every other inspector (capture, head masks, importance gates, hooks) in any nesting.
    """
    chosen = check_points(points)
    names = select(model, modules)
    out = Cache()
    sites = {name: dict.fromkeys(chosen, out.keep) for name in names}
    with tapping(model, sites, pattern_from_weights="scores" not in chosen):
        yield out
