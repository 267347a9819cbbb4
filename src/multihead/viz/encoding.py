"""Each attention module's weights as the page of :mod:`.page` carries them: statistics, blobs, thumbnails.

Dimensions: H heads, Lq query length, Lk key length, R x C a thumbnail's rows x columns (at most
``THUMB`` each).

A head's weights travel quantised and compressed: rounded to uint8 (``q = round(255 * w)``, so an entry
is off by at most 1/510; most weights of a long text round to 0, which deflates well), deflated with
:mod:`zlib` and base64-encoded (:func:`encode_head`). Its thumbnail in the page's model view is computed
here too (:func:`thumbnail`): the quantised weights max-pooled to at most ``THUMB`` x ``THUMB`` pixels,
deflated and base64-encoded a module at a time, so opening the page inflates 9 KiB per head, not the
head: a full head is inflated only when the head view shows it. A module is encoded on its own
(:func:`encode_module`: statistics, blobs and thumbnails, no tensor kept), so a caller can encode each
module as the model runs and never hold every head's float weights at once.
"""

from __future__ import annotations

import base64
import math
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

__all__ = [
    "STAT_COLUMNS",
    "EncodedModule",
    "THUMB",
    "PageModule",
    "encode_head",
    "encode_module",
    "head_stats",
    "thumbnail",
]

STAT_COLUMNS = {
    "entropy": "mean entropy of a query's attention, in nats (0: one key; ln Lk: uniform)",
    "distance": "mean |query - key| position distance, weighted by attention (self-attention only)",
    "first": "mean weight on the first token",
    "special": "mean weight on the special tokens ([CLS], [SEP], <s>, ...)",
    "previous": "mean weight on the token just before the query (self-attention only)",
    "same": "mean weight a token gives to itself (self-attention only)",
}
"""The statistics of :func:`head_stats`, in table order, with the explanation the page shows."""


@dataclass(frozen=True)
class PageModule:
    """One attention module for the page: its weights (H, Lq, Lk) and which token sequences they join.

    ``queries`` and ``keys`` name sequences of :func:`~multihead.viz.page.build_page`'s ``sequences``
    (``"input"``, or ``"encoder"`` / ``"decoder"`` for an encoder-decoder's cross-attention).
    """

    name: str
    kind: str
    weights: Tensor
    queries: str
    keys: str
    importance: Sequence[float] | None = field(default=None)

    @property
    def heads(self) -> int:
        """H, the number of heads."""
        return self.weights.shape[0]

    @property
    def shape(self) -> tuple[int, int]:
        """(Lq, Lk), one head's shape."""
        return (self.weights.shape[1], self.weights.shape[2])

    def encode(self, special: Sequence[bool]) -> EncodedModule:
        """This module as the page carries it (:func:`encode_module`); ``special`` (Lk,) flags the keys."""
        return encode_module(
            self.name, self.kind, self.weights, self.queries, self.keys, special, importance=self.importance
        )


@dataclass(frozen=True)
class EncodedModule:
    """One attention module as the page carries it: per-head statistics, compressed weights and thumbnails,
    no tensor.

    ``blobs`` hold one head each (:func:`encode_head`'s format) of ``shape`` (Lq, Lk); ``thumbs`` the
    heads' thumbnails (H, R, C), ``thumb_shape`` = (R, C) (:func:`thumbnail`), in one base64 of zlib of
    their bytes (head by head, row by row); ``stats`` are
    ``{column of STAT_COLUMNS: H values}`` (None where undefined). At 1,000 tokens about 1/70 of the
    float32 weights' memory (most weights round to 0 and deflate away), so a whole model's fits where its
    float weights would not. Made by :func:`encode_module` or :meth:`PageModule.encode`.
    """

    name: str
    kind: str
    queries: str
    keys: str
    shape: tuple[int, int]
    stats: Mapping[str, Sequence[float | None]]
    blobs: Sequence[str]
    thumbs: str
    importance: Sequence[float] | None = field(default=None)

    @property
    def heads(self) -> int:
        """H, the number of heads."""
        return len(self.blobs)

    @property
    def thumb_shape(self) -> tuple[int, int]:
        """(R, C), a thumbnail's shape: (min(THUMB, Lq), min(THUMB, Lk))."""
        return (min(THUMB, self.shape[0]), min(THUMB, self.shape[1]))

    def encode(self, special: Sequence[bool]) -> EncodedModule:
        """Already encoded: itself (its statistics were computed with the key flags it was encoded with)."""
        return self

    def thumbnails(self) -> Tensor:
        """The heads' thumbnails (H, R, C) uint8, decoded from ``thumbs``."""
        raw = zlib.decompress(base64.b64decode(self.thumbs))
        return torch.frombuffer(bytearray(raw), dtype=torch.uint8).reshape(self.heads, *self.thumb_shape)

    def head(self, h: int) -> Tensor:
        """Head ``h``'s weights (Lq, Lk) float32 as the page reads them (within 1/510 of the original)."""
        raw = zlib.decompress(base64.b64decode(self.blobs[h]))
        q = torch.frombuffer(bytearray(raw), dtype=torch.uint8).reshape(self.shape[::-1])  # (Lk, Lq)
        return q.t().float() / 255  # (Lq, Lk)


