"""Autoregressive decoding as free functions over a step function: :func:`greedy` and :func:`beam_search`.

Dimensions: B sources, K beams, N rows the step sees (B for greedy, B*K for beam search, row
``b*K + j`` = beam j of source b), t tokens so far (the start token included), V vocabulary.

A **step** is any function ``step(tokens, cache) -> log_probs``: ``tokens`` (N, t) long are every row's
tokens so far, the start token first; ``cache`` is the object given to the decoder (a
:class:`~multihead.KVCache`, or ``None``); it returns next-token log-probabilities (N, V), float. A
cached model step reads only ``tokens[:, -1]``; a step without a cache may recompute from all of them.
Beam search calls ``cache.reorder(rows, include_static=False)`` after every step so each row's cache
follows its parent beam (the beams of a source share its source, so static caches stay).

Both functions rank by the length-normalised score ``sum(log p) / length ** length_penalty``, length
counting generated tokens with the end token; a finished row continues with ``fill`` at no cost.
:meth:`multihead.Transformer.generate` runs them on the model's cached step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple, Protocol

import torch
from torch import Tensor

from ..core.checks import positive_int

__all__ = ["Decoded", "Step", "beam_search", "greedy"]


class Reorderable(Protocol):
    """What beam search needs of a step's state: keep batch rows ``rows`` (N,), in that order."""

    def reorder(self, indices: Tensor, *, include_static: bool = True) -> None: ...


Step = Callable[[Tensor, "Reorderable | None"], Tensor]
"""``step(tokens (N, t) long, cache) -> next-token log-probabilities (N, V)``."""


class Decoded(NamedTuple):
    """The result of a decoding function.

    ``tokens`` (B, T') long: generated tokens without the start token, ``fill`` after the end token, T'
    the longest result. ``scores`` (B,): each result's ranking score ``sum(log p) / length**alpha``.
    ``lengths`` (B,) long: generated tokens per result, the end token included.
    """

    tokens: Tensor
    scores: Tensor
    lengths: Tensor


def _check(start: Tensor, max_len: int) -> None:
    positive_int("max_len", max_len)
    if not isinstance(start, Tensor) or start.dim() != 1 or start.is_floating_point():
        raise ValueError(
            f"start must be a 1-D integer tensor (B,) of first tokens, got "
            f"{tuple(start.shape) if isinstance(start, Tensor) else type(start).__name__}"
        )


def greedy(
    step: Step,
    start: Tensor,
    *,
    max_len: int,
    eos_id: int | None,
    fill: int,
    length_penalty: float = 1.0,
    cache: Reorderable | None = None,
) -> Decoded:
    """Greedy decoding: the most likely next token of every row, until ``eos_id`` or ``max_len`` tokens.

    Args:
        step: ``step(tokens (B, t), cache) -> log-probs (B, V)`` (see the module docstring).
        start: (B,) the first token of every row (a begin-of-sequence id).
        max_len: the most tokens generated per row (the end token included).
        eos_id: the end token (``None``: always ``max_len`` tokens).
        fill: the token written after a row's end token.
        length_penalty: alpha of the returned scores (it does not change greedy choices).
        cache: passed to ``step`` unchanged.

    Returns :class:`Decoded` (tokens (B, T'), scores (B,), lengths (B,)).
    """
    _check(start, max_len)
    b, dev = start.shape[0], start.device
    seqs = torch.full((b, max_len + 1), fill, dtype=torch.long, device=dev)  # (B, 1 + max_len)
    seqs[:, 0] = start
    scores = torch.zeros(b, device=dev)  # (B,) sum of log-probs
    lengths = torch.zeros(b, dtype=torch.long, device=dev)  # (B,) tokens incl. eos
    finished = torch.zeros(b, dtype=torch.bool, device=dev)  # (B,)
    for t in range(max_len):
        logp = step(seqs[:, : t + 1], cache)  # (B, V)
        tok = torch.where(finished, fill, logp.argmax(dim=-1))  # (B,)
        gain = logp.gather(1, tok[:, None]).squeeze(1)  # (B,)
        scores = scores + torch.where(finished, 0.0, gain)
        lengths = torch.where(finished, lengths, t + 1)
        finished = finished | (tok == eos_id) if eos_id is not None else finished
        seqs[:, t + 1] = tok
        if bool(finished.all()):
            break
    width = int(lengths.max())
    return Decoded(seqs[:, 1 : 1 + width], scores / lengths.float() ** length_penalty, lengths)


