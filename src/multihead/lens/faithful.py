"""Faithfulness of a circuit: :func:`faithfulness`, the clean run with every edge outside the circuit carrying an
ablated writer output, by intervention (exact, batched, no gradients).

Dimensions: B batch, L length, E model width, W writers, R readers, C readers of one block.

In the intervened run each reader reads its own copy of the stream (:mod:`.readers`): reader r's input is the
stream of this run minus, for every writer w upstream of r whose edge (w, r) is not kept,
``w_this_run - w_ablated``. So a kept edge carries the writer's output of this run, an edge not kept the
ablated one: the corrupted run's (:class:`CorruptedEdges`) or the reference run's mean over its batch and
positions (:class:`MeanEdges`). All edges kept is the clean run; none kept, the corrupted run (for
:class:`CorruptedEdges`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor, nn

from ..heads.naming import attention_modules
from .attribution_patch import metric_mean
from .graph import Graph, Node
from .patch import _check_alike
from .readers import Layout, Record, layout, reader_run
from .sites import run
from .stream import Stream, find_stream


class EdgeAblation:
    """What an edge outside the circuit carries: :meth:`values` gives each writer block's ablated output,
    (n, B, L, E) or broadcastable, from a run of the model."""

    needs_reference = False

    def values(
        self, model: nn.Module, stream: Stream, nodes: Layout, corrupted: object, reference: object
    ) -> list[Tensor]:
        """The ablated output of every writer block, in row order."""
        raise NotImplementedError


def writer_blocks(model: nn.Module, stream: Stream, nodes: Layout, inputs: object) -> list[Tensor]:
    """Every writer block's output (n, B, L, E) on a plain run of ``inputs``."""
    with torch.no_grad(), reader_run(model, stream, nodes, None) as seen:
        run(model, inputs)
    return seen.blocks


class CorruptedEdges(EdgeAblation):
    """The corrupted run's writer outputs (same examples, same positions)."""

    def values(
        self, model: nn.Module, stream: Stream, nodes: Layout, corrupted: object, reference: object
    ) -> list[Tensor]:
        return writer_blocks(model, stream, nodes, corrupted)


class MeanEdges(EdgeAblation):
    """Each writer's mean output over the reference run's batch and positions: (n, 1, 1, E) per block."""

    needs_reference = True

    def values(
        self, model: nn.Module, stream: Stream, nodes: Layout, corrupted: object, reference: object
    ) -> list[Tensor]:
        return [b.mean(dim=(1, 2), keepdim=True) for b in writer_blocks(model, stream, nodes, reference)]


EDGE_ABLATIONS: dict[str, type[EdgeAblation]] = {"corrupt": CorruptedEdges, "mean": MeanEdges}
"""``ablation`` -> its class; an :class:`EdgeAblation` instance may be given instead."""


def faithfulness(
    model: nn.Module,
    edges: Iterable[Any] | Graph,
    clean: object,
    corrupted: object,
    metric: Callable[[Any], Tensor | float],
    *,
    ablation: str | EdgeAblation = "corrupt",
    reference: object = None,
) -> float:
    """How much of the clean - corrupted gap the edges ``edges`` recover: the clean run with every other edge
    carrying the ablated writer output, as a fraction of the way from metric(corrupted) (0.0) to
    metric(clean) (1.0), the metric's batch mean.

    Args:
        model, clean, corrupted, metric: as in :func:`~multihead.lens.edge_attribution`.
        edges: the kept edges: (writer, reader) :class:`~multihead.lens.Node` pairs, or (writer, reader, score)
            as :meth:`Graph.top` gives, or a :class:`~multihead.lens.Graph` (all its edges).
        ablation: ``"corrupt"`` (the corrupted run's writer outputs), ``"mean"`` (the reference run's mean over
            batch and positions), or an :class:`EdgeAblation`.
        reference: the inputs of the reference run (for "mean").
    """
    method = (
        EDGE_ABLATIONS[ablation]() if isinstance(ablation, str) and ablation in EDGE_ABLATIONS else ablation
    )
    if not isinstance(method, EdgeAblation):
        raise ValueError(
            f"ablation must be one of {sorted(EDGE_ABLATIONS)} or an EdgeAblation, got {ablation!r}"
        )
    if method.needs_reference and reference is None:
        raise ValueError(
            f"ablation={ablation!r} needs reference inputs (reference=...): the run its means come from"
        )
    batch = _check_alike(clean, corrupted)
    stream, _, out = find_stream(model, clean, attention_modules(model))
    nodes = layout(stream)
    drop = ~_kept(edges, nodes)  # (W, R)
    ablated = method.values(model, stream, nodes, corrupted, reference)
    with torch.no_grad():
        low = float(metric_mean(metric(run(model, corrupted)), batch))
        high = float(metric_mean(metric(out), batch))
        with reader_run(model, stream, nodes, _removing(drop, ablated)):
            value = float(metric_mean(metric(run(model, clean)), batch))
    if high == low:
        raise ValueError(
            f"the metric is the same on the clean and corrupted runs ({high}): there is no gap to recover"
        )
    return (value - low) / (high - low)


