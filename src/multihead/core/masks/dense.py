"""Dense mask builders: bool (Lq, Lk) or (B, 1, Lq|1, Lk) tensors, ``True`` = may attend.

Dimensions: B batch, H query heads, Lq query length, Lk key length.

Causality lives here once: :func:`causal_keep` is the rule ``kv_idx <= q_idx + diagonal`` on index
tensors, and every causal mask of the library -- :func:`causal`, :func:`sliding_window`, the causal
function factories, the backends' causal tiles, ``compat.torch``'s top-left mask, the transformers
integration's -- is built from it, the alignment given as ``diagonal``: ``Lk - Lq`` is the library's
bottom-right rule (the default), ``0`` the top-left one of ``torch``'s ``is_causal`` and FlexAttention's
``causal_mask``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from ..checks import check_valid_lens, is_int


class Extent(NamedTuple):
    """[start, stop) of one tile dimension; unlike a ``range`` it keeps a symbolic size symbolic (an
    exported graph's dynamic lengths stay dynamic)."""

    start: int
    stop: int


__all__ = [
    "Extent",
    "bottom_right",
    "causal",
    "causal_keep",
    "combine",
    "from_valid_lens",
    "index_grid",
    "key_padding",
    "key_padding_from_tokens",
    "key_prefix",
    "segment_mask",
    "sliding_window",
    "to_bias",
]


def bottom_right(lq: int, lk: int) -> int:
    """The diagonal of the bottom-right alignment: ``Lk - Lq`` (query ``i`` sees keys ``j <= i + Lk - Lq``,
    so the last query sees every key: what a KV cache needs)."""
    return lk - lq


def causal_keep(q_idx: Tensor, kv_idx: Tensor, diagonal: int, window: int | None = None) -> Tensor:
    """The causal rule on broadcastable index tensors: ``kv_idx <= q_idx + diagonal``, and with a
    ``window`` also ``kv_idx > q_idx + diagonal - window`` (the ``window`` most recent keys)."""
    d = kv_idx - (q_idx + diagonal)  # 0 on the diagonal
    return (d <= 0) if window is None else (d <= 0) & (d > -window)


def _positions(lq: int, lk: int, device: torch.device | str | None) -> tuple[Tensor, Tensor]:
    return (
        torch.arange(lq, device=device).unsqueeze(1),  # (Lq, 1)
        torch.arange(lk, device=device).unsqueeze(0),  # (1, Lk)
    )


def causal(
    lq: int,
    lk: int | None = None,
    *,
    diagonal: int | None = None,
    device: torch.device | str | None = None,
) -> Tensor:
    """Causal mask of shape (Lq, Lk): query ``i`` may attend to key ``j`` when ``j <= i + diagonal``.

    ``diagonal`` gives the alignment: by default ``Lk - Lq``, the **bottom right**, so the last query
    sees every key (what a KV cache needs). With Lq = 2, Lk = 5::

        1 1 1 1 0
        1 1 1 1 1

    ``diagonal=0`` is the top-left alignment (``torch``'s ``is_causal``); with Lq = 2, Lk = 5::

        1 0 0 0 0
        1 1 0 0 0

    With Lq = Lk = 3 both are the usual lower triangle::

        1 0 0
        1 1 0
        1 1 1
    """
    lk = lq if lk is None else lk
    rows, cols = _positions(lq, lk, device)
    return causal_keep(rows, cols, bottom_right(lq, lk) if diagonal is None else diagonal)  # (Lq, Lk)


def sliding_window(
    lq: int,
    lk: int | None = None,
    *,
    window: int,
    causal: bool = True,
    diagonal: int | None = None,
    device: torch.device | str | None = None,
) -> Tensor:
    """Local attention mask of shape (Lq, Lk), aligned like :func:`causal` (``diagonal``, default the
    bottom right).

    With ``causal=True`` query ``i`` sees the ``window`` most recent keys up to its own position;
    with ``causal=False`` it sees keys within ``window - 1`` positions on either side.
    Lq = Lk = 5, window = 2, causal::

        1 0 0 0 0
        1 1 0 0 0
        0 1 1 0 0
        0 0 1 1 0
        0 0 0 1 1
    """
    if not is_int(window, 1):
        raise ValueError(f"window must be a positive int, got {window!r}")
    lk = lq if lk is None else lk
    rows, cols = _positions(lq, lk, device)
    diagonal = bottom_right(lq, lk) if diagonal is None else diagonal
    if causal:
        return causal_keep(rows, cols, diagonal, window)  # (Lq, Lk)
    return (cols - rows - diagonal).abs() < window  # (Lq, Lk)


def from_valid_lens(valid_lens: Tensor, lk: int, lq: int | None = None) -> Tensor:
    """Bool mask from d2l-style ``valid_lens``: keys at index >= valid_len are masked.

    ``valid_lens`` (B,) gives (B, 1, 1, Lk); (B, Lq) gives (B, 1, Lq, Lk). With valid_lens = [3, 1]
    and Lk = 4 the two rows are::

        1 1 1 0
        1 0 0 0
    """
    check_valid_lens(valid_lens, batch=None, lq=lq)
    keys = torch.arange(lk, device=valid_lens.device)  # (Lk,)
    if valid_lens.dim() == 1:
        return (keys < valid_lens[:, None]).view(valid_lens.shape[0], 1, 1, lk)  # (B, 1, 1, Lk)
    return (keys < valid_lens[:, :, None]).unsqueeze(1)  # (B, 1, Lq, Lk)


def key_padding(keep: Tensor) -> Tensor:
    """(B, Lk) bool, ``True`` for real keys, to a (B, 1, 1, Lk) attention mask.

    torch's ``key_padding_mask`` uses the opposite meaning (``True`` = padding); pass ``~mask``.
    """
    if keep.dtype != torch.bool or keep.dim() != 2:
        raise ValueError(
            f"key_padding expects a (B, Lk) bool tensor with True for real keys, got shape "
            f"{tuple(keep.shape)} dtype {keep.dtype}; convert with `keep = lengths_or_mask.bool()`"
        )
    return keep[:, None, None, :]  # (B, 1, 1, Lk)


def key_prefix(keep: Tensor) -> Tensor | None:
    """(B,) lengths ``n`` when the bool mask ``keep`` (B|1, 1, Lq|1, Lk) lets every query of row ``b`` see
    exactly the keys ``0 .. n[b]-1`` (right padding, ``valid_lens`` per row, transformers' padding mask of
    an encoder); ``None`` for any other mask. One pass over ``keep``; reads values (not for tracing)."""
    if keep.dtype != torch.bool or keep.dim() != 4 or keep.shape[1] != 1:
        return None
    first = keep[:, :, :1]  # (B|1, 1, 1, Lk): the first query's keys
    if keep.shape[2] > 1 and not bool((keep == first).all()):
        return None
    lk = keep.shape[3]
    n = first.reshape(-1, lk).sum(-1)  # (B|1,)
    prefix = torch.arange(lk, device=keep.device) < n[:, None]  # (B|1, Lk)
    return n if torch.equal(first.reshape(-1, lk), prefix) else None


def key_padding_from_tokens(tokens: Tensor, pad_id: int) -> Tensor:
    """(B, Lk) token ids to a (B, 1, 1, Lk) mask that hides the ``pad_id`` positions."""
    return key_padding(tokens != pad_id)


def combine(*masks: Tensor | None) -> Tensor | None:
    """AND of bool masks with broadcasting; ``None`` entries are skipped, all-``None`` gives ``None``.

    ``combine(causal(3), from_valid_lens(torch.tensor([2]), 3))`` is, for the one batch row::

        1 0 0
        1 1 0
        1 1 0
    """
    out: Tensor | None = None
    for m in masks:
        if m is None:
            continue
        if m.dtype != torch.bool:
            raise ValueError(f"combine takes bool masks, got dtype {m.dtype}; convert with `m.bool()`")
        out = m if out is None else out & m
    return out


def to_bias(mask: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """Bool mask to an additive float bias: 0 where allowed, ``-inf`` where masked."""
    return torch.full(mask.shape, float("-inf"), dtype=dtype, device=mask.device).masked_fill_(mask, 0.0)


def segment_mask(q_ids: Tensor, kv_ids: Tensor) -> Tensor:
    """(B, 1, Lq, Lk) bool from segment ids ``q_ids`` (B, Lq), ``kv_ids`` (B, Lk): the same id, both >= 0."""
    qi, ki = q_ids[:, None, :, None], kv_ids[:, None, None, :]  # (B, 1, Lq, 1), (B, 1, 1, Lk)
    return (qi == ki) & (qi >= 0) & (ki >= 0)  # (B, 1, Lq, Lk)


def index_grid(
    target: tuple[int, int, int, int],
    device: torch.device | str | None = None,
    *,
    batch: Extent | range | None = None,
    queries: Extent | range | None = None,
    keys: Extent | range | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    r"""The int64 index tensors a mask or bias function is called with on the (B, H, Lq, Lk) grid ``target``,
    or on the tile of it that ``batch``, ``queries`` and ``keys`` (:class:`Extent`\ s or ranges of global
    indices) select:
    ``b`` (B, 1, 1, 1), ``h`` (1, H, 1, 1), ``q_idx`` (1, 1, Lq, 1), ``kv_idx`` (1, 1, 1, Lk)."""
    nb, h, lq, lk = target

    def arange(
        extent: Extent | range | None, n: int
    ) -> Tensor:  # the whole dimension: arange(n), n kept symbolic
        if extent is None or (extent.start == 0 and extent.stop is n):
            return torch.arange(n, device=device)
        return torch.arange(extent.start, extent.stop, device=device)

    return (
        arange(batch, nb).view(-1, 1, 1, 1),  # (B, 1, 1, 1)
        torch.arange(h, device=device).view(1, h, 1, 1),  # (1, H, 1, 1)
        arange(queries, lq).view(1, 1, -1, 1),  # (1, 1, Lq, 1)
        arange(keys, lk).view(1, 1, 1, -1),  # (1, 1, 1, Lk)
    )
