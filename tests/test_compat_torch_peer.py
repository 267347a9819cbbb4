"""The behaviours PyTorch's own ``test/nn/test_multihead_attention.py`` checks, on the torch drop-in.

Each test here covers one behaviour that file checks of ``torch.nn.MultiheadAttention`` (written anew, not
copied), on :class:`multihead.compat.torch.MultiheadAttention`, against torch's class or its functional form
holding the same weights. ``benchmarks/peer_torch_mha.py`` runs PyTorch's file itself against the drop-in.
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from multihead.compat.torch import MaskDtypeError, MultiheadAttention, MultiheadAttentionError

E, H, N, L, S = 8, 4, 3, 2, 5


def _pair(*args, **kwargs):
    ref = nn.MultiheadAttention(*args, **kwargs)
    return ref, MultiheadAttention.from_torch(ref)


def _functional(m, q, k, v, **kwargs):
    """torch's functional form, driven by the module's own attributes (as torch's test drives it)."""
    separate = not m._qkv_same_embed_dim
    return F.multi_head_attention_forward(
        q, k, v, m.embed_dim, m.num_heads, m.in_proj_weight, m.in_proj_bias, m.bias_k, m.bias_v,
        m.add_zero_attn, m.dropout, m.out_proj.weight, m.out_proj.bias, training=m.training,
        use_separate_proj_weight=separate, q_proj_weight=m.q_proj_weight, k_proj_weight=m.k_proj_weight,
        v_proj_weight=m.v_proj_weight, **kwargs,
    )  # fmt: skip


# ---- the module's attributes are torch's: its functional form computes what the module does --------------


@pytest.mark.parametrize("average", [True, False])
@pytest.mark.parametrize(
    "flags",
    [
        {},
        {"add_bias_kv": True},
        {"add_zero_attn": True},
        {"kdim": 5, "vdim": 7},
        {"add_bias_kv": True, "kdim": 5, "vdim": 5},
    ],
    ids=["plain", "bias_kv", "zero_attn", "kdim", "bias_kv+kdim"],
)
@pytest.mark.parametrize("masks", ["none", "kpm", "float_mask+kpm"])
def test_functional_form_over_the_modules_attributes(flags, average, masks):
    torch.manual_seed(0)
    m = MultiheadAttention(E, H, **flags)
    q = torch.randn(1, N, E)  # (L=1, N, E): one decoder state per batch element, as torch's test
    kv = torch.randn(S, N, flags.get("kdim", E))
    v = kv if flags.get("vdim") is None else torch.randn(S, N, flags["vdim"])
    kw = {}
    if masks != "none":
        kpm = torch.tensor([[False, True, False, False, True]]).expand(N, S)  # the same padding for all rows
        kw["key_padding_mask"] = kpm
    if masks == "float_mask+kpm":
        kw["attn_mask"] = torch.tensor([[0.0, 0.0, float("-inf"), 0.0, 0.0]])  # (1, S)
    out, w = m(q, kv, v, average_attn_weights=average, **kw)
    ref_out, ref_w = _functional(m, q, kv, v, average_attn_weights=average, **kw)
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(w, ref_w, atol=1e-5, rtol=1e-5)
    extra = int(bool(flags.get("add_bias_kv"))) + int(bool(flags.get("add_zero_attn")))
    assert w.shape == ((N, 1, S + extra) if average else (N, H, 1, S + extra))


def test_3d_attn_mask_is_one_mask_per_batch_element_and_head():
    torch.manual_seed(0)
    m = MultiheadAttention(E, H)
    q, k = torch.rand(L, N, E), torch.rand(S, N, E)
    per_sample = torch.randint(0, 2, (N, L, S)).float()
    per_sample[..., 0] = 1  # every query keeps a key
    per_sample = per_sample.masked_fill(per_sample == 0, float("-inf")).masked_fill(per_sample == 1, 0.0)
    out = m(q, k, k, attn_mask=per_sample.repeat_interleave(H, dim=0))[0]  # (N*H, L, S)
    for i in range(N):
        one = m(q[:, i : i + 1], k[:, i : i + 1], k[:, i : i + 1], attn_mask=per_sample[i])[0]  # (L, 1, E)
        torch.testing.assert_close(out[:, i : i + 1], one, atol=1e-6, rtol=1e-5)


def test_bias_false_means_no_bias_anywhere():
    m = MultiheadAttention(E, H, bias=False)
    assert m.in_proj_bias is None and m.out_proj.bias is None


# ---- invalid shapes: torch's AssertionError and its text, the library's ValueError and its fix -------------

Q3, Q2 = torch.randn(4, 4, 4), torch.randn(4, 4)
BAD = {
    "batched_2d_key": (
        (Q3, torch.randn(4, 4), Q3),
        {},
        "expected `key` and `value` to be 3-D but found 2-D and 3-D",
    ),
    "batched_2d_value": (
        (Q3, Q3, torch.randn(4, 4)),
        {},
        "to be 3-D but found 3-D and 2-D tensors respectively",
    ),
    "batched_1d_kpm": (
        (Q3, Q3, Q3),
        {"key_padding_mask": torch.tensor([False, False, True, True])},
        "expected `key_padding_mask` to be `None` or 2-D but found 1-D tensor instead",
    ),
    "batched_1d_attn_mask": (
        (Q3, Q3, Q3),
        {"attn_mask": torch.tensor([False, False, True, True])},
        "expected `attn_mask` to be `None`, 2-D or 3-D but found 1-D tensor instead",
    ),
    "unbatched_3d_key": ((Q2, Q3, Q2), {}, "expected `key` and `value` to be 2-D but found 3-D and 2-D"),
    "unbatched_3d_value": ((Q2, Q2, Q3), {}, "expected `key` and `value` to be 2-D but found 2-D and 3-D"),
    "unbatched_2d_kpm": (
        (Q2, Q2, Q2),
        {"key_padding_mask": torch.zeros(1, 8, dtype=torch.bool)},
        "expected `key_padding_mask` to be `None` or 1-D but found 2-D tensor instead",
    ),
    "unbatched_1d_attn_mask": (
        (Q2, Q2, Q2),
        {"attn_mask": torch.tensor([False, False, True, True])},
        "expected `attn_mask` to be `None`, 2-D or 3-D but found 1-D tensor instead",
    ),
    "unbatched_3d_attn_mask_shape": (
        (Q2, Q2, Q2),
        {"attn_mask": torch.zeros(5, 4, 4, dtype=torch.bool)},
        r"Expected `attn_mask` shape to be \(4, 4, 4\)",
    ),
    "1d_query": (
        (torch.randn(4),) * 3,
        {},
        "query should be unbatched 2D or batched 3D tensor but received 1-D",
    ),
    "embed_dim": ((torch.randn(4, 4, 3),) * 3, {}, "was expecting embedding dimension of 4, but got 3"),
}


@pytest.mark.parametrize("case", list(BAD))
@pytest.mark.parametrize("mode", ["train", "eval_no_grad", "batch_first_no_weights"])
def test_invalid_shapes_raise_torchs_type_and_text_and_ours(case, mode):
    (q, k, v), kwargs, text = BAD[case]
    ref, ours = _pair(4, 4, batch_first=mode == "batch_first_no_weights")
    if mode != "train":
        ref.eval(), ours.eval()
    if mode == "batch_first_no_weights":
        kwargs = {**kwargs, "need_weights": False}
    with torch.no_grad() if mode != "train" else torch.enable_grad():
        if mode != "batch_first_no_weights":  # there torch's fast path may fail first, with other errors
            with pytest.raises(AssertionError, match=text):  # what code written against torch catches ...
                ref(q, k, v, **kwargs)
        with pytest.raises(AssertionError, match=text) as caught:  # ... catches ours too
            ours(q, k, v, **kwargs)
    assert isinstance(caught.value, ValueError) and isinstance(caught.value, MultiheadAttentionError)
    assert len(str(caught.value)) > len(text) + 20  # torch's text, then what to do about it


# ---- nested tensors: real tokens only, a nested output ---------------------------------------------------


def _nested(lengths, dim, layout, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.nested.nested_tensor([torch.randn(n, dim, generator=g) for n in lengths], layout=layout)


def _per_sequence(m, q, k, v, **kwargs):
    """The oracle: each sequence alone, as a dense batch of one."""
    outs, ws = [], []
    for qi, ki, vi in zip(q.unbind(), k.unbind(), v.unbind()):
        out, w = m(qi[None], ki[None], vi[None], **kwargs)
        outs.append(out[0])
        ws.append(None if w is None else w[0])
    return outs, ws


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
@pytest.mark.parametrize("layout", [torch.jagged, torch.strided], ids=["jagged", "strided"])
@pytest.mark.parametrize(
    "flags",
    [{}, {"add_bias_kv": True}, {"add_zero_attn": True}, {"add_bias_kv": True, "add_zero_attn": True}],
    ids=["plain", "bias_kv", "zero_attn", "both"],
)
@pytest.mark.parametrize("kv", ["self", "cross"])
@pytest.mark.parametrize("need_weights", [True, False], ids=["weights", "packed"])
def test_nested_inputs_attend_over_real_tokens_only(layout, flags, kv, need_weights):
    torch.manual_seed(0)
    m = MultiheadAttention(10, 5, batch_first=True, **flags).eval()  # 5 heads: odd, torch refuses nested here
    q = _nested([4, 6], 10, layout, 1)
    k, v = (q, q) if kv == "self" else (_nested([7, 3], 10, layout, 2), _nested([7, 3], 10, layout, 3))
    out, w = m(q, k, v, need_weights=need_weights, average_attn_weights=False)
    assert out.is_nested and out.layout == layout
    outs, ws = _per_sequence(m, q, k, v, average_attn_weights=False)
    for o, ref in zip(out.unbind(), outs):
        torch.testing.assert_close(o, ref, atol=1e-6, rtol=1e-5)
    if not need_weights:
        assert w is None
        return
    extra = int(bool(flags.get("add_bias_kv"))) + int(bool(flags.get("add_zero_attn")))
    assert w.shape == (2, 5, 6, max(t.shape[0] for t in k.unbind()) + extra)  # dense, padded like torch's
    for i, wi in enumerate(ws):
        lq, lk = wi.shape[-2:]
        torch.testing.assert_close(w[i, :, :lq, :lk], wi, atol=1e-6, rtol=1e-5)
        assert not w[i, :, lq:].any() and not w[i, :, :, lk:].any()  # zeros outside the sequence's block


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
def test_nested_without_weights_is_one_packed_call_with_segment_ids():
    import multihead as mh

    calls = []

    def spy(q, k, v, **kwargs):
        calls.append((tuple(q.shape), tuple(k.shape), kwargs.get("segment_ids")))
        return mh.attention(q, k, v, **kwargs)

    m = MultiheadAttention(E, H, batch_first=True, add_zero_attn=True)
    m.attention_fn = spy
    q = _nested([2, 5, 3], E, torch.jagged, 8)
    m(q, q, q, need_weights=False)
    ((q_shape, k_shape, (q_ids, kv_ids)),) = calls  # one call for the whole batch
    assert q_shape == (1, H, 10, E // H) and k_shape == (
        1,
        H,
        10 + 3,
        E // H,
    )  # sum of L_i, + a zero key each
    assert q_ids.tolist() == [[0, 0, 1, 1, 1, 1, 1, 2, 2, 2]]
    assert kv_ids.tolist() == [[0, 0, 1, 1, 1, 1, 1, 2, 2, 2, 0, 1, 2]]


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
def test_nested_padding_never_leaks_and_gradients_flow():
    torch.manual_seed(0)
    m = MultiheadAttention(E, H, batch_first=True, dropout=0.0)
    q = _nested([2, 5, 3], E, torch.jagged, 4).requires_grad_(True)
    out, _ = m(q, q, q, need_weights=False)
    dense = q.to_padded_tensor(0.0)  # (N, 5, E), the same tokens with padding
    pad = torch.arange(5)[None, :] >= torch.tensor([2, 5, 3])[:, None]  # (N, 5), True = padding
    ref, _ = m(dense, dense, dense, key_padding_mask=pad, need_weights=False)
    torch.testing.assert_close(out.to_padded_tensor(0.0)[~pad], ref[~pad], atol=1e-6, rtol=1e-5)
    (grad,) = torch.autograd.grad(out.values().sum(), m.in_proj_weight)
    (ref_grad,) = torch.autograd.grad(ref[~pad].sum(), m.in_proj_weight)
    torch.testing.assert_close(grad, ref_grad, atol=1e-5, rtol=1e-5)


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
@pytest.mark.parametrize("need_weights", [True, False])
def test_nested_matches_torchs_fast_path_where_torch_takes_it(need_weights):
    ref, ours = _pair(10, 2, batch_first=True)
    ref.eval(), ours.eval()
    q = _nested([4, 6], 10, torch.strided, 5)
    with torch.no_grad():
        a_out, a_w = ref(q, q, q, need_weights=need_weights)
        b_out, b_w = ours(q, q, q, need_weights=need_weights)
        with torch.inference_mode():
            c_out, _ = ours(q, q, q, need_weights=need_weights)
    torch.testing.assert_close(b_out.to_padded_tensor(0.0), a_out.to_padded_tensor(0.0), atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(c_out.to_padded_tensor(0.0), a_out.to_padded_tensor(0.0), atol=1e-6, rtol=1e-5)
    assert (b_w is None) == (a_w is None)
    if a_w is not None:
        torch.testing.assert_close(b_w, a_w, atol=1e-6, rtol=1e-5)


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
def test_nested_misuse_is_refused_by_name():
    m = MultiheadAttention(10, 5, batch_first=True)
    q = _nested([4, 6], 10, torch.jagged, 6)
    with pytest.raises(
        AssertionError, match="query should be unbatched 2D or batched 3D tensor but received 1-D"
    ):
        empty = torch.nested.nested_tensor([])
        m(empty, empty, empty)
    with pytest.raises(MultiheadAttentionError, match="key_padding_mask"):
        m(q, q, q, key_padding_mask=torch.zeros(2, 6, dtype=torch.bool))
    with pytest.raises(MultiheadAttentionError, match="batch_first=True"):
        MultiheadAttention(10, 5)(q, q, q)
    with pytest.raises(MultiheadAttentionError, match="all nested"):
        m(q, torch.randn(2, 6, 10), torch.randn(2, 6, 10))
    with pytest.raises(MultiheadAttentionError, match="same number of sequences"):
        k = _nested([4, 6, 1], 10, torch.jagged, 7)
        m(q, k, k)


# ---- the two masks together on torch's fast path (eval, no grad) ------------------------------------------


def test_attn_mask_and_key_padding_together_in_inference():
    torch.manual_seed(0)
    ref, ours = _pair(14, 7, batch_first=True)
    ref.eval(), ours.eval()
    x = torch.rand(8, S, 14)
    am = torch.randint(0, 2, (S, S)).bool()
    kpm = torch.randint(0, 2, (8, S)).bool()
    dead = (am[None] | kpm[:, None, :]).all(-1)  # (N, L): rows with no key, NaN in torch, 0 here
    with torch.no_grad():
        a = ref(x, x, x, attn_mask=am, key_padding_mask=kpm)[0]
        b = ours(x, x, x, attn_mask=am, key_padding_mask=kpm)[0]
        ref_slow = _functional(
            ref, *(x.transpose(0, 1),) * 3, attn_mask=am, key_padding_mask=kpm, need_weights=False
        )[0].transpose(0, 1)
    torch.testing.assert_close(b[~dead], a[~dead], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(b[~dead], ref_slow[~dead], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(b[dead], ours.out_proj.bias.expand_as(b[dead]))  # zero heads: only the bias


# ---- dtypes ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("batch_first", [False, True])
@pytest.mark.parametrize("training", [True, False])
def test_output_keeps_the_modules_dtype(dtype, batch_first, training):
    m = MultiheadAttention(16, 4, batch_first=batch_first).to(dtype).train(training)
    x = torch.randn(3, 5, 16, dtype=dtype)
    with torch.no_grad() if not training else torch.enable_grad():
        out, w = m(x, x, x, need_weights=False)
    assert out.dtype == dtype and out.shape == x.shape and w is None


@pytest.mark.parametrize("grad", [False, True])
def test_projection_bias_in_another_dtype_is_promoted_like_torch(grad):
    ref, ours = _pair(4, 4, batch_first=True, dtype=torch.float64)
    ref.eval(), ours.eval()
    for m in (ref, ours):
        m.in_proj_bias = nn.Parameter(ref.in_proj_bias.detach().half())
    q = torch.randn(4, 4, 4, dtype=torch.float64)
    with torch.no_grad() if not grad else torch.enable_grad():
        a, b = ref(q, q, q), ours(q, q, q)
        c = ours(q, torch.randn(4, 6, 4, dtype=torch.float64), torch.randn(4, 6, 4, dtype=torch.float64))
    assert b[0].dtype == torch.float64 and c[0].dtype == torch.float64
    torch.testing.assert_close(b[0], a[0])
    torch.testing.assert_close(b[1], a[1])


@pytest.mark.parametrize("name", ["attn_mask", "key_padding_mask"])
@pytest.mark.parametrize("need_weights", [True, False])
def test_float_mask_in_another_dtype_is_refused_like_torch(name, need_weights):
    ref, ours = _pair(4, 2, batch_first=True, dtype=torch.float64)
    q = torch.randn(3, 4, 4, dtype=torch.float64)
    mask = torch.zeros((4, 4) if name == "attn_mask" else (3, 4), dtype=torch.float16)
    with pytest.raises(RuntimeError):
        ref(q, q, q, need_weights=need_weights, **{name: mask})
    with pytest.raises(RuntimeError, match=rf"{name}.to\(torch.float64\)") as caught:
        ours(q, q, q, need_weights=need_weights, **{name: mask})
    assert isinstance(caught.value, ValueError) and isinstance(caught.value, MaskDtypeError)
    out = ours(q, q, q, need_weights=need_weights, **{name: mask.to(torch.float64)})[0]  # the fix works
    torch.testing.assert_close(out, ref(q, q, q, need_weights=need_weights, **{name: mask.double()})[0])


# ---- small configurations torch checks run at all -------------------------------------------------------


@pytest.mark.parametrize(
    "flags, kv_dim", [({"batch_first": True}, 4), ({"bias": False}, 4), ({"kdim": 2, "vdim": 2}, 2)],
    ids=["fast_path_small", "no_in_proj_bias", "no_in_proj_weight"],
)  # fmt: skip
def test_small_float64_configurations_match_torch(flags, kv_dim):
    ref, ours = _pair(4, 4, dtype=torch.float64, **flags)
    ref.eval(), ours.eval()
    assert (ours.in_proj_bias is None) == (ref.in_proj_bias is None)
    assert (ours.in_proj_weight is None) == (ref.in_proj_weight is None)
    q = torch.rand(4, 4, 4, dtype=torch.float64)
    k = q if kv_dim == 4 else torch.rand(4, 4, kv_dim, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(ours(q, k, k)[0], ref(q, k, k)[0])
