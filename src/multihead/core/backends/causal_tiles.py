"""Causal attention on the CPU as square tiles: the fused kernel's own causal mode wastes a third of its work.

Dimensions: B batch, H heads, L = Lq = Lk, Dk/Dv head dims, c tile length (L = n * c, n a power of 2),
m tiles of one level, s their length.

PyTorch's fused CPU kernel skips key blocks above the diagonal, but in blocks of 512 keys against 256
queries (L >= 768): a query block computes every key of each 512-key block it touches, so at L = 2,048 it
computes 20 of the 32 (256, 512) tiles, 0.625x of the unmasked work where causal needs 0.5x (measured:
0.64x the unmasked call on a Zen 4 and a Zen 5 EPYC). Here the (L, L) triangle is cut into

* the n diagonal (c, c) tiles, one kernel call in the kernel's causal mode (the n tiles as a batch of B*n);
* a binary tree of rectangles below them: at each level, the odd query blocks of length s against the
  even key blocks just before them (unmasked, one call with the m = L / (2s) pairs as a batch of B*m),
  for s = L/2, L/4, ..., c;

and the pieces are joined by the log-sum-exp the kernel returns (``lerp`` with the weight
``sigmoid(lse_acc - lse_new)``, in place, one pass over the rows a level touches). Its work is
L^2 / 2 + L * c / 2 pairs (the diagonal tiles computed whole): 0.53x the unmasked call at L = 2,048, c = 128.
Every batch is a view of q, k, v (B and the tile index merge because the tiles are consecutive rows of one
sequence) and the output comes out in the kernel's own (B, L, H, Dv) memory layout, so the module's head
merge stays a view.

Inference only (the kernel's log-sum-exp carries no gradient), H == Hkv, float32/float64/bfloat16/float16.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["ENABLED", "MIN_LENGTH", "TILE", "serves", "tiled_causal"]

ENABLED = False
"""Off until timed: written and checked against the reference in a session whose bench runs never got the
shared machine's benchmark lock, so its speed on a CPU is unmeasured. The arithmetic says 0.53x of the
unmasked pairs at L = 2,048, but its smallest calls run the kernel's 32- and 64-query blocks, less efficient
than the (256, 512) ones (a staircase of such calls measured slower than the causal kernel, see
docs/performance.md). Set it True (``multihead.core.backends.causal_tiles.ENABLED = True``) and run
``multihead bench --only "causal attention"`` to decide."""

TILE = 128
"""The smallest diagonal tile: L is halved while it stays even and at least twice this (c in [128, 256))."""
MIN_LENGTH = 1024
"""The shortest sequence tiled: below it the extra kernel calls and joins cost more than they save."""

_KERNEL = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def _levels(length: int) -> int:
    """How many times L is halved into tiles (0: not tiled)."""
    t = 0
    while length % 2 == 0 and length // 2 >= TILE:
        length //= 2
        t += 1
    return t


def serves(q: Tensor, k: Tensor, v: Tensor) -> bool:
    """Whether :func:`tiled_causal` serves a causal call on q (B, H, L, Dk), k (B, H, L, Dk), v (B, H, L, Dv)."""
    length = q.shape[2]
    return (
        ENABLED
        and q.device.type == "cpu"
        and q.dtype in _DTYPES
        and length >= MIN_LENGTH
        and k.shape[2] == length
        and k.shape[1] == q.shape[1]
        and q.stride(-1) == k.stride(-1) == v.stride(-1) == 1
        and _levels(length) > 0
        and not (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad))
    )


def _tiles(t: Tensor, parts: int, which: slice) -> Tensor:
    """(B, X, L, D) -> (B*m, X, s, D): the blocks ``which`` of ``parts`` equal blocks along L, a view."""
    b, x, length, d = t.shape
    s = length // parts
    blocks = t.view(b, x, parts, s, d)[:, :, which].transpose(1, 2)  # (B, m, X, s, D)
    return blocks.reshape(-1, x, s, d)  # (B*m, X, s, D): a view (B's stride is m times the block's)


def tiled_causal(q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
    """Causal attention (Lq == Lk) of q (B, H, L, Dk), k (B, H, L, Dk), v (B, H, L, Dv) -> (B, H, L, Dv);
    see the module docstring. The caller checks :func:`serves`."""
    b, h, length, _ = q.shape
    dv = v.shape[3]
    parts = 1 << _levels(length)
    every = slice(None)
    out, lse = _KERNEL(
        _tiles(q, parts, every), _tiles(k, parts, every), _tiles(v, parts, every), 0.0, True, scale=scale
    )  # (B*n, H, c, Dv) in (B*n, c, H, Dv) memory, (B*n, H, c)
    rows = out.transpose(1, 2).reshape(b, length, h, dv)  # (B, L, H, Dv): a view of the kernel's memory
    total = lse.view(b, parts, h, -1).transpose(2, 3).reshape(b, length, h)  # (B, L, H) float
    odd, even = slice(1, None, 2), slice(0, None, 2)
    while parts > 1:
        s = length // parts
        o, part = _KERNEL(
            _tiles(q, parts, odd), _tiles(k, parts, even), _tiles(v, parts, even), 0.0, False, scale=scale
        )  # (B*m, H, s, Dv), (B*m, H, s)
        o = o.transpose(1, 2).view(b, parts // 2, s, h, dv)  # (B, m, s, H, Dv)
        part = part.view(b, parts // 2, h, s).transpose(2, 3)  # (B, m, s, H)
        acc = rows.view(b, parts, s, h, dv)[:, odd]  # (B, m, s, H, Dv): the odd blocks' rows, a view
        seen = total.view(b, parts, s, h)[:, odd]  # (B, m, s, H)
        weight = torch.sigmoid(seen - part).unsqueeze(-1).to(o.dtype)  # (B, m, s, H, 1): acc's share
        torch.lerp(o, acc, weight, out=acc)  # in place: w * acc + (1 - w) * o
        seen.copy_(torch.logaddexp(seen, part))
        parts //= 2
    return rows.transpose(1, 2)  # (B, H, L, Dv)
