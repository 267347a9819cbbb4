"""multihead.compat.d2l against the d2l book's multi-head attention, written out here as the oracle."""

import math

import pytest
import torch

from multihead.compat.d2l import DotProductAttention, MultiHeadAttention

B, LQ, LK, P, H = 2, 4, 6, 100, 5  # d2l's example: 2 x 4 queries, 6 key-value pairs, 100 hiddens, 5 heads


# ---- the d2l book's code (PyTorch edition), the behaviour users come from --------------------------
def d2l_masked_softmax(x, valid_lens):
    if valid_lens is None:
        return torch.softmax(x, dim=-1)
    shape = x.shape
    if valid_lens.dim() == 1:
        valid_lens = torch.repeat_interleave(valid_lens, shape[1])
    else:
        valid_lens = valid_lens.reshape(-1)
    x = x.reshape(-1, shape[-1]).clone()
    mask = torch.arange(shape[-1], dtype=torch.float32)[None, :] < valid_lens[:, None]
    x[~mask] = -1e6
    return torch.softmax(x.reshape(shape), dim=-1)


def d2l_dot_product(q, k, v, valid_lens):
    scores = torch.bmm(q, k.transpose(1, 2)) / math.sqrt(q.shape[-1])
    w = d2l_masked_softmax(scores, valid_lens)
    return torch.bmm(w, v), w


def transpose_qkv(x, h):
    x = x.reshape(x.shape[0], x.shape[1], h, -1).permute(0, 2, 1, 3)
    return x.reshape(-1, x.shape[2], x.shape[3])


def transpose_output(x, h):
    x = x.reshape(-1, h, x.shape[1], x.shape[2]).permute(0, 2, 1, 3)
    return x.reshape(x.shape[0], x.shape[1], -1)


def d2l_mha(layer, queries, keys, values, valid_lens):
    q, k, v = (
        transpose_qkv(w(x), H) for w, x in ((layer.W_q, queries), (layer.W_k, keys), (layer.W_v, values))
    )
    if valid_lens is not None:
        valid_lens = torch.repeat_interleave(valid_lens, repeats=H, dim=0)
    out, w = d2l_dot_product(q, k, v, valid_lens)
    return layer.W_o(transpose_output(out, H)), w


# -----------------------------------------------------------------------------------------------------


def _data(seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, LQ, P, generator=g), torch.randn(B, LK, P, generator=g)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize(
    "valid_lens",
    [None, torch.tensor([3, 2]), torch.tensor([[1, 2, 3, 6], [6, 4, 2, 1]]), torch.tensor([3.0, 2.0])],
    ids=["none", "B", "B_Lq", "float_B"],
)
def test_matches_d2l(valid_lens, bias):
    torch.manual_seed(0)
    layer = MultiHeadAttention(P, P, P, P, H, 0.5, bias=bias, keep_weights=True).eval()
    x, y = _data()
    with torch.no_grad():
        ours = layer(x, y, y, valid_lens)
        ref, ref_w = d2l_mha(layer, x, y, y, valid_lens)
    assert ours.shape == (B, LQ, P)
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(layer.attention.attention_weights, ref_w, atol=1e-6, rtol=1e-5)
    mh = layer.to_multihead().eval()
    lens = None if valid_lens is None else valid_lens.ceil().long()
    torch.testing.assert_close(mh(x, y, y, valid_lens=lens), ours, atol=1e-5, rtol=1e-5)


def test_zero_valid_len_gives_zeros_where_d2l_attends_uniformly():
    torch.manual_seed(0)
    layer = MultiHeadAttention(P, P, P, P, H, 0.0).eval()
    x, y = _data(1)
    lens = torch.tensor([[0, 2, 3, 6], [6, 4, 2, 0]])
    with torch.no_grad():
        ours = layer(x, y, y, lens)
        ref, ref_w = d2l_mha(layer, x, y, y, lens)
    dead = lens == 0
    assert torch.equal(ours[dead], torch.zeros_like(ours[dead]))  # bias=False: zero heads -> zero output
    torch.testing.assert_close(ref_w.view(B, H, LQ, LK)[:, :, 0][0], torch.full((H, LK), 1 / LK))  # uniform
    torch.testing.assert_close(ours[~dead], ref[~dead], atol=1e-5, rtol=1e-5)


