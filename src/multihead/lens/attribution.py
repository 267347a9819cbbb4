"""Direct logit attribution of every head: :func:`logit_attribution`, for causal language models.

Dimensions: N modules, B batch, H heads, L length, E model width, V vocabulary.

The logit of a target at one position is ``u . unembed_in`` (+ the unembedding's bias), where ``unembed_in`` is
the final norm's output. With the norm's scale frozen at this run's value, the norm is affine in its input:
``norm(x) = g * C(x) + b`` (g (E,): the weight times the frozen 1/scale, C: centring for a LayerNorm, the
identity for an RMSNorm). The residual stream x is the sum of every head's result and everything else, so
head h contributes ``u . (g * C(result_h))`` exactly, and ``.rest`` is the remainder (embeddings, MLPs, biases,
the norm's b and the unembedding's bias).

The norm is not recognised by its class: it is the last module (with only (E,) parameters) whose output feeds
the unembedding, and g and the centring are *probed*: the norm is called on inputs with this run's mean and
variance (so its scale is the run's), ``mean +- std * s`` for a +-1 pattern s, and
``g = (norm(mean + std s) - norm(mean - std s)) / (2 std s)``; it centres if shifting its input leaves its
output unchanged. RMSNorm, Gemma's ``(1 + w)`` RMSNorm and LayerNorm with or without bias all pass; a norm that
is not affine at a frozen scale is refused by name.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from .cache import cache
from .sites import run


@dataclass(frozen=True)
class Attribution:
    """``heads`` (N, H, B): each head's direct share of the target logit; ``rest`` (B,): the remainder;
    ``logit`` (B,): the run's target logit (``heads.sum((0, 1)) + rest``); ``names``: the N modules."""

    names: list[str]
    heads: Tensor
    rest: Tensor
    logit: Tensor

    def _repr_html_(self) -> str | None:
        """Drawn in a notebook by :func:`multihead.viz.show`."""
        from ..viz.show import show

        return show(self)._repr_html_()

    def _repr_png_(self) -> bytes | None:
        from ..viz.show import show

        return show(self)._repr_png_()


def logit_attribution(model: nn.Module, inputs: object, target: Tensor, *, position: int = -1) -> Attribution:
    """Each head's result at ``position`` through the final norm (scale frozen from this run) and the unembedding.

    Args:
        model: a causal language model with ``get_output_embeddings()`` (a Hugging Face ``...ForCausalLM`` on
            ``attn_implementation="multihead"``), pre-norm (each head's result is added to the residual stream).
        inputs: its inputs (a dict of keyword inputs, or input ids (B, L)).
        target: token ids (B,) (the logit of each example's token) or a direction (V,) over the vocabulary
            (e.g. ``one_hot(a) - one_hot(b)`` for a logit difference).
        position: the query position read (default: the last).

    Returns:
        :class:`Attribution` with ``heads`` (N, H, B) and ``rest`` (B,), where ``heads.sum((0, 1)) + rest`` is
        the run's target logit. Modules with fewer heads than others are padded with 0.
    """
    if not isinstance(position, int) or isinstance(position, bool):
        raise TypeError(
            f"position must be an int (a query position; -1: the last), got {type(position).__name__}"
        )
    unembed = _unembedding(model)
    width = unembed.weight.shape[1]
    with torch.no_grad():
        with _final_norm(model, unembed, width) as seen, cache(model, "result") as c:
            run(model, inputs)
        if "unembed" not in seen:
            raise ValueError("the run did not call the model's output embeddings: nothing to attribute")
        norm, x, y = _checked_norm(seen, position)  # x, y (B, L, E)
        g, centred = frozen_norm(norm, x[:, position])  # (B, E)
        u, logit = _target(unembed, seen["unembed"][1][:, position], target, x.shape[0])  # (B, E), (B,)
        names = c.names()
        parts = [
            _head_logits(name, c.calls(name, "result"), position, x.shape[-1], centred, g * u)
            for name in names
        ]
        h = max(p.shape[0] for p in parts)
        heads = torch.stack(
            [torch.nn.functional.pad(p, (0, 0, 0, h - p.shape[0])) for p in parts]
        )  # (N, H, B)
    return Attribution(names, heads, logit - heads.sum((0, 1)), logit)


