"""Rotary position embeddings (RoPE, Su et al. 2021) for queries and keys.

Dimensions: B batch, H heads, L positions, D head dim (even), D/2 rotation frequencies.

Position ``p`` rotates each pair of features ``(x[i], x[i + D/2])`` by the angle ``p * base**(-2i/D)``
(the "half split" pairing of GPT-NeoX and LLaMA, not RoFormer's interleaved pairs). The score between
a query at position ``m`` and a key at position ``n`` then depends on ``m - n`` only, which is why a
cache offset is all that incremental decoding needs: a step's query and key rotate by their absolute
positions ``offset + i``.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..core.checks import is_int

__all__ = ["RotaryEmbedding", "apply_rotary"]


def _rotate_half(x: Tensor) -> Tensor:
    """(..., D) -> (..., D): ``[x1, x2] -> [-x2, x1]`` with x1, x2 the two halves."""
    x1, x2 = x.chunk(2, dim=-1)  # (..., D/2) each
    return torch.cat([-x2, x1], dim=-1)  # (..., D)


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate ``x`` (B, H, L, D) by angles given as ``cos``/``sin`` (L, D); equals ``x*cos + rot(x)*sin``."""
    return x * cos + _rotate_half(x) * sin


class RotaryEmbedding(nn.Module):
    """Rotary embedding for heads of size ``head_dim``; applied by ``MultiHeadAttention(rotary=True)``.

    Args:
        head_dim: D, even.
        base: the frequency base (10000 in the paper).

    ``rope(x, offset=0)`` rotates x (B, H, L, D) as positions ``offset, ..., offset + L - 1``. The angles
    are computed in float64 and cast to x's dtype, so the same position gives bit-identical rotations
    whether it is reached in one full pass or step by step through a cache. There are no parameters
    (nothing in ``state_dict``).
    """

    def __init__(self, head_dim: int, *, base: float = 10000.0) -> None:
        super().__init__()
        if not is_int(head_dim, 1) or head_dim % 2:
            raise ValueError(
                f"rotary embeddings need an even head_dim (features rotate in pairs), got {head_dim!r}; "
                f"choose embed_dim and num_heads so that embed_dim // num_heads is even, or pass head_dim="
            )
        if not base > 0:
            raise ValueError(f"base must be positive, got {base!r}")
        self.head_dim = head_dim
        self.base = float(base)

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, base={self.base:g}"

    def angles(
        self,
        length: int,
        offset: int = 0,
        *,
        device: torch.device | None = None,
        positions: Tensor | None = None,
    ) -> Tensor:
        """Angles (L, D) in float64 for positions ``offset .. offset + L - 1`` (each half repeated), or
        (B, 1, L, D) for explicit ``positions`` (B, L) (e.g. restarting in each packed sequence)."""
        half = self.head_dim // 2
        inv_freq = self.base ** (-torch.arange(half, dtype=torch.float64, device=device) / half)  # (D/2,)
        if positions is not None:
            ang = positions.to(torch.float64)[:, None, :, None] * inv_freq  # (B, 1, L, D/2)
            return torch.cat([ang, ang], dim=-1)  # (B, 1, L, D)
        pos = torch.arange(offset, offset + length, dtype=torch.float64, device=device)  # (L,)
        ang = pos[:, None] * inv_freq[None, :]  # (L, D/2)
        return torch.cat([ang, ang], dim=-1)  # (L, D)

    def forward(self, x: Tensor, *, offset: int = 0, positions: Tensor | None = None) -> Tensor:
        """Rotate ``x`` (B, H, L, D) for positions ``offset + arange(L)``, or for ``positions`` (B, L) int
        when given; returns (B, H, L, D)."""
        if x.dim() != 4 or x.shape[-1] != self.head_dim:
            raise ValueError(f"rotary expects (B, H, L, {self.head_dim}), got {tuple(x.shape)}")
        if not is_int(offset):
            raise ValueError(f"offset must be an int (the position of x[:, :, 0]), got {offset!r}")
        if positions is not None and tuple(positions.shape) != (x.shape[0], x.shape[2]):
            raise ValueError(
                f"positions must have shape (B, L) = {(x.shape[0], x.shape[2])}, got {tuple(positions.shape)}"
            )
        ang = self.angles(x.shape[2], offset, device=x.device, positions=positions)  # (L, D) or (B, 1, L, D)
        return apply_rotary(x, ang.cos().to(x.dtype), ang.sin().to(x.dtype))
