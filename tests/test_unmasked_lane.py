"""The unmasked lane: an auto-routed call with nothing to mask goes straight to the fused kernel.

It must give what the whole way (validate, normalise masks, walk the registry) gives, take autograd
along, leave every unusual call -- and every error message -- to the whole way, and step aside when a
user's backend is registered ahead of the kernel's.

Dimensions: B batch, H heads, Hkv kv heads, Lq/Lk lengths, D head dim.
"""

from __future__ import annotations

import importlib

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import multihead as mh
from multihead.core import backends
from multihead.core.backends import math as math_backend
from multihead.nn import seam
from multihead.testing import compare_to_reference

pytestmark = pytest.mark.numerics  # compares with float64: tests/cpu_kernels.py

core_attention = importlib.import_module("multihead.core.attention")


@pytest.fixture
def lane(monkeypatch):
    """Counts the calls the unmasked lane serves."""
    served = []
    real = backends.unmasked_route

    def spy():
        route = real()
        if route is None:
            return None

        def counted(*args):
            out = route(*args)
            served.append(out is not None)
            return out

        return counted

    monkeypatch.setattr(core_attention._backends, "unmasked_route", spy)
    return served


def _qkv(b, h, hkv, lq, lk, d=16, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, lq, d, generator=g).to(dtype)
    k = torch.randn(b, hkv, lk, d, generator=g).to(dtype)
    v = torch.randn(b, hkv, lk, d, generator=g).to(dtype)
    return q, k, v


