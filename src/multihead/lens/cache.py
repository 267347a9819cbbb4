"""Caching the points of every attention call: :func:`cache` and the :class:`Cache` it fills.

Dimensions: N modules, B batch, H query heads, Hkv key/value heads, Lq/Lk lengths, D head dim, O output width.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
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

    def __init__(self, *, grads: bool = False) -> None:
        self._kept: dict[tuple[str, str], list[Tensor]] = {}
        self._order: dict[str, None] = {}  # module names in the order they first ran
        self._grads: dict[tuple[str, str], list[Tensor | None]] | None = {} if grads else None
        self._backward = False  # whether a backward pass reached any kept point

    def keep(self, tensor: Tensor, ctx: Context) -> Tensor | None:
        """The handler of every cached site (k and v are copied: a cache may write its buffers in place).

        With gradients kept, the site's tensor gets a hook storing what the backward pass delivers to it, and
        ``"result"`` is handed back as its own replacement (so the output projection's output is the sum of the
        heads' results, and the gradient flows through them)."""
        kept = tensor.detach()
        if ctx.point in _KEY_POINTS:
            kept = kept.clone()
        self._order.setdefault(ctx.name)
        self._kept.setdefault((ctx.name, ctx.point), []).append(kept)
        if self._grads is None:
            return None
        slots = self._grads.setdefault((ctx.name, ctx.point), [])
        slots.append(None)
        if tensor.requires_grad:
            tensor.register_hook(self._grad_hook(slots, len(slots) - 1))
        return tensor if ctx.point == "result" else None

    def _grad_hook(self, slots: list[Tensor | None], call: int) -> Callable[[Tensor], None]:
        def hook(grad: Tensor) -> None:
            self._backward = True
            held = slots[call]
            slots[call] = grad.detach().clone() if held is None else held + grad.detach()

        return hook

    def grad(self, name: str, point: str) -> Tensor:
        """What the backward pass(es) run inside or after the block delivered to ``point`` of module ``name``:
        the gradient of what ``backward()`` differentiated with respect to it (summed over backward passes), in
        the point's shape (several calls joined as :meth:`__getitem__` joins them; 0 where the backward did not
        reach a call)."""
        if self._grads is None:
            raise ValueError(
                "this cache keeps no gradients: open it with lens.cache(model, points, grads=True) and call "
                "backward() on what the block computed"
            )
        self.calls(name, point)  # refuses, by name, a site that was not cached
        if not self._backward:
            raise ValueError(
                f"no backward pass has reached the cached points yet (grad of ({name!r}, {point!r})): call "
                f"backward() on a value computed from the model's output (with gradients enabled, not under "
                f"torch.no_grad())"
            )
        values = self._kept[name, point]
        grads = [torch.zeros_like(v) if g is None else g for v, g in zip(values, self._grads[name, point])]
        if len(grads) == 1:
            return grads[0]
        if point in _KEY_POINTS:
            return _last_of_growing(grads, name, point)
        return _join_queries([g.nan_to_num() for g in grads], name, point, pad=0.0)

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


def _join_queries(parts: list[Tensor], name: str, point: str, pad: float | None = None) -> Tensor:
    """Several calls joined along the queries (dim 2); scores/pattern padded on the right to the longest keys
    (with ``pad``, default -inf for scores and 0 for the pattern)."""
    if len({(t.shape[:2], t.shape[3:] if point not in _PAD else ()) for t in parts}) > 1:
        raise ValueError(
            f"the calls of {name!r} differ in shape ({[tuple(t.shape) for t in parts]}) and cannot be joined "
            f"along the queries; read them with c.calls({name!r}, {point!r})"
        )
    if point in _PAD:
        lk = max(t.shape[-1] for t in parts)
        fill = _PAD[point] if pad is None else pad
        parts = [torch.nn.functional.pad(t, (0, lk - t.shape[-1]), value=fill) for t in parts]
    return torch.cat(parts, dim=2)  # (B, H, sum of Lq, ...)


@contextmanager
def cache(
    model: nn.Module,
    points: Iterable[str] | str = ("pattern", "z"),
    modules: ModuleSelection = None,
    grads: bool = False,
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

    ``grads=True`` also keeps the gradient each point receives in a backward pass run inside or after the
    block: ``c.grad(name, point)``, in the point's shape::

        with lens.cache(model, points=("z", "pattern"), grads=True) as c:
            metric(model(x)).sum().backward()
        c.grad("layers.0.attn", "z")    # (B, H, Lq, Dv)

    Then the pattern takes the explicit path (the weights a fused kernel returns carry no gradient), and the
    projection's output is rebuilt from the heads' results when "result" is cached (so gradients reach them).
    """
    if not isinstance(grads, bool):
        raise TypeError(f"grads must be True or False, got {type(grads).__name__}")
    chosen = check_points(points)
    names = select(model, modules)
    out = Cache(grads=grads)
    sites = {name: dict.fromkeys(chosen, out.keep) for name in names}
    with tapping(model, sites, pattern_from_weights="scores" not in chosen and not grads):
        yield out
