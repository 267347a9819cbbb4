"""One reader of a Hugging Face Llama fed its own residual stream, by hand: finite differences of a graph's
reader columns, and exact path patching of one edge (``bench_circuits.py``, ``circuits_induction.py``).

A reader (a query head's q, a key/value head's k or v, an MLP, the logits) reads the residual stream x through
its norm and its rows of a projection. Here the corrupted run is repeated with that one reader fed
``x + eps * delta`` instead of x (x as this run has it; the other readers keep x): the q, k or v projection's
output columns of that head are recomputed from ``norm(x + eps * delta)``, the MLP's input or the unembedding's
input replaced by ``norm(x + eps * delta)``. Nothing of ``multihead.lens``'s circuits code runs here.

* ``delta`` = clean residual - corrupted residual at the reader: d metric / d eps at 0 is the reader's column
  sum of the graph (every upstream writer's edge into it), checked by central differences;
* ``delta`` = one writer's clean output - its corrupted output, eps = 1: the exact effect of patching that one
  edge (path patching), which the edge's score estimates to first order.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import Tensor, nn

from multihead import lens
from multihead.lens import Node

Metric = Callable[[object], Tensor]


def _layer(model: nn.Module, node: Node) -> nn.Module:
    return model.model.layers[int(node.name.split(".")[2])]


def _norm_of(model: nn.Module, node: Node) -> nn.Module:
    """The norm the reader reads the residual through (its input is the residual x at the reader)."""
    if node.kind == "logits":
        return model.model.norm
    layer = _layer(model, node)
    return layer.post_attention_layernorm if node.kind == "mlp" else layer.input_layernorm


@contextmanager
def _fed(model: nn.Module, reader: Node, delta: Tensor, eps: float) -> Iterator[None]:
    """Within: ``reader`` alone reads ``x + eps * delta`` (delta (B, L, E), x the residual of the run)."""
    norm, seen, handles = _norm_of(model, reader), {"mine": False}, []

    def record(m: nn.Module, args: tuple) -> None:
        if not seen["mine"]:  # the model's own call, not the one below
            seen["x"] = args[0]

    handles.append(norm.register_forward_pre_hook(record))

    def moved() -> Tensor:
        seen["mine"] = True
        try:
            return norm(seen["x"] + eps * delta.to(seen["x"].dtype))
        finally:
            seen["mine"] = False

    if reader.kind in ("q", "k", "v"):
        attn = _layer(model, reader).self_attn
        proj = getattr(attn, f"{reader.kind}_proj")
        d = attn.head_dim
        cols = slice(reader.head * d, (reader.head + 1) * d)

        def columns(m: nn.Module, args: tuple, out: Tensor) -> Tensor:
            out = out.clone()
            out[..., cols] = nn.functional.linear(moved(), proj.weight, proj.bias)[..., cols]
            return out

        handles.append(proj.register_forward_hook(columns))
    else:
        target = _layer(model, reader).mlp if reader.kind == "mlp" else model.lm_head
        handles.append(target.register_forward_pre_hook(lambda m, args: (moved(),) + tuple(args[1:])))
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def _rms_norm(self: nn.Module, x: Tensor) -> Tensor:
    """Llama's RMSNorm in the input's own dtype (Hugging Face's rounds through float32)."""
    return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))


def exact_norms(model: nn.Module) -> nn.Module:
    """``model`` (a float64 Llama) with every RMSNorm computed in float64: Hugging Face's rounds its input
    to float32, which would put float32 noise into every finite difference. Returns the model."""
    for m in model.modules():
        if type(m).__name__.endswith("RMSNorm"):
            m.forward = types.MethodType(_rms_norm, m)
    return model


def metric_fed(
    model: nn.Module, inputs: dict, metric: Metric, reader: Node, delta: Tensor, eps: float
) -> float:
    """The metric's batch mean with ``reader`` alone reading ``x + eps * delta`` (no gradient)."""
    with torch.no_grad(), _fed(model, reader, delta, eps):
        return float(metric(model(**inputs)).mean())


def residual_at(model: nn.Module, inputs: dict, reader: Node) -> Tensor:
    """(B, L, E): the residual stream the reader reads (its norm's input) in the run of ``inputs``."""
    seen = {}
    h = _norm_of(model, reader).register_forward_pre_hook(lambda m, args: seen.__setitem__("x", args[0]))
    try:
        with torch.no_grad():
            model(**inputs)
    finally:
        h.remove()
    return seen["x"]


def column_by_differences(
    model: nn.Module, clean: dict, corrupted: dict, metric: Metric, reader: Node, step: float = 1e-3
) -> float:
    """d metric / d eps at eps = 0, ``reader`` fed corrupted + eps (clean - corrupted residual): central
    differences (error O(step^2))."""
    delta = residual_at(model, clean, reader) - residual_at(model, corrupted, reader)
    up, down = (metric_fed(model, corrupted, metric, reader, delta, s) for s in (step, -step))
    return (up - down) / (2 * step)


def writer_output(model: nn.Module, inputs: dict, writer: Node) -> Tensor:
    """(B, L, E): a writer's output in the run of ``inputs`` (a head's result through ``lens.cache``; the
    embedding's and an MLP's by a forward hook on the module)."""
    if writer.kind == "head":
        with torch.no_grad(), lens.cache(model, points="result", modules=[writer.name]) as c:
            model(**inputs)
        return c[writer.name, "result"][:, writer.head]
    seen = {}
    module = model.get_submodule(writer.name)
    h = module.register_forward_hook(lambda m, args, out: seen.__setitem__("y", out))
    try:
        with torch.no_grad():
            model(**inputs)
    finally:
        h.remove()
    return seen["y"]


def path_patch(
    model: nn.Module, clean: dict, corrupted: dict, metric: Metric, writer: Node, reader: Node
) -> float:
    """The exact effect on the metric's batch mean of patching one edge: the corrupted run with ``reader``
    alone reading the writer's clean output in place of its corrupted one."""
    delta = writer_output(model, clean, writer) - writer_output(model, corrupted, writer)
    base = metric_fed(model, corrupted, metric, reader, delta, 0.0)
    return metric_fed(model, corrupted, metric, reader, delta, 1.0) - base
