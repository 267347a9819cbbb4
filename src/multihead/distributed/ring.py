"""Exact ring attention over ``torch.distributed``: one sequence split across processes and machines.

Dimensions: B batch, H query heads, Hkv key/value heads (H % Hkv == 0), G = H // Hkv, P ranks in the
process group, r this rank, L a total (global) sequence length, Lq/Lk this rank's local query/key lengths,
n/m the query rows/key columns one block step works on, Dk query/key head dim, Dv value head dim.

Each rank holds a shard of the queries and of the keys/values. The key/value shards travel once around
the ring of ranks (rank r sends to r + 1 and receives from r - 1) with point-to-point ``isend``/``irecv``;
while the next shard is in flight, the rank attends its queries to the shard it has. Each step gives a
partial, unnormalised output with its row max and row sum of exponentials (the log-sum-exp, in two
parts); rescaling the partial results to a common max and adding them is exact: the result equals
softmax attention over the whole sequence. The backward pass sends the key/value shards around again, together with the gradients of K and V, which collect every rank's
contribution on the way and end on the rank that owns the shard.

Which positions of the sequence a rank holds is its *layout* (:data:`LAYOUTS`), the same one
:func:`shard` cuts with. For L = 8 tokens over P = 2 ranks::

    contiguous  rank 0: 0 1 2 3    rank 1: 4 5 6 7      (one block each)
    zigzag      rank 0: 0 1 6 7    rank 1: 2 3 4 5      (chunks r and 2P-1-r of 2P chunks)
    striped     rank 0: 0 2 4 6    rank 1: 1 3 5 7      (every P-th token)

With ``causal=True`` a contiguous layout leaves rank 0 almost idle (its queries see only its own keys)
while rank P-1 attends to everything; zigzag gives every rank the same amount of work, and the steps
skip the key blocks (or the query rows) that the causal mask hides entirely.
"""

from __future__ import annotations

import functools
import queue as _queue
import socket
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ..core import masks as _masks
from ..core.attention import check_qkv
from ..core.backends._common import group_mask, group_queries, ungroup
from ..core.checks import check_scale
from ..nn.attention import MultiHeadAttention
from ..nn.seam import check_positions

__all__ = [
    "LAYOUTS",
    "causal_work",
    "gather_sequence",
    "launch",
    "ring_attention",
    "shard",
    "ShardedAttention",
    "sharded_attention",
    "unshard",
    "use_process_group",
]

LAYOUTS = ("contiguous", "zigzag", "striped")
_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_TAG_KV, _TAG_DKV = 1, 2  # distinct P2P tags: K/V shards and dK/dV accumulators may be in flight together


# ----------------------------------------------------------------------------------------------
# Layouts: which global positions each rank holds
# ----------------------------------------------------------------------------------------------


def _check_layout(layout: object) -> str:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    return str(layout)


def _layout_positions(total: int, world: int, layout: str) -> list[Tensor]:
    """Global positions (ascending) of each rank's shard of a sequence of ``total`` tokens."""
    idx = torch.arange(total)  # (L,)
    if layout == "contiguous":
        return list(idx.tensor_split(world))
    if layout == "zigzag":
        chunks = idx.tensor_split(2 * world)
        return [torch.cat([chunks[r], chunks[2 * world - 1 - r]]) for r in range(world)]
    return [idx[r::world] for r in range(world)]  # striped


def _positions_from_lengths(lengths: Sequence[int], layout: str, what: str) -> list[Tensor]:
    """Global positions of every rank's shard, given every rank's local length.

    ``contiguous`` accepts any lengths (rank r holds the next ``lengths[r]`` tokens); ``zigzag`` and
    ``striped`` need exactly the lengths :func:`shard` produces for the total.
    """
    lengths = [int(n) for n in lengths]
    total = sum(lengths)
    if layout == "contiguous":
        return list(torch.arange(total).split(lengths))
    expected = _layout_positions(total, len(lengths), layout)
    if [len(p) for p in expected] != lengths:
        raise ValueError(
            f"{what}: layout {layout!r} over {len(lengths)} ranks for a total of {total} tokens expects local "
            f"lengths {[len(p) for p in expected]}, got {lengths}; cut the sequence with "
            f"multihead.distributed.shard(x, dim, rank, world, layout={layout!r})"
        )
    return expected


def shard(x: Tensor, dim: int, rank: int, world: int, layout: str = "contiguous") -> Tensor:
    """This rank's shard of the sequence axis ``dim`` of ``x``, in ``layout`` (see :data:`LAYOUTS`).

    Lengths need not divide: ``L`` tokens are cut into ``P`` (contiguous, striped) or ``2P`` (zigzag)
    chunks whose sizes differ by at most one, like ``torch.tensor_split``. For x of shape (B, 8, E)
    and ``world=2``, ``shard(x, 1, 0, 2, "zigzag")`` is ``x[:, [0, 1, 6, 7]]`` (B, 4, E).
    """
    _check_layout(layout)
    if not isinstance(world, int) or world < 1 or not isinstance(rank, int) or not 0 <= rank < world:
        raise ValueError(f"need 0 <= rank < world, got rank={rank!r}, world={world!r}")
    pos = _layout_positions(x.shape[dim], world, layout)[rank]
    return x.index_select(dim, pos.to(x.device))  # (..., L_r, ...)


