"""One ring step: this rank's queries against one key/value shard, forward and backward.

Dimensions: B batch, H query heads, Hkv key/value heads (H % Hkv == 0), G = H // Hkv, Lq this rank's
query length, n/m the query rows/key columns a block works on, Dk query/key head dim, Dv value head dim.

A block's result is a :class:`SoftmaxState`: its *normalised* output over the keys it saw and the
log-sum-exp of those scores. Two states over disjoint key sets merge exactly (:func:`merge_into`), so
the ring folds one block per shard into the answer over the whole sequence. The backward of a block
takes the *final* state (output and log-sum-exp over all keys): with it, ``p = exp(s - lse)`` are the
final attention weights and each block's dq, dk, dv are its exact share of the gradients.

Two kernels compute a block (:data:`KERNELS`):

* ``"flash"``: PyTorch's fused CPU flash-attention ops, forward and backward
  (``aten._scaled_dot_product_flash_attention_for_cpu[_backward]``), driven with the global
  log-sum-exp and output the way flash-attention's ring implementations drive theirs. No (n, m) score
  tensor exists, grouped-query K/V are used as they are (the kernel maps query head h to kv head
  h // G), and the diagonal block uses the kernel's own causal mask. CPU, float32/float64, Dk == Dv.
* ``"math"``: plain matmuls on grouped queries (B, Hkv, G*n, D) against (B, Hkv, m, D): any device
  and dtype, forms one (B, Hkv, G*n, m) score block.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

from ..core import masks as _masks
from ..core.backends._common import group_mask, group_queries, kv_for_cpu_kernel, ungroup
from .sharding import Region

__all__ = [
    "KERNELS",
    "Block",
    "BlockInputs",
    "FlashOps",
    "Grads",
    "SoftmaxState",
    "add_sinks",
    "block_backward",
    "block_forward",
    "choose_kernel",
    "flash_ops",
    "make_block",
    "merge_into",
    "prepare",
    "shares_ids",
    "sinks_grad",
]

KERNELS = ("auto", "flash", "math")


class FlashOps(NamedTuple):
    """PyTorch's fused CPU flash-attention ops (they return / take the log-sum-exp)."""

    forward: Callable[..., tuple[Tensor, Tensor]]
    backward: Callable[..., tuple[Tensor, Tensor, Tensor]]


def _fold_groups(d: Tensor, hkv: int) -> Tensor:
    """A gradient over repeated K/V heads (B, H, m, D) summed back to the Hkv heads: (B, Hkv, m, D)."""
    b, h, m, dim = d.shape
    return (
        d if h == hkv else d.view(b, hkv, h // hkv, m, dim).sum(dim=2)
    )  # (B, Hkv, G, m, D) -> (B, Hkv, m, D)


def flash_ops() -> FlashOps | None:
    """The fused CPU forward/backward ops of this torch, or None where it has none."""
    fwd = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    bwd = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)
    return None if fwd is None or bwd is None else FlashOps(fwd, bwd)


def _flash_reasons(device: torch.device, dtype: torch.dtype, dk: int, dv: int) -> list[str]:
    reasons = []
    if device.type != "cpu":
        reasons.append(f"it runs on CPU tensors, got device {device}")
    if dtype not in (torch.float32, torch.float64):
        reasons.append(f"it computes in float32/float64, got {dtype}")
    if dk != dv:
        reasons.append(f"it needs Dk == Dv, got Dk={dk}, Dv={dv}")
    if flash_ops() is None:
        reasons.append(f"torch {torch.__version__} has no _scaled_dot_product_flash_attention_for_cpu ops")
    return reasons


def choose_kernel(requested: str, device: torch.device, dtype: torch.dtype, dk: int, dv: int) -> str:
    """The block kernel for a call: ``"flash"`` or ``"math"``.

    ``requested`` is one of :data:`KERNELS`; ``"auto"`` takes ``"flash"`` where it can run (``dtype`` is
    the dtype the blocks compute in), and an explicit ``"flash"`` that cannot run raises saying why.
    """
    if requested not in KERNELS:
        raise ValueError(f"block_kernel must be one of {KERNELS}, got {requested!r}")
    if requested == "math":
        return "math"
    reasons = _flash_reasons(device, dtype, dk, dv)
    if requested == "flash" and reasons:
        raise ValueError("block_kernel='flash' cannot run: " + "; ".join(reasons) + "; use 'auto' or 'math'")
    return "math" if reasons else "flash"


