"""Normalisation: the one place an attention call's masks are interpreted, and the one tile evaluation.

Dimensions: B batch, H query heads, Lq query length, Lk key length, n queries and w keys of a tile.

:func:`normalize` validates and merges ``mask``, ``bias``, ``valid_lens``, ``causal`` and ``segment_ids``
into a :class:`Normalized`; :func:`evaluate_block` gives what it says about one tile of queries x keys
(``(keep, bias)``), the only function that evaluates a tile -- every backend, block-skipping or dense
(:func:`materialize` is :func:`evaluate_block` on the whole grid), goes through it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..checks import check_bias, check_mask, check_segment_ids, check_valid_lens
from .blocks import BlockMaskFunction, from_flex, is_flex_block_mask
from .dense import Extent, causal_keep, combine, from_valid_lens, index_grid, segment_mask
from .evaluate import call_fn, open_dead_rows, probe_fn
from .functions import BiasFn, MaskFn

__all__ = ["Normalized", "evaluate_block", "materialize", "normalize"]


@dataclass
class Normalized:
    """Masks of one attention call in a single canonical form.

    ``mask``: bool (B|1, H|1, Lq|1, Lk) or ``None`` -- everything dense that forbids keys, causal
    included unless ``causal`` below is still ``True``.
    ``bias``: float (B|1, H|1, Lq|1, Lk|1) or ``None``; finite in rows that have no allowed key.
    ``causal``: without functions (``has_functions`` False), ``True`` only when causality is the *only*
    constraint and Lq == Lk, so a backend may use its native causal kernel (top-left and bottom-right
    agree then).
    ``row_ok``: bool (B|1, H|1, Lq|1, 1) or ``None``: ``False`` for query rows with no allowed key.
    Such rows have been re-opened in ``mask``/``bias`` (so kernels never see an all ``-inf`` row and
    gradients stay finite); the backend multiplies their output and weights by ``row_ok`` -> 0.

    The function part (never expanded to a dense (Lq, Lk) tensor here; ``None`` = absent):
    ``mask_fn``: a :data:`MaskFn` that ANDs with ``mask``; ``bias_fn``: a :data:`BiasFn` added with ``bias``;
    ``segments``: ``(q_ids (B, Lq), kv_ids (B, Lk))`` int64 packed-sequence ids (a query sees only keys of
    its own id; negative ids are padding: never attended, and a padding query has no allowed key).

    **Function mode** (``has_functions`` True): ``mask``/``bias`` hold only the dense tensors given
    (``mask``, ``bias``, ``valid_lens``), and ``causal=True`` keeps its user meaning as a flag: the
    bottom-right aligned causal rule ``j <= i + (Lk - Lq)``, ANDed with everything else, for any Lq, Lk.
    ``row_ok`` covers the dense part only: rows that the functions, segments or causality leave with no
    allowed key are unknown until evaluated, and a backend serving the call must give them output 0
    (weights 0, finite gradients) itself. :func:`materialize` turns this into the dense form;
    :func:`evaluate_block` gives one block of it (a block-skipping backend's view);
    :func:`multihead.segments.segment_runs` gives the contiguous runs of ``segments`` (varlen kernels).
    The allowed set is ``mask & mask_fn & segments & causal & (bias + bias_fn > -inf)``.
    """

    mask: Tensor | None
    bias: Tensor | None
    causal: bool
    row_ok: Tensor | None
    mask_fn: MaskFn | None = None
    bias_fn: BiasFn | None = None
    segments: tuple[Tensor, Tensor] | None = None
    mask_broadcast: bool = True  # how mask_fn is called (see multihead.core.masks.evaluate.how_to_call)
    bias_broadcast: bool = True  # how bias_fn is called

    @property
    def has_functions(self) -> bool:
        """Whether part of the masking is given as functions or segment ids (not as dense tensors)."""
        return self.mask_fn is not None or self.bias_fn is not None or self.segments is not None


def _is_fn(x: object) -> bool:
    return x is not None and not isinstance(x, Tensor) and callable(x)


def _dense(keep: Tensor | None, bias: Tensor | None) -> Normalized:
    """The dense form of ``keep`` and ``bias``: dead rows found, re-opened and recorded in ``row_ok``."""
    keep, bias, row_ok = open_dead_rows(keep, bias)
    return Normalized(keep, bias, False, row_ok)


def normalize(
    target: tuple[int, int, int, int],
    *,
    mask: Tensor | MaskFn | None = None,
    bias: Tensor | BiasFn | None = None,
    valid_lens: Tensor | None = None,
    causal: bool = False,
    segment_ids: Tensor | tuple[Tensor, Tensor] | None = None,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
) -> Normalized:
    """Validate and merge ``mask``, ``bias``, ``valid_lens``, ``causal`` and ``segment_ids`` for ``target``.

    ``target`` is (B, H, Lq, Lk). Returns a :class:`Normalized`. This is the only function that
    interprets masks; every backend and the reference go through it. A function ``mask``/``bias`` or
    ``segment_ids`` give the function mode (see :class:`Normalized`): nothing of size (Lq, Lk) is built
    here; the functions are only probed on a few indices for a clear error, and to decide how they are
    called (:func:`multihead.core.masks.evaluate.how_to_call`).
    """
    b, _, lq, lk = target
    if causal and lq == 1 and lk >= 1:
        causal = False  # one query, bottom-right aligned, sees every key: a decoding step needs no mask
    if is_flex_block_mask(mask):
        mask = from_flex(mask, target)  # its structure and mask_mod, as FlexAttention computes them
    if isinstance(mask, BlockMaskFunction):
        mask.blocks.check(target)
    mask_fn = mask if _is_fn(mask) else None
    bias_fn = bias if _is_fn(bias) else None
    mask_broadcast = probe_fn(mask_fn, target, "mask", device) if mask_fn is not None else True
    bias_broadcast = probe_fn(bias_fn, target, "bias", device) if bias_fn is not None else True
    segments = None if segment_ids is None else check_segment_ids(segment_ids, b, lq, lk, device)
    dev = None if device is None else torch.device(device)
    keep = check_mask(mask, target, device=dev) if mask is not None and mask_fn is None else None  # type: ignore[arg-type]
    dense_bias = check_bias(bias, target, dtype, dev) if bias is not None and bias_fn is None else None  # type: ignore[arg-type]
    if valid_lens is not None:
        check_valid_lens(valid_lens, b, lq, dev)
        keep = combine(keep, from_valid_lens(valid_lens.to(device), lk, lq))
    if lk == 0:  # no keys: every row is dead, whatever a mask broadcast over them says (or none at all)
        keep = combine(keep, torch.zeros(1, 1, 1, 0, dtype=torch.bool, device=dev))  # (1, 1, 1, 0)
    if mask_fn is not None or bias_fn is not None or segments is not None:  # function mode
        norm = _dense(keep, dense_bias)
        norm.causal, norm.mask_fn, norm.bias_fn, norm.segments = causal, mask_fn, bias_fn, segments
        norm.mask_broadcast, norm.bias_broadcast = mask_broadcast, bias_broadcast
        return norm
    if causal and (keep is not None or dense_bias is not None or lq != lk):
        keep, _ = evaluate_block(
            Normalized(keep, None, True, None), target, slice(None), slice(None), dtype, device
        )
        causal = False
    if keep is None and dense_bias is None:
        return Normalized(None, None, causal, None)
    return _dense(keep, dense_bias)


def materialize(
    norm: Normalized,
    target: tuple[int, int, int, int],
    dtype: torch.dtype,
    device: torch.device | str | None = None,
) -> Normalized:
    """A function-mode :class:`Normalized` in the ordinary dense form (``has_functions`` False).

    Evaluates ``mask_fn``/``bias_fn`` on the full (B, H, Lq, Lk) grid, turns ``segments`` into a
    (B, 1, Lq, Lk) bool mask and folds ``causal`` in, then finds, re-opens and records the rows with no
    allowed key (``row_ok``). Builds (Lq, Lk) entries: backends call it only at lengths where a dense
    score matrix is acceptable. A dense ``norm`` is returned as is.
    """
    if not norm.has_functions:
        return norm
    keep, bias = evaluate_block(norm, target, slice(None), slice(None), dtype, device)
    return _dense(keep, bias)


def _cut(t: Tensor | None, b: Extent, q: Extent, kv: Extent) -> Tensor | None:
    """A dense (B|1, H|1, Lq|1, Lk|1) mask or bias on a tile, broadcast (size-1) dimensions kept."""
    if t is None:
        return None
    if t.shape[0] > 1 and (b.start, b.stop) != (0, t.shape[0]):
        t = t[b.start : b.stop]
    if t.shape[2] > 1 and (q.start, q.stop) != (0, t.shape[2]):
        t = t[:, :, q.start : q.stop]
    if t.shape[3] > 1 and (kv.start, kv.stop) != (0, t.shape[3]):
        t = t[:, :, :, kv.start : kv.stop]
    return t


def evaluate_block(
    norm: Normalized,
    target: tuple[int, int, int, int],
    q: slice,
    kv: slice,
    dtype: torch.dtype,
    device: torch.device | str | None = None,
    *,
    batch: slice = slice(None),
    keep: bool = True,
    bias: bool = True,
) -> tuple[Tensor | None, Tensor | None]:
    """Everything ``norm`` says about one tile: batch rows ``batch`` x queries ``q`` x keys ``kv`` (slices of
    [0, B), [0, Lq), [0, Lk), global indices of the call ``target`` (B, H, Lq, Lk)).

    Returns ``(keep, bias)``: bool (B'|1, H|1, n|1, w|1) -- the dense mask and dense dead rows, the mask
    function, the segment ids and bottom-right causality, ANDed -- and float (B'|1, H|1, n|1, w|1) in
    ``dtype`` -- the dense bias plus the bias function -- each ``None`` if nothing applies. The one tile
    evaluation of the library: a block-skipping backend calls it per tile, :func:`materialize` once for
    the whole grid. Rows with no allowed key are *not* handled here (a row is dead only if all its tiles
    are: :func:`multihead.core.masks.evaluate.open_dead_rows` handles them once the tiles are joined).
    ``keep=False`` / ``bias=False``: leave that part out (``None``), e.g. the bias of keys found masked.
    """
    nb, _, lq, lk = target
    rb, rq, rk = (
        Extent(s.start or 0, n if s.stop is None else s.stop) for s, n in ((batch, nb), (q, lq), (kv, lk))
    )
    allowed = combine(_cut(norm.mask, rb, rq, rk), _cut(norm.row_ok, rb, rq, Extent(0, 1))) if keep else None
    added = _cut(norm.bias, rb, rq, rk) if bias else None
    diagonal = lk - lq  # bottom right
    crosses = keep and norm.causal and rk.stop - 1 > rq.start + diagonal  # a key of the tile is past it
    fns = (
        keep and (norm.mask_fn is not None or norm.segments is not None) or bias and norm.bias_fn is not None
    )
    if not fns and not crosses:
        return allowed, added
    idx = index_grid(target, device, batch=rb, queries=rq, keys=rk)
    if keep and norm.mask_fn is not None:
        allowed = combine(allowed, call_fn(norm.mask_fn, "mask", idx, norm.mask_broadcast))
    if keep and norm.segments is not None:
        q_ids, kv_ids = norm.segments
        ids = q_ids[rb.start : rb.stop, rq.start : rq.stop], kv_ids[rb.start : rb.stop, rk.start : rk.stop]
        allowed = combine(allowed, segment_mask(*ids))  # (B', 1, n, w)
    if crosses:
        allowed = combine(allowed, causal_keep(idx[2], idx[3], diagonal))  # (1, 1, n, w)
    if bias and norm.bias_fn is not None:
        extra = call_fn(norm.bias_fn, "bias", idx, norm.bias_broadcast).to(dtype)
        added = extra if added is None else added + extra
    return allowed, added
