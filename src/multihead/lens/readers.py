"""The reader-split forward: each reader of the residual stream reads its own copy of it.

Dimensions: B batch, L length, E model width, H query heads, Hkv key/value heads, C = H + 2 Hkv copies of a
layer's attention input (one per q head, k head and v head), W writers, R readers.

Two runs serve the circuits.

:func:`reader_run`, the reader-split forward, for interventions (faithfulness, and the finite differences
that check edge attribution): in a layer, the norm before the attention is handed C copies of the stream (C*B
rows) instead of one; the attention block runs on them (its other batch inputs repeated, as patching's shared
prefix does), and at the lens's points q, k and v each head is taken from its own copy: q head h from copy h, k
head g from copy H + g, v head g from copy H + Hkv + g. From there on every copy holds the same q, k, v, so the
block's output is one copy's rows (B). The MLP's norm and the final norm are handed one copy each. So each reader
reads its own input, through its own norm and its own rows of the projections (and rotary), whatever the
architecture: GQA needs nothing special. The price: the attention block runs on C copies.

:func:`gradient_run`, for the readers' gradients (edge attribution), runs the model once as it is. The MLP and
logits readers read a copy of the stream whose gradient is theirs alone. Each layer's attention norm reads a copy
x of the stream; the backward delivers the gradients at q, k and v (small: (B, heads, L, D)), and
:func:`head_gradients` maps each head's share back to x through the local graph alone (x -> norm -> projection
rows -> rotary, one batched backward over the heads), giving each q/k/v head reader's gradient without running
the attention on copies. Each is contracted with the writers' deltas at once and dropped (:mod:`.edges`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from .graph import Node
from .patch import _rows
from .share import repeat_batch
from .sites import Context, tapping
from .stream import Layer, Stream, first_tensor, hidden_of, hooked, with_hidden


@dataclass(frozen=True)
class Layout:
    """The nodes of a stream: ``writers`` (W) and ``readers`` (R) in run order, the rows of each writer block
    (embed, then each layer's heads and its MLP) and the columns of each reader block (each layer's q, k, v
    heads, its MLP, then the logits)."""

    writers: list[Node]
    readers: list[Node]
    attention_cols: list[slice]
    mlp_cols: list[int]
    head_rows: list[slice]
    mlp_rows: list[int]

    def upstream(self) -> Tensor:
        """(W, R) bool: whether writer w runs before reader r reads (an edge exists): a layer's q/k/v heads read
        the writers of the layers before it, its MLP also its own heads, the logits every writer."""
        mask = torch.zeros(len(self.writers), len(self.readers), dtype=torch.bool)
        for cols, heads, mlp_col in zip(self.attention_cols, self.head_rows, self.mlp_cols):
            mask[: heads.start, cols] = True
            mask[: heads.stop, mlp_col] = True
        mask[:, -1] = True
        return mask


def layout(stream: Stream) -> Layout:
    """Every node of ``stream``: writers embed, heads, MLPs; readers q, k, v heads, MLPs, logits."""
    writers = [Node(stream.embed_name, "embed")]
    readers: list[Node] = []
    attention_cols, mlp_cols, head_rows, mlp_rows = [], [], [], []
    for layer in stream.layers:
        head_rows.append(slice(len(writers), len(writers) + layer.heads))
        writers += [Node(layer.attention, "head", h) for h in range(layer.heads)]
        mlp_rows.append(len(writers))
        writers.append(Node(layer.mlp_name, "mlp"))
        start = len(readers)
        readers += [Node(layer.attention, "q", h) for h in range(layer.heads)]
        readers += [Node(layer.attention, kind, g) for kind in ("k", "v") for g in range(layer.kv_heads)]
        attention_cols.append(slice(start, len(readers)))
        mlp_cols.append(len(readers))
        readers.append(Node(layer.mlp_name, "mlp"))
    readers.append(Node(stream.logits_name, "logits"))
    return Layout(writers, readers, attention_cols, mlp_cols, head_rows, mlp_rows)


Read = Callable[[slice, int, Tensor, "Record"], Tensor]
"""``read(cols, upto, x, record) -> copies``: the inputs (C, B, L, E) of the readers ``cols`` (C of them), given
the stream ``x`` (B, L, E) they read and the writers recorded so far (rows ``:upto`` of ``record``)."""


@dataclass
class Record:
    """What a reader-split run saw: each writer block's value on this run (``blocks``: (n, B, L, E) each, in row
    order, detached), where each block starts, the leaf the stream starts from (with ``leaf=True``), and the
    writer rows upstream of each reader column (``upto``). With a ``sink``, each block is handed to it as it
    comes (``sink(index, block)``) instead of being kept."""

    blocks: list[Tensor] = field(default_factory=list)
    starts: list[int] = field(default_factory=list)
    leaf: Tensor | None = None
    upto: dict[int, int] = field(default_factory=dict)
    sink: Callable[[int, Tensor], None] | None = None
    rows: int = 0

    def add(self, block: Tensor) -> None:
        self.starts.append(self.rows)
        self.rows += block.shape[0]
        if self.sink is None:
            self.blocks.append(block.detach())
        else:
            self.sink(len(self.starts) - 1, block.detach())


@contextmanager
def reader_run(model: nn.Module, stream: Stream, nodes: Layout, read: Read | None) -> Iterator[Record]:
    """While the block runs, every writer's value is recorded and (``read`` given) every reader reads the
    copy ``read`` gives it (the reader-split forward: see the module docstring)."""
    record = Record()
    hooks = [(stream.layers[0].module, "pre_kw", _entry(record, False))]
    sites: dict[str, dict[str, Callable[..., Any]]] = {}
    for i, layer in enumerate(stream.layers):
        sites[layer.attention] = {"result": _results(record, read is not None, layer)}
        hooks.append((layer.mlp, "post", lambda m, a, out: record.add(first_tensor(out)[None])))  # type: ignore[index]
        if read is not None:
            cols = nodes.attention_cols[i]
            hooks += _split(layer, cols, read, record)
            sites[layer.attention].update(_assembly(layer))
            mlp = slice(nodes.mlp_cols[i], nodes.mlp_cols[i] + 1)
            hooks.append((layer.mlp_norm, "pre", _reading(mlp, read, record)))
    if read is not None:
        logits = slice(len(nodes.readers) - 1, len(nodes.readers))
        hooks.append(_final(stream, _reading(logits, read, record)))
    with hooked(hooks), tapping(model, sites):
        yield record


def _entry(record: Record, leaf: bool) -> Callable[..., Any]:
    """The first layer's pre-hook: records the embed writer (the stream entering it), made a leaf if asked."""

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        x = hidden_of(args, kwargs)
        if x is None:
            raise ValueError("the first layer was called without hidden states (B, L, E)")
        record.add(x[None])
        if not leaf:
            return None
        record.leaf = x.detach().requires_grad_()
        return with_hidden(args, kwargs, record.leaf)

    return hook


