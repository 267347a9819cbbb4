"""Activation patching of every head: :func:`patch_heads`.

Dimensions: N modules, B batch, C copies of the batch in one forward (one patch each), H heads (Hkv for k/v),
P positions (queries; keys for k/v), L sequence length.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn

from ..heads.naming import attention_modules
from ..progress import Progress
from .cache import cache
from .share import Prefix, repeat_batch, shared_run
from .sites import Context, ModuleSelection, check_points, run, select, tapping

TOKENS_PER_FORWARD = 1024
"""Default bound on C * B * L of one batched forward (the memory of the patched runs)."""


class Patch(NamedTuple):
    """One patch: head ``head`` (and position ``position``, or all positions) of module number ``module``."""

    module: int
    head: int
    position: int | None


def patch_heads(
    model: nn.Module,
    clean: object,
    corrupted: object,
    metric: Callable[[Any], Tensor | float],
    *,
    point: str = "z",
    per_position: bool = False,
    modules: ModuleSelection = None,
    chunk: int | None = None,
    progress: bool | None = None,
) -> Tensor:
    """The metric of the corrupted run with one head's ``point`` taken from the clean run, for every head.

    Args:
        model: the model (in the mode it is in: use ``model.eval()`` for dropout-free runs).
        clean, corrupted: the model's inputs, of equal shapes: dicts of keyword inputs, or tensors.
        metric: ``metric(output)`` -> (B,) per example, or a scalar. A per-example metric lets patches share
            a forward: the corrupted batch is repeated C times, copy c patching the c-th head, and the metric is
            called on each copy's rows of the output (tensors whose dim 0 is C*B are cut; 0-dim ones become None).
            A scalar metric costs one forward per patch. Where the patched modules sit in a stack of layers
            (an ``nn.ModuleList``), the layers before a forward's first patch run once, on the corrupted batch,
            and their output is repeated for the copies (checked against the corrupted run on the first such
            forward; switched off, with a warning, on a model where that does not reproduce it).
        point: ``"z"`` (default), ``"q"``, ``"k"``/``"v"`` (by key/value head), ``"scores"``, ``"pattern"`` or
            ``"result"``.
        per_position: patch one position at a time too (queries; keys for k/v).
        modules: which attention modules (names, a predicate, None: all).
        chunk: copies per forward (default: as many as keep C*B*L <= :data:`TOKENS_PER_FORWARD`).
        progress: a progress bar on stderr (default: when the sweep takes 8 forwards or more).

    Returns:
        effects (N, H) or (N, H, P): the metric (its mean over the batch) of each patched run; N the modules in
        module order, H the most heads of any (NaN where a module has fewer).
    """
    (point,) = check_points(point, argument="point")
    names = select(model, modules)
    batch = _check_alike(clean, corrupted)
    with torch.no_grad():
        sources = _clean_sources(model, clean, names, point)
        found = attention_modules(model)  # checked by the clean run's cache; reused by every patched run
        base = _per_example(metric(run(model, corrupted)), batch)
        sweep = _Sweep(names, sources, point, metric, batch, base, Prefix(model, names))
        patches, shape = _layout(names, sources, per_position)
        size = _chunk_size(chunk, base is not None, batch, _length(corrupted), len(patches))
        effects = torch.full(shape, float("nan"))
        forwards = math.ceil(len(patches) / size)
        show = forwards >= 8 if progress is None else progress
        with Progress(len(patches), f"patch {point}", enabled=show) as bar:
            for start in range(0, len(patches), size):
                part = patches[start : start + size]
                values = _patched(model, found, corrupted, part, sweep)
                for patch, value in zip(part, values):
                    effects[
                        (patch.module, patch.head) + (() if patch.position is None else (patch.position,))
                    ] = value
                bar.update(len(part))
    return effects


def _layout(
    names: list[str], sources: Mapping[str, Tensor], per_position: bool
) -> tuple[list[Patch], tuple[int, ...]]:
    """Every patch, module by module, and the shape of the effects: (N, H) or (N, H, P), H and P the largest."""
    patches = [
        Patch(i, h, p)
        for i, name in enumerate(names)
        for h in range(sources[name].shape[1])
        for p in (range(sources[name].shape[2]) if per_position else (None,))
    ]
    shape = (len(names), max(t.shape[1] for t in sources.values()))
    return patches, shape + ((max(t.shape[2] for t in sources.values()),) if per_position else ())


def _clean_sources(model: nn.Module, clean: object, names: list[str], point: str) -> dict[str, Tensor]:
    """``point`` of each module on the clean inputs (one call each)."""
    with cache(model, point, modules=names) as c:
        run(model, clean)
    sources = {}
    for name in names:
        calls = c.calls(name, point) if (name, point) in c else []
        if len(calls) != 1:
            raise ValueError(
                f"{name!r} ran {len(calls)} times on the clean inputs; patch_heads patches modules that run once "
                f"per forward (not decoding with a cache, not a layer shared across depth): pass modules=..."
            )
        sources[name] = calls[0]
    return sources


@dataclass(frozen=True)
class _Sweep:
    """What every forward of one sweep shares: the patched modules, their clean ``point``, the metric, the
    corrupted batch ``batch`` and its per-example metric ``base`` (None for a scalar metric), the shared prefix."""

    names: list[str]
    sources: Mapping[str, Tensor]
    point: str
    metric: Callable[[Any], Tensor | float]
    batch: int
    base: Tensor | None
    prefix: Prefix


def _patched(
    model: nn.Module, found: Mapping[str, nn.Module], corrupted: object, part: list[Patch], sweep: _Sweep
) -> list[float]:
    """One forward of ``len(part)`` copies of the corrupted batch, copy c patched by ``part[c]``; each copy's
    metric, averaged over its examples. The layers before the first patch run once when they can
    (:class:`~multihead.lens.share.Prefix`)."""
    copies = len(part)
    layer = sweep.prefix.layer_for(part[0].module) if copies > 1 and sweep.base is not None else None
    if layer is not None:
        check = not sweep.prefix.checked  # the first shared forward carries one unpatched copy
        total = copies + check
        with tapping(model, _sites(part, total, sweep), found=found):
            out = shared_run(sweep.prefix, layer, sweep.batch, total, lambda: run(model, corrupted))
        if out is not None:
            values = [_copy_metric(sweep, out, c, total) for c in range(total)]
            if not check or sweep.prefix.verify(values[-1], sweep.base):
                return [float(v.mean()) for v in values[:copies]]
    inputs = corrupted if copies == 1 else repeat_batch(corrupted, sweep.batch, copies)
    with tapping(model, _sites(part, copies, sweep), found=found):
        out = run(model, inputs)
    return [float(_copy_metric(sweep, out, c, copies).mean()) for c in range(copies)]


def _sites(part: list[Patch], copies: int, sweep: _Sweep) -> dict[str, dict[str, Callable[..., Tensor]]]:
    """The handlers of one forward: each patched module's ``point`` written into the copies patching it."""
    sites = {}
    for i in sorted({p.module for p in part}):
        mine = [(c, p) for c, p in enumerate(part) if p.module == i]
        name = sweep.names[i]
        sites[name] = {sweep.point: _patcher(sweep.sources[name], mine, copies, sweep.batch)}
    return sites


