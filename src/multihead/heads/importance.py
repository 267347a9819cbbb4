"""Head gates (the inspection seam), masking heads, and head importance scores.

Dimensions: B batch, H query heads, Lq query length, Dv value head dim.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager

import torch
from torch import Tensor, nn

from ..nn import seam
from .naming import HeadSpec, _resolve, attention_modules, check_routed, module_heads

# ------------------------------------------------------------------------------------------------
# Gates
# ------------------------------------------------------------------------------------------------


class _Gates(seam.Inspector):
    """Multiplies each head's output (B, H, Lq, Dv) by a gate from ``make_gate(name, heads)``."""

    def __init__(self, model: nn.Module, make_gate: Callable[[str, Tensor], Tensor | None]) -> None:
        self.names = {m: name for name, m in attention_modules(model).items()}
        self.make_gate = make_gate

    def on_heads(self, module: nn.Module, heads: Tensor, weights: Tensor | None) -> Tensor:
        name = self.names.get(module)
        gate = None if name is None else self.make_gate(name, heads)
        return heads if gate is None else heads * gate  # (B, H, Lq, Dv) * (B or 1, H, 1, 1)


@contextmanager
def masked(model: nn.Module, heads: HeadSpec) -> Iterator[nn.Module]:
    """Within the block, the listed heads of ``model`` output zeros (the gated model); yields ``model``.

    A masked head still computes its attention, but contributes nothing to ``out_proj``: this is
    exactly what :func:`prune` computes with the head removed. Blocks compose with each other and with
    every other inspector (:mod:`multihead.nn.seam`): nested blocks mask the union of their heads, and a
    capture, importance scores or a user inspector inside the block see the masked model. Example::

        with heads.masked(model, {"encoder.layers.0.self_attn": [2]}):
            logits = model(src, tgt)
    """
    spec = _resolve(model, heads)
    check_routed(model)
    modules = attention_modules(model)
    # one (H,) tensor per masked module, made here: compiled code takes it as an input, so masking other
    # heads of the same modules reuses the compiled graph instead of recompiling
    gates = {name: torch.ones(module_heads(modules[name])[0]) for name, idx in spec.items() if idx}
    for name, gate in gates.items():
        gate[spec[name]] = 0.0

    def make_gate(name: str, h: Tensor) -> Tensor | None:
        gate = gates.get(name)
        return None if gate is None else gate.to(h)[None, :, None, None]  # (1, H, 1, 1)

    with seam.inspecting(_Gates(model, make_gate)):
        yield model


# ------------------------------------------------------------------------------------------------
# Importance
# ------------------------------------------------------------------------------------------------


@contextmanager
def _eval_mode(model: nn.Module) -> Iterator[None]:
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)


