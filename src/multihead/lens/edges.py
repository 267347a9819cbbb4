"""Edge attribution patching of the residual stream: :func:`edge_attribution` (EAP, Syed et al. 2023; with
``ig_steps`` > 1, EAP-IG, Hanna et al. 2024).

Dimensions: B batch, L length, E model width, W writers, R readers, C copies of a layer's attention input.

Writer w's clean output moved into reader r's input alone changes the metric's batch mean M by about
``sum over examples and positions of (w_clean - w_corrupted) . dM/d(x_r)``, x_r the reader's own copy of the
stream (a writer at position p feeds the readers at p). The gradients dM/d(x_r) come from one forward and
backward per step (:func:`~multihead.lens.readers.gradient_run`): the MLP and logits readers' copies get theirs
from the backward itself; each q/k/v head's is the gradient at that head mapped back through its own norm and
projection rows (:func:`~multihead.lens.readers.head_gradients`). Each is contracted with the deltas of the
writers upstream (a layer's readers at once: (C, B*L*E) against each writer block's (n, B*L*E)) and dropped, so
no reader's gradient outlives its layer, and each writer's delta is formed as its corrupted output comes. The
finite differences that check this use the other mechanism, the reader-split forward
(:func:`~multihead.lens.readers.reader_run`). The stream is found and checked on the clean run first
(:mod:`.stream`): edges exist only where it is a sum of writers (pre-norm stacks); elsewhere they are refused
by name, saying why.

On SmolLM2-135M with 1,000 tokens, one thread (AMD EPYC Zen 1, loaded machine): a forward 11.5 s, edges
(301 writers x 481 readers) 71 s, peak resident set 3.2 GiB.

Because the stream is a sum of writers, dM/dw is the sum of dM/d(x_r) over the readers downstream of w, so a
writer's row sums to its node effect (a head's: ``attribution_patch(point="z") - metric(corrupted)``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from ..heads.naming import attention_modules
from ..progress import Progress
from .attribution_patch import Runs, _recording, metric_mean
from .graph import Graph
from .patch import TOKENS_PER_FORWARD, _check_alike, _length
from .path import Path, check_steps, steps
from .readers import Layout, Record, gradient_run, head_gradients, layout
from .sites import ModuleSelection, select
from .stream import Stream, find_stream


def edge_attribution(
    model: nn.Module,
    clean: object,
    corrupted: object,
    metric: Callable[[Any], Tensor | float],
    *,
    ig_steps: int = 1,
    modules: ModuleSelection = None,
    progress: bool | None = None,
) -> Graph:
    """Every writer -> reader edge of the residual stream, scored by its first-order effect on the metric.

    Args:
        model: a pre-norm stack (a decoder-only or encoder-only model; post-norm, parallel blocks and models
            whose MLP cannot be found are refused by name).
        clean, corrupted, metric: as in :func:`~multihead.lens.patch_heads` (metric (B,) or a scalar).
        ig_steps: m; the gradients averaged over m runs along the input embeddings from corrupted to clean
            (alpha = k/m, k = 0..m-1), as in :func:`~multihead.lens.attribution_patch`.
        modules: the attention modules whose layers' nodes (heads, q/k/v heads, MLP) are kept in the graph
            (default: all); embed and logits are always kept.
        progress: a progress bar on stderr, a step per layer (default: when ig_steps >= 8 or the batch holds
            :data:`~multihead.lens.TOKENS_PER_FORWARD` tokens or more).

    Returns:
        :class:`~multihead.lens.Graph`: writers (embed, each head, each MLP), readers (each q head, each k and v
        head: Hkv of them, each MLP, the logits), ``scores`` (W, R), 0 where the writer is not upstream.
    """
    m = check_steps(ig_steps)
    names = select(model, modules)
    batch = _check_alike(clean, corrupted)
    path = Path(model, clean, corrupted) if m > 1 else None
    with _recording(path, "clean"):
        stream, clean_blocks, out = find_stream(model, clean, attention_modules(model))
    nodes = layout(stream)
    clean_value = float(metric_mean(metric(out), batch))
    del out  # the logits of a language model at length: large
    runs = Runs(model, {}, path, corrupted, metric, batch)
    state = _State(nodes, clean_blocks, m)
    long = m >= 8 or batch * _length(corrupted) >= TOKENS_PER_FORWARD
    show = long if progress is None else progress
    with Progress(m * (len(stream.layers) + 1), "edges", enabled=show) as bar:
        for alpha in steps(m):
            _step(runs, stream, state, alpha, bar)
    return _graph(state, names, clean_value, state.base)


@dataclass
class _State:
    """The scores being summed, the writers' deltas (clean - corrupted, one (n, B*L*E) block per writer block,
    set from the first step's run), and where each reader column's upstream writers end."""

    nodes: Layout
    clean: list[Tensor | None]
    steps: int
    scores: Tensor | None = None
    deltas: list[Tensor] | None = None
    upto: dict[int, int] | None = None
    base: float = 0.0

    def take(self, index: int, corrupted: Tensor) -> None:
        """The sink of the first (corrupted) run: writer block ``index``'s delta formed as soon as its corrupted
        output comes, the clean output then dropped (so the two runs' outputs are never all held at once)."""
        clean, self.clean[index] = self.clean[index], None
        assert clean is not None
        if self.deltas is None:
            self.deltas = []
        self.deltas.append((clean - corrupted).flatten(1))

    def start(self, seen: Record, value: Tensor) -> None:
        """After the first run: its metric, the scores, each reader's upstream rows."""
        assert self.deltas is not None and len(self.deltas) == len(seen.starts)
        self.base = float(value.detach())
        self.clean = []
        w, r = seen.rows, len(self.nodes.readers)
        self.scores = torch.zeros(w, r, dtype=self.deltas[0].dtype, device=self.deltas[0].device)
        self.upto = dict(seen.upto)

    def contract(self, cols: slice, upto: int, grad: Tensor, starts: list[int]) -> None:
        """Add ``grad`` (C, B, L, E), the gradient at readers ``cols``'s copies, against the upstream deltas."""
        assert self.deltas is not None and self.scores is not None
        g = grad.flatten(1)  # (C, B*L*E)
        for start, delta in zip(starts, self.deltas):
            if start >= upto:
                break
            part = delta @ g.T.to(delta.dtype)  # (n, C)
            self.scores[start : start + delta.shape[0], cols] += part / self.steps


def _step(runs: Runs, stream: Stream, state: _State, alpha: float, bar: Progress) -> None:
    """One forward and backward at ``alpha`` on the path; its gradients contracted into ``state.scores``."""
    starts: list[int] = []

    def read(cols: slice, upto: int, x: Tensor, record: Record) -> Tensor:
        copy = x.unsqueeze(0).clone()  # (1, B, L, E): the reader's own input
        copy.register_hook(lambda g: state.contract(cols, upto, g, starts))
        return copy

    first = alpha == 0.0
    with _recording(runs.path if first else None, "corrupted"):
        with gradient_run(runs.model, stream, state.nodes, read, state.take if first else None) as (
            seen,
            taps,
        ):
            value = runs.value_at(alpha)
    if first:
        state.start(seen, value)
    starts[:] = seen.starts
    assert seen.leaf is not None
    torch.autograd.grad(value, seen.leaf, retain_graph=True)  # MLP and logits readers contract on the way
    bar.update(1)
    for i, tap in enumerate(taps):
        cols = state.nodes.attention_cols[i]
        upto = seen.upto[cols.start]
        offset = cols.start
        for point in ("q", "k", "v"):
            grads = head_gradients(tap, point)  # (heads, B, L, E)
            state.contract(slice(offset, offset + grads.shape[0]), upto, grads, starts)
            offset += grads.shape[0]
        tap.points.clear(), tap.grads.clear()  # this layer's graph and gradients can go
        bar.update(1)


def _drop(index: int, block: Tensor) -> None:
    """The sink of the later steps: their writers' outputs are not needed."""


def _graph(state: _State, names: list[str], clean: float, corrupted: float) -> Graph:
    """The graph of ``state``'s scores, with only the nodes of the layers of ``names`` (and embed, logits)."""
    assert state.scores is not None and state.upto is not None
    nodes = state.nodes
    upstream = torch.zeros(state.scores.shape, dtype=torch.bool)
    for col, upto in state.upto.items():
        upstream[:upto, col] = True
    kept = set(names)
    rows = [
        i for i, w in enumerate(nodes.writers) if w.kind == "embed" or _layer_kept(w, nodes, kept, i, True)
    ]
    cols = [
        j for j, r in enumerate(nodes.readers) if r.kind == "logits" or _layer_kept(r, nodes, kept, j, False)
    ]
    scores = state.scores.detach().cpu()[rows][:, cols]
    return Graph(
        [nodes.writers[i] for i in rows],
        [nodes.readers[j] for j in cols],
        scores,
        upstream=upstream[rows][:, cols],
        metric_clean=clean,
        metric_corrupted=corrupted,
    )


def _layer_kept(node: Any, nodes: Layout, kept: set[str], index: int, writer: bool) -> bool:
    """Whether ``node`` (a head, q/k/v head or MLP node) belongs to a layer whose attention module is kept."""
    if node.kind in ("head", "q", "k", "v"):
        return node.name in kept
    layer = nodes.mlp_rows.index(index) if writer else nodes.mlp_cols.index(index)
    return any(nodes.writers[nodes.head_rows[layer].start].name == name for name in kept)