def test_weights_only_on_request():
    layer = MultiHeadAttention(P, P, P, P, H, 0.0)
    x, y = _data()
    layer(x, y, y, torch.tensor([3, 2]))
    with pytest.raises(RuntimeError, match="keep_weights=True"):
        _ = layer.attention.attention_weights
    layer.attention.keep_weights = True
    layer(x, y, y, torch.tensor([3, 2]))
    assert layer.attention.attention_weights.shape == (B * H, LQ, LK)


def test_dot_product_attention_matches_d2l():
    g = torch.Generator().manual_seed(3)
    q, k, v = torch.randn(2, 1, 2, generator=g), torch.ones(2, 10, 2), torch.randn(2, 10, 4, generator=g)
    lens = torch.tensor([2, 6])
    att = DotProductAttention(0.5, keep_weights=True).eval()
    ref, ref_w = d2l_dot_product(q, k, v, lens)
    torch.testing.assert_close(att(q, k, v, lens), ref, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(att.attention_weights, ref_w, atol=1e-6, rtol=1e-5)


def test_state_dict_uses_d2l_names():
    layer = MultiHeadAttention(3, 4, 5, 10, 2, 0.1, bias=True)
    assert list(layer.state_dict()) == [f"W_{n}.{p}" for n in "qkvo" for p in ("weight", "bias")]
    with pytest.raises(ValueError, match="divisible"):
        MultiHeadAttention(3, 4, 5, 10, 3, 0.1)


# ---- d2l 1.0's constructor: MultiHeadAttention(num_hiddens, num_heads, dropout, bias=False), lazy sizes ----


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("sizes", [(P, P), (7, 9)], ids=["same", "other_sizes"])
def test_d2l_1_0_form_matches_d2l(sizes, bias):
    torch.manual_seed(0)
    eq, ekv = sizes
    layer = MultiHeadAttention(P, H, 0.5, bias=bias, keep_weights=True).eval()
    assert isinstance(layer.W_q, torch.nn.LazyLinear)  # input sizes come from the first call, as in d2l 1.0
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(B, LQ, eq, generator=g), torch.randn(B, LK, ekv, generator=g)
    lens = torch.tensor([3, 2])
    with torch.no_grad():
        ours = layer(x, y, y, lens)
        ref, ref_w = d2l_mha(layer, x, y, y, lens)
    assert layer.W_q.weight.shape == (P, eq) and layer.W_k.weight.shape == (P, ekv)
    assert layer.W_o.weight.shape == (P, P) and (layer.W_o.bias is not None) == bias
    assert ours.shape == (B, LQ, P)
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(layer.attention.attention_weights, ref_w, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize(
    "args, kwargs",
    [((P, H, 0.0), {}), ((), {"num_hiddens": P, "num_heads": H, "dropout": 0.0}), ((P, H), {"dropout": 0.0})],
    ids=["positional", "keywords", "mixed"],
)
def test_both_forms_hold_the_same_weights_and_semantics(args, kwargs):
    torch.manual_seed(0)
    old = MultiHeadAttention(P, P, P, P, H, 0.0).eval()
    new = MultiHeadAttention(*args, **kwargs).eval()
    x, y = _data(2)
    lens = torch.tensor([[1, 2, 3, 6], [6, 4, 2, 1]])
    with torch.no_grad():
        new(x, y, y)  # materialise the lazy layers, then take the old form's weights
    assert list(new.state_dict()) == list(old.state_dict())
    new.load_state_dict(old.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(new(x, y, y, lens), old(x, y, y, lens))
        torch.testing.assert_close(new.to_multihead()(x, y, y, valid_lens=lens), old(x, y, y, lens))


def test_old_form_by_keywords_and_bad_calls():
    layer = MultiHeadAttention(
        key_size=3, query_size=4, value_size=5, num_hiddens=10, num_heads=2, dropout=0.1
    )
    assert layer.W_q.weight.shape == (10, 4) and layer.W_k.weight.shape == (10, 3)
    assert layer.W_v.weight.shape == (10, 5) and layer.W_o.weight.shape == (10, 10)
    with pytest.raises(TypeError, match=r"num_hiddens, num_heads, dropout, bias=False"):
        MultiHeadAttention(10, 2)  # no dropout: names both forms
    with pytest.raises(TypeError, match="key_size"):
        MultiHeadAttention(3, 4, 5, 10, 2)
    with pytest.raises(TypeError, match="unexpected keyword"):
        MultiHeadAttention(10, 2, 0.1, heads=2)
    with pytest.raises(ValueError, match="divisible"):
        MultiHeadAttention(10, 3, 0.1)
    with pytest.raises(ValueError, match="forward pass first"):
        MultiHeadAttention(10, 2, 0.1).to_multihead()
