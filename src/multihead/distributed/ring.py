"""The ring: K/V shards travel around the ranks; each rank folds one block per shard into its answer.

Dimensions: B batch, H query heads, Hkv key/value heads (H % Hkv == 0), P ranks in the process group,
r this rank, Lq/Lk this rank's local query/key lengths, m_s rank s's key length, n/m the rows/columns
of one block, Dk query/key head dim, Dv value head dim.

Forward: at step t this rank holds the K/V shard of rank s = r - t. It starts sending that shard to
r + 1 and receiving the next from r - 1 (``isend``/``irecv``), computes its block over the shard it has
(:func:`~.blocks.block_forward`), and merges the block's normalised output and log-sum-exp into its
running state (:func:`~.blocks.merge_into`): exact, whatever the order. After P steps it holds the
output over the whole sequence and its log-sum-exp.

Backward: the K/V shards go around once more, and with them one dK/dV accumulator per shard. At each
hop the holder adds its queries' share of the shard's gradients (the fused kernel's own backward,
driven by the *final* output and log-sum-exp) and passes it on; after P hops it is back home,
complete. dQ never leaves its rank. Every message goes into one of two preallocated buffers that
alternate (one in flight, one in use), so a step allocates only what the block kernel returns.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from .agree import Plan, Shard, answered, make_plan
from .blocks import (
    Block,
    BlockInputs,
    Grads,
    SoftmaxState,
    add_sinks,
    block_backward,
    block_forward,
    merge_into,
    prepare,
    sinks_grad,
)

__all__ = ["PIECE_KEYS", "auto_pieces", "ring_attention", "ring_forward", "ring_with_plan"]

# P2P tags: K, V, the key mask, dK and dV may all be in flight between the same two ranks at once
_TAG_K, _TAG_V, _TAG_MASK, _TAG_DK, _TAG_DV, _TAG_IDS = 1, 2, 3, 4, 5, 6


# ----------------------------------------------------------------------------------------------
# Messages: tensors of one shard that travel to r + 1, into two alternating buffers
# ----------------------------------------------------------------------------------------------


class _Relay:
    """Sends a set of per-shard tensors on around the ring, receiving into two alternating buffers.

    ``shapes(vid)`` gives the shapes of piece ``vid // P`` of rank ``vid % P``'s tensors (see
    :meth:`~.agree.Plan.vid`); every buffer is flat storage as large as the largest piece's, viewed at the
    shape of the piece it holds (contiguous, as P2P needs).
    """

    def __init__(
        self,
        plan: Plan,
        shapes: Callable[[int], list[tuple[int, ...]]],
        dtypes: tuple[torch.dtype, ...],
        tags: tuple[int, ...],
        device: torch.device,
    ) -> None:
        self.plan, self.shapes, self.dtypes, self.tags = plan, shapes, dtypes, tags
        sizes = [[_numel(s) for s in shapes(vid)] for vid in range(plan.world * plan.pieces)]
        self.numel = [max(col) for col in zip(*sizes)]
        self.device = device
        self.buffers: list[list[Tensor]] = []  # up to two sets, made when first needed
        self.works: list[Any] = []

    def views(self, slot: int, src: int) -> list[Tensor]:
        """Buffer set ``slot`` viewed as the tensors of virtual shard ``src`` (a piece of a rank's shard)."""
        while len(self.buffers) <= slot:
            self.buffers.append(
                [torch.empty(n, dtype=d, device=self.device) for n, d in zip(self.numel, self.dtypes)]
            )
        return [buf[: _numel(s)].view(s) for buf, s in zip(self.buffers[slot], self.shapes(src))]

    def start(self, send: list[Tensor], slot: int, src: int) -> list[Tensor]:
        """Start sending ``send`` to r + 1 and receiving rank ``src``'s tensors from r - 1 into ``slot``."""
        recv = self.views(slot, src)
        ops = []
        for s, r, tag in zip(send, recv, self.tags):
            ops.append(dist.P2POp(dist.isend, s, self.plan.next_peer, self.plan.group, tag))
            ops.append(dist.P2POp(dist.irecv, r, self.plan.prev_peer, self.plan.group, tag))
        self.works = dist.batch_isend_irecv(ops)
        return recv

    def wait(self) -> None:
        with answered("ring_attention"):
            for w in self.works:
                w.wait()
        self.works = []


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _kv_relay(plan: Plan, k: Tensor, v: Tensor) -> _Relay:
    """The relay of K, V (the key mask as uint8, the keys' segment ids), piece by piece."""

    def shapes(vid: int) -> list[tuple[int, ...]]:
        src, piece = vid % plan.world, vid // plan.world
        m = len(plan.k_pos[src][plan.cols(src, piece)])
        own = [plan.kv_shape(src, plan.dk, piece), plan.kv_shape(src, plan.dv, piece)]
        return own + [(plan.batch, m)] * (plan.has_key_mask + (plan.kv_ids is not None))

    dtypes = (k.dtype, v.dtype) + ((torch.uint8,) if plan.has_key_mask else ())
    tags = (_TAG_K, _TAG_V) + ((_TAG_MASK,) if plan.has_key_mask else ())
    if plan.kv_ids is not None:
        dtypes, tags = dtypes + (torch.int64,), tags + (_TAG_IDS,)
    return _Relay(plan, shapes, dtypes, tags, k.device)


def _own(plan: Plan, k: Tensor, v: Tensor, key_mask: Tensor | None, piece: int) -> list[Tensor]:
    """This rank's messages for ``piece``: its columns of K, V, the key mask (uint8) and the key ids."""
    cols = plan.cols(plan.rank, piece)
    whole = plan.pieces == 1
    mine = [k if whole else k[:, :, cols], v if whole else v[:, :, cols]]  # (B, Hkv, m, D*)
    if key_mask is not None:
        mine.append(key_mask[:, cols].view(torch.uint8))  # (B, m): gloo sends no bool
    if plan.kv_ids is not None:
        mine.append(plan.kv_ids[:, cols])  # (B, m)
    return [t.contiguous() for t in mine]


def _unpack(msg: list[Tensor], plan: Plan) -> Shard:
    k, v, rest = msg[0], msg[1], msg[2:]
    key_mask = rest.pop(0).view(torch.bool) if plan.has_key_mask else None
    return Shard(k, v, key_mask, rest[0] if plan.kv_ids is not None else None)


# ----------------------------------------------------------------------------------------------
# Forward and backward
# ----------------------------------------------------------------------------------------------


def ring_forward(q: Tensor, k: Tensor, v: Tensor, key_mask: Tensor | None, plan: Plan) -> SoftmaxState:
    """Output (B, H, Lq, Dv) and log-sum-exp (B, H, Lq) over every rank's keys, in the compute dtype."""
    dtype = plan.compute_dtype
    qa = prepare(q, dtype)  # (B, H, Lq, Dk)
    relay = _kv_relay(plan, k, v)
    state: SoftmaxState | None = None
    for piece in range(plan.pieces):  # one ring per piece: only pieces are ever in flight
        msg = _own(plan, k, v, key_mask, piece)
        for step in range(plan.world):
            src = plan.src(step)
            shard = _unpack(msg, plan)
            last = step == plan.world - 1
            nxt = None if last else relay.start(msg, step % 2, plan.vid(plan.src(step + 1), piece))
            for blk in plan.blocks(src, shard, q.device, piece):
                x = BlockInputs(qa, prepare(shard.k, dtype), prepare(shard.v, dtype))
                # the block's output is passed on, not named: it is freed once absorbed, before the next
                # block allocates its own (a name would keep two block outputs alive at once)
                state = _absorb(state, block_forward(x, blk, plan.scale, plan.kernel, plan.softcap), blk, q,
                                v.shape[-1], dtype)  # fmt: skip
            relay.wait()
            if nxt is not None:
                msg = nxt
    if state is None:  # no query of this rank sees any key
        state = _absorb(None, None, None, q, v.shape[-1], dtype)
    return state


def _absorb(
    state: SoftmaxState | None,
    part: SoftmaxState | None,
    blk: Block | None,
    q: Tensor,
    dv: int,
    dtype: torch.dtype,
) -> SoftmaxState:
    """The running state after ``part`` (a block over rows ``blk.rows`` of the queries ``q``); the first
    full-rows block is taken as it is, without a copy."""
    b, h, lq, _ = q.shape
    if state is None and part is not None and blk is not None and blk.n == lq:
        return part
    if state is None:
        state = SoftmaxState(
            q.new_zeros((b, h, lq, dv), dtype=dtype),  # (B, H, Lq, Dv)
            q.new_full((b, h, lq), float("-inf"), dtype=dtype),  # (B, H, Lq)
        )
    if part is not None and blk is not None:
        merge_into(SoftmaxState(state.out[:, :, blk.rows], state.lse[:, :, blk.rows]), part)
    return state


def _ring_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, key_mask: Tensor | None, final: SoftmaxState, plan: Plan
) -> tuple[Tensor, Tensor, Tensor]:
    """dq (B, H, Lq, Dk) for this rank's queries and dk, dv for this rank's keys, summed over all ranks.
    ``final``: the forward's output and log-sum-exp, with 0 where a row saw nothing (so that p = 0 there)."""
    dtype = plan.compute_dtype
    qa, da = prepare(q, dtype), dout.to(dtype).contiguous()  # (B, H, Lq, Dk), (B, H, Lq, Dv)
    kv_relay = _kv_relay(plan, k, v)
    grad_relay = _Relay(
        plan,
        lambda vid: [
            plan.kv_shape(vid % plan.world, plan.dk, vid // plan.world),
            plan.kv_shape(vid % plan.world, plan.dv, vid // plan.world),
        ],
        (dtype, dtype),
        (_TAG_DK, _TAG_DV),
        k.device,
    )
    dq: Tensor | None = None
    homes = []
    for piece in range(plan.pieces):  # one ring per piece, as in the forward
        dq, home = _backward_piece(qa, da, k, v, key_mask, final, plan, kv_relay, grad_relay, dq, piece)
        homes.append(home if plan.pieces == 1 else [t.clone() for t in home])  # buffers are reused
    dk, dv = (torch.cat(parts, dim=2) for parts in zip(*homes)) if plan.pieces > 1 else homes[0]
    if dq is None:  # no query of this rank sees any key
        dq = torch.zeros_like(qa)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _backward_piece(
    qa: Tensor,
    da: Tensor,
    k: Tensor,
    v: Tensor,
    key_mask: Tensor | None,
    final: SoftmaxState,
    plan: Plan,
    kv_relay: _Relay,
    grad_relay: _Relay,
    dq: Tensor | None,
    piece: int,
) -> tuple[Tensor | None, list[Tensor]]:
    """One piece's ring of the backward: dq so far, and this rank's own piece's dK, dV (complete)."""
    dtype = plan.compute_dtype
    msg = _own(plan, k, v, key_mask, piece)
    acc: list[Tensor] | None = None  # dK, dV of the piece held at this step, with earlier ranks' shares
    incoming: list[Tensor] | None = None  # the next piece's accumulator, arriving from r - 1
    for step in range(plan.world):
        src = plan.src(step)
        shard = _unpack(msg, plan)
        nxt_vid = plan.vid(plan.src(step + 1), piece)
        nxt = kv_relay.start(msg, step % 2, nxt_vid) if step < plan.world - 1 else None
        shares = []  # (block, its share of the gradients)
        for blk in plan.blocks(src, shard, qa.device, piece):
            x = BlockInputs(qa, prepare(shard.k, dtype), prepare(shard.v, dtype))
            grads = block_backward(x, da, final, blk, plan.scale, plan.kernel, plan.softcap)
            dq = _add_rows(dq, grads.dq, blk.rows, tuple(qa.shape), dtype)
            shares.append((blk, grads))
        grad_relay.wait()  # the accumulator for shard `src` has arrived (and our last one has left)
        if step == 0:
            whole = len(shares) == 1 and shares[0][0].cols.stop == shard.k.shape[2]
            if plan.world == 1 and whole:
                acc = [shares[0][1].dk, shares[0][1].dv]  # the whole answer, no copy
            else:
                acc = [t.zero_() for t in grad_relay.views(0, plan.vid(src, piece))]
                _add_cols(acc, shares)
        else:
            assert incoming is not None
            acc = incoming
            _add_cols(acc, shares)
        if plan.world > 1:  # pass it on; after P hops it is back home, complete
            incoming = grad_relay.start(acc, (step + 1) % 2, nxt_vid)
        kv_relay.wait()
        if nxt is not None:
            msg = nxt
    grad_relay.wait()
    home = incoming if plan.world > 1 else acc  # this rank's own piece's dK, dV, complete
    assert home is not None
    return dq, home


def _add_rows(
    dq: Tensor | None, part: Tensor, rows: slice, shape: tuple[int, ...], dtype: torch.dtype
) -> Tensor:
    """``dq`` (B, H, Lq, Dk) with a block's share (B, H, n, Dk) added at ``rows``; the first full block is
    taken as it is."""
    if dq is None:
        if part.shape[2] == shape[2]:
            return part
        dq = torch.zeros(shape, dtype=dtype, device=part.device)
    dq[:, :, rows] += part
    return dq


def _add_cols(acc: list[Tensor], shares: list[tuple[Block, Grads]]) -> None:
    """Add each block's dk, dv (B, Hkv, m, D*) into the shard's accumulators at its columns."""
    for blk, grads in shares:
        acc[0][:, :, blk.cols] += grads.dk  # (B, Hkv, m, Dk)
        acc[1][:, :, blk.cols] += grads.dv  # (B, Hkv, m, Dv)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, q: Tensor, k: Tensor, v: Tensor, key_mask: Tensor | None, plan: Plan, sinks: Tensor | None
    ) -> Tensor:
        state = ring_forward(q, k, v, key_mask, plan)
        if sinks is not None:  # one more column of every row's softmax, merged once, on the row's rank
            add_sinks(state, sinks)
        ctx.save_for_backward(q, k, v, state.out, state.lse, sinks)
        ctx.key_mask, ctx.plan = key_mask, plan
        return state.out.to(q.dtype)

    @staticmethod
    def backward(ctx: Any, dout: Tensor) -> tuple[Tensor | None, ...]:
        q, k, v, out, lse, sinks = ctx.saved_tensors
        # a row that saw no key (and no sink): lse 0, not -inf, so that every p = exp(s - lse) there is 0
        final = SoftmaxState(out, lse.masked_fill(torch.isneginf(lse), 0.0))
        dq, dk, dv = _ring_backward(dout, q, k, v, ctx.key_mask, final, ctx.plan)
        dsinks = None
        if sinks is not None and ctx.needs_input_grad[5]:
            dsinks = sinks_grad(sinks, dout.to(out.dtype), final)  # this rank's rows' share
        return dq, dk, dv, None, None, dsinks


def ring_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    causal: bool = False,
    group: Any = None,
    layout: str = "contiguous",
    valid_lens: Tensor | None = None,
    key_mask: Tensor | None = None,
    segment_ids: Tensor | tuple[Tensor, Tensor] | None = None,
    scale: float | None = None,
    block_kernel: str = "auto",
    kv_pieces: int | None = None,
    softcap: float | None = None,
    sinks: Tensor | None = None,
) -> Tensor:
    """Exact attention over a sequence sharded across the ranks of ``group`` (every rank calls it).

    Args:
        q: (B, H, Lq, Dk) this rank's queries (its shard of the global query sequence).
        k: (B, Hkv, Lk, Dk) this rank's keys; H % Hkv == 0 (grouped-query attention).
        v: (B, Hkv, Lk, Dv) this rank's values.
        causal: bottom-right aligned over the *global* positions: query i sees keys j <= i + (L_k - L_q)
            with L_q, L_k the total lengths. Global (8, 8), contiguous over 2 ranks; rank 1 holds query
            rows 4..7, and its (4, 8) block of the mask is::

                1 1 1 1 1 0 0 0
                1 1 1 1 1 1 0 0
                1 1 1 1 1 1 1 0
                1 1 1 1 1 1 1 1

        group: the ``torch.distributed`` process group (default: the world).
        layout: how the sequence is sharded (:data:`~multihead.distributed.LAYOUTS`), as cut by
            :func:`~multihead.distributed.shard`; ``"zigzag"`` balances causal work. ``"contiguous"``
            takes any local lengths (uneven included); the others need the lengths ``shard`` gives.
        valid_lens: int (B,) or (B, Lq): keys at *global* index >= valid_len are masked (d2l meaning).
        key_mask: bool (B, Lk), True = real key, for this rank's keys (a shard of a (B, L) padding mask,
            the argument of :func:`multihead.masks.key_padding`); it travels with the keys.
        softcap: scores -> ``softcap * tanh(scores / softcap)`` in every block (runs the math blocks).
        sinks: (H,) one logit per head, as :func:`multihead.attention`'s: merged once into each rank's
            rows after the ring; its gradient on each rank is its rows' share (sum it over the group,
            as a training loop's all-reduce of a replicated parameter does).
        segment_ids: int (B, Lq) for self-attention, or a pair (q_ids (B, Lq), kv_ids (B, Lk)): this
            rank's shard of the packed sequences' ids (cut like q with :func:`shard`); a query sees only
            keys with its own id, negative ids are padding. The key ids travel with the keys, and a step
            whose keys share no id with this rank's queries is skipped, so the work follows the documents.
        scale: score scale, default 1/sqrt(Dk).
        block_kernel: what computes each block: ``"flash"`` (PyTorch's fused CPU flash-attention
            forward and backward: CPU, float32/float64 or half precision computed in float32, Dk == Dv),
            ``"math"`` (plain matmuls, anywhere) or ``"auto"`` (flash where it can run).
        kv_pieces: each K/V shard travels in this many pieces, one ring per piece, so only two pieces
            are ever in flight (memory per rank: the K/V buffers are 1/kv_pieces of a shard); the same
            bytes go around in kv_pieces times as many messages. None: pieces of at least
            :data:`PIECE_KEYS` keys, at most 4 (short shards go whole). 1 on one rank.

    Returns:
        (B, H, Lq, Dv): this rank's rows of ``multihead.attention(Q, K, V, causal=..., valid_lens=...)``
        on the full sequences. A query with no visible key gets 0 (and finite gradients). Differentiable
        in q, k, v; backward, like forward, must run on every rank.

    Each rank keeps its (B, H, Lq, Dv) output with its (B, H, Lq) log-sum-exp and two K/V pieces in
    flight; grouped-query K/V are never repeated, so memory per rank falls with the number of ranks.
    Every call makes one small all-gather of the shapes first, so a bad input raises on every rank
    instead of hanging the others.
    """
    plan = make_plan(
        q,
        k,
        v,
        causal=causal,
        group=group,
        layout=layout,
        valid_lens=valid_lens,
        key_mask=key_mask,
        scale=scale,
        segment_ids=segment_ids,
        block_kernel=block_kernel,
        pieces=auto_pieces(k) if kv_pieces is None else kv_pieces,
        softcap=softcap,
        sinks=sinks,
    )
    return ring_with_plan(q, k, v, key_mask, plan, sinks)


