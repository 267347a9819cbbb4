"""What the fuzzing of issue 46 found, one test each (every one failed before its fix).

Dimensions: B batch, H heads, Hkv kv heads, Lq/Lk lengths, Dk/Dv head dims.
"""

from __future__ import annotations

import pytest
import torch
from attention_cases import make_qkv
from test_backends_fast import _flex_eager

import multihead as mh
from multihead.compat.torch import MultiheadAttention as DropIn
from multihead.compat.torch.boundary import MultiheadAttentionError
from multihead.core.attention import prepare
from multihead.core.backends.blocked import BlockedBackend

pytestmark = pytest.mark.numerics
BACKENDS = ("sdpa", "math")


def _close(a, b):
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", ["auto", "sdpa", "math"])
@pytest.mark.parametrize("scale", [-0.5, 0.0])
def test_causal_with_a_scale_not_above_zero(backend, scale):
    # torch's causal kernel returns NaN rows for a scale <= 0; the library spells the mask out then
    q, k, v = make_qkv(1, 2, 2, 5, 5, 8, 8)
    out = mh.attention(q, k, v, causal=True, scale=scale, backend=backend)
    _close(out, mh.attention_reference(q, k, v, causal=True, scale=scale))


def test_causal_packed_run_with_a_negative_scale():
    q, k, v = make_qkv(1, 2, 2, 6, 6, 8, 8)
    ids = torch.tensor([[0, 0, 0, 1, 1, 1]])
    out = mh.attention(q, k, v, causal=True, segment_ids=ids, scale=-0.5, backend="blocked")
    _close(out, mh.attention_reference(q, k, v, causal=True, segment_ids=ids, scale=-0.5))


def test_blocked_takes_dv_other_than_dk_without_autograd():
    q, k, v = make_qkv(1, 4, 2, 40, 40, 16, 8)
    fn = mh.masks.sliding_window_fn(9)
    with torch.no_grad():
        out = mh.attention(q, k, v, mask=fn, backend="blocked")
        _close(out, mh.attention_reference(q, k, v, mask=fn))
        small = BlockedBackend(block_q=8, span_k=16, block_k=8)
        call = prepare(q, k, v, mask=fn)
        _close(small(call)[0], mh.attention_reference(q, k, v, mask=fn))


def test_module_with_mla_head_sizes_and_a_mask_function_in_eval():
    # auto routes a mask function past the dense limit to blocked; here blocked is named, at a small size
    fn, x = mh.masks.causal_fn(), torch.randn(1, 20, 64)
    outs = []
    for backend in ("blocked", "math"):
        torch.manual_seed(0)
        m = mh.MultiHeadAttention(64, 2, head_dim=32, v_head_dim=16, backend=backend).eval()
        with torch.no_grad():
            outs.append(m(x, mask=fn))
    _close(*outs)


@pytest.mark.parametrize("backend", ["auto", *BACKENDS])
@pytest.mark.parametrize("garbage", [float("nan"), float("inf"), 3e38])
@pytest.mark.parametrize("how", ["valid_lens", "key_padding", "segments"])
def test_hidden_keys_never_reach_the_output_or_a_gradient(backend, garbage, how):
    q, k, v = make_qkv(2, 4, 2, 5, 6, 8, 8, requires_grad=True)
    if how == "valid_lens":
        kw = {"valid_lens": torch.tensor([4, 6])}
    elif how == "key_padding":
        kw = {"mask": mh.masks.key_padding(torch.tensor([[1, 1, 1, 1, 0, 0], [1] * 6]).bool())}
    else:
        kw = {
            "segment_ids": (torch.tensor([[0] * 5, [0] * 5]), torch.tensor([[0, 0, 0, 0, -1, -1], [0] * 6]))
        }
    bad_k, bad_v = k.detach().clone(), v.detach().clone()
    bad_k[0, :, 4:], bad_v[0, :, 4:] = garbage, -garbage
    bad_k.requires_grad_(True)
    bad_v.requires_grad_(True)
    out = mh.attention(q, bad_k, bad_v, backend=backend, **kw)
    ref = mh.attention_reference(q, k, v, **kw)
    _close(out, ref)
    g = torch.randn_like(ref)
    got = torch.autograd.grad(out, (q, bad_k, bad_v), g)
    want = torch.autograd.grad(ref, (q, k, v), g)
    for a, b in zip(got, want, strict=True):
        _close(a, b)
    assert not got[1][0, :, 4:].any() and not got[2][0, :, 4:].any()