def beam_search(
    step: Step,
    start: Tensor,
    *,
    beams: int,
    max_len: int,
    eos_id: int | None,
    fill: int,
    length_penalty: float = 1.0,
    cache: Reorderable | None = None,
) -> Decoded:
    """Batched beam search: the ``beams`` best hypotheses per source, ranked by length-normalised score.

    Args:
        step: ``step(tokens (B*K, t), cache) -> log-probs (B*K, V)``; row ``b*K + j`` is beam j of
            source b, so whatever the step reads per row (a source's encoding) must be repeated K times.
        start: (B,) the first token of every source.
        beams: K >= 1. max_len, eos_id, fill, length_penalty: as in :func:`greedy`.
        cache: passed to ``step``, and reordered after every step with
            ``cache.reorder(parent_rows (B*K,), include_static=False)``.

    All K*V continuations of the K beams of a source are ranked by
    ``(score + log p) / length ** length_penalty`` at every step; finished beams stay (continuing with
    ``fill`` at no cost) until all K of a source are finished or ``max_len`` is reached. Returns the best
    hypothesis per source as :class:`Decoded`.
    """
    _check(start, max_len)
    k = positive_int("beams", beams)
    b, dev = start.shape[0], start.device
    scores = torch.full((b, k), float("-inf"), device=dev)  # (B, K) sum of log-probs
    scores[:, 0] = 0.0  # one live beam at the start: the others would duplicate it
    lengths = torch.zeros(b, k, dtype=torch.long, device=dev)  # (B, K) tokens incl. eos
    finished = torch.zeros(b, k, dtype=torch.bool, device=dev)  # (B, K)
    seqs = start[:, None, None].expand(b, k, 1)  # (B, K, t) with the start token
    row0 = torch.arange(b, device=dev)[:, None] * k  # (B, 1) first row of each source
    for t in range(max_len):
        logp = step(seqs.reshape(b * k, t + 1), cache).view(b, k, -1)  # (B, K, V)
        v = logp.shape[-1]
        # A finished beam continues only with `fill`, at no cost.
        logp = logp.masked_fill(finished[..., None], float("-inf"))
        logp[..., fill] = torch.where(finished, 0.0, logp[..., fill])
        cand = scores[..., None] + logp  # (B, K, V)
        cand_len = torch.where(finished, lengths, t + 1).float()[..., None]  # (B, K, 1)
        ranked = (cand / cand_len**length_penalty).view(b, k * v)  # (B, K*V)
        top = ranked.topk(k, dim=-1).indices  # (B, K), best first
        parent, tok = top // v, top % v  # (B, K), (B, K)
        scores = cand.view(b, k * v).gather(1, top)  # (B, K)
        was_done = finished.gather(1, parent)  # (B, K)
        lengths = torch.where(was_done, lengths.gather(1, parent), t + 1)
        finished = was_done | (tok == eos_id) if eos_id is not None else was_done
        seqs = torch.cat(
            [seqs.gather(1, parent[..., None].expand(-1, -1, t + 1)), tok[..., None]], dim=2
        )  # (B, K, t + 2)
        if cache is not None and k > 1:
            cache.reorder((row0 + parent).view(-1), include_static=False)  # (B*K,) parent rows
        if bool(finished.all()):
            break
    best_len = lengths[:, 0]  # (B,) the top-ranked hypothesis
    best = seqs[:, 0, 1 : 1 + int(best_len.max())]  # (B, T')
    return Decoded(best, scores[:, 0] / best_len.float() ** length_penalty, best_len)
