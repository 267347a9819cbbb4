"""Training helpers shared by the tools: the AdamW loop, learning-rate schedules, parameter counts, tables.

``multihead prune`` (its recovery by distillation) and ``multihead demo`` (training its Transformer) both
run :func:`fit` with a schedule from here, count parameters with :func:`count_params` and print their
tables with :func:`markdown_table` / :func:`text_table`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

__all__ = [
    "AdamW",
    "Schedule",
    "count_params",
    "fit",
    "markdown_table",
    "text_table",
    "warmup_cosine",
    "warmup_linear",
]

Schedule = Callable[[int], float]
"""Step (from 0) -> factor of the base learning rate."""


def warmup_linear(steps: int, warmup: int) -> Schedule:
    """Linear warm-up over ``warmup`` steps to 1, then linear decay to 0 at ``steps``."""
    warmup = max(1, warmup)
    return lambda s: (s + 1) / warmup if s < warmup else max(0.0, (steps - s) / max(1, steps - warmup))


def warmup_cosine(steps: int, warmup: int, floor: float = 0.05) -> Schedule:
    """Linear warm-up over ``warmup`` steps to 1, then a cosine decay to ``floor`` at ``steps``."""
    warmup = max(1, warmup)

    def factor(s: int) -> float:
        if s < warmup:
            return (s + 1) / warmup
        t = (s - warmup) / max(1, steps - warmup)
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * t))

    return factor


@dataclass(frozen=True)
class AdamW:
    """The optimiser's settings (``torch.optim.AdamW``) and the gradient-norm clip."""

    lr: float
    betas: tuple[float, float] = (0.9, 0.999)
    weight_decay: float = 0.0
    clip: float = 1.0


def fit(
    params: Iterable[nn.Parameter],
    loss_at: Callable[[int], Tensor],
    steps: int,
    optimiser: AdamW,
    schedule: Schedule,
    *,
    on_step: Callable[[int, float], bool | None] | None = None,
) -> list[float]:
    """Minimise ``loss_at(step)`` for ``steps`` AdamW steps; returns the loss of each step taken.

    ``on_step(step, loss)`` runs after each step (progress, evaluations); returning True stops early.
    """
    params = list(params)
    opt = torch.optim.AdamW(
        params, lr=optimiser.lr, betas=optimiser.betas, weight_decay=optimiser.weight_decay
    )
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    losses: list[float] = []
    for step in range(steps):
        loss = loss_at(step)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        nn.utils.clip_grad_norm_(params, optimiser.clip)
        opt.step()
        sched.step()
        losses.append(float(loss.detach()))
        if on_step is not None and on_step(step, losses[-1]):
            break
    return losses


def count_params(model: nn.Module) -> int:
    """Parameters (shared ones once)."""
    return sum(p.numel() for p in model.parameters())


def markdown_table(rows: Sequence[Sequence[str]]) -> str:
    """A markdown table; ``rows[0]`` is the header."""
    lines = ["| " + " | ".join(rows[0]) + " |", "|" + "---|" * len(rows[0])]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows[1:]])


def text_table(rows: Sequence[Sequence[str]]) -> str:
    """The rows as left-aligned columns two spaces apart (for a terminal)."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows)
