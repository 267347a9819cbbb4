"""The contenders: for each (name, level) a builder that turns a case into a zero-argument step.

Dimensions: B batch, L sequence length (the cached length when decoding), E embed_dim, H query heads,
Hkv key/value heads, D = E // H head dim.

A :class:`Step` is one call (forward, or forward + backward in ``"train"`` mode) with its inputs held by
the closure, plus an optional untimed ``prepare`` the harness runs before each timed call (a decoding
step puts its cache back to the case's length there). Contenders (:data:`CONTENDERS`):

* ``multihead``: :class:`multihead.MultiHeadAttention` (module), :func:`multihead.attention`
  (attention), or one decoding step with a :class:`multihead.KVCache` (decode);
* ``torch``: ``torch.nn.MultiheadAttention`` (its native fast path in eval under no grad);
* ``naive``: the seed notebooks' attention (three ``Linear``s, matmul, softmax, matmul);
* ``keras``: ``keras.layers.MultiHeadAttention`` on the torch backend (optional);
* ``sdpa``: ``torch.nn.functional.scaled_dot_product_attention`` (attention; a mask case: with the mask
  as a dense bool tensor), in one SDPA backend where the case's ``sdpa_backend`` names one; at module
  level the same fused QKV and output projections as the module around it;
* ``flex``: ``torch.compile(flex_attention)`` with the mask case's BlockMask built once (or, with
  ``mask_form="rebuilt"``, on every call);
* ``graphed``: the same decoding steps on a ``KVCache(fixed_shape=True)``, compiled with
  ``mode="reduce-overhead"`` (a CUDA graph on a GPU);
* ``bare``: the bare work of a decoding step: QKV projection of the new token, its keys/values written
  into one preallocated buffer, fused attention over the buffer, output projection;
* ``ring``: :func:`multihead.distributed.ring_attention` (needs a process group: the case runs in its
  own process through :func:`multihead.distributed.launch`);
* a ragged batch (``case.lengths``), attention on projected heads, three ways: ``packed`` (one row,
  :func:`multihead.attention` with ``segment_ids``), ``sequences`` (:func:`multihead.attention` on each
  sequence in turn) and ``padded`` (the batch padded to its longest sequence, ``valid_lens``).
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Callable
from dataclasses import replace
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..core.attention import attention
from ..core.masks import sliding_window_fn
from ..nn.attention import MultiHeadAttention, merge_heads, split_heads
from ..nn.cache import KVCache
from .cases import Case
from .masks import KINDS, mask_of

__all__ = [
    "CONTENDERS",
    "Contender",
    "NaiveMHA",
    "Step",
    "attention_inputs",
    "build",
    "matmul_step",
    "naive_attention",
    "window_function",
]


class Step(NamedTuple):
    """``run()``: one timed call. ``prepare()``: untimed, before every call (None: nothing to do).
    ``output()``: the call's forward output (B, H, Lq, Dv) under no grad, on the inputs of
    :func:`attention_inputs`, which :mod:`multihead.bench.peers` compares with the float64 reference before
    the step is timed (None: the contender's output is not attention's, e.g. a module's)."""

    run: Callable[[], object]
    prepare: Callable[[], None] | None = None
    output: Callable[[], Tensor] | None = None


class Contender(NamedTuple):
    """How to build a contender's step for a case, and whether it holds the (B, H, Lq, Lk) scores."""

    build: Callable[[Case, torch.device], Step]
    holds_scores: Callable[[Case, torch.device], bool]


def build(name: str, case: Case, device: torch.device) -> Step:
    """The step of contender ``name`` on ``case`` (raises ``ValueError`` for an unknown pair)."""
    contender = CONTENDERS.get((name, case.level))
    if contender is None:
        known = sorted(n for n, level in CONTENDERS if level == case.level)
        raise ValueError(f"no contender {name!r} at level {case.level!r}; known there: {known}")
    return contender.build(case, device)


def matmul_step(device: torch.device, n: int, dtype: str = "float32") -> Step:
    """The yardstick: an (n, n) @ (n, n) matmul in ``dtype``, ``2*n**3`` FLOPs."""
    a, b = (torch.randn(n, n, device=device, dtype=getattr(torch, dtype)) for _ in range(2))
    return Step(lambda: a @ b)


# ----------------------------------------------------------------------------------------------
# Shared pieces
# ----------------------------------------------------------------------------------------------


def _factory(case: Case, device: torch.device) -> dict[str, object]:
    return {"device": device, "dtype": getattr(torch, case.dtype)}


def _first(out: object) -> Tensor:
    return out[0] if isinstance(out, tuple) else out  # type: ignore[return-value]


def _step(fn: Callable[[], object], case: Case, grads: list[Tensor], *, attends: bool = False) -> Step:
    """``fn`` under no grad, or (``"train"``) forward + backward of the output's sum. ``attends``: ``fn``
    returns attention's output (or an (output, weights) pair) on :func:`attention_inputs`: the step's
    ``output`` is its forward under no grad."""

    def forward() -> object:
        with torch.no_grad():
            return fn()

    output = (lambda: _first(forward())) if attends else None
    if case.mode != "train":
        return Step(forward, output=output)

    def train() -> None:
        for t in grads:
            t.grad = None
        _first(fn()).float().sum().backward()

    return Step(train, output=output)


def _module_input(case: Case, device: torch.device) -> Tensor:
    torch.manual_seed(0)
    return torch.randn(
        case.batch,
        case.length,
        case.embed_dim,
        **_factory(case, device),  # type: ignore[arg-type]
        requires_grad=case.mode == "train",
    )  # fmt: skip  (B, L, E)


def attention_inputs(case: Case, device: torch.device) -> tuple[Tensor, Tensor, Tensor]:
    """The inputs every attention-level contender of ``case`` gets: q (B, H, L, D), k and v (B, Hkv, L, D),
    drawn after ``torch.manual_seed(0)`` (requiring grad in ``"train"`` mode)."""
    return _qkv(case, device)


def _qkv(case: Case, device: torch.device) -> tuple[Tensor, Tensor, Tensor]:
    """q (B, H, L, D), k and v (B, Hkv, L, D), requiring grad in ``"train"`` mode."""
    b, n, h = case.batch, case.length, case.heads
    hkv, d = case.kv_heads or h, case.embed_dim // h
    torch.manual_seed(0)
    grad, fac = case.mode == "train", _factory(case, device)
    q = torch.randn(b, h, n, d, **fac, requires_grad=grad)  # type: ignore[arg-type]
    k, v = (torch.randn(b, hkv, n, d, **fac, requires_grad=grad) for _ in range(2))  # type: ignore[arg-type]
    return q, k, v


def _module(mod: nn.Module, case: Case, x: Tensor, fn: Callable[[], object]) -> Step:
    mod.train(case.mode in ("train", "forward-train-module"))
    return _step(fn, case, [x, *mod.parameters()])


def _never(case: Case, device: torch.device) -> bool:
    return False


def _always(case: Case, device: torch.device) -> bool:
    return True


def _when_weights(case: Case, device: torch.device) -> bool:
    return case.mode == "weights"


# ----------------------------------------------------------------------------------------------
# Module level: input (B, L, E)
# ----------------------------------------------------------------------------------------------


def _ours_module(case: Case, device: torch.device) -> Step:
    x = _module_input(case, device)
    mod = MultiHeadAttention(case.embed_dim, case.heads, kv_heads=case.kv_heads, **_factory(case, device))  # type: ignore[arg-type]
    weights = case.mode == "weights"

    def forward() -> object:
        with _sdpa_backend(case):  # torch's choice of SDPA kernel, or the one the case names
            return mod(x, causal=case.causal, return_weights=weights)

    return _module(mod, case, x, forward)


def _torch_module(case: Case, device: torch.device) -> Step:
    if case.kv_heads not in (None, case.heads):
        raise RuntimeError("torch.nn.MultiheadAttention has no grouped-query heads")
    x = _module_input(case, device)
    n = case.length
    mod = nn.MultiheadAttention(case.embed_dim, case.heads, batch_first=True, **_factory(case, device))  # type: ignore[arg-type]
    mask = torch.ones(n, n, dtype=torch.bool, device=device).triu(1) if case.causal else None  # True = masked
    need = case.mode == "weights"
    return _module(
        mod, case, x, lambda: mod(x, x, x, need_weights=need, attn_mask=mask, is_causal=case.causal)[0]
    )


def _torch_holds_scores(case: Case, device: torch.device) -> bool:
    """torch's native fast path (eval, no grad, CPU) and its weights path hold (B, H, L, L)."""
    return case.mode == "weights" or (case.mode == "forward" and device.type == "cpu")


class NaiveMHA(nn.Module):
    """The seed notebooks' multi-head attention: three projections, matmul, softmax, matmul."""

    def __init__(self, e: int, h: int, **factory: object) -> None:
        super().__init__()
        self.h = h
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(e, e, **factory) for _ in range(4))  # type: ignore[arg-type]

    def forward(self, x: Tensor, causal: bool = False) -> Tensor:
        q, k, v = (split_heads(w(x), self.h) for w in (self.wq, self.wk, self.wv))  # (B, H, L, D)
        return self.wo(merge_heads(naive_attention(q, k, v, causal)))  # (B, L, E)


