"""The functional core: :func:`attention` (fast, dispatching) and :func:`attention_reference` (the oracle).

Dimensions: B batch, H query heads, Hkv key/value heads (H % Hkv == 0; Hkv = 1 is multi-query
attention), Lq query length, Lk key length, Dk query/key head dim, Dv value head dim.

Mask convention (see :mod:`multihead.masks`): bool ``mask`` True = may attend; float ``bias`` added
to the scores; ``valid_lens`` (B,) or (B, Lq) hides keys ``j >= valid_len``; ``causal`` is bottom-right
aligned; ``segment_ids`` keep packed sequences apart; masks and biases may be functions of
(b, h, q_idx, kv_idx); all combine with AND; a query row with no allowed key gets output 0 and weights 0.
Order of operations: scale -> softcap -> + bias -> masks -> softmax (sinks in the denominator).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from . import backends as _backends
from . import masks as _masks
from .checks import check_dropout, check_flag, check_scale, check_softcap, is_tracing
from .masks.blocks import from_flex, is_flex_block_mask
from .options import AttentionOptions, AttentionOutput, options_of, output_and_weights

__all__ = [
    "AttentionOptions",
    "AttentionOutput",
    "attention",
    "attention_reference",
    "attention_with",
    "check_sinks",
    "explain_backends",
    "output_and_weights",
    "prepare",
    "reference_with",
    "unmasked_attention",
]


def check_qkv(q: Tensor, k: Tensor, v: Tensor) -> None:
    """Validate q (B, H, Lq, Dk), k (B, Hkv, Lk, Dk), v (B, Hkv, Lk, Dv) with H % Hkv == 0."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(
                f"{name} must be 4-D (B, H, L, D), got shape {tuple(t.shape)}; split heads first, e.g. "
                f"x.view(B, L, H, D).transpose(1, 2), or use multihead.MultiHeadAttention on (B, L, E) inputs"
            )
        if not t.is_floating_point():
            raise TypeError(
                f"{name} must be a floating-point tensor, got dtype {t.dtype}; use {name}.float()"
            )
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(
            f"q, k and v must share one dtype, got q {q.dtype}, k {k.dtype}, v {v.dtype}; "
            f"convert with k.to(q.dtype), v.to(q.dtype)"
        )
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k and v must be on one device, got {q.device}, {k.device}, {v.device}")
    (b, h, _, dk), (bk, hkv, lk, dk2), (bv, hv, lv, _) = q.shape, k.shape, v.shape
    if not (b == bk == bv):
        raise ValueError(
            f"q, k, v must share the batch size B, got {b}, {bk}, {bv} (shapes q {tuple(q.shape)}, "
            f"k {tuple(k.shape)}, v {tuple(v.shape)})"
        )
    if hkv != hv or lk != lv:
        raise ValueError(
            f"k (B, Hkv, Lk, Dk) and v (B, Hkv, Lk, Dv) must agree on Hkv and Lk, got k {tuple(k.shape)} "
            f"and v {tuple(v.shape)}"
        )
    if dk != dk2:
        raise ValueError(f"q and k must share the head dim Dk, got q {tuple(q.shape)} and k {tuple(k.shape)}")
    if hkv == 0 or h % hkv:
        raise ValueError(
            f"query heads H={h} must be a multiple of key/value heads Hkv={hkv} (grouped-query attention); "
            f"got q {tuple(q.shape)} and k {tuple(k.shape)}"
        )


def check_sinks(sinks: Tensor | None, q: Tensor) -> Tensor | None:
    """``sinks`` (H,) float on q's device, returned in q's dtype (the cast keeps its gradient), or None."""
    if sinks is None:
        return None
    h = q.shape[1]
    if not isinstance(sinks, Tensor):
        raise TypeError(
            f"sinks must be a float torch.Tensor of shape (H,) = ({h},), got {type(sinks).__name__}"
        )
    if not sinks.is_floating_point():
        raise TypeError(
            f"sinks must be a floating-point tensor (one logit per head), got dtype {sinks.dtype}"
        )
    if tuple(sinks.shape) != (h,):
        raise ValueError(
            f"sinks must have shape (H,) = ({h},), one logit per query head, got {tuple(sinks.shape)}"
        )
    if sinks.device != q.device:
        raise ValueError(
            f"sinks is on {sinks.device} but q is on {q.device}; move it with sinks.to(q.device)"
        )
    cast = sinks.to(q.dtype)
    _check_sink_values(sinks, cast)
    return cast


