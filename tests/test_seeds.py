"""The seeds' examples run; their three projection weight formats agree; each erratum in docs/seeds.md is shown."""

import runpy
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from seed_shapes import SEED002_SHAPE_LINES
from torch import nn

import multihead as mh
from multihead.compat import weights
from multihead.nn import merge_heads, split_heads

EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "seeds"
E, H, D, B, L = 12, 3, 4, 2, 5


def _run_example(name, capsys, argv=()):
    module = runpy.run_path(str(EXAMPLES / name))  # defines main() without running it
    result = module["main"](list(argv))
    return result, capsys.readouterr().out


# ---- every example runs and prints what its notebook printed ----------------------------------------


def test_seed000_example(capsys):
    out, printed = _run_example("seed000_keras_mha.py", capsys)
    assert out.shape == (64, 5, 512) and torch.isfinite(out).all()
    assert "torch.Size([64, 5, 512])" in printed and "finite: True" in printed


def test_seed001_example(capsys):
    out, printed = _run_example("seed001_torch_from_scratch.py", capsys)
    assert printed.count("torch.Size([2, 5, 64]) torch.Size([2, 5, 64]) torch.Size([2, 5, 64])") == 8
    assert "MultiHeadAttention(q, kv): torch.Size([2, 5, 512])" in printed
    assert out.shape == (2, 5, 512)


def test_seed002_example(capsys):
    out, printed = _run_example("seed002_tf_fused_qkv.py", capsys)
    for line in SEED002_SHAPE_LINES:
        assert line in printed
    assert out.shape == (30, 4, 512)


def test_seed003_and_004_examples(capsys):
    out3, printed3 = _run_example("seed003_d2l_djl.py", capsys)
    out4, printed4 = _run_example("seed004_d2l_tf.py", capsys)
    assert "(2, 4, 100)" in printed3 and "torch.Size([2, 4, 100])" in printed4
    assert "attention_weights: (10, 4, 6)" in printed4
    torch.testing.assert_close(out3, out4)  # float valid_lens [3., 2.] == int [3, 2]; same seed, same layer


# ---- the three projection weight formats ------------------------------------------------------------------


def _weights(seed=0):
    g = torch.Generator().manual_seed(seed)
    w = [torch.randn(H * D, E, generator=g) / E**0.5 for _ in range(3)] + [torch.randn(E, H * D, generator=g)]
    b = [torch.randn(H * D, generator=g) for _ in range(3)] + [torch.randn(E, generator=g)]
    return weights.SharedWeights(*w, *b)


def shared_forward(w, q, kv):
    """Seeds 000 / d2l, fixed: one projection each, reshape to heads, attention, transpose back."""

    def heads(x, wt, bt):
        return F.linear(x, wt, bt).reshape(x.shape[0], x.shape[1], H, D).permute(0, 2, 1, 3)

    qh, kh, vh = heads(q, w.w_q, w.b_q), heads(kv, w.w_k, w.b_k), heads(kv, w.w_v, w.b_v)
    att = torch.softmax(qh @ kh.transpose(-1, -2) / D**0.5, -1) @ vh
    return F.linear(att.permute(0, 2, 1, 3).reshape(q.shape[0], q.shape[1], H * D), w.w_o, w.b_o)


def per_head_forward(p, q, kv):
    """Seed 001, fixed: one Linear per head, attention per head, concatenate the list (not [list])."""
    outs = []
    for wq, wk, wv, bq, bk, bv in zip(p.w_q, p.w_k, p.w_v, p.b_q, p.b_k, p.b_v):
        qi, ki, vi = F.linear(q, wq, bq), F.linear(kv, wk, bk), F.linear(kv, wv, bv)
        outs.append(torch.softmax(qi @ ki.transpose(-1, -2) / D**0.5, -1) @ vi)
    return F.linear(torch.cat(outs, -1), p.w_o, p.b_o)


def fused_forward(f, x):
    """Seed 002, fixed: fused projection, per-head [q k v] split, transpose before the merge."""
    qkv = F.linear(x, f.w_qkv, f.b_qkv).reshape(x.shape[0], x.shape[1], H, 3 * D).permute(0, 2, 1, 3)
    q, k, v = qkv.chunk(3, dim=-1)
    att = torch.softmax(q @ k.transpose(-1, -2) / D**0.5, -1) @ v  # (B, H, L, D)
    return F.linear(att.transpose(1, 2).reshape(x.shape[0], x.shape[1], H * D), f.w_o, f.b_o)


