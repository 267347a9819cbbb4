"""Logit soft-capping (Gemma 2) and attention sinks (gpt-oss) against an oracle written here.

Dimensions: B batch, H heads, Hkv kv heads, Lq/Lk lengths, Dk/Dv head dims.

The oracle is the plain formula, one query row at a time in float64, independent of the library:
``s_j = c * tanh(q.k_j * scale / c)``, ``w_j = exp(s_j) / (sum_{allowed j'} exp(s_j') + exp(sink))``
over the allowed keys, ``out = sum_j w_j v_j``; a row with no allowed key gives 0.
"""

import math

import pytest
import torch
from attention_cases import make_qkv
from hypothesis import given, settings
from hypothesis import strategies as st

import multihead as mh
from multihead.core.attention import prepare
from multihead.core.backends.flex import FlexBackend
from multihead.core.backends.math import MathBackend
from multihead.testing import compare_to_reference

# one thread: see conftest.py; compares with float64: tests/cpu_kernels.py
pytestmark = [pytest.mark.numerics, pytest.mark.usefixtures("one_thread")]


def oracle(q, k, v, allowed, softcap=None, sinks=None):
    """q (B, H, Lq, Dk), k (B, Hkv, Lk, Dk), v (B, Hkv, Lk, Dv), allowed bool (B, H, Lq, Lk) -> (out, weights)."""
    b, h, lq, dk = q.shape
    hkv, lk, dv = k.shape[1], k.shape[2], v.shape[3]
    out = torch.zeros(b, h, lq, dv, dtype=torch.float64)
    weights = torch.zeros(b, h, lq, lk, dtype=torch.float64)
    for bi in range(b):
        for hi in range(h):
            kv = hi // (h // hkv)
            for i in range(lq):
                keys = [j for j in range(lk) if allowed[bi, hi, i, j]]
                if not keys:
                    continue
                s = {j: float(q[bi, hi, i] @ k[bi, kv, j]) / math.sqrt(dk) for j in keys}
                if softcap is not None:
                    s = {j: softcap * math.tanh(x / softcap) for j, x in s.items()}
                top = max(s.values()) if sinks is None else max(*s.values(), float(sinks[hi]))
                denom = sum(math.exp(x - top) for x in s.values())
                if sinks is not None:
                    denom += math.exp(float(sinks[hi]) - top)
                for j, x in s.items():
                    weights[bi, hi, i, j] = math.exp(x - top) / denom
                out[bi, hi, i] = weights[bi, hi, i] @ v[bi, kv].double()
    return out, weights


B, H, HKV, LQ, LK, D = 2, 4, 2, 5, 6, 3
IDS = torch.tensor([[0, 0, 1, 1, 1, -1], [2, 2, 2, 2, -1, -1]])
KINDS = {
    "none": ({}, torch.ones(LQ, LK, dtype=torch.bool)),
    "causal": ({"causal": True}, mh.masks.causal(LQ, LK)),
    "dead_rows": ({"valid_lens": torch.tensor([4, 0])}, mh.masks.from_valid_lens(torch.tensor([4, 0]), LK)),
    "segments": (
        {"segment_ids": (IDS[:, 1:], IDS), "causal": True},
        mh.masks.segment_mask(IDS[:, 1:], IDS) & mh.masks.causal(LQ, LK),
    ),
}
SINKS = torch.tensor([0.5, -1.0, 2.0, 0.0], dtype=torch.float64)