def naive_attention(q: Tensor, k: Tensor, v: Tensor, causal: bool) -> Tensor:
    """softmax(q k^T / sqrt(D)) v with repeated K/V: q (B, H, L, D), k/v (B, Hkv, L, D) -> (B, H, L, D)."""
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)  # (B, H, L, D)
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])  # (B, H, L, L)
    if causal:
        n = q.shape[2]
        scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1), -math.inf)
    return torch.softmax(scores, dim=-1) @ v  # (B, H, L, D)


def _naive_module(case: Case, device: torch.device) -> Step:
    x = _module_input(case, device)
    mod = NaiveMHA(case.embed_dim, case.heads, **_factory(case, device))
    return _module(mod, case, x, lambda: mod(x, case.causal))


def _keras_module(case: Case, device: torch.device) -> Step:
    os.environ.setdefault("KERAS_BACKEND", "torch")
    import keras  # noqa: PLC0415  (optional peer: only this contender needs it)

    if keras.backend.backend() != "torch":
        raise RuntimeError(f"keras runs on the {keras.backend.backend()} backend, not torch")
    x = _module_input(case, device)
    layer = keras.layers.MultiHeadAttention(num_heads=case.heads, key_dim=case.embed_dim // case.heads)
    training, weights = case.mode == "train", case.mode == "weights"  # weights: the per-head scores too
    return _step(
        lambda: layer(x, x, use_causal_mask=case.causal, training=training, return_attention_scores=weights),
        case,
        [x],
    )


# ----------------------------------------------------------------------------------------------
# Attention level: q (B, H, L, D), k/v (B, Hkv, L, D)
# ----------------------------------------------------------------------------------------------


def window_function(w: int, form: str = "lambda") -> Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]:
    """A causal sliding window of ``w`` keys as a mask function: ``"library"`` is what users write with
    the library (:func:`multihead.masks.sliding_window_fn`, with a key range), ``"lambda"`` a plain
    function of the same rule, query i sees keys j > i - w (causal=True adds j <= i), with none."""
    if form == "library":
        return sliding_window_fn(w)
    return lambda b, h, q_idx, kv_idx: q_idx - kv_idx < w


