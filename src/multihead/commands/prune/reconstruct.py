"""Layer-wise reconstruction: each pruned layer trained by gradient to give the original layer's output.

The closed-form refit (:mod:`.refit`) recombines what the kept heads output, but their attention patterns
stay the original's: only training changes those. :func:`reconstruct_layers` goes through the pruned layers
in the order the model runs them. For each, on the pruned model's own input to that layer (as the layers
before it were left), it trains the layer's attention parameters -- the kept heads' query, key and value
projections and the output projection -- with AdamW so that the layer's output matches the original
layer's output on the original's input. The loss is the mean squared error over real tokens, divided by
the mean square of the original's output. Every :data:`CHECK_EVERY` steps the same error on the
validation texts decides which weights to keep (early stopping), so a layer ends no worse on them than it
started.

A layer is the element of an ``nn.ModuleList`` that holds the attention module (BERT's
``encoder.layer.3``, GPT-2's ``transformer.h.3``, Llama's ``model.layers.3``); it is run again on the
arguments the model passed it, with any KV cache left out. A layer that runs other than once per forward
pass (weights shared across depth) is left as it is.

Unlike end-to-end distillation (:mod:`.recover`), each step is one layer's forward and backward, and the
target is every output value of every token, so the fit is dense. On all-MiniLM-L6-v2
(``benchmarks/bench_prune.py``, seeds 0, 1, 2) it moved the saved model's external held-out Spearman at
``--heads`` 0.5 from 0.9692 to 0.9746 on the licence texts and from 0.9273 to 0.9309 on the package descriptions; the
learning rates tried are in docs/heads.md.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import torch
from torch import Tensor, nn

from .inputs import DEFAULT_RECONSTRUCT
from .objectives import Batch, Objective
from .refit import _real, output_projection
from .replay import Call, Chain, first, layer_of, stack_of

__all__ = ["CHECK_EVERY", "LR", "layer_of", "reconstruct_layers"]

LR = 3e-4
"""Learning rate of the layer-wise training (constant)."""

CHECK_EVERY = 25
"""Steps between validation checks."""


def _teacher_outputs(
    model: nn.Module, layers: dict[str, nn.Module], batches: Sequence[Batch], objective: Objective
) -> dict[str, list[Tensor]]:
    """One pass of ``model``: each layer's output per batch; a layer run other than once per batch is left out."""
    seen: dict[str, list[Tensor]] = {name: [] for name in layers}
    handles = [
        layer.register_forward_hook(lambda _m, _a, out, name=name: seen[name].append(first(out).detach()))
        for name, layer in layers.items()
    ]
    try:
        with torch.no_grad():
            for b in batches:
                objective.forward(model, b)
    finally:
        for h in handles:
            h.remove()
    return {name: outs for name, outs in seen.items() if len(outs) == len(batches)}


class _Fit:
    """One layer's training data: its calls, the teacher's outputs, the real tokens and the loss scale."""

    def __init__(
        self, layer: nn.Module, calls: list[Call], targets: list[Tensor], batches: Sequence[Batch]
    ) -> None:
        self.layer, self.calls, self.targets = layer, calls, targets
        self.real = [_real(t, b.inputs["attention_mask"]) for t, b in zip(targets, batches, strict=True)]
        self.scale = torch.cat([t[r] for t, r in zip(targets, self.real, strict=True)]).float().pow(2).mean()

    def loss(self, i: int) -> Tensor:
        args, kwargs = self.calls[i]
        out = first(self.layer(*args, **kwargs))
        r = self.real[i]
        return (out[r] - self.targets[i][r]).float().pow(2).mean() / self.scale

    def mean_loss(self) -> float:
        with torch.no_grad():
            return sum(float(self.loss(i)) for i in range(len(self.calls))) / len(self.calls)