def importance(
    model: nn.Module,
    batches: Iterable[object],
    loss_fn: Callable[[nn.Module, object], Tensor],
    *,
    normalize: bool = True,
) -> dict[str, Tensor]:
    """Head importance of Michel et al. (2019): ``I_h = E_x |dL(x) / dxi_h|`` at gates ``xi = 1``.

    Args:
        model: any module holding attention modules (:class:`MultiHeadAttention`, or a Hugging Face model
            running on multihead), run in eval mode here, restored after.
        batches: an iterable of whatever ``loss_fn`` takes (e.g. ``(src, tgt)`` tensors).
        loss_fn: ``loss_fn(model, batch)`` -> scalar loss, the *mean* over the batch's examples.
        normalize: divide each module's scores by their L2 norm (the paper's per-layer normalisation),
            so that layers compare on one scale.

    Returns:
        ``{module name: (H,) float32 scores}``; higher = more important. :func:`rank` orders them.

    Each example gets its own gate (B, H), so the absolute value is taken per example, as in the paper,
    not of a batch-averaged gradient (which lets opposite signs cancel). A module called several times in
    one forward (a decoder stepping with a cache) sums the gradients of its calls. Only the gates get
    gradients: the parameters' ``.grad`` are left untouched. Called inside :func:`masked` (or another
    inspector's block), it scores the model as that block changes it; ``loss_fn`` may open blocks too.
    """
    modules = attention_modules(model)
    if not modules:
        raise ValueError("model has no attention modules multihead can score")
    check_routed(model)
    totals = {name: torch.zeros(module_heads(m)[0], dtype=torch.float64) for name, m in modules.items()}
    n_batches = 0
    calls: list[tuple[str, Tensor]] = []  # (module name, gate (B, H, 1, 1)) of each call in one batch

    @torch.compiler.disable  # a leaf that needs grad: made outside a compiled graph (one clean break)
    def make_gate(name: str, h: Tensor) -> Tensor:
        gate = torch.ones(h.shape[0], h.shape[1], 1, 1, dtype=h.dtype, device=h.device)  # (B, H, 1, 1)
        gate.requires_grad_(True)
        calls.append((name, gate))
        return gate

    with _eval_mode(model), torch.enable_grad():
        for batch in batches:
            calls.clear()
            with seam.inspecting(_Gates(model, make_gate)):
                loss = loss_fn(model, batch)
            if not isinstance(loss, Tensor) or loss.numel() != 1:
                raise ValueError(
                    f"loss_fn must return a scalar tensor (the mean loss over the batch), got "
                    f"{type(loss).__name__}{'' if not isinstance(loss, Tensor) else tuple(loss.shape)}"
                )
            if not calls:
                raise ValueError("loss_fn ran no attention module of model: nothing to score")
            grads = torch.autograd.grad(loss, [g for _, g in calls], allow_unused=True)
            per_module: dict[str, Tensor] = {}
            for (name, gate), grad in zip(calls, grads):
                grad = torch.zeros_like(gate) if grad is None else grad
                prev = per_module.get(name)
                per_module[name] = grad if prev is None or prev.shape != grad.shape else prev + grad
            for name, grad in per_module.items():
                # batch-mean loss: sum_b |dL/dxi_bh| = mean over the batch's examples of |dL_b/dxi_h|
                totals[name] += grad.detach().abs().sum(dim=(0, 2, 3)).double().cpu()  # (H,)
            n_batches += 1
    if n_batches == 0:
        raise ValueError("batches is empty: importance needs at least one batch")
    scores = {name: (t / n_batches).float() for name, t in totals.items()}
    if normalize:
        scores = {name: s / s.norm().clamp_min(1e-20) for name, s in scores.items()}
    return scores


def masking_drop(
    model: nn.Module,
    metric: Callable[[nn.Module], float],
    *,
    heads: HeadSpec | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> dict[str, Tensor]:
    """The metric lost when each head alone is masked: ``metric(model) - metric(model with head h masked)``.

    Args:
        model: the model (run in eval mode here, restored after).
        metric: ``metric(model)`` -> float, higher is better (e.g. exact-match accuracy in %).
        heads: which heads to try (default: all); the others get NaN.
        progress: called as ``progress(done, total)`` after each evaluation.

    Returns:
        ``{module name: (H,) float32 drops}``; a large drop = an important head. Costs one evaluation
        per head (plus one), so use it to check :func:`importance`, not instead of it.
    """
    modules = attention_modules(model)
    spec = (
        {n: list(range(module_heads(m)[0])) for n, m in modules.items()}
        if heads is None
        else _resolve(model, heads)
    )
    total = sum(len(v) for v in spec.values())
    drops = {name: torch.full((module_heads(m)[0],), float("nan")) for name, m in modules.items()}
    with _eval_mode(model):
        base = float(metric(model))
        done = 0
        for name, idx in spec.items():
            for h in idx:
                with masked(model, {name: [h]}):
                    drops[name][h] = base - float(metric(model))
                done += 1
                if progress is not None:
                    progress(done, total)
    return drops


def rank(scores: Mapping[str, Tensor]) -> list[tuple[str, int]]:
    """All ``(module name, head)`` pairs from least to most important (NaN scores last)."""
    flat = [(float(s), name, h) for name, t in scores.items() for h, s in enumerate(t.tolist())]
    flat.sort(key=lambda x: (math.isnan(x[0]), x[0]))
    return [(name, h) for _, name, h in flat]