def _head_logits(
    name: str, calls: list[Tensor], position: int, width: int, centred: bool, direction: Tensor
) -> Tensor:
    """(H, B): each head's result at ``position`` through the frozen norm and the unembedding
    (``direction`` = g * u, (B, E)); refused where the module ran more than once or its results are not in the
    stream the final norm reads."""
    if len(calls) != 1:
        raise ValueError(
            f"{name!r} ran {len(calls)} times in one forward; attribution needs one call per module"
        )
    r = calls[0][:, :, position]  # (B, H, E)
    if r.shape[-1] != width:
        raise ValueError(
            f"logit_attribution reads each head's result in the stream the final norm reads, but {name!r}'s "
            f"results are {r.shape[-1]} wide and the norm before the unembedding reads {width}: a layer sits "
            f"between the residual stream and that norm (as in ELECTRA's generator head), so a head's share of "
            f"the logit is not linear; read the heads' results with lens.cache(model, 'result') instead"
        )
    r = r - r.mean(-1, keepdim=True) if centred else r
    return (r * direction[:, None]).sum(-1).T  # (H, B)


def _unembedding(model: nn.Module) -> nn.Module:
    get = getattr(model, "get_output_embeddings", None)
    unembed = get() if callable(get) else None
    weight = getattr(unembed, "weight", None)
    if not isinstance(weight, Tensor) or weight.dim() != 2:
        raise TypeError(
            f"logit_attribution needs a causal language model whose get_output_embeddings() gives the "
            f"unembedding layer (weight (V, E)); {type(model).__name__} has none"
        )
    return unembed  # type: ignore[return-value]


def _is_norm(module: nn.Module, width: int) -> bool:
    """A leaf module whose parameters are all (E,) vectors (LayerNorm, RMSNorm and kin), or a leaf without
    parameters whose class says it is a norm (OLMo's LayerNorm, nanochat's RMSNorm: no affine weights). A wrong
    pick is caught: the probe of :func:`frozen_norm` refuses what does not act as a norm."""
    if any(True for _ in module.children()):
        return False
    params = list(module.parameters(recurse=False))
    if not params:
        return "norm" in type(module).__name__.lower()
    return all(p.shape == (width,) for p in params)


@contextmanager
def _final_norm(model: nn.Module, unembed: nn.Module, width: int) -> Iterator[dict[str, Any]]:
    """Record, when the unembedding runs, the last norm-like call before it and the unembedding's input/output."""
    seen: dict[str, Any] = {}
    last: list[tuple[nn.Module, Tensor, Tensor]] = []

    def on_norm(module: nn.Module, inputs: tuple[Any, ...], output: Any) -> None:
        if inputs and isinstance(inputs[0], Tensor) and isinstance(output, Tensor):
            last[:] = [(module, inputs[0], output)]

    def on_unembed(module: nn.Module, inputs: tuple[Any, ...], output: Tensor) -> None:
        seen["unembed"] = (inputs[0], output)
        if last:
            seen["norm"] = last[0]

    handles = [m.register_forward_hook(on_norm) for m in model.modules() if _is_norm(m, width)]
    handles.append(unembed.register_forward_hook(on_unembed))
    try:
        yield seen
    finally:
        for handle in handles:
            handle.remove()


