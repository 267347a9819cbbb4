"""What every rank of a sequence-parallel call agrees on first: shapes, lengths, positions, the strategy.

Dimensions: B batch, H query heads, Hkv key/value heads (H % Hkv == 0), P ranks in the process group,
r this rank, Lq/Lk this rank's local query/key lengths, m_s rank s's key length, Dk/Dv head dims.

One small all-gather of a row of integers per rank (:class:`Meta`) comes before any other message of a
call. Every rank then holds the same table, so every rank raises the same error for a call that ranks
disagree on (lengths no layout produces, heads, layouts, strategies) instead of hanging in a collective
that its peers never enter; a rank whose own inputs are wrong raises its own error and the others say
which rank it was. The result, a :class:`Plan`, is what the ring (:mod:`.ring`) and the all-to-all
(:mod:`.ulysses`) run from.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

from ..core import masks as _masks
from ..core.attention import check_qkv, check_sinks
from ..core.checks import check_scale, check_softcap
from .blocks import KERNELS, Block, choose_kernel, make_block, shares_ids
from .sharding import LAYOUTS, check_layout, positions_from_lengths, split_region, visible_region

__all__ = [
    "STRATEGIES",
    "Meta",
    "PeerLost",
    "Plan",
    "Shard",
    "agree",
    "agree_on",
    "answered",
    "check_head_chunks",
    "make_plan",
]

_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
STRATEGIES = ("ring", "ulysses", "hybrid")


class Shard(NamedTuple):
    """One rank's keys and what travels with them."""

    k: Tensor  # (B, Hkv, m, Dk)
    v: Tensor  # (B, Hkv, m, Dv)
    key_mask: Tensor | None  # (B, m) bool, True = real key
    kv_ids: Tensor | None  # (B, m) int64 segment ids


class Meta(NamedTuple):
    """One rank's view of a call, as integers (one row of the all-gathered table)."""

    ok: int  # 0: this rank's own inputs were rejected (it raises its own error)
    batch: int
    heads: int
    kv_heads: int
    dk: int
    dv: int
    lq: int  # this rank's query length (may differ between ranks)
    lk: int  # this rank's key length (may differ between ranks)
    dtype: int  # index in _DTYPES
    causal: int
    layout: int  # index in LAYOUTS
    key_mask: int
    segments: int  # 1: segment_ids given
    valid_lens: int  # 0: none, 1: (B,), 2: (B, Lq)
    kernel: int  # index in KERNELS, as requested
    strategy: int  # index in STRATEGIES
    pieces: int  # K/V shards travel in this many pieces
    softcap: int  # 1: softcap given
    sinks: int  # 1: sinks given
    head_chunks: int  # Ulysses' head chunks as asked (0: None, chosen from the size)
    grad: int  # 1: autograd records this call here (grad enabled, an input requires grad)


# fields that may differ between ranks (no key_mask: all keys real; pieces: the smallest count is used;
# grad: a call is differentiable when any rank records it)
_PER_RANK = ("lq", "lk", "key_mask", "pieces", "grad")
_NAMES = {"batch": "B", "heads": "H", "kv_heads": "Hkv", "dk": "Dk", "dv": "Dv", "lq": "Lq", "lk": "Lk"}
_CHOICES = {"layout": LAYOUTS, "strategy": STRATEGIES, "kernel": KERNELS, "dtype": _DTYPES}


