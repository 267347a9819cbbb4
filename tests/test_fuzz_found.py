"""What the fuzzing of issue 46 found, one test each (every one failed before its fix).

Dimensions: B batch, H heads, Hkv kv heads, Lq/Lk lengths, Dk/Dv head dims.
"""

from __future__ import annotations

import pytest
import torch
from attention_cases import make_qkv

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
