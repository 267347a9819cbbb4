"""torch's conventions at the drop-in's boundary: its errors (of torch's types and the library's) and its masks
turned into the library's (bool ``True`` = may attend, float added to the scores).

Dimensions: N batch, S source (key) length, S' = S + the keys appended after the projections.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = [
    "FastPathShapeError",
    "InputDtypeError",
    "IsCausalError",
    "MaskDtypeError",
    "MultiheadAttentionError",
    "MultiheadAttentionRuntimeError",
    "NotATensorError",
]

# Each error of the drop-in is also an instance of the class torch.nn.MultiheadAttention (torch 2.13) raises for
# the same mistake, so an ``except`` clause written for torch catches it; its message names the argument, the
# expected and actual value, and the fix. tests/test_compat_torch_errors.py checks each against torch's module.


class MultiheadAttentionError(ValueError, AssertionError):
    """A bad argument or shape: torch.nn.MultiheadAttention raises ``AssertionError`` here, the library
    ``ValueError``; this is both, so ``except AssertionError`` written against torch still catches it."""


class MultiheadAttentionRuntimeError(ValueError, RuntimeError):
    """A bad argument torch finds only as it computes -- an ``attn_mask`` of the wrong shape, a key and value
    whose batch or feature size does not fit the query or the projections: torch raises ``RuntimeError``
    (from a ``view`` or a matrix product), the library ``ValueError``; this is both."""


class FastPathShapeError(MultiheadAttentionError, RuntimeError):
    """A bad shape torch reports as ``AssertionError`` on its general path and as ``RuntimeError`` on its fused
    inference path (eval, no grad, batch_first, one tensor as query, key and value): a mask of the wrong rank,
    a ``key_padding_mask`` of the wrong shape, a query of the wrong ``embed_dim``. This is all three."""


class IsCausalError(MultiheadAttentionRuntimeError):
    """``is_causal=True`` without ``attn_mask`` (torch raises ``RuntimeError`` here; this is both)."""


class MaskDtypeError(MultiheadAttentionRuntimeError):
    """A float mask whose dtype is not the query's (torch raises ``RuntimeError`` here; this is both)."""


class InputDtypeError(TypeError, RuntimeError):
    """A query, key or value whose dtype is not the module's (a float64 or an int64 query into a float32
    module): torch's projection raises ``RuntimeError``, the library ``TypeError``; this is both."""


class NotATensorError(TypeError, AttributeError):
    """A query, key or value that is not a tensor (a list): torch reads an attribute of it and raises
    ``AttributeError``, the library ``TypeError``; this is both."""


def _torch_says(torch_text: str, fix: str, kind: type[ValueError] = MultiheadAttentionError) -> ValueError:
    """torch's own message (what code written against torch matches on), then the library's fix, as ``kind``."""
    return kind(f"{torch_text}. {fix}")


def _keep_and_bias(m: Tensor | None, name: str, dtype: torch.dtype) -> tuple[Tensor | None, Tensor | None]:
    """A torch-style mask to (keep, bias): bool ``True`` = masked out becomes keep ``False``."""
    if m is None:
        return None, None
    if m.dtype == torch.bool:
        return ~m, None
    if m.is_floating_point():
        if m.dtype != dtype:  # torch refuses it too (in SDPA or baddbmm); converting would hide the mismatch
            raise MaskDtypeError(
                f"Expected {name} dtype to be bool or float or to match query dtype, but got {name}.dtype: "
                f"{m.dtype} and query.dtype: {dtype} instead. A float {name} is added to the scores in the "
                f"query's dtype: convert it with `{name}.to({dtype})`, or pass a bool mask (True = masked out)"
            )
        return None, m
    raise _torch_says(
        f"only bool and floating types of {name} are supported",
        f"{name} must be bool (True = masked out) or floating point (added to the scores), got dtype "
        f"{m.dtype}; convert with `{name}.bool()`",
    )


def _shape(t: Tensor) -> str:
    """A tensor's shape for a message; a nested tensor's sizes are ragged, so only its rank."""
    return f"(nested, {t.dim()}-D)" if t.is_nested else str(tuple(t.shape))


def _pad_keys(keep: Tensor | None, bias: Tensor | None, extra: int) -> tuple[Tensor | None, Tensor | None]:
    """Append ``extra`` always-allowed key columns (for bias_k/bias_v and add_zero_attn)."""
    if extra == 0:
        return keep, bias
    if keep is not None:
        keep = F.pad(keep, (0, extra), value=True)  # (..., S')
    if bias is not None:
        bias = F.pad(bias, (0, extra), value=0.0)  # (..., S')
    return keep, bias