def unshard(shards: Sequence[Tensor], dim: int, layout: str = "contiguous") -> Tensor:
    """Reassemble the sequence from every rank's shard (``shards[r]`` from rank r); inverse of :func:`shard`.

    ``unshard([shard(x, d, r, P, layout) for r in range(P)], d, layout)`` equals ``x``.
    """
    _check_layout(layout)
    pos = _positions_from_lengths([s.shape[dim] for s in shards], layout, "unshard")
    flat = torch.cat(list(shards), dim)  # (..., L, ...) in rank order
    order = torch.cat(pos).to(flat.device)  # (L,) global position of each row of `flat`
    return torch.empty_like(flat).index_copy_(dim, order, flat)  # (..., L, ...) in sequence order


def gather_sequence(x: Tensor, dim: int, *, layout: str = "contiguous", group: Any = None) -> Tensor:
    """All-gather every rank's shard of ``x`` along ``dim`` and :func:`unshard` it (not differentiable).

    Every rank of ``group`` must call it; shards may differ in length along ``dim``.
    """
    _check_layout(layout)
    world = dist.get_world_size(group)
    length = torch.tensor([x.shape[dim]], device=x.device)
    lengths = [torch.zeros_like(length) for _ in range(world)]
    dist.all_gather(lengths, length, group=group)
    sizes = [int(n) for n in lengths]
    pad = list(x.shape)
    pad[dim] = max(sizes) - x.shape[dim]
    padded = torch.cat([x, x.new_zeros(pad)], dim).contiguous()  # (..., max L_r, ...)
    parts = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded, group=group)
    return unshard([p.narrow(dim, 0, n) for p, n in zip(parts, sizes)], dim, layout)


# ----------------------------------------------------------------------------------------------
# The plan of one call: every rank's shapes and positions, agreed by one small all-gather
# ----------------------------------------------------------------------------------------------

_META = ("ok", "B", "H", "Hkv", "Dk", "Dv", "Lq", "Lk", "dtype", "causal", "layout", "key_mask", "valid_lens")


@dataclass
class _Plan:
    group: Any
    rank: int
    world: int
    next_peer: int  # global rank of r + 1 (we send to it)
    prev_peer: int  # global rank of r - 1 (we receive from it)
    q_pos: Tensor  # (Lq,) global positions of this rank's queries, on CPU
    k_pos: list[Tensor]  # (Lk_s,) global positions of rank s's keys, on CPU
    k_shape: tuple[int, int, int, int]  # (B, Hkv, Dk, Dv)
    causal_offset: int | None  # Lk_total - Lq_total (bottom-right causal), None when not causal
    scale: float
    valid_lens: Tensor | None  # (B,) or (B, Lq): global key counts
    has_key_mask: bool

    def src(self, step: int) -> int:
        """Rank whose key/value shard this rank holds at ``step``."""
        return (self.rank - step) % self.world

    def numel(self, src: int, *, with_mask: bool) -> int:
        """Elements of the flat buffer that carries rank ``src``'s K/V (and key mask) or dK/dV."""
        b, hkv, dk, dv = self.k_shape
        m = len(self.k_pos[src])
        return b * hkv * m * (dk + dv) + (b * m if with_mask and self.has_key_mask else 0)


def _comm_device(group: Any, like: object) -> torch.device:
    if isinstance(like, Tensor):
        return like.device
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _local_meta(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    causal: bool,
    layout: str,
    valid_lens: Tensor | None,
    key_mask: Tensor | None,
) -> list[int]:
    """This rank's entries of :data:`_META`; raises what is wrong with its own inputs."""
    check_qkv(q, k, v)
    _check_layout(layout)
    (b, h, lq, dk), (_, hkv, lk, dv) = q.shape, v.shape
    if q.dtype not in _DTYPES:
        raise TypeError(f"ring_attention supports dtypes {_DTYPES}, got {q.dtype}")
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
    vl_kind = 0 if valid_lens is None else valid_lens.dim()
    flags = [int(bool(causal)), LAYOUTS.index(layout), int(key_mask is not None), vl_kind]
    return [1, b, h, hkv, dk, dv, lq, lk, _DTYPES.index(q.dtype), *flags]