def reconstruct_layers(
    student: nn.Module,
    teacher: nn.Module,
    batches: Sequence[Batch],
    validation: Sequence[Batch],
    objective: Objective,
    modules: Sequence[str],
    *,
    steps: int = DEFAULT_RECONSTRUCT,
    lr: float = LR,
    check_every: int = CHECK_EVERY,
    seed: int = 0,
    progress: Callable[[], None] | None = None,
) -> dict[str, tuple[float, float]]:
    """Train each layer holding one of ``modules`` (attention modules of ``student``, pruned) so that it
    reproduces ``teacher``'s layer output, in place, in the order the layers run (see the module docstring).
    ``batches`` train, ``validation`` chooses the kept weights. Returns ``{layer: (validation error before,
    after)}`` for the layers trained.
    """
    s_mods = dict(student.named_modules())
    own: dict[str, dict[int, nn.Parameter]] = {}  # layer -> its attention parameters, each once
    for name in modules:
        layer = layer_of(student, name)
        if layer is not None:
            proj = output_projection(student, name, s_mods[name]).layer
            own.setdefault(layer, {}).update(
                {id(p): p for p in (*s_mods[name].parameters(), *proj.parameters())}
            )
    order = [n for n in s_mods if n in own]  # the order the model builds (and runs) its layers
    done: dict[str, tuple[float, float]] = {}
    was_training = student.training
    student.eval()
    grads = {p: p.requires_grad for p in student.parameters()}
    gen = torch.Generator().manual_seed(seed)
    sets = (batches, validation)
    try:
        for p in student.parameters():
            p.requires_grad_(False)
        layers = _chained(student, teacher, order, sets, objective) or _by_passes(
            student, teacher, order, sets, objective
        )
        for name, fit, check in layers:
            done[name] = _train(fit, check, list(own[name].values()), steps, lr, check_every, gen)
            if progress is not None:
                progress()
    finally:
        for p, g in grads.items():
            p.requires_grad_(g)
        student.train(was_training)
    return done


Sets = tuple[Sequence[Batch], Sequence[Batch]]  # (training batches, validation batches)
Layers = Iterator[tuple[str, "_Fit", "_Fit"]]  # (layer, its training fit, its validation check), in order


def _chained(
    student: nn.Module, teacher: nn.Module, order: list[str], sets: Sets, objective: Objective
) -> Layers | None:
    """Each layer of ``order`` with its training and validation data, through a :class:`~.replay.Chain` of
    each model per set over the layers from the first of ``order`` to the last: every layer runs once per
    batch (the student's after its training, so the next layer sees the trained one's output). None
    where the layers do not chain."""
    stack = stack_of(student, order) if order else None
    if stack is None:
        return None
    names = stack[stack.index(order[0]) : stack.index(order[-1]) + 1]
    chains = [(Chain.record(teacher, names, b, objective), Chain.record(student, names, b, objective))
              for b in sets]  # fmt: skip
    if any(c is None for pair in chains for c in pair):
        return None

    def layers() -> Layers:
        for name in names:
            targets: list[list[Tensor]] = [[], []]
            for (t_chain, _), seen in zip(chains, targets, strict=True):
                t_chain.advance(each=lambda _b, out, seen=seen: seen.append(out))  # type: ignore[union-attr]
            if name in order:
                fit, check = (
                    _Fit(s_chain.layer, [s_chain.call(i) for i in range(len(b))], t, b)  # type: ignore[union-attr]
                    for (_, s_chain), t, b in zip(chains, targets, sets, strict=True)
                )
                yield name, fit, check
            for _, s_chain in chains:
                s_chain.advance()  # type: ignore[union-attr]

    return layers()


def _by_passes(
    student: nn.Module, teacher: nn.Module, order: list[str], sets: Sets, objective: Objective
) -> Layers:
    """:func:`_chained` where the layers do not chain: one pass of the teacher per set records every layer's
    output, one pass of the student per layer (stopped there) gives its inputs."""
    t_layers = {n: teacher.get_submodule(n) for n in order}
    targets = [_teacher_outputs(teacher, t_layers, b, objective) for b in sets]
    for name in order:
        if not all(name in t for t in targets):
            continue
        fit, check = (_Fit(student.get_submodule(name), _calls(student, name, b, objective), t[name], b)
                      for t, b in zip(targets, sets, strict=True))  # fmt: skip
        yield name, fit, check


def _calls(model: nn.Module, name: str, batches: Sequence[Batch], objective: Objective) -> list[Call]:
    """The arguments ``model`` passes its layer ``name`` on each batch (each pass stops there)."""
    chain = Chain.record(model, [name], batches, objective)
    assert chain is not None  # one layer always chains
    return [chain.call(i) for i in range(len(batches))]


def _train(
    fit: _Fit,
    check: _Fit,
    params: list[nn.Parameter],
    steps: int,
    lr: float,
    every: int,
    gen: torch.Generator,
) -> tuple[float, float]:
    """AdamW on ``params`` for ``steps`` steps of ``fit``'s batches in random order; the weights of the best
    validation check (``check``) are kept. Returns the validation error before and after."""
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    before = best = check.mean_loss()
    kept = [p.detach().clone() for p in params]
    for step in range(steps):
        i = int(torch.randint(len(fit.calls), (1,), generator=gen))
        loss = fit.loss(i)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if (step + 1) % every == 0 or step + 1 == steps:
            now = check.mean_loss()
            if now < best:
                best, kept = now, [p.detach().clone() for p in params]
    with torch.no_grad():
        for p, k in zip(params, kept, strict=True):
            p.copy_(k)
            p.requires_grad_(False)
    return before, best
