"""KVCache, rotary embeddings and cached MultiHeadAttention decoding."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import multihead as mh
from multihead.nn import RotaryEmbedding


def _mha(heads=4, kv_heads=None, rotary=False, dtype=torch.float32, seed=0, embed=32):
    torch.manual_seed(seed)
    return mh.MultiHeadAttention(embed, heads, kv_heads=kv_heads, rotary=rotary, dtype=dtype).eval()


pytestmark = pytest.mark.usefixtures("one_thread")  # many tiny ops: see conftest.py


# ----------------------------------------------------------------------------------------------
# KVCache itself
# ----------------------------------------------------------------------------------------------


def test_cache_grows_and_reorders():
    c = mh.KVCache()
    assert c.is_empty and len(c) == 0 and c.keys is None
    k1, v1 = torch.randn(3, 2, 1, 4), torch.randn(3, 2, 1, 5)
    k2, v2 = torch.randn(3, 2, 2, 4), torch.randn(3, 2, 2, 5)
    c.update(k1, v1)
    k, v = c.update(k2, v2)
    assert len(c) == 3 and k.shape == (3, 2, 3, 4) and v.shape == (3, 2, 3, 5)
    assert torch.equal(k[:, :, :1], k1) and torch.equal(v[:, :, 1:], v2)
    c.reorder(torch.tensor([2, 2, 0]))
    assert torch.equal(c.keys[0], k[2]) and torch.equal(c.keys[1], k[2]) and torch.equal(c.values[2], v[0])
    c.reset()
    assert c.is_empty and len(c) == 0


def test_static_cache_is_filled_once():
    c = mh.KVCache(static=True)
    c.update(torch.randn(2, 1, 3, 4), torch.randn(2, 1, 3, 4))
    with pytest.raises(ValueError, match="already filled"):
        c.update(torch.randn(2, 1, 3, 4), torch.randn(2, 1, 3, 4))


def test_cache_children_and_len():
    root = mh.KVCache()
    layer = root.child("0")
    layer.child("cross_attn", static=True).update(torch.randn(1, 1, 7, 2), torch.randn(1, 1, 7, 2))
    layer.child("self_attn").update(torch.randn(1, 1, 2, 2), torch.randn(1, 1, 2, 2))
    assert len(root) == 2  # decoded positions, not the 7 source positions
    assert [n for n, _ in root.children()] == ["0"]
    with pytest.raises(ValueError, match="static"):
        layer.child("self_attn", static=True)
    with pytest.raises(ValueError, match="container"):
        root.update(torch.randn(1, 1, 1, 2), torch.randn(1, 1, 1, 2))
    root.reorder(torch.tensor([0, 0]), include_static=False)
    assert layer.child("self_attn").keys.shape[0] == 2
    assert layer.child("cross_attn", static=True).keys.shape[0] == 1
    assert "children" in repr(root)


@pytest.mark.parametrize(
    "k, v, match",
    [
        (torch.randn(3, 2, 1, 4), torch.randn(3, 2, 1, 5), "match the cached"),
        (torch.randn(2, 2, 1), torch.randn(2, 2, 1), "Hkv, Lnew"),
    ],
)
def test_cache_rejects_mismatched_steps(k, v, match):
    c = mh.KVCache()
    c.update(torch.randn(2, 2, 1, 4), torch.randn(2, 2, 1, 5))
    with pytest.raises(ValueError, match=match):
        c.update(k, v)


def test_cache_rejects_bad_indices_and_dtype():
    c = mh.KVCache()
    c.update(torch.randn(2, 1, 1, 4), torch.randn(2, 1, 1, 4))
    with pytest.raises(ValueError, match="indices"):
        c.reorder(torch.tensor([[0, 1]]))
    with pytest.raises(TypeError, match="dtype"):
        c.update(torch.randn(2, 1, 1, 4, dtype=torch.float64), torch.randn(2, 1, 1, 4, dtype=torch.float64))


def test_mha_rejects_a_non_cache():
    with pytest.raises(TypeError, match="KVCache"):
        _mha()(torch.randn(1, 2, 32), cache={})


# ----------------------------------------------------------------------------------------------
# Rotary embeddings
# ----------------------------------------------------------------------------------------------


def _rotary_complex(x, positions, base=10000.0):
    """Independent oracle: pairs (x[i], x[i + D/2]) as complex numbers times exp(i * p * base**(-2i/D))."""
    d = x.shape[-1]
    z = torch.complex(x[..., : d // 2].double(), x[..., d // 2 :].double())
    theta = torch.tensor(
        [[p * base ** (-2 * i / d) for i in range(d // 2)] for p in positions], dtype=torch.float64
    )
    z = z * torch.polar(torch.ones_like(theta), theta)
    return torch.cat([z.real, z.imag], dim=-1)


@pytest.mark.parametrize("offset", [0, 3, 100])
def test_rotary_matches_complex_rotation(offset):
    x = torch.randn(2, 3, 5, 8, dtype=torch.float64)
    got = RotaryEmbedding(8)(x, offset=offset)
    torch.testing.assert_close(got, _rotary_complex(x, range(offset, offset + 5)), rtol=0, atol=1e-12)


def test_rotary_scores_depend_on_relative_position_only():
    rope = RotaryEmbedding(16)
    q, k = torch.randn(1, 1, 1, 16, dtype=torch.float64), torch.randn(1, 1, 1, 16, dtype=torch.float64)
    s1 = (rope(q, offset=7) * rope(k, offset=3)).sum()
    s2 = (rope(q, offset=54) * rope(k, offset=50)).sum()
    s3 = (rope(q, offset=5) * rope(k, offset=3)).sum()
    torch.testing.assert_close(s1, s2, rtol=0, atol=1e-10)
    assert not torch.allclose(s1, s3)


def test_rotary_needs_even_head_dim():
    with pytest.raises(ValueError, match="even head_dim"):
        mh.MultiHeadAttention(30, 2, rotary=True)
    with pytest.raises(ValueError, match="rotary"):
        _mha(rotary=True).to_torch()


def test_rotary_adds_no_parameters():
    plain, rot = _mha(), _mha(rotary=True)
    assert plain.state_dict().keys() == rot.state_dict().keys()
    x = torch.randn(2, 5, 32)
    assert not torch.allclose(plain(x), rot(x))  # it does change the computation
    assert "rotary=True" in repr(rot)


# ----------------------------------------------------------------------------------------------
# Cached decoding == full causal forward
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("rotary", [False, True])
@pytest.mark.parametrize("kv_heads", [None, 2, 1])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_cached_steps_equal_full_causal_forward(rotary, kv_heads, dtype):
    mha = _mha(kv_heads=kv_heads, rotary=rotary, dtype=dtype)
    x = torch.randn(3, 9, 32, dtype=dtype)
    full = mha(x, causal=True)  # (B, L, E)
    cache = mh.KVCache()
    for t in range(9):
        step = mha(x[:, t : t + 1], cache=cache, causal=True)
        torch.testing.assert_close(
            step, full[:, t : t + 1], rtol=0, atol=1e-5 if dtype == torch.float32 else 1e-12
        )
    assert len(cache) == 9


@pytest.mark.parametrize("rotary", [False, True])
def test_cached_chunks_equal_full_causal_forward(rotary):
    """A prefill of 4 positions, then chunks of 1 and 3: the bottom-right causal rule at each call."""
    mha = _mha(rotary=rotary)
    x = torch.randn(2, 8, 32)
    full = mha(x, causal=True)
    cache = mh.KVCache()
    outs = [mha(x[:, a:b], cache=cache, causal=True) for a, b in ((0, 4), (4, 5), (5, 8))]
    torch.testing.assert_close(torch.cat(outs, dim=1), full, rtol=0, atol=1e-5)


def test_cached_steps_match_the_reference_attention():
    """The cached path against attention_reference on explicitly rotated, projected heads."""
    mha = _mha(rotary=True, dtype=torch.float64)
    x = torch.randn(2, 6, 32, dtype=torch.float64)
    q, k, v = mha.project(x, x, x)
    rope = RotaryEmbedding(mha.head_dim)
    ref = mh.attention_reference(rope(q), rope(k), v, causal=True)  # (B, H, L, D)
    ref = mha.out_proj(ref.transpose(1, 2).flatten(2))
    cache = mh.KVCache()
    steps = torch.cat([mha(x[:, t : t + 1], cache=cache, causal=True) for t in range(6)], dim=1)
    torch.testing.assert_close(steps, ref, rtol=0, atol=1e-12)


def test_static_cache_reuses_cross_attention_keys():
    mha = _mha()
    memory, other = torch.randn(2, 5, 32), torch.randn(2, 5, 32)
    q = torch.randn(2, 3, 32)
    expect = mha(q, memory, valid_lens=torch.tensor([5, 2]))
    cache = mh.KVCache(static=True)
    first = mha(q[:, :1], memory, cache=cache, valid_lens=torch.tensor([5, 2]))
    # later steps ignore the key/value tensors: the cached source is reused, not re-projected
    rest = mha(q[:, 1:], other, cache=cache, valid_lens=torch.tensor([5, 2]))
    torch.testing.assert_close(torch.cat([first, rest], dim=1), expect, rtol=0, atol=1e-6)
    assert len(cache) == 5


def test_cached_attention_is_unbatched_friendly():
    mha = _mha()
    x = torch.randn(4, 32)
    cache = mh.KVCache()
    out = torch.cat([mha(x[t : t + 1], cache=cache, causal=True) for t in range(4)])
    torch.testing.assert_close(out, mha(x, causal=True), rtol=0, atol=1e-6)
    assert math.isclose(len(cache), 4)


@settings(max_examples=25, deadline=None)
@given(
    cuts=st.lists(st.integers(1, 10), min_size=1, max_size=6),
    rotary=st.booleans(),
    kv_heads=st.sampled_from([None, 2, 1]),
    batch=st.integers(1, 3),
)
def test_any_chunking_of_cached_decoding_equals_full(cuts, rotary, kv_heads, batch):
    """Property: however a sequence is split into cached calls, the outputs equal one causal pass."""
    mha = _mha(heads=4, kv_heads=kv_heads, rotary=rotary, embed=16)
    length = sum(cuts)
    x = torch.randn(batch, length, 16)
    full = mha(x, causal=True)
    cache, start, outs = mh.KVCache(), 0, []
    for n in cuts:
        outs.append(mha(x[:, start : start + n], cache=cache, causal=True))
        start += n
    torch.testing.assert_close(torch.cat(outs, dim=1), full, rtol=0, atol=1e-5)
