"""The residual stream of a pre-norm stack, found on a run: its layers, each layer's attention, MLP and the norms
they read through, the final norm, and the check that the stream is a sum of writers.

Dimensions: B batch, L length, E model width, H query heads, Hkv key/value heads.

Nothing is assumed from an architecture's class. The layers are the items of the ``nn.ModuleList`` holding the
attention modules (:func:`~multihead.heads.naming.layer_of`), one attention module each. Within a layer, among its
direct children with parameters: the one holding the attention module, the norms (leaf modules whose parameters
are (E,) vectors, as :func:`~multihead.lens.attribution._is_norm` finds them), and the MLP: the one child left, or
the children left when they run one after the other (torch's layers: linear1, linear2; the MLP's nodes are then
named by the last, whose output is the MLP's).
Which norm feeds which, and the sums, are read off a run (:func:`find_stream`), and the structure is refused,
by name and saying why, unless on that run, for every layer (x its input):

* the attention's input is a norm's output, that norm's input is x (else: post-norm, as BERT and
  ``norm_first=False`` layers);
* the attention's output is the sum of its heads' results plus the projection's bias (the heads are writers);
* the MLP's input is a norm's output, that norm's input is x + attention output (else: a parallel block, as
  GPT-J, Falcon and GPT-NeoX, where both read x);
* the layer's output is x + attention output + MLP output (else: a norm after a sublayer, as Gemma 2).

The stream entering the first layer is the "embed" writer (the embeddings with whatever the model adds before
the first layer, e.g. positions: constant between two runs of the same length). The logits reader reads the input
of the final norm, the first norm to run on the last layer's output (or, with none, the last layer's output).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from ..heads.naming import Projection, layer_of, module_heads
from .attribution import _is_norm
from .cache import cache
from .path import embedding_name
from .sites import run


@dataclass(frozen=True)
class Layer:
    """One layer of the stream: its module, its attention module (``attention``: the lens's name, ``block``:
    the child of the layer holding it) and the norm it reads through, its MLP and that MLP's norm."""

    name: str
    module: nn.Module
    attention: str
    block: nn.Module
    attention_norm: nn.Module
    mlp_name: str
    mlp: nn.Module
    mlp_norm: nn.Module
    heads: int
    kv_heads: int


@dataclass(frozen=True)
class Stream:
    """The layers in run order, the final norm (None: the logits reader reads the last layer's output), the
    names of the embed writer and the logits reader, and the model width E."""

    layers: list[Layer]
    final_norm: nn.Module | None
    embed_name: str
    logits_name: str
    width: int


class StreamError(ValueError):
    """The model's residual stream is not a sum of writers (edges are not defined on it)."""


