"""MultiHeadAttention: shapes, GQA, fused projections and exact parity with torch.nn.MultiheadAttention."""

import inspect

import pytest
import torch
from torch import nn
from torch.overrides import TorchFunctionMode

import multihead as mh
from multihead.compat import d2l as compat_d2l
from multihead.compat import torch as compat_torch
from multihead.nn import merge_heads, seam


def torch_padding(valid_lens, lk):
    return torch.arange(lk)[None, :] >= valid_lens[:, None]  # torch's meaning: True = padding


@pytest.mark.parametrize("mode", ["self", "cross", "cross_kv_dims"])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("padding", [False, True])
def test_from_torch_parity_outputs_and_gradients(mode, bias, padding):
    torch.manual_seed(0)
    e, h, b, lq, lk = 16, 4, 3, 5, 7
    kdim = vdim = None
    if mode == "cross_kv_dims":
        kdim, vdim = 11, 9
    ref = nn.MultiheadAttention(e, h, bias=bias, kdim=kdim, vdim=vdim, batch_first=True)
    ours = mh.MultiHeadAttention.from_torch(ref)
    x = torch.randn(b, lq, e)
    if mode == "self":
        key = value = x
        lk = lq
    else:
        key = torch.randn(b, lk, kdim or e)
        value = key if mode == "cross" else torch.randn(b, lk, vdim)
    valid = torch.tensor([lk, 2, 1]) if padding else None
    xs = [x.clone().requires_grad_(True) for _ in range(2)]
    ks = [key.clone().requires_grad_(True) for _ in range(2)] if mode != "self" else xs
    vs = ks if mode in ("self", "cross") else [value.clone().requires_grad_(True) for _ in range(2)]

    theirs = ref(
        xs[0],
        ks[0],
        vs[0],
        key_padding_mask=None if valid is None else torch_padding(valid, lk),
        need_weights=False,
    )[0]
    mine = ours(xs[1], ks[1], vs[1], valid_lens=valid)
    torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=1e-5)
    g = torch.randn_like(mine)
    theirs.backward(g)
    mine.backward(g)
    for a, bb in zip((xs[0], ks[0], vs[0]), (xs[1], ks[1], vs[1])):
        torch.testing.assert_close(bb.grad, a.grad, atol=1e-5, rtol=1e-5)
    params_ref, params_ours = dict(ref.named_parameters()), dict(ours.named_parameters())
    assert params_ref.keys() == params_ours.keys()
    for name, p in params_ref.items():
        torch.testing.assert_close(params_ours[name].grad, p.grad, atol=1e-5, rtol=1e-5, msg=name)


def test_weights_match_torch_per_head():
    torch.manual_seed(1)
    ref = nn.MultiheadAttention(12, 3, batch_first=True)
    ours = mh.MultiHeadAttention.from_torch(ref)
    x = torch.randn(2, 4, 12)
    _, w_ref = ref(x, x, x, average_attn_weights=False)
    _, w = ours(x, return_weights=True)
    torch.testing.assert_close(w, w_ref, atol=1e-6, rtol=1e-5)


def test_to_torch_round_trip_and_refusal():
    torch.manual_seed(2)
    ours = mh.MultiHeadAttention(16, 4, kdim=8, vdim=6, bias=False)
    back = mh.MultiHeadAttention.from_torch(ours.to_torch())
    for (n, a), (_, b) in zip(ours.state_dict().items(), back.state_dict().items()):
        assert torch.equal(a, b), n
    with pytest.raises(ValueError, match="kv_heads=2 != num_heads=4"):
        mh.MultiHeadAttention(16, 4, kv_heads=2).to_torch()


def test_from_torch_refuses_bias_kv_with_pointer():
    with pytest.raises(ValueError, match="compat.torch"):
        mh.MultiHeadAttention.from_torch(nn.MultiheadAttention(8, 2, add_bias_kv=True))


@pytest.mark.parametrize("kv_heads", [4, 2, 1])
def test_gqa_module_equals_reference_math(kv_heads):
    """The module's output equals projections + attention_reference + output projection, by hand."""
    torch.manual_seed(3)
    m = mh.MultiHeadAttention(16, 4, kv_heads=kv_heads, head_dim=6, v_head_dim=5, out_dim=10).double()
    x, mem = torch.randn(2, 3, 16, dtype=torch.float64), torch.randn(2, 5, 16, dtype=torch.float64)
    wq, wk, wv = m.proj_weights()
    bq, bk, bv = m.proj_biases()
    q = (x @ wq.T + bq).view(2, 3, 4, 6).transpose(1, 2)  # (B, H, Lq, Dk)
    k = (mem @ wk.T + bk).view(2, 5, kv_heads, 6).transpose(1, 2)  # (B, Hkv, Lk, Dk)
    v = (mem @ wv.T + bv).view(2, 5, kv_heads, 5).transpose(1, 2)  # (B, Hkv, Lk, Dv)
    heads = mh.attention_reference(q, k, v, valid_lens=torch.tensor([5, 2]))
    expected = merge_heads(heads) @ m.out_proj.weight.T + m.out_proj.bias
    torch.testing.assert_close(m(x, mem, valid_lens=torch.tensor([5, 2])), expected, atol=1e-12, rtol=1e-12)
    assert m.in_proj_weight.shape == (4 * 6 + kv_heads * 6 + kv_heads * 5, 16)


