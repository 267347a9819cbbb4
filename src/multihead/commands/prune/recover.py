"""Recovery: distil the pruned model toward the original, stopped early on the validation texts."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from .. import training
from .objectives import Batch, Objective, Outputs

__all__ = ["Recovery", "recover"]

_CACHE_BYTES = 512 * 2**20  # teacher outputs kept between recovery steps up to this size


@dataclass
class Recovery:
    """What recovery did: the loss of each step run (every learning rate tried, in order), the learning
    rates tried, and of the last try its validation checks ``(step, quality)`` and the step whose weights
    were kept (the best check; 0 = the starting weights)."""

    losses: list[float] = field(default_factory=list)
    checks: list[tuple[int, float]] = field(default_factory=list)
    kept_step: int = 0
    lrs: list[float] = field(default_factory=list)


def recover(
    student: nn.Module,
    teacher: nn.Module,
    batches: Sequence[Batch],
    objective: Objective,
    steps: int,
    *,
    lrs: Sequence[float],
    seed: int,
    validate: Callable[[nn.Module], float],
    eval_every: int,
    patience: int,
    progress: Callable[[float], None] | None = None,
) -> Recovery:
    """Distil ``student`` toward ``teacher`` (``objective.distill``) for at most ``steps`` AdamW steps, at
    the first learning rate of ``lrs`` whose steps improve the validation quality.

    ``validate(student)`` (a quality, higher better) runs before the first step and every ``eval_every``
    steps; a try stops after ``patience`` checks without improvement, and the student ends with the
    weights of its best check. When no check of a try improved on the starting weights, the student is back
    at them and the next learning rate of ``lrs`` is tried (a smaller one: the step was too large to help),
    until none is left. Token embeddings stay frozen (the pruned heads never changed them); dropout is off
    (eval mode); learning rate: linear warm-up over the first 10% of the steps, then linear decay to zero.
    """
    result, teacher_out = Recovery(), _TeacherCache(teacher, batches, objective)  # shared by the tries
    for lr in lrs:
        one = _distil(student, teacher_out, batches, objective, steps, lr=lr, seed=seed, validate=validate,
                      eval_every=eval_every, patience=patience, progress=progress)  # fmt: skip
        result.losses += one.losses
        result.checks, result.kept_step = one.checks, one.kept_step
        result.lrs.append(lr)
        if one.kept_step:
            break
    return result


def _distil(
    student: nn.Module,
    teacher_out: _TeacherCache,
    batches: Sequence[Batch],
    objective: Objective,
    steps: int,
    *,
    lr: float,
    seed: int,
    validate: Callable[[nn.Module], float],
    eval_every: int,
    patience: int,
    progress: Callable[[float], None] | None,
) -> Recovery:
    """One try of :func:`recover` at learning rate ``lr``."""
    params = [p for n, p in student.named_parameters() if "embeddings" not in n and "embed_tokens" not in n]
    for p in student.parameters():
        p.requires_grad_(False)
    for p in params:
        p.requires_grad_(True)
    student.eval()
    gen = torch.Generator().manual_seed(seed)
    order: list[int] = []
    result = Recovery(checks=[(0, validate(student))])
    best = _snapshot(params)

    def loss_at(_: int) -> Tensor:
        if not order:
            order.extend(torch.randperm(len(batches), generator=gen).tolist())
        i = order.pop()
        return objective.distill(objective.outputs(student, batches[i]), teacher_out[i])

    def on_step(step: int, loss: float) -> bool:
        nonlocal best
        if progress is not None:
            progress(loss)
        if (step + 1) % eval_every and step + 1 < steps:
            return False
        result.checks.append((step + 1, validate(student)))
        if result.checks[-1][1] > max(q for _, q in result.checks[:-1]):
            best, result.kept_step = _snapshot(params), step + 1
        return len(result.checks) - 1 - _index_of(result.checks, result.kept_step) >= patience

    schedule = training.warmup_linear(steps, steps // 10)
    result.losses = training.fit(params, loss_at, steps, training.AdamW(lr), schedule, on_step=on_step)
    with torch.no_grad():
        for p, b in zip(params, best, strict=True):
            p.copy_(b)
    for p in student.parameters():
        p.requires_grad_(True)
    return result


def _snapshot(params: Sequence[nn.Parameter]) -> list[Tensor]:
    return [p.detach().clone() for p in params]


def _index_of(checks: list[tuple[int, float]], step: int) -> int:
    return next(i for i, (s, _) in enumerate(checks) if s == step)


class _TeacherCache:
    """The teacher's outputs on each batch, computed once and kept while they fit in ``_CACHE_BYTES``."""

    def __init__(self, teacher: nn.Module, batches: Sequence[Batch], objective: Objective) -> None:
        self.teacher, self.batches, self.objective = teacher, batches, objective
        self.kept: dict[int, Outputs] = {}
        self.bytes = 0

    def __getitem__(self, i: int) -> Outputs:
        out = self.kept.get(i)
        if out is None:
            with torch.no_grad():
                out = self.objective.outputs(self.teacher, self.batches[i])
            if self.bytes + out.nbytes() <= _CACHE_BYTES:
                self.kept[i], self.bytes = out, self.bytes + out.nbytes()
        return out
