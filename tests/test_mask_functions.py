"""Masks and biases given as functions of (b, h, q_idx, kv_idx): each equals its dense equivalent.

Dimensions: B batch, H heads, Hkv kv heads, Lq/Lk lengths, Dk/Dv head dims.
"""

import pytest
import torch
from attention_cases import make_qkv
from hypothesis import given, settings
from hypothesis import strategies as st

import multihead as mh
from multihead import masks
from multihead.core.attention import prepare
from multihead.core.backends.flex import FlexBackend
from multihead.core.backends.math import MathBackend
from multihead.testing import compare_to_reference

# one thread: see conftest.py; compares with float64: tests/cpu_kernels.py
pytestmark = [pytest.mark.numerics, pytest.mark.usefixtures("one_thread")]

B, H, HKV, LQ, LK, D = 2, 4, 2, 5, 7, 6


def _dense(fn, lq=LQ, lk=LK, b=B, h=H):
    return masks.evaluate_fn(fn, (b, h, lq, lk), "mask")


# Each function form and the dense tensor it must equal, on (B, H, Lq, Lk) = (2, 4, 5, 7).
SLOPES = masks.alibi_slopes(H).double()
TABLE = torch.randn(H, 5, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
POS = torch.arange(LQ)[:, None] + (LK - LQ)  # (Lq, 1) each query's position among the keys
KEY = torch.arange(LK)[None, :]  # (1, Lk)
DIST = KEY - POS  # (Lq, Lk): 0 on the bottom-right aligned diagonal
CASES = {
    "causal": (dict(mask=masks.causal_fn(LQ, LK)), dict(mask=masks.causal(LQ, LK))),
    "window": (
        dict(mask=masks.sliding_window_fn(2, lq=LQ, lk=LK)),
        dict(mask=masks.sliding_window(LQ, LK, window=2)),
    ),
    "window_both_sides": (
        dict(mask=masks.sliding_window_fn(2, causal=False, lq=LQ, lk=LK)),
        dict(mask=masks.sliding_window(LQ, LK, window=2, causal=False)),
    ),
    "chunked": (
        dict(mask=masks.chunked_fn(3, lq=LQ, lk=LK)),
        dict(mask=(POS // 3 == KEY // 3) & (KEY <= POS)),
    ),
    "prefix_lm": (
        dict(mask=masks.prefix_lm_fn(torch.tensor([3, 0]), lq=LQ, lk=LK)),
        dict(mask=(masks.causal(LQ, LK) | (torch.arange(LK) < torch.tensor([3, 0])[:, None, None, None]))),
    ),
    "or_not": (
        dict(mask=masks.causal_fn(LQ, LK) | ~masks.sliding_window_fn(3, causal=False, lq=LQ, lk=LK)),
        dict(mask=masks.causal(LQ, LK) | ~masks.sliding_window(LQ, LK, window=3, causal=False)),
    ),
    "per_head": (
        dict(mask=lambda b, h, i, j: (j + h) % 3 != 0),
        dict(mask=(torch.arange(LK) + torch.arange(H)[:, None, None]) % 3 != 0),
    ),
    "dead_rows": (  # query 1 of batch 1 sees nothing
        dict(mask=lambda b, h, i, j: ~((b == 1) & (i == 1)) & (j >= 0)),
        dict(mask=~((torch.arange(B) == 1)[:, None, None, None] & (torch.arange(LQ) == 1)[:, None])),
    ),
    "alibi+causal": (
        dict(bias=masks.alibi_fn(SLOPES, lq=LQ, lk=LK), causal=True),
        dict(bias=-SLOPES[:, None, None] * DIST.abs(), causal=True),
    ),
    "relative": (
        dict(bias=masks.relative_position_fn(TABLE, lq=LQ, lk=LK)),
        dict(bias=TABLE[:, DIST.clamp(-2, 2) + 2]),
    ),
    "fn_and_tensors": (
        dict(mask=masks.sliding_window_fn(4, lq=LQ, lk=LK), valid_lens=torch.tensor([6, 2]), causal=True),
        dict(mask=masks.sliding_window(LQ, LK, window=4), valid_lens=torch.tensor([6, 2]), causal=True),
    ),
}


def _cast(kw, dtype):
    return {
        n: (x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x)
        for n, x in kw.items()
    }


def test_chunked_picture_is_right():
    """The chunked case's dense side, spelled out for Lq = Lk = 4, chunk 2 (the docstring picture)."""
    assert masks.evaluate_fn(masks.chunked_fn(2), (1, 1, 4, 4), "mask")[0, 0].int().tolist() == [
        [1, 0, 0, 0],
        [1, 1, 0, 0],
        [0, 0, 1, 0],
        [0, 0, 1, 1],
    ]


@pytest.mark.parametrize("case", sorted(CASES))
def test_reference_function_equals_dense(case):
    fn_kw, dense_kw = CASES[case]
    q, k, v = make_qkv(B, H, HKV, LQ, LK, D, D, torch.float64)
    got = mh.attention_reference(q, k, v, return_weights=True, **fn_kw)
    want = mh.attention_reference(q, k, v, return_weights=True, **dense_kw)
    torch.testing.assert_close(got.output, want.output, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(got.weights, want.weights, atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("backend", ["math", "sdpa"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_backend_function_equals_reference(case, backend, dtype):
    fn_kw, dense_kw = CASES[case]
    q, k, v = make_qkv(B, H, HKV, LQ, LK, D, D, dtype)
    kw = _cast(fn_kw, dtype)
    report = compare_to_reference(lambda *a, **k_: mh.attention(*a, backend=backend, **k_), q, k, v, **kw)
    assert report.ok, report
    dense = mh.attention(q, k, v, backend=backend, **_cast(dense_kw, dtype))
    torch.testing.assert_close(mh.attention(q, k, v, backend=backend, **kw), dense)


@pytest.mark.parametrize("case", sorted(CASES))
def test_math_weights_of_a_function(case):
    fn_kw, dense_kw = CASES[case]
    q, k, v = make_qkv(B, H, HKV, LQ, LK, D, D, torch.float64)
    got = mh.attention(q, k, v, backend="math", return_weights=True, **fn_kw)
    want = mh.attention_reference(q, k, v, return_weights=True, **dense_kw)
    torch.testing.assert_close(got.weights, want.weights, atol=1e-12, rtol=1e-12)


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("case", sorted(CASES))
def test_flex_eager_function_equals_reference(case):
    """FlexAttention's eager path on CPU (forward only): mask_mod/score_mod plumbing = the dense answer."""
    fn_kw, dense_kw = CASES[case]
    q, k, v = make_qkv(B, H, HKV, LQ, LK, D, D, torch.float32)
    flex = FlexBackend(compiled=False)
    with torch.no_grad():
        call = prepare(q, k, v, **_cast(fn_kw, torch.float32))
        assert list(flex.why_not(call)) == []
        got, _ = flex(call)
    want = mh.attention_reference(q.double(), k.double(), v.double(), **_cast(dense_kw, torch.float64))
    torch.testing.assert_close(got.double(), want, atol=2e-6, rtol=2e-6)


def test_normalize_builds_nothing_of_size_lq_lk():
    """Function mode keeps the functions and the ids; dense parts stay as small as given."""
    target = (2, 4, 1000, 1000)
    ids = torch.zeros(2, 1000, dtype=torch.long)
    norm = masks.normalize(
        target, mask=masks.causal_fn(), segment_ids=ids, valid_lens=torch.tensor([5, 9]), causal=True
    )
    assert norm.has_functions and norm.causal and norm.mask_fn is not None
    assert norm.mask.shape == (2, 1, 1, 1000) and norm.bias is None
    assert norm.segments[0] is norm.segments[1]
    dense = masks.materialize(norm, target, torch.float32)
    assert not dense.has_functions and dense.mask.shape == (2, 1, 1000, 1000)


def test_causal_flag_in_function_mode_is_bottom_right():
    q, k, v = make_qkv(1, 2, 2, 2, 5, 4, 4, torch.float64)
    ids = (torch.zeros(1, 2, dtype=torch.long), torch.zeros(1, 5, dtype=torch.long))
    got = mh.attention(q, k, v, segment_ids=ids, causal=True, return_weights=True).weights
    assert (got[0, 0] > 0).int().tolist() == [[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]


def test_gradients_reach_a_bias_functions_parameters():
    """Learned ALiBi slopes and a relative-position table get the same gradients as their dense forms."""
    q, k, v = make_qkv(B, H, HKV, LQ, LK, D, D, torch.float64)
    for base, make, dense in (
        (SLOPES, lambda p: masks.alibi_fn(p, lq=LQ, lk=LK), lambda p: -p[:, None, None] * DIST.abs()),
        (TABLE, lambda p: masks.relative_position_fn(p, lq=LQ, lk=LK), lambda p: p[:, DIST.clamp(-2, 2) + 2]),
    ):
        grads = []
        for build in (make, dense):
            p = base.clone().requires_grad_(True)
            for backend in ("math", "sdpa"):
                p.grad = None
                mh.attention(q, k, v, bias=build(p), causal=True, backend=backend).square().sum().backward()
                grads.append(p.grad.clone())
        for g in grads[1:]:
            torch.testing.assert_close(g, grads[0], atol=1e-12, rtol=1e-12)


def test_gradcheck_through_a_function_mask_and_bias():
    q, k, v = make_qkv(1, 2, 1, 3, 4, 3, 2, torch.float64, requires_grad=True)
    slopes = torch.tensor([0.5, 0.25], dtype=torch.float64, requires_grad=True)

    def fn(q, k, v, slopes):
        return mh.attention(
            q, k, v, mask=masks.sliding_window_fn(2, lq=3, lk=4), bias=masks.alibi_fn(slopes, lq=3, lk=4)
        )

    assert torch.autograd.gradcheck(fn, (q, k, v, slopes))


def test_composition_and_names():
    m = masks.causal_fn() & masks.sliding_window_fn(2)
    assert isinstance(m, masks.MaskFunction) and "causal" in repr(m)
    assert masks.evaluate_fn(m, (1, 1, 4, 4), "mask")[0, 0].int().tolist() == [
        [1, 0, 0, 0],
        [1, 1, 0, 0],
        [0, 1, 1, 0],
        [0, 0, 1, 1],
    ]
    plain = lambda b, h, i, j: j != 0  # noqa: E731 -- a plain function composes with a MaskFunction
    either = plain | masks.causal_fn()
    assert masks.evaluate_fn(either, (1, 1, 2, 2), "mask")[0, 0].int().tolist() == [[1, 1], [1, 1]]
    bias = masks.alibi_fn(2) + masks.BiasFunction(lambda b, h, i, j: i * 0 + 1.0)
    assert masks.evaluate_fn(bias, (1, 2, 2, 2), "bias")[0, 0].tolist() == [
        [1.0, 0.9375],
        [0.9375, 1.0],
    ]  # slope 2**-4


def test_tensor_fn_round_trips():
    m = torch.rand(2, 1, 3, 4) > 0.5
    got = masks.evaluate_fn(masks.tensor_fn(m), (2, 3, 3, 4), "mask")
    assert torch.equal(got.expand(2, 3, 3, 4), m.expand(2, 3, 3, 4))


def test_alibi_slopes():
    assert masks.alibi_slopes(4).tolist() == [0.25, 0.0625, 0.015625, 0.00390625]
    s6 = masks.alibi_slopes(6)  # 4 of the power-of-two sequence, then every other slope of the 8 sequence
    assert s6[:4].tolist() == masks.alibi_slopes(4).tolist()
    assert s6[4:].tolist() == masks.alibi_slopes(8)[0::2][:2].tolist()


@pytest.mark.parametrize(
    "kw, error, match",
    [
        (dict(mask=lambda b, h, i, j: (j - i).float()), ValueError, "must return a bool tensor"),
        (dict(bias=lambda b, h, i, j: j >= i), ValueError, "floating-point tensor"),
        (dict(mask=lambda b, h, i, j: True), ValueError, "must return a torch.Tensor"),
        (dict(mask=lambda b, h, i, j: torch.ones(5, 7, dtype=torch.bool)), ValueError, "elementwise"),
        (dict(mask=3), TypeError, "a function"),
        (dict(bias="alibi"), TypeError, "or a function"),
    ],
)
def test_bad_functions_give_clear_errors(kw, error, match):
    q, k, v = make_qkv(B, H, HKV, LQ, LK, D, D)
    with pytest.raises(error, match=match):
        mh.attention(q, k, v, **kw)


def test_factories_validate_their_arguments():
    with pytest.raises(ValueError, match="both lq and lk"):
        masks.causal_fn(3)
    with pytest.raises(ValueError, match="window"):
        masks.sliding_window_fn(0)
    with pytest.raises(ValueError, match="odd number"):
        masks.relative_position_fn(torch.zeros(2, 4))
    with pytest.raises(TypeError, match="callable"):
        masks.MaskFunction(torch.ones(3))


def test_dense_backends_refuse_huge_function_grids_and_say_why():
    """Above the limit math and sdpa decline (a block-skipping backend serves); weights force dense."""
    q, k, v = make_qkv(1, 2, 2, 64, 64, 4, 4)
    ids = torch.zeros(1, 64, dtype=torch.long)
    small = MathBackend(dense_limit=1000)
    call = prepare(q, k, v, segment_ids=ids)
    reasons = list(small.why_not(call))
    assert (
        reasons and "dense (B, H, Lq, Lk) grid of 8192 entries" in reasons[0] and "limit 1000" in reasons[0]
    )
    assert list(small.why_not(prepare(q, k, v, segment_ids=ids, return_weights=True))) == []
    assert list(small.why_not(prepare(q, k, v, causal=True))) == []  # no functions: no limit


@settings(max_examples=30, deadline=None)
@given(
    lq=st.integers(1, 7),
    lk=st.integers(1, 7),
    window=st.integers(1, 4),
    causal=st.booleans(),
    chunk=st.integers(1, 4),
)
def test_random_lengths_function_equals_dense(lq, lk, window, causal, chunk):
    """Hypothesis: the factories' bottom-right alignment agrees with the dense builders at any lengths."""
    q, k, v = make_qkv(1, 2, 1, lq, lk, 4, 3, torch.float64, seed=lq * 10 + lk)
    fn = masks.sliding_window_fn(window, causal=causal, lq=lq, lk=lk)
    dense = masks.sliding_window(lq, lk, window=window, causal=causal)
    assert torch.equal(_dense(fn, lq, lk, 1, 1)[0, 0], dense)
    assert torch.equal(_dense(masks.causal_fn(lq, lk), lq, lk, 1, 1)[0, 0], masks.causal(lq, lk))
    both = fn & masks.chunked_fn(chunk, lq=lq, lk=lk)
    for backend in ("math", "sdpa"):
        got = mh.attention(q, k, v, mask=both, backend=backend)
        want = mh.attention_reference(q, k, v, mask=_dense(both, lq, lk, 1, 2))
        torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)


def test_blocks_tile_the_materialized_grid():
    """evaluate_block over a tiling of (Lq, Lk) = the whole grid (what a block-skipping backend sees)."""
    ids = (torch.tensor([[0, 0, 1, 1, -1], [2, 2, 2, 2, 2]]), torch.tensor([[0, 0, 0, 1, 1, 1, -1], [2] * 7]))
    norm = masks.normalize(
        (B, H, LQ, LK),
        mask=masks.sliding_window_fn(4, lq=LQ, lk=LK),
        bias=masks.alibi_fn(H, lq=LQ, lk=LK),
        valid_lens=torch.tensor([6, 0]),
        segment_ids=ids,
        causal=True,
    )
    whole_keep, whole_bias = masks.evaluate_block(
        norm, (B, H, LQ, LK), slice(None), slice(None), torch.float64
    )
    for q0, q1 in ((0, 2), (2, 5)):
        for k0, k1 in ((0, 3), (3, 7)):
            keep, bias = masks.evaluate_block(
                norm, (B, H, LQ, LK), slice(q0, q1), slice(k0, k1), torch.float64
            )
            want_keep = whole_keep.expand(B, H, LQ, LK)[:, :, q0:q1, k0:k1]
            assert torch.equal(keep.expand_as(want_keep), want_keep)
            want_bias = whole_bias.expand(B, H, LQ, LK)[:, :, q0:q1, k0:k1]
            torch.testing.assert_close(bias.expand_as(want_bias), want_bias)
    dense = masks.materialize(norm, (B, H, LQ, LK), torch.float64)
    assert dense.row_ok is not None and not dense.row_ok[1].any()  # valid_lens 0: batch row 1 is dead


# ----------------------------------------------------------------------------------------------
# Key ranges: a structural bound outside which a library mask function is surely False
# ----------------------------------------------------------------------------------------------


def _bounded(kind, size, causal, lq, lk):
    """A library mask function of ``kind`` aligned to (lq, lk)."""
    if kind == "causal":
        return masks.causal_fn(lq, lk)
    if kind == "window":
        return masks.sliding_window_fn(size, causal=causal, lq=lq, lk=lk)
    if kind == "chunked":
        return masks.chunked_fn(size, causal=causal, lq=lq, lk=lk)
    return masks.prefix_lm_fn(torch.tensor([size, size // 2]), lq=lq, lk=lk)


KINDS = st.sampled_from(["causal", "window", "chunked", "prefix"])


def _assert_sound(fn, lq, lk, q0, q1):
    """Every key that some query of q0:q1 may see lies inside fn's key range for that block."""
    allowed = _dense(fn, lq, lk)[:, :, q0:q1].reshape(-1, lk).any(0)  # (Lk,) some query sees key j
    k0, k1 = fn.key_range(q0, q1)
    seen = allowed.nonzero().flatten().tolist()
    assert all(k0 <= j < k1 for j in seen), (fn, q0, q1, (k0, k1), seen)


@settings(max_examples=60, deadline=None)
@given(
    kinds=st.lists(KINDS, min_size=1, max_size=3),
    ops=st.lists(st.sampled_from(["&", "|"]), min_size=2, max_size=2),
    size=st.integers(1, 9),
    causal=st.booleans(),
    lq=st.integers(1, 24),
    lk=st.integers(1, 24),
    cut=st.tuples(st.integers(0, 23), st.integers(1, 8)),
)
def test_key_ranges_are_sound_and_compose(kinds, ops, size, causal, lq, lk, cut):
    """Soundness: the dense evaluation has no True outside the bound, for one function and for & / |
    compositions (intersection / hull); the complement has no bound."""
    q0 = min(cut[0], lq - 1)
    q1 = min(lq, q0 + cut[1])
    fns = [_bounded(kind, size + i, causal, lq, lk) for i, kind in enumerate(kinds)]
    fn = fns[0]
    for op, other in zip(ops, fns[1:], strict=False):
        fn = fn & other if op == "&" else fn | other
    for f in (*fns, fn):
        _assert_sound(f, lq, lk, q0, q1)
    assert (~fn).key_range(q0, q1) is None


def test_key_ranges_of_plain_functions_are_unknown():
    lam = masks.MaskFunction(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx)
    assert lam.key_range(0, 4) is None
    assert (lam | masks.causal_fn()).key_range(0, 4) is None  # a hull needs every part's range
    assert (lam & masks.sliding_window_fn(3)).key_range(8, 12) == (6, 12)  # AND: the known part bounds it


def test_key_ranges_are_tight_for_a_window():
    """Not only sound: a causal window's range is exactly the keys its block sees (tiles are skipped)."""
    assert masks.sliding_window_fn(4).key_range(10, 14) == (7, 14)
    assert masks.sliding_window_fn(4, lq=4, lk=20).key_range(0, 4) == (13, 20)
    assert masks.chunked_fn(4).key_range(5, 7) == (4, 7)