def _copy_metric(sweep: _Sweep, out: Any, copy: int, copies: int) -> Tensor:
    """The metric of copy ``copy``'s rows of a forward of ``copies`` copies, as a float tensor."""
    rows = out if copies == 1 else _rows(out, copy, copies, sweep.batch)
    return torch.as_tensor(sweep.metric(rows)).float()


def _patcher(source: Tensor, mine: list[tuple[int, Patch]], copies: int, batch: int) -> Callable[..., Tensor]:
    """The handler writing ``source``'s (clean) heads into the copies that patch this module."""
    rows = torch.tensor([c for c, _ in mine], device=source.device)  # (K,)
    heads = torch.tensor([p.head for _, p in mine], device=source.device)  # (K,)
    positions = (
        None
        if mine[0][1].position is None
        else torch.tensor([p.position for _, p in mine], device=source.device)
    )

    def patch(tensor: Tensor, ctx: Context) -> Tensor:
        out = tensor.unflatten(0, (copies, batch)).clone()  # (C, B, H, P, ...)
        if positions is None:
            out[rows, :, heads] = source[:, heads].transpose(0, 1).to(out.dtype)  # (K, B, P, ...)
        else:
            out[rows, :, heads, positions] = (
                source[:, heads, positions].transpose(0, 1).to(out.dtype)
            )  # (K, B, ...)
        return out.flatten(0, 1)  # (C*B, H, P, ...)

    return patch