@pytest.mark.parametrize("backend", ["auto", *BACKENDS])
def test_a_query_with_no_key_outputs_0_whatever_it_holds(backend):
    q, k, v = make_qkv(2, 2, 2, 4, 4, 8, 8)
    q[1, :, 2:] = float("nan")
    valid = torch.tensor([[4, 4, 4, 4], [4, 4, 0, 0]])
    out = mh.attention(q, k, v, valid_lens=valid, backend=backend)
    assert out[1, :, 2:].eq(0).all()
    _close(out[:, :, :2], mh.attention_reference(q, k, v, valid_lens=valid)[:, :, :2])


@pytest.mark.parametrize("fn", [mh.attention, mh.attention_reference])
def test_valid_lens_of_shape_b_with_no_keys(fn):
    q, k, v = make_qkv(2, 2, 2, 3, 0, 4, 4)
    out = fn(q, k, v, valid_lens=torch.tensor([0, 0]))
    assert out.shape == (2, 2, 3, 4) and not out.any()


@pytest.mark.parametrize("backend", ["auto", "blocked", "math"])
def test_an_empty_batch_with_segment_ids(backend):
    q, k, v = make_qkv(0, 2, 2, 4, 4, 8, 8)
    out = mh.attention(q, k, v, segment_ids=torch.zeros(0, 4, dtype=torch.long), backend=backend)
    assert out.shape == (0, 2, 4, 8)


def test_tensor_fn_on_a_table_with_a_0_size_dimension():
    q, k, v = make_qkv(1, 2, 2, 3, 0, 4, 4)
    table = torch.zeros(1, 1, 3, 0)
    out = mh.attention(q, k, v, bias=mh.masks.tensor_fn(table), backend="math")
    assert out.shape == (1, 2, 3, 4) and not out.any()


@pytest.mark.parametrize("backend", ["auto", *BACKENDS])
def test_a_head_dim_of_0_scores_0(backend):
    q, k, _ = make_qkv(1, 2, 2, 3, 4, 0, 0)
    v = make_qkv(1, 2, 2, 3, 4, 5, 5)[2]
    _close(mh.attention(q, k, v, backend=backend), v.mean(dim=2, keepdim=True).expand(1, 2, 3, 5))


@pytest.mark.parametrize("name", ["causal", "return_weights"])
@pytest.mark.parametrize("bad", ["False", "no", 0.5, [1], 2, None, torch.tensor(True)])
def test_flags_take_only_bools(name, bad):
    q, k, v = make_qkv(1, 2, 2, 3, 3, 4, 4)
    for fn in (mh.attention, mh.attention_reference):
        with pytest.raises(TypeError, match=f"{name} must be True or False"):
            fn(q, k, v, **{name: bad})


@pytest.mark.parametrize("name", ["causal", "return_weights"])
def test_flags_take_0_and_1(name):
    q, k, v = make_qkv(1, 2, 2, 3, 3, 4, 4)
    for flag in (0, 1):
        want = mh.attention(q, k, v, **{name: bool(flag)})
        _close(mh.attention(q, k, v, **{name: flag})[0], want[0])


@pytest.mark.parametrize("name", ["mask", "bias", "valid_lens", "segment_ids"])
def test_masks_on_another_device_are_named(name):
    q, k, v = make_qkv(2, 2, 2, 3, 3, 4, 4)
    meta = {
        "mask": torch.ones(3, 3, dtype=torch.bool, device="meta"),
        "bias": torch.zeros(3, 3, device="meta"),
        "valid_lens": torch.ones(2, dtype=torch.long, device="meta"),
        "segment_ids": torch.zeros(2, 3, dtype=torch.long, device="meta"),
    }[name]
    for fn in (mh.attention, mh.attention_reference):
        with pytest.raises(ValueError, match=f"{name}.* is on meta but q is on cpu"):
            fn(q, k, v, **{name: meta})