def _ours_attention(case: Case, device: torch.device) -> Step:
    q, k, v = _qkv(case, device)
    if case.mask_form == "new ids":  # segment ids new on every call, as each training step's are
        ids = mask_of(case.mask, "segments", case.length, device)["segment_ids"]
        return _step(
            lambda: attention(q, k, v, segment_ids=ids.clone(), causal=True), case, [q, k, v], attends=True
        )  # type: ignore[union-attr]
    if case.mask:  # a mask case: the mask as the case's form gives it (lambda, library, segments, BlockMask)
        kw = mask_of(case.mask, case.mask_form, case.length, device)
        return _step(lambda: attention(q, k, v, **kw), case, [q, k, v], attends=True)  # type: ignore[arg-type]
    if case.window:  # a mask function: the call's cost follows the window, not L*L
        fn = window_function(case.window, case.window_form)
        return _step(lambda: attention(q, k, v, mask=fn, causal=case.causal), case, [q, k, v], attends=True)  # type: ignore[arg-type]
    return _step(lambda: attention(q, k, v, causal=case.causal), case, [q, k, v], attends=True)


def _ragged_inputs(case: Case, device: torch.device) -> list[tuple[Tensor, Tensor, Tensor]]:
    """q, k, v (1, H, n, D) of each sequence of the ragged batch (leaves requiring grad in train mode)."""
    return [_qkv(replace(case, batch=1, length=n, lengths=()), device) for n in case.lengths]


