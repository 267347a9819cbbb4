"""Mask builders and the one mask normalisation routine every backend uses.

Dimensions: B batch, H query heads, Lq query length, Lk key length.

The convention, everywhere in the library:

* a **bool** mask is ``True`` where a query *may* attend to a key; it broadcasts to (B, H, Lq, Lk);
* a **float** bias is added to the scores (``-inf`` entries forbid a key);
* ``valid_lens`` of shape (B,) or (B, Lq) keeps keys ``j < valid_len`` (the d2l meaning);
* ``causal=True`` is aligned to the **bottom right**: query ``i`` sees keys ``j <= i + (Lk - Lq)``;
* everything given combines with AND;
* a query row with no allowed key gets output 0 and weight 0 (see :class:`Normalized`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = [
    "BiasFn",
    "MaskFn",
    "Normalized",
    "causal",
    "check_mask",
    "combine",
    "from_valid_lens",
    "key_padding",
    "key_padding_from_tokens",
    "normalize",
    "sliding_window",
    "to_bias",
]


def _offsets(lq: int, lk: int, device: torch.device | str | None) -> Tensor:
    """(Lq, Lk) long tensor of ``j - (i + Lk - Lq)``: 0 on the bottom-right aligned diagonal."""
    rows = torch.arange(lq, device=device).unsqueeze(1) + (lk - lq)  # (Lq, 1)
    cols = torch.arange(lk, device=device).unsqueeze(0)  # (1, Lk)
    return cols - rows  # (Lq, Lk)


def causal(lq: int, lk: int | None = None, *, device: torch.device | str | None = None) -> Tensor:
    """Causal mask of shape (Lq, Lk), aligned to the bottom right.

    Query ``i`` may attend to key ``j`` when ``j <= i + (Lk - Lq)``, so the last query sees every key
    (what a KV cache needs). With Lq = 2, Lk = 5::

        1 1 1 1 0
        1 1 1 1 1

    With Lq = Lk = 3 it is the usual lower triangle::

        1 0 0
        1 1 0
        1 1 1
    """
    lk = lq if lk is None else lk
    return _offsets(lq, lk, device) <= 0


def sliding_window(
    lq: int,
    lk: int | None = None,
    *,
    window: int,
    causal: bool = True,
    device: torch.device | str | None = None,
) -> Tensor:
    """Local attention mask of shape (Lq, Lk), aligned to the bottom right like :func:`causal`.

    With ``causal=True`` query ``i`` sees the ``window`` most recent keys up to its own position;
    with ``causal=False`` it sees keys within ``window - 1`` positions on either side.
    Lq = Lk = 5, window = 2, causal::

        1 0 0 0 0
        1 1 0 0 0
        0 1 1 0 0
        0 0 1 1 0
        0 0 0 1 1
    """
    if not isinstance(window, int) or window < 1:
        raise ValueError(f"window must be a positive int, got {window!r}")
    lk = lq if lk is None else lk
    off = _offsets(lq, lk, device)  # (Lq, Lk)
    if causal:
        return (off <= 0) & (off > -window)
    return off.abs() < window


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
        return (keys < valid_lens[:, None]).view(-1, 1, 1, lk)  # (B, 1, 1, Lk)
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
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))


MaskFn = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]
"""``fn(b, h, q_idx, kv_idx) -> bool tensor`` (True = may attend), called with broadcastable integer index
tensors; written with elementwise tensor operations it is also a valid FlexAttention ``mask_mod``."""

BiasFn = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]
"""``fn(b, h, q_idx, kv_idx) -> float tensor`` added to the scores (ALiBi, relative positions)."""


# ----------------------------------------------------------------------------------------------
# Validation helpers (shared by attention(), attention_reference() and the modules)
# ----------------------------------------------------------------------------------------------


def _broadcastable(shape: tuple[int, ...], target: tuple[int, ...]) -> bool:
    if len(shape) > len(target):
        return False
    return all(s in (1, t) for s, t in zip(reversed(shape), reversed(target)))


def check_mask(mask: Tensor, target: tuple[int, int, int, int], name: str = "mask") -> Tensor:
    """Check a bool ``mask`` broadcasts to ``target`` (B, H, Lq, Lk); return it as a 4-D view."""
    if not isinstance(mask, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of dtype bool, got {type(mask).__name__}")
    if mask.dtype != torch.bool:
        if mask.is_floating_point():
            fix = (
                f"a float {name} is an additive bias: pass it as `bias=` instead, or make a bool mask "
                f"with `{name} == 0` (0 = keep) or `{name} > -inf`"
            )
        else:
            fix = (
                f"convert with `{name}.bool()` if nonzero means 'may attend', or `{name} == 0` if "
                f"nonzero means 'masked out' (torch/Keras padding style)"
            )
        raise ValueError(f"{name} must be a bool tensor (True = may attend), got dtype {mask.dtype}; {fix}")
    if not _broadcastable(tuple(mask.shape), target):
        raise ValueError(
            f"{name} of shape {tuple(mask.shape)} does not broadcast to (B, H, Lq, Lk) = {target}; "
            f"give it shape (Lq, Lk), (B, 1, Lq, Lk), (B, 1, 1, Lk) or (B, H, Lq, Lk)"
        )
    return mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))  # (B|1, H|1, Lq|1, Lk|1)


def check_bias(bias: Tensor, target: tuple[int, int, int, int], dtype: torch.dtype) -> Tensor:
    """Check a float ``bias`` broadcasts to ``target``; return it 4-D in the working ``dtype``."""
    if not isinstance(bias, Tensor):
        raise TypeError(f"bias must be a floating-point torch.Tensor, got {type(bias).__name__}")
    if not bias.is_floating_point():
        raise TypeError(
            f"bias must be a floating-point tensor added to the scores, got dtype {bias.dtype}; "
            f"for a keep/drop mask pass a bool tensor as `mask=`"
        )
    if not _broadcastable(tuple(bias.shape), target):
        raise ValueError(
            f"bias of shape {tuple(bias.shape)} does not broadcast to (B, H, Lq, Lk) = {target}; "
            f"give it shape (Lq, Lk), (H, Lq, Lk), (B, 1, Lq, Lk) or (B, H, Lq, Lk)"
        )
    bias = bias.reshape((1,) * (4 - bias.dim()) + tuple(bias.shape))  # (B|1, H|1, Lq|1, Lk|1)
    return bias.to(dtype)


def _is_tracing() -> bool:
    return bool(torch.jit.is_tracing() or torch.compiler.is_compiling() or torch.onnx.is_in_onnx_export())


def check_valid_lens(valid_lens: Tensor, batch: int | None, lq: int | None) -> None:
    """``valid_lens`` must be an integer tensor of shape (B,) or (B, Lq) with no negative entry."""
    if not isinstance(valid_lens, Tensor):
        raise TypeError(
            f"valid_lens must be an integer torch.Tensor of shape (B,) or (B, Lq), got "
            f"{type(valid_lens).__name__}; wrap it with torch.tensor(...)"
        )
    if valid_lens.is_floating_point() or valid_lens.is_complex() or valid_lens.dtype == torch.bool:
        raise TypeError(
            f"valid_lens must be an integer tensor, got dtype {valid_lens.dtype}; convert with "
            f"`valid_lens.long()`"
        )
    expected = "(B,) or (B, Lq)" if batch is None else f"({batch},) or ({batch}, {lq})"
    ok_rank = valid_lens.dim() in (1, 2)
    ok_batch = batch is None or (ok_rank and valid_lens.shape[0] == batch)
    ok_lq = valid_lens.dim() != 2 or lq is None or valid_lens.shape[1] == lq
    if not (ok_rank and ok_batch and ok_lq):
        raise ValueError(f"valid_lens must have shape {expected}, got {tuple(valid_lens.shape)}")
    if not _is_tracing() and valid_lens.numel() and bool((valid_lens < 0).any()):
        raise ValueError(f"valid_lens must be >= 0, got minimum {int(valid_lens.min())}")


# ----------------------------------------------------------------------------------------------
# Normalisation: the one place masks are interpreted
# ----------------------------------------------------------------------------------------------


@dataclass
class Normalized:
    """Masks of one attention call in a single canonical form.

    ``mask``: bool (B|1, H|1, Lq|1, Lk) or ``None`` -- everything that forbids keys, causal included
    unless ``causal`` below is still ``True``.
    ``bias``: float (B|1, H|1, Lq|1, Lk|1) or ``None``; finite in rows that have no allowed key.
    ``causal``: ``True`` only when causality is the *only* constraint and Lq == Lk, so a backend may use
    its native causal kernel (top-left and bottom-right agree then).
    ``row_ok``: bool (B|1, H|1, Lq|1, 1) or ``None``: ``False`` for query rows with no allowed key.
    Such rows have been re-opened in ``mask``/``bias`` (so kernels never see an all ``-inf`` row and
    gradients stay finite); the backend multiplies their output and weights by ``row_ok`` -> 0.

    The function part (never expanded to a dense (Lq, Lk) tensor at long lengths; ``None`` = absent):
    ``mask_fn``: a :data:`MaskFn` that ANDs with ``mask``; ``bias_fn``: a :data:`BiasFn` added with ``bias``;
    ``segments``: ``(q_ids (B, Lq), kv_ids (B, Lk))`` int64 packed-sequence ids (a query sees only keys of
    its own id; negative ids are padding). When any of these is set, dead rows cannot be known without
    evaluating them: ``row_ok`` then covers the dense part only, and a backend serving the call must give
    rows with no allowed key output 0 itself.
    """

    mask: Tensor | None
    bias: Tensor | None
    causal: bool
    row_ok: Tensor | None
    mask_fn: MaskFn | None = None
    bias_fn: BiasFn | None = None
    segments: tuple[Tensor, Tensor] | None = None

    @property
    def has_functions(self) -> bool:
        """Whether part of the masking is given as functions or segment ids (not as dense tensors)."""
        return self.mask_fn is not None or self.bias_fn is not None or self.segments is not None


def normalize(
    target: tuple[int, int, int, int],
    *,
    mask: Tensor | None = None,
    bias: Tensor | None = None,
    valid_lens: Tensor | None = None,
    causal: bool = False,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
) -> Normalized:
    """Validate and merge ``mask``, ``bias``, ``valid_lens`` and ``causal`` for shape ``target``.

    ``target`` is (B, H, Lq, Lk). Returns a :class:`Normalized`. This is the only function that
    interprets masks; every backend and the reference go through it.
    """
    b, _, lq, lk = target
    if causal and lq == 1 and lk >= 1:
        causal = False  # one query, bottom-right aligned, sees every key: a decoding step needs no mask
    keep = check_mask(mask, target) if mask is not None else None
    if bias is not None:
        bias = check_bias(bias, target, dtype)
    if valid_lens is not None:
        check_valid_lens(valid_lens, b, lq)
        keep = combine(keep, from_valid_lens(valid_lens.to(device), lk, lq))
    if causal and (keep is not None or bias is not None or lq != lk):
        keep = combine(keep, (_offsets(lq, lk, device) <= 0).view(1, 1, lq, lk))  # bottom-right causal
        causal = False
    if keep is None and bias is None:
        return Normalized(None, None, causal, None)

    # Rows with no allowed key: from the bool mask, and from -inf entries of the bias.
    allowed = keep
    if bias is not None:
        finite = ~torch.isneginf(bias)
        allowed = finite if allowed is None else allowed & finite
    assert allowed is not None
    row_ok: Tensor | None = allowed.any(dim=-1, keepdim=True)  # (B|1, H|1, Lq|1, 1)
    if not _is_tracing() and allowed.device.type == "cpu" and bool(row_ok.all()):
        return Normalized(keep, bias, False, None)  # common case: no dead row, nothing to patch
    assert row_ok is not None
    if keep is not None:
        keep = keep | ~row_ok  # re-open dead rows: their output is zeroed by row_ok
    if bias is not None:
        bias = bias.masked_fill(~row_ok, 0.0)
    return Normalized(keep, bias, False, row_ok)