def _check_sink_values(sinks: Tensor, cast: Tensor) -> None:
    """A sink is a finite logit, or -inf (that head has none). NaN, or +inf in q's dtype (a finite float32
    sink over float16's range included), would make every row of its head NaN on some backends and 0 on
    others: refused, by value, on the CPU only (on a GPU the check would make the host wait for the device
    on every call, as for ``valid_lens``), and not while tracing."""
    if cast.device.type != "cpu" or is_tracing() or not cast.numel():
        return
    # one reduction: NaN if one is NaN (max propagates it), +inf if one is +inf (2 us a call, not 5)
    top = cast.detach().max().item()
    if top == top and top != math.inf:
        return
    bad = torch.isnan(cast) | torch.isposinf(cast)  # (H,)
    i = int(bad.nonzero()[0, 0])
    got, held = sinks[i].item(), cast[i].item()
    as_held = "" if got == held or got != got else f" ({cast.dtype}, q's dtype, holds it as {held})"
    raise ValueError(
        f"sinks must be finite logits, or -inf for a head with no sink; got {got}{as_held} for head {i}. "
        f"A large finite logit (e.g. 1e4) makes a head attend to nearly nothing"
    )


def prepare(
    q: Tensor, k: Tensor, v: Tensor, options: AttentionOptions | None = None, /, **keywords: Any
) -> _backends.AttentionCall:
    """Validate an attention call and normalise its masks into an :class:`~multihead.core.backends.AttentionCall`.

    The options come as one :class:`AttentionOptions` record or as :func:`attention`'s keywords.
    """
    options = options_of(options, keywords)
    check_qkv(q, k, v)
    target = (q.shape[0], q.shape[1], q.shape[2], k.shape[2])  # (B, H, Lq, Lk)
    norm = _masks.normalize(
        target,
        mask=options.mask,
        bias=options.bias,
        valid_lens=options.valid_lens,
        causal=check_flag("causal", options.causal),
        segment_ids=options.segment_ids,
        dtype=q.dtype,
        device=q.device,
    )
    return _backends.AttentionCall(
        q,
        k,
        v,
        norm,
        check_scale(options.scale, q.shape[-1]),
        check_dropout(options.dropout),
        check_flag("return_weights", options.return_weights),
        softcap=check_softcap(options.softcap),
        sinks=check_sinks(options.sinks, q),
    )


def _nothing_to_mask(
    mask: object,
    bias: object,
    valid_lens: object,
    segment_ids: object,
    softcap: object,
    sinks: object,
    dropout: object,
    return_weights: object,
) -> bool:
    """Whether a call's options leave only ``causal`` and ``scale``: the unmasked lane may serve it."""
    return (
        mask is None
        and bias is None
        and valid_lens is None
        and segment_ids is None
        and softcap is None
        and sinks is None
        and return_weights is False
        and type(dropout) in (float, int)
        and dropout == 0
    )


def unmasked_attention(q: Tensor, k: Tensor, v: Tensor, causal: object, scale: float | None) -> Tensor | None:
    """The unmasked lane: an auto-routed call with nothing to mask (but ``causal`` where it is the kernel's
    own, Lq == Lk, or moot, Lq == 1), served by :func:`~multihead.core.backends.unmasked_route`'s backend
    without normalising masks or walking the registry -> (B, H, Lq, Dv); ``None`` where the call goes the
    whole way (no such backend, anything unusual in q, k, v -- whose errors the whole way raises -- or
    under ``torch.compile``).

    The same kernel call the whole way makes (tests/test_attention.py compares the two), for what a decode
    step or a plain encoder layer costs in Python: about a third of the whole way's.
    """
    if torch.compiler.is_compiling():
        return (
            None  # compiled code pays no Python per call; the whole way also keeps symbolic shapes symbolic
        )
    route = _backends.unmasked_route()
    if route is None or not (causal is False or causal is True) or not _plain_qkv(q, k, v):
        return None  # (a causal that is not a bool: the whole way checks it)
    lq, lk = q.shape[2], k.shape[2]
    if causal:
        if lq != lk and lq != 1:
            return None  # bottom-right alignment with Lq != Lk: a mask the kernel's flag does not make
        causal = lq > 1  # Lq == 1 sees every key
    return route(q, k, v, causal, check_scale(scale, q.shape[3]))