def _checked_norm(seen: dict[str, Any], position: int) -> tuple[nn.Module, Tensor, Tensor]:
    """The final norm, its input and output (B, L, E), checked to be what the unembedding reads at ``position``."""
    fed = seen["unembed"][0]  # (B, L', E)
    norm = seen.get("norm")
    ok = norm is not None and norm[2].shape == fed.shape
    if ok:
        length = fed.shape[1]
        if not -length <= position < length:
            raise ValueError(f"position must be in [-{length}, {length}) (the run's queries), got {position}")
        ok = torch.equal(norm[2][:, position], fed[:, position])
    if not ok:
        raise ValueError(
            "logit_attribution needs the unembedding fed by a final norm (LayerNorm, RMSNorm) over every position; "
            "the layer feeding it is not one (or the logits were cut: do not pass logits_to_keep)"
        )
    return norm  # type: ignore[no-any-return]


def _signs(width: int, like: Tensor) -> Tensor:
    """Two +-1 patterns (2, E), each of mean 0 and variance 1, not both 0 anywhere (E odd: one 0 each)."""
    s = torch.ones(width, dtype=like.dtype, device=like.device)
    s[1::2] = -1.0
    if width % 2:
        s[-1] = 0.0
        s = s * (width / (width - 1)) ** 0.5
    return torch.stack([s, s.roll(1)])  # (2, E)


def frozen_norm(norm: nn.Module, x: Tensor) -> tuple[Tensor, bool]:
    """The norm at its scale frozen at ``x`` (B, E): ``(g (B, E), centred)``, with ``norm(x) = g * C(x) + b``.

    Probed on inputs of ``x``'s mean and variance (hence its scale): see the module docstring. Refused by name
    where ``norm(x)`` is not reproduced (a norm that is not affine at a frozen scale).
    """
    mean = x.mean(-1, keepdim=True)  # (B, 1)
    std = x.var(-1, unbiased=False, keepdim=True).sqrt()  # (B, 1)
    gs, halves = [], []
    for s in _signs(x.shape[-1], x):
        up, down = norm(mean + std * s), norm(mean - std * s)  # (B, E)
        gs.append((up - down) / (2 * std * s))  # (B, E); inf/nan where s == 0
        halves.append((up + down) / 2)
    first = _signs(x.shape[-1], x)[0] != 0
    g = torch.where(first, gs[0], gs[1])  # (B, E)
    y = norm(x)
    shifted = norm(x + std)
    scale = y.abs().amax().clamp_min(1e-30)
    tol = max(1e-3, 4 * torch.finfo(y.dtype).eps)  # the norm's own rounding (bfloat16: 0.03)
    centred = bool((shifted - y).abs().amax() <= tol * scale)
    b = torch.where(first, halves[0], halves[1]) - (0.0 if centred else g * mean)  # (B, E)
    rebuilt = g * (x - mean if centred else x) + b
    if not torch.allclose(rebuilt, y, rtol=tol, atol=tol / 10 * float(scale)):
        raise ValueError(
            f"the final norm {type(norm).__name__} is not affine in its input at a frozen scale (not a LayerNorm "
            f"or RMSNorm): its heads' logits cannot be separated"
        )
    return g, centred


def _target(unembed: nn.Module, logits: Tensor, target: Tensor, batch: int) -> tuple[Tensor, Tensor]:
    """``(u (B, E), logit (B,))``: the unembedding direction of the target and the run's target logit;
    ``logits`` (B, V) at the position."""
    weight = unembed.weight  # (V, E)
    vocab = weight.shape[0]
    if isinstance(target, Tensor) and not target.is_floating_point() and target.shape == (batch,):
        ids = target.to(weight.device)
        return weight[ids], logits.gather(1, ids[:, None].to(logits.device))[:, 0]
    if isinstance(target, Tensor) and target.is_floating_point() and target.shape == (vocab,):
        d = target.to(weight)
        return (d @ weight).expand(batch, -1), logits @ d.to(logits)
    got = tuple(target.shape) if isinstance(target, Tensor) else type(target).__name__
    raise ValueError(
        f"target must be token ids of shape ({batch},) (one per example) or a float direction of shape ({vocab},) "
        f"over the vocabulary, got {got}"
    )