@dataclass(frozen=True)
class Block:
    """The visible part of one (Lq, m_s) block and the masks on it.

    ``rows`` [i0, Lq) and ``cols`` [0, j1) cut what no query sees; ``keep`` bool (B|1, 1, n|1, m), True =
    may attend, None = all visible; ``triangle`` adds the top-left causal mask (n == m: row i sees
    columns <= i), which kernels apply without a mask tensor.
    """

    rows: slice
    cols: slice
    keep: Tensor | None
    triangle: bool = False

    @property
    def n(self) -> int:
        return self.rows.stop - self.rows.start


class BlockInputs(NamedTuple):
    """What one block attends with: all of this rank's queries and one shard's keys and values."""

    q: Tensor  # (B, H, Lq, Dk); the block takes its rows
    k: Tensor  # (B, Hkv, m_s, Dk); the block takes its columns
    v: Tensor  # (B, Hkv, m_s, Dv)


class SoftmaxState(NamedTuple):
    """Normalised output and log-sum-exp of the scores over the keys seen so far."""

    out: Tensor  # (B, H, n, Dv); 0 for a row that saw no key
    lse: Tensor  # (B, H, n); -inf for a row that saw no key


class Grads(NamedTuple):
    """One block's share of the gradients."""

    dq: Tensor  # (B, H, n, Dk) for the block's rows
    dk: Tensor  # (B, Hkv, m, Dk) for the block's columns
    dv: Tensor  # (B, Hkv, m, Dv)


def make_block(
    region: Region,
    k_pos: Tensor,
    *,
    valid_lens: Tensor | None,
    key_mask: Tensor | None,
    segments: tuple[Tensor, Tensor] | None = None,
    device: torch.device,
) -> Block:
    """The block of a visible ``region`` with its masks.

    ``k_pos`` (m_s,) global positions of the shard's keys; ``valid_lens`` (B,) or (B, Lq) global key
    counts; ``key_mask`` bool (B, m_s), True = real key; ``segments`` (q_ids (B, Lq), kv_ids (B, m_s)):
    a query sees only keys of its own id, none with a negative id.
    """
    rows, cols = region.rows, region.cols
    staircase = None
    if region.seen is not None:
        counts = region.seen.to(device)  # (n,)
        staircase = torch.arange(cols.stop, device=device) < counts[:, None]  # (n, m)
        staircase = staircase[None, None]  # (1, 1, n, m)
    valid = None
    if valid_lens is not None:
        k_seen = k_pos[cols].to(device)  # (m,)
        vl = valid_lens if valid_lens.dim() == 1 else valid_lens[:, rows]  # (B,) | (B, n)
        valid = k_seen < vl[..., None]  # (B, m) | (B, n, m)
        valid = valid[:, None, None] if vl.dim() == 1 else valid[:, None]  # (B, 1, 1|n, m)
    pad = None if key_mask is None else key_mask[:, None, None, cols]  # (B, 1, 1, m)
    same = None
    if segments is not None:
        q_ids, kv_ids = segments[0][:, rows], segments[1][:, cols]  # (B, n), (B, m)
        same = _masks.segment_mask(q_ids, kv_ids)  # (B, 1, n, m)
    return Block(rows, cols, _masks.combine(staircase, valid, pad, same), region.triangle)


def shares_ids(q_ids: Tensor, kv_ids: Tensor) -> bool:
    """Whether some query of ``q_ids`` (B, n) may see some key of ``kv_ids`` (B, m): a shared id >= 0 in
    one batch row. O((n + m) log m), without the (n, m) comparison a block mask makes."""
    width = int(torch.maximum(q_ids.max(), kv_ids.max()).clamp_min(0)) + 1
    row = torch.arange(q_ids.shape[0], device=q_ids.device)[:, None] * width  # (B, 1): rows kept apart
    q = torch.where(q_ids >= 0, q_ids + row, -1)  # (B, n)
    k = torch.where(kv_ids >= 0, kv_ids + row, -2)  # (B, m): padding meets nothing
    return bool(torch.isin(q, k).any())


def _full_keep(blk: Block) -> Tensor | None:
    """``blk.keep`` with the causal triangle folded in: bool (B|1, 1, n|1, m) or None."""
    if not blk.triangle:
        return blk.keep
    device = None if blk.keep is None else blk.keep.device
    tril = _masks.causal(blk.n, blk.n, device=device)[None, None]  # (1, 1, n, n)
    return _masks.combine(tril, blk.keep)


def _flash_bias(blk: Block, dtype: torch.dtype) -> tuple[Tensor | None, Tensor | None]:
    """For the fused kernel: ``blk.keep`` as an additive 0/-inf bias (B|1, 1, n|1, m), and which rows see
    at least one key once the triangle is applied too (B|1, 1, n|1, 1); (None, None) without ``keep``."""
    keep = blk.keep
    if keep is None:
        return None, None
    bias = _masks.to_bias(keep, dtype)  # (B|1, 1, n|1, m)
    if not blk.triangle:
        return bias, keep.any(dim=-1, keepdim=True)  # (B|1, 1, n|1, 1)
    seen = keep.cumsum(dim=-1) > 0  # (B|1, 1, n|1, m): some key <= j is kept
    if keep.shape[2] == 1:
        return bias, seen.transpose(-2, -1)  # (B|1, 1, n, 1): row i sees keys 0..i (n == m)
    return bias, seen.diagonal(dim1=-2, dim2=-1)[..., None]  # (B|1, 1, n, 1)