SHAPES = [  # (B, H, Hkv, Lq, Lk, causal)
    (2, 4, 4, 7, 7, False),
    (2, 4, 4, 7, 7, True),
    (1, 8, 2, 1, 33, True),  # a decode step: Lq = 1 sees every key
    (1, 8, 2, 1, 33, False),
    (3, 6, 3, 5, 9, False),  # Lq != Lk, grouped
    (1, 4, 1, 1, 1, True),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize(("b", "h", "hkv", "lq", "lk", "causal"), SHAPES)
def test_the_lane_serves_plain_calls_within_the_2x_rule(lane, dtype, b, h, hkv, lq, lk, causal):
    q, k, v = _qkv(b, h, hkv, lq, lk, dtype=dtype)
    report = compare_to_reference(mh.attention, q, k, v, causal=causal, scale=0.3)
    assert lane == [True], "the lane did not serve the call (the reference runs do not use it)"
    assert report.ok, report


@pytest.mark.parametrize(("b", "h", "hkv", "lq", "lk", "causal"), SHAPES)
def test_the_lane_gives_what_the_whole_way_gives_forward_and_backward(lane, b, h, hkv, lq, lk, causal):
    q, k, v = _qkv(b, h, hkv, lq, lk)
    fast_in = [t.clone().requires_grad_() for t in (q, k, v)]
    whole_in = [t.clone().requires_grad_() for t in (q, k, v)]
    fast = mh.attention(*fast_in, causal=causal)
    assert lane == [True]
    whole = mh.attention(*whole_in, causal=causal, backend="sdpa")  # named: the whole way
    assert lane == [True]
    torch.testing.assert_close(fast, whole, rtol=1e-6, atol=1e-6)
    g = torch.randn_like(fast)
    fast.backward(g)
    whole.backward(g)
    for a, w in zip(fast_in, whole_in):
        torch.testing.assert_close(a.grad, w.grad, rtol=1e-5, atol=1e-6)


SHORT = [  # (B, H, Hkv, Lq, Lk, causal): many short rows, where the CPU's fused kernel is slow
    (16, 4, 4, 7, 7, True),
    (16, 4, 2, 5, 9, False),  # grouped, Lq != Lk
    (32, 4, 1, 12, 12, True),  # grouped, causal
    (8, 8, 8, 32, 32, False),  # the longest rows it takes
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(("b", "h", "hkv", "lq", "lk", "causal"), SHORT)
def test_many_short_rows_run_as_two_matmuls_and_match(lane, dtype, b, h, hkv, lq, lk, causal):
    """B*H >= 64 rows of <= 32 keys: math.short_attention (0.26x the fused kernel's time at the seed
    shape). Within the 2x rule, and forward and backward equal to the fused kernel itself."""
    q, k, v = _qkv(b, h, hkv, lq, lk, dtype=dtype)
    assert math_backend.serves_short(q, k, causal)
    report = compare_to_reference(mh.attention, q, k, v, causal=causal, scale=0.3)
    assert lane == [True] and report.ok, report
    ours_in = [t.clone().requires_grad_() for t in (q, k, v)]
    fused_in = [t.clone().requires_grad_() for t in (q, k, v)]
    ours = mh.attention(*ours_in, causal=causal, scale=0.3)
    fused = F.scaled_dot_product_attention(*fused_in, is_causal=causal, scale=0.3, enable_gqa=hkv < h)
    tol = {"rtol": 1e-4, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 1e-10, "atol": 1e-12}
    torch.testing.assert_close(ours, fused, **tol)
    g = torch.randn_like(ours)
    ours.backward(g)
    fused.backward(g)
    for a, w in zip(ours_in, fused_in, strict=True):
        torch.testing.assert_close(a.grad, w.grad, **tol)


@settings(max_examples=30, deadline=None)
@given(
    st.integers(1, 8),  # B
    st.sampled_from([(8, 8), (8, 2), (16, 1), (12, 4)]),  # (H, Hkv)
    st.integers(2, 12),  # Lq
    st.integers(1, 32),  # Lk
    st.booleans(),  # causal (only where Lq == Lk)
    st.sampled_from(["contiguous", "strided", "head-major"]),  # how the heads are stored
    st.integers(0, 2**31 - 1),
)
def test_short_rows_equal_the_reference_for_any_shape_they_serve(b, heads, lq, lk, causal, layout, seed):
    """Any call math.short_attention serves (B*H >= 64, 1..32 keys, Lq >= 2; causal with Lq == Lk; grouped
    heads; contiguous inputs, strided ones as the module's fused projection gives them, or head-major ones
    as its per-head projection gives them), forward and backward, against the float64 reference."""
    h, hkv = heads
    causal = causal and lq == lk
    if b * h < math_backend.MANY_HEADS:
        b = -(-math_backend.MANY_HEADS // h)
    g = torch.Generator().manual_seed(seed)
    if layout == "head-major":  # (heads, B, L, D) storage seen as (B, heads, L, D)
        q = torch.randn(h, b, lq, 8, generator=g, dtype=torch.float64).transpose(0, 1)
        k, v = (torch.randn(hkv, b, lk, 8, generator=g, dtype=torch.float64).transpose(0, 1) for _ in (0, 1))
        assert all(math_backend.head_major(t) for t in (q, k, v))
    elif layout == "strided":  # (B, L, heads*D) buffers split into heads: (B, heads, L, D) views with gaps
        q = torch.randn(b, lq, 2 * h * 8, generator=g, dtype=torch.float64)[..., : h * 8]
        kv = torch.randn(b, lk, 3 * hkv * 8, generator=g, dtype=torch.float64)
        q = q.view(b, lq, h, 8).transpose(1, 2)
        k, v = (kv[..., i * hkv * 8 : (i + 1) * hkv * 8].view(b, lk, hkv, 8).transpose(1, 2) for i in (0, 1))
    else:
        q, k, v = _qkv(b, h, hkv, lq, lk, d=8, dtype=torch.float64, seed=seed)
    assert math_backend.serves_short(q, k, causal)
    ins = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    ref_ins = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    got = math_backend.short_attention(*ins, causal, 0.35)
    want = mh.attention_reference(*ref_ins, causal=causal, scale=0.35)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    grad = torch.randn(got.shape, generator=g, dtype=torch.float64)
    got.backward(grad)
    want.backward(grad)
    for a, w in zip(ins, ref_ins, strict=True):
        torch.testing.assert_close(a.grad, w.grad, rtol=1e-10, atol=1e-12)
    with torch.no_grad():  # the in-place path
        again = math_backend.short_attention(q, k, v, causal, 0.35)
    torch.testing.assert_close(again, want.detach(), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize(
    ("shape", "causal", "dtype"),
    [
        ((8, 8, 8, 32, 33), False, torch.float32),  # 33 keys: the fused kernel
        ((7, 9, 9, 5, 5), False, torch.float32),  # 63 rows of heads
        ((64, 8, 8, 1, 5), False, torch.float32),  # a decode step: the fused kernel is faster at Lq = 1
        ((64, 8, 8, 3, 5), True, torch.float32),  # causal with Lq != Lk
        ((64, 8, 8, 5, 5), False, torch.bfloat16),
    ],
    ids=["33 keys", "63 heads", "Lq=1", "causal Lq!=Lk", "bf16"],
)
def test_short_rows_leave_the_rest_to_the_fused_kernel(shape, causal, dtype):
    b, h, hkv, lq, lk = shape
    q, k, _ = _qkv(b, h, hkv, lq, lk, dtype=dtype)
    assert not math_backend.serves_short(q, k, causal)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"causal": True},  # with Lq = 3 != Lk = 5: bottom-right, a mask the kernel's flag does not make
        {"mask": torch.ones(3, 5, dtype=torch.bool)},
        {"valid_lens": torch.tensor([4, 5])},
        {"dropout": 0.1},
        {"softcap": 5.0},
        {"sinks": torch.zeros(4)},
        {"return_weights": True},
        {"backend": "sdpa"},
        {"backend": "math"},
    ],
    ids=lambda kw: next(iter(kw)),
)
def test_everything_else_goes_the_whole_way(lane, kwargs):
    q, k, v = _qkv(2, 4, 2, 3, 5)
    out = mh.attention(q, k, v, **kwargs)
    assert lane == []
    if kwargs.get("dropout") or kwargs.get("return_weights"):
        return
    options = {n: x for n, x in kwargs.items() if n != "backend"}
    backend = kwargs.get("backend", "auto")
    report = compare_to_reference(
        lambda *a, **kw: mh.attention(*a, backend=backend, **kw), q, k, v, **options
    )
    assert report.ok and out.shape == (2, 4, 3, 16), report


@pytest.mark.parametrize(
    ("make", "error", "words"),
    [
        (lambda: (torch.randn(2, 3, 4), torch.randn(2, 3, 4), torch.randn(2, 3, 4)), ValueError, "4-D"),
        (
            lambda: (torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 4).double(), torch.randn(1, 2, 3, 4)),
            TypeError,
            "share one dtype",
        ),
        (
            lambda: (torch.randn(1, 3, 3, 4), torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 4)),
            ValueError,
            "H=3",
        ),
        (lambda: (torch.randn(1, 2, 3, 4), torch.randn(1, 2, 0, 4), torch.randn(1, 2, 0, 4)), None, None),
        (lambda: (torch.randn(64, 8, 5, 4), torch.randn(64, 8, 0, 4), torch.randn(64, 8, 0, 4)), None, None),
        (lambda: ([[1.0]], torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 4)), TypeError, "torch.Tensor"),
    ],
    ids=["3-D", "dtypes", "heads", "no keys", "no keys, many short rows", "a list"],
)
def test_bad_or_unusual_input_gets_the_whole_ways_answer(lane, make, error, words):
    q, k, v = make()
    if error is None:  # no keys: every row dead -> 0, as the whole way says
        assert mh.attention(q, k, v).abs().max() == 0
    else:
        with pytest.raises(error, match=words):
            mh.attention(q, k, v)
    assert lane == []