def _make_plan(
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
) -> _Plan:
    """Validate the call on every rank at once; all ranks raise the same kind of error, none hangs."""
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "ring_attention needs an initialized torch.distributed process group: call "
            "torch.distributed.init_process_group(...) in every process (or start them with "
            "multihead.distributed.launch / torchrun), or use multihead.attention in a single process"
        )
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    error: Exception | None = None
    try:
        meta = _local_meta(q, k, v, causal, layout, valid_lens, key_mask)
        scale = check_scale(scale, q.shape[-1])
    except (TypeError, ValueError) as exc:
        error, meta = exc, [0] * len(_META)
    mine = torch.tensor(meta, dtype=torch.long, device=_comm_device(group, q))
    every = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(every, mine, group=group)
    table = torch.stack(every).tolist()  # (P, len(_META)) -- identical on every rank
    if error is not None:
        raise error
    bad = [s for s in range(world) if not table[s][0]]
    if bad:
        raise RuntimeError(f"ring_attention: rank(s) {bad} rejected their inputs (their own error says why)")
    for i, name in enumerate(_META):
        values = [row[i] for row in table]
        if name not in ("Lq", "Lk") and len(set(values)) > 1:
            raise ValueError(
                f"ring_attention: every rank must pass the same {name}; ranks 0..{world - 1} gave {values}"
            )
    lq_all, lk_all = [row[6] for row in table], [row[7] for row in table]
    if min(lq_all) == 0 or min(lk_all) == 0:
        raise ValueError(
            f"ring_attention: every rank needs at least one query and one key, got local lengths "
            f"Lq {lq_all}, Lk {lk_all}; use fewer ranks or a longer sequence"
        )
    q_pos = _positions_from_lengths(lq_all, layout, "ring_attention (queries)")[rank]
    k_pos = _positions_from_lengths(lk_all, layout, "ring_attention (keys)")
    get_global = functools.partial(dist.get_global_rank, group) if group is not None else (lambda r: r)
    b, _, hkv, dk, dv = table[0][1:6]
    return _Plan(
        group=group,
        rank=rank,
        world=world,
        next_peer=get_global((rank + 1) % world),
        prev_peer=get_global((rank - 1) % world),
        q_pos=q_pos,
        k_pos=k_pos,
        k_shape=(b, hkv, dk, dv),
        causal_offset=(sum(lk_all) - sum(lq_all)) if causal else None,
        scale=float(scale),
        valid_lens=None if valid_lens is None else valid_lens.to(q.device),
        has_key_mask=key_mask is not None,
    )


# ----------------------------------------------------------------------------------------------
# One block: this rank's queries against one key/value shard
# ----------------------------------------------------------------------------------------------


@dataclass
class _Block:
    """The part of the (Lq, Lk_s) score block that the causal mask leaves visible, and its masks."""

    rows: slice  # query rows [i0, Lq) that see at least one key
    cols: slice  # key columns [0, j1) that at least one query sees
    keep: Tensor | None  # bool (B|1, 1, n|1, m), True = may attend; None = all visible
    causal: bool = False  # also the top-left causal mask (n == m): row i sees columns <= i


def _full_keep(blk: _Block) -> Tensor | None:
    """``blk.keep`` with the causal triangle folded in: bool (B|1, 1, n|1, m) or None."""
    if not blk.causal:
        return blk.keep
    n = blk.rows.stop - blk.rows.start
    tril = _masks.causal(n, n, device=None if blk.keep is None else blk.keep.device)[
        None, None
    ]  # (1, 1, n, n)
    return _masks.combine(tril, blk.keep)


def _block(plan: _Plan, src: int, key_mask: Tensor | None, device: torch.device) -> _Block | None:
    """Region and mask of this rank's queries x rank ``src``'s keys; ``None`` if nothing is visible."""
    q_pos, k_pos = plan.q_pos, plan.k_pos[src]
    lq, lk = len(q_pos), len(k_pos)
    rows, cols, causal_keep, causal = slice(0, lq), slice(0, lk), None, False
    if plan.causal_offset is not None:
        # Positions ascend within a shard, so query i sees a prefix of the keys: its first `seen[i]`.
        seen = torch.searchsorted(k_pos.contiguous(), q_pos + plan.causal_offset, right=True)  # (Lq,)
        i0 = int(torch.searchsorted(seen, 1))  # first row that sees a key (seen is non-decreasing)
        if i0 == lq:
            return None
        j1 = int(seen[-1])
        rows, cols = slice(i0, lq), slice(0, j1)
        if int(seen[i0]) < j1:  # some visible row sees fewer keys than the last one: a staircase
            counts = seen[i0:].to(device)  # (n,)
            if i0 == 0 and j1 == lq and torch.equal(counts, torch.arange(1, lq + 1, device=device)):
                causal = True  # the plain triangle: kernels apply it without a mask tensor
            else:
                causal_keep = torch.arange(j1, device=device) < counts[:, None]  # (n, m)
                causal_keep = causal_keep[None, None]  # (1, 1, n, m)
    k_seen = k_pos[cols].to(device)  # (m,)
    valid = None
    if plan.valid_lens is not None:
        vl = plan.valid_lens if plan.valid_lens.dim() == 1 else plan.valid_lens[:, rows]  # (B,) | (B, n)
        valid = k_seen < vl[..., None]  # (B, m) | (B, n, m)
        valid = valid[:, None, None] if vl.dim() == 1 else valid[:, None]  # (B, 1, 1|n, m)
    pad = None if key_mask is None else key_mask[:, None, None, cols]  # (B, 1, 1, m)
    return _Block(rows, cols, _masks.combine(causal_keep, valid, pad), causal)


def _scores(q: Tensor, k: Tensor, blk: _Block, scale: float, h: int) -> Tensor:
    """Masked scores of grouped queries q (B, Hkv, G*n, Dk) against keys k (B, Hkv, m, Dk)."""
    s = torch.matmul(q, k.transpose(-2, -1)) * scale  # (B, Hkv, G*n, m)
    keep = group_mask(_full_keep(blk), h, k.shape[1], blk.rows.stop - blk.rows.start)
    return s if keep is None else s.masked_fill(~keep, float("-inf"))