def _packed_attention(case: Case, device: torch.device) -> Step:
    """The sequences packed in one row (1, H, sum n, D), told apart by segment ids."""
    seqs = _ragged_inputs(case, device)
    grad = case.mode == "train"
    q, k, v = (torch.cat([s[i].detach() for s in seqs], dim=2).requires_grad_(grad) for i in range(3))
    n = torch.tensor(case.lengths, device=device)
    ids = torch.repeat_interleave(torch.arange(len(case.lengths), device=device), n)[None]  # (1, sum n)
    return _step(lambda: attention(q, k, v, segment_ids=ids, causal=case.causal), case, [q, k, v])  # type: ignore[call-arg]


def _sequences_attention(case: Case, device: torch.device) -> Step:
    """Each sequence on its own, one call after another (the cost packing should match)."""
    seqs = _ragged_inputs(case, device)

    def each() -> object:
        outs = [attention(q, k, v, causal=case.causal) for q, k, v in seqs]
        return torch.stack([o.sum() for o in outs]).sum() if case.mode == "train" else outs  # type: ignore[union-attr]

    return _step(each, case, [t for s in seqs for t in s])


def _padded_attention(case: Case, device: torch.device) -> Step:
    """The batch padded to its longest sequence, (N, H, max n, D), the padding hidden by valid_lens."""
    longest, lens = max(case.lengths), torch.tensor(case.lengths, device=device)
    seqs, grad = _ragged_inputs(case, device), case.mode == "train"
    q, k, v = (
        torch.stack(
            [F.pad(s[i].detach()[0], (0, 0, 0, longest - s[i].shape[2])) for s in seqs]
        ).requires_grad_(grad)
        for i in range(3)
    )  # (N, H, max n, D) each, zeros past every sequence's end
    return _step(lambda: attention(q, k, v, valid_lens=lens, causal=case.causal), case, [q, k, v])


def _plain_mask(case: Case, device: torch.device) -> Callable[..., Tensor] | None:
    """The case's mask as a plain mask_mod on ``device`` (its mask kind, or causal), ``None`` if unmasked."""
    if case.mask:
        return KINDS[case.mask].plain(case.length, device)  # type: ignore[no-any-return]
    if case.causal:  # bottom-right aligned, as mh.attention's causal (Lq == Lk here)
        return lambda b, h, q_idx, kv_idx: q_idx >= kv_idx
    return None


def _sdpa_backend(case: Case) -> contextlib.AbstractContextManager[object]:
    """``sdpa_kernel`` restricted to ``case.sdpa_backend`` ("flash", "efficient", "cudnn", "math"), or
    nothing: torch's own choice."""
    if case.sdpa_backend is None:
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: PLC0415

    names = {
        "flash": SDPBackend.FLASH_ATTENTION,
        "efficient": SDPBackend.EFFICIENT_ATTENTION,
        "cudnn": SDPBackend.CUDNN_ATTENTION,
        "math": SDPBackend.MATH,
    }
    return sdpa_kernel(names[case.sdpa_backend])


