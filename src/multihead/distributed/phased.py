"""Ulysses without a backward, in K/V *phases*: a rank holds part of a K/V head at a time, not all of it.

Dimensions: B batch, H query heads, P ranks, r this rank, L_q/L_k the total query/key lengths, Lq_r this
rank's query length, w the query heads of one chunk, n the K/V slots a chunk reads, Dv value head dim, W
windows of positions, F phases.

Windowed Ulysses (:func:`~.exchange.attend_in_chunks`) holds the K/V slot a chunk reads over the whole
sequence while the chunk's query windows come and go. No schedule that sends every byte once can hold
less (docs/distributed.md, "The floor"). This one sends queries more than once instead: the chunk's keys
and values arrive in F phases of key windows (each K/V byte still travels once), and in each phase every
query window that sees a key of it arrives, is attended against that phase's keys only, and goes home as
its normalised output and log-sum-exp. The query's own rank merges the phases' partial results exactly
(:func:`~.blocks.merge_into`), as the ring merges its shards. So a rank holds 1/F of the K/V head, plus
its own output and log-sum-exp, which it holds anyway.

What it costs: a query window goes out once per phase it sees, and its output comes back as often, with
one more element per row (the log-sum-exp). Causal, with F = 2: the queries of the first half see the
first phase only, those of the second half both, so queries and outputs travel 1.5 times (K/V once).
:func:`sends` counts it; :func:`multihead.distributed.plan` (``training=False``) predicts it.

It has no backward (a training step's forward keeps the whole-head schedule): Ulysses runs it when no
rank's autograd records the call (the agreed ``Plan.grad``), with every rank's chunk structure aligned
(:func:`aligned`), in the working dtype, on the ring's block kernels (no mask or bias functions, no
dropout, ``backend="auto"``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from .blocks import SoftmaxState, add_sinks, merge_into
from .exchange import (
    Attend,
    Chunk,
    HeadShare,
    Route,
    from_owners,
    heads_out,
    rank_chunks,
    sequences,
    tokens_out,
    window_edges,
)

__all__ = ["KV_PHASES", "aligned", "attend_in_phases", "phase_keys", "phases_for", "runs", "sends"]

KV_PHASES = 2
"""How many phases a chunk's K/V travel in when the phased schedule runs: each holds half of the K/V
head; more phases hold less and send the queries and outputs of more windows again. 1 turns the schedule
off (every rank must set the same value: it decides the exchanges)."""


def phases_for(exchanges: Sequence[Sequence[Chunk]]) -> int:
    """The phases a windowed forward without autograd runs in: :data:`KV_PHASES` where the exchanges are
    :func:`aligned`, else 1 (the whole-head schedule of :func:`~.exchange.attend_in_chunks`)."""
    return KV_PHASES if KV_PHASES > 1 and aligned(exchanges) else 1


def aligned(exchanges: Sequence[Sequence[Chunk]]) -> bool:
    """Whether in every exchange the ranks with query heads all receive a new K/V slot, or all keep theirs
    (then a :func:`runs` of exchanges shares one slot on every rank, and a phase serves all of them)."""
    return all(len({c.new_kv for c in cs if c.q}) <= 1 for cs in exchanges)


def runs(exchanges: Sequence[Sequence[Chunk]]) -> list[range]:
    """The exchanges cut into runs that read one K/V slot: each run starts where some rank gets a new slot."""
    starts = [i for i, cs in enumerate(exchanges) if i == 0 or any(c.new_kv for c in cs)]
    return [range(a, z) for a, z in zip(starts, [*starts[1:], len(exchanges)])]


def phase_keys(k_edges: Sequence[int], phases: int) -> list[range]:
    """The key windows of each phase (as even as they go; no phase empty): ranges of window indices."""
    count = len(k_edges) - 1
    edges = window_edges(count, max(1, min(phases, count)))
    return [range(a, z) for a, z in zip(edges, edges[1:])]


def sends(q_edges: Sequence[int], k_edges: Sequence[int], phases: int, offset: int | None) -> list[list[int]]:
    """``[i]``: the phases that query window i (positions ``q_edges[i]`` .. ``q_edges[i + 1]`` - 1) goes out
    in: those with a key some query of the window may see (``offset``: bottom-right causal, row p sees keys
    up to p + ``offset``; None: every key)."""
    first = [k_edges[p.start] for p in phase_keys(k_edges, phases)]  # each phase's first key position
    return [[j for j, a in enumerate(first) if offset is None or z - 1 + offset >= a] for z in q_edges[1:]]


def attend_in_phases(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    shares: Sequence[HeadShare],
    positions: tuple[Sequence[Tensor], Sequence[Tensor]],
    group: Any,
    counts: Sequence[int],
    attend: Callable[[Attend], SoftmaxState],
    *,
    windows: int,
    phases: int,
    offset: int | None,
    sinks: Tensor | None = None,
) -> Tensor:
    """Ulysses over ``group`` in K/V phases, without autograd: q (B, H, Lq_r, Dk), k (B, Hkv, Lk_r, Dk),
    v (B, Hkv, Lk_r, Dv) this rank's tokens -> (B, H, Lq_r, Dv).

    ``shares``, ``positions``, ``counts`` and ``windows`` as :func:`~.exchange.attend_in_chunks` (the
    exchanges must be :func:`aligned`); ``attend(Attend)`` -> the :class:`~.blocks.SoftmaxState` (out
    (B, w, b - a, Dv), lse (B, w, b - a)) of a window's queries over the keys at ``Attend.keys`` only;
    ``offset`` the causal offset (None: not causal); ``sinks`` (H,) merged once per row at the end.
    """
    rank = dist.get_rank(group)
    qp, kp, q_edges, k_edges = sequences(positions, windows, q.device)
    b, h, lq, _ = q.shape
    dv = v.shape[-1]
    goes = sends(q_edges, k_edges, phases, offset)
    with torch.no_grad():
        state = SoftmaxState(
            q.new_zeros(b, h, lq, dv),  # (B, H, Lq_r, Dv): 0 for a row that saw no key
            q.new_full((b, h, lq), float("-inf")),  # (B, H, Lq_r)
        )
        exchanges = rank_chunks(shares, counts)
        for run in runs(exchanges):
            for j, part in enumerate(phase_keys(k_edges, phases)):
                keys = range(k_edges[part.start], k_edges[part.stop])
                lead = exchanges[run.start]  # the run's first exchange carries its slots
                slots = tuple(s.kv[c.kv.start : c.kv.stop] if c.new_kv else () for s, c in zip(shares, lead))
                route = Route(slots, kp, group, rank, k_edges)
                kh, vh = heads_out(k, route, part), heads_out(v, route, part)  # (B, n, |keys|, D)
                for cs in (exchanges[i] for i in run):
                    q_route = Route(_heads(shares, cs), qp, group, rank, q_edges)
                    _phase(q, state, (cs, shares, q_route), goes, j, attend, (kh, vh, keys))
                del kh, vh
        if sinks is not None:  # one more column of every row's softmax, once, on the row's rank
            add_sinks(state, sinks)
    return state.out


def _heads(shares: Sequence[HeadShare], cs: Sequence[Chunk]) -> tuple[tuple[int, ...], ...]:
    """Each rank's query heads in the exchange ``cs``."""
    return tuple(tuple(s.q[c.q.start : c.q.stop]) for s, c in zip(shares, cs))