def _args(softcap, sinks):
    return {"softcap": softcap, "sinks": None if sinks is None else SINKS.clone()}


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("softcap, sinks", [(2.0, None), (None, "sinks"), (1.5, "sinks")])
@pytest.mark.parametrize("backend", ["reference", "math", "sdpa"])
def test_float64_equals_the_oracle(backend, softcap, sinks, kind):
    kw, allowed = KINDS[kind]
    q, k, v = make_qkv(B, H, HKV, LQ, LK, D, D + 1, torch.float64)
    extra = _args(softcap, sinks)
    want_out, want_w = oracle(q, k, v, allowed.expand(B, H, LQ, LK), softcap, extra["sinks"])
    if backend == "reference":
        got = mh.attention_reference(q, k, v, return_weights=True, **kw, **extra)
        torch.testing.assert_close(got.weights, want_w, atol=1e-12, rtol=1e-12)
        got = got.output
    elif backend == "sdpa" and softcap is not None:
        with pytest.raises(ValueError, match="sdpa cannot soft-cap"):
            mh.attention(q, k, v, backend="sdpa", **kw, **extra)
        return
    else:
        res = mh.attention(q, k, v, backend=backend, return_weights=backend == "math", **kw, **extra)
        if backend == "math":
            torch.testing.assert_close(res.weights, want_w, atol=1e-12, rtol=1e-12)
            res = res.output
        got = res
    torch.testing.assert_close(got, want_out, atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize(
    "backend, softcap", [("math", None), ("math", 3.0), ("sdpa", None)]
)  # sdpa: no softcap
@pytest.mark.parametrize("kind", ["causal", "dead_rows"])
def test_gradcheck_with_sinks(backend, softcap, kind):
    kw, _ = KINDS[kind]
    q, k, v = make_qkv(B, 2, 1, LQ, LK, 2, 2, torch.float64, requires_grad=True)
    sinks = torch.tensor([0.3, -0.7], dtype=torch.float64, requires_grad=True)

    def fn(q, k, v, sinks):
        return mh.attention(q, k, v, sinks=sinks, softcap=softcap, backend=backend, **kw)

    assert torch.autograd.gradcheck(fn, (q, k, v, sinks))


@pytest.mark.parametrize("backend", ["math", "sdpa", "auto"])
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_float32_within_twice_the_reference_error(backend, kind):
    kw, _ = KINDS[kind]
    q, k, v = make_qkv(B, H, HKV, LQ, LK, D, D, torch.float32)
    softcap = None if backend == "sdpa" else 5.0
    sinks = SINKS.float()
    report = compare_to_reference(
        lambda *a, **k_: mh.attention(*a, backend=backend, **k_), q, k, v, softcap=softcap, sinks=sinks, **kw
    )
    assert report.ok, report


def test_dead_rows_with_sinks_are_zero_with_finite_gradients():
    q, k, v = make_qkv(2, 2, 2, 3, 4, 4, 4, torch.float64, requires_grad=True)
    sinks = torch.tensor([5.0, -5.0], dtype=torch.float64, requires_grad=True)
    for backend in ("math", "sdpa"):
        out = mh.attention(q, k, v, valid_lens=torch.tensor([2, 0]), sinks=sinks, backend=backend)
        assert out[1].abs().max() == 0
        out.sum().backward()
        assert all(torch.isfinite(t.grad).all() for t in (q, k, v, sinks))
        for t in (q, k, v, sinks):
            t.grad = None


def test_weights_sum_to_less_than_one_by_the_sink_share():
    """Row sums of the weights = 1 - sigmoid(sink - logsumexp(scores)) (the probability left to the sink)."""
    q, k, v = make_qkv(1, 4, 4, 3, 5, 4, 4, torch.float64)
    res = mh.attention(q, k, v, sinks=SINKS, backend="math", return_weights=True)
    scores = q @ k.transpose(-2, -1) / 2.0  # (1, 4, 3, 5), Dk = 4
    share = torch.sigmoid(SINKS.view(1, 4, 1) - torch.logsumexp(scores, dim=-1))
    torch.testing.assert_close(res.weights.sum(-1), 1 - share)


def test_softcap_bounds_the_scores():
    """With a tiny cap every score is within (-c, c): huge logits give an almost uniform row."""
    q, k, v = make_qkv(1, 1, 1, 2, 4, 4, 4, torch.float64)
    w = mh.attention(q * 1e4, k, v, softcap=1e-3, backend="math", return_weights=True).weights
    torch.testing.assert_close(w, torch.full_like(w, 0.25), atol=1e-3, rtol=0)


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_flex_eager_softcap_and_sinks(kind):
    """FlexAttention eager on CPU (forward): score_mod softcap and the lse-based sinks = the oracle."""
    kw, allowed = KINDS[kind]
    q, k, v = make_qkv(B, H, HKV, LQ, LK, D, D, torch.float32)
    with torch.no_grad():
        call = prepare(q, k, v, softcap=2.0, sinks=SINKS.float(), **kw)
        got, _ = FlexBackend(compiled=False)(call)
    want, _ = oracle(q.double(), k.double(), v.double(), allowed.expand(B, H, LQ, LK), 2.0, SINKS)
    torch.testing.assert_close(got.double(), want, atol=2e-6, rtol=2e-6)


@settings(max_examples=30, deadline=None)
@given(
    lq=st.integers(1, 5),
    lk=st.integers(1, 5),
    softcap=st.sampled_from([None, 0.5, 4.0]),
    sink=st.floats(-3, 3),
    causal=st.booleans(),
)
def test_random_shapes_match_the_oracle(lq, lk, softcap, sink, causal):
    q, k, v = make_qkv(1, 2, 1, lq, lk, 3, 2, torch.float64, seed=lq * 7 + lk)
    sinks = torch.tensor([sink, -sink], dtype=torch.float64)
    allowed = (mh.masks.causal(lq, lk) if causal else torch.ones(lq, lk, dtype=torch.bool)).expand(
        1, 2, lq, lk
    )
    want, _ = oracle(q, k, v, allowed, softcap, sinks)
    got = mh.attention(q, k, v, causal=causal, softcap=softcap, sinks=sinks)
    torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize(
    "kw, error, match",
    [
        ({"softcap": 0.0}, ValueError, "softcap must be a finite number > 0"),
        ({"softcap": float("nan")}, ValueError, "softcap must be a finite number > 0"),
        ({"softcap": "50"}, ValueError, "softcap must be"),
        ({"sinks": torch.zeros(3)}, ValueError, r"shape \(H,\) = \(4,\)"),
        ({"sinks": torch.zeros(4, dtype=torch.long)}, TypeError, "floating-point"),
        ({"sinks": [0.0] * 4}, TypeError, "torch.Tensor"),
    ],
)
def test_bad_softcap_and_sinks_are_refused(kw, error, match):
    q, k, v = make_qkv(1, 4, 2, 3, 3, 4, 4)
    with pytest.raises(error, match=match):
        mh.attention(q, k, v, **kw)


def test_module_sinks_softcap_and_backend():
    torch.manual_seed(0)
    mha = mh.MultiHeadAttention(
        16, 4, kv_heads=2, softcap=30.0, sinks=True, backend="math", dtype=torch.float64
    )
    assert mha.sinks.shape == (4,) and mha.sinks.abs().max() == 0 and "sinks" in dict(mha.named_parameters())
    assert "softcap=30" in repr(mha) and "sinks=True" in repr(mha)
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    with torch.no_grad():
        mha.sinks.copy_(SINKS)
    got = mha(x, causal=True)
    with torch.no_grad():
        q, k, v = mha.project(x, x, x)
    heads = oracle(q, k, v, mh.masks.causal(5).expand(2, 4, 5, 5), 30.0, SINKS)[0]
    want = mha.out_proj(heads.transpose(1, 2).flatten(2))
    torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)
    got.sum().backward()
    assert mha.sinks.grad is not None and mha.sinks.grad.abs().sum() > 0
    with pytest.raises(ValueError, match="sinks=True"):
        mha.to_torch()
    with pytest.raises(ValueError, match="backend must be 'auto' or one of"):
        mh.MultiHeadAttention(16, 4, backend="fast")
    with pytest.raises(TypeError, match="sinks must be a bool"):
        mh.MultiHeadAttention(16, 4, sinks=torch.zeros(4))


@pytest.mark.parametrize("return_weights", [False, True])
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_math_cache_blocked_path(kind, return_weights):
    """The inference path that works block by block in preallocated buffers: softcap and sinks too."""
    kw, allowed = KINDS[kind]
    q, k, v = make_qkv(B, H, HKV, LQ, LK, D, D, torch.float64)
    backend = MathBackend(block_bytes=64)
    with torch.no_grad():
        call = prepare(q, k, v, softcap=2.0, sinks=SINKS, return_weights=return_weights, **kw)
        assert backend.blocked(call)
        out, weights = backend(call)
    want_out, want_w = oracle(q, k, v, allowed.expand(B, H, LQ, LK), 2.0, SINKS)
    torch.testing.assert_close(out, want_out, atol=1e-12, rtol=1e-12)
    if return_weights:
        torch.testing.assert_close(weights, want_w, atol=1e-12, rtol=1e-12)
