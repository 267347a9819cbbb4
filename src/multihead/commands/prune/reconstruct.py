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

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from .inputs import DEFAULT_RECONSTRUCT
from .objectives import Batch, Objective
from .refit import _real, _Stop, output_projection

__all__ = ["CHECK_EVERY", "LR", "layer_of", "reconstruct_layers"]

LR = 3e-4
"""Learning rate of the layer-wise training (constant)."""

CHECK_EVERY = 25
"""Steps between validation checks."""


def layer_of(model: nn.Module, name: str) -> str | None:
    """The name of the layer holding attention module ``name``: the element of an ``nn.ModuleList`` nearest
    above it (None when there is none)."""
    parts = name.split(".")
    for i in range(len(parts) - 1, 0, -1):
        if parts[i].isdigit() and isinstance(model.get_submodule(".".join(parts[:i])), nn.ModuleList):
            return ".".join(parts[: i + 1])
    return None


Call = tuple[tuple[Any, ...], dict[str, Any]]


def _is_cache(value: object) -> bool:
    """Whether ``value`` is a KV cache (a ``transformers`` ``Cache``, by its class or a base's name)."""
    return any(c.__name__.endswith("Cache") for c in type(value).__mro__[:-1])


def _no_cache(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Call:
    """The layer's arguments with any KV cache left out (replaying must not append to one): a cache object
    under any name (``past_key_values`` in transformers 5.23, ``cache`` in 5.24) becomes None."""
    out = {k: (None if "past_key" in k or _is_cache(v) else v) for k, v in kwargs.items()}
    if "use_cache" in out:
        out["use_cache"] = False
    return tuple(None if _is_cache(a) else a for a in args), out


def _first(out: Any) -> Tensor:
    return out[0] if isinstance(out, tuple) else out


def _teacher_outputs(
    model: nn.Module, layers: dict[str, nn.Module], batches: Sequence[Batch], objective: Objective
) -> dict[str, list[Tensor]]:
    """One pass of ``model``: each layer's output per batch; a layer run other than once per batch is left out."""
    seen: dict[str, list[Tensor]] = {name: [] for name in layers}
    handles = [
        layer.register_forward_hook(lambda _m, _a, out, name=name: seen[name].append(_first(out).detach()))
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


def _student_calls(
    model: nn.Module, layer: nn.Module, batches: Sequence[Batch], objective: Objective
) -> list[Call]:
    """The arguments ``model`` passes ``layer`` on each batch (each pass stops there)."""
    calls: list[Call] = []

    def hook(_: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        calls.append(_no_cache(args, kwargs))
        raise _Stop

    handle = layer.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        with torch.no_grad():
            for b in batches:
                try:
                    objective.forward(model, b)
                except _Stop:
                    pass
    finally:
        handle.remove()
    return calls


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
        out = _first(self.layer(*args, **kwargs))
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
    t_layers = {n: teacher.get_submodule(n) for n in order}
    targets = {"train": _teacher_outputs(teacher, t_layers, batches, objective),
               "validation": _teacher_outputs(teacher, t_layers, validation, objective)}  # fmt: skip
    done: dict[str, tuple[float, float]] = {}
    was_training = student.training
    student.eval()
    grads = {p: p.requires_grad for p in student.parameters()}
    gen = torch.Generator().manual_seed(seed)
    try:
        for p in student.parameters():
            p.requires_grad_(False)
        for name in order:
            if name not in targets["train"] or name not in targets["validation"]:
                continue
            layer = s_mods[name]
            fit = _Fit(
                layer, _student_calls(student, layer, batches, objective), targets["train"][name], batches
            )
            check = _Fit(
                layer,
                _student_calls(student, layer, validation, objective),
                targets["validation"][name],
                validation,
            )
            done[name] = _train(fit, check, list(own[name].values()), steps, lr, check_every, gen)
            if progress is not None:
                progress()
    finally:
        for p, g in grads.items():
            p.requires_grad_(g)
        student.train(was_training)
    return done


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