def _plain_qkv(q: Tensor, k: Tensor, v: Tensor) -> bool:
    """Whether q (B, H, Lq, Dk), k (B, Hkv, Lk, Dk), v (B, Hkv, Lk, Dv) pass :func:`check_qkv` with no length
    0 -- tested without formatting anything (False: the whole way checks and names the problem)."""
    if not (isinstance(q, Tensor) and isinstance(k, Tensor) and isinstance(v, Tensor)):
        return False
    try:
        b, h, lq, dk = q.shape
        bk, hkv, lk, dk2 = k.shape
        bv, hv, lv, _ = v.shape
    except ValueError:  # not 4-D
        return False
    return (
        b == bk == bv
        and hkv == hv > 0
        and lk == lv > 0
        and lq > 0
        and dk == dk2
        and h % hkv == 0
        and q.dtype == k.dtype == v.dtype
        and q.is_floating_point()
        and q.device == k.device == v.device
    )


def attention_with(
    q: Tensor, k: Tensor, v: Tensor, options: AttentionOptions, backend: str = "auto"
) -> Tensor | AttentionOutput:
    """:func:`attention` with its options as one record (what the layers below the public API pass)."""
    o = options
    if backend == "auto" and _nothing_to_mask(
        o.mask, o.bias, o.valid_lens, o.segment_ids, o.softcap, o.sinks, o.dropout, o.return_weights
    ):
        out = unmasked_attention(q, k, v, o.causal, o.scale)
        if out is not None:
            return out
    return _whole_way(q, k, v, options, backend)


def _whole_way(
    q: Tensor, k: Tensor, v: Tensor, options: AttentionOptions, backend: str
) -> Tensor | AttentionOutput:
    """Validate, normalise the masks, pick the backend and run it (the unmasked lane already declined or
    did not apply)."""
    call = prepare(q, k, v, options)
    if not isinstance(backend, str):
        raise TypeError(f"backend must be a str ('auto', {', '.join(map(repr, _backends.available()))})")
    run = _backends.select(call, backend)  # a named backend refuses as it would at any size
    out, weights = _empty_answer(call) if 0 in call.q.shape[:3] + call.k.shape[2:3] else run(call)
    if call.return_weights:
        assert weights is not None
        return AttentionOutput(out, weights)
    return out


