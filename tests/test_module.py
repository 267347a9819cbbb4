"""MultiHeadAttention: shapes, GQA, fused projections and exact parity with torch.nn.MultiheadAttention."""

import pytest
import torch
from torch import nn
from torch.overrides import TorchFunctionMode

import multihead as mh
from multihead.nn import merge_heads


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