def _results(record: Record, split: bool, layer: Layer) -> Callable[[Tensor, Context], None]:
    """The result handler: records the heads' results (H, B, L, E) of one copy."""

    def handler(result: Tensor, ctx: Context) -> None:
        copies = layer.heads + 2 * layer.kv_heads if split else 1
        b = result.shape[0] // copies
        record.add(result[:b].transpose(0, 1))  # (H, B, L, E)

    return handler


def _reading(cols: slice, read: Read, record: Record) -> Callable[..., Any]:
    """A norm's pre-hook: its input x (B, L, E) replaced by the one reader's copy."""

    def hook(module: nn.Module, args: tuple) -> tuple:
        record.upto[cols.start] = record.rows
        return (read(cols, record.rows, args[0], record)[0], *args[1:])

    return hook


def _final(stream: Stream, hook: Callable[..., Any]) -> tuple[nn.Module, str, Callable[..., Any]]:
    """Where the logits reader reads: the final norm's input, or (no final norm) the last layer's output."""
    if stream.final_norm is not None:
        return (stream.final_norm, "pre", hook)

    def on_output(module: nn.Module, args: tuple, output: Any) -> Any:
        x = first_tensor(output)
        new = hook(module, (x,))[0]
        return new if isinstance(output, Tensor) else (new, *output[1:])

    return (stream.layers[-1].module, "post", on_output)