def _phase(
    q: Tensor,
    state: SoftmaxState,
    exchange: tuple[Sequence[Chunk], Sequence[HeadShare], Route],
    goes: list[list[int]],
    j: int,
    attend: Callable[[Attend], SoftmaxState],
    kv: tuple[Tensor, Tensor, range],
) -> None:
    """Phase ``j`` of one exchange (its chunks, the head shares, its queries' route): every query window
    that sees the phase's keys ``kv``, attended and merged into ``state`` at home."""
    (cs, shares, route), (kh, vh, keys) = exchange, kv
    rank = route.rank
    mine = cs[rank]
    b, dv = q.shape[0], vh.shape[-1]
    edges = route.edges
    for i in range(len(edges) - 1):
        if j not in goes[i]:  # no query of the window sees a key of this phase (the same on every rank)
            continue
        a, z = edges[i], edges[i + 1]
        qh = heads_out(q, route, range(i, i + 1))  # (B, w, z - a, Dk)
        if mine.q:
            first = shares[rank].q.start + mine.q.start
            part = attend(Attend(qh, kh, vh, first, range(a, z), keys))
            msg = torch.cat(
                [part.out, part.lse[..., None].to(part.out.dtype)], dim=-1
            )  # (B, w, z - a, Dv + 1)
        else:  # no heads in this exchange
            msg = qh.new_zeros(b, 0, z - a, dv + 1)
        del qh
        got = tokens_out(msg, route, i, a)
        del msg
        rows = route.rows(rank, i)
        for heads, piece in zip(route.heads_of, from_owners(got, route, i, dv + 1, b)):
            if heads:  # (B, w_s, rows, Dv + 1): merged into its heads' running output and log-sum-exp
                hs = slice(heads[0], heads[-1] + 1)
                merge_into(
                    SoftmaxState(state.out[:, hs, rows], state.lse[:, hs, rows]),
                    SoftmaxState(piece[..., :dv], piece[..., dv]),
                )
        del got
