"""Where the lens reads and writes: the points of every attention call, and the one inspector serving them.

Dimensions: B batch, H query heads, Hkv key/value heads, Lq/Lk lengths, Dk/Dv head dims, O the output
projection's width (E for a self-attention block).

A *site* is one point of one attention module, ``(name, point)``; a lens block gives each site a handler
``fn(tensor, ctx) -> replacement or None``. :class:`Tap` is the :class:`~multihead.nn.seam.Inspector` that calls
them: q, k, v, scores and pattern through the seam's points (asked of the named modules only, so every other
module keeps its fast path), z through ``on_heads``, and result through a forward hook on the module's output
projection, installed for the block only.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from ..heads.naming import Projection, _names_hint, attention_modules, check_routed, output_projection
from ..nn import seam
from ..nn.attention import merge_heads

POINTS = ("q", "k", "v", "scores", "pattern", "z", "result")
"""Every point of an attention call, in the order a call reaches them."""

HEAD_POINTS = ("q", "scores", "pattern", "z", "result")
"""Points whose dim 1 is the H query heads (``"k"`` and ``"v"`` have Hkv heads)."""

_NONE: frozenset[str] = frozenset()


@dataclass(frozen=True)
class Context:
    """What a handler is told: the module's ``name`` in the model, the ``point``, the ``module`` itself, and
    ``call``, the index of this call of the module inside the block (0, 1, ... when decoding with a cache)."""

    name: str
    point: str
    module: nn.Module
    call: int


Handler = Callable[[Tensor, Context], Tensor | None]
"""``fn(tensor, ctx) -> replacement of the same shape, or None to leave the tensor as it is``."""

ModuleSelection = Iterable[str] | Callable[[str], bool] | None
"""Which attention modules: names, a predicate on the name, or None for all of them."""


def check_points(points: Iterable[str] | str, *, argument: str = "points") -> tuple[str, ...]:
    """``points`` as a tuple of known points (a single string is one point); unknown ones refused by name."""
    if not isinstance(points, (str, Iterable)):
        raise TypeError(
            f"{argument} must be a point name or names from {POINTS}, got {type(points).__name__}"
        )
    chosen = (points,) if isinstance(points, str) else tuple(points)
    for point in chosen:
        if point not in POINTS:
            raise ValueError(f"{argument} names {point!r}, which is not a point; the points are {POINTS}")
    if not chosen:
        raise ValueError(f"{argument} is empty: name at least one of {POINTS}")
    return tuple(dict.fromkeys(chosen))


def select(model: nn.Module, modules: ModuleSelection, *, argument: str = "modules") -> list[str]:
    """The names of ``model``'s attention modules that ``modules`` picks, in module order."""
    found = attention_modules(model)
    if not found:
        raise ValueError(
            f"{type(model).__name__} has no attention module multihead can see (MultiHeadAttention, a converted "
            f"torch model, the d2l drop-in, or a Hugging Face model on attn_implementation='multihead')"
        )
    if modules is None:
        return list(found)
    if callable(modules):
        return [name for name in found if modules(name)]
    if isinstance(modules, str):
        modules = [modules]
    if not isinstance(modules, Iterable):
        raise TypeError(
            f"{argument} must be module names, a predicate on the name, or None (all), got {type(modules).__name__}"
        )
    names = list(modules)
    for name in names:
        check_name(found, name, argument=argument)
    return [name for name in found if name in set(names)]


def check_name(found: Mapping[str, nn.Module], name: object, *, argument: str) -> None:
    """Refuse a name that is not an attention module of the model, listing the names."""
    if name not in found:
        raise ValueError(
            f"{argument} names {name!r}, which is not an attention module of this model; names: "
            f"{_names_hint(found)}"
        )