def _last_dim_contiguous(t: Tensor) -> Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def block_forward(
    x: BlockInputs, blk: Block, scale: float, kernel: str, softcap: float | None = None
) -> SoftmaxState:
    """Attention of ``x.q``'s rows ``blk.rows`` over the shard's columns ``blk.cols``: (B, H, n, Dv), (B, H, n).

    Equals ``out = softmax(s) @ v`` and ``lse = logsumexp(s)`` with ``s = scale * q k^T`` (capped to
    ``softcap * tanh(s / softcap)`` with a ``softcap``; the math kernel only) masked by the block
    (``-inf`` where not kept), except that a row with no kept key gets ``out = 0, lse = -inf``.
    """
    q = x.q[:, :, blk.rows]  # (B, H, n, Dk)
    k, v = x.k[:, :, blk.cols], x.v[:, :, blk.cols]  # (B, Hkv, m, Dk), (B, Hkv, m, Dv)
    if kernel == "flash":
        ops = flash_ops()
        assert ops is not None, "choose_kernel picks 'flash' only where the ops exist"
        bias, sees = _flash_bias(blk, q.dtype)
        kf, vf = kv_for_cpu_kernel(q, k, v)
        out, lse = ops.forward(
            q, kf, vf, 0.0, blk.triangle, attn_mask=bias, scale=scale
        )  # (B,H,n,Dv), (B,H,n)
        if sees is not None:  # rows with no visible key: output 0, no mass
            out.masked_fill_(~sees, 0.0)
            lse.masked_fill_(~sees[..., 0], float("-inf"))
        return SoftmaxState(out, lse)
    h, hkv = q.shape[1], k.shape[1]
    qg = group_queries(q, hkv)  # (B, Hkv, G*n, Dk)
    s, _ = _scores(qg, k, blk, scale, h, softcap)  # (B, Hkv, G*n, m)
    mx = s.amax(dim=-1, keepdim=True)  # (B, Hkv, G*n, 1); -inf where a row sees nothing
    p = torch.exp(s - mx.masked_fill(torch.isneginf(mx), 0.0))  # (B, Hkv, G*n, m); dead rows -> 0
    den = p.sum(dim=-1, keepdim=True)  # (B, Hkv, G*n, 1)
    out = torch.matmul(p, v) / den.masked_fill(den == 0, 1.0)  # (B, Hkv, G*n, Dv)
    lse = (mx + torch.log(den)).masked_fill(den == 0, float("-inf"))  # (B, Hkv, G*n, 1)
    return SoftmaxState(ungroup(out, h), ungroup(lse, h)[..., 0])


def _scores(
    qg: Tensor, k: Tensor, blk: Block, scale: float, h: int, softcap: float | None
) -> tuple[Tensor, Tensor | None]:
    """Masked scores of grouped queries (B, Hkv, G*n, Dk) against keys (B, Hkv, m, Dk): (B, Hkv, G*n, m),
    and, with a ``softcap``, the capped scores before the mask (their tanh gives the cap's derivative)."""
    s = torch.matmul(qg, k.transpose(-2, -1)) * scale  # (B, Hkv, G*n, m)
    capped = None
    if softcap is not None:
        s = capped = softcap * torch.tanh(s / softcap)
    keep = group_mask(_full_keep(blk), h, k.shape[1], blk.n)  # (B|1, Hkv|1, G*n|1, m)
    return (s if keep is None else s.masked_fill(~keep, float("-inf"))), capped


def merge_into(state: SoftmaxState, part: SoftmaxState) -> None:
    """In place: ``state`` (views of the running output and lse) absorbs ``part`` over other keys (exact)."""
    new = torch.logaddexp(state.lse, part.lse)  # (B, H, n); -inf only where neither saw a key
    safe = new.masked_fill(torch.isneginf(new), 0.0)
    a = torch.exp(state.lse - safe)[..., None]  # (B, H, n, 1): rescale both to the merged sum
    c = torch.exp(part.lse - safe)[..., None]
    state.out.mul_(a).add_(part.out.mul_(c))
    state.lse.copy_(new)