@dataclass(frozen=True, kw_only=True)
class Plan:
    """Everything a rank needs to run its steps; identical in shape on every rank."""

    group: Any
    rank: int
    world: int
    next_peer: int  # global rank of r + 1 (we send to it)
    prev_peer: int  # global rank of r - 1 (we receive from it)
    q_pos_all: list[Tensor]  # P tensors (Lq_s,): global positions of rank s's queries, on CPU
    k_pos: list[Tensor]  # P tensors (m_s,): global positions of rank s's keys, on CPU
    batch: int
    heads: int
    kv_heads: int
    dk: int
    dv: int
    causal_offset: int | None  # Lk_total - Lq_total (bottom-right causal), None when not causal
    scale: float
    valid_lens: Tensor | None  # (B,) or (B, Lq): global key counts
    has_key_mask: bool
    q_ids: Tensor | None  # (B, Lq) segment ids of this rank's queries
    kv_ids: Tensor | None  # (B, Lk) segment ids of this rank's keys (they travel with the keys)
    kernel: str  # "flash" or "math" (see blocks.choose_kernel)
    compute_dtype: torch.dtype  # the dtype blocks compute and accumulate in
    pieces: int = 1  # the ring sends each K/V shard in this many pieces, one ring per piece
    softcap: float | None = None  # scores -> softcap * tanh(scores / softcap), in every block
    grad: bool = True  # some rank's autograd records the call (False: a schedule without a backward may run)

    @property
    def q_pos(self) -> Tensor:
        """(Lq,) global positions of this rank's queries."""
        return self.q_pos_all[self.rank]

    def src(self, step: int) -> int:
        """Rank whose key/value shard this rank holds at ``step``."""
        return (self.rank - step) % self.world

    def cols(self, src: int, piece: int) -> slice:
        """Rank ``src``'s key columns in ``piece`` (of :attr:`pieces`, as even as they go)."""
        m = len(self.k_pos[src])
        return slice(piece * m // self.pieces, (piece + 1) * m // self.pieces)

    def vid(self, src: int, piece: int) -> int:
        """The virtual shard of ``piece`` of rank ``src``'s keys (what a relay buffer is shaped for)."""
        return piece * self.world + src

    def kv_shape(self, src: int, d: int, piece: int = 0) -> tuple[int, int, int, int]:
        """(B, Hkv, m, d): the shape of ``piece`` of rank ``src``'s keys (d = Dk) or values (d = Dv)."""
        c = self.cols(src, piece)
        return (self.batch, self.kv_heads, c.stop - c.start, d)

    def blocks(self, src: int, shard: Shard, device: torch.device, piece: int = 0) -> list[Block]:
        """The blocks of this rank's queries x ``piece`` of rank ``src``'s keys that something sees: none
        when the causal mask hides them all or the keys share no segment id with the queries; a causal
        staircase comes as its own small block (a triangle where it is one) and the rows that see every
        key as a plain rectangle, so no (rows, keys) mask is built for them."""
        k_pos = self.k_pos[src][self.cols(src, piece)]  # (m,) global positions of the piece's keys
        region = visible_region(self.q_pos, k_pos, self.causal_offset)
        if region is None:
            return []
        segments = None
        if self.q_ids is not None and shard.kv_ids is not None:
            segments = (self.q_ids, shard.kv_ids)
            if not shares_ids(self.q_ids[:, region.rows], shard.kv_ids[:, region.cols]):
                return []
        return [
            make_block(
                part,
                k_pos,
                valid_lens=self.valid_lens,
                key_mask=shard.key_mask,
                segments=segments,
                device=device,
            )
            for part in split_region(
                region, max(1, len(k_pos) // 2) if self.pieces > 1 else None
            )  # row tiles
        ]


def _comm_device(group: Any, like: object) -> torch.device:
    if isinstance(like, Tensor):
        return like.device
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def check_head_chunks(head_chunks: object) -> None:
    """``head_chunks`` is None or a positive int (else a ValueError that says so)."""
    if head_chunks is not None and (
        isinstance(head_chunks, bool) or not isinstance(head_chunks, int) or head_chunks < 1
    ):
        raise ValueError(
            f"head_chunks must be a positive int (chunks of heads per exchange) or None, got {head_chunks!r}"
        )


def _local_meta(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    causal: bool,
    layout: str,
    valid_lens: Tensor | None,
    key_mask: Tensor | None,
    segment_ids: Tensor | tuple[Tensor, Tensor] | None,
    block_kernel: str,
    strategy: str,
    pieces: int,
    softcap: float | None,
    sinks: Tensor | None,
    head_chunks: int | None,
) -> tuple[Meta, tuple[Tensor, Tensor] | None]:
    """This rank's :class:`Meta`; raises what is wrong with its own inputs."""
    check_qkv(q, k, v)
    check_layout(layout)
    if isinstance(pieces, bool) or not isinstance(pieces, int) or pieces < 1:
        raise ValueError(f"kv_pieces must be a positive int (pieces a K/V shard travels in), got {pieces!r}")
    if block_kernel not in KERNELS:
        raise ValueError(f"block_kernel must be one of {KERNELS}, got {block_kernel!r}")
    (b, h, lq, dk), (_, hkv, lk, dv) = q.shape, v.shape
    if q.dtype not in _DTYPES:
        raise TypeError(f"{strategy}_attention supports dtypes {_DTYPES}, got {q.dtype}")
    if valid_lens is not None:
        _masks.check_valid_lens(valid_lens, b, lq)
    if key_mask is not None and (
        not isinstance(key_mask, Tensor) or key_mask.dtype != torch.bool or tuple(key_mask.shape) != (b, lk)
    ):
        got = (tuple(key_mask.shape), key_mask.dtype) if isinstance(key_mask, Tensor) else type(key_mask)
        raise ValueError(
            f"key_mask must be a bool tensor of shape (B, Lk) = {(b, lk)} (this rank's keys, True = real "
            f"key), got {got}; build it with `shard(keep, 1, rank, world, layout)` from a (B, L) bool mask"
        )
    ids = None if segment_ids is None else _masks.check_segment_ids(segment_ids, b, lq, lk, q.device)
    check_softcap(softcap)
    check_sinks(sinks, q)
    check_head_chunks(head_chunks)
    if softcap is not None and block_kernel == "flash":
        raise ValueError(
            "block_kernel='flash' cannot apply softcap (the fused kernel has no cap); use 'auto'"
        )
    meta = Meta(
        ok=1,
        batch=b,
        heads=h,
        kv_heads=hkv,
        dk=dk,
        dv=dv,
        lq=lq,
        lk=lk,
        dtype=_DTYPES.index(q.dtype),
        causal=int(bool(causal)),
        layout=LAYOUTS.index(layout),
        key_mask=int(key_mask is not None),
        segments=int(ids is not None),
        valid_lens=0 if valid_lens is None else valid_lens.dim(),
        kernel=KERNELS.index(block_kernel),
        strategy=STRATEGIES.index(strategy),
        pieces=pieces,
        softcap=int(softcap is not None),
        sinks=int(sinks is not None),
        head_chunks=head_chunks or 0,
        grad=int(
            torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, k, v, sinks))
        ),
    )
    return meta, ids


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Blocks compute and accumulate half precision in float32, the rest in its own dtype."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def make_plan(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    causal: bool,
    group: Any,
    layout: str,
    valid_lens: Tensor | None,
    key_mask: Tensor | None,
    scale: float | None,
    segment_ids: Tensor | tuple[Tensor, Tensor] | None = None,
    block_kernel: str = "auto",
    strategy: str = "ring",
    positions: tuple[list[Tensor], list[Tensor]] | None = None,
    pieces: int = 1,
    softcap: float | None = None,
    sinks: Tensor | None = None,
    head_chunks: int | None = None,
) -> Plan:
    """Validate the call on every rank at once; all ranks raise the same kind of error, none hangs.

    ``strategy`` (one of :data:`STRATEGIES`) is part of what ranks agree on: a rank that runs another
    strategy than its peers is named. ``positions`` (each rank's query positions, each rank's key
    positions) replaces the layout's (the hybrid's ring runs over unions of shards).
    """
    caller = f"{strategy}_attention"
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            f"{caller} needs an initialized torch.distributed process group: call "
            "torch.distributed.init_process_group(...) in every process (or start them with "
            "multihead.distributed.launch / torchrun), or use multihead.attention in a single process"
        )
    local = dict(
        causal=causal,
        layout=layout,
        valid_lens=valid_lens,
        key_mask=key_mask,
        segment_ids=segment_ids,
        block_kernel=block_kernel,
        strategy=strategy,
        pieces=pieces,
        softcap=softcap,
        sinks=sinks,
        head_chunks=head_chunks,
    )
    table, ids, scale = _agreed_table(q, k, v, group, caller, scale, local)
    return _plan_from(
        q,
        table,
        ids,
        scale,
        group=group,
        caller=caller,
        layout=layout,
        positions=positions,
        causal=causal,
        valid_lens=valid_lens,
        block_kernel=block_kernel,
        softcap=softcap,
    )


