"""Choosing the heads to prune: importance under the checkpoint's objective, in rounds, rescoring after each."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence

from torch import nn

from ... import heads as heads_tools
from ...heads.naming import attention_modules, family_of, module_heads
from .inputs import PruneError
from .objectives import Batch, Objective

__all__ = ["check_prunable", "choose_and_prune", "spread_subset"]


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
