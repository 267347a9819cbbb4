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


# many tiny ops: see conftest.py; compares with float64: tests/cpu_kernels.py
pytestmark = [pytest.mark.numerics, pytest.mark.usefixtures("one_thread")]


# ----------------------------------------------------------------------------------------------
# KVCache itself
# ----------------------------------------------------------------------------------------------


def test_cache_grows_and_reorders():
    c = mh.KVCache()
    assert c.is_empty and len(c) == 0 and c.keys is None
    k1, v1 = torch.randn(3, 2, 1, 4), torch.randn(3, 2, 1, 5)
    k2, v2 = torch.randn(3, 2, 2, 4), torch.randn(3, 2, 2, 5)
    c.update(k1, v1)
    k, v = (t.clone() for t in c.update(k2, v2))  # views of the storage: reorder rewrites them
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


# ----------------------------------------------------------------------------------------------
# The in-place cache against a concatenating reference
# ----------------------------------------------------------------------------------------------


class CatCache(mh.KVCache):
    """Reference: the cache as it was, ``torch.cat`` of everything so far on every update."""

    def __init__(self, *, static=False, max_len=None):
        super().__init__(static=static, max_len=max_len)
        self._ck = self._cv = None

    keys = property(lambda self: self._ck)
    values = property(lambda self: self._cv)

    def __len__(self):
        if self._ck is not None:
            return self._ck.shape[2]
        return next((len(c) for _, c in self.children() if not c.static and not c.is_empty), 0)

    def update(self, k, v):
        if self._ck is None:
            self._ck, self._cv = k, v
        else:
            assert not self.static
            self._ck, self._cv = torch.cat([self._ck, k], dim=2), torch.cat([self._cv, v], dim=2)
        return self._ck, self._cv

    def reorder(self, indices, *, include_static=True):
        if self._ck is not None and (include_static or not self.static):
            self._ck, self._cv = self._ck[indices], self._cv[indices]
        for _, c in self.children():
            c.reorder(indices, include_static=include_static)

    def reset(self):
        self._ck = self._cv = None
        for _, c in self.children():
            c.reset()


def _twin_steps(mha, chunks, *, beams=None, reset_at=None, max_len=None):
    """Decode ``chunks`` [(B, n, E)] with the in-place cache and the reference; yield both outputs."""
    fast, ref = mh.KVCache(max_len=max_len), CatCache()
    for i, x in enumerate(chunks):
        if i == reset_at:
            fast.reset()
            ref.reset()
        yield mha(x, cache=fast, causal=True), mha(x, cache=ref, causal=True)
        assert len(fast) == len(ref)
        torch.testing.assert_close(fast.keys, ref.keys, rtol=0, atol=0)
        if beams is not None:
            rows = beams[i % len(beams)]
            fast.reorder(rows)
            ref.reorder(rows)


CHUNKINGS = {"steps": [1] * 40, "chunks": [5, 1, 3, 1, 1, 17, 2, 1, 11]}


@pytest.mark.parametrize("chunking", sorted(CHUNKINGS))
@pytest.mark.parametrize("kv_heads, rotary", [(None, False), (2, False), (1, False), (None, True), (1, True)])
@pytest.mark.parametrize("grad", [False, True])
def test_in_place_cache_equals_concatenation_bit_for_bit(chunking, kv_heads, rotary, grad):
    """Steps and chunks, MHA/GQA/MQA, rotary: the same bits as appending with torch.cat (with and
    without autograd; with it the cache concatenates so that no tensor saved for backward is rewritten)."""
    mha = _mha(kv_heads=kv_heads, rotary=rotary)
    cuts = CHUNKINGS[chunking]
    x = torch.randn(3, sum(cuts), 32)
    chunks = list(x.split(cuts, dim=1))
    with torch.set_grad_enabled(grad):
        for fast, ref in _twin_steps(mha, chunks):
            assert torch.equal(fast, ref)


def test_in_place_cache_with_beams_reset_and_max_len():
    """reorder between steps (beam parents, duplicated and dropped rows), reset mid-way, max_len storage."""
    mha = _mha(kv_heads=2, rotary=True)
    chunks = [torch.randn(4, n, 32) for n in (3, 1, 1, 2, 1, 1, 1)]
    beams = [torch.tensor([1, 1, 0, 3]), torch.tensor([3, 2, 1, 0]), torch.tensor([0, 0, 0, 2])]
    with torch.no_grad():
        for max_len in (None, 10):
            for reset_at in (None, 4):
                for fast, ref in _twin_steps(mha, chunks, beams=beams, reset_at=reset_at, max_len=max_len):
                    assert torch.equal(fast, ref)