def _flash_ops() -> tuple[Any, Any] | None:
    """PyTorch's CPU flash-attention forward/backward ops (they return/take the log-sum-exp), if present."""
    fwd = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    bwd = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)
    return None if fwd is None or bwd is None else (fwd, bwd)


def _use_flash(q: Tensor, v: Tensor) -> bool:
    """Blocks run on the fused CPU kernel (never an (n, m) score tensor); elsewhere the plain matmuls.

    The kernel needs equal query and value head dims and a float32/float64 CPU tensor.
    """
    on_cpu = q.device.type == "cpu" and q.dtype in (torch.float32, torch.float64)
    return FLASH_BLOCKS and on_cpu and q.shape[-1] == v.shape[-1] and _flash_ops() is not None


#: Use PyTorch's fused CPU attention kernel for each block when it is available (set False to compare).
FLASH_BLOCKS = True


def _block_bias(blk: _Block, dtype: torch.dtype) -> tuple[Tensor | None, Tensor | None]:
    """For the fused kernel: ``blk.keep`` as an additive bias (0 / -inf) (B|1, 1, n, m), and which rows
    see at least one key once the causal triangle is applied too (B|1, 1, n, 1); (None, None) when no
    mask tensor is needed (all visible, or only the triangle, which the kernel applies itself)."""
    if blk.keep is None:
        return None, None
    n = blk.rows.stop - blk.rows.start
    keep = blk.keep.expand(*blk.keep.shape[:2], n, blk.keep.shape[3])  # (B|1, 1, n, m)
    bias = torch.zeros(keep.shape, dtype=dtype, device=keep.device).masked_fill_(~keep, float("-inf"))
    if blk.causal:  # row i sees a key iff one of keys 0..i is kept
        sees = keep.cumsum(dim=-1).diagonal(dim1=-2, dim2=-1)[..., None] > 0  # (B|1, 1, n, 1)
    else:
        sees = keep.any(dim=-1, keepdim=True)  # (B|1, 1, n, 1)
    return bias, sees


