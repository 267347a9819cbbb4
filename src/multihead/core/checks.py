"""Argument checks shared by every layer: one definition of "an int", "a positive int", "a probability",
and the validators of attention's mask arguments (``mask``, ``bias``, ``valid_lens``, ``segment_ids``).

Dimensions: B batch, H query heads, Lq query length, Lk key length.

The scalar helpers only decide; each caller keeps its own error message (it knows the argument's meaning
and the fix). The tensor validators raise themselves, naming the argument, the expected and the actual
shape or dtype, and the fix. ``bool`` is never an int here, although Python's ``bool`` subclasses ``int``.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = [
    "broadcastable",
    "check_bias",
    "check_device",
    "check_dropout",
    "check_flag",
    "check_mask",
    "check_scale",
    "check_segment_ids",
    "check_softcap",
    "check_valid_lens",
    "is_int",
    "is_tracing",
    "positive_int",
]


def is_int(value: object, minimum: int | None = None) -> bool:
    """``value`` is an ``int`` (not a ``bool``), and at least ``minimum`` when given."""
    if isinstance(value, bool) or not isinstance(value, int):
        return False
    return minimum is None or value >= minimum


def positive_int(name: str, value: object) -> int:
    """``value`` if it is an int >= 1, else ``ValueError`` naming ``name``."""
    if not is_int(value, 1):
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value  # type: ignore[return-value]


def _is_number(value: object) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float))


def check_dropout(dropout: float, name: str = "dropout") -> float:
    """A dropout probability in [0, 1)."""
    if not _is_number(dropout) or not 0.0 <= dropout < 1.0:
        raise ValueError(f"{name} must be a probability in [0, 1), got {dropout!r}")
    return float(dropout)


def check_flag(name: str, value: object) -> bool:
    """A yes/no option (``causal``, ``return_weights``): ``True``/``False`` or the ints 1/0, as a bool.

    Anything else is a ``TypeError``: ``bool()`` would take ``"False"``, ``0.5`` or ``[0]`` as True, and a
    tensor as an error that does not name the argument."""
    if value is True or value is False:
        return value
    if is_int(value) and value in (0, 1):
        return bool(value)
    hint = " (a tensor: pass bool(t))" if isinstance(value, Tensor) else ""
    raise TypeError(f"{name} must be True or False, got {type(value).__name__} {value!r}{hint}")


def check_device(name: str, t: Tensor, device: torch.device | str | None, *, host_ok: bool = False) -> None:
    """``t`` (argument ``name``) must be on ``device`` (q's), or on the CPU where ``host_ok`` (small index
    tensors such as ``valid_lens`` are moved): else a ``ValueError`` saying how to move it."""
    if device is None or t.device == torch.device(device) or (host_ok and t.device.type == "cpu"):
        return
    raise ValueError(f"{name} is on {t.device} but q is on {device}; move it with {name}.to(q.device)")


def check_scale(scale: float | None, dk: int) -> float:
    """The score scale: ``scale`` if a finite number, ``1/sqrt(dk)`` if None (1 when Dk = 0: every score
    is 0 then, whatever the scale)."""
    if scale is None:
        return 1.0 / math.sqrt(dk) if dk > 0 else 1.0
    if not _is_number(scale) or not math.isfinite(scale):
        raise ValueError(f"scale must be a finite number or None (= 1/sqrt(Dk)), got {scale!r}")
    return float(scale)


def check_softcap(softcap: float | None) -> float | None:
    """A logit soft cap: ``None`` (off) or a finite number > 0."""
    if softcap is None:
        return None
    if not _is_number(softcap) or not math.isfinite(softcap) or softcap <= 0:
        raise ValueError(
            f"softcap must be a finite number > 0 (scores -> softcap * tanh(scores / softcap), e.g. 50.0 "
            f"as Gemma 2) or None, got {softcap!r}"
        )
    return float(softcap)


def check_segment_ids(
    segment_ids: object, batch: int, lq: int, lk: int, device: torch.device | str | None = None
) -> tuple[Tensor, Tensor]:
    """``segment_ids`` as ``(q_ids (B, Lq), kv_ids (B, Lk))`` int64 on ``device``.

    Accepts one int tensor (B, L) for self-attention (Lq == Lk == L) or a pair ``(q_ids, kv_ids)``.
    """
    if isinstance(segment_ids, (tuple, list)):
        if len(segment_ids) != 2:
            raise ValueError(
                f"segment_ids must be an int tensor (B, L) or a pair (q_ids (B, Lq), kv_ids (B, Lk)), got a "
                f"{type(segment_ids).__name__} of {len(segment_ids)} items"
            )
        q_ids, kv_ids = segment_ids
        pair = True
    else:
        q_ids = kv_ids = segment_ids
        pair = False
    for name, ids, length in (("q_ids", q_ids, lq), ("kv_ids", kv_ids, lk)):
        label = f"segment_ids {name}" if pair else "segment_ids"
        if not isinstance(ids, Tensor):
            raise TypeError(
                f"{label} must be an integer torch.Tensor of shape ({batch}, {length}), got {type(ids).__name__}"
            )
        if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
            raise TypeError(
                f"{label} must be an integer tensor, got dtype {ids.dtype}; convert with `.long()`"
            )
        if not pair and lq != lk:
            raise ValueError(
                f"one segment_ids tensor (B, L) is for self-attention (Lq == Lk), got Lq={lq}, Lk={lk}; pass "
                f"a pair segment_ids=(q_ids (B, Lq), kv_ids (B, Lk))"
            )
        if tuple(ids.shape) != (batch, length):
            raise ValueError(
                f"{label} must have shape (B, {'Lq' if name == 'q_ids' else 'Lk'}) = ({batch}, {length}), got "
                f"{tuple(ids.shape)}; a single sequence is ids[None] (1, L)"
            )
    for name, ids in (("q_ids", q_ids), ("kv_ids", kv_ids)):
        check_device(f"segment_ids {name}" if pair else "segment_ids", ids, device, host_ok=True)  # type: ignore[arg-type]
    q64 = q_ids.to(device=device, dtype=torch.int64)  # type: ignore[union-attr]
    kv64 = q64 if kv_ids is q_ids else kv_ids.to(device=device, dtype=torch.int64)  # type: ignore[union-attr]
    return q64, kv64


def broadcastable(shape: tuple[int, ...], target: tuple[int, ...]) -> bool:
    """Whether a tensor of ``shape`` broadcasts to ``target`` without growing ``target``."""
    if len(shape) > len(target):
        return False
    return all(s in (1, t) for s, t in zip(reversed(shape), reversed(target)))


def check_mask(
    mask: Tensor, target: tuple[int, int, int, int], name: str = "mask", device: torch.device | None = None
) -> Tensor:
    """Check a bool ``mask`` broadcasts to ``target`` (B, H, Lq, Lk) on ``device``; return it as a 4-D view."""
    if not isinstance(mask, Tensor):
        raise TypeError(
            f"{name} must be a bool torch.Tensor, a function fn(b, h, q_idx, kv_idx) -> bool tensor or a "
            f"FlexAttention BlockMask, got "
            f"{type(mask).__name__}"
        )
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
    if not broadcastable(tuple(mask.shape), target):
        raise ValueError(
            f"{name} of shape {tuple(mask.shape)} does not broadcast to (B, H, Lq, Lk) = {target}; "
            f"give it shape (Lq, Lk), (B, 1, Lq, Lk), (B, 1, 1, Lk) or (B, H, Lq, Lk)"
        )
    check_device(name, mask, device)
    return mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))  # (B|1, H|1, Lq|1, Lk|1)


def check_bias(
    bias: Tensor, target: tuple[int, int, int, int], dtype: torch.dtype, device: torch.device | None = None
) -> Tensor:
    """Check a float ``bias`` broadcasts to ``target`` on ``device``; return it 4-D in the working ``dtype``."""
    if not isinstance(bias, Tensor):
        raise TypeError(
            f"bias must be a floating-point torch.Tensor or a function fn(b, h, q_idx, kv_idx) -> float "
            f"tensor, got {type(bias).__name__}"
        )
    if not bias.is_floating_point():
        raise TypeError(
            f"bias must be a floating-point tensor added to the scores, got dtype {bias.dtype}; "
            f"for a keep/drop mask pass a bool tensor as `mask=`"
        )
    if not broadcastable(tuple(bias.shape), target):
        raise ValueError(
            f"bias of shape {tuple(bias.shape)} does not broadcast to (B, H, Lq, Lk) = {target}; "
            f"give it shape (Lq, Lk), (H, Lq, Lk), (B, 1, Lq, Lk) or (B, H, Lq, Lk)"
        )
    check_device("bias", bias, device)
    bias = bias.reshape((1,) * (4 - bias.dim()) + tuple(bias.shape))  # (B|1, H|1, Lq|1, Lk|1)
    return bias.to(dtype)


def is_tracing() -> bool:
    """Whether a tracer (jit, dynamo, ONNX export) runs: data-dependent checks are skipped then."""
    return bool(torch.jit.is_tracing() or torch.compiler.is_compiling() or torch.onnx.is_in_onnx_export())


def check_valid_lens(
    valid_lens: Tensor, batch: int | None, lq: int | None, device: torch.device | None = None
) -> None:
    """``valid_lens`` must be an integer tensor of shape (B,) or (B, Lq) with no negative entry, on ``device``
    (q's) or the CPU."""
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
    check_device("valid_lens", valid_lens, device, host_ok=True)
    # values are read on the CPU only: on a GPU the check would make the host wait for the device on every
    # call (no queueing ahead, no CUDA graphs); there a negative length acts as 0 (a row with no key)
    on_host = valid_lens.device.type == "cpu"
    if on_host and not is_tracing() and valid_lens.numel() and bool((valid_lens < 0).any()):
        raise ValueError(f"valid_lens must be >= 0, got minimum {int(valid_lens.min())}")