class _Plain:
    """A user backend that serves every call (output = q), with no word on unmasked calls."""

    name = "plain"

    def __init__(self):
        self.calls = 0

    def why_not(self, call):
        return ()

    def __call__(self, call):
        self.calls += 1
        return call.q, None


def test_a_user_backend_ahead_of_sdpa_takes_the_lane_away_until_it_leaves(registry):
    sdpa = registry.get("sdpa")
    assert registry.unmasked_route() == sdpa.unmasked  # flex said it never serves such a call
    plain = registry.register(_Plain(), before="sdpa")
    assert registry.unmasked_route() is None
    q, k, v = _qkv(1, 2, 2, 4, 4)
    assert mh.attention(q, k, v) is q and plain.calls == 1  # the user's backend, not the kernel
    registry.unregister("plain")
    assert registry.unmasked_route() == sdpa.unmasked
    assert mh.attention(q, k, v) is not q and plain.calls == 1


def test_a_dtype_the_kernel_does_not_serve_goes_the_whole_way(registry):
    route = registry.unmasked_route()
    q, k, v = (torch.randn(1, 2, 3, 4, dtype=torch.complex64) for _ in range(3))
    assert route(q, k, v, False, 0.5) is None


class _Fn:
    def __call__(self, q, k, v, **kw):
        return mh.attention(q, k, v, **kw)


