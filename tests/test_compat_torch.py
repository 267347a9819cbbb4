"""multihead.compat.torch.MultiheadAttention against torch.nn.MultiheadAttention holding the same weights."""

import itertools
import random

import pytest
import torch
from torch import nn

import multihead as mh
from multihead.compat.torch import IsCausalError, MultiheadAttention

E, H, L, S, N = 8, 2, 3, 4, 2
KV_MODES = ("self", "cross", "kdim")  # key is query / separate same-size key/value / kdim, vdim != E
MASKS = ("none", "kpm_bool", "kpm_float", "2d_bool", "2d_float", "3d_bool", "3d_float", "kpm_bool+3d_float")
WEIGHTS = ("off", "avg", "per_head")

# Every constructor flag x batch_first x mask kind x need_weights x is_causal x batched x train/eval is
# 24 * 2 * 8 * 3 * 2 * 2 * 2 = 9216 cases; a fixed sample of 160 keeps the suite fast while every value
# of every factor, and every (mask kind, other factor) pair, still appears (checked below).
FULL = list(
    itertools.product(
        (True, False),  # bias
        (False, True),  # add_bias_kv
        (False, True),  # add_zero_attn
        KV_MODES,
        (False, True),  # batch_first
        MASKS,
        WEIGHTS,
        (False, True),  # is_causal
        (True, False),  # batched
        ("train", "eval"),
    )
)
GRID = random.Random(0).sample(FULL, 160)


def test_grid_covers_every_pair_with_mask_kind():
    for i in [j for j in range(len(FULL[0])) if j != 5]:
        values = {c[i] for c in FULL}
        for mask in MASKS:
            seen = {c[i] for c in GRID if c[5] == mask}
            assert seen == values, (i, mask)


def _mask(kind, batched, S, gen):
    """torch-convention masks with at least one allowed key per row (key 0 always allowed)."""
    kpm = am = None
    if kind.startswith("kpm"):
        pad = torch.rand(N, S, generator=gen) > 0.5
        pad[:, 0] = False
        kpm = pad if kind.startswith("kpm_bool") else torch.randn(N, S, generator=gen).masked_fill(pad, -1e9)
        kpm = kpm if batched else kpm[0]
    if "2d" in kind or "3d" in kind:
        shape = (L, S) if "2d" in kind else ((N if batched else 1) * H, L, S)
        blocked = torch.rand(shape, generator=gen) > 0.6
        blocked[..., 0] = False
        am = (
            blocked
            if kind.endswith("bool")
            else torch.randn(shape, generator=gen).masked_fill(blocked, float("-inf"))
        )
    return kpm, am


def _inputs(kv_mode, batch_first, batched, gen):
    kd, vd = (5, 6) if kv_mode == "kdim" else (E, E)

    def t(length, dim):
        shape = (N, length, dim) if batch_first else (length, N, dim)
        return torch.randn(shape if batched else (length, dim), generator=gen, requires_grad=True)

    q = t(L, E)
    if kv_mode == "self":
        return q, q, q
    return q, t(S, kd), t(S, vd)


def _pair(bias, bias_kv, zero_attn, kv_mode, batch_first, dropout=0.0):
    kd, vd = (5, 6) if kv_mode == "kdim" else (None, None)
    kw = dict(
        bias=bias, add_bias_kv=bias_kv, add_zero_attn=zero_attn, kdim=kd, vdim=vd, batch_first=batch_first
    )
    ref = nn.MultiheadAttention(E, H, dropout=dropout, **kw)
    ours = MultiheadAttention(E, H, dropout=dropout, **kw)
    ours.load_state_dict(ref.state_dict())
    return ref, ours


def _run(m, q, k, v, kpm, am, weights, is_causal, gen_seed):
    out, w = m(
        q, k, v, key_padding_mask=kpm, need_weights=weights != "off", attn_mask=am,
        average_attn_weights=weights == "avg", is_causal=is_causal,
    )  # fmt: skip
    g = torch.Generator().manual_seed(gen_seed)
    loss = (out * torch.randn(out.shape, generator=g)).sum()
    if w is not None:
        loss = loss + (w * torch.randn(w.shape, generator=g)).sum()
    inputs = [t for t in dict.fromkeys((q, k, v))]
    grads = torch.autograd.grad(loss, inputs + list(m.parameters()))
    return out, w, grads


