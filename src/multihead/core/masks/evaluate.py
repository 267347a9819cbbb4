"""Calling mask and bias functions with FlexAttention's meaning, and the one dead-row helper.

Dimensions: B batch, H query heads, Lq query length, Lk key length, n queries and w keys of a tile.

**What a function means.** FlexAttention calls a ``mask_mod``/``score_mod`` once per (b, h, q_idx, kv_idx),
each a 0-d int tensor, under ``torch.vmap``; the result for one point is a 0-d tensor. A function written
with elementwise operations gives the same values when called once on broadcastable index tensors
(b (B, 1, 1, 1), h (1, H, 1, 1), q_idx (1, 1, n, 1), kv_idx (1, 1, 1, w)), which is much cheaper. Others
do not: attention-gym's Flamingo mask indexes a captured (images, 2) table with ``kv_idx`` and then takes
``interval[0]`` -- the first *image* on broadcast indices, the interval's start on a scalar.

So :func:`call_fn` decides per function object, once (:func:`how_to_call`): it evaluates the function
both ways -- broadcast, and per scalar under nested ``torch.vmap`` exactly as FlexAttention does -- on a
probe grid (every batch row and head, the first, last and a few middle queries and keys). Only a function
that succeeds broadcast and gives the same shape-checked values there is called broadcast from then on;
every other one is called per scalar (vmap), which is FlexAttention's own evaluation. A function that
fails both ways, or returns something that is not a bool (mask) or floating-point (bias) tensor of the
tile's shape, raises a ``ValueError`` that names it and what it returned, with the user's exception
chained.

The probe is a spot check, not a proof: a function that agrees with its scalar meaning on the probe grid
and disagrees elsewhere would be evaluated wrongly. Functions built from elementwise tensor operations
and indexing of captured tensors by the index tensors agree everywhere.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor

from ..checks import broadcastable, is_tracing
from .dense import index_grid, to_bias
from .functions import check_callable, check_signature, fn_name

__all__ = [
    "DeadRows",
    "attn_mask",
    "call_fn",
    "evaluate_fn",
    "how_to_call",
    "open_dead_rows",
    "probe_fn",
]

Index = tuple[Tensor, Tensor, Tensor, Tensor]

_MODES: weakref.WeakKeyDictionary[object, bool] = weakref.WeakKeyDictionary()
"""Per function object: ``True`` = called broadcast, ``False`` = called per scalar under vmap."""


def _per_scalar(fn: Callable[..., object]) -> Callable[..., object]:
    """``fn`` vmapped over 1-D b, h, q_idx, kv_idx vectors -> a (B, H, n, w) result, one call per point
    (FlexAttention's ``_vmap_for_bhqkv``: kv innermost, b outermost)."""
    out = fn
    for dims in ((None, None, None, 0), (None, None, 0, None), (None, 0, None, None), (0, None, None, None)):
        out = torch.vmap(out, in_dims=dims, out_dims=0)
    return out


def _shape(idx: Index) -> tuple[int, int, int, int]:
    return tuple(torch.broadcast_shapes(*(i.shape for i in idx)))  # type: ignore[return-value]


def _checked(out: object, fn: object, kind: str, shape: tuple[int, int, int, int]) -> Tensor:
    """What a ``kind`` ("mask" or "bias") function returned for a tile of ``shape``, as a 4-D tensor; a
    ``ValueError`` naming the function and what it returned if it is not a bool (mask) or floating-point
    (bias) tensor broadcasting to ``shape``."""
    name = fn_name(fn)
    if not isinstance(out, Tensor):
        raise ValueError(
            f"the {kind} function {name!r} must return a torch.Tensor, got {type(out).__name__} ({out!r:.60}); "
            f"build it from the index tensors with elementwise ops, e.g. `kv_idx <= q_idx`"
        )
    if kind == "mask" and out.dtype != torch.bool:
        raise ValueError(
            f"the mask function {name!r} must return a bool tensor (True = may attend), got dtype "
            f"{out.dtype}; return a comparison (e.g. `x != 0`), or pass a float result as bias="
        )
    if kind == "bias" and not out.is_floating_point():
        raise ValueError(
            f"the bias function {name!r} must return a floating-point tensor (added to the scores), got "
            f"dtype {out.dtype}; convert with `.float()`, or pass a bool result as mask="
        )
    if not broadcastable(tuple(out.shape), shape):
        raise ValueError(
            f"the {kind} function {name!r} returned shape {tuple(out.shape)} for index tensors that "
            f"broadcast to {shape}; it must be elementwise in (b, h, q_idx, kv_idx) -- one value per point, e.g. "
            f"`t[b, h, q_idx, kv_idx]` rather than `t`"
        )
    return out.reshape((1,) * (4 - out.dim()) + tuple(out.shape))


def _scalar_call(fn: Callable[..., object], kind: str, idx: Index) -> Tensor:
    """``fn`` on every point of the tile ``idx``, per scalar (FlexAttention's meaning): (B, H, n, w)."""
    shape = _shape(idx)
    vectors = [i.reshape(-1) for i in idx]  # (B,), (H,), (n,), (w,)
    try:
        out = _per_scalar(fn)(*vectors)
    except Exception as err:
        try:  # one point, no vmap: a function that returns a non-tensor or a wrong dtype is named for it
            point, ran = fn(*(v[0] for v in vectors)), True
        except Exception:
            point, ran = None, False
        if ran:
            _checked(point, fn, kind, ())
        raise ValueError(
            f"the {kind} function {fn_name(fn)!r} failed when called as FlexAttention calls it (0-d int "
            f"index tensors b, h, q_idx, kv_idx under torch.vmap) on the tile {shape}: "
            f"{type(err).__name__}: {err}"
        ) from err
    return _checked(out, fn, kind, shape)


def _probe_index(target: tuple[int, int, int, int], device: torch.device | str | None) -> Index:
    """Every batch row and head, and at most 6 queries and keys: the first two, the middle, the last two."""
    b, h, lq, lk = target

    def few(n: int) -> Tensor:
        return torch.tensor(sorted({0, 1, n // 2, n - 2, n - 1} & set(range(n))), device=device)

    return (
        torch.arange(b, device=device).view(b, 1, 1, 1),  # (B, 1, 1, 1)
        torch.arange(h, device=device).view(1, h, 1, 1),  # (1, H, 1, 1)
        few(lq).view(1, 1, -1, 1),  # (1, 1, n, 1)
        few(lk).view(1, 1, 1, -1),  # (1, 1, 1, w)
    )


def how_to_call(
    fn: Callable[..., object], kind: str, target: tuple[int, int, int, int], device: torch.device | str | None
) -> bool:
    """Whether ``fn`` may be called on broadcast index tensors (``True``) or must be called per scalar
    under vmap (``False``), decided on a probe grid of ``target`` the first time this function object is
    seen (see the module docstring); raises the ``ValueError`` of a function that fails per scalar."""
    check_callable(fn, kind)
    try:
        return _MODES[fn]
    except (KeyError, TypeError):  # not seen yet, or not weak-referenceable (then probed every call)
        pass
    check_signature(fn, kind)
    if 0 in target:  # no point to probe, and none to evaluate: call_fn never calls it (an empty tile)
        return True
    idx = _probe_index(target, device)
    try:
        scalar = _scalar_call(fn, kind, idx)  # FlexAttention's meaning, or a ValueError naming the function
    except ValueError as err:
        if not _vmap_cannot_index(err):
            raise
        # torch before 2.9: vmap reads a 0-d index tensor with .item() (``table[h]``, ``pad[b, kv_idx]``), so
        # no function that indexes a captured tensor runs per scalar there, FlexAttention's own included;
        # the broadcast call is the one meaning such a function has on that torch
        try:
            _checked(fn(*idx), fn, kind, _shape(idx))
        except Exception:
            raise err from err.__cause__  # it fails broadcast too: the per-scalar failure names it
        scalar = None
    same = True if scalar is None else _broadcast_agrees(fn, kind, idx, scalar)
    try:
        _MODES[fn] = same
    except TypeError:
        pass
    return same


def _vmap_cannot_index(err: ValueError) -> bool:
    cause = err.__cause__
    return isinstance(cause, RuntimeError) and "vmap" in str(cause) and ".item()" in str(cause)


def _broadcast_agrees(fn: Callable[..., object], kind: str, idx: Index, scalar: Tensor) -> bool:
    """Whether ``fn`` on broadcast index tensors gives its per-scalar values on the probe grid."""
    try:
        broad = _checked(fn(*idx), fn, kind, _shape(idx))
        return bool((broad.expand(scalar.shape) == scalar).all()) or (
            kind == "bias" and torch.allclose(broad.expand(scalar.shape), scalar, equal_nan=True)
        )
    except Exception:  # fails on broadcast index tensors: it is called per scalar
        return False


def call_fn(fn: Callable[..., object], kind: str, idx: Index, broadcast: bool | None = None) -> Tensor:
    """A ``kind`` ("mask" or "bias") function on the tile of index tensors ``idx`` (broadcastable to
    (B, H, n, w)), with FlexAttention's meaning: (B|1, H|1, n|1, w|1) bool or float.

    ``broadcast``: how to call it (:func:`how_to_call`); ``None`` = as decided for this function before,
    or per scalar if it was never probed. Errors are ``ValueError`` naming the function, chaining its own.

    A tile with no point (a length, B or H of 0) has nothing for the function to say: it is not called, and
    the result is an empty bool (mask) or float (bias) tensor of the tile's shape. Called on empty index
    tensors, a function written for FlexAttention's 0-d indices (``table[kv_idx][1]``) would index the
    wrong dimension, and no probe can say how it means to be called with no point to probe.
    """
    shape = _shape(idx)
    if 0 in shape:
        dtype = torch.bool if kind == "mask" else torch.get_default_dtype()
        return torch.zeros(shape, dtype=dtype, device=idx[0].device)  # (B|1, H|1, n|1, w|1), no entry
    if broadcast is None:
        try:
            broadcast = _MODES.get(fn, False)
        except TypeError:
            broadcast = False
    if not broadcast:
        return _scalar_call(fn, kind, idx)
    points = max(CHUNK, shape[2] * shape[3] >> 8)  # of one call: at most 256 calls, none under CHUNK points
    rows = max(1, points // shape[3])  # queries of one call: its temporaries stay small
    if rows >= shape[2] or idx[2].shape[2] == 1 or is_tracing():  # traced: one call, shapes kept symbolic
        return _broadcast_call(fn, kind, idx, shape)
    first = _broadcast_call(fn, kind, _rows(idx, 0, rows), (*shape[:2], rows, shape[3]))
    if first.shape[2] == 1:  # the result does not vary along the queries: one call says it all
        return _broadcast_call(fn, kind, idx, shape)
    out = first.new_empty(*first.shape[:2], shape[2], first.shape[3])  # (B|1, H|1, n, w|1)
    out[:, :, :rows] = first
    step = max(1, points // (first.numel() // rows))  # per batch row and head, if the result has them
    for r0 in range(rows, shape[2], step):
        r1 = min(shape[2], r0 + step)
        out[:, :, r0:r1] = _broadcast_call(fn, kind, _rows(idx, r0, r1), (*shape[:2], r1 - r0, shape[3]))
    return out


CHUNK = 1 << 14
"""Fewest (query, key) points of one broadcast call on a tile that has more: it is called in chunks of whole
query rows, at most 256 of them, so the function's own temporaries (an int64 ``q_idx - kv_idx``, its
``abs``) stay small -- 128 KiB each on a 256 x 256 tile, where called whole they were 512 KiB, more than the
rest of a sliding window's blocked call beside its output (and placed by the allocator on fresh pages);
2 MiB on the 2**26-point grid of a dense evaluation, where they were 512 MiB. A window mask evaluated densely
at 4,096 and 8,192 (H = 4) took 0.37x and 0.29x the whole call's time, an ALiBi-like bias 0.80x and 0.61x
(Zen 1, benchmarks/results/window_memory_zen1.md): the chunks stay in cache."""


def _rows(idx: Index, r0: int, r1: int) -> Index:
    """The index tensors of queries r0:r1 of the tile ``idx``."""
    return idx[0], idx[1], idx[2][:, :, r0:r1], idx[3]


def _broadcast_call(
    fn: Callable[..., object], kind: str, idx: Index, shape: tuple[int, int, int, int]
) -> Tensor:
    """``fn`` called once on the broadcast index tensors ``idx`` of a tile of ``shape``, checked."""
    try:
        out = fn(*idx)
    except Exception as err:
        raise ValueError(
            f"the {kind} function {fn_name(fn)!r} failed on the index tensors of the tile {shape}: "
            f"{type(err).__name__}: {err}"
        ) from err
    return _checked(out, fn, kind, shape)


def probe_fn(
    fn: object, target: tuple[int, int, int, int], kind: str, device: torch.device | str | None
) -> bool:
    """Check ``fn`` is a ``kind`` function that works on ``target`` (a clear error before any kernel runs)
    and decide how it is called; costs a probe grid of B*H*36 points, never (Lq, Lk)."""
    return how_to_call(fn, kind, target, device)  # type: ignore[arg-type]


def evaluate_fn(
    fn: Callable[..., object],
    target: tuple[int, int, int, int],
    kind: str,
    device: torch.device | str | None = None,
) -> Tensor:
    """A mask or bias function evaluated on the full grid: (B|1, H|1, Lq|1, Lk|1) bool or float.

    ``kind`` is "mask" or "bias" (what the result is checked to be). This builds (Lq, Lk) entries;
    backends do it only at lengths where that is acceptable (see :func:`materialize`).
    """
    broadcast = how_to_call(fn, kind, target, device)
    return call_fn(fn, kind, index_grid(target, device), broadcast)


class DeadRows(NamedTuple):
    """``keep`` and ``bias`` with the query rows that allow no key re-opened (so a kernel never sees an all
    ``-inf`` row and gradients stay finite), and ``row_ok`` (B|1, H|1, n|1, 1), ``False`` on those rows
    (their output is multiplied by it -> 0), or ``None`` when every row allows a key."""

    keep: Tensor | None
    bias: Tensor | None
    row_ok: Tensor | None


def open_dead_rows(keep: Tensor | None, bias: Tensor | None, *, always: bool = False) -> DeadRows:
    """The one treatment of rows with no allowed key: a row is dead when ``keep`` forbids, or ``bias``
    puts ``-inf`` on, every key. Those rows are re-opened (``keep`` True, ``bias`` 0) and reported in
    ``row_ok``. ``row_ok`` is ``None`` if no row is dead, checked on the host unless tracing (``always``:
    keep the ``row_ok`` tensor, no host sync)."""
    if keep is None and bias is None:
        return DeadRows(None, None, None)
    allowed = keep
    if bias is not None:
        finite = ~torch.isneginf(bias)
        allowed = finite if allowed is None else allowed & finite
    assert allowed is not None
    row_ok = allowed.any(dim=-1, keepdim=True)  # (B|1, H|1, n|1, 1)
    if not always and not is_tracing() and allowed.device.type == "cpu" and bool(row_ok.all()):
        return DeadRows(keep, bias, None)  # the common case: nothing to patch
    if keep is not None:
        keep = keep | ~row_ok
    if bias is not None:
        bias = bias.masked_fill(~row_ok, 0.0)
    return DeadRows(keep, bias, row_ok)


def attn_mask(keep: Tensor | None, bias: Tensor | None, dtype: torch.dtype | None = None) -> Tensor | None:
    """``keep`` and ``bias`` as one ``attn_mask`` for a fused kernel: the bias (or 0) where kept, ``-inf``
    elsewhere; the bool ``keep`` itself when there is no bias and no ``dtype`` asks for a float mask."""
    if keep is None:
        return bias
    if bias is None:
        return keep if dtype is None else to_bias(keep, dtype)
    return bias.masked_fill(~keep, float("-inf"))