def hidden_of(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Tensor | None:
    """The hidden states a layer or block is called with: the first positional tensor, else the keyword
    ``hidden_states``, else the first 3-dim floating-point keyword tensor."""
    if args and isinstance(args[0], Tensor):
        return args[0]
    found = kwargs.get("hidden_states")
    if isinstance(found, Tensor):
        return found
    return next(
        (v for v in kwargs.values() if isinstance(v, Tensor) and v.is_floating_point() and v.dim() == 3), None
    )


def with_hidden(
    args: tuple[Any, ...], kwargs: dict[str, Any], new: Tensor
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``(args, kwargs)`` with the hidden states (as :func:`hidden_of` finds them) replaced by ``new``."""
    if args and isinstance(args[0], Tensor):
        return (new, *args[1:]), kwargs
    old = hidden_of((), kwargs)
    key = next(k for k, v in kwargs.items() if v is old)
    return args, {**kwargs, key: new}


def first_tensor(value: Any) -> Tensor | None:
    """``value`` itself if a tensor, else the first item of a tuple/list (an HF block's (output, weights))."""
    if isinstance(value, Tensor):
        return value
    if isinstance(value, (tuple, list)) and value and isinstance(value[0], Tensor):
        return value[0]
    return None


@contextmanager
def hooked(pairs: list[tuple[nn.Module, str, Callable[..., Any]]]) -> Iterator[None]:
    """Install ``(module, kind, hook)`` for the block: kind "pre", "pre_kw", "post" or "post_kw"."""
    handles = []
    try:
        for module, kind, hook in pairs:
            kw = kind.endswith("_kw")
            if kind.startswith("pre"):
                handles.append(module.register_forward_pre_hook(hook, with_kwargs=kw))
            else:
                handles.append(module.register_forward_hook(hook, with_kwargs=kw))
        yield
    finally:
        for handle in handles:
            handle.remove()


def _layers_of(model: nn.Module, found: Mapping[str, nn.Module], names: list[str]) -> list[tuple[str, str]]:
    """``[(layer name, attention name)]`` for every attention module, refused where one is in no stack of
    layers or a layer holds several (cross-attention)."""
    pairs: dict[str, str] = {}
    for name in names:
        layer = layer_of(model, name)
        if layer is None:
            raise StreamError(
                f"edges need a stack of layers (an nn.ModuleList), and the attention module {name!r} is in none"
            )
        if layer in pairs:
            raise StreamError(
                f"the layer {layer!r} holds several attention modules ({pairs[layer]!r} and {name!r}: a "
                f"cross-attention reads another stack's output); edges are defined on a stack whose layers "
                f"hold one attention module each (decoder-only or encoder-only)"
            )
        pairs[layer] = name
    return list(pairs.items())


@dataclass
class _Seen:
    """One layer's calls on the finding run: its input and output, and its children's (child, input, output)
    in call order."""

    input: Tensor | None = None
    output: Tensor | None = None
    calls: list[tuple[nn.Module, Tensor | None, Tensor | None]] = field(default_factory=list)


def _recorders(layer: nn.Module, seen: _Seen, width: int) -> list[tuple[nn.Module, str, Callable[..., Any]]]:
    def on_in(module: nn.Module, args: tuple, kwargs: dict) -> None:
        seen.input = hidden_of(args, kwargs)

    def on_out(module: nn.Module, args: tuple, output: Any) -> None:
        seen.output = first_tensor(output)

    def on_child(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        seen.calls.append((module, hidden_of(args, kwargs), first_tensor(output)))

    hooks: list[tuple[nn.Module, str, Callable[..., Any]]] = [
        (layer, "pre_kw", on_in),
        (layer, "post", on_out),
    ]
    for child in layer.children():
        if any(True for _ in child.parameters()) or _is_norm(child, width):
            hooks.append((child, "post_kw", on_child))
    return hooks


def _sum(*parts: Tensor | None) -> Tensor | None:
    """The sum of tensors of one shape; None where one is missing or the shapes differ (nothing to compare)."""
    if any(p is None for p in parts) or len({p.shape for p in parts}) != 1:  # type: ignore[union-attr]
        return None
    return sum(parts[1:], parts[0])  # type: ignore[arg-type]


def _close(a: Tensor | None, b: Tensor | None) -> bool:
    if a is None or b is None or a.shape != b.shape:
        return False
    eps = torch.finfo(a.dtype).eps if a.is_floating_point() else 0.0
    tol = min(64 * eps, 1e-2)
    scale = float(b.detach().abs().amax().clamp_min(1e-30))
    return bool(torch.allclose(a, b, rtol=tol, atol=tol * scale))


def find_stream(
    model: nn.Module, inputs: object, found: Mapping[str, nn.Module]
) -> tuple[Stream, list[Tensor], Any]:
    """The stream of ``model`` (attention modules ``found``) found and checked on a run of ``inputs``; the
    writers' outputs on that run, one block (n, B, L, E) each (embed (1), each layer's heads (H) and MLP (1));
    the run's output."""
    pairs = _layers_of(model, found, list(found))
    layers = [model.get_submodule(name) for name, _ in pairs]
    seen = [_Seen() for _ in layers]
    width = _width(model, found[pairs[0][1]])
    final: list[tuple[nn.Module, Tensor]] = []
    inside = {id(m) for layer in layers for m in layer.modules()}

    def on_norm(module: nn.Module, args: tuple, output: Any) -> None:
        if seen[-1].output is not None and not final and args and isinstance(args[0], Tensor):
            final.append((module, args[0]))

    hooks = [h for layer, s in zip(layers, seen) for h in _recorders(layer, s, width)]
    hooks += [(m, "post", on_norm) for m in model.modules() if id(m) not in inside and _is_norm(m, width)]
    with torch.no_grad(), hooked(hooks), cache(model, "result", modules=[a for _, a in pairs]) as c:
        out = run(model, inputs)
    checked = [
        _check_layer(model, name, layer, found[attention], attention, s, c.calls(attention, "result"), width)
        for (name, attention), layer, s in zip(pairs, layers, seen)
    ]
    norm = final[0][0] if final and torch.equal(final[0][1], seen[-1].output) else None  # type: ignore[arg-type]
    stream = Stream(checked, norm, embedding_name(model), _logits_name(model, norm, pairs[-1][0]), width)
    blocks = [seen[0].input[None]]  # type: ignore[index]
    for layer, s in zip(checked, seen):
        blocks.append(c[layer.attention, "result"].transpose(0, 1))  # (H, B, L, E)
        blocks.append(next(o for m, _, o in reversed(s.calls) if m is layer.mlp)[None])  # type: ignore[index]
        s.calls.clear()
    return stream, blocks, out


def _width(model: nn.Module, attention: nn.Module) -> int:
    get = getattr(model, "get_input_embeddings", None)
    embed = get() if callable(get) else None
    weight = getattr(embed, "weight", None)
    if isinstance(weight, Tensor) and weight.dim() == 2:
        return int(weight.shape[1])
    return int(
        getattr(attention, "embed_dim", 0) or getattr(attention, "hidden_size", 0) or 0
    ) or _probe_width(attention)


def _probe_width(attention: nn.Module) -> int:
    weights = [p for p in attention.parameters() if p.dim() == 2]
    if not weights:
        raise StreamError(f"cannot tell the model width of {type(attention).__name__} (no weight matrices)")
    return int(weights[-1].shape[0])


def _logits_name(model: nn.Module, norm: nn.Module | None, last_layer: str) -> str:
    get = getattr(model, "get_output_embeddings", None)
    unembed = get() if callable(get) else None
    target = unembed if isinstance(unembed, nn.Module) else norm
    if target is None:
        return last_layer
    return next(name for name, m in model.named_modules() if m is target)


def _check_layer(
    model: nn.Module,
    name: str,
    layer: nn.Module,
    attention: nn.Module,
    attention_name: str,
    seen: _Seen,
    results: list[Tensor],
    width: int,
) -> Layer:
    """The :class:`Layer` read off one layer's calls, or a :class:`StreamError` saying what is not pre-norm."""
    if seen.input is None or seen.output is None or len(results) != 1:
        raise StreamError(f"the layer {name!r} did not run once with its hidden states on the run")
    block = next(child for child in layer.children() if any(m is attention for m in child.modules()))
    called = [child for child, _, _ in seen.calls]
    norms = {id(child) for child in called if _is_norm(child, width)}
    attention_norm, attn_in, attn_out = _fed_by(seen, block, norms, name, "attention")
    x = seen.input
    if attention_norm is None or not torch.equal(attn_in, x):  # type: ignore[arg-type]
        raise StreamError(
            f"the layer {name!r} is post-norm: its attention does not read a norm of the layer's input (as in "
            f"BERT and norm_first=False layers, a norm runs on the residual sum; in OLMo 2, on the attention's "
            f"output), so the residual stream is not a sum of writers and edges are not defined"
        )
    parts = _mlp_parts(seen, block, norms, layer, name)
    mlp = parts[-1]  # its output is the MLP's (the writer)
    mlp_norm, mlp_in, _ = _fed_by(seen, parts[0], norms, name, "MLP")
    mlp_out = next(o for c, _, o in reversed(seen.calls) if c is mlp)
    if mlp_norm is None or not _close(mlp_in, _sum(x, attn_out)):
        why = (
            "a parallel block: its MLP reads the layer's input, as the attention does (GPT-J, Falcon, GPT-NeoX)"
            if _close(mlp_in, x)
            else "not a sum of writers: its MLP does not read a norm of its input + the attention's output (a "
            "norm on the attention's output before the residual sum, as Gemma 2's post-attention norm)"
        )
        raise StreamError(
            f"the layer {name!r} is {why}; the MLP is not downstream of the attention on the residual stream, "
            f"and edges are not defined"
        )
    if not _close(seen.output, _sum(x, attn_out, mlp_out)):
        raise StreamError(
            f"the output of the layer {name!r} is not its input + attention output + MLP output (a norm after a "
            f"sublayer, as Gemma 2's, a scaled residual, or an MLP whose output is not shaped like the stream, as "
            f"Llama 4's mixture of experts' flattened tokens): the stream is not a sum of writers, edges are not "
            f"defined"
        )
    mlp_name = next(n for n, c in model.named_modules() if c is mlp)
    h, hkv = module_heads(attention)
    return Layer(name, layer, attention_name, block, attention_norm, mlp_name, mlp, mlp_norm, h, hkv)


def _mlp_parts(
    seen: _Seen, block: nn.Module, norms: set[int], layer: nn.Module, name: str
) -> list[nn.Module]:
    """The children with parameters other than the attention and the norms, in call order: the MLP (one child,
    or several run one after the other, as torch's linear1 and linear2)."""
    parts = list({id(c): c for c, _, _ in seen.calls if c is not block and id(c) not in norms}.values())
    order = [i for i, (c, _, _) in enumerate(seen.calls) if any(c is p for p in parts)]
    if not parts or order != list(range(order[0], order[0] + len(order))) or len(order) != len(parts):
        listed = [n for n, c in layer.named_children() if any(c is p for p in parts)]
        raise StreamError(
            f"cannot find the MLP of the layer {name!r}: besides its attention and norms, the children that ran "
            f"with parameters are {listed}, not one MLP (one child, or children run once each one after the "
            f"other); edges need a layer of one attention and one MLP"
        )
    return parts


def _fed_by(
    seen: _Seen, child: nn.Module, norms: set[int], name: str, what: str
) -> tuple[nn.Module | None, Tensor | None, Tensor]:
    """The norm whose output ``child`` reads (None: none), that norm's input and the child's output."""
    index = next(i for i, (c, _, _) in enumerate(seen.calls) if c is child)
    _, fed, out = seen.calls[index]
    if out is None or fed is None:
        raise StreamError(
            f"the {what} of the layer {name!r} does not take and return hidden states (B, L, E)"
        )
    before = [(c, i, o) for c, i, o in seen.calls[:index] if id(c) in norms]
    if not before or before[-1][2] is None or not torch.equal(before[-1][2], fed):
        return None, None, out
    return before[-1][0], before[-1][1], out


def _check_heads(name: str, projection: Projection | None, out: Tensor, results: Tensor) -> None:
    """The attention block's output must be its heads' results summed, plus the projection's bias."""
    bias = None if projection is None else projection.bias()
    total = results.sum(1) + (0 if bias is None else bias)
    if not _close(out, total):
        raise StreamError(
            f"the attention block of the layer {name!r} does not output the sum of its heads' results plus the "
            f"output projection's bias (something transforms them in between), so its heads are not writers"
        )