def _plan_from(
    q: Tensor,
    table: list[Meta],
    ids: tuple[Tensor, Tensor] | None,
    scale: float,
    *,
    group: Any,
    caller: str,
    layout: str,
    positions: tuple[list[Tensor], list[Tensor]] | None,
    causal: bool,
    valid_lens: Tensor | None,
    block_kernel: str,
    softcap: float | None,
) -> Plan:
    """This rank's :class:`Plan` from the agreed ``table``: every rank's token positions, its peers, the
    block kernel (the checks that need every rank's lengths raise here, the same on every rank)."""
    world, rank = len(table), dist.get_rank(group)
    lq_all, lk_all = [row.lq for row in table], [row.lk for row in table]
    if min(lq_all) == 0 or min(lk_all) == 0:
        raise ValueError(
            f"{caller}: every rank needs at least one query and one key, got local lengths "
            f"Lq {lq_all}, Lk {lk_all}; use fewer ranks or a longer sequence"
        )
    if positions is None:
        q_pos_all = positions_from_lengths(lq_all, layout, f"{caller} (queries)")
        k_pos = positions_from_lengths(lk_all, layout, f"{caller} (keys)")
    else:
        q_pos_all, k_pos = positions
    get_global = functools.partial(dist.get_global_rank, group) if group is not None else (lambda r: r)
    mine_meta = table[rank]
    compute = _compute_dtype(q.dtype)
    return Plan(
        group=group,
        rank=rank,
        world=world,
        next_peer=get_global((rank + 1) % world),
        prev_peer=get_global((rank - 1) % world),
        q_pos_all=q_pos_all,
        k_pos=k_pos,
        batch=mine_meta.batch,
        heads=mine_meta.heads,
        kv_heads=mine_meta.kv_heads,
        dk=mine_meta.dk,
        dv=mine_meta.dv,
        causal_offset=(sum(map(len, k_pos)) - sum(map(len, q_pos_all))) if causal else None,
        scale=scale,
        valid_lens=valid_lens,
        has_key_mask=any(row.key_mask for row in table),
        q_ids=None if ids is None else ids[0],
        kv_ids=None if ids is None else ids[1],
        kernel="math"
        if softcap is not None
        else choose_kernel(block_kernel, q.device, compute, mine_meta.dk, mine_meta.dv),
        compute_dtype=compute,
        pieces=max(1, min(min(row.pieces for row in table), min(lk_all))) if world > 1 else 1,
        softcap=check_softcap(softcap),
        grad=any(row.grad for row in table),
    )