def _split(
    layer: Layer, cols: slice, read: Read, record: Record
) -> list[tuple[nn.Module, str, Callable[..., Any]]]:
    """The hooks running ``layer``'s attention block on C copies: the norm's input, the block's other batch
    inputs repeated, its output cut back to one copy."""
    copies = cols.stop - cols.start
    batch: list[int] = []

    def norm_in(module: nn.Module, args: tuple) -> tuple:
        x = args[0]
        batch[:] = [x.shape[0]]
        for c in range(cols.start, cols.stop):
            record.upto[c] = record.rows
        fed = read(cols, record.rows, x, record)  # (C, B, L, E)
        return (fed.flatten(0, 1), *args[1:])

    def block_in(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        x = hidden_of(args, kwargs)
        args, kwargs = repeat_batch(args, batch[0], copies), repeat_batch(kwargs, batch[0], copies)
        return with_hidden(args, kwargs, x)  # type: ignore[arg-type]

    def block_out(module: nn.Module, args: tuple, output: Any) -> Any:
        return _rows(output, 0, copies, batch[0])

    return [
        (layer.attention_norm, "pre", norm_in),
        (layer.block, "pre_kw", block_in),
        (layer.block, "post", block_out),
    ]


def _assembly(layer: Layer) -> dict[str, Callable[[Tensor, Context], Tensor]]:
    """The q, k, v handlers: head h of q from copy h, head g of k from copy H + g, of v from copy H + Hkv + g."""
    h, hkv = layer.heads, layer.kv_heads
    copies = h + 2 * hkv

    def take(offset: int, heads: int) -> Callable[[Tensor, Context], Tensor]:
        def handler(t: Tensor, ctx: Context) -> Tensor:
            per = t.unflatten(0, (copies, t.shape[0] // copies))  # (C, B, heads, L, D)
            idx = torch.arange(heads, device=t.device)
            own = per[offset + idx, :, idx].transpose(0, 1)  # (B, heads, L, D)
            return own.unsqueeze(0).expand(copies, *own.shape).flatten(0, 1)

        return handler

    return {"q": take(0, h), "k": take(h, hkv), "v": take(h + hkv, hkv)}


@dataclass
class Taps:
    """One layer's attention inputs on a gradient run: ``x`` the copy of the stream its norm reads (B, L, E),
    the q, k, v points, and (after the backward) the gradients they received."""

    x: Tensor | None = None
    points: dict[str, Tensor] = field(default_factory=dict)
    grads: dict[str, Tensor] = field(default_factory=dict)


@contextmanager
def gradient_run(
    model: nn.Module,
    stream: Stream,
    nodes: Layout,
    read: Read,
    sink: Callable[[int, Tensor], None] | None = None,
) -> Iterator[tuple[Record, list[Taps]]]:
    """A run for the readers' gradients without copies of the attention: the MLP and logits readers read
    ``read``'s copy (one each); each layer's attention norm reads a copy x of the stream whose q, k and v points
    are kept with the gradients they receive, so that :func:`head_gradients` maps each head's gradient back to
    x through the layer's own norm, projection rows and rotary alone (the stream starts from a leaf). ``sink``:
    as :class:`Record`'s."""
    record = Record(sink=sink)
    taps = [Taps() for _ in stream.layers]
    hooks = [(stream.layers[0].module, "pre_kw", _entry(record, True))]
    sites: dict[str, dict[str, Callable[..., Any]]] = {}
    for i, layer in enumerate(stream.layers):
        sites[layer.attention] = {"result": _results(record, False, layer), **_keeping(taps[i])}
        hooks.append((layer.mlp, "post", lambda m, a, out: record.add(first_tensor(out)[None])))  # type: ignore[index]
        hooks.append((layer.attention_norm, "pre", _copying(taps[i], nodes.attention_cols[i], record)))
        mlp = slice(nodes.mlp_cols[i], nodes.mlp_cols[i] + 1)
        hooks.append((layer.mlp_norm, "pre", _reading(mlp, read, record)))
    hooks.append(_final(stream, _reading(slice(len(nodes.readers) - 1, len(nodes.readers)), read, record)))
    with hooked(hooks), tapping(model, sites):
        yield record, taps


def _copying(taps: Taps, cols: slice, record: Record) -> Callable[..., Any]:
    def hook(module: nn.Module, args: tuple) -> tuple:
        for c in range(cols.start, cols.stop):
            record.upto[c] = record.rows
        taps.x = args[0].clone()
        return (taps.x, *args[1:])

    return hook


def _keeping(taps: Taps) -> dict[str, Callable[[Tensor, Context], None]]:
    def keep(t: Tensor, ctx: Context) -> None:
        taps.points[ctx.point] = t
        if t.requires_grad:
            t.register_hook(lambda g: taps.grads.__setitem__(ctx.point, g))

    return dict.fromkeys(("q", "k", "v"), keep)


def head_gradients(taps: Taps, point: str) -> Tensor:
    """(heads, B, L, E): for each head of ``point`` ("q": H heads, "k"/"v": Hkv), the gradient its reader's own
    input x receives through that head alone: the head's share of the point's gradient mapped back through the
    local graph x -> norm -> projection rows -> rotary (one batched backward over the heads, the rest of the
    model not traversed)."""
    t, x = taps.points[point], taps.x
    assert x is not None
    g = taps.grads.get(point)
    heads = t.shape[1]
    if g is None:
        return x.new_zeros((heads, *x.shape))
    eye = torch.eye(heads, dtype=g.dtype, device=g.device)
    masked = g.unsqueeze(0) * eye[:, None, :, None, None]  # (heads, B, heads, L, D)
    try:
        (out,) = torch.autograd.grad(t, x, grad_outputs=masked, retain_graph=True, is_grads_batched=True)
        return out
    except RuntimeError:  # an op without a batching rule: one backward per head
        return torch.stack([torch.autograd.grad(t, x, grad_outputs=m, retain_graph=True)[0] for m in masked])