def head_results(merged: Tensor, projection: Projection, heads: int) -> Tensor:
    """Each head's share of the output projection: merged z (B, Lq, H*Dv) -> (B, H, Lq, O), no bias.

    ``result[:, h] = z_h @ W[:, h*Dv:(h+1)*Dv].T``, so ``result.sum(1) + bias`` is the projection's output.
    """
    b, lq, width = merged.shape
    weight = projection.weight()  # (O, H*Dv)
    z = merged.view(b, lq, heads, width // heads)  # (B, Lq, H, Dv)
    w = weight.view(weight.shape[0], heads, width // heads)  # (O, H, Dv)
    return torch.einsum("blhd,ohd->bhlo", z, w.to(z.dtype))  # (B, H, Lq, O)


class Tap(seam.Inspector):
    """Calls each site's handler; built by :func:`tapping` (``sites``: ``{name: {point: handler}}``).

    ``pattern_from_weights``: a handler of ``"pattern"`` only reads (a cache), so the pattern is taken from the
    weights the module's attention function returns (``return_weights``) instead of the explicit path.
    """

    def __init__(
        self,
        model: nn.Module,
        sites: Mapping[str, Mapping[str, Handler]],
        *,
        pattern_from_weights: bool = False,
        found: Mapping[str, nn.Module] | None = None,
    ) -> None:
        found = attention_modules(model) if found is None else found
        for name in sites:
            check_name(found, name, argument="sites")
        self.names = {found[name]: name for name in sites}
        self.handlers = {found[name]: dict(points) for name, points in sites.items()}
        by_weights = {m for m, h in self.handlers.items() if pattern_from_weights and "pattern" in h}
        self._points = {
            m: frozenset(p for p in h if p in seam.POINTS and not (p == "pattern" and m in by_weights))
            for m, h in self.handlers.items()
        }
        self._weights = by_weights
        self.points = frozenset().union(*self._points.values())
        self.calls = dict.fromkeys(self.handlers, 0)
        self.pending: dict[nn.Module, tuple[Tensor, int]] = {}  # module -> (z (B, H, Lq, Dv), call)
        self.projections = {
            m: self._projection(model, self.names[m], m) for m, h in self.handlers.items() if "result" in h
        }

    @staticmethod
    def _projection(model: nn.Module, name: str, module: nn.Module) -> Projection:
        projection = output_projection(model, name, module)
        if projection is None:
            raise ValueError(
                f"the point 'result' of {name!r} cannot be read: multihead does not know the output projection "
                f"of a {type(module).__name__} (its head family gives none); ask for 'z' there, or give the "
                f"family an output_projection(model, name, module) method"
            )
        return projection

    def points_for(self, module: nn.Module) -> frozenset[str]:
        return self._points.get(module, _NONE)

    def weights_for(self, module: nn.Module) -> bool:
        return module in self._weights

    def _apply(self, module: nn.Module, point: str, tensor: Tensor, call: int) -> Tensor | None:
        ctx = Context(self.names[module], point, module, call)
        new = self.handlers[module][point](tensor, ctx)
        if new is None:
            return None
        if not isinstance(new, Tensor):
            raise TypeError(
                f"handlers[({ctx.name!r}, {point!r})] returned {type(new).__name__}; it must return a tensor of "
                f"shape {tuple(tensor.shape)} and dtype {tensor.dtype}, or None to leave the point as it is"
            )
        if new.shape != tensor.shape or new.dtype != tensor.dtype or new.device != tensor.device:
            raise ValueError(
                f"handlers[({ctx.name!r}, {point!r})] returned a {new.dtype} tensor of shape {tuple(new.shape)} on "
                f"{new.device}; it must keep the shape {tuple(tensor.shape)}, dtype {tensor.dtype} and device "
                f"{tensor.device} of the tensor it replaces (convert with .to(tensor.dtype))"
            )
        return new

    def on_point(self, module: nn.Module, point: str, tensor: Tensor) -> Tensor | None:
        return self._apply(module, point, tensor, self.calls[module])

    def on_heads(self, module: nn.Module, heads: Tensor, weights: Tensor | None) -> Tensor:
        handlers = self.handlers.get(module)
        if handlers is None:
            return heads
        call = self.calls[module]
        if module in self._weights and weights is not None:
            self._apply(module, "pattern", weights, call)  # a reading handler: its answer is None
        if "z" in handlers:
            new = self._apply(module, "z", heads, call)
            heads = heads if new is None else new  # (B, H, Lq, Dv)
        if "result" in handlers:
            self.pending[module] = (heads, call)
        self.calls[module] = call + 1
        return heads

    def result_hook(self, module: nn.Module) -> Callable[..., Tensor | None]:
        """The forward hook of ``module``'s output projection: reads (and maybe replaces) each head's result."""
        projection = self.projections[module]

        def hook(layer: nn.Module, inputs: tuple[Any, ...], output: Tensor) -> Tensor | None:
            pending = self.pending.pop(module, None)
            if pending is None:  # the layer ran outside a call of its attention module
                return None
            heads, call = pending  # (B, H, Lq, Dv)
            merged = inputs[0]  # (B, Lq, H*Dv)
            self._check_fed(module, heads, merged)
            new = self._apply(module, "result", head_results(merged, projection, heads.shape[1]), call)
            if new is None:
                return None
            bias = projection.bias()
            out = new.sum(1)  # (B, Lq, O)
            return (out if bias is None else out + bias).to(output.dtype)

        return hook

    def _check_fed(self, module: nn.Module, heads: Tensor, merged: object) -> None:
        """Refuse by name an output projection that is not fed the merged heads (then results would lie)."""
        b, h, lq, dv = heads.shape
        fed = isinstance(merged, Tensor) and merged.shape == (b, lq, h * dv)
        stack = seam.active()
        inner = stack.index(self) < len(stack) - 1 if self in stack else False  # they may change the heads
        if fed and not inner:
            fed = torch.equal(merged, merge_heads(heads))  # type: ignore[arg-type]
        if not fed:
            got = tuple(merged.shape) if isinstance(merged, Tensor) else type(merged).__name__
            raise ValueError(
                f"the point 'result' of {self.names[module]!r} cannot be read: its output projection is fed "
                f"{got}, not the merged heads (B, Lq, H*Dv) = {(b, lq, h * dv)} (a {type(module).__name__} that "
                f"transforms them in between); ask for 'z' there"
            )


@contextmanager
def tapping(
    model: nn.Module,
    sites: Mapping[str, Mapping[str, Handler]],
    *,
    pattern_from_weights: bool = False,
    found: Mapping[str, nn.Module] | None = None,
) -> Iterator[Tap]:
    """Serve ``sites`` (``{name: {point: handler}}``) while the block runs; nothing is left after it.

    ``found``: ``attention_modules(model)``, from a caller that opens many blocks on one model (patching) and
    has checked it (:func:`~multihead.heads.naming.check_routed`) once.
    """
    if found is None:
        check_routed(model)
    tap = Tap(model, sites, pattern_from_weights=pattern_from_weights, found=found)
    handles = [
        projection.module.register_forward_hook(tap.result_hook(m))
        for m, projection in tap.projections.items()
    ]
    try:
        with seam.inspecting(tap):
            yield tap
    finally:
        for handle in handles:
            handle.remove()


def run(model: nn.Module, inputs: object) -> Any:
    """``model(**inputs)`` for a mapping of keyword inputs, ``model(*inputs)`` for a tuple, else ``model(inputs)``."""
    if isinstance(inputs, Mapping):
        return model(**inputs)
    if isinstance(inputs, tuple):
        return model(*inputs)
    return model(inputs)