def _agreed_table(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    group: Any,
    caller: str,
    scale: float | None,
    local: dict[str, Any],
) -> tuple[list[Meta], tuple[Tensor, Tensor] | None, float]:
    """Every rank's :class:`Meta` (``local``: :func:`_local_meta`'s keywords), this rank's checked segment
    ids and scale. Collective: a rank whose inputs are wrong raises its own error, the others name it; a
    field that must agree and does not raises the same message everywhere."""
    error: Exception | None = None
    ids = None
    try:
        meta, ids = _local_meta(q, k, v, **local)
        scale = check_scale(scale, q.shape[-1])
    except (TypeError, ValueError) as exc:
        error, meta = exc, Meta(*([0] * len(Meta._fields)))
    table = agree(meta, group, caller, like=q)  # P rows, identical on every rank
    bad = [s for s, row in enumerate(table) if not row.ok]
    if bad:
        raise shared_error(error, bad, group, caller) from error
    for field in Meta._fields:
        values = [getattr(row, field) for row in table]
        if field not in _PER_RANK and len(set(values)) > 1:
            shown = [_CHOICES[field][x] for x in values] if field in _CHOICES else values
            raise ValueError(  # one message on every rank, whatever each one called
                f"sequence-parallel attention: every rank must pass the same {_NAMES.get(field, field)}; "
                f"ranks 0..{len(table) - 1} gave {shown}"
            )
    return table, ids, scale