def _removing(drop: Tensor, ablated: list[Tensor]) -> Callable[[slice, int, Tensor, Record], Tensor]:
    """The read of the intervened run: each reader's copy minus its dropped writers' (this run - ablated)."""

    def read(cols: slice, upto: int, x: Tensor, record: Record) -> Tensor:
        copies = x.unsqueeze(0).repeat(cols.stop - cols.start, *([1] * x.dim())).clone()  # (C, B, L, E)
        for start, this, off in zip(record.starts, record.blocks, ablated):
            if start >= upto:
                break
            mask = drop[start : start + this.shape[0], cols].to(device=x.device, dtype=x.dtype)  # (n, C)
            if bool(mask.any()):
                copies -= torch.einsum("nc,nble->cble", mask, (this - off.to(this.dtype)).expand_as(this))
        return copies

    return read


def _kept(edges: Iterable[Any] | Graph, nodes: Layout) -> Tensor:
    """(W, R) bool: the edges kept, from Node pairs (or triples); unknown nodes refused by name."""
    if isinstance(edges, Graph):
        edges = edges.edges()
    writers = {w: i for i, w in enumerate(nodes.writers)}
    readers = {r: j for j, r in enumerate(nodes.readers)}
    kept = torch.zeros(len(writers), len(readers), dtype=torch.bool)
    upstream = nodes.upstream()
    for edge in edges:
        if not (
            isinstance(edge, tuple) and len(edge) in (2, 3) and all(isinstance(n, Node) for n in edge[:2])
        ):
            raise TypeError(
                f"edges must be (writer, reader) pairs of lens.Node (or graph.top(k)'s (writer, reader, score)), "
                f"got {edge!r}"
            )
        w, r = edge[0], edge[1]
        if w not in writers or r not in readers:
            missing = w if w not in writers else r
            raise ValueError(
                f"edges names {missing}, which is not a {'writer' if w is missing else 'reader'} of this model; "
                f"take nodes from lens.edge_attribution(...).writers / .readers"
            )
        if not upstream[writers[w], readers[r]]:
            raise ValueError(
                f"edges holds ({w}, {r}), which is not an edge: the writer runs after the reader reads the stream"
            )
        kept[writers[w], readers[r]] = True
    return kept


def nudged(
    model: nn.Module,
    clean: object,
    corrupted: object,
    metric: Callable[[Any], Tensor | float],
    reader: Node,
    eps: float,
) -> float:
    """The corrupted run's metric (batch mean) with ``reader`` alone fed its input plus ``eps`` times the sum of
    its upstream writers' (clean - corrupted) outputs: the finite differences that check a column of
    :func:`~multihead.lens.edge_attribution` (its sum is the derivative of this in ``eps`` at 0)."""
    batch = _check_alike(clean, corrupted)
    stream, clean_blocks, _ = find_stream(model, clean, attention_modules(model))
    nodes = layout(stream)
    if reader not in nodes.readers:
        raise ValueError(f"reader names {reader}, which is not a reader of this model")
    col = nodes.readers.index(reader)
    deltas = [
        c - k
        for c, k in zip(
            writer_blocks(model, stream, nodes, clean), writer_blocks(model, stream, nodes, corrupted)
        )
    ]

    def read(cols: slice, upto: int, x: Tensor, record: Record) -> Tensor:
        copies = x.unsqueeze(0).repeat(cols.stop - cols.start, *([1] * x.dim())).clone()  # (C, B, L, E)
        if cols.start <= col < cols.stop:
            shift = sum(d.sum(0) for s, d in zip(record.starts, deltas) if s < upto)
            copies[col - cols.start] += eps * shift
        return copies

    with torch.no_grad(), reader_run(model, stream, nodes, read):
        return float(metric_mean(metric(run(model, corrupted)), batch))