class _WithClassFn(nn.Module):
    attention_fn = staticmethod(mh.attention)


class _WithProperty(nn.Module):
    @property
    def backend(self):
        return "math"


def test_the_seam_reads_a_modules_function_and_backend_wherever_they_live():
    plain = nn.Linear(2, 2)  # another library's module: neither
    assert seam.attention_fn_of(plain) is mh.attention and seam._read(plain, "backend", "auto") == "auto"
    own = mh.MultiHeadAttention(8, 2, attention_fn=_Fn())
    assert isinstance(seam.attention_fn_of(own), _Fn)  # an instance attribute
    assert seam.attention_fn_of(_WithClassFn()) is mh.attention  # a class attribute
    assert seam._read(_WithProperty(), "backend", "auto") == "math"  # a property
    holder = nn.Module()
    holder.attention_fn = nn.Identity()  # a submodule
    assert isinstance(seam.attention_fn_of(holder), nn.Identity)


class _Inspector(seam.Inspector):
    def __init__(self):
        self.seen = 0

    def on_heads(self, module, heads, weights):
        self.seen += 1
        return heads


def test_the_seams_unmasked_entry_steps_aside_whenever_attend_has_work():
    q, k, v = _qkv(1, 4, 2, 1, 9)
    plain = nn.Linear(2, 2)  # another library's module: default function and backend
    want = seam.attend(plain, q, k, v, causal=False, scale=0.5)[0]
    got = seam.attend_unmasked(plain, q, k, v, False, 0.5)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    with seam.inspecting(_Inspector()) as inspector:
        assert seam.attend_unmasked(plain, q, k, v, False, 0.5) is None  # an inspector must see the heads
        seam.attend(plain, q, k, v)
    assert inspector.seen == 1
    own = mh.MultiHeadAttention(8, 2, attention_fn=_Fn())
    assert seam.attend_unmasked(own, q, k, v, False, 0.5) is None  # the module's own function
    assert seam.attend_unmasked(_WithProperty(), q, k, v, False, 0.5) is None  # a named backend