def add_sinks(state: SoftmaxState, sinks: Tensor) -> None:
    """In place: ``state`` (out (B, H, Lq, Dv), lse (B, H, Lq) over every key) absorbs one sink logit per
    head, ``sinks`` (H,): a key with that score and a zero value (it takes weight, adds nothing)."""
    sink = sinks.to(state.lse.dtype)[None, :, None]  # (1, H, 1)
    new = torch.logaddexp(state.lse, sink)  # (B, H, Lq): -inf where a row saw no key and the head no sink
    safe = new.masked_fill(torch.isneginf(new), 0.0)  # (-inf) - (-inf) would be NaN there
    state.out.mul_(torch.exp(state.lse - safe)[..., None])  # rows that saw no key stay 0
    state.lse.copy_(new)


def sinks_grad(sinks: Tensor, dout: Tensor, final: SoftmaxState) -> Tensor:
    """d loss / d ``sinks`` (H,) from this rank's rows: ``-sum over rows of p_sink * rowsum(dout * out)``,
    with ``p_sink = exp(sink - lse)`` the sink's final weight (``dout``, ``final.out`` (B, H, Lq, Dv);
    ``final.lse`` 0 where a row saw no key and no sink, so that p_sink = exp(-inf) = 0 there)."""
    delta = (dout * final.out).sum(dim=-1)  # (B, H, Lq)
    p_sink = torch.exp(sinks.to(final.lse.dtype)[None, :, None] - final.lse)  # (B, H, Lq)
    return -(p_sink * delta).sum(dim=(0, 2)).to(sinks.dtype)  # (H,)


def block_backward(
    x: BlockInputs,
    dout: Tensor,
    final: SoftmaxState,
    blk: Block,
    scale: float,
    kernel: str,
    softcap: float | None = None,
) -> Grads:
    """The block's share of dq, dk, dv, given the gradient ``dout`` (B, H, Lq, Dv) of the final output.

    ``final`` holds the output (B, H, Lq, Dv) and log-sum-exp (B, H, Lq) over *all* keys, with 0 (not
    ``-inf``) for rows that saw no key. Then ``p = exp(s - lse)`` are the final weights and
    ``ds = p * (dout @ v^T - rowsum(dout * out))``; dq = scale * ds @ k, dk = scale * ds^T @ q,
    dv = p^T @ dout, summed over the G query heads of each kv head. A ``softcap`` multiplies ``ds`` by
    the cap's derivative, ``1 - tanh^2``.
    """
    rows = blk.rows
    q, do = x.q[:, :, rows], dout[:, :, rows]  # (B, H, n, Dk), (B, H, n, Dv)
    out, lse = final.out[:, :, rows], final.lse[:, :, rows]  # (B, H, n, Dv), (B, H, n)
    k, v = x.k[:, :, blk.cols], x.v[:, :, blk.cols]  # (B, Hkv, m, Dk), (B, Hkv, m, Dv)
    if kernel == "flash":
        ops = flash_ops()
        assert ops is not None, "choose_kernel picks 'flash' only where the ops exist"
        bias, _ = _flash_bias(blk, q.dtype)
        kf, vf = kv_for_cpu_kernel(q, k, v)
        dq, dk, dv = ops.backward(do, q, kf, vf, out, lse, 0.0, blk.triangle, attn_mask=bias, scale=scale)
        return Grads(dq, _fold_groups(dk, k.shape[1]), _fold_groups(dv, k.shape[1]))
    h, hkv = q.shape[1], k.shape[1]
    qg, dog, og = (group_queries(t, hkv) for t in (q, do, out))  # (B, Hkv, G*n, D*)
    lse_g = group_queries(lse[..., None], hkv)  # (B, Hkv, G*n, 1)
    s, capped = _scores(qg, k, blk, scale, h, softcap)  # (B, Hkv, G*n, m)
    p = torch.exp(s - lse_g)  # (B, Hkv, G*n, m)
    dv = torch.matmul(p.transpose(-2, -1), dog)  # (B, Hkv, m, Dv)
    delta = (dog * og).sum(dim=-1, keepdim=True)  # (B, Hkv, G*n, 1)
    ds = p * (torch.matmul(dog, v.transpose(-2, -1)) - delta)  # (B, Hkv, G*n, m)
    if capped is not None and softcap is not None:  # through the cap: d tanh = 1 - tanh^2
        ds = ds * (1 - (capped / softcap) ** 2)
    dq = ungroup(torch.matmul(ds, k), h) * scale  # (B, H, n, Dk)
    dk = torch.matmul(ds.transpose(-2, -1), qg) * scale  # (B, Hkv, m, Dk)
    return Grads(dq, dk, dv)


def prepare(t: Tensor, dtype: torch.dtype) -> Tensor:
    """``t`` in the blocks' compute ``dtype`` with a unit-stride last dim (the fused kernel's need)."""
    return _last_dim_contiguous(t.to(dtype))