class CountLinear(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.nn.functional.linear:
            self.calls += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize(("call", "expected"), [("self", 2), ("kv_shared", 3), ("separate", 4)])
def test_self_attention_uses_one_matmul_for_qkv(call, expected):
    m = mh.MultiHeadAttention(8, 2)
    x, y, z = torch.randn(1, 3, 8), torch.randn(1, 4, 8), torch.randn(1, 4, 8)
    args = {"self": (x,), "kv_shared": (x, y), "separate": (x, y, z)}[call]
    with CountLinear() as counter:
        m(*args)
    assert counter.calls == expected  # q/k/v projections + the output projection


def test_seed_shapes():
    assert mh.MultiHeadAttention(512, 8)(torch.rand(64, 5, 512)).shape == (64, 5, 512)
    d2l = mh.MultiHeadAttention(100, 5, bias=False).eval()
    x, y = torch.ones(2, 4, 100), torch.ones(2, 6, 100)
    out, w = d2l(x, y, y, valid_lens=torch.tensor([3, 2]), return_weights=True)
    assert out.shape == (2, 4, 100) and w.shape == (2, 5, 4, 6)
    assert w[0, :, :, 3:].abs().max() == 0 and w[1, :, :, 2:].abs().max() == 0
    torch.testing.assert_close(w.sum(-1), torch.ones(2, 5, 4))


def test_unbatched_input():
    m = mh.MultiHeadAttention(8, 2)
    x = torch.randn(3, 8)
    out, w = m(x, return_weights=True)
    assert out.shape == (3, 8) and w.shape == (2, 3, 3)
    torch.testing.assert_close(out, m(x[None])[0])


def test_dropout_only_in_training():
    m = mh.MultiHeadAttention(8, 2, dropout=0.5)
    x = torch.randn(2, 6, 8)
    m.eval()
    torch.testing.assert_close(m(x), m(x))
    m.train()
    assert not torch.allclose(m(x), m(x))


def test_factory_kwargs_and_repr():
    m = mh.MultiHeadAttention(8, 4, kv_heads=2, dtype=torch.float64, device="cpu")
    assert all(p.dtype == torch.float64 for p in m.parameters())
    assert "kv_heads=2" in repr(m)


# ----------------------------------------------------------------------------------------------
# The seam: every module's attention goes through multihead.nn.seam.attend
# ----------------------------------------------------------------------------------------------


class Spy:
    """An attention function that records its calls and computes the default attention."""

    def __init__(self):
        self.calls = []

    def __call__(self, q, k, v, **kwargs):
        self.calls.append(((tuple(q.shape), tuple(k.shape), tuple(v.shape)), kwargs))
        return mh.attention(q, k, v, **kwargs)


def test_attention_fn_gets_the_heads_and_every_keyword():
    torch.manual_seed(0)
    spy = Spy()
    m = mh.MultiHeadAttention(16, 4, kv_heads=2, kdim=6, vdim=6, dropout=0.25, attention_fn=spy)
    assert m.attention_fn is spy
    x, mem = torch.randn(2, 3, 16), torch.randn(2, 5, 6)
    mask, bias, lens = torch.ones(3, 5, dtype=torch.bool), torch.zeros(3, 5), torch.tensor([5, 2])
    m.eval()(x, mem, mem, mask=mask, bias=bias, valid_lens=lens, causal=True, return_weights=True)
    m.train()(x, mem, mem)
    (shapes, eval_kw), (_, train_kw) = spy.calls
    assert shapes == ((2, 4, 3, 4), (2, 2, 5, 4), (2, 2, 5, 4))  # q (B, H, Lq, D), k/v (B, Hkv, Lk, D)
    assert eval_kw["mask"] is mask and eval_kw["bias"] is bias and eval_kw["valid_lens"] is lens
    assert eval_kw["causal"] is True and eval_kw["return_weights"] is True and eval_kw["backend"] == "auto"
    assert eval_kw["dropout"] == 0.0 and train_kw["dropout"] == 0.25  # attention dropout only in training
    # every keyword of multihead.attention, None-valued ones included (the seam drops none)
    assert set(eval_kw) == set(inspect.signature(mh.attention).parameters) - {"q", "k", "v"}
    assert eval_kw["segment_ids"] is None and eval_kw["softcap"] is None and eval_kw["sinks"] is None


def test_attention_fn_result_is_what_the_module_uses():
    torch.manual_seed(0)
    m = mh.MultiHeadAttention(8, 2, attention_fn=lambda q, k, v, **kw: torch.zeros_like(q))
    x = torch.randn(2, 3, 8)
    torch.testing.assert_close(m(x), m.out_proj.bias.expand(2, 3, 8))  # zero heads -> out_proj(0) = bias
    m.attention_fn = mh.attention  # an attribute: swap it on a live module
    plain = mh.MultiHeadAttention(8, 2)
    plain.load_state_dict(m.state_dict())
    torch.testing.assert_close(m(x), plain(x))


def test_attention_fn_must_be_callable():
    with pytest.raises(
        TypeError, match="attention_fn must be a function with multihead.attention's signature"
    ):
        mh.MultiHeadAttention(8, 2, attention_fn="math")


def _sharded(q, k, v, **kwargs):
    return mh.attention(q, k, v, **kwargs)


_sharded.sharded = True  # what ring attention's ShardedAttention declares: inputs are per-rank shards


def test_a_sharded_attention_fn_is_refused_where_positions_are_per_call():
    with pytest.raises(ValueError, match="ring attention over sharded sequences cannot use rotary=True"):
        mh.MultiHeadAttention(8, 2, rotary=True, attention_fn=_sharded)
    m = mh.MultiHeadAttention(8, 2, attention_fn=_sharded)
    x = torch.randn(1, 3, 8)
    assert m(x).shape == (1, 3, 8)  # no positions per call: fine
    with pytest.raises(ValueError, match="cannot use a KV cache"):
        m(x, cache=mh.KVCache(), causal=True)


class Counter(seam.Inspector):
    """Counts the calls per module and checks what the seam hands it."""

    def __init__(self, wants_weights=False, scale=1.0):
        self.wants_weights, self.scale, self.seen = wants_weights, scale, []

    def on_heads(self, module, heads, weights):
        assert heads.dim() == 4 and (weights is not None or not self.wants_weights)
        self.seen.append(module)
        return heads * self.scale


def test_inspector_sees_each_call_and_can_change_the_heads():
    torch.manual_seed(0)
    m = mh.MultiHeadAttention(8, 2).eval()
    x = torch.randn(2, 3, 8)
    with torch.no_grad():
        y = m(x)
        with seam.inspecting(Counter(wants_weights=True)) as looking:
            out = m(x)  # weights computed for the inspector (it checks), not returned to the caller
            assert isinstance(out, torch.Tensor) and out.shape == (2, 3, 8)
        with seam.inspecting(Counter(scale=0.0)) as zeroing:
            torch.testing.assert_close(m(x), m.out_proj.bias.expand(2, 3, 8))  # gated heads change the output
        torch.testing.assert_close(m(x), y)  # and leaving the block leaves no trace
    assert looking.seen == [m] and zeroing.seen == [m]


def test_inspectors_nest_and_unwind_on_error():
    outer, inner = Counter(), Counter()
    with seam.inspecting(outer):
        with pytest.raises(RuntimeError, match="boom"), seam.inspecting(inner):
            assert seam.current() is inner
            raise RuntimeError("boom")
        assert seam.current() is outer
    assert seam.current() is None


def _modules_that_attend():
    torch.manual_seed(0)
    x = torch.randn(2, 4, 8)
    mha = mh.MultiHeadAttention(8, 2)
    torch_mha = compat_torch.MultiheadAttention(8, 2, batch_first=True)
    d2l_mha = compat_d2l.MultiHeadAttention(8, 8, 8, 8, 2, 0.0)
    layer = mh.TransformerEncoderLayer(8, 2, 16, dropout=0.0)
    return {
        "MultiHeadAttention": (mha, lambda: mha(x)),
        "compat.torch": (torch_mha, lambda: torch_mha(x, x, x)),
        "compat.d2l": (d2l_mha.attention, lambda: d2l_mha(x, x, x, None)),
        "TransformerEncoderLayer": (layer.self_attn, lambda: layer(x)),
    }


@pytest.mark.parametrize(
    "name", ["MultiHeadAttention", "compat.torch", "compat.d2l", "TransformerEncoderLayer"]
)
def test_every_module_that_attends_goes_through_the_seam(name):
    """The inspector sees the call (with the module that attends), and a replaced attention_fn runs."""
    holder, run = _modules_that_attend()[name]
    spy = Spy()
    holder.attention_fn = spy
    with torch.no_grad(), seam.inspecting(Counter()) as counter:
        run()
    assert counter.seen == [holder]
    assert len(spy.calls) == 1