@pytest.mark.filterwarnings("ignore:Support for mismatched key_padding_mask")
@pytest.mark.parametrize("case", GRID, ids=lambda c: "-".join(map(str, c)))
def test_matches_torch(case):
    bias, bias_kv, zero_attn, kv_mode, batch_first, mask, weights, is_causal, batched, mode = case
    gen = torch.Generator().manual_seed(hash(case) % 2**31)
    torch.manual_seed(0)
    ref, ours = _pair(bias, bias_kv, zero_attn, kv_mode, batch_first)
    ref.train(mode == "train")
    ours.train(mode == "train")
    q, k, v = _inputs(kv_mode, batch_first, batched, gen)
    s_len = k.shape[1] if batch_first and batched else k.shape[0]
    kpm, am = _mask(mask, batched, s_len, gen)
    if is_causal and am is None:  # torch's rule: is_causal is a hint about attn_mask
        with pytest.raises(RuntimeError, match="attn_mask"):
            ref(q, k, v, key_padding_mask=kpm, attn_mask=am, is_causal=True)
        with pytest.raises(IsCausalError, match="attn_mask"):
            ours(q, k, v, key_padding_mask=kpm, attn_mask=am, is_causal=True)
        return
    r_out, r_w, r_g = _run(ref, q, k, v, kpm, am, weights, is_causal, 1)
    o_out, o_w, o_g = _run(ours, q, k, v, kpm, am, weights, is_causal, 1)
    torch.testing.assert_close(o_out, r_out, atol=1e-5, rtol=1e-5)
    assert (o_w is None) == (r_w is None)
    if r_w is not None:
        torch.testing.assert_close(o_w, r_w, atol=1e-5, rtol=1e-5)
    for a, b in zip(o_g, r_g):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("need_weights", [False, True])
def test_eval_fast_path_no_grad(need_weights):
    """torch takes its fused fast path in eval mode without autograd; ours still matches it."""
    torch.manual_seed(0)
    ref, ours = _pair(True, False, False, "self", True)
    ref.eval(), ours.eval()
    x = torch.randn(N, L, E)
    kpm = torch.tensor([[False, False, True], [False, False, False]])
    with torch.no_grad():
        a = ref(x, x, x, key_padding_mask=kpm, need_weights=need_weights)
        b = ours(x, x, x, key_padding_mask=kpm, need_weights=need_weights)
    torch.testing.assert_close(b[0], a[0], atol=1e-5, rtol=1e-5)
    if need_weights:
        torch.testing.assert_close(b[1], a[1], atol=1e-5, rtol=1e-5)