def test_in_place_cache_in_a_decoder_with_static_caches():
    """A whole decoder stack (dynamic self-attention and static cross-attention children), with beams."""
    torch.manual_seed(0)
    dec = mh.TransformerDecoder(16, 4, 32, kv_heads=2, num_layers=2).eval()
    x, memory = torch.randn(4, 6, 16), torch.randn(4, 5, 16)
    fast, ref = mh.KVCache(), CatCache()
    rows = torch.tensor([0, 0, 2, 2])  # beams within each pair of rows: memory rows stay equal
    memory = memory[rows]
    with torch.no_grad():
        for t in range(6):
            a = dec(x[:, t : t + 1], memory, cache=fast)
            b = dec(x[:, t : t + 1], memory, cache=ref)
            assert torch.equal(a, b)
            fast.reorder(rows.flip(0), include_static=False)
            ref.reorder(rows.flip(0), include_static=False)
    cross = fast.child("1").child("cross_attn", static=True)
    assert cross.static and cross.keys.shape == (4, 2, 5, 4)
    assert len(fast) == len(ref) == 6


def test_storage_grows_geometrically_and_reset_keeps_it():
    c = mh.KVCache()
    caps, ptrs = [], []
    with torch.no_grad():
        for _ in range(1000):
            c.update(torch.randn(2, 1, 1, 4), torch.randn(2, 1, 1, 4))
            caps.append(c.capacity)
            ptrs.append(c._k.data_ptr())
    grew = [b for a, b in zip(caps, caps[1:]) if b != a]
    assert grew == [32, 64, 128, 256, 512, 1024]  # doubling from the 16-position start
    moved = sum(a != b for a, b in zip(ptrs, ptrs[1:]))
    assert moved == len(grew)  # storage reallocated only when it grew: 6 copies for 1000 tokens
    assert len(c) == 1000 and c.capacity >= len(c)
    before = c._k.data_ptr()
    c.reset()
    assert c.is_empty and len(c) == 0 and c.keys is None and c.capacity == 1024
    c.update(torch.randn(2, 1, 3, 4), torch.randn(2, 1, 3, 4))
    assert c._k.data_ptr() == before and len(c) == 3  # same storage, no allocation
    c.reset()
    c.update(torch.randn(5, 1, 1, 4), torch.randn(5, 1, 1, 4))  # another batch size: new storage
    assert c.keys.shape == (5, 1, 1, 4) and c.capacity == 16


def test_max_len_cache_is_allocated_once_and_raises_when_full():
    c = mh.KVCache(max_len=5)
    c.update(torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 4))
    assert c.capacity == 5 and len(c) == 3
    ptr = c._k.data_ptr()
    c.update(torch.randn(1, 2, 2, 4), torch.randn(1, 2, 2, 4))
    assert c._k.data_ptr() == ptr and len(c) == 5
    with pytest.raises(ValueError, match=r"full: it holds 5 of max_len=5 positions and this step adds 1"):
        c.update(torch.randn(1, 2, 1, 4), torch.randn(1, 2, 1, 4))
    assert len(c) == 5  # the failed step changed nothing
    root = mh.KVCache(max_len=7)
    assert root.child("self_attn").max_len == 7 and root.child("x", static=True).max_len is None
    with pytest.raises(ValueError, match="max_len must be a positive int"):
        mh.KVCache(max_len=0)
    mha = _mha()
    cache = mh.KVCache(max_len=4)
    mha(torch.randn(1, 4, 32), cache=cache, causal=True)
    with pytest.raises(ValueError, match="KVCache is full"):
        mha(torch.randn(1, 1, 32), cache=cache, causal=True)


def test_cached_decoding_still_backpropagates():
    """With gradients the cache concatenates (and reorders out of place): backward through several
    cached steps works and equals the gradient of the full causal pass."""
    mha = _mha(dtype=torch.float64)
    x = torch.randn(2, 5, 32, dtype=torch.float64, requires_grad=True)
    cache, steps = mh.KVCache(), []
    for t in range(5):
        steps.append(mha(x[:, t : t + 1], cache=cache, causal=True))
        cache.reorder(torch.tensor([0, 1]))  # beams that keep their rows: gathered out of place here
    (g_steps,) = torch.autograd.grad(torch.cat(steps, dim=1).square().sum(), x)
    (g_full,) = torch.autograd.grad(mha(x, causal=True).square().sum(), x)
    torch.testing.assert_close(g_steps, g_full, rtol=0, atol=1e-12)