@pytest.mark.parametrize("causal", [False, True])
def test_a_module_of_many_short_rows_equals_torchs(causal):
    """The module's strided q, k, v views (one fused projection) through the short-rows path: torch's own
    layer with the same weights, forward and backward, in float64."""
    torch.manual_seed(0)
    theirs = nn.MultiheadAttention(64, 8, batch_first=True).double()
    ours = mh.MultiHeadAttention.from_torch(theirs).double()
    x = torch.randn(16, 6, 64, dtype=torch.float64, requires_grad=True)  # B*H = 128 rows of 6 keys
    assert math_backend.serves_short(torch.empty(16, 8, 6, 8), torch.empty(16, 8, 6, 8), causal)
    mask = torch.ones(6, 6, dtype=torch.bool).triu(1) if causal else None  # True = masked (torch's)
    a = ours(x, causal=causal)
    b = theirs(x, x, x, need_weights=False, attn_mask=mask)[0]
    torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    ga, gb = (torch.autograd.grad(y.sum(), x)[0] for y in (a, b))
    torch.testing.assert_close(ga, gb, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(("b", "length", "e", "heads", "kv_heads", "bias", "per_head"), [
    (64, 5, 128, 8, 8, True, True),  # the seed shape's rows (E = 128 here: heads of 16)
    (16, 32, 64, 4, 2, True, True),  # grouped heads: projected head-major, attended through the grouped path
    (128, 8, 64, 1, 1, False, True),  # one head, no bias
    (64, 5, 64, 8, 8, True, False),  # heads of 8 dims: the fused projection (narrow products are slower)
    (16, 4, 512, 32, 32, True, False),  # 96 products of 16 dims: the fused projection
])  # fmt: skip
def test_without_autograd_short_rows_are_projected_one_head_at_a_time(
    b, length, e, heads, kv_heads, bias, per_head
):
    """Without autograd, few tokens of short rows of heads wide enough (math.serves_head_major): one product
    per head, stored head-major, read by short_attention without a copy; the output equals the float64
    module's as closely as torch's own float32 layer does (the 2x rule); narrow heads, too many products,
    and autograd keep the fused projection."""
    torch.manual_seed(0)
    ours = mh.MultiHeadAttention(e, heads, kv_heads=kv_heads, bias=bias)
    if bias:
        nn.init.normal_(ours.in_proj_bias)
    x = torch.randn(b, length, e)
    with torch.no_grad():
        q, k, v = ours.project(x, x, x)
        assert all(math_backend.head_major(t) for t in (q, k, v)) == per_head
        fused = F.linear(x, ours.in_proj_weight, ours.in_proj_bias)  # (B, L, H*D + 2*Hkv*D)
        torch.testing.assert_close(torch.cat([t.transpose(1, 2).flatten(2) for t in (q, k, v)], -1), fused)
        got = ours(x)
        want = ours.double()(x.double())
        ours.float()
    if kv_heads == heads:
        theirs = nn.MultiheadAttention(e, heads, batch_first=True, bias=bias)
        theirs.load_state_dict(ours.state_dict())
        with torch.no_grad():
            peer = theirs.eval()(x, x, x, need_weights=False)[0]
        bound = 2 * (peer.double() - want).abs().max().item() + 1e-6
        assert (got.double() - want).abs().max().item() <= bound
    else:
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    q, k, v = ours.project(x, x, x)  # autograd on: the fused projection's strided views
    assert not math_backend.head_major(q)


# ----------------------------------------------------------------------------------------------
# bfloat16 on a CPU that multiplies it in hardware: blocks of two bmm and a softmax
# ----------------------------------------------------------------------------------------------

BF16 = [  # (B, H, Hkv, Lq, Lk): whole (batch, kv head) pairs per block, one pair's rows in parts, grouped
    (2, 4, 4, 40, 40),
    (1, 4, 2, 17, 300),  # grouped, Lq != Lk
    (1, 8, 2, 1, 64),  # a decode step
    (1, 2, 1, 600, 2100),  # one kv head's 1,200 x 2,100 scores (4.8 MiB): its rows in three parts
]


@pytest.mark.parametrize("strided", [False, True])
@pytest.mark.parametrize(("b", "h", "hkv", "lq", "lk"), BF16)
def test_bfloat16_blocks_match_the_reference(monkeypatch, b, h, hkv, lq, lk, strided):
    """math.bf16_attention (the sdpa backend's bfloat16 lane without autograd, where the CPU multiplies
    bfloat16 natively): within the 2x rule of the bfloat16 reference, contiguous or strided heads."""
    monkeypatch.setattr(math_backend, "NATIVE_BF16", True)  # the blocks run on any CPU; only speed differs
    q, k, v = _qkv(b, h, hkv, lq, lk, d=32, dtype=torch.bfloat16, seed=lq)
    if strided:  # (B, L, H, D) buffers, as the module's projection gives them
        q = q.transpose(1, 2).contiguous().transpose(1, 2)
        k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (k, v))
    assert math_backend.serves_bf16(q, k, v, False)
    with torch.no_grad():
        report = compare_to_reference(mh.attention, q, k, v, scale=0.2)
        direct = math_backend.bf16_attention(q, k, v, 0.2)
    assert report.ok, report
    torch.testing.assert_close(direct, mh.attention(q, k, v, scale=0.2), rtol=0, atol=0)