def _repeat_kv(t: Tensor, h: int) -> Tensor:
    """(B, Hkv, m, D) -> (B, H, m, D), each kv head repeated for its G query heads (the fused kernel
    needs equal head counts; this costs m*D per head, not the (n, m) mask grouped queries would)."""
    return t if t.shape[1] == h else t.repeat_interleave(h // t.shape[1], dim=1)  # (B, H, m, D)


def _block_forward(
    q: Tensor, k: Tensor, v: Tensor, blk: _Block, scale: float
) -> tuple[Tensor, Tensor, Tensor]:
    """Unnormalised attention of q (B, H, Lq, Dk) rows ``blk.rows`` over one shard k (B, Hkv, m, Dk), v.

    Returns ``acc = exp(s - mx) @ v`` (B, H, n, Dv), the row max ``mx`` of the scores (B, H, n, 1)
    (``-inf`` where a row sees no key of this shard) and the row sum ``den = sum exp(s - mx)`` (B, H, n, 1).
    On the fused kernel, ``acc`` is the normalised block output, ``mx`` its log-sum-exp and ``den`` 1
    (0 for a row that sees no key): the same state, scaled differently.
    """
    h, hkv = q.shape[1], k.shape[1]
    kb, vb = k[:, :, blk.cols], v[:, :, blk.cols]  # (B, Hkv, m, Dk), (B, Hkv, m, Dv)
    if _use_flash(q, v):
        bias, sees = _block_bias(blk, q.dtype)  # (B|1, 1, n, m), (B|1, 1, n, 1)
        out, lse = _flash_ops()[0](
            q[:, :, blk.rows],
            _repeat_kv(kb, h),
            _repeat_kv(vb, h),
            0.0,
            blk.causal,
            attn_mask=bias,
            scale=scale,
        )  # (B, H, n, Dv), (B, H, n)
        lse = lse.unsqueeze(-1)  # (B, H, n, 1)
        den = torch.ones_like(lse)
        if sees is not None:  # rows with no visible key: output 0, no mass
            out, lse, den = out * sees, lse.masked_fill(~sees, float("-inf")), den * sees
        return out, lse, den
    qg = group_queries(q[:, :, blk.rows], hkv)  # (B, Hkv, G*n, Dk)
    s = _scores(qg, kb, blk, scale, h)  # (B, Hkv, G*n, m)
    mx = s.amax(dim=-1, keepdim=True)  # (B, Hkv, G*n, 1)
    p = torch.exp(s - mx.masked_fill(torch.isneginf(mx), 0.0))  # (B, Hkv, G*n, m); dead rows -> 0
    acc = torch.matmul(p, vb)  # (B, Hkv, G*n, Dv)
    return ungroup(acc, h), ungroup(mx, h), ungroup(p.sum(dim=-1, keepdim=True), h)


def _merge(acc: Tensor, mx: Tensor, den: Tensor, acc_b: Tensor, mx_b: Tensor, den_b: Tensor) -> None:
    """In place: the running softmax state (acc, mx, l) absorbs a block over other keys (exact)."""
    new = torch.maximum(mx, mx_b)  # (B, H, n, 1); -inf only where neither saw a key
    safe = new.masked_fill(torch.isneginf(new), 0.0)
    a, c = torch.exp(mx - safe), torch.exp(mx_b - safe)  # rescale both to the new max
    acc.mul_(a).add_(acc_b * c)
    den.mul_(a).add_(den_b * c)
    mx.copy_(new)


def _softmax_state(mx: Tensor, den: Tensor) -> tuple[Tensor, Tensor]:
    """(mx, l) made safe for ``exp(s - mx) / l``: rows that saw no key get mx = 0, l = 1 (so p = 0)."""
    dead = den == 0
    return mx.masked_fill(dead, 0.0), den.masked_fill(dead, 1.0)


def _block_backward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    dout: Tensor,
    out: Tensor,
    mx: Tensor,
    den: Tensor,
    delta: Tensor,
    blk: _Block,
    scale: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of one block: dq (B, H, n, Dk), dk (B, Hkv, m, Dk), dv (B, Hkv, m, Dv).

    ``out`` (B, H, Lq, Dv) is the final output; ``mx``, ``den`` (B, H, Lq, 1) are the softmax max and sum
    over *all* keys (from the forward pass, made safe by :func:`_softmax_state`) and ``delta``
    (B, H, Lq, 1) = rowsum(dout * out), so ``p = exp(s - mx) / den`` are the final attention weights and
    ``ds = p * (dout @ v^T - delta)``. The fused kernel takes the same as ``out`` and the log-sum-exp
    ``mx + log(den)``.
    """
    h, hkv = q.shape[1], k.shape[1]
    if _use_flash(q, v):
        rows = blk.rows
        lse = (mx + torch.log(den))[:, :, rows].squeeze(-1)  # (B, H, n)
        bias, _ = _block_bias(blk, torch.float64)  # (B|1, 1, n, m)
        kb, vb = _repeat_kv(k[:, :, blk.cols], h), _repeat_kv(v[:, :, blk.cols], h)  # (B, H, m, D*)
        # float64 inside the kernel: its float32 dK/dV sums lose ~2 bits more than the plain matmuls
        # (measured 3.5x the float32 reference's own error under MQA); it still forms no (n, m) tensor.
        f64 = [
            t.to(torch.float64).contiguous()
            for t in (dout[:, :, rows], q[:, :, rows], kb, vb, out[:, :, rows], lse)
        ]
        dq, dk, dv = _flash_ops()[1](*f64, 0.0, blk.causal, attn_mask=bias, scale=scale)
        m = dk.shape[2]
        dk = dk.view(dk.shape[0], hkv, h // hkv, m, -1).sum(dim=2)  # (B, Hkv, m, Dk): sum over the group
        dv = dv.view(dv.shape[0], hkv, h // hkv, m, -1).sum(dim=2)  # (B, Hkv, m, Dv)
        return dq.to(q.dtype), dk.to(q.dtype), dv.to(q.dtype)
    qg = group_queries(q[:, :, blk.rows], hkv)  # (B, Hkv, G*n, Dk)
    dog = group_queries(dout[:, :, blk.rows], hkv)  # (B, Hkv, G*n, Dv)
    mx_g, den_g, delta_g = (
        group_queries(t[:, :, blk.rows], hkv) for t in (mx, den, delta)
    )  # (B, Hkv, G*n, 1)
    kb, vb = k[:, :, blk.cols], v[:, :, blk.cols]  # (B, Hkv, m, Dk), (B, Hkv, m, Dv)
    p = torch.exp(_scores(qg, kb, blk, scale, h) - mx_g) / den_g  # (B, Hkv, G*n, m)
    dv = torch.matmul(p.transpose(-2, -1), dog)  # (B, Hkv, m, Dv)
    ds = p * (torch.matmul(dog, vb.transpose(-2, -1)) - delta_g)  # (B, Hkv, G*n, m)
    dq = ungroup(torch.matmul(ds, kb), h) * scale  # (B, H, n, Dk)
    dk = torch.matmul(ds.transpose(-2, -1), qg) * scale  # (B, Hkv, m, Dk)
    return dq, dk, dv


# ----------------------------------------------------------------------------------------------
# The ring
# ----------------------------------------------------------------------------------------------


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _exchange(plan: _Plan, send: Tensor, recv: Tensor, tag: int) -> list[Any]:
    """Start sending ``send`` to rank r + 1 and receiving ``recv`` from rank r - 1; returns the works."""
    ops = [
        dist.P2POp(dist.isend, send, plan.next_peer, plan.group, tag),
        dist.P2POp(dist.irecv, recv, plan.prev_peer, plan.group, tag),
    ]
    return dist.batch_isend_irecv(ops)


def _pack(tensors: Sequence[Tensor | None], dtype: torch.dtype) -> Tensor:
    """One flat buffer of the given tensors (None skipped), so one message carries a whole shard."""
    return torch.cat([t.reshape(-1).to(dtype) for t in tensors if t is not None])  # (numel,)


def _unpack_kv(
    plan: _Plan, buf: Tensor, src: int, *, with_mask: bool
) -> tuple[Tensor, Tensor, Tensor | None]:
    """Views of rank ``src``'s k (B, Hkv, m, Dk), v (B, Hkv, m, Dv) and key mask (B, m) in ``buf``."""
    b, hkv, dk, dv = plan.k_shape
    m = len(plan.k_pos[src])
    nk, nv = b * hkv * m * dk, b * hkv * m * dv
    k = buf[:nk].view(b, hkv, m, dk)  # (B, Hkv, m, Dk)
    v = buf[nk : nk + nv].view(b, hkv, m, dv)  # (B, Hkv, m, Dv)
    mask = buf[nk + nv :].view(b, m) > 0.5 if with_mask and plan.has_key_mask else None  # (B, m)
    return k, v, mask


def _ring_forward(
    q: Tensor, k: Tensor, v: Tensor, key_mask: Tensor | None, plan: _Plan
) -> tuple[Tensor, Tensor, Tensor]:
    """Output (B, H, Lq, Dv) and the softmax max and sum (B, H, Lq, 1), in the accumulation dtype."""
    acc_dtype = _acc_dtype(q.dtype)
    b, h, lq, _ = q.shape
    qa = q.to(acc_dtype)
    acc = q.new_zeros((b, h, lq, v.shape[-1]), dtype=acc_dtype)  # (B, H, Lq, Dv)
    mx = q.new_full((b, h, lq, 1), float("-inf"), dtype=acc_dtype)  # (B, H, Lq, 1)
    den = q.new_zeros((b, h, lq, 1), dtype=acc_dtype)  # (B, H, Lq, 1)
    cur = _pack([k, v, key_mask], k.dtype)
    for step in range(plan.world):
        src = plan.src(step)
        works, nxt = [], None
        if step < plan.world - 1:  # fetch the next shard while this one is computed
            nxt = cur.new_empty(plan.numel(plan.src(step + 1), with_mask=True))
            works = _exchange(plan, cur, nxt, _TAG_KV)
        kb, vb, mb = _unpack_kv(plan, cur, src, with_mask=True)
        blk = _block(plan, src, mb, q.device)
        if blk is not None:
            part = _block_forward(qa, kb.to(acc_dtype), vb.to(acc_dtype), blk, plan.scale)
            _merge(acc[:, :, blk.rows], mx[:, :, blk.rows], den[:, :, blk.rows], *part)
        for w in works:
            w.wait()
        if nxt is not None:
            cur = nxt
    mx, den = _softmax_state(mx, den)
    return acc / den, mx, den  # rows that saw no key: 0 / 1 = 0


def _ring_backward(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    key_mask: Tensor | None,
    out: Tensor,
    mx: Tensor,
    den: Tensor,
    plan: _Plan,
) -> tuple[Tensor, Tensor, Tensor]:
    """dq (B, H, Lq, Dk) for this rank's queries and dk, dv for this rank's keys, summed over all ranks."""
    acc = _acc_dtype(q.dtype)
    b, hkv, dk_dim, dv_dim = plan.k_shape
    qa, da = q.to(acc), dout.to(acc)
    delta = (da * out).sum(dim=-1, keepdim=True)  # (B, H, Lq, 1)
    dq = torch.zeros_like(qa)  # (B, H, Lq, Dk)
    cur = _pack([k, v, key_mask], k.dtype)
    grads_in: Tensor | None = None  # dK/dV accumulator arriving from rank r - 1
    pending: list[Any] = []  # works of the dK/dV exchange in flight
    for step in range(plan.world):
        src = plan.src(step)
        kv_works, nxt = [], None
        if step < plan.world - 1:
            nxt = cur.new_empty(plan.numel(plan.src(step + 1), with_mask=True))
            kv_works = _exchange(plan, cur, nxt, _TAG_KV)
        kb, vb, mb = _unpack_kv(plan, cur, src, with_mask=True)
        grads = q.new_zeros(plan.numel(src, with_mask=False), dtype=acc)  # flat dK | dV of shard src
        dkb, dvb, _ = _unpack_kv(plan, grads, src, with_mask=False)
        blk = _block(plan, src, mb, q.device)
        if blk is not None:
            dq_b, dk_b, dv_b = _block_backward(
                qa, kb.to(acc), vb.to(acc), da, out, mx, den, delta, blk, plan.scale
            )
            dq[:, :, blk.rows] += dq_b
            dkb[:, :, blk.cols] += dk_b
            dvb[:, :, blk.cols] += dv_b
        for w in pending:
            w.wait()
        if grads_in is not None:
            grads += grads_in  # the contributions of the ranks this shard visited before
        if plan.world > 1:  # pass the accumulator on; after P hops it is back home, complete
            grads_in = grads.new_empty(plan.numel(plan.src(step + 1), with_mask=False))
            pending = _exchange(plan, grads, grads_in, _TAG_DKV)
        else:
            grads_in = grads
        for w in kv_works:
            w.wait()
        if nxt is not None:
            cur = nxt
    for w in pending:
        w.wait()
    assert grads_in is not None
    dk, dv, _ = _unpack_kv(plan, grads_in, plan.rank, with_mask=False)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, key_mask: Tensor | None, plan: _Plan) -> Tensor:
        out, mx, den = _ring_forward(q, k, v, key_mask, plan)
        ctx.save_for_backward(q, k, v, out, mx, den)
        ctx.key_mask, ctx.plan = key_mask, plan
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx: Any, dout: Tensor) -> tuple[Tensor | None, ...]:
        q, k, v, out, mx, den = ctx.saved_tensors
        dq, dk, dv = _ring_backward(dout, q, k, v, ctx.key_mask, out, mx, den, ctx.plan)
        return dq, dk, dv, None, None


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
    scale: float | None = None,
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
        layout: how the sequence is sharded (:data:`LAYOUTS`), as cut by :func:`shard`; ``"zigzag"``
            balances causal work. ``"contiguous"`` takes any local lengths (uneven included); the others
            need the lengths :func:`shard` gives.
        valid_lens: int (B,) or (B, Lq): keys at *global* index >= valid_len are masked (d2l meaning).
        key_mask: bool (B, Lk), True = real key, for this rank's keys (a shard of a (B, L) padding mask,
            the argument of :func:`multihead.masks.key_padding`); it travels with the keys.
        scale: score scale, default 1/sqrt(Dk).

    Returns:
        (B, H, Lq, Dv): this rank's rows of ``multihead.attention(Q, K, V, causal=..., valid_lens=...)``
        on the full sequences. A query with no visible key gets 0 (and finite gradients). Differentiable
        in q, k, v; backward, like forward, must run on every rank.

    Each rank keeps (B, H, Lq, Dv) partial outputs and one K/V shard in flight; each block runs on the
    fused CPU flash kernel where it can (otherwise plain matmuls with a (B, Hkv, G*Lq, Lk_s) score
    block), so memory per rank falls with the number of ranks. Every call makes one small all-gather of
    the shapes first, so a bad input raises on every rank instead of hanging the others.
    """
    plan = _make_plan(
        q,
        k,
        v,
        causal=causal,
        group=group,
        layout=layout,
        valid_lens=valid_lens,
        key_mask=key_mask,
        scale=scale,
    )
    return _RingAttention.apply(q, k, v, key_mask, plan)


def causal_work(total: int, world: int, layout: str = "contiguous") -> list[int]:
    """Score entries each rank computes (per batch row and head) for causal self-attention.

    ``total`` tokens cut by :func:`shard` over ``world`` ranks; blocks the causal mask hides entirely
    are skipped, as :func:`ring_attention` does. For 8 tokens over 2 ranks, contiguous gives
    ``[16, 32]`` (rank 1 does twice the work) and zigzag ``[24, 24]``.
    """
    pos = _layout_positions(total, world, _check_layout(layout))
    work = []
    for r in range(world):
        plan = _Plan(None, r, world, r, r, pos[r], pos, (1, 1, 1, 1), 0, 1.0, None, False)
        blocks = (_block(plan, plan.src(step), None, torch.device("cpu")) for step in range(world))
        work.append(sum((b.rows.stop - b.rows.start) * (b.cols.stop - b.cols.start) for b in blocks if b))
    return work


# ----------------------------------------------------------------------------------------------
# Modules
# ----------------------------------------------------------------------------------------------


def sharded_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    group: Any,
    layout: str = "contiguous",
    mask: Tensor | None = None,
    bias: Tensor | None = None,
    valid_lens: Tensor | None = None,
    causal: bool = False,
    scale: float | None = None,
    dropout: float = 0.0,
    return_weights: bool = False,
    backend: str = "auto",
) -> Tensor:
    """:func:`multihead.attention`'s signature over sharded sequences, for modules; runs :func:`ring_attention`.

    ``mask`` may only be a key-padding mask, bool (B|1, 1, 1, Lk) for this rank's keys (what
    :func:`multihead.masks.key_padding` builds); ``bias``, other masks, ``dropout > 0`` and
    ``return_weights`` need the whole (Lq, Lk) score matrix on one rank and are rejected. ``backend``
    is ignored: each block step is the ring's own.
    """
    del backend
    problems = []
    if bias is not None:
        problems.append("bias= (a float bias over all keys) is not supported")
    if dropout:
        problems.append(f"dropout={dropout} is not supported: set the module's dropout to 0 or call .eval()")
    if return_weights:
        problems.append("return_weights=True is not supported: the full weights never exist on one rank")
    key_mask = None
    if mask is not None:
        b, lk = q.shape[0], k.shape[2]
        if not (
            isinstance(mask, Tensor) and mask.dim() == 4 and mask.shape[1:3] == (1, 1) and mask.shape[3] == lk
        ):
            got = tuple(mask.shape) if isinstance(mask, Tensor) else type(mask).__name__
            problems.append(
                f"mask= must be a key-padding mask of shape (B, 1, 1, Lk) = {(b, 1, 1, lk)} for this rank's "
                f"keys (multihead.masks.key_padding(keep_local)), got {got}; use causal= or valid_lens= "
                f"for the rest"
            )
        else:
            key_mask = _masks.check_mask(mask, (b, 1, 1, lk)).expand(b, 1, 1, lk)[:, 0, 0]  # (B, Lk)
    if problems:
        raise ValueError("attention over a process group: " + "; ".join(problems))
    return ring_attention(
        q,
        k,
        v,
        causal=causal,
        group=group,
        layout=layout,
        valid_lens=valid_lens,
        key_mask=key_mask,
        scale=scale,
    )


@dataclass(frozen=True)
class ShardedAttention:
    """An ``attention_fn`` for modules whose inputs are this rank's shards: ring attention over ``group``.

    Same signature as :func:`multihead.attention` (see :func:`sharded_attention` for what it refuses);
    ``local`` is the module's attention function before it was installed, restored by
    ``use_process_group(model, None)``.
    """

    group: Any
    layout: str
    local: Callable[..., Any]
    sharded: bool = True  # read by multihead.nn.seam: positions (rotary, KV cache) are per rank

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, **kwargs: Any) -> Tensor:
        return sharded_attention(q, k, v, group=self.group, layout=self.layout, **kwargs)


def use_process_group(model: nn.Module, group: Any, *, layout: str = "contiguous") -> list[str]:
    """Make every :class:`~multihead.MultiHeadAttention` inside ``model`` run ring attention over ``group``.

    It installs a :class:`ShardedAttention` as each module's ``attention_fn`` (the torch drop-in
    :class:`multihead.compat.torch.MultiheadAttention` included). Afterwards each rank feeds the model its
    shard of every sequence, (B, L_r, E), cut with :func:`shard` in the same ``layout``; token-wise layers
    (projections, feed-forward, norms) need nothing else. ``group=None`` restores each module's own
    attention function; pass ``torch.distributed.group.WORLD`` for all ranks. Modules with rotary
    embeddings are refused here (their positions would be per rank). Returns the names of the modules set.
    """
    _check_layout(layout)
    found = {name: m for name, m in model.named_modules() if isinstance(m, MultiHeadAttention)}
    if not found:
        raise ValueError(f"{type(model).__name__} contains no multihead.MultiHeadAttention to set a group on")
    for m in found.values():
        if group is not None:
            check_positions(
                m, ShardedAttention(group, layout, m.attention_fn), rotary=m.rotary is not None, cache=False
            )
    for m in found.values():
        local = m.attention_fn.local if isinstance(m.attention_fn, ShardedAttention) else m.attention_fn
        m.attention_fn = local if group is None else ShardedAttention(group, layout, local)
    return list(found)


# ----------------------------------------------------------------------------------------------
# Several processes on one machine
# ----------------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _launched(
    rank: int,
    world: int,
    port: int,
    backend: str,
    timeout: float,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    results: Any,
) -> None:
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        dist.init_process_group(
            backend,
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=timeout),
        )
        results.put((rank, True, fn(*args)))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))  # the parent raises it and kills every rank
        return
    if dist.is_initialized():
        dist.destroy_process_group()


def launch(
    fn: Callable[..., Any],
    world_size: int,
    args: tuple[Any, ...] = (),
    *,
    backend: str = "gloo",
    timeout: float = 300.0,
) -> list[Any]:
    """Run ``fn(*args)`` in ``world_size`` fresh local processes that share one process group.

    Each process initialises ``torch.distributed`` (``backend``: ``"gloo"`` for CPU, ``"nccl"`` with one
    GPU per rank) on 127.0.0.1 and a free port, calls ``fn`` (a module-level function, so it can be
    pickled) and returns its (picklable) result; the list of results is in rank order. If a rank
    raises, dies, or the whole run takes longer than ``timeout`` seconds, every process is killed and a
    ``RuntimeError``/``TimeoutError`` (with the rank's traceback) is raised: no process is left running.
    For several machines use ``torchrun`` instead (see docs/distributed.md).
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    ctx = torch.multiprocessing.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(
            target=_launched, args=(r, world_size, port, backend, timeout, fn, args, results), daemon=True
        )
        for r in range(world_size)
    ]
    done: dict[int, Any] = {}
    finished = False
    try:
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        while len(done) < world_size:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(
                    f"launch: ranks {sorted(set(range(world_size)) - set(done))} of {world_size} did not finish "
                    f"within {timeout} s; every process was killed"
                )
            try:
                rank, ok, payload = results.get(timeout=min(left, 0.5))
            except _queue.Empty:
                lost = [r for r, p in enumerate(procs) if r not in done and p.exitcode not in (None, 0)]
                if lost:
                    codes = [procs[r].exitcode for r in lost]
                    raise RuntimeError(f"launch: rank(s) {lost} died with exit codes {codes}") from None
                continue
            if not ok:
                raise RuntimeError(f"launch: rank {rank} of {world_size} failed:\n{payload}")
            done[rank] = payload
        finished = True
    finally:
        for p in procs:
            if finished and p.pid is not None:
                p.join(timeout=10)  # normal exit after destroy_process_group
            if p.is_alive():
                p.kill()
            if p.pid is not None:
                p.join()
        results.close()
    return [done[r] for r in range(world_size)]
