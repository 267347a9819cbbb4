"""Attribution patching of every head (and position): :func:`attribution_patch`, the first-order estimate of
:func:`~multihead.lens.patch_heads` from one clean forward and one corrupted forward and backward per step.

Dimensions: N modules, B batch, H heads (Hkv for k/v), P positions (queries; keys for k/v), m ``ig_steps``.

For a point a of head h, patching its clean value into the corrupted run moves the metric's batch mean M by
about ``sum((a_clean - a_corrupted) * dM/da)``, the sum over every example, position and component of that
head (and, per position, all but the position). With ``ig_steps=m`` the gradient is the mean of the gradients
at m points of the straight path from the corrupted to the clean input embeddings (:mod:`.path`), as
integrated gradients do (EAP-IG, Hanna et al. 2024). Masked scores (-inf in both runs) contribute 0.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from ..heads.naming import attention_modules
from ..progress import Progress
from .patch import _check_alike, _per_example
from .path import Path, check_steps, steps
from .sites import Context, ModuleSelection, check_points, run, select, tapping


def attribution_patch(
    model: nn.Module,
    clean: object,
    corrupted: object,
    metric: Callable[[Any], Tensor | float],
    *,
    point: str = "z",
    per_position: bool = False,
    modules: ModuleSelection = None,
    ig_steps: int = 1,
    progress: bool | None = None,
) -> Tensor:
    """The first-order estimate of :func:`~multihead.lens.patch_heads`'s answer, same shape and meaning.

    Args:
        model, clean, corrupted, metric, point, per_position, modules: as in :func:`patch_heads` (metric: (B,)
            per example or a scalar; the batch runs at once either way). Points: z (default), q, k/v (by
            key/value head), result, pattern and scores (per query position: summed over the keys).
        ig_steps: m; the gradient averaged over m runs whose input embeddings are
            ``corrupted + k/m * (clean - corrupted)``, k = 0..m-1 (1: plain attribution patching).
        progress: a progress bar on stderr, a step per ig step (default: when ig_steps >= 8).

    Returns:
        effects (N, H) or (N, H, P): ``metric(corrupted) + sum((a_clean - a_corrupted) * g)`` for every head
        (and position), g the gradient of the metric's batch mean at a; NaN where a module has fewer heads.
    """
    (point,) = check_points(point, argument="point")
    m = check_steps(ig_steps)
    names = select(model, modules)
    batch = _check_alike(clean, corrupted)
    path = Path(model, clean, corrupted) if m > 1 else None
    sources = _clean_points(model, clean, names, point, path)
    runs = Runs(model, attention_modules(model), path, corrupted, metric, batch)
    grads: dict[str, Tensor] = {}
    show = m >= 8 if progress is None else progress
    with Progress(m, f"attribution {point}", enabled=show) as bar:
        for alpha in steps(m):
            with _recording(path if alpha == 0.0 else None, "corrupted"):
                value, seen, g = _gradients(runs, alpha, names, point)
            if alpha == 0.0:
                base, corrupt = value, seen
            for name in names:
                grads[name] = grads.get(name, 0) + g[name] / m
            bar.update(1)
    parts = [_reduce(sources[n] - corrupt[n], grads[n], point, per_position) for n in names]
    return base + _padded(parts)


def _recording(path: Path | None, end: str) -> AbstractContextManager[None]:
    """Record the path's end ``end`` in the block (nothing without a path)."""
    return nullcontext() if path is None else path.recording(end)


class _Enough(Exception):
    """Raised in the clean run once every module asked has given its point: the rest of that forward (the
    layers after the last one asked, the final norm, the unembedding) computes nothing the estimate reads."""


def _clean_points(
    model: nn.Module, clean: object, names: list[str], point: str, path: Path | None
) -> dict[str, Tensor]:
    """``point`` of each module on the clean inputs, the forward stopped once all have run (the unembedding of
    every position is about a sixth of a small LM's forward). A module that runs twice is refused by the
    corrupted run (:func:`grab`)."""
    kept: dict[str, Tensor] = {}

    def keep(tensor: Tensor, ctx: Context) -> None:
        # k and v copied: a KV cache may write its buffers in place
        kept.setdefault(ctx.name, tensor.detach().clone() if point in ("k", "v") else tensor.detach())
        if len(kept) == len(names):
            raise _Enough

    sites = {name: {point: keep} for name in names}
    try:
        with torch.no_grad(), tapping(model, sites, pattern_from_weights=point != "scores"):
            with _recording(path, "clean"):
                run(model, clean)
    except _Enough:
        pass
    return {name: _one_call([kept[name]] if name in kept else [], name) for name in names}


