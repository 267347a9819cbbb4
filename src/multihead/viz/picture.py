"""The model view as one picture, drawn on the server: a PNG without matplotlib, and the array a figure shows.

Dimensions: N modules (rows), H heads (columns), R x C a thumbnail's pixels.

Each head's thumbnail (:func:`~multihead.viz.encoding.thumbnail`, decoded from the encoded module) is shaded as
the page shades it (the square root of the pixel over the head's largest, or over 0.25 when that is smaller:
a uniform head stays pale) and put in a grid of modules x heads. :func:`model_view_png` writes that grid as
a PNG with :mod:`zlib` only: the static picture an inline head view shows where scripts do not run.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Sequence

import torch
from torch import Tensor

from .encoding import EncodedModule, thumbnail

__all__ = ["model_view_grid", "model_view_png", "png_bytes"]

_FLOOR = 64  # uint8 of 0.25: a head whose largest weight is below it is shaded against 0.25


def model_view_grid(modules: Sequence[EncodedModule], *, side: int = 48, gap: int = 3) -> Tensor:
    """(N * (r + gap), H * (c + gap)) float: each head's shaded thumbnail (0: no weight, 1: the head's
    largest), pooled to at most ``side`` pixels a side, in its module's row and its head's column; NaN in
    the gaps and where a module has fewer heads. r, c: the largest pooled thumbnail's rows and columns."""
    tiles = [thumbnail(m.thumbnails(), side) for m in modules]  # (H_i, r_i, c_i) uint8
    r, c = max(t.shape[1] for t in tiles), max(t.shape[2] for t in tiles)
    cols = max(t.shape[0] for t in tiles)
    out = torch.full((len(tiles) * (r + gap), cols * (c + gap)), float("nan"))
    for i, t in enumerate(tiles):
        top = t.flatten(1).amax(1).clamp(min=_FLOOR).float()  # (H_i,)
        shade = (t.float() / top[:, None, None]).sqrt()  # (H_i, r_i, c_i)
        for h in range(t.shape[0]):
            y, x = i * (r + gap), h * (c + gap)
            out[y : y + t.shape[1], x : x + t.shape[2]] = shade[h]
    return out


def model_view_png(modules: Sequence[EncodedModule], *, side: int = 48) -> bytes:
    """The model view as PNG bytes: :func:`model_view_grid` in the page's blues, white where NaN; a short
    text's few pixels a head are each drawn as a square of pixels, so a head is at least 30 pixels wide."""
    g = model_view_grid(modules, side=side)
    tile = max(max(m.thumb_shape) for m in modules)
    k = -(-30 // min(tile, side))  # ceil(30 / tile): 1 from 30 tokens on
    g = g.repeat_interleave(k, 0).repeat_interleave(k, 1)  # (k Y, k X)
    x = g.nan_to_num(0.0)[..., None]  # (Y, X, 1)
    rgb = 255 - x * torch.tensor([243.0, 194.0, 110.0])  # the page's ramp: white -> (12, 61, 145)
    return png_bytes(rgb.round().to(torch.uint8))


def png_bytes(rgb: Tensor) -> bytes:
    """An image (Y, X, 3) uint8 as PNG bytes (8-bit RGB, no filter, deflated)."""
    if rgb.dtype != torch.uint8 or rgb.dim() != 3 or rgb.shape[2] != 3:
        raise ValueError(f"rgb must be a (Y, X, 3) uint8 tensor, got {rgb.dtype} {tuple(rgb.shape)}")
    y, x, _ = rgb.shape
    rows = torch.cat([torch.zeros(y, 1, dtype=torch.uint8), rgb.reshape(y, 3 * x)], dim=1)  # filter 0 per row

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", x, y, 8, 2, 0, 0, 0)  # 8 bits, RGB, deflate, no filter, no interlace
    idat = zlib.compress(rows.contiguous().numpy().tobytes(), 6)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")