def test_three_weight_formats_give_the_same_output_for_the_same_weights():
    w = _weights()
    state = weights.from_shared(w)
    mha = weights.module_from_state(state, H).eval()
    per_head, fused = weights.to_per_head(state, H), weights.to_fused(state, H)
    x = torch.randn(B, L, E, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = mha(x)
        for other in (shared_forward(w, x, x), per_head_forward(per_head, x, x), fused_forward(fused, x)):
            torch.testing.assert_close(other, ours, atol=1e-5, rtol=1e-5)
    # the converters are inverses, and the fused layout is a real permutation of the library's rows
    back = weights.from_fused(fused, H)
    for k in state:
        assert torch.equal(back[k], state[k]) and torch.equal(weights.from_per_head(per_head)[k], state[k])
    assert not torch.equal(fused.w_qkv, state["in_proj_weight"])


def test_weight_formats_with_other_key_value_sizes_and_no_bias():
    g = torch.Generator().manual_seed(2)
    w = weights.SharedWeights(*(torch.randn(H * D, n, generator=g) for n in (E, 7, 9)), torch.randn(E, H * D))
    mha = weights.module_from_state(weights.from_shared(w), H)
    assert (mha.kdim, mha.vdim, mha.in_proj_bias) == (7, 9, None)
    q, k, v = torch.randn(B, L, E), torch.randn(B, 6, 7), torch.randn(B, 6, 9)
    ref = mh.attention_reference(
        *(F.linear(x, wt).unflatten(-1, (H, D)).transpose(1, 2) for x, wt in zip((q, k, v), w[:3]))
    )
    torch.testing.assert_close(mha(q, k, v), F.linear(merge_heads(ref), w.w_o), atol=1e-5, rtol=1e-5)
    assert all(torch.equal(a, b) for a, b in zip(weights.to_shared(mha.state_dict())[:4], w[:4]))


# ---- errata (docs/seeds.md) ------------------------------------------------------------------------


def test_000_heads_come_from_the_argument_and_projections_are_d_model_wide():
    for heads in (4, 8):
        m = mh.MultiHeadAttention(512, heads)
        assert m.head_dim == 512 // heads  # the notebook used the global h = 8 whatever n_heads was
        assert m.in_proj_weight.shape == (3 * 512, 512)  # d_model wide, not d_k = 64 wide


def test_000_a_0_1_float_mask_is_refused_and_a_bool_mask_hides_keys_exactly():
    """The notebook's ``scores += -inf * mask`` turns every 0 entry into NaN. The library refuses a 0/1
    float mask with the fix, and a bool mask gives each query the softmax over its allowed keys only."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 3, D, generator=g, dtype=torch.float64) for _ in range(3))  # (B, H, L, D)
    zero_one = torch.tensor([[1.0, 0.0, 0.0], [1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    with pytest.raises(ValueError, match=r"must be a bool tensor.*`bias=`"):
        mh.attention(q, k, v, mask=zero_one)
    out, w = mh.attention(q, k, v, mask=zero_one.bool(), return_weights=True)
    assert torch.isfinite(out).all()
    for i, allowed in enumerate(zero_one.bool()):  # row i, from the allowed keys alone
        scores = q[..., i : i + 1, :] @ k[..., allowed, :].transpose(-1, -2) / D**0.5  # (B, H, 1, n)
        p = torch.softmax(scores, dim=-1)
        torch.testing.assert_close(out[..., i : i + 1, :], p @ v[..., allowed, :])
        torch.testing.assert_close(w[..., i : i + 1, allowed], p)
        assert not w[..., i, ~allowed].any()  # hidden keys: weight exactly 0


def test_001_merge_heads_is_the_concatenation_of_the_heads():
    """The notebook meant ``torch.cat(head_outputs, -1)``; ``merge_heads`` is that, and ``split_heads``
    undoes it."""
    heads = [torch.randn(B, L, D) for _ in range(H)]
    stacked = torch.stack(heads, 1)  # (B, H, L, D)
    merged = merge_heads(stacked)  # (B, L, H*D)
    assert torch.equal(merged, torch.cat(heads, -1))
    assert torch.equal(split_heads(merged, H), stacked)


def test_001_no_unused_parameters_and_the_mask_is_used():
    m = mh.MultiHeadAttention(E, H)
    q = torch.randn(B, L, E)
    kv = torch.randn(B, L, E, requires_grad=True)
    out = m(q, kv, valid_lens=torch.tensor([2, 5]))
    grads = torch.autograd.grad(out.sum(), [kv, *m.parameters()])
    assert all(g is not None and g.abs().sum() > 0 for g in grads[1:])  # no dead LayerNorm-style weights
    assert torch.equal(grads[0][0, 2:], torch.zeros_like(grads[0][0, 2:]))  # masked keys: no influence


def test_001_encoder_layer_is_a_module_with_all_its_weights(capsys):
    module = runpy.run_path(str(EXAMPLES / "seed001_torch_from_scratch.py"))
    layer = module["EncoderLayer"](2, 8, d_ff=16)
    assert isinstance(layer, nn.Module)
    names = {n.split(".")[0] for n, _ in layer.named_parameters()}
    assert names == {"mha", "norm1", "norm2", "feed_forward"}  # LayerNorms used and registered
    assert any(isinstance(m, nn.ReLU) for m in layer.feed_forward)


def test_002_merge_without_transpose_mixes_positions():
    torch.manual_seed(0)
    mha = mh.MultiHeadAttention(E, H).eval()
    q, kv = torch.randn(B, L, E), torch.randn(B, L + 1, E)
    q2 = q.clone()
    q2[:, 0] += 5.0  # change query position 0 only

    def notebook_merge(x):
        qh, kh, vh = mha.project(x, kv, kv)
        att = mh.attention(qh, kh, vh)  # (B, H, L, D)
        return mha.out_proj(att.reshape(B, L, H * D))  # the notebook: no transpose

    with torch.no_grad():
        ours, ours2 = mha(q, kv), mha(q2, kv)
        bug, bug2 = notebook_merge(q), notebook_merge(q2)
    torch.testing.assert_close(ours[:, 1:], ours2[:, 1:])  # other positions untouched
    assert not torch.allclose(bug[:, 1:], bug2[:, 1:])  # the notebook leaks position 0 into others