PIECE_KEYS = 1024
"""With ``kv_pieces=None`` a K/V shard travels in pieces of at least this many keys (at most 4 pieces)."""


def auto_pieces(k: Tensor) -> int:
    """How many pieces a K/V shard (B, Hkv, m, D) travels in by default."""
    return max(1, min(4, k.shape[2] // PIECE_KEYS)) if isinstance(k, Tensor) and k.dim() == 4 else 1


def ring_with_plan(
    q: Tensor, k: Tensor, v: Tensor, key_mask: Tensor | None, plan: Plan, sinks: Tensor | None = None
) -> Tensor:
    """The ring over an agreed :class:`~.agree.Plan` (what :func:`ring_attention` runs after agreeing):
    q (B, H, Lq, Dk), k (B, Hkv, Lk, Dk), v (B, Hkv, Lk, Dv), key_mask (B, Lk), sinks (H,) ->
    (B, H, Lq, Dv)."""
    if plan.has_key_mask and key_mask is None:  # another rank has padding: this one's keys are all real
        key_mask = torch.ones(k.shape[0], k.shape[2], dtype=torch.bool, device=k.device)  # (B, Lk)
    out = _RingAttention.apply(q, k, v, key_mask, plan, sinks)
    assert isinstance(out, Tensor)
    return out
