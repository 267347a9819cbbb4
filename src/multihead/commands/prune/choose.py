"""Choosing the heads to prune.

Dimensions: n tokens, H heads of a module, Dv a head's value width, I = H * Dv, O the projection's output.

:func:`choose_compensable` (what ``multihead prune`` uses): a head can go when the least-squares refit
(:mod:`.refit`) can make up for it *on texts it was not fit on*. For a module whose output projection maps
the heads' merged contexts ``x`` (n, I) to ``y`` (n, O), keeping the heads ``K`` leaves the residual
``r(K) = ||[x_K 1] A - y||^2`` of the best linear map ``A`` of the kept heads' columns.
:class:`CrossValidated` measures it out of sample: the texts are dealt into :data:`FOLDS` folds, ``A`` is
fit on all folds but one and ``r`` summed over the texts of the fold left out, fold after fold. It is
divided by the module's output energy about its mean (:meth:`LeastSquares.spread`) so that modules compare
on one scale. Greedily, over every module at once, the head whose removal raises its module's normalised
residual the least goes next, ``n`` times; no module is emptied.

Why out of sample: measured on the texts it was fit on, the residual flatters the modules whose fit does
not carry over. On all-MiniLM-L6-v2 the last layer's was the lowest of the six in sample (a quarter of its
heads gone: 0.032 of its spread) and the highest out of sample (0.121, 4 folds), and that layer is the
most costly to prune (removing three of its heads alone, then the refit: 1 - Spearman 0.010 on the
external held-out package-docs sentences of ``benchmarks/bench_prune.py``, against 0.002-0.004 for any
other layer). Chosen in sample, ``--heads 0.25`` removed four of its heads; out of sample, none.

:func:`choose_and_prune`: Michel et al.'s importance of the objective's loss, in rounds, rescoring after
each (kept for comparison and for callers that want the loss-driven choice).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence

import torch
from torch import Tensor, nn

from ... import heads as heads_tools
from ...heads.naming import attention_modules, family_of, module_heads
from .inputs import PruneError
from .objectives import Batch, Objective
from .refit import RIDGE, LeastSquares, output_folds, output_projection

__all__ = [
    "FOLDS",
    "CrossValidated",
    "check_prunable",
    "choose_and_prune",
    "choose_compensable",
    "compensable_heads",
    "compensable_order",
    "gqa_groups",
    "grouped",
    "removal_order",
    "spread_subset",
]

FOLDS = 4
"""Folds of :class:`CrossValidated` in :func:`choose_compensable`. On all-MiniLM-L6-v2 (seed 0, refit stage,
external held-out Spearman of ``benchmarks/bench_prune.py``) 2, 4 and 8 folds chose the same heads, or
heads within 0.0015 of each other, in each of the four cases (two real-text corpora, ``--heads`` 0.25 and
0.5)."""


class CrossValidated:
    """The residual of a module's refit on texts it was not fit on: ``parts[f]`` holds the normal
    equations of fold ``f``'s rows (:func:`~.refit.output_folds`); :meth:`residual` fits on every other fold
    and measures on fold ``f``, summed over the folds. One fold: the in-sample residual."""

    def __init__(self, parts: Sequence[LeastSquares]) -> None:
        self.parts = [p for p in parts if p.rows]
        if not self.parts:
            raise ValueError("CrossValidated needs at least one fold with rows")
        self.total = sum(self.parts[1:], self.parts[0])
        self.rest = [self.total - part for part in self.parts]  # rest[f]: the rows of every fold but f

    @property
    def inputs(self) -> int:
        return self.total.inputs

    def residual(self, columns: Tensor, ridge: float = RIDGE, *, bias: bool = True) -> float:
        """``sum_f ||[x_f,c 1] A_(-f) - y_f||^2``: ``A_(-f)`` the fit on ``columns`` of every fold but ``f``
        (:meth:`LeastSquares.solve`'s, ridge included)."""
        if len(self.parts) == 1:
            return self.total.residual(columns, ridge, bias=bias)
        return sum(
            part.error(rest.solution(columns, ridge, bias=bias), columns, bias=bias)
            for part, rest in zip(self.parts, self.rest, strict=True)
        )

    def spread(self) -> float:
        return self.total.spread()


def check_prunable(model: nn.Module) -> dict[str, int]:
    """``{module: H}`` of every attention module; :class:`PruneError` if one cannot be pruned."""
    modules = attention_modules(model)
    if not modules:
        raise PruneError(f"{type(model).__name__} has no attention module that runs on multihead")
    for name, m in modules.items():
        family = family_of(m)
        if family is not None:
            try:
                family.check_prunable(name, m)
            except ValueError as e:
                raise PruneError(str(e).splitlines()[0]) from e
    return {name: module_heads(m)[0] for name, m in modules.items()}


def choose_and_prune(
    model: nn.Module,
    batches: Sequence[Batch],
    objective: Objective,
    n: int,
    rounds: int,
    progress: Callable[[], None] | None = None,
) -> tuple[nn.Module, dict[str, list[int]]]:
    """Prune ``n`` heads in ``rounds`` rounds: score (:func:`multihead.heads.importance` of
    ``objective.loss``), prune the least important, repeat; no layer is ever emptied.

    Returns the pruned copy and the removed heads per module, as indices of the original model.
    """
    current = model
    origin = {name: list(range(h)) for name, h in heads_tools.head_counts(model).items()}  # now -> original
    removed: dict[str, list[int]] = {name: [] for name in origin}
    rounds = max(1, min(rounds, n))
    for r in range(rounds):
        k = n * (r + 1) // rounds - n * r // rounds
        score = heads_tools.importance(current, _counted(batches, progress), objective.loss)
        left = heads_tools.head_counts(current)
        drop: dict[str, list[int]] = {}
        for name, h in heads_tools.rank(score):
            if k == 0:
                break
            if left[name] - len(drop.get(name, [])) > 1:
                drop.setdefault(name, []).append(h)
                k -= 1
        for name, hs in drop.items():
            removed[name] += [origin[name][h] for h in hs]
            origin[name] = [o for i, o in enumerate(origin[name]) if i not in hs]
        current = heads_tools.prune(current, drop)
    return current, {k: sorted(v) for k, v in removed.items() if v}


def compensable_heads(
    fits: Mapping[str, LeastSquares | CrossValidated],
    heads: Mapping[str, int],
    n: int,
    *,
    bias: Mapping[str, bool] | None = None,
    groups: Mapping[str, int] | None = None,
) -> dict[str, list[int]]:
    """The heads to remove, ``{module: sorted head indices}``: those of :func:`removal_order`."""
    return grouped(removal_order(fits, heads, n, bias=bias, groups=groups), heads)


Unit = tuple[str, tuple[int, ...]]  # (module, the heads that go together)


def removal_order(
    fits: Mapping[str, LeastSquares | CrossValidated],
    heads: Mapping[str, int],
    n: int,
    *,
    bias: Mapping[str, bool] | None = None,
    groups: Mapping[str, int] | None = None,
) -> list[Unit]:
    """Units of heads to remove, at most ``n`` heads, ``[(module, heads), ...]`` in the greedy choice's order
    (nested: its first ``k`` units are what it takes for that many heads).

    ``fits[name]``: the normal equations of module ``name``'s output projection (columns ``[h Dv, (h + 1)
    Dv)`` are head ``h``'s), a :class:`LeastSquares` (in sample) or :class:`CrossValidated` (out of sample);
    ``bias[name]``: whether its refit has an intercept (default True); ``groups[name]``: a unit's heads
    (default 1; under GQA the query heads sharing a key/value head, which goes with them). Each step removes
    the unit, among those that fit in the heads left, whose removal raises its module's residual divided by
    its :meth:`LeastSquares.spread` the least; a module keeps one unit. Ties: the earlier module, the lower
    head. ``ValueError`` if ``n`` heads cannot go."""
    size = {name: 1 if groups is None else groups.get(name, 1) for name in heads}
    kept = {
        name: [tuple(range(u, u + size[name])) for u in range(0, h, size[name])] for name, h in heads.items()
    }
    scale = {name: max(fits[name].spread(), 1e-30) for name in heads}

    def residual(name: str, keep: list[tuple[int, ...]]) -> float:
        dv = fits[name].inputs // heads[name]
        cols = torch.cat([torch.arange(h * dv, (h + 1) * dv) for u in keep for h in u])  # (kept * Dv,)
        return fits[name].residual(cols, bias=True if bias is None else bias[name]) / scale[name]

    now = {name: residual(name, kept[name]) for name in heads}
    best: dict[
        str, tuple[float, tuple[int, ...]]
    ] = {}  # module -> (rise of its residual, unit): its cheapest

    def cheapest(name: str) -> None:
        if len(kept[name]) == 1:
            best[name] = (math.inf, ())
            return
        best[name] = min(
            (residual(name, [k for k in kept[name] if k != u]) - now[name], u) for u in kept[name]
        )

    for name in heads:
        cheapest(name)
    order: list[Unit] = []
    left = n
    while left > 0:
        fitting = [k for k in best if size[k] <= left and best[k][1]]
        if not fitting:
            if any(best[k][1] for k in best):
                break  # the units left are larger than the heads left to remove
            raise ValueError(f"cannot remove {n} heads: every module is down to one head")
        name = min(fitting, key=lambda k: best[k][0])
        rise, unit = best[name]
        kept[name].remove(unit)
        order.append((name, unit))
        now[name] += rise
        left -= len(unit)
        cheapest(name)
    return order


def choose_compensable(
    model: nn.Module, batches: Sequence[Batch], objective: Objective, n: int, *, folds: int = FOLDS
) -> tuple[nn.Module, dict[str, list[int]]]:
    """Prune the ``n`` heads the refit can best make up for on unseen texts (:func:`compensable_order`).
    Returns the pruned copy and the removed heads per module."""
    removed = grouped(
        compensable_order(model, batches, objective, n, folds=folds), heads_tools.head_counts(model)
    )
    return heads_tools.prune(model, removed), removed


def compensable_order(
    model: nn.Module, batches: Sequence[Batch], objective: Objective, n: int, *, folds: int = FOLDS
) -> list[Unit]:
    """At most ``n`` heads the refit can best make up for on unseen texts, in the order they go
    (:func:`removal_order` on each output projection's :class:`CrossValidated` map over the real tokens of
    ``batches``, ``folds`` folds; 1: in sample); under grouped-query attention the query heads that share a
    key/value head go together (:func:`gqa_groups`)."""
    fits = {
        name: CrossValidated(parts) for name, parts in output_folds(model, batches, objective, folds).items()
    }
    modules = attention_modules(model)
    bias = {name: output_projection(model, name, m).has_bias for name, m in modules.items()}
    counts = heads_tools.head_counts(model)
    heads = {name: h for name, h in counts.items() if name in fits}  # the modules that ran
    return removal_order(fits, heads, n, bias=bias, groups=gqa_groups(model))


def gqa_groups(model: nn.Module) -> dict[str, int]:
    """``{module: query heads per key/value head}`` of each attention module with fewer key/value heads
    than query heads: removed together, such a group takes its key/value head with it (the KV cache
    shrinks), and the groups stay even (an uneven layer would repeat key/value heads to even them,
    :func:`multihead.heads.prune`, and its KV cache would grow)."""
    counts = {name: module_heads(m) for name, m in attention_modules(model).items()}
    return {name: h // hkv for name, (h, hkv) in counts.items() if hkv < h}


def grouped(order: Sequence[Unit], modules: Iterable[str]) -> dict[str, list[int]]:
    """``[(module, heads), ...]`` -> ``{module: sorted heads}``, in the order of ``modules`` (every module
    of ``order`` among them)."""
    removed: dict[str, list[int]] = {}
    for name, unit in order:
        removed.setdefault(name, []).extend(unit)
    return {name: sorted(removed[name]) for name in modules if name in removed}


def _counted(batches: Sequence[Batch], progress: Callable[[], None] | None) -> Iterator[Batch]:
    for b in batches:
        yield b
        if progress is not None:
            progress()


def spread_subset(batches: list[Batch], texts: int) -> list[Batch]:
    """Batches spread through ``batches`` holding about ``texts`` texts in all (a stage need not see all)."""
    per = max(1, len(batches[0].inputs["input_ids"]))
    k = max(1, min(len(batches), math.ceil(texts / per)))
    return [batches[int((i + 0.5) * len(batches) / k)] for i in range(k)]
