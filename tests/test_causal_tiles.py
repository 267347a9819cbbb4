"""Causal attention as square tiles on the CPU (multihead.core.backends.causal_tiles), against the reference.

Dimensions: B batch, H heads, L = Lq = Lk, D head dim. Small tiles (monkeypatched) give many levels at
small L; one case runs at the real sizes.
"""

from __future__ import annotations

import pytest
import torch

import multihead as mh
from multihead.core.backends import causal_tiles
from multihead.testing import compare_to_reference

pytestmark = pytest.mark.numerics  # compares with float64: tests/cpu_kernels.py


@pytest.fixture(autouse=True)
def enabled(monkeypatch):
    monkeypatch.setattr(causal_tiles, "ENABLED", True)


@pytest.fixture
def small_tiles(monkeypatch):
    monkeypatch.setattr(causal_tiles, "TILE", 4)
    monkeypatch.setattr(causal_tiles, "MIN_LENGTH", 8)


@pytest.fixture
def served(monkeypatch):
    """Counts the calls the tiles serve."""
    calls = []
    real = causal_tiles.tiled_causal

    def spy(*args):
        calls.append(args[0].shape)
        return real(*args)

    monkeypatch.setattr(causal_tiles, "tiled_causal", spy)
    return calls


def _qkv(b, h, length, d, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, length, 3, h, d, generator=g).to(dtype)  # (B, L, 3, H, D): a fused projection's
    q, k, v = (t.transpose(1, 2) for t in x.unbind(2))  # (B, H, L, D) each, strided like the module's
    return q, k, v


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("length", [8, 24, 64, 80])  # 1 to 4 levels; 80 = 5 * 16: tiles of 5
def test_tiles_match_the_reference(small_tiles, served, dtype, length):
    q, k, v = _qkv(2, 3, length, 8, dtype)
    with torch.no_grad():
        report = compare_to_reference(mh.attention, q, k, v, causal=True)
    assert report.ok, report
    assert served, "the call should have been tiled"


def test_real_sizes(served):
    q, k, v = _qkv(1, 2, causal_tiles.MIN_LENGTH, 16, torch.float32)
    with torch.no_grad():
        report = compare_to_reference(mh.attention, q, k, v, causal=True)
    assert report.ok, report
    assert served


@pytest.mark.parametrize("length", [7, 6])  # odd; or even but shorter than two tiles of 4
def test_untileable_lengths_use_the_kernel(small_tiles, served, length):
    q, k, v = _qkv(1, 2, length, 8, torch.float32)
    with torch.no_grad():
        assert compare_to_reference(mh.attention, q, k, v, causal=True).ok
    assert not served


def test_autograd_keeps_the_kernel(small_tiles, served):
    q, k, v = (t.detach().requires_grad_() for t in _qkv(1, 2, 16, 8, torch.float64))
    out = mh.attention(q, k, v, causal=True)
    assert not served
    gold = mh.attention_reference(q, k, v, causal=True)
    g_out = torch.autograd.grad(out.sum(), (q, k, v))
    g_gold = torch.autograd.grad(gold.sum(), (q, k, v))
    for a, b in zip(g_out, g_gold):
        torch.testing.assert_close(a, b)


def test_off_by_default_uses_the_kernel(small_tiles, served, monkeypatch):
    monkeypatch.setattr(causal_tiles, "ENABLED", False)
    q, k, v = _qkv(1, 2, 16, 8, torch.float32)
    with torch.no_grad():
        assert compare_to_reference(mh.attention, q, k, v, causal=True).ok
    assert not served


def test_grouped_heads_use_the_kernel(small_tiles, served):
    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, 4, 16, 8, generator=g)  # H = 4
    k, v = torch.randn(1, 2, 16, 8, generator=g), torch.randn(1, 2, 16, 8, generator=g)  # Hkv = 2
    with torch.no_grad():
        assert compare_to_reference(mh.attention, q, k, v, causal=True).ok
    assert not served


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_module_causal_forward(small_tiles, served, dtype):
    torch.manual_seed(0)
    mha = mh.MultiHeadAttention(16, 2, dtype=dtype).eval()
    x = torch.randn(2, 32, 16, dtype=dtype)
    with torch.no_grad():
        out = mha(x, causal=True)
        q, k, v = mha.project(x, x, x)
        gold = mh.attention_reference(q.double(), k.double(), v.double(), causal=True)
        w, b = mha.out_proj.weight.double(), mha.out_proj.bias.double()
        want = torch.nn.functional.linear(gold.transpose(1, 2).flatten(2), w, b)
        ref = mha.out_proj(mh.attention_reference(q, k, v, causal=True).transpose(1, 2).flatten(2))
    assert served
    err, ref_err = (out.double() - want).abs().max(), (ref.double() - want).abs().max()
    assert err <= 2 * ref_err + 1e-6, (err, ref_err)