# ------------------------------------------------------------------------------------------------
# Data: statistics and encoding
# ------------------------------------------------------------------------------------------------


def head_stats(weights: Tensor, special: Sequence[bool], *, self_attention: bool) -> dict[str, Tensor]:
    """Per-head statistics of one module's weights (H, Lq, Lk), each averaged over the query rows.

    ``special`` (Lk,) marks the special key tokens. Returns ``{column of STAT_COLUMNS: (H,) float64}``;
    the position statistics (distance, previous, same) are NaN for cross-attention
    (``self_attention=False``), where query and key positions index different sequences. Each query's
    sum over the keys is taken in the weights' precision (float32 at least: about 1e-6 relative error),
    the means over the queries in float64.
    """
    w = weights.detach()
    w = w if w.dtype == torch.float64 else w.float()  # (H, Lq, Lk)
    f64 = torch.float64
    h, lq, lk = w.shape
    if len(special) != lk:
        raise ValueError(f"special must have one flag per key token (Lk={lk}), got {len(special)}")
    spec = torch.tensor(list(special), dtype=torch.bool)
    out = {
        "entropy": torch.special.entr(w).sum(-1).to(f64).mean(-1),  # -sum w ln w over the keys: (H,)
        "first": w[:, :, 0].to(f64).mean(-1),
        "special": w[:, :, spec].sum(-1).to(f64).mean(-1),
    }
    nan = torch.full((h,), math.nan, dtype=f64)
    if not self_attention or lq != lk:
        out.update(distance=nan, previous=nan, same=nan)
    else:
        pos = torch.arange(lq, dtype=w.dtype)  # exact: positions < 2**24
        dist = (pos[:, None] - pos[None, :]).abs()  # (Lq, Lk)
        out["distance"] = torch.einsum("hqk,qk->hq", w, dist).to(f64).mean(-1)  # sum_k w |q - k|: (H, Lq)
        out["previous"] = w.diagonal(offset=-1, dim1=1, dim2=2).to(f64).mean(-1) if lq > 1 else nan.clone()
        out["same"] = w.diagonal(dim1=1, dim2=2).to(f64).mean(-1)
    return {k: out[k] for k in STAT_COLUMNS}


def _quantize(weights: Tensor) -> Tensor:
    """Weights (..., Lq, Lk) in [0, 1] -> uint8 ``floor(255 w + 1/2)``, within 1/510 (+ one rounding of 255 w)."""
    w = weights.detach()
    w = w if w.dtype == torch.float64 else w.float()
    return w.mul(255).add_(0.5).clamp_(0, 255).to(torch.uint8)  # conversion truncates: floor of x >= 0


def _deflate(q: Tensor, level: int) -> str:
    """uint8 (N, M) -> base64 of zlib (at ``level``) of its bytes row by row."""
    return base64.b64encode(zlib.compress(q.contiguous().numpy().tobytes(), level)).decode("ascii")


def _pack(q: Tensor) -> str:
    """uint8 (Lq, Lk) -> base64 of zlib (level 5) of its bytes key-major: row j holds key j's Lq weights.

    Key-major because a key's weights down the queries vary less than a query's along the keys (a key
    that draws attention draws it from many queries; a causal key gets none from the queries before it):
    on a 1,000-token text the deflated bytes are about a quarter fewer than row-major, and deflate faster.
    """
    return _deflate(q.t(), 5)