def _tensors(inputs: object) -> list[Tensor]:
    if isinstance(inputs, Tensor):
        return [inputs]
    values = inputs.values() if isinstance(inputs, Mapping) else inputs if isinstance(inputs, tuple) else ()
    return [v for v in values if isinstance(v, Tensor)]


def _check_alike(clean: object, corrupted: object) -> int:
    """The batch size B of two inputs of the same structure and shapes (refused by name otherwise)."""
    shapes = [tuple(t.shape) for t in _tensors(clean)], [tuple(t.shape) for t in _tensors(corrupted)]
    same_keys = not isinstance(clean, Mapping) or set(clean) == set(corrupted)  # type: ignore[arg-type]
    if shapes[0] != shapes[1] or not same_keys or not shapes[0] or not shapes[0][0]:
        raise ValueError(
            f"clean and corrupted must be the model's inputs (dicts of keyword inputs, tuples or tensors) of equal "
            f"shapes, with a batch dimension; got tensors of shapes {shapes[0]} and {shapes[1]}"
        )
    return shapes[0][0][0]


def _length(inputs: object) -> int:
    return max((t.shape[1] for t in _tensors(inputs) if t.dim() >= 2), default=1)


def _per_example(value: Tensor | float, batch: int) -> Tensor | None:
    """The metric's values (B,) when it is per example, None when it is a scalar; anything else refused."""
    if not isinstance(value, (Tensor, float, int)):
        raise TypeError(
            f"metric must return a tensor (one value per example ({batch},), or a scalar) or a number, "
            f"got {type(value).__name__}"
        )
    value = torch.as_tensor(value)
    if value.dim() == 1 and value.shape[0] == batch:
        return value.detach().float()
    if value.numel() == 1:
        return None
    raise ValueError(
        f"metric must return a scalar or one value per example ({batch},), got shape {tuple(value.shape)}"
    )


def _chunk_size(chunk: int | None, per_example: bool, batch: int, length: int, total: int) -> int:
    if not per_example:
        return 1
    if chunk is None:
        chunk = max(1, TOKENS_PER_FORWARD // (batch * length))
    if not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"chunk must be a positive int (copies of the batch per forward), got {chunk!r}")
    return min(chunk, max(1, total))


def _rows(out: Any, copy: int, copies: int, batch: int) -> Any:
    """Copy ``copy``'s rows of a batched output: tensors (C*B, ...) cut to (B, ...), 0-dim ones None, containers
    (ModelOutput, dicts, tuples, lists) rebuilt, anything else as it is."""
    if isinstance(out, Tensor):
        if out.dim() == 0:
            return None
        return out[copy * batch : (copy + 1) * batch] if out.shape[0] == copies * batch else out
    if isinstance(out, Mapping):
        return type(out)(**{k: _rows(v, copy, copies, batch) for k, v in out.items()})
    if isinstance(out, (tuple, list)) and not hasattr(out, "_fields"):
        return type(out)(_rows(v, copy, copies, batch) for v in out)
    return out
