"""Hypothesis: random shapes and masks never give NaN/inf from finite inputs, and match the reference."""

from functools import partial

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import multihead as mh
from multihead.testing import compare_to_reference

pytestmark = pytest.mark.numerics  # compares with float64: tests/cpu_kernels.py


@st.composite
def attention_cases(draw):
    b = draw(st.integers(1, 3))
    hkv = draw(st.integers(1, 3))
    h = hkv * draw(st.integers(1, 3))
    lq, lk = draw(st.integers(1, 9)), draw(st.integers(1, 9))
    dk, dv = draw(st.integers(1, 12)), draw(st.integers(1, 12))
    seed = draw(st.integers(0, 2**16))
    g = torch.Generator().manual_seed(seed)
    scale = draw(st.sampled_from([1.0, 4.0, 30.0]))  # large inputs stress the softmax
    q = torch.randn(b, h, lq, dk, generator=g) * scale
    k = torch.randn(b, hkv, lk, dk, generator=g) * scale
    v = torch.randn(b, hkv, lk, dv, generator=g)
    kw = {}
    if draw(st.booleans()):
        shape = draw(st.sampled_from([(lq, lk), (b, 1, lq, lk), (b, h, lq, lk), (1, lk)]))
        kw["mask"] = torch.rand(shape, generator=g) > draw(st.floats(0.0, 1.0))
    if draw(st.booleans()):
        kw["valid_lens"] = torch.randint(0, lk + 1, draw(st.sampled_from([(b,), (b, lq)])), generator=g)
    if draw(st.booleans()):
        bias = torch.randn(h, lq, lk, generator=g)
        kw["bias"] = bias.masked_fill(torch.rand(h, lq, lk, generator=g) > 0.7, float("-inf"))
    kw["causal"] = draw(st.booleans())
    backend = draw(st.sampled_from(["auto", "math", "sdpa"]))
    return q, k, v, kw, backend, scale


@settings(max_examples=150, deadline=None)
@given(attention_cases())
def test_finite_and_matches_reference(case):
    q, k, v, kw, backend, scale = case
    for t in (q, k, v):
        t.requires_grad_(True)
    out = mh.attention(q, k, v, backend=backend, **kw)
    assert torch.isfinite(out).all()
    out.sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))
    rep = compare_to_reference(
        partial(mh.attention, backend=backend), q.detach(), k.detach(), v.detach(), **kw
    )
    if scale == 1.0:  # the 2x rule is for well-scaled inputs (flash-attention's test inputs are randn)
        assert rep.ok, rep
    else:  # scores up to ~1e4: float32 spacing there is ~1e-3, so only closeness is meaningful
        assert rep.fast < 1e-4 * scale**2, rep


@settings(max_examples=60, deadline=None)
@given(attention_cases())
def test_weights_are_distributions_or_zero(case):
    q, k, v, kw, _, _ = case
    _, w = mh.attention(q, k, v, return_weights=True, **kw)
    sums = w.sum(-1)
    assert torch.isfinite(w).all() and (w >= 0).all()
    assert torch.all(((sums - 1).abs() < 1e-5) | (sums == 0))
