"""The fast paths (sdpa, math, flex, the fused module) against attention_reference, and their memory.

Dimensions: B batch, H heads, Hkv kv heads, Lq/Lk lengths, D head dim, E embed dim.
Rule (flash-attention's): in float64 a fast path matches the reference tightly; in float32 its error
against a float64 reference is at most 2x the float32 reference's own error (``multihead.testing.allowed_error``).
"""

from __future__ import annotations

import warnings
from functools import partial

import pytest
import torch
import torch.nn.functional as F
from attention_cases import make_qkv, mask_kwargs
from torch.utils._python_dispatch import TorchDispatchMode

import multihead as mh
from multihead.core import backends
from multihead.core.attention import explain_backends, output_and_weights, prepare
from multihead.core.backends._common import FUSED_CPU_TAKES_GROUPS
from multihead.core.backends.flex import FlexBackend
from multihead.testing import allowed_error, compare_to_reference

pytestmark = pytest.mark.numerics  # compares with float64: tests/cpu_kernels.py


def _qkv(b, h, hkv, lq, lk, d, dtype, seed=0):
    return make_qkv(b, h, hkv, lq, lk, d, d, dtype, seed)


def _masks(kind, b, h, lq, lk):
    return mask_kwargs(kind, b, h, lq, lk, bias_dtype=torch.float64)


def _as(kwargs, dtype):
    return {
        k: (v.to(dtype) if torch.is_tensor(v) and v.is_floating_point() else v) for k, v in kwargs.items()
    }


def _check(fast, ref64, ref32=None):
    """float64: tight; in a working dtype, the one 2x rule: :func:`multihead.testing.allowed_error`."""
    if ref32 is None:
        torch.testing.assert_close(fast, ref64, rtol=1e-10, atol=1e-10)
        return
    own = (ref32.double() - ref64).abs().max().item()
    err = (fast.double() - ref64).abs().max().item()
    assert err <= allowed_error(own, fast.dtype), f"fast path error {err:.3g} > 2x reference error {own:.3g}"


def _check_against_reference(fn, q, k, v, dtypes=(torch.float64, torch.float32), **kw):
    """``fn(q, k, v, **kw)`` vs attention_reference (:func:`multihead.testing.compare_to_reference`): in
    float64 within 1e-10, in float32 the 2x rule; outputs, and weights when ``return_weights``."""
    for dtype in dtypes:
        rep = compare_to_reference(fn, *(t.to(dtype) for t in (q, k, v)), **_as(kw, dtype))
        if dtype == torch.float64:
            assert rep.fast <= 1e-10 and (rep.fast_weights or 0.0) <= 1e-10, rep
        assert rep.ok, rep


_FLEX_EAGER = FlexBackend(compiled=False)


def _flex_eager(q, k, v, **kw):
    """The flex backend with FlexAttention's eager path: its mask/bias plumbing, run on CPU."""
    call = prepare(q, k, v, **kw)
    assert list(_FLEX_EAGER.why_not(call)) == [], "a case flex refuses is not a flex case"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return _FLEX_EAGER(call)[0]


MASK_KINDS = ["none", "causal", "mask", "bias", "valid_lens", "window+causal"]
HEADS = {"mha": (4, 4), "gqa": (4, 2), "mqa": (4, 1)}
SHAPES = {"L1": (2, 1, 1, 8), "L9-D59": (2, 9, 9, 59), "Lq5-Lk17": (1, 5, 17, 16)}  # (B, Lq, Lk, D)


def _flex_serves(kind, shape):
    """Whether the flex backend serves a call: only with a mask or bias to skip blocks by. Plain and
    causal calls with Lq == Lk have neither (sdpa's native kernels serve them); causal with Lq != Lk is
    a bottom-right mask, which flex does serve."""
    _, lq, lk, _ = shape
    return kind not in ("none", "causal") or (kind == "causal" and lq != lk)


# sdpa and math over every other mask kind are test_functional.py's grid; here: flex (in float32, a
# dtype it serves), and the one mask kind that grid lacks, for sdpa and math
BACKEND_CASES = [
    pytest.param(backend, heads, kind, shape, id=f"{backend}-{shape_id}-{heads}-{kind}")
    for backend in ("sdpa", "math", "flex-eager")
    for shape_id, shape in SHAPES.items()
    for heads in HEADS
    for kind in MASK_KINDS
    if (_flex_serves(kind, shape) if backend == "flex-eager" else kind == "window+causal")
]


@pytest.mark.parametrize(("backend", "heads", "kind", "shape"), BACKEND_CASES)
def test_backend_matches_reference(backend, heads, kind, shape):
    b, lq, lk, d = shape
    h, hkv = HEADS[heads]
    q, k, v = _qkv(b, h, hkv, lq, lk, d, torch.float64)
    fn = _flex_eager if backend == "flex-eager" else partial(mh.attention, backend=backend)
    dtypes = (torch.float32,) if backend == "flex-eager" else (torch.float64, torch.float32)
    _check_against_reference(fn, q, k, v, dtypes=dtypes, **_masks(kind, b, h, lq, lk))


