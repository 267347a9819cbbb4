"""The circuit graph of :func:`~multihead.lens.edge_attribution`: :class:`Node` and :class:`Graph`.

Dimensions: W writers, R readers.

Nodes are named as in ``model.named_modules()``. Writers: ``"embed"`` (the input embedding module's output),
``"head"`` (head h of an attention module: its result, z_h through its columns of the output projection),
``"mlp"`` (an MLP module's output). Readers: ``"q"`` (query head h of an attention module), ``"k"`` and ``"v"``
(key/value head g: Hkv of them under GQA), ``"mlp"`` (an MLP module's input), ``"logits"`` (the output embedding
module, reading the final norm's input). The writer and reader mlp nodes of one MLP share the name.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

WRITER_KINDS = ("embed", "head", "mlp")
"""The kinds of writer nodes."""

READER_KINDS = ("q", "k", "v", "mlp", "logits")
"""The kinds of reader nodes."""


class Node(NamedTuple):
    """One node of the residual stream's graph: the module ``name``, the ``kind`` (see the module docstring) and
    the ``head`` (query head for "head" and "q", key/value head for "k" and "v", None where none applies)."""

    name: str
    kind: str
    head: int | None = None

    def __str__(self) -> str:
        where = self.name or "<model>"
        return f"{where}:{self.kind}" + ("" if self.head is None else f"{self.head}")


Edge = tuple[Node, Node, float]
"""``(writer, reader, score)``."""


class Graph:
    """Edges of the residual stream, writer -> reader, with a score each.

    ``writers`` (W nodes), ``readers`` (R nodes), ``scores`` (W, R): the first-order effect on the metric's batch
    mean of patching that edge alone (a writer's clean output into that reader's input), summed over positions;
    0 where the writer is not upstream of the reader; ``upstream`` (W, R) bool: where it is (an edge exists).
    ``metric_clean`` and ``metric_corrupted``: the metric's
    batch mean on each run (None where not measured).
    """

    def __init__(
        self,
        writers: list[Node],
        readers: list[Node],
        scores: Tensor,
        *,
        upstream: Tensor | None = None,
        metric_clean: float | None = None,
        metric_corrupted: float | None = None,
    ) -> None:
        if scores.shape != (len(writers), len(readers)):
            raise ValueError(
                f"scores must be (writers, readers) = {(len(writers), len(readers))}, got {tuple(scores.shape)}"
            )
        self.writers = list(writers)
        self.readers = list(readers)
        self.scores = scores
        self.upstream = scores != 0 if upstream is None else upstream.to(torch.bool)  # (W, R)
        self.metric_clean = metric_clean
        self.metric_corrupted = metric_corrupted

    def edges(self) -> list[Edge]:
        """Every edge (writer, reader, score): the writer upstream of the reader, in writer then reader order."""
        rows, cols = torch.nonzero(self.upstream, as_tuple=True)
        return [
            (self.writers[i], self.readers[j], float(self.scores[i, j]))
            for i, j in zip(rows.tolist(), cols.tolist())
        ]

    def top(self, k: int) -> list[Edge]:
        """The ``k`` edges of largest ``|score|``, largest first: ``[(writer, reader, score), ...]`` (only edges:
        a writer upstream of its reader; fewer than ``k`` where the graph has fewer)."""
        if not isinstance(k, int) or isinstance(k, bool) or k < 0:
            raise ValueError(f"k must be a non-negative int (how many edges), got {k!r}")
        flat = self.scores.flatten()
        index = torch.nonzero(self.upstream.flatten(), as_tuple=True)[0]  # (edges,)
        order = index[torch.argsort(flat[index].abs(), descending=True, stable=True)[:k]]
        r = len(self.readers)
        return [(self.writers[i // r], self.readers[i % r], float(flat[i])) for i in order.tolist()]

    def node_effects(self) -> Tensor:
        """(W,): each writer's row sum, its first-order node effect on the metric's batch mean."""
        return self.scores.sum(1)

    def __len__(self) -> int:
        return int(torch.count_nonzero(self.upstream))

    def __repr__(self) -> str:
        best = self.top(3)
        shown = ", ".join(f"{w} -> {r}: {s:+.4g}" for w, r, s in best)
        return f"Graph({len(self.writers)} writers, {len(self.readers)} readers, {len(self)} edges; top: {shown})"
