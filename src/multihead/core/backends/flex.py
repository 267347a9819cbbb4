"""The ``flex`` backend: FlexAttention on CUDA for masks, biases, softcap and sinks the fused SDPA kernels
cannot skip or express.

Everything that forbids keys becomes one ``mask_mod`` -- the AND of the dense mask (read by index), the
user's mask function, the segment-id rule and bottom-right causality -- from which ``create_block_mask``
builds a block mask, so whole blocks that a sliding window, a causal band, key padding or packed
sequences forbid are never computed; no dense (Lq, Lk) mask is built by this library. Packed documents
alone (with causality) get theirs read off the ids' tile ranges instead, without a pass over every pair.
Softcap, a dense bias and a bias function become one ``score_mod``. Sinks use the returned log-sum-exp: with
``lse`` over the real keys, ``out * sigmoid(lse - sink[h])`` is exactly the output with the sink in the
denominator. The kernel is compiled by ``torch.compile`` (Triton) on first use for each shape. On the CPU it serves
the calls :mod:`.flex_cpu` describes (a mask function alone, no autograd, float32: inductor's C++ kernel,
with a block mask from the function's tile structure), and auto routing leaves small or one-off calls to
``blocked``. ``compiled=False`` runs FlexAttention eagerly (forward only on CPU: for testing the plumbing).
It never returns weights.

Dimensions: B batch, H heads, Hkv kv heads, Lq/Lk lengths, Dk/Dv head dims.

Equals::

    out, lse = flex_attention(
        q, k, v,
        score_mod=lambda s, b, h, i, j: softcap * tanh(s / softcap) + bias[b, h, i, j] + bias_fn(b, h, i, j),
        block_mask=create_block_mask(
            lambda b, h, i, j: mask[b, h, i, j] & mask_fn(b, h, i, j) & (ids_q[b, i] == ids_k[b, j] >= 0)
            & (j <= i + Lk - Lq), B, H, Lq, Lk),
        scale=scale, enable_gqa=Hkv < H, return_lse=True)
    out = out * sigmoid(lse - sink[h])

with broadcast (size-1) mask/bias dimensions indexed at 0 and rows with no allowed key set to zero.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from ..checks import is_tracing
from ..masks import BiasFn, MaskFn, and_masks, causal_fn, segments_fn, tensor_fn
from ..masks.blocks import Recent, captured_versions, segment_tiles
from ._common import DENSE_LIMIT, call_needs_grad, zero_dead_rows
from .base import AttentionCall, Backend, Deferral
from .flex_cpu import CpuFlex

if TYPE_CHECKING:
    from ..masks import Normalized

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _flex_module() -> object | None:
    try:
        from torch.nn.attention import flex_attention
    except ImportError:  # torch < 2.5
        return None
    return flex_attention


@functools.cache
def _compiled_flex() -> Callable[..., Tensor]:
    flex = _flex_module()
    assert flex is not None
    return torch.compile(flex.flex_attention, dynamic=False)  # type: ignore[attr-defined]


def _run_flex(
    run: Callable[..., object], flex: object, want_lse: bool, **kwargs: object
) -> tuple[Tensor, Tensor | None]:
    """Call ``run`` (flex_attention, compiled or not) and return ``(out, lse or None)``."""
    if not want_lse:
        return run(**kwargs), None  # type: ignore[return-value]
    aux_request = getattr(flex, "AuxRequest", None)
    if aux_request is not None:  # torch >= 2.9
        out, aux = run(**kwargs, return_aux=aux_request(lse=True))  # type: ignore[misc]
        return out, aux.lse
    out, lse = run(**kwargs, return_lse=True)  # type: ignore[misc]
    return out, lse


class FlexBackend:
    name = "flex"
    serves_unmasked = False  # why_not refuses a call with nothing to mask: the fused sdpa kernels serve it

    def __init__(
        self, *, compiled: bool = True, cpu: CpuFlex | None = None, fallback: Backend | None = None
    ) -> None:
        self.compiled = compiled  # False: eager FlexAttention (slow, for testing the mask plumbing)
        self.cpu = CpuFlex() if cpu is None else cpu  # the CPU policy and its compiled kernels
        self.fallback = fallback  # serves a CPU call whose compile failed (the registry gives it blocked)

    def _on_cpu(self, call: AttentionCall) -> bool:
        return self.compiled and call.q.device.type == "cpu"

    def why_not(self, call: AttentionCall) -> Iterator[str]:
        q, m = call.q, call.masks
        if q.device.type not in ("cuda", "cpu") and self.compiled:
            yield f"flex runs on CUDA and the CPU; q is on {q.device.type}"
        if _flex_module() is None:
            yield f"torch {torch.__version__} has no torch.nn.attention.flex_attention (needs 2.5+)"
        if (
            m.mask is None
            and m.bias is None
            and not m.has_functions
            and call.softcap is None
            and call.sinks is None
        ):
            yield "no mask or bias (nor softcap or sinks) to serve: the fused sdpa kernels serve this call faster"
        if call.return_weights:
            yield "flex cannot return attention weights (use backend='math')"
        if call.dropout > 0:
            yield "flex has no attention dropout (use dropout=0.0 or backend='sdpa')"
        if q.dtype not in _DTYPES:
            yield f"flex supports dtypes {_DTYPES}, got {q.dtype}"
        if q.device.type == "cpu" and call_needs_grad(call):
            yield "FlexAttention has no backward on CPU (run under torch.no_grad() or use another backend)"
        if self._on_cpu(call):
            yield from self.cpu.why_not(call)

    def defers(self, call: AttentionCall) -> Deferral | None:
        """On the CPU, auto routing leaves small, one-off and unbounded calls to ``blocked``
        (:meth:`.flex_cpu.CpuFlex.defers`); on a GPU, calls of tensor masks alone to ``sdpa``
        (:func:`gpu_deferral`)."""
        return self.cpu.defers(call) if self._on_cpu(call) else gpu_deferral(call)

    def __call__(self, call: AttentionCall) -> tuple[Tensor, Tensor | None]:
        if self._on_cpu(call):
            fallback = self.fallback
            return self.cpu(call, None if fallback is None else lambda c: fallback(c)[0]), None
        flex = _flex_module()
        assert flex is not None
        q, k, v, m = call.q, call.k, call.v, call.masks
        b, h, lq, lk = q.shape[0], q.shape[1], q.shape[2], k.shape[2]
        per_b = per_h = m.mask_fn is not None  # a user function may read b and h
        if m.mask is not None:
            per_b, per_h = per_b or m.mask.shape[0] > 1, per_h or m.mask.shape[1] > 1
        per_b = per_b or m.segments is not None
        masked = m.mask is not None or m.mask_fn is not None or m.segments is not None or m.causal
        alone = m.mask_fn is not None and m.mask is None and m.segments is None and not m.causal
        block_mask = _as_given(m.mask_fn, b, h, lq, lk) if alone else None  # the user's own BlockMask
        if masked and block_mask is None:
            rows = (b if per_b else None, h if per_h else None, lq, lk)
            block_mask = _built_block_mask(flex, m, rows, q.device)
        score_mod = _score_mod(call.softcap, m.bias, m.bias_fn)
        kwargs = {
            "query": q,  # (B, H, Lq, Dk)
            "key": k,  # (B, Hkv, Lk, Dk)
            "value": v,  # (B, Hkv, Lk, Dv)
            "score_mod": score_mod,
            "block_mask": block_mask,
            "scale": call.scale,
            "enable_gqa": k.shape[1] != h,
        }
        want_lse = call.sinks is not None
        if not self.compiled:
            out, lse = _run_flex(flex.flex_attention, flex, want_lse, **kwargs)  # type: ignore[attr-defined]
        else:
            try:
                out, lse = _run_flex(_compiled_flex(), flex, want_lse, **kwargs)  # (B, H, Lq, Dv), (B, H, Lq)
            except Exception as err:
                # torch's compiler failed on this call: FlexAttention eagerly, with the same meaning
                if is_tracing() or not _is_compile_failure(err) or b * h * lq * lk > DENSE_LIMIT:
                    raise
                _warn_compile_failure(err, q, k)
                out, lse = _run_flex(flex.flex_attention, flex, want_lse, **kwargs)  # type: ignore[attr-defined]
        if call.sinks is not None:
            assert lse is not None
            sink = call.sinks.view(1, h, 1).to(lse.dtype)  # (1, H, 1)
            # a row with no key: out is 0 already, and lse - sink would be NaN for a head with no sink (-inf)
            gap = torch.where(torch.isneginf(lse), 0.0, lse - sink)  # (B, H, Lq)
            out = out * torch.sigmoid(gap).unsqueeze(-1).to(out.dtype)  # (B, H, Lq, Dv)
        return zero_dead_rows(out, m.row_ok), None


#: Block masks built by the last calls: (their sources, the call's rows) -> (sources kept alive, the
#: BlockMask). The layers of one forward pass, and the calls of a loop, pass the same mask function,
#: or segment ids: building the BlockMask evaluates the mask over every (query, key) pair
#: (about 30 ms at L = 16k on an H200, more than the attention), so it is built once for them.
_BUILT = Recent(16)


def _mask_parts(m: Normalized, lq: int, lk: int) -> list[MaskFn]:
    """The mask functions whose AND is the call's mask: the dense mask read by index, the user's function,
    the segment-id rule and bottom-right causality (those the call has)."""
    parts: list[MaskFn] = []
    if m.mask is not None:
        parts.append(tensor_fn(m.mask))
    if m.mask_fn is not None:
        parts.append(m.mask_fn)
    if m.segments is not None:
        parts.append(segments_fn(*m.segments))
    if m.causal:  # dense mode: Lq == Lk; function mode: any lengths; bottom-right either way
        parts.append(causal_fn(lq, lk))
    return parts


def _built_block_mask(flex: object, m: Normalized, rows: tuple, device: torch.device) -> object:
    """``create_block_mask`` of the call's mask (:func:`_mask_parts`) for ``rows`` (B|None, H|None, Lq,
    Lk), reused while its sources (the mask function and the tensors it captures, the segment ids, the dense
    mask: by identity and version) and the call's rows are the same; built every call under tracing, and
    when a dense mask tensor is part of it (normalisation makes a new one per call, and the cache would
    keep tensors of (Lq, Lk) alive). The mask functions are made only when the BlockMask is built: its
    ``mask_mod`` is what flex_attention evaluates (a reused one still holds the first call's functions)."""

    def build() -> object:
        both = and_masks(*_mask_parts(m, rows[2], rows[3]))

        def mask_mod(bi: Tensor, hi: Tensor, i: Tensor, j: Tensor) -> Tensor:
            return both(bi, hi, i, j)

        if m.segments is not None and m.mask is None and m.mask_fn is None:
            return _segments_block_mask(flex, m.segments, m.causal, mask_mod)
        return flex.create_block_mask(mask_mod, *rows, device=device)  # type: ignore[attr-defined]

    if is_tracing() or m.mask is not None:
        return build()
    sources = (m.mask_fn, *(m.segments or ()))
    key = (
        tuple(id(x) for x in sources),
        tuple(x._version for x in sources if isinstance(x, Tensor)),
        captured_versions(m.mask_fn) if m.mask_fn is not None else (),
        m.causal,
        rows,
        device,
    )
    return _BUILT.get(key, build, sources)


#: FlexAttention's default tile (queries x keys), the one ``create_block_mask`` builds.
FLEX_BLOCK = 128


def _segments_block_mask(
    flex: object, segments: tuple[Tensor, Tensor], causal: bool, mask_mod: MaskFn
) -> object:
    """The BlockMask of packed documents (and bottom-right causality), built from the ids' tile ranges
    (:func:`~multihead.core.masks.blocks.segment_tiles`) instead of evaluating ``mask_mod`` over every
    (query, key) pair: the same tables as ``create_block_mask`` for ids that never decrease along a row, in
    a few small operations with no host synchronisation -- new ids every training step cost no (Lq, Lk)
    pass."""
    q_ids, kv_ids = segments  # (B, Lq), (B, Lk)
    lq, lk = q_ids.shape[1], kv_ids.shape[1]
    partial, full = segment_tiles(q_ids, kv_ids, lk - lq if causal else None, FLEX_BLOCK, FLEX_BLOCK)

    def tables(t: Tensor) -> tuple[Tensor, Tensor]:
        """(B, nq, nk) tiles -> (B, 1, nq) counts and (B, 1, nq, nk) indices, the listed tiles first."""
        order = torch.argsort(t.to(torch.uint8), dim=-1, descending=True, stable=True)
        return t.sum(-1, dtype=torch.int32)[:, None], order.to(torch.int32)[:, None]

    return flex.BlockMask.from_kv_blocks(  # type: ignore[attr-defined]
        *tables(partial), *tables(full), BLOCK_SIZE=FLEX_BLOCK, mask_mod=mask_mod, seq_lengths=(lq, lk)
    )


def _as_given(mask_fn: object, b: int, h: int, lq: int, lk: int) -> object | None:
    """The FlexAttention ``BlockMask`` the user passed as ``mask=``, when it fits the call ((B|1, H|1) rows,
    (Lq, Lk) lengths; the caller checks it is the call's whole mask): flex_attention takes it as it is,
    without building another from its function."""
    source = getattr(mask_fn, "source", None)
    if source is None:
        return None
    mb, mh = source.kv_num_blocks.shape[:2]  # type: ignore[attr-defined]
    fits = tuple(int(n) for n in source.seq_lengths) == (lq, lk)  # type: ignore[attr-defined]
    return source if fits and mb in (1, b) and mh in (1, h) else None


#: Lq * Lk from which packed documents (segment ids) stay with flex on a GPU: there its block mask skips the
#: pairs between documents (at 16k on an H200: 0.10x SDPA with the dense mask); below, SDPA's dense mask
#: costs little and needs no compile.
SEGMENTS_ON_FLEX = 2048 * 2048


def gpu_deferral(call: AttentionCall) -> Deferral | None:
    """On a GPU, auto routing sends to ``sdpa`` the calls whose masks are tensors alone (a bool mask,
    ``valid_lens``, causality with Lq != Lk, a dense bias, sinks; packed documents below
    :data:`SEGMENTS_ON_FLEX`): SDPA's fused kernels take them as one dense mask, with nothing to compile.
    Flex keeps what only it serves without a dense grid: mask and bias functions (a BlockMask included),
    softcap, and long packed rows. Measured on an H200 (benchmarks/results/cuda.md): through compiled flex,
    such calls recompiled whenever their mask tensor was a new one, synchronised the host while doing it,
    and inductor failed to compile some grouped-query shapes."""
    m = call.masks
    if m.mask_fn is not None or m.bias_fn is not None or call.softcap is not None:
        return None
    if m.segments is not None and call.q.shape[2] * call.k.shape[2] >= SEGMENTS_ON_FLEX:
        return None
    return Deferral("sdpa", "tensor masks only: SDPA's fused kernels take them as a dense mask, no compile")


def _is_compile_failure(err: BaseException) -> bool:
    """Whether ``err`` came from torch's compiler stack (dynamo, inductor, Triton's autotuning)."""
    return any(
        c.__module__.startswith(("torch._dynamo", "torch._inductor", "triton")) for c in type(err).__mro__
    )


@functools.cache
def _warn_once(text: str) -> None:
    warnings.warn(text, RuntimeWarning, stacklevel=4)


def _warn_compile_failure(err: BaseException, q: Tensor, k: Tensor) -> None:
    first = str(err).strip().splitlines()[0][:200] if str(err).strip() else type(err).__name__
    _warn_once(
        f"multihead: torch.compile could not compile flex_attention for q {tuple(q.shape)} k {tuple(k.shape)} "
        f"{q.dtype} ({type(err).__name__}: {first}); FlexAttention runs eagerly for this call (same result, "
        f"more memory). backend='sdpa' or 'math' avoid the compiler."
    )


def _score_mod(
    softcap: float | None, bias: Tensor | None, bias_fn: BiasFn | None
) -> Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], Tensor] | None:
    """One ``score_mod``: softcap, then the dense bias and the bias function added (None if no part)."""
    if softcap is None and bias is None and bias_fn is None:
        return None
    add = None if bias is None else tensor_fn(bias)

    def score_mod(s: Tensor, bi: Tensor, hi: Tensor, i: Tensor, j: Tensor) -> Tensor:
        if softcap is not None:
            s = softcap * torch.tanh(s / softcap)
        if add is not None:
            s = s + add(bi, hi, i, j)
        if bias_fn is not None:
            s = s + bias_fn(bi, hi, i, j)
        return s

    return score_mod