@pytest.mark.parametrize("kind", MASK_KINDS)
@pytest.mark.parametrize("shape", list(SHAPES))
def test_flex_refuses_exactly_the_calls_it_is_not_generated_for(kind, shape):
    """The flex cases left out of the grid above are the calls flex refuses, with the reason."""
    b, lq, lk, d = SHAPES[shape]
    call = prepare(*_qkv(b, 4, 2, lq, lk, d, torch.float32), **_masks(kind, b, 4, lq, lk))
    reasons = list(_FLEX_EAGER.why_not(call))
    assert (reasons == []) == _flex_serves(kind, SHAPES[shape]), reasons
    if reasons:
        assert any("no mask or bias" in r for r in reasons), reasons


@pytest.mark.parametrize("kind", ["none", "causal", "bias", "valid_lens"])
@pytest.mark.parametrize("heads", [(4, 4), (4, 2)], ids=["mha", "gqa"])
def test_weights_path_one_pass_matches_reference(heads, kind):
    h, hkv = heads
    q, k, v = _qkv(2, h, hkv, 7, 7, 12, torch.float64)
    _check_against_reference(mh.attention, q, k, v, return_weights=True, **_masks(kind, 2, h, 7, 7))


@pytest.mark.parametrize("backend", ["sdpa", "math"])
@pytest.mark.parametrize("heads", [(4, 4), (4, 2)], ids=["mha", "gqa"])
@pytest.mark.parametrize("causal", [False, True])
def test_backend_gradients_match_reference(backend, heads, causal):
    h, hkv = heads
    ins = [t.requires_grad_() for t in _qkv(2, h, hkv, 11, 11, 8, torch.float64)]
    mh.attention(*ins, causal=causal, backend=backend).square().sum().backward()
    fast = [t.grad.clone() for t in ins]
    for t in ins:
        t.grad = None
    mh.attention_reference(*ins, causal=causal).square().sum().backward()
    for f, t in zip(fast, ins):
        _check(f, t.grad)


def test_auto_picks_fused_kernels_and_explains():
    q, k, v = _qkv(1, 4, 2, 6, 6, 8, torch.float32)
    assert backends.select(prepare(q, k, v, causal=True)).name == "sdpa"
    assert backends.select(prepare(q, k, v, return_weights=True)).name == "math"
    why = explain_backends(q, k, v, mask=mh.masks.sliding_window(6, window=2))
    assert why["sdpa"] == [] and any("serves calls with a mask function" in r for r in why["flex"])


# ----------------------------------------------------------------------------------------------
# The module: fused projections, no copies, exact against a plain composition
# ----------------------------------------------------------------------------------------------


def _module_reference(m, x, **kw):
    """Plain composition: three projections, attention_reference, output projection."""
    (wq, wk, wv), (bq, bk, bv) = m.proj_weights(), m.proj_biases()
    q = F.linear(x, wq, bq).unflatten(-1, (m.num_heads, -1)).transpose(1, 2)  # (B, H, L, Dk)
    k = F.linear(x, wk, bk).unflatten(-1, (m.kv_heads, -1)).transpose(1, 2)  # (B, Hkv, L, Dk)
    v = F.linear(x, wv, bv).unflatten(-1, (m.kv_heads, -1)).transpose(1, 2)  # (B, Hkv, L, Dv)
    res = mh.attention_reference(q, k, v, **kw)
    out, w = output_and_weights(res)
    y = m.out_proj(out.transpose(1, 2).flatten(2))  # (B, L, E)
    return y if w is None else (y, w)


@pytest.mark.parametrize("kv_heads", [4, 2, 1])
@pytest.mark.parametrize("kind", ["none", "causal", "valid_lens"])
def test_module_fast_path_matches_plain_composition(kv_heads, kind):
    torch.manual_seed(0)
    m = mh.MultiHeadAttention(32, 4, kv_heads=kv_heads, dtype=torch.float64).eval()
    x = torch.randn(2, 9, 32, dtype=torch.float64)
    kw = _masks(kind, 2, 4, 9, 9)
    _check(m(x, **kw), _module_reference(m, x, **kw))
    y, w = m(x, return_weights=True, **kw)
    ry, rw = _module_reference(m, x, return_weights=True, **kw)
    _check(y, ry)
    _check(w, rw)


def test_module_matches_torch_fast_path_in_float32():
    torch.manual_seed(0)
    t = torch.nn.MultiheadAttention(64, 8, batch_first=True).eval()
    m = mh.MultiHeadAttention.from_torch(t).eval()
    x = torch.randn(3, 10, 64)
    with torch.no_grad():
        ref64 = mh.MultiHeadAttention.from_torch(t.double())(x.double())
        _check(m(x), ref64, t.float()(x, x, x, need_weights=False)[0])