def _one_call(calls: list[Tensor], name: str) -> Tensor:
    if len(calls) != 1:
        raise ValueError(
            f"{name!r} ran {len(calls)} times on the clean inputs; attribution patching estimates modules that "
            f"run once per forward (not decoding with a cache, not a layer shared across depth): pass modules=..."
        )
    return calls[0]


def grab(kept: dict[str, Tensor]) -> Callable[[Tensor, Context], Tensor]:
    """A handler keeping each site's tensor in the autograd graph (made a leaf needing grad where nothing
    upstream does) and handing it back, so the rest of the forward depends on exactly that tensor."""

    def handler(tensor: Tensor, ctx: Context) -> Tensor:
        if ctx.name in kept:
            raise ValueError(
                f"{ctx.name!r} ran more than once in one forward; attribution patching estimates modules that "
                f"run once per forward: pass modules=..."
            )
        if not tensor.requires_grad:
            tensor = tensor.detach().requires_grad_()
        kept[ctx.name] = tensor
        return tensor

    return handler


def metric_mean(value: Tensor | float, batch: int) -> Tensor:
    """The metric's batch mean (a per-example metric) or the scalar itself, as a 0-dim tensor."""
    per = _per_example(value.detach() if isinstance(value, Tensor) else value, batch)
    value = torch.as_tensor(value)
    return value.mean() if per is not None else value.reshape(())


@dataclass(frozen=True)
class Runs:
    """What every run of one estimate shares: the attention modules ``found``, the integration ``path`` (None
    for ig_steps=1), the corrupted inputs, the metric and the batch size."""

    model: nn.Module
    found: Mapping[str, nn.Module]
    path: Path | None
    corrupted: object
    metric: Callable[[Any], Tensor | float]
    batch: int

    def value_at(self, alpha: float) -> Tensor:
        """The metric's batch mean of the run at ``alpha`` on the path (0: the corrupted run), with autograd."""
        with torch.enable_grad():
            if self.path is None or alpha == 0.0:
                out = run(self.model, self.corrupted)
            else:
                with self.path.at(alpha) as inputs:
                    out = run(self.model, inputs)
            value = metric_mean(self.metric(out), self.batch)
        if not value.requires_grad:
            raise ValueError(
                "the metric does not depend on the model's output through autograd (it returned a value without "
                "a gradient); compute it from the output with torch operations"
            )
        return value


def _gradients(
    runs: Runs, alpha: float, names: list[str], point: str
) -> tuple[float, dict[str, Tensor], dict[str, Tensor]]:
    """One run at ``alpha`` on the path: the metric's batch mean, each module's ``point`` and its gradient."""
    kept: dict[str, Tensor] = {}
    with tapping(runs.model, {name: {point: grab(kept)} for name in names}, found=runs.found):
        value = runs.value_at(alpha)
    missing = [name for name in names if name not in kept]
    if missing:
        raise ValueError(f"the corrupted run did not call the modules {missing}: nothing to estimate there")
    tensors = [kept[name] for name in names]
    g = torch.autograd.grad(value, tensors, allow_unused=True, materialize_grads=True)
    return float(value.detach()), {n: t.detach() for n, t in zip(names, tensors)}, dict(zip(names, g))


def _reduce(delta: Tensor, grad: Tensor, point: str, per_position: bool) -> Tensor:
    """(H,) or (H, P): ``delta * grad`` summed over all but the head (and position) dims; 0 where the delta is
    not finite (scores masked in both runs)."""
    product = torch.where(torch.isfinite(delta), delta * grad, grad.new_zeros(()))
    keep = (1, 2) if per_position else (1,)
    return product.sum([d for d in range(product.dim()) if d not in keep])


def _padded(parts: list[Tensor]) -> Tensor:
    """(N, H[, P]) from N modules' (H[, P]), NaN-padded to the most heads (and positions)."""
    shape = [max(p.shape[i] for p in parts) for i in range(parts[0].dim())]
    dtype = torch.promote_types(parts[0].dtype, torch.float32)
    out = torch.full((len(parts), *shape), float("nan"), dtype=dtype)
    for i, p in enumerate(parts):
        out[(i, *(slice(0, n) for n in p.shape))] = p.detach().cpu().to(dtype)
    return out
