"""multihead.attention vs multihead.attention_reference, on every backend, over a grid of cases."""

from functools import partial

import pytest
import torch
from attention_cases import MODERN_KINDS, make_qkv, mask_kwargs

import multihead as mh
from multihead import masks
from multihead.core import backends
from multihead.core.attention import output_and_weights, prepare
from multihead.testing import compare_to_reference

pytestmark = pytest.mark.numerics  # compares with float64: tests/cpu_kernels.py

BACKENDS = ["auto", "math", "sdpa"]
HEADS = {"mha": (8, 8), "gqa": (8, 2), "mqa": (8, 1)}
# (Lq, Lk, Dk, Dv): length 1, Lq != Lk both ways, head dim 59, Dk != Dv, length 97
SIZES = [(1, 1, 8, 8), (5, 7, 59, 32), (7, 5, 16, 24), (97, 97, 16, 16)]
MASK_KINDS = ["none", "causal", "mask", "bias", "valid_lens_1d", "valid_lens_2d", "all"]


def check_auto_choice(q, k, v, **kw):
    """On CPU ``auto`` runs sdpa, or math when weights are asked for (flex serves only mask functions on the
    CPU, none here): check the choice,
    its reasons, and that ``auto`` gives exactly the chosen backend's result (so it ran that path)."""
    expected = "math" if kw.get("return_weights") else "sdpa"
    assert q.device.type == "cpu"
    assert backends.select(prepare(q, k, v, **kw)).name == expected
    why = mh.core.explain_backends(q, k, v, **kw)
    assert why[expected] == [] and why["flex"], why
    if expected == "math":
        assert any("cannot return attention weights" in r for r in why["sdpa"]), why
    auto, chosen = (output_and_weights(mh.attention(q, k, v, backend=b, **kw)) for b in ("auto", expected))
    for a, c in zip(auto, chosen):
        assert (a is None and c is None) or torch.equal(a, c), f"auto did not run {expected}"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("kind", MASK_KINDS)
@pytest.mark.parametrize("heads", list(HEADS))
@pytest.mark.parametrize("size", SIZES, ids=lambda s: "x".join(map(str, s)))
def test_backend_matches_reference(backend, dtype, kind, heads, size):
    h, hkv = HEADS[heads]
    lq, lk, dk, dv = size
    q, k, v = make_qkv(2, h, hkv, lq, lk, dk, dv, dtype)
    kw = mask_kwargs(kind, 2, h, lq, lk)
    rep = compare_to_reference(partial(mh.attention, backend=backend), q, k, v, **kw)
    if dtype == torch.float64:
        assert rep.fast <= 1e-10, rep
    assert rep.ok, rep
    if backend == "auto":
        check_auto_choice(q, k, v, **kw)


@pytest.mark.parametrize("backend", ["auto", "math"])
@pytest.mark.parametrize("kind", MASK_KINDS)
@pytest.mark.parametrize("heads", list(HEADS))
def test_weights_match_reference(backend, kind, heads):
    h, hkv = HEADS[heads]
    q, k, v = make_qkv(2, h, hkv, 6, 9, 16, 8)
    kw = mask_kwargs(kind, 2, h, 6, 9)
    rep = compare_to_reference(partial(mh.attention, backend=backend), q, k, v, return_weights=True, **kw)
    assert rep.fast_weights is not None and rep.ok, rep
    if backend == "auto":
        check_auto_choice(q, k, v, return_weights=True, **kw)