def shared_error(error: Exception | None, bad: list[int], group: Any, caller: str) -> Exception:
    """The one error every rank raises when the ranks ``bad`` rejected their own inputs: the first one's
    ``ValueError`` or ``TypeError`` and its message, naming that rank. A collective on this path only (every
    rank knows from the agreed table that it is taken): one all-gather of each rank's error, or None."""
    mine = None if error is None else (type(error).__name__, str(error))
    every: list[Any] = [None] * dist.get_world_size(group)
    with answered(caller):
        dist.all_gather_object(every, mine, group=group)
    kind, message = every[bad[0]]  # a rank is bad only when its own check raised
    also = f" (ranks {bad} rejected theirs)" if len(bad) > 1 else ""
    return (TypeError if kind == "TypeError" else ValueError)(
        f"{caller}: rank {bad[0]}'s inputs: {message}{also}"
    )


def agree(meta: Meta, group: Any, caller: str, *, like: object = None) -> list[Meta]:
    """All-gather every rank's ``meta``: the table, identical on every rank.

    A rank that does not take part in time (it died, or never made the call) makes the others raise a
    ``RuntimeError`` that says so, after the group's timeout, instead of hanging.
    """
    world = dist.get_world_size(group)
    mine = torch.tensor(meta, dtype=torch.long, device=_comm_device(group, like))  # (len(Meta),)
    every = [torch.empty_like(mine) for _ in range(world)]
    with answered(caller):
        dist.all_gather(every, mine, group=group)
    return [Meta(*row) for row in torch.stack(every).tolist()]


def agree_on(group: Any, caller: str, fields: dict[str, int], shown: dict[str, tuple[Any, ...]]) -> None:
    """Raise the same ``ValueError`` on every rank if the ranks of ``group`` disagree on any of ``fields``.

    ``fields`` are this rank's integer choices; ``shown[name]`` turns an index back into its value for the
    message. One all-gather of len(fields) integers.
    """
    world = dist.get_world_size(group)
    mine = torch.tensor(list(fields.values()), dtype=torch.long, device=_comm_device(group, None))
    every = [torch.empty_like(mine) for _ in range(world)]
    with answered(caller):
        dist.all_gather(every, mine, group=group)
    table = torch.stack(every).tolist()  # (P, len(fields)), identical on every rank
    for j, name in enumerate(fields):
        values = [row[j] for row in table]
        if len(set(values)) > 1:
            got = [shown[name][x] for x in values] if name in shown else values
            raise ValueError(
                f"{caller}: every rank must pass the same {name}; ranks 0..{world - 1} gave {got}"
            )


class PeerLost(RuntimeError):
    """A rank of the group did not answer a collective in time: it died, or it never made the call."""


@contextmanager
def answered(caller: str) -> Iterator[None]:
    """Turn the error of a collective that a peer never answered into a :class:`PeerLost` that says so.

    torch.distributed raises after the group's timeout (or at once, when the peer's connection closed).
    """
    try:
        yield
    except PeerLost:
        raise
    except RuntimeError as exc:
        raise PeerLost(
            f"{caller}: a rank of the group did not answer within the group's timeout -- it died, or it "
            f"never made this call; every rank of the group must call {caller} together ({exc})"
        ) from exc