def test_bfloat16_blocks_only_where_they_are_faster_and_nothing_needs_a_gradient(monkeypatch):
    """Causal, float16/float32, autograd, a CPU without bfloat16 products, or a few short rows: the fused
    kernel (or short_attention) as before; with autograd, the fused kernel's gradients."""
    monkeypatch.setattr(math_backend, "NATIVE_BF16", True)
    q, k, v = _qkv(1, 4, 4, 40, 40, dtype=torch.bfloat16)  # no grouping: torch < 2.9 repeats K/V on the CPU
    assert math_backend.serves_bf16(q, k, v, False)
    assert not math_backend.serves_bf16(q, k, v, True)  # the fused kernel skips the upper triangle
    assert not math_backend.serves_bf16(*(t.half() for t in (q, k, v)), False)
    assert not math_backend.serves_bf16(*(t.float() for t in (q, k, v)), False)
    assert not math_backend.serves_bf16(q, k[:, :, :32], v[:, :, :32], False)  # short rows
    ins = [t.clone().requires_grad_() for t in (q, k, v)]
    assert not math_backend.serves_bf16(*ins, False)
    with torch.no_grad():
        assert math_backend.serves_bf16(*ins, False)  # no autograd: nothing to differentiate
    out = mh.attention(*ins)
    fused_in = [t.clone().requires_grad_() for t in (q, k, v)]
    fused = F.scaled_dot_product_attention(*fused_in)
    torch.testing.assert_close(out, fused, rtol=0, atol=0)  # the fused kernel itself
    out.float().sum().backward()
    fused.float().sum().backward()
    for a, w in zip(ins, fused_in, strict=True):
        torch.testing.assert_close(a.grad, w.grad, rtol=0, atol=0)
    monkeypatch.setattr(math_backend, "NATIVE_BF16", False)
    assert not math_backend.serves_bf16(q, k, v, False)


@settings(max_examples=25, deadline=None)
@given(
    st.integers(1, 3),  # B
    st.sampled_from([(4, 4), (4, 2), (6, 1), (2, 2)]),  # (H, Hkv)
    st.integers(1, 70),  # Lq
    st.integers(math_backend.SHORT_KEYS + 1, 400),  # Lk
    st.booleans(),  # strided heads, as the module's fused projection gives them
    st.integers(0, 2**31 - 1),
)
def test_bfloat16_blocks_equal_the_reference_for_any_shape_they_serve(b, heads, lq, lk, strided, seed):
    """Any call math.bf16_attention serves (grouped heads, Lq != Lk, decode steps, contiguous or strided), with
    blocks made small enough that pairs and rows are split: within the 2x rule of the bfloat16 reference."""
    h, hkv = heads
    q, k, v = _qkv(b, h, hkv, lq, lk, d=8, dtype=torch.bfloat16, seed=seed)
    if strided:
        q, k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))
    saved = math_backend.NATIVE_BF16, math_backend.BF16_BLOCK_BYTES
    math_backend.NATIVE_BF16, math_backend.BF16_BLOCK_BYTES = True, 4096  # a few rows of scores a block
    try:
        assert math_backend.serves_bf16(q, k, v, False)
        with torch.no_grad():
            report = compare_to_reference(mh.attention, q, k, v, scale=0.3)
    finally:
        math_backend.NATIVE_BF16, math_backend.BF16_BLOCK_BYTES = saved
    assert report.ok, report