@pytest.mark.parametrize("backend", ["math", "sdpa"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("kind", MODERN_KINDS)
@pytest.mark.parametrize("size", SIZES, ids=lambda s: "x".join(map(str, s)))
def test_modern_kinds_match_reference(backend, dtype, kind, size):
    """Segments, mask/bias functions, softcap and sinks at the awkward sizes (GQA); sdpa refuses softcap."""
    lq, lk, dk, dv = size
    q, k, v = make_qkv(2, 8, 2, lq, lk, dk, dv, dtype)
    kw = mask_kwargs(kind, 2, 8, lq, lk, bias_dtype=dtype)
    if backend == "sdpa" and "softcap" in kw:
        assert any("soft-cap" in r for r in mh.core.explain_backends(q, k, v, **kw)["sdpa"])
        return
    rep = compare_to_reference(partial(mh.attention, backend=backend), q, k, v, **kw)
    if dtype == torch.float64:
        assert rep.fast <= 1e-10, rep
    assert rep.ok, rep


def test_long_key_sequence_1025():
    q, k, v = make_qkv(1, 4, 2, 3, 1025, 32, 32)
    for backend in ("math", "sdpa"):
        rep = compare_to_reference(partial(mh.attention, backend=backend), q, k, v, causal=True)
        assert rep.ok, (backend, rep)


def test_sdpa_refuses_weights_with_reason():
    q, k, v = make_qkv(1, 2, 2, 3, 3, 4, 4)
    with pytest.raises(ValueError, match="cannot return attention weights"):
        mh.attention(q, k, v, return_weights=True, backend="sdpa")
    reasons = mh.core.explain_backends(q, k, v, return_weights=True)
    assert reasons["math"] == [] and reasons["sdpa"]


def test_unknown_backend_names_the_choices():
    q, k, v = make_qkv(1, 2, 2, 3, 3, 4, 4)
    with pytest.raises(ValueError, match="one of"):
        mh.attention(q, k, v, backend="flash9")


# ----------------------------------------------------------------------------------------------
# Gradients
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["math", "sdpa"])
@pytest.mark.parametrize("kind", ["none", "causal", "valid_lens_1d", "all"])
@pytest.mark.parametrize("heads", [(4, 4), (4, 2)])
def test_gradcheck(backend, kind, heads):
    h, hkv = heads
    q, k, v = make_qkv(2, h, hkv, 3, 4, 5, 3, torch.float64, requires_grad=True)
    kw = mask_kwargs(kind, 2, h, 3, 4)
    if "bias" in kw:
        kw["bias"] = kw["bias"].double().requires_grad_(True)

    def fn(q, k, v, *extra):
        return mh.attention(q, k, v, backend=backend, **kw)

    inputs = (q, k, v) + ((kw["bias"],) if "bias" in kw else ())
    # fast mode: random projections of the Jacobian, each checked against its numerical estimate
    assert torch.autograd.gradcheck(fn, inputs, eps=1e-6, atol=1e-7, fast_mode=True)


@pytest.mark.parametrize("backend", ["math", "sdpa"])
@pytest.mark.parametrize("heads", [(4, 4), (4, 1)])
def test_gradients_match_reference(backend, heads):
    h, hkv = heads
    kw = mask_kwargs("all", 2, h, 6, 8)
    grads = []
    for fn in (mh.attention_reference, partial(mh.attention, backend=backend)):
        q, k, v = make_qkv(2, h, hkv, 6, 8, 8, 8, torch.float64, requires_grad=True)
        out = fn(q, k, v, **kw)
        out.backward(torch.ones_like(out))
        grads.append([t.grad for t in (q, k, v)])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("lq_lk", [(6, 6), (3, 7)])
def test_causality_by_gradients(backend, lq_lk):
    """With causal=True, output row i has zero gradient w.r.t. keys/values after i + (Lk - Lq)."""
    lq, lk = lq_lk
    q, k, v = make_qkv(1, 2, 2, lq, lk, 4, 4, torch.float64, requires_grad=True)
    out = mh.attention(q, k, v, causal=True, backend=backend)
    for i in range(lq):
        gk, gv = torch.autograd.grad(out[:, :, i].sum(), (k, v), retain_graph=True)
        last = i + lk - lq  # last visible key
        if last + 1 < lk:
            assert gk[:, :, last + 1 :].abs().max() == 0
            assert gv[:, :, last + 1 :].abs().max() == 0
        assert gv[:, :, : last + 1].abs().sum() > 0  # it does see the earlier keys


# ----------------------------------------------------------------------------------------------
# Mask equivalences and fully masked rows
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_broadcast_equivalent_masks(backend):
    q, k, v = make_qkv(2, 4, 4, 5, 6, 8, 8)
    base = torch.rand(5, 6, generator=torch.Generator().manual_seed(3)) > 0.4
    base[:, 0] = True
    shapes = [base, base[None], base[None, None], base.expand(2, 4, 5, 6).clone(), base.expand(4, 5, 6)]
    outs = [mh.attention(q, k, v, mask=m, backend=backend) for m in shapes]
    for o in outs[1:]:
        torch.testing.assert_close(o, outs[0], atol=0, rtol=0)
    if backend == "auto":
        for m in shapes:
            check_auto_choice(q, k, v, mask=m)


@pytest.mark.parametrize("backend", BACKENDS)
def test_mask_equals_neg_inf_bias(backend):
    q, k, v = make_qkv(2, 4, 2, 5, 6, 8, 8)
    m = torch.rand(2, 1, 5, 6, generator=torch.Generator().manual_seed(4)) > 0.5
    m[..., 0, :] = False  # one dead row
    a = mh.attention(q, k, v, mask=m, backend=backend)
    b = mh.attention(q, k, v, bias=masks.to_bias(m), backend=backend)
    torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
    assert a[:, :, 0].abs().max() == 0


def test_valid_lens_equals_mask():
    q, k, v = make_qkv(3, 2, 2, 4, 6, 8, 8)
    vl = torch.tensor([6, 2, 0])
    m = masks.from_valid_lens(vl, 6)
    torch.testing.assert_close(mh.attention(q, k, v, valid_lens=vl), mh.attention(q, k, v, mask=m))


DEAD_ROW_CASES = {
    "valid_len_0": lambda b, lq, lk: {"valid_lens": torch.tensor([0, lk])},
    "valid_lens_2d_0": lambda b, lq, lk: {"valid_lens": torch.tensor([[0] * lq, [lk] * lq])},
    "mask_row": lambda b, lq, lk: {
        "mask": torch.ones(lq, lk, dtype=torch.bool).index_fill(0, torch.tensor([1]), False)
    },
    "bias_row": lambda b, lq, lk: {
        "bias": torch.zeros(lq, lk).index_fill(0, torch.tensor([1]), float("-inf"))
    },
    "causal_lq_gt_lk": lambda b, lq, lk: {"causal": True},  # row 0 sees keys j <= 0 + (Lk - Lq) = -1
}


# sdpa cannot return weights (see test_sdpa_refuses_weights_with_reason): that pair is not a case.
BACKEND_WEIGHTS = [(b, w) for b in BACKENDS for w in (False, True) if not (b == "sdpa" and w)]


@pytest.mark.parametrize(("backend", "return_weights"), BACKEND_WEIGHTS)
@pytest.mark.parametrize("case", list(DEAD_ROW_CASES))
@pytest.mark.parametrize("heads", [(4, 4), (4, 2)])
def test_fully_masked_rows_are_zero_with_finite_grads(backend, return_weights, case, heads):
    h, hkv = heads
    lq, lk = 4, 3
    kw = DEAD_ROW_CASES[case](2, lq, lk)
    q, k, v = make_qkv(2, h, hkv, lq, lk, 8, 8, requires_grad=True)
    res = mh.attention(q, k, v, backend=backend, return_weights=return_weights, **kw)
    out = res.output if return_weights else res
    ref = mh.attention_reference(q, k, v, return_weights=True, **kw)
    dead = ~ref.weights.detach().bool().any(-1)  # (B, H, Lq) rows with no allowed key
    assert dead.any(), "the case must produce a dead row"
    assert out[dead].abs().max() == 0
    if return_weights:
        assert res.weights[dead].abs().max() == 0
        torch.testing.assert_close(res.weights, ref.weights)
    torch.testing.assert_close(out, ref.output)
    loss = out.square().sum() + (res.weights.sum() if return_weights else 0)
    loss.backward()
    for t in (q, k, v):
        assert torch.isfinite(t.grad).all()


# ----------------------------------------------------------------------------------------------
# Dropout and scale
# ----------------------------------------------------------------------------------------------


def test_math_dropout_matches_reference_with_same_seed():
    q, k, v = make_qkv(2, 4, 4, 5, 6, 8, 8)
    torch.manual_seed(7)
    a = mh.attention(q, k, v, dropout=0.4, backend="math")
    torch.manual_seed(7)
    b = mh.attention_reference(q, k, v, dropout=0.4)
    torch.testing.assert_close(a, b)
    assert not torch.allclose(a, mh.attention(q, k, v))


@pytest.mark.parametrize("backend", ["math", "sdpa"])
def test_dropout_is_unbiased(backend):
    q, k, v = make_qkv(1, 2, 2, 4, 5, 8, 8, torch.float64)
    torch.manual_seed(0)
    clean = mh.attention(q, k, v, backend=backend)
    runs = torch.stack([mh.attention(q, k, v, dropout=0.3, backend=backend) for _ in range(2000)])
    assert not torch.allclose(runs[0], clean)
    torch.testing.assert_close(runs.mean(0), clean, atol=0.08, rtol=0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_custom_scale(backend):
    q, k, v = make_qkv(2, 4, 4, 5, 6, 8, 8)
    rep = compare_to_reference(partial(mh.attention, backend=backend), q, k, v, scale=0.05)
    assert rep.ok, rep
    torch.testing.assert_close(mh.attention(q, k, v, scale=0.5), mh.attention(q * 0.5 * 8**0.5, k, v))


def test_low_precision_bfloat16():
    q, k, v = make_qkv(2, 4, 2, 9, 11, 16, 16, torch.bfloat16)
    for backend in ("math", "sdpa"):
        rep = compare_to_reference(
            partial(mh.attention, backend=backend),
            q,
            k,
            v,
            valid_lens=torch.tensor([3, 11]),
        )
        assert rep.ok, (backend, rep)


# ----------------------------------------------------------------------------------------------
# The checker itself can fail: negative controls for compare_to_reference and the 2x rule
# ----------------------------------------------------------------------------------------------


def _wrong_scale(q, k, v, **kw):
    """Attention with a 5% wrong score scale: 1.05 / sqrt(Dk)."""
    return mh.attention(q, k, v, **kw, scale=1.05 / q.shape[-1] ** 0.5)


def _causal_shifted(offset):
    """Attention that gets ``causal=True`` wrong by ``offset`` keys (+1: sees one key ahead, -1: not itself)."""

    def fn(q, k, v, *, causal, **kw):
        assert causal
        shifted = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool).tril(offset)  # (Lq, Lk)
        return mh.attention(q, k, v, mask=shifted, **kw)

    return fn


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "wrong", [_wrong_scale, _causal_shifted(1), _causal_shifted(-1)], ids=["scale", "causal+1", "causal-1"]
)
@pytest.mark.parametrize("return_weights", [False, True])
def test_compare_to_reference_fails_a_wrong_attention(dtype, wrong, return_weights):
    q, k, v = make_qkv(2, 4, 2, 9, 9, 16, 16, dtype)
    right = compare_to_reference(mh.attention, q, k, v, causal=True, return_weights=return_weights)
    assert right.ok, right  # the same inputs pass with the right function
    rep = compare_to_reference(wrong, q, k, v, causal=True, return_weights=return_weights)
    assert not rep.ok, rep
    assert rep.fast > rep.allowed(rep.reference)
    if return_weights:
        assert rep.fast_weights > rep.allowed(rep.reference_weights)


def test_compare_to_reference_checks_the_weights_too():
    """Right output, wrong weights (a 5% wrong scale): the report fails on the weights alone."""
    q, k, v = make_qkv(2, 4, 2, 9, 9, 16, 16)

    def wrong_weights(q, k, v, **kw):
        return mh.AttentionOutput(mh.attention(q, k, v, **kw).output, _wrong_scale(q, k, v, **kw).weights)

    rep = compare_to_reference(wrong_weights, q, k, v, return_weights=True)
    assert rep.fast <= rep.allowed(rep.reference) and not rep.ok, rep