def _sdpa_call(case: Case, device: torch.device) -> Callable[[Tensor, Tensor, Tensor], Tensor]:
    """SDPA on q (B, H, L, D), k/v (B, Hkv, L, D) with the case's mask (dense bool, built once on the
    device) or ``is_causal``, in the case's SDPA backend."""
    dense = None
    if case.mask:  # the equivalent dense bool mask (L, L)
        fn, n = _plain_mask(case, device), case.length
        rows, cols = torch.arange(n, device=device).view(-1, 1), torch.arange(n, device=device).view(1, -1)
        dense = fn(torch.zeros((), device=device), torch.zeros((), device=device), rows, cols)  # type: ignore[misc]

    def call(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        with _sdpa_backend(case):
            return F.scaled_dot_product_attention(
                q, k, v, attn_mask=dense, is_causal=case.causal and dense is None,
                enable_gqa=k.shape[1] != q.shape[1],
            )  # fmt: skip

    return call


def _sdpa_attention(case: Case, device: torch.device) -> Step:
    q, k, v = _qkv(case, device)
    call = _sdpa_call(case, device)
    call(q.detach(), k.detach(), v.detach())  # a backend that cannot serve the case raises here, not timed
    return _step(lambda: call(q, k, v), case, [q, k, v], attends=True)


def _sdpa_module(case: Case, device: torch.device) -> Step:
    """The module's work by hand: the same fused QKV and output projections around SDPA."""
    x = _module_input(case, device)
    mod = MultiHeadAttention(case.embed_dim, case.heads, kv_heads=case.kv_heads, **_factory(case, device))  # type: ignore[arg-type]
    h, hkv, d = mod.num_heads, mod.kv_heads, mod.head_dim
    sizes = [h * d, hkv * d, hkv * mod.v_head_dim]  # rows of q, k, v in in_proj
    call = _sdpa_call(case, device)

    def forward() -> Tensor:
        q, k, v = F.linear(x, mod.in_proj_weight, mod.in_proj_bias).split(sizes, dim=-1)  # (B, L, *)
        heads = call(split_heads(q, h), split_heads(k, hkv), split_heads(v, hkv))  # (B, H, L, D)
        return mod.out_proj(merge_heads(heads))  # (B, L, E)

    with torch.no_grad():
        forward()  # a backend that cannot serve the case raises here, not timed
    return _module(mod, case, x, forward)


def _flex_attention(case: Case, device: torch.device) -> Step:
    """``torch.compile(flex_attention)`` with the case's mask as a BlockMask, built once (``mask_form``
    "rebuilt": built again on every call, inside the timed call)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    q, k, v = _qkv(case, device)
    fn = _plain_mask(case, device)
    # a fresh compile budget for each case: past dynamo's recompile limit (8 mask_mods in one process)
    # flex_attention falls back to its eager form, which materialises (Lq, Lk) scores (23 GB at 16k: the
    # machine killed the whole `--only flex:` run) and would time the wrong peer
    torch._dynamo.reset()
    run = torch.compile(flex_attention, dynamic=False)
    n, gqa = case.length, k.shape[1] != q.shape[1]

    def blocks() -> object:
        return None if fn is None else create_block_mask(fn, None, None, n, n, device=device.type)

    built = blocks()
    if case.mask_form == "rebuilt":
        return _step(lambda: run(q, k, v, block_mask=blocks(), enable_gqa=gqa), case, [q, k, v], attends=True)
    return _step(lambda: run(q, k, v, block_mask=built, enable_gqa=gqa), case, [q, k, v], attends=True)


def _naive_attention(case: Case, device: torch.device) -> Step:
    q, k, v = _qkv(case, device)
    return _step(lambda: naive_attention(q, k, v, case.causal), case, [q, k, v], attends=True)


def _ring_attention(case: Case, device: torch.device) -> Step:
    from ..distributed import ring_attention  # noqa: PLC0415  (tools may use distributed; only this needs it)

    q, k, v = _qkv(case, device)
    return _step(lambda: ring_attention(q, k, v, causal=case.causal), case, [q, k, v], attends=True)


# ----------------------------------------------------------------------------------------------
# Decode level: one step of Lq new tokens (B, Lq, E) against L cached keys/values
# ----------------------------------------------------------------------------------------------


def _decode_inputs(case: Case, device: torch.device) -> tuple[MultiHeadAttention, Tensor, Tensor, Tensor]:
    """The module, the new tokens x (B, Lq, E) and the cached keys k0 / values v0 (B, Hkv, L, D)."""
    fac = _factory(case, device)
    torch.manual_seed(0)
    mod = MultiHeadAttention(case.embed_dim, case.heads, kv_heads=case.kv_heads, **fac).eval()  # type: ignore[arg-type]
    x = torch.randn(case.batch, case.lq, case.embed_dim, **fac)  # type: ignore[arg-type]  (B, Lq, E)
    shape = (case.batch, mod.kv_heads, case.length, mod.head_dim)
    k0, v0 = (torch.randn(shape, **fac) for _ in range(2))  # type: ignore[arg-type]  (B, Hkv, L, D)
    return mod, x, k0, v0


def _ours_decode(case: Case, device: torch.device) -> Step:
    """``case.steps`` calls ``mha(x, cache=cache, causal=True)``, the cache put back to L positions first."""
    mod, x, k0, v0 = _decode_inputs(case, device)
    cache = KVCache()

    def refill() -> None:
        if len(cache) != case.length:
            cache.reset()
            cache.update(k0, v0)  # (B, Hkv, L, D)

    def step() -> Tensor:
        with torch.no_grad():
            for _ in range(case.steps):
                out = mod(x, cache=cache, causal=case.causal)  # (B, Lq, E)
        return out

    return Step(step, refill)


def _graphed_decode(case: Case, device: torch.device) -> Step:
    """The same steps on a ``KVCache(fixed_shape=True)``, the step compiled with ``mode="reduce-overhead"``
    (on CUDA: recorded once in a CUDA graph and replayed for every token)."""
    mod, x, k0, v0 = _decode_inputs(case, device)
    cache = KVCache(max_len=case.length + case.steps * case.lq, fixed_shape=True)
    torch._dynamo.reset()
    run = torch.compile(lambda x_t: mod(x_t, cache=cache, causal=case.causal), mode="reduce-overhead")

    def refill() -> None:
        cache.reset()
        with torch.no_grad():
            cache.update(k0, v0)  # (B, Hkv, L, D) written at positions 0..L-1

    def step() -> Tensor:
        with torch.no_grad():
            for _ in range(case.steps):
                out = run(x)  # (B, Lq, E)
        return out

    return Step(step, refill)


def _bare_decode(case: Case, device: torch.device) -> Step:
    """The same steps' unavoidable work: the projections, a write into a buffer, fused attention."""
    mod, x, k0, v0 = _decode_inputs(case, device)
    n, lq, steps = case.length, case.lq, case.steps
    h, hkv = mod.num_heads, mod.kv_heads
    shape = (k0.shape[0], hkv, n + steps * lq, k0.shape[3])
    kbuf = torch.empty(shape, dtype=k0.dtype, device=device)  # (B, Hkv, L + steps*Lq, D)
    vbuf = torch.empty_like(kbuf)  # (B, Hkv, L + steps*Lq, D)
    kbuf[:, :, :n], vbuf[:, :, :n] = k0, v0
    w, bias = mod.in_proj_weight, mod.in_proj_bias
    sizes = [h * mod.head_dim, hkv * mod.head_dim, hkv * mod.v_head_dim]  # rows of q, k, v in in_proj
    causal = case.causal and lq > 1  # one new query sees every key: no mask to apply

    def step() -> Tensor:
        with torch.no_grad():
            for i in range(steps):
                end = n + (i + 1) * lq
                q, k, v = F.linear(x, w, bias).split(sizes, dim=-1)  # (B, Lq, H*D), (B, Lq, Hkv*D) x2
                kbuf[:, :, end - lq : end] = split_heads(k, hkv)  # (B, Hkv, Lq, D)
                vbuf[:, :, end - lq : end] = split_heads(v, hkv)  # (B, Hkv, Lq, D)
                heads = F.scaled_dot_product_attention(
                    split_heads(q, h),
                    kbuf[:, :, :end],
                    vbuf[:, :, :end],
                    is_causal=causal,
                    enable_gqa=h != hkv,
                )  # (B, H, Lq, D)
                out = mod.out_proj(merge_heads(heads))  # (B, Lq, E)
        return out

    return Step(step)


CONTENDERS: dict[tuple[str, str], Contender] = {
    ("multihead", "module"): Contender(_ours_module, _when_weights),
    ("torch", "module"): Contender(_torch_module, _torch_holds_scores),
    ("naive", "module"): Contender(_naive_module, _always),
    ("keras", "module"): Contender(_keras_module, _always),
    ("multihead", "attention"): Contender(_ours_attention, _when_weights),
    ("sdpa", "module"): Contender(_sdpa_module, _never),
    ("sdpa", "attention"): Contender(_sdpa_attention, _never),
    ("flex", "attention"): Contender(_flex_attention, _never),
    ("naive", "attention"): Contender(_naive_attention, _always),
    ("ring", "attention"): Contender(_ring_attention, _never),
    ("packed", "attention"): Contender(_packed_attention, _never),
    ("sequences", "attention"): Contender(_sequences_attention, _never),
    ("padded", "attention"): Contender(_padded_attention, _never),
    ("multihead", "decode"): Contender(_ours_decode, _never),
    ("bare", "decode"): Contender(_bare_decode, _never),
    ("graphed", "decode"): Contender(_graphed_decode, _never),
}
"""(contender name, case level) -> how to build its step; the names rows of a case refer to."""
