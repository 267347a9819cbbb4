"""``multihead prune --quality Q``: remove the most heads whose removal keeps the validation quality >= Q.

The heads go in the order of :func:`~.choose.compensable_order` (the greedy choice is nested: its first ``n``
heads are what ``--heads n`` removes). For a candidate count ``n`` those heads are pruned, the model is refit
(:func:`~.refit.refit_layers`, the command's refit stage) and its validation quality measured as the share of
the original's it keeps (:meth:`~.objectives.Objective.relative`). A binary search over ``n`` finds the largest
count that keeps at least ``Q`` (the quality falls as heads go; the search assumes it falls monotonically
and measures about ``log2`` of the prunable heads' count). The later stages (reconstruction, recovery) are
kept only when they raise the validation quality, so the saved model keeps at least ``Q`` on the validation
texts too; the report states its held-out quality and interval, how many heads went, and what the validation
quality would have been with one head more.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from ... import heads as heads_tools
from .choose import Unit, grouped

__all__ = ["Floor", "search"]


@dataclass
class Floor:
    """What the search found: the floor ``quality`` (Q), the validation quality (relative, after the refit)
    at each head count it tried, and the count ``n`` it chose (0: not even one head keeps Q)."""

    quality: float
    most: int  # the most heads that can go (every layer keeps one)
    tried: dict[int, float] = field(default_factory=dict)
    n: int = 0
    removed: dict[str, list[int]] = field(default_factory=dict)  # the n heads, {module: heads}

    def next_head(self) -> tuple[int, float] | None:
        """``(heads, validation quality)`` of the next count after ``n`` (one head more, or one key/value
        group more under grouped-query attention): what it would have left (None: ``n`` is the most)."""
        more = [k for k in self.tried if k > self.n]
        return (min(more), self.tried[min(more)]) if more else None

    def as_dict(self) -> dict[str, Any]:
        nxt = self.next_head()
        return {
            "quality": self.quality,
            "removable": self.n,
            "most": self.most,
            "validation_at_removable": self.tried.get(self.n, 1.0),
            "next": None if nxt is None else {"heads": nxt[0], "validation": nxt[1]},
            "tried": {str(k): v for k, v in sorted(self.tried.items())},
        }


def search(
    original: nn.Module,
    order: list[Unit],
    quality: float,
    refit: Callable[[nn.Module, dict[str, list[int]]], nn.Module],
    validate: Callable[[nn.Module], float],
) -> tuple[Floor, nn.Module | None]:
    """The most heads, the first units of ``order`` (:func:`~.choose.removal_order`), whose removal, then
    ``refit(pruned, removed)``, keeps ``validate(model) >= quality`` (binary search over the number of
    units, assuming the quality falls as more go). Returns the :class:`Floor` (``n`` in heads) and the
    refit model at that ``n`` (None when ``n`` is 0)."""
    heads = [0]  # heads[k]: the heads of the first k units
    for _, unit in order:
        heads.append(heads[-1] + len(unit))
    floor = Floor(quality, heads[-1])
    modules = list(heads_tools.head_counts(original))
    best: nn.Module | None = None
    lo, hi = 0, len(order) + 1  # units: lo keeps the floor (none removed: 1.0), hi does not (past the most)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        removed = grouped(order[:mid], modules)
        model = refit(heads_tools.prune(original, removed), removed)
        floor.tried[heads[mid]] = validate(model)
        if floor.tried[heads[mid]] >= quality:
            lo, best = mid, model
        else:
            hi = mid
    floor.n, floor.removed = heads[lo], grouped(order[:lo], modules)
    return floor, best
