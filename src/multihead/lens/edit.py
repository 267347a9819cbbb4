"""Editing the points: :func:`hooks` (any handler at any site) and :func:`ablate` (heads zeroed, or replaced by
their mean or by a resampled example's output on reference inputs).

Dimensions: B batch, B' reference batch, H query heads, Lq query length, Dv value head dim.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager

import torch
from torch import Tensor, nn

from ..heads.naming import _resolve
from .cache import cache
from .sites import Context, Handler, check_points, run, select, tapping


@contextmanager
def hooks(model: nn.Module, handlers: Mapping[tuple[str, str], Handler]) -> Iterator[nn.Module]:
    """Call ``handlers[(name, point)](tensor, ctx)`` at each site while the block runs; yields ``model``.

    A handler returns a replacement of the same shape (the rest of the forward uses it: an edit of q, k, v,
    scores, pattern or z changes every later point and the module's output exactly as recomputing by hand; an
    edit of result makes the output projection's output ``sum over heads + bias``) or None to only read.
    ``ctx`` has ``.name``, ``.point``, ``.module`` and ``.call``. Example::

        def no_head_0(z, ctx):
            z = z.clone()
            z[:, 0] = 0
            return z

        with lens.hooks(model, {("layers.0.attn", "z"): no_head_0}):
            model(x)
    """
    if not isinstance(handlers, Mapping):
        raise TypeError(f"handlers must be a mapping {{(name, point): fn}}, got {type(handlers).__name__}")
    select(model, None)  # the model has attention modules
    sites: dict[str, dict[str, Handler]] = {}
    for key, fn in handlers.items():
        if not (isinstance(key, tuple) and len(key) == 2):
            raise TypeError(f"handlers' keys must be (module name, point) pairs, got {key!r}")
        name, point = key
        select(model, [name], argument="handlers")
        check_points(point, argument=f"handlers[{key!r}]")
        if not callable(fn):
            raise TypeError(f"handlers[{key!r}] must be a function fn(tensor, ctx), got {type(fn).__name__}")
        sites.setdefault(name, {})[point] = fn
    with tapping(model, sites):
        yield model


# ------------------------------------------------------------------------------------------------
# Ablation: one class per kind
# ------------------------------------------------------------------------------------------------


class Ablation:
    """How an ablated head's output z is replaced. :meth:`prepare` sees the spec (and the reference inputs);
    :meth:`values` gives, for one call, what the heads ``heads`` of module ``name`` output instead."""

    needs_reference = False

    def prepare(self, model: nn.Module, spec: Mapping[str, list[int]], reference: object) -> None:
        """Called once before the block (``reference``: the inputs given, or None)."""

    def values(self, name: str, heads: list[int], z: Tensor) -> Tensor:
        """What heads ``heads`` of ``z`` (B, H, Lq, Dv) become: (B, len(heads), Lq, Dv) or broadcastable."""
        raise NotImplementedError

    def handler(self, spec: Mapping[str, list[int]]) -> Handler:
        """The z handler that writes :meth:`values` into the ablated heads."""

        def ablate_z(z: Tensor, ctx: Context) -> Tensor:
            heads = spec[ctx.name]
            out = z.clone()  # (B, H, Lq, Dv)
            out[:, heads] = self.values(ctx.name, heads, z).to(z.dtype)
            return out

        return ablate_z


class ZeroAblation(Ablation):
    """The heads output 0 (what :func:`multihead.heads.masked` does)."""

    def values(self, name: str, heads: list[int], z: Tensor) -> Tensor:
        return z.new_zeros(())


class _FromReference(Ablation):
    """Ablations made of each head's z on reference inputs (one run of the model on them, z cached)."""

    needs_reference = True

    def prepare(self, model: nn.Module, spec: Mapping[str, list[int]], reference: object) -> None:
        with torch.no_grad(), cache(model, "z", modules=list(spec)) as c:
            run(model, reference)
        missing = [name for name in spec if (name, "z") not in c]
        if missing:
            raise ValueError(
                f"the reference inputs did not run the modules {missing}: nothing to ablate with"
            )
        self.reference = {name: c[name, "z"] for name in spec}  # (B', H, Lq', Dv)


class MeanAblation(_FromReference):
    """Each head outputs its mean z over the reference batch and positions: (Dv,) per head."""

    def values(self, name: str, heads: list[int], z: Tensor) -> Tensor:
        mean = self.reference[name][:, heads].mean(dim=(0, 2))  # (len(heads), Dv)
        return mean[None, :, None, :]  # (1, len(heads), 1, Dv)


class ResampleAblation(_FromReference):
    """Each example's head outputs another example's z: a reference example drawn at random (``seed``) per
    example of the batch, at the same positions (the reference's length must equal the run's)."""

    def __init__(self, seed: int = 0) -> None:
        self.seed = seed

    def values(self, name: str, heads: list[int], z: Tensor) -> Tensor:
        ref = self.reference[name]  # (B', H, Lq', Dv)
        if ref.shape[2] != z.shape[2]:
            raise ValueError(
                f"resample ablation of {name!r}: the reference inputs have {ref.shape[2]} positions, the run "
                f"{z.shape[2]}; give reference inputs of the run's length (or use how='mean')"
            )
        generator = torch.Generator().manual_seed(self.seed)
        picks = torch.randint(ref.shape[0], (z.shape[0],), generator=generator).to(ref.device)  # (B,)
        return ref[picks][:, heads]  # (B, len(heads), Lq, Dv)


ABLATIONS: dict[str, type[Ablation]] = {
    "zero": ZeroAblation,
    "mean": MeanAblation,
    "resample": ResampleAblation,
}
"""``how`` -> its class; an :class:`Ablation` instance may be given instead."""


@contextmanager
def ablate(
    model: nn.Module,
    heads: Mapping[str, Iterable[int]],
    how: str | Ablation = "zero",
    reference: object = None,
) -> Iterator[nn.Module]:
    """Within the block, the listed heads of ``model`` (``{name: [head, ...]}``) are ablated; yields ``model``.

    ``how``: ``"zero"`` (z = 0, as :func:`multihead.heads.masked`), ``"mean"`` (z = the head's mean over the
    reference run's examples and positions) or ``"resample"`` (each example takes a random reference example's
    z, same positions); ``reference``: the model's inputs for that run (a dict of keyword inputs, or a tensor).
    """
    method = ABLATIONS[how]() if isinstance(how, str) and how in ABLATIONS else how
    if not isinstance(method, Ablation):
        raise ValueError(f"how must be one of {sorted(ABLATIONS)} or an Ablation, got {how!r}")
    if method.needs_reference and reference is None:
        raise ValueError(f"how={how!r} needs reference inputs (reference=...): the run its values come from")
    spec = {name: idx for name, idx in _resolve(model, heads).items() if idx}
    method.prepare(model, spec, reference)
    with tapping(model, {name: {"z": method.handler(spec)} for name in spec}):
        yield model