# ----------------------------------------------------------------------------------------------
# The fixed-shape cache: every step the same shapes, the length on the device
# ----------------------------------------------------------------------------------------------


@settings(max_examples=20, deadline=None)
@given(
    cuts=st.lists(st.integers(1, 6), min_size=1, max_size=5),
    rotary=st.booleans(),
    kv_heads=st.sampled_from([None, 2, 1]),
    causal=st.booleans(),
)
def test_fixed_shape_cache_equals_the_growing_cache(cuts, rotary, kv_heads, causal):
    """Property: however a sequence is split, steps on KVCache(max_len, fixed_shape=True) give the outputs
    of the growing cache (float64: the same arithmetic up to the masked positions' exact zeros)."""
    mha = _mha(heads=4, kv_heads=kv_heads, rotary=rotary, embed=16, dtype=torch.float64)
    x = torch.randn(2, sum(cuts), 16, dtype=torch.float64)
    fixed, growing = mh.KVCache(max_len=sum(cuts) + 3, fixed_shape=True), mh.KVCache()
    start = 0
    with torch.no_grad():
        for n in cuts:
            chunk = x[:, start : start + n]
            got = mha(chunk, cache=fixed, causal=causal)
            want = mha(chunk, cache=growing, causal=causal)
            torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
            start += n
            assert fixed.keys.shape[2] == len(fixed) == start  # the filled positions, read on the host
    assert fixed.capacity == sum(cuts) + 3


def test_fixed_shape_cache_with_a_key_padding_mask():
    """mask= over the storage's max_len positions (left padding) combines with the positions not yet
    written; the growing cache with the same mask cut to the written length agrees."""
    mha = _mha(dtype=torch.float64)
    x = torch.randn(2, 6, 32, dtype=torch.float64)
    keep = torch.ones(2, 8, dtype=torch.bool)
    keep[1, :2] = False  # row 1: two padding positions at the start
    fixed, growing = mh.KVCache(max_len=8, fixed_shape=True), mh.KVCache()
    with torch.no_grad():
        for a, b in ((0, 3), (3, 4), (4, 6)):
            got = mha(x[:, a:b], cache=fixed, causal=True, mask=keep[:, None, None, :])
            want = mha(x[:, a:b], cache=growing, causal=True, mask=keep[:, None, None, :b])
            torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


def test_fixed_shape_cache_reset_reorder_and_storage():
    c = mh.KVCache(max_len=5, fixed_shape=True)
    k, v = torch.randn(3, 2, 2, 4), torch.randn(3, 2, 2, 4)
    with torch.no_grad():
        full_k, _ = c.update(k, v)
        assert full_k.shape == (3, 2, 5, 4) and len(c) == 2 and torch.equal(c.keys, k)
        assert full_k[:, :, 2:].abs().max() == 0  # unwritten positions are zeros, never garbage
        ptr = full_k.data_ptr()
        c.reorder(torch.tensor([2, 0, 1]))
        assert c.keys.data_ptr() == ptr and torch.equal(c.keys[0], k[2])  # gathered in place
        c.reset()
        assert len(c) == 0 and c.keys is None
        c.update(k[:1], v[:1])  # a new batch size after reset: new storage
        assert c.capacity == 5 and len(c) == 2 and torch.equal(c.keys, k[:1])


@pytest.mark.parametrize(
    ("build", "match"),
    [
        (lambda: mh.KVCache(fixed_shape=True), r"fixed_shape=True needs max_len"),
        (lambda: mh.KVCache(static=True, max_len=4, fixed_shape=True), r"static=False"),
    ],
)
def test_fixed_shape_cache_needs_max_len(build, match):
    with pytest.raises(ValueError, match=match):
        build()


def test_fixed_shape_cache_errors():
    mha = _mha()
    x = torch.randn(2, 3, 32)
    c = mh.KVCache(max_len=4, fixed_shape=True)
    with pytest.raises(ValueError, match="keeps no gradients"):
        mha(x, cache=c, causal=True)  # grad enabled, parameters require grad
    with torch.no_grad():
        with pytest.raises(ValueError, match="not valid_lens or segment_ids"):
            mha(x, cache=c, causal=True, valid_lens=torch.tensor([3, 2]))
        mha(x, cache=c, causal=True)
        with pytest.raises(
            ValueError, match=r"full: max_len=4 positions and this step would write position 4"
        ):
            mha(x[:, :2], cache=c, causal=True)
        with pytest.raises(ValueError, match="keeps its batch size 2"):
            c.reorder(torch.tensor([0, 1, 1]))