def encode_head(weights: Tensor) -> str:
    """One head's weights (Lq, Lk) as the page carries them: base64 of zlib(uint8 q, key-major).

    Decoding: base64, inflate, read Lk x Lq bytes (row j: key j's weight from each query), transpose to
    (Lq, Lk); the weight is ``q / 255``, within 1/510 of
    the input (weights lie in [0, 1]; float32 weights are scaled in float32, which adds at most 2**-24).
    """
    return _pack(_quantize(weights.cpu()))


def encode_module(
    name: str,
    kind: str,
    weights: Tensor,
    queries: str,
    keys: str,
    special: Sequence[bool],
    *,
    importance: Sequence[float] | None = None,
) -> EncodedModule:
    """One module's weights (H, Lq, Lk) (on any device) encoded for the page: statistics, and per head a
    blob (:func:`encode_head`) and a thumbnail (:func:`thumbnail`; all of them deflated in one blob at
    level 9 and base64-encoded).

    ``special`` (Lk,) flags the special key tokens; the position statistics are computed when
    ``queries == keys`` (self-attention). The result holds no reference to ``weights``.
    """
    if weights.dim() != 3:
        raise ValueError(f"{name}: weights must be (H, Lq, Lk), got shape {tuple(weights.shape)}")
    w = weights.detach().cpu()
    stats = head_stats(w, special, self_attention=queries == keys)
    q = _quantize(w)  # (H, Lq, Lk) uint8
    thumbs = thumbnail(q)  # (H, R, C) uint8
    return EncodedModule(
        name,
        kind,
        queries,
        keys,
        (w.shape[1], w.shape[2]),
        {k: [_finite(v) for v in s.tolist()] for k, s in stats.items()},
        [_pack(q[i]) for i in range(q.shape[0])],
        _deflate(thumbs.reshape(-1, thumbs.shape[-1]), 9),  # (H * R, C)
        importance,
    )


def _finite(x: float) -> float | None:
    return None if math.isnan(x) else round(float(x), 5)


# ------------------------------------------------------------------------------------------------
# Thumbnails
# ------------------------------------------------------------------------------------------------

THUMB = 96
"""The largest side of a thumbnail, in pixels (a head of more tokens is pooled down to it)."""


def _pool_rows(q: Tensor, side: int) -> Tensor:
    """(..., N, M) -> (..., R, M), R = min(side, N): row r the largest of rows i with floor(i R / N) == r."""
    n = q.shape[-2]
    out = min(side, n)
    edges = [(r * n + out - 1) // out for r in range(out + 1)]  # block r: rows ceil(r n / out) on
    width = max(b - a for a, b in zip(edges, edges[1:]))
    # each block's rows, the last repeated up to the widest block's count (a repeat leaves the max as it is)
    rows = torch.tensor([[min(a + k, b - 1) for k in range(width)] for a, b in zip(edges, edges[1:])])
    picked = q.index_select(-2, rows.flatten())  # (..., R * width, M)
    return picked.view(*q.shape[:-2], out, width, q.shape[-1]).amax(-2)  # (..., R, M)


def thumbnail(q: Tensor, side: int = THUMB) -> Tensor:
    """Quantised weights (..., Lq, Lk) uint8 max-pooled to (..., R, C), R = min(side, Lq), C = min(side, Lk).

    Pixel (r, c) holds the largest weight of the cells (i, j) with ``floor(i R / Lq) == r`` and
    ``floor(j C / Lk) == c``: contiguous blocks of ``Lq / R`` queries by ``Lk / C`` keys, each cell in one.
    The maximum, not the mean, because a thumbnail is for spotting a head's pattern: a one-cell-wide
    line (each query on itself, on the token before, on the first token) averaged over a 10 x 10 block
    would fade to a tenth of its weight, while its maximum keeps it at full strength; a head that spreads
    its weight evenly stays pale either way (its largest weight is small).
    """
    if side < 1:
        raise ValueError(f"side must be at least 1 pixel, got {side}")
    rows = _pool_rows(q, side)  # (..., R, Lk)
    return _pool_rows(rows.transpose(-1, -2), side).transpose(-1, -2)  # (..., R, C)