def test_dropout_eval_is_identity_and_train_weights_match_torch_rng():
    torch.manual_seed(0)
    ref, ours = _pair(True, False, False, "cross", True, dropout=0.5)
    q, k = torch.randn(N, L, E), torch.randn(N, S, E)
    ref.eval(), ours.eval()
    torch.testing.assert_close(ours(q, k, k)[0], ref(q, k, k)[0], atol=1e-5, rtol=1e-5)
    ref.train(), ours.train()
    torch.manual_seed(7)
    a_out, a_w = ref(q, k, k, average_attn_weights=False)
    torch.manual_seed(7)
    b_out, b_w = ours(q, k, k, average_attn_weights=False)
    # torch returns the dropped-out weights with need_weights; ours draws the same dropout mask.
    torch.testing.assert_close(b_w, a_w, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(b_out, a_out, atol=1e-5, rtol=1e-5)
    assert (b_w == 0).any()


@pytest.mark.parametrize("flags", [dict(), dict(add_bias_kv=True, kdim=5, vdim=6), dict(bias=False)])
def test_state_dict_round_trips_both_ways(flags):
    ref = nn.MultiheadAttention(E, H, **flags)
    ours = MultiheadAttention(E, H, **flags)
    assert list(ours.state_dict()) == list(ref.state_dict())
    assert [v.shape for v in ours.state_dict().values()] == [v.shape for v in ref.state_dict().values()]
    ours.load_state_dict(ref.state_dict())
    back = nn.MultiheadAttention(E, H, **flags)
    back.load_state_dict(ours.state_dict())
    for (name, a), b in zip(ref.state_dict().items(), back.state_dict().values()):
        assert torch.equal(a, b), name
    assert torch.equal(
        MultiheadAttention.from_torch(ref).to_torch().state_dict()["out_proj.weight"], ref.out_proj.weight
    )


def test_fully_masked_rows_give_zeros_where_torch_gives_nan():
    """The one intended difference."""
    torch.manual_seed(0)
    ref, ours = _pair(True, False, False, "cross", True)
    q, k = torch.randn(N, L, E), torch.randn(N, S, E, requires_grad=True)
    am = torch.zeros(L, S, dtype=torch.bool)
    am[1] = True  # query 1 may attend to nothing
    r_out, r_w = ref(q, k, k, attn_mask=am, average_attn_weights=False)
    o_out, o_w = ours(q, k, k, attn_mask=am, average_attn_weights=False)
    assert torch.isnan(r_w[:, :, 1]).all()
    assert torch.equal(o_w[:, :, 1], torch.zeros_like(o_w[:, :, 1]))
    torch.testing.assert_close(o_out[:, 1], ours.out_proj.bias.expand(N, E))  # zero heads -> only out bias
    torch.testing.assert_close(o_out[:, [0, 2]], r_out[:, [0, 2]], atol=1e-5, rtol=1e-5)
    (o_grad,) = torch.autograd.grad(o_out.sum(), k)
    assert torch.isfinite(o_grad).all()


def test_is_causal_uses_top_left_causal_like_torch_sdpa():
    """is_causal with no key padding and need_weights=False: attn_mask is a hint and is replaced."""
    torch.manual_seed(0)
    ref, ours = _pair(True, False, False, "cross", True)
    q, k = torch.randn(N, L, E), torch.randn(N, S, E)
    hint = torch.zeros(L, S, dtype=torch.bool)  # not causal at all: torch ignores it here
    a = ref(q, k, k, attn_mask=hint, is_causal=True, need_weights=False)[0]
    b = ours(q, k, k, attn_mask=hint, is_causal=True, need_weights=False)[0]
    torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)
    top_left = ~torch.ones(L, S, dtype=torch.bool).tril()
    c = ours(q, k, k, attn_mask=top_left, need_weights=False)[0]
    torch.testing.assert_close(b, c, atol=1e-6, rtol=1e-6)


def test_bad_inputs_raise_clear_errors():
    m = MultiheadAttention(E, H)
    x = torch.randn(L, N, E)
    with pytest.raises(ValueError, match=r"key_padding_mask.*\.bool\(\)"):
        m(x, x, x, key_padding_mask=torch.zeros(N, L, dtype=torch.long))
    with pytest.raises(ValueError, match=r"attn_mask. shape to be \(3, 3\)"):
        m(x, x, x, attn_mask=torch.zeros(2, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="key_padding_mask is \\(N, S\\)"):
        m(x, x, x, key_padding_mask=torch.zeros(N, 5, dtype=torch.bool))
    with pytest.raises(ValueError, match="divisible"):
        MultiheadAttention(10, 3)


def test_need_weights_path_is_one_pass():
    """need_weights=True uses the math backend once: output and weights come from the same softmax."""
    calls = []
    import multihead.core.backends.math as math_backend

    orig = math_backend.MathBackend.__call__

    def spy(self, call):
        calls.append(call.return_weights)
        return orig(self, call)

    math_backend.MathBackend.__call__ = spy
    try:
        m = MultiheadAttention(E, H, batch_first=True).eval()
        x = torch.randn(N, L, E)
        m(x, x, x, need_weights=True)
    finally:
        math_backend.MathBackend.__call__ = orig
    assert calls == [True]
    assert isinstance(m, mh.MultiHeadAttention)