class _Recorder(TorchDispatchMode):
    """Records every aten op and the largest tensor each one returns."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        outs = out if isinstance(out, (tuple, list)) else (out,)
        size = max((o.numel() for o in outs if isinstance(o, torch.Tensor)), default=0)
        self.ops.append((func.__name__, size))
        return out


_COPIES = {"clone", "copy_", "contiguous", "repeat_interleave", "cat", "_to_copy"}


@pytest.mark.parametrize("kv_heads", [4, 2])
@pytest.mark.parametrize("causal", [False, True])
def test_self_attention_forward_makes_no_copies(kv_heads, causal):
    m = mh.MultiHeadAttention(64, 4, kv_heads=kv_heads).eval()
    x = torch.randn(2, 16, 64)
    with torch.no_grad(), _Recorder() as rec:
        m(x, causal=causal)
    names = [n.split(".")[0] for n, _ in rec.ops]
    assert names.count("addmm") == 2  # one fused QKV projection, one output projection
    # the fused kernel, not the math path
    assert "_scaled_dot_product_flash_attention_for_cpu" in names, names
    copies = [(n, size) for n, (_, size) in zip(names, rec.ops, strict=True) if n in _COPIES]
    if kv_heads < 4 and not FUSED_CPU_TAKES_GROUPS:
        # before torch 2.9 the fused CPU kernel takes no grouped K/V: K and V are repeated to H heads, one
        # copy each of (B, H, L, D) = 2 * 4 * 16 * 16 -- never a (query, key) sized tensor
        assert copies == [("clone", 2 * 4 * 16 * 16)] * 2, names
    else:
        assert not copies, names


# ----------------------------------------------------------------------------------------------
# Memory: no Lq x Lk tensor without weights, forward or backward
# ----------------------------------------------------------------------------------------------


def _largest(fn):
    with _Recorder() as rec:
        fn()
    return max(size for _, size in rec.ops)


@pytest.mark.parametrize("kv_heads", [4, 1])
def test_no_lq_by_lk_tensor_forward_or_backward(kv_heads):
    b, n, e, h = 1, 512, 32, 4
    lxl = n * n  # a single head's (Lq, Lk) scores; the (B, H, L, E) tensors are far smaller
    m = mh.MultiHeadAttention(e, h, kv_heads=kv_heads)
    x = torch.randn(b, n, e, requires_grad=True)
    assert _largest(lambda: m(x, causal=True).sum().backward()) < lxl
    with torch.no_grad():
        assert _largest(lambda: m(x)) < lxl
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
        m(x, valid_lens=torch.tensor([300]))
    assert max(saved) < lxl
    # the detector can fail: the weights path does hold (B, H, Lq, Lk)
    with torch.no_grad():
        assert _largest(lambda: m(x, return_weights=True)) >= b * h * lxl


@pytest.mark.parametrize("block_bytes", [1, 300])
@pytest.mark.parametrize("kind", MASK_KINDS)
@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (4, 1)], ids=["mha", "gqa", "mqa"])
def test_blocked_inference_path_matches_reference(heads, kind, block_bytes):
    """The math backend's cache-blocked path (inference, large scores) on tiny blocks: one (batch,
    kv head) pair per block, and a few kv heads per block."""
    from multihead.core.backends.math import MathBackend

    backend = MathBackend(block_bytes=block_bytes)
    h, hkv = heads
    q, k, v = _qkv(2, h, hkv, 6, 9 if kind != "causal" and "window" not in kind else 6, 8, torch.float64)
    lk = k.shape[2]
    kw = _masks(kind, 2, h, 6, lk)
    with torch.no_grad():
        assert backend.blocked(prepare(q, k, v, return_weights=True, **kw))  # the path under test is taken

        def blocked_attention(q, k, v, return_weights=False, **kw):
            out, w = backend(prepare(q, k, v, return_weights=return_weights, **kw))
            return mh.AttentionOutput(out, w) if return_weights else out

        _check_against_reference(blocked_attention, q, k, v, return_weights=True, **kw)


def test_blocked_path_is_not_taken_when_autograd_records():
    from multihead.core.backends.math import MathBackend

    backend = MathBackend(block_bytes=1)
    q, k, v = _qkv(1, 2, 2, 4, 4, 8, torch.float64)
    assert backend.blocked(prepare(q, k, v, return_weights=True))  # without autograd it would block
    q.requires_grad_(True)
    assert not backend.blocked(prepare(q, k, v, return_weights=True))
    out, _ = backend(prepare(q, k, v))
    (g,) = torch.autograd.grad(out.sum(), q)
    (g_ref,) = torch.autograd.grad(mh.attention_reference(q, k, v).sum(), q)
    torch.testing.assert_close(g, g_ref)
