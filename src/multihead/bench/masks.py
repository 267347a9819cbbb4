"""The masks of the benchmark's mask cases, as FlexAttention users write them and as the library does.

Dimensions: L sequence length (self-attention), W window, C chunk, P prefix.

Each kind (:data:`KINDS`) gives, for a length L, a plain ``mask_mod`` (what users bring: a lambda of
(b, h, q_idx, kv_idx)), the library's equivalent mask function where there is one (with a key range),
and for documents the segment ids. Every form allows exactly the same (query, key) pairs.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor

from ..core.masks import chunked_fn, prefix_lm_fn, sliding_window_fn

__all__ = ["KINDS", "MaskKind", "document_ids", "mask_of", "visible_pairs"]

MaskFn = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]
WINDOW, CHUNK = 512, 512


class MaskKind(NamedTuple):
    """``plain(L, device)``: the user's mask_mod (a tensor it captures lives on ``device``);
    ``library(L)``: the library's function or ``None``; ``segments(L)``: (1, L) segment ids whose causal
    attention is the same mask, or ``None``."""

    plain: Callable[..., MaskFn]
    library: Callable[[int], MaskFn | None]
    segments: Callable[[int], Tensor | None]


def document_ids(length: int, seed: int = 0) -> Tensor:
    """(L,) ids of documents of random lengths 64..2048 packed in one row (fixed seed)."""
    gen, ids, doc = random.Random(seed), [], 0
    while len(ids) < length:
        ids += [doc] * gen.randint(64, 2048)
        doc += 1
    return torch.tensor(ids[:length])


def _two_sided(length: int, device: object = "cpu") -> MaskFn:
    return lambda b, h, q_idx, kv_idx: (q_idx - kv_idx < WINDOW) & (kv_idx - q_idx < WINDOW)


def _causal_window(length: int, device: object = "cpu") -> MaskFn:
    return lambda b, h, q_idx, kv_idx: (q_idx >= kv_idx) & (q_idx - kv_idx < WINDOW)


def _eighth_window(length: int, device: object = "cpu") -> MaskFn:
    w = length // 8
    return lambda b, h, q_idx, kv_idx: (q_idx >= kv_idx) & (q_idx - kv_idx < w)


def _prefix_lm(length: int, device: object = "cpu") -> MaskFn:
    prefix = length // 4
    return lambda b, h, q_idx, kv_idx: (kv_idx <= q_idx) | (kv_idx < prefix)


def _chunked(length: int, device: object = "cpu") -> MaskFn:
    return lambda b, h, q_idx, kv_idx: (q_idx // CHUNK == kv_idx // CHUNK) & (kv_idx <= q_idx)


def _documents(length: int, device: object = "cpu") -> MaskFn:
    ids = document_ids(length).to(device)  # (L,)
    return lambda b, h, q_idx, kv_idx: (ids[q_idx] == ids[kv_idx]) & (kv_idx <= q_idx)


KINDS: dict[str, MaskKind] = {
    "two-sided window": MaskKind(
        _two_sided, lambda n: sliding_window_fn(WINDOW, causal=False), lambda n: None
    ),
    "causal window": MaskKind(_causal_window, lambda n: sliding_window_fn(WINDOW), lambda n: None),
    "causal window L/8": MaskKind(_eighth_window, lambda n: sliding_window_fn(n // 8), lambda n: None),
    "prefix-LM": MaskKind(_prefix_lm, lambda n: prefix_lm_fn(n // 4), lambda n: None),
    "chunked": MaskKind(_chunked, lambda n: chunked_fn(CHUNK), lambda n: None),
    "documents": MaskKind(_documents, lambda n: None, lambda n: document_ids(n)[None]),
}


def mask_of(kind: str, form: str, length: int, device: torch.device | str = "cpu") -> dict[str, object]:
    """The ``mh.attention`` keywords of mask ``kind`` in ``form`` for inputs on ``device``: "lambda" (the
    plain mask_mod), "library" (the library's function), "segments" (segment ids, causal) or "blockmask"
    (a FlexAttention BlockMask of the plain mask_mod, built once here)."""
    k, device = KINDS[kind], torch.device(device)
    if form == "library":
        return {"mask": k.library(length)}
    if form == "segments":
        return {"segment_ids": k.segments(length).to(device), "causal": True}  # type: ignore[union-attr]
    if form == "blockmask":
        from torch.nn.attention.flex_attention import create_block_mask

        fn = k.plain(length, device)
        return {"mask": create_block_mask(fn, None, None, length, length, device=device.type)}
    return {"mask": k.plain(length, device)}


@functools.cache
def visible_pairs(kind: str, length: int) -> int:
    """How many (query, key) pairs mask ``kind`` allows at length L (counted on rows of 256 queries at a
    time: never an (L, L) tensor)."""
    fn, total = KINDS[kind].plain(length), 0
    keys = torch.arange(length).view(1, -1)  # (1, L)
    for start in range(0, length, 256):
        rows = torch.arange(start, min(length, start + 256)).view(-1, 1)  # (n, 1)
        total += int(fn(torch.zeros(()), torch.zeros(()), rows, keys).sum())
    return total