@pytest.mark.parametrize(
    "shapes",
    [((2, 3, 8), (2, 4, 6), (2, 5, 5)), ((2, 3, 8), (2, 4, 7), (2, 4, 5)), ((2, 3, 8), (2, 4, 6), (2, 4, 4))],
    ids=["length", "kdim", "vdim"],
)
def test_drop_in_mismatches_are_torch_assertion_errors(shapes):
    m = DropIn(8, 2, kdim=6, vdim=5, batch_first=True)
    with pytest.raises(MultiheadAttentionError):
        m(*(torch.randn(s) for s in shapes))
    with pytest.raises(AssertionError):  # what code written for torch catches
        m(*(torch.randn(s) for s in shapes))


@pytest.mark.parametrize("backend", ["auto", "blocked", "math", "sdpa"])
def test_a_block_mask_for_an_empty_batch(backend):
    from torch.nn.attention.flex_attention import create_block_mask

    bm = create_block_mask(lambda b, h, i, j: i >= j, 0, 2, 3, 3, device="cpu", BLOCK_SIZE=8)
    q, k, v = make_qkv(0, 2, 2, 3, 3, 4, 4)
    assert mh.attention(q, k, v, mask=bm, backend=backend).shape == (0, 2, 3, 4)


@pytest.mark.parametrize("backend", ["auto", *BACKENDS])
@pytest.mark.parametrize("mask", [None, "broadcast"])
def test_no_keys_with_sinks_reads_no_query(backend, mask):
    # found by `make fuzz` (2026-11-29): with Lk = 0 every row is dead, but a (.., 1) mask broadcast over no
    # keys, or no mask at all, left it unrecorded; the sink key then read the query's garbage (NaN out)
    q = torch.full((1, 2, 3, 4), float("nan"), dtype=torch.float64, requires_grad=True)
    k, v = (torch.zeros(1, 2, 0, 4, dtype=torch.float64, requires_grad=True) for _ in range(2))
    sinks = torch.tensor([0.2, -1.0], dtype=torch.float64, requires_grad=True)
    kw = {"sinks": sinks, "scale": -1.0}
    if mask:
        kw["mask"] = torch.ones(1, 1, 1, 1, dtype=torch.bool)
    out = mh.attention(q, k, v, backend=backend, **kw)
    want = mh.attention_reference(torch.zeros_like(q), k, v, **kw)
    _close(out, want)
    assert not out.isnan().any()
    grads = torch.autograd.grad(out.sum(), (q, sinks))
    assert all(g is None or not g.isnan().any() for g in grads)


def _sink_case(dead_rows: bool):
    """q (2, 2, 4, 8), k/v (2, 2, 6, 8) in float64 and a mask function; with ``dead_rows``, rows 2 and 3 see
    no key."""
    q, k, v = make_qkv(2, 2, 2, 4, 6, 8, 8, dtype=torch.float64)

    def mask(b, h, i, j):
        return (j <= i + 2) & (i < 2) if dead_rows else j <= i + 2

    return q, k, v, mask


