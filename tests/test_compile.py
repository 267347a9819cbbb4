"""``torch.compile(fullgraph=True)``: the functional core, MultiHeadAttention, an encoder layer and a
cached decoding step compile without a graph break, and give the eager results.

``fullgraph=True`` turns any graph break into an error, so each test fails on a break. The ``eager``
compile backend runs the captured graph op by op: it checks the capture (what a graph break would spoil)
at a fraction of inductor's compile time, and its results equal eager execution bit for bit.
"""

import copy

import pytest
import torch
from torch._dynamo.utils import counters

import multihead as mh
from multihead import heads
from multihead.nn import seam

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def _compiled(fn):
    return torch.compile(fn, fullgraph=True, backend="eager")


def _equal(a, b):
    a, b = (x if isinstance(x, tuple) else (x,) for x in (a, b))
    assert len(a) == len(b)
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=0, atol=0)


CALLS = {
    "causal": {"causal": True},
    "valid_lens": {"valid_lens": torch.tensor([2, 5])},
    "causal+weights": {"causal": True, "return_weights": True},
    "mask+valid_lens+weights": {
        "mask": torch.rand(2, 1, 5, 5) > 0.3,
        "valid_lens": torch.tensor([4, 1]),
        "return_weights": True,
    },
}


@pytest.mark.parametrize("call, kv_heads", [("causal", 2), ("valid_lens", 4), ("mask+valid_lens+weights", 1)])
def test_attention_compiles(call, kv_heads):
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, 5, 8), torch.randn(2, kv_heads, 5, 8), torch.randn(2, kv_heads, 5, 8)
    _equal(_compiled(mh.attention)(q, k, v, **CALLS[call]), mh.attention(q, k, v, **CALLS[call]))


MODULES = {
    "mha": {},
    "gqa": {"kv_heads": 2},
    "mqa+rotary": {"kv_heads": 1, "rotary": True},
}


@pytest.mark.parametrize(
    "module, call",
    [
        ("mha", "causal+weights"),
        ("gqa", "valid_lens"),
        ("mqa+rotary", "causal"),
        ("gqa", "mask+valid_lens+weights"),
    ],
)
def test_multi_head_attention_compiles(module, call):
    torch.manual_seed(0)
    mha = mh.MultiHeadAttention(16, 4, **MODULES[module]).eval()
    x = torch.randn(2, 5, 16)
    _equal(_compiled(mha)(x, **CALLS[call]), mha(x, **CALLS[call]))


class _Silence(seam.Inspector):
    """Zeroes every head: the module's output is then its output projection's bias."""

    def on_heads(self, module, heads, weights):
        return heads * 0


def test_compiled_module_sees_the_active_inspector():
    """Inspection still applies to a compiled module: entering an inspector recompiles, leaving it too."""
    torch.manual_seed(0)
    mha = mh.MultiHeadAttention(16, 4).eval()
    torch.nn.init.normal_(mha.out_proj.bias)
    x = torch.randn(2, 5, 16)
    compiled = _compiled(mha)
    plain = compiled(x)
    with seam.inspecting(_Silence()):
        silenced = compiled(x)
        _equal(silenced, mha(x))
    assert not torch.equal(plain, silenced)
    torch.testing.assert_close(silenced, mha.out_proj.bias.expand(2, 5, 16), rtol=0, atol=0)
    _equal(compiled(x), plain)


def test_encoder_layer_compiles_and_trains():
    torch.manual_seed(0)
    layer = mh.TransformerEncoderLayer(16, 4, 32, kv_heads=2, dropout=0.0, norm_first=True)
    x, lens = torch.randn(2, 5, 16, requires_grad=True), torch.tensor([5, 3])
    got = _compiled(layer)(x, valid_lens=lens)
    expect = layer(x, valid_lens=lens)
    _equal(got, expect)
    (g_got,) = torch.autograd.grad(got.square().sum(), x)
    (g_expect,) = torch.autograd.grad(expect.square().sum(), x)
    torch.testing.assert_close(g_got, g_expect, rtol=0, atol=0)


@pytest.mark.parametrize("rotary", [False, True])
def test_cached_decoding_step_compiles(rotary):
    """One-token steps on a fixed max_len cache, compiled whole: the cache write is in place, the
    attention reads a view of the preallocated storage; after the first call specialises, one graph
    dynamic in the cached length serves every later step (no graph break, no recompile per token)."""
    torch.manual_seed(0)
    mha = mh.MultiHeadAttention(16, 4, kv_heads=2, rotary=rotary).eval()
    x = torch.randn(2, 12, 16)

    def step(x_t, cache):
        return mha(x_t, cache=cache, causal=True)

    compiled = _compiled(step)
    eager_cache, cache = mh.KVCache(max_len=12), mh.KVCache(max_len=12)
    with torch.no_grad():
        for c in (eager_cache, cache):
            mha(x[:, :3], cache=c, causal=True)  # prefill, eagerly
        for t in range(3, 12):
            _equal(compiled(x[:, t : t + 1], cache), step(x[:, t : t + 1], eager_cache))
    assert len(cache) == 12 and cache.capacity == 12
    assert counters["stats"]["unique_graphs"] <= 2
    with torch.no_grad(), pytest.raises(ValueError, match="KVCache is full"):
        step(x[:, :1], cache)


def test_masking_head_after_head_reuses_the_compiled_graph():
    """heads.masked's gates are inputs of the graph: masking each head in turn (as masking_drop does)
    neither recompiles per head nor hits the recompile limit (a hard error with fullgraph=True)."""
    torch.manual_seed(0)
    mha = mh.MultiHeadAttention(16, 4).eval()
    x = torch.randn(2, 5, 16)
    compiled = _compiled(mha)
    with torch.no_grad():
        for h in [0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3]:
            with heads.masked(mha, [h]):
                got = compiled(x)
            plain = copy.deepcopy(mha)
            plain.out_proj.weight[:, h * 4 : (h + 1) * 4] = 0  # head h's columns of out_proj (head dim 4)
            torch.testing.assert_close(got, plain(x))
    assert counters["stats"]["unique_graphs"] <= 2


def test_fixed_shape_steps_are_one_compiled_graph():
    """KVCache(max_len, fixed_shape=True): every step has the same shapes and touches no Python int, so
    torch.compile(fullgraph=True) compiles the decode step once and replays it for every position (what a
    CUDA graph needs), matching eager. (Not a numerics test: inductor's C++ build fails under a forced
    ATEN_CPU_CAPABILITY, see test_flex_cpu.py.)"""
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    mha = mh.MultiHeadAttention(32, 4, kv_heads=2, rotary=True).eval()
    x = torch.randn(2, 9, 32)
    cache, eager_cache = mh.KVCache(max_len=9, fixed_shape=True), mh.KVCache(max_len=9, fixed_shape=True)
    step = torch.compile(lambda x_t: mha(x_t, cache=cache, causal=True), fullgraph=True)
    with torch.no_grad():
        mha(x[:, :3], cache=cache, causal=True)  # prefill, eagerly
        mha(x[:, :3], cache=eager_cache, causal=True)
        for t in range(3, 9):
            got = step(x[:, t : t + 1])
            want = mha(x[:, t : t + 1], cache=eager_cache, causal=True)
            torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    torch._dynamo.reset()