def _empty_answer(call: _backends.AttentionCall) -> tuple[Tensor, Tensor]:
    """The answer to a call with no (query, key) pair (B, H, Lq or Lk of 0), for every backend alike: output
    (B, H, Lq, Dv) of zeros (a row with no key gives 0) and weights (B, H, Lq, Lk), with no entry.

    Both come out of q @ k^T @ v over the empty dimension, so they hold q's dtype, are joined to the autograd
    graph of q, k and v, and of the sinks and a dense bias (a sum over none of their entries is added), so a
    backward gives each a zero gradient, and read no value of them (NaN or -inf included). No mask or bias
    function is called: an empty tile has nothing for it to say (see
    :func:`multihead.core.masks.evaluate.call_fn`).
    """
    q, k, v = call.q, call.k, call.v
    b, h, lq, dk = q.shape
    hkv, lk, dv = k.shape[1], k.shape[2], v.shape[3]
    scores = torch.matmul(q.reshape(b, hkv, h // hkv * lq, dk), k.transpose(-2, -1))  # (B, Hkv, G*Lq, Lk)
    out = torch.matmul(scores, v)  # (B, Hkv, G*Lq, Dv): a sum over no key, or no row at all
    out, weights = out.reshape(b, h, lq, dv), scores.reshape(b, h, lq, lk)  # (B, H, Lq, Dv), (B, H, Lq, Lk)
    for extra in (call.sinks, call.masks.bias):
        if extra is not None and extra.requires_grad:
            none = extra.narrow(-1, 0, 0).sum().to(out.dtype)  # 0, with a zero gradient for every entry
            out, weights = out + none, weights + none
    return out, weights


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    mask: Tensor | _masks.MaskFn | None = None,
    bias: Tensor | _masks.BiasFn | None = None,
    valid_lens: Tensor | None = None,
    causal: bool = False,
    segment_ids: Tensor | tuple[Tensor, Tensor] | None = None,
    softcap: float | None = None,
    sinks: Tensor | None = None,
    scale: float | None = None,
    dropout: float = 0.0,
    return_weights: bool = False,
    backend: str = "auto",
) -> Tensor | AttentionOutput:
    """Scaled dot-product attention over heads, with every mask kind, GQA/MQA and a choice of backend.

    Args:
        q: (B, H, Lq, Dk) queries.
        k: (B, Hkv, Lk, Dk) keys; H % Hkv == 0 (Hkv < H is grouped-query, Hkv == 1 multi-query).
        v: (B, Hkv, Lk, Dv) values; Dv may differ from Dk.
        mask: bool, True = may attend, broadcastable to (B, H, Lq, Lk). E.g. (Lq, Lk) = (2, 3)::

                1 1 0
                1 1 1

            Or a function ``fn(b, h, q_idx, kv_idx) -> bool tensor`` called with broadcastable int64
            index tensors b (B, 1, 1, 1), h (1, H, 1, 1), q_idx (1, 1, Lq, 1), kv_idx (1, 1, 1, Lk) (or
            blocks of them): a FlexAttention ``mask_mod``; see :mod:`multihead.masks` (``causal_fn``,
            ``sliding_window_fn``, ...). Backends that can skip blocks never build it densely.
        bias: float, added to the scores, broadcastable to (B, H, Lq, Lk) (ALiBi, relative positions,
            ``-inf`` entries forbid keys); or a function ``fn(b, h, q_idx, kv_idx) -> float tensor``.
        valid_lens: int (B,) or (B, Lq): keys at index >= valid_len are masked (d2l).
        causal: query i sees keys j <= i + (Lk - Lq) (bottom-right aligned).
        segment_ids: int (B, L) for self-attention, or a pair (q_ids (B, Lq), kv_ids (B, Lk)): packed
            sequences; a query sees only keys with its own id (with ``causal``: causal within each
            sequence). Negative ids are padding: never attended; such queries output 0.
            ids = [[0, 0, 1, 1]] with causal::

                1 0 0 0
                1 1 0 0
                0 0 1 0
                0 0 1 1

        softcap: ``None`` or c > 0: scores -> c * tanh(scores / c) (Gemma 2's logit soft-capping).
        sinks: ``None`` or float (H,): a per-head logit that joins every row's softmax denominator and
            carries no value (gpt-oss's attention sinks); gradients flow to it. Returned weights are over
            the real keys and sum to less than 1. A sink is finite, or ``-inf`` (that head has none); NaN or
            ``+inf`` (in q's dtype) raises ``ValueError`` on the CPU.
        scale: score scale, default 1/sqrt(Dk).
        dropout: probability of dropping attention weights; applied only when > 0 (pass 0 in eval).
        return_weights: also return the per-head weights (B, H, Lq, Lk), before dropout.
        backend: ``"auto"`` (the first registered backend that can serve the call: flex on CUDA for
            masks, the fused SDPA kernel, ..., ``"math"``), or a backend's name (``"sdpa"``, ``"math"``,
            ...); every backend gives the same answer, and a named one that cannot serve says why.

    The order of operations (one, on every backend): scale -> softcap -> + bias -> masks (mask, mask
    functions, valid_lens, causal, segments: AND) -> softmax (with the sink in the denominator) -> a
    query row with no allowed key gives 0 (with sinks too).

    Returns:
        (B, H, Lq, Dv) output, or ``AttentionOutput(output, weights)`` with ``return_weights=True``.
        A query row with no allowed key has output 0 and weights 0 (finite gradients), on every backend.

    Equals ``softmax(softcap(q @ k^T * scale) + bias, masked) @ v`` with K/V repeated H // Hkv times;
    see :func:`attention_reference`.
    """
    if backend == "auto" and _nothing_to_mask(
        mask, bias, valid_lens, segment_ids, softcap, sinks, dropout, return_weights
    ):
        out = unmasked_attention(q, k, v, causal, scale)
        if out is not None:
            return out
    options = (
        AttentionOptions(  # the ten keywords above, as one record (not locals(): dynamo < 2.9 refuses it)
            mask=mask,
            bias=bias,
            valid_lens=valid_lens,
            causal=causal,
            segment_ids=segment_ids,
            softcap=softcap,
            sinks=sinks,
            scale=scale,
            dropout=dropout,
            return_weights=return_weights,
        )
    )
    return _whole_way(q, k, v, options, backend)  # the lane was tried above


def explain_backends(q: Tensor, k: Tensor, v: Tensor, **kwargs: object) -> dict[str, list[str]]:
    """For the call ``attention(q, k, v, **kwargs)``: each backend and why it cannot serve it ([] = it can)."""
    kwargs.pop("backend", None)
    return _backends.explain(prepare(q, k, v, **kwargs))


def attention_reference(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    mask: Tensor | _masks.MaskFn | None = None,
    bias: Tensor | _masks.BiasFn | None = None,
    valid_lens: Tensor | None = None,
    causal: bool = False,
    segment_ids: Tensor | tuple[Tensor, Tensor] | None = None,
    softcap: float | None = None,
    sinks: Tensor | None = None,
    scale: float | None = None,
    dropout: float = 0.0,
    return_weights: bool = False,
) -> Tensor | AttentionOutput:
    """Plain, readable attention: the oracle every fast path is tested against.

    Same arguments and results as :func:`attention` (without ``backend``). It repeats K/V for grouped
    heads, evaluates mask/bias functions and segment ids on the full (B, H, Lq, Lk) grid, materialises
    the whole mask, and applies softmax directly (a sink is one more column of the softmax that is
    dropped afterwards); nothing clever.
    """
    options = (
        AttentionOptions(  # the ten keywords above, as one record (not locals(): dynamo < 2.9 refuses it)
            mask=mask,
            bias=bias,
            valid_lens=valid_lens,
            causal=causal,
            segment_ids=segment_ids,
            softcap=softcap,
            sinks=sinks,
            scale=scale,
            dropout=dropout,
            return_weights=return_weights,
        )
    )
    return reference_with(q, k, v, options)


Visit = Callable[[str, Tensor], Tensor]
"""``visit(point, tensor) -> tensor``: called by :func:`reference_with` at ``"scores"`` and ``"pattern"``; what it
returns replaces the tensor for everything downstream (return the tensor itself to only read it)."""


def reference_with(
    q: Tensor, k: Tensor, v: Tensor, options: AttentionOptions, visit: Visit | None = None
) -> Tensor | AttentionOutput:
    """:func:`attention_reference` with its options as one record.

    ``visit`` (the inspection seam's explicit path, :mod:`multihead.lens`): called with
    ``("scores", (B, H, Lq, Lk))`` -- the logits after scale, softcap and bias, ``-inf`` where a mask forbids
    the key (a row with no allowed key is all ``-inf``) -- and then with ``("pattern", (B, H, Lq, Lk))``, the
    softmax weights before dropout; each returned tensor replaces the one given. Keys whose edited score is
    ``-inf`` are not attended, and a row with none left gives 0, exactly as for masks.
    """
    mask, bias, valid_lens, causal = options.mask, options.bias, options.valid_lens, options.causal
    segment_ids, softcap, sinks, scale = options.segment_ids, options.softcap, options.sinks, options.scale
    dropout, return_weights = options.dropout, options.return_weights
    check_qkv(q, k, v)
    b, h, lq, dk = q.shape
    hkv, lk = k.shape[1], k.shape[2]
    target = (b, h, lq, lk)
    scale = check_scale(scale, dk)
    dropout = check_dropout(dropout)
    softcap = check_softcap(softcap)
    sinks = check_sinks(sinks, q)
    causal, return_weights = check_flag("causal", causal), check_flag("return_weights", return_weights)

    allowed = torch.ones(target, dtype=torch.bool, device=q.device)  # (B, H, Lq, Lk)
    if is_flex_block_mask(mask):  # its blocks and mask_mod, as flex_attention reads them
        mask = from_flex(mask, target)
    if callable(mask) and not isinstance(mask, Tensor):
        allowed = allowed & _masks.evaluate_fn(mask, target, "mask", q.device)
    elif mask is not None:
        allowed = allowed & _masks.check_mask(mask, target, device=q.device)
    if valid_lens is not None:
        _masks.check_valid_lens(valid_lens, b, lq, q.device)
        allowed = allowed & _masks.from_valid_lens(valid_lens.to(q.device), lk, lq)
    if causal:
        allowed = allowed & _masks.causal(lq, lk, device=q.device)
    if segment_ids is not None:
        q_ids, kv_ids = _masks.check_segment_ids(segment_ids, b, lq, lk, q.device)
        allowed = allowed & _masks.segment_mask(q_ids, kv_ids)
    if callable(bias) and not isinstance(bias, Tensor):
        bias = _masks.evaluate_fn(bias, target, "bias", q.device).to(q.dtype)
    elif bias is not None:
        bias = _masks.check_bias(bias, target, q.dtype, q.device)
    if bias is not None:
        allowed = allowed & ~torch.isneginf(bias)

    k = k.repeat_interleave(h // hkv, dim=1)  # (B, H, Lk, Dk)
    v = v.repeat_interleave(h // hkv, dim=1)  # (B, H, Lk, Dv)
    # what no allowed (query, key) pair reads is never read, whatever it holds (NaN, Inf): the keys hidden
    # from every query of a head, the queries that may see no key
    hidden = ~allowed.any(dim=2).unsqueeze(-1)  # (B, H, Lk, 1)
    k, v = k.masked_fill(hidden, 0.0), v.masked_fill(hidden, 0.0)
    q = q.masked_fill(~allowed.any(dim=-1, keepdim=True), 0.0)  # (B, H, Lq, Dk)
    scores = torch.matmul(q, k.transpose(-2, -1)) * scale  # (B, H, Lq, Lk)
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    if bias is not None:
        scores = scores + bias
    scores = scores.masked_fill(~allowed, float("-inf"))
    if visit is not None:
        scores = visit("scores", scores)  # (B, H, Lq, Lk)
        allowed = scores != float("-inf")  # an edit may open or close keys
    row_ok = allowed.any(dim=-1, keepdim=True)  # (B, H, Lq, 1)
    scores = scores.masked_fill(~row_ok, 0.0)  # a dead row: finite scores, zeroed below
    if sinks is None:
        weights = torch.softmax(scores, dim=-1)  # (B, H, Lq, Lk)
    else:
        # a dead row's sink is 0 as its scores are (its weights are zeroed below): a head with no sink (-inf)
        # would otherwise make a row of no keys all -inf, NaN in softmax's backward
        sink = sinks.view(1, h, 1, 1).expand(b, h, lq, 1).masked_fill(~row_ok, 0.0)  # (B, H, Lq, 1)
        weights = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :lk]  # (B, H, Lq, Lk)
    weights = weights * row_ok
    if visit is not None:
        weights = visit("pattern", weights)  # (B, H, Lq, Lk)
    dropped = torch.nn.functional.dropout(weights, p=dropout) if dropout > 0 else weights
    out = torch.matmul(dropped, v)  # (B, H, Lq, Dv)
    return AttentionOutput(out, weights) if return_weights else out