@pytest.mark.parametrize(
    ("backend", "grad"),
    [(b, g) for b in ("auto", "blocked", "math", "sdpa") for g in (False, True)] + [("flex-eager", False)],
)  # blocked: its fused kernel's log-sum-exp joins without autograd, its online softmax with it
@pytest.mark.parametrize("dead_rows", [False, True])
@pytest.mark.parametrize("sinks", [(float("-inf"), 0.5), (float("-inf"), float("-inf")), (1e4, -1e4)])
def test_a_head_with_no_sink_is_minus_inf(backend, grad, dead_rows, sinks):
    # found by probing past the fuzz suite's randn sinks (2026-11-29): a sink of -inf (that head has none)
    # made the blocked backend's online softmax start from exp(-inf - -inf) = NaN (every row NaN, forward
    # and gradient), and flex's sigmoid(lse - sink) NaN in rows with no key; the reference, math and sdpa
    # gave the right answer. Huge finite sinks are checked beside them
    q, k, v, mask = _sink_case(dead_rows)
    s = torch.tensor(sinks, dtype=torch.float64)
    want = mh.attention_reference(q, k, v, mask=mask, sinks=s)
    qf, kf, vf, sf = (t.float().requires_grad_(grad) for t in (q, k, v, s))
    if backend == "flex-eager":
        out = _flex_eager(qf, kf, vf, mask=mask, sinks=sf)  # the flex backend's sink plumbing, on CPU
    elif backend == "blocked":
        call = prepare(qf, kf, vf, mask=mask, sinks=sf)
        out = BlockedBackend()(call)[0]  # forced: auto leaves calls this small to math
    else:
        out = mh.attention(qf, kf, vf, mask=mask, sinks=sf, backend=backend)
    assert not out.isnan().any()
    torch.testing.assert_close(out.double(), want, atol=2e-5, rtol=2e-5)
    if grad:  # (FlexAttention has no backward on the CPU)
        grads = torch.autograd.grad(out.sum(), (qf, kf, vf, sf))
        leaves = [t.detach().requires_grad_() for t in (q, k, v, s)]
        ref = mh.attention_reference(*leaves[:3], mask=mask, sinks=leaves[3])
        for got, wanted in zip(grads, torch.autograd.grad(ref.sum(), leaves)):
            torch.testing.assert_close(got.double(), wanted, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("backend", ["auto", "blocked", "math", "sdpa"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_nan_or_plus_inf_sink_is_refused_by_name(backend, bad):
    # NaN, or +inf, in a sink made every row of its head NaN on sdpa and the reference and 0 on math
    q, k, v = make_qkv(1, 2, 2, 4, 6, 8, 8)
    with pytest.raises(ValueError, match=r"sinks must be finite logits, or -inf .* head 1"):
        mh.attention(q, k, v, sinks=torch.tensor([0.0, bad]), backend=backend)


def test_a_sink_over_the_range_of_qs_dtype_is_refused_by_name():
    q, k, v = make_qkv(1, 2, 2, 4, 6, 8, 8)
    q, k, v = (t.half() for t in (q, k, v))
    with pytest.raises(
        ValueError, match=r"got 70000.0 \(torch.float16, q's dtype, holds it as inf\) for head 0"
    ):
        mh.attention(q, k, v, sinks=torch.tensor([7e4, 0.0]))


@pytest.mark.parametrize("backend", ["auto", "math", "sdpa", "reference"])
@pytest.mark.parametrize("returned", [False, True])
def test_no_keys_and_a_head_with_no_sink(backend, returned):
    # found by `make fuzz` once it drew -inf sinks (2026-11-29): with Lk = 0, math's sink share was
    # sigmoid(logsumexp(no scores) - sink) = sigmoid(-inf - -inf), NaN in the output and the sink's gradient;
    # the reference's softmax over the lone -inf sink column was NaN in its backward
    q = torch.randn(1, 2, 3, 4, dtype=torch.float64, requires_grad=True)
    k, v = (torch.zeros(1, 2, 0, 4, dtype=torch.float64, requires_grad=True) for _ in range(2))
    sinks = torch.tensor([float("-inf"), 0.3], dtype=torch.float64, requires_grad=True)
    weights = returned and backend != "sdpa"
    if backend == "reference":
        got = mh.attention_reference(q, k, v, sinks=sinks, return_weights=weights)
    else:
        got = mh.attention(q, k, v, sinks=sinks, backend=backend, return_weights=weights)
    out = got[0] if isinstance(got, tuple) else got
    _close(out, torch.zeros(1, 2, 3, 4, dtype=torch.float64))
    grads = torch.autograd.grad(out.sum(), (q, sinks), allow_unused=True)
    assert all(g is None or not g.isnan().any() for g in grads)
