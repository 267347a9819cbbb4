"""Issue 55, item 1: an empty problem (Lq, Lk or both 0) with a mask or bias function written for
FlexAttention's 0-d indices answers the empty result on every backend and the reference.

Such a function (attention-gym's Flamingo interval mask: ``iv[kv_idx][0]``) means the interval's start on a
0-d ``kv_idx`` and the first *row* of ``iv`` on a broadcast index tensor; on an empty tile it used to be called
broadcast and fail with an IndexError. A tile with no point has nothing for it to say.

Dimensions: B batch, H heads, Hkv kv heads, Lq/Lk lengths, Dk/Dv head dims.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from attention_cases import make_qkv

import multihead as mh
from multihead.core.backends.flex import FlexBackend

pytestmark = pytest.mark.numerics

B, H, HKV, DK, DV = 2, 4, 2, 8, 6
INTERVALS = torch.tensor([[0, 3], [2, 5], [1, 4]])  # (keys, 2): the queries [start, end + 2) that see key j
WEIGHTS = torch.tensor([[0.5, -1.0], [2.0, 0.25], [-0.5, 1.5]])  # (keys, 2)


def interval_mask(b, h, q_idx, kv_idx):
    """Scalar-index only: ``INTERVALS[kv_idx][1]`` is the end of key kv_idx's interval on a 0-d kv_idx."""
    return (q_idx >= INTERVALS[kv_idx][0]) & (q_idx < INTERVALS[kv_idx][1] + 2)


def row_bias(b, h, q_idx, kv_idx):
    """Scalar-index only, like interval_mask: a per-key affine bias in the query index."""
    return WEIGHTS[kv_idx][0] * q_idx + WEIGHTS[kv_idx][1]


FUNCTIONS = {"mask": {"mask": interval_mask}, "bias": {"bias": row_bias}}
EMPTY = [(0, 0), (0, 3), (5, 0)]  # (Lq, Lk)
BACKENDS = ["reference", "auto", "math", "sdpa", "blocked"]


def _run(backend, q, k, v, **kw):
    if backend == "reference":
        return mh.attention_reference(q, k, v, **kw)
    return mh.attention(q, k, v, backend=backend, **kw)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("fn", sorted(FUNCTIONS))
@pytest.mark.parametrize("lengths", EMPTY)
@pytest.mark.parametrize("backend", BACKENDS)
def test_an_empty_problem_answers_the_empty_result(backend, lengths, fn, dtype):
    lq, lk = lengths
    q, k, v = make_qkv(B, H, HKV, lq, lk, DK, DV, dtype, requires_grad=True)
    out = _run(backend, q, k, v, **FUNCTIONS[fn])
    # no key at all: every row outputs 0 (the one convention for a row with no allowed key)
    assert out.dtype == dtype
    torch.testing.assert_close(out, torch.zeros(B, H, lq, DV, dtype=dtype), atol=0, rtol=0)
    (out * torch.randn_like(out)).sum().backward()
    for t, shape in ((q, (B, H, lq, DK)), (k, (B, HKV, lk, DK)), (v, (B, HKV, lk, DV))):
        assert t.grad is not None and tuple(t.grad.shape) == shape
        assert bool(torch.isfinite(t.grad).all()) and not bool(t.grad.any())


@pytest.mark.parametrize("lengths", EMPTY)
@pytest.mark.parametrize("backend", BACKENDS)
def test_sinks_and_a_dense_bias_get_zero_gradients_too(backend, lengths):
    """What requires a gradient besides q, k and v gets one, zero, as from the reference (no error from
    torch.autograd.grad for a tensor the answer does not use)."""
    lq, lk = lengths
    q, k, v = make_qkv(B, H, HKV, lq, lk, DK, DV, torch.float64, requires_grad=True)
    sinks = torch.tensor([0.5, float("-inf"), -1.0, 2.0], dtype=torch.float64, requires_grad=True)
    bias = torch.randn(H, lq, lk, dtype=torch.float64, requires_grad=True)
    out = _run(backend, q, k, v, mask=interval_mask, sinks=sinks, bias=bias)
    grads = torch.autograd.grad((out * torch.randn_like(out)).sum(), (q, k, v, sinks, bias))
    for g, t in zip(grads, (q, k, v, sinks, bias), strict=True):
        assert g.shape == t.shape and not bool(g.any())


@pytest.mark.parametrize("fn", sorted(FUNCTIONS))
@pytest.mark.parametrize("lengths", EMPTY)
@pytest.mark.parametrize("backend", ["reference", "math"])
def test_an_empty_problem_returns_empty_weights(backend, lengths, fn):
    lq, lk = lengths
    q, k, v = make_qkv(B, H, HKV, lq, lk, DK, DV, torch.float64)
    got = _run(backend, q, k, v, return_weights=True, **FUNCTIONS[fn])
    torch.testing.assert_close(got.output, torch.zeros(B, H, lq, DV, dtype=torch.float64), atol=0, rtol=0)
    assert got.weights.dtype == torch.float64 and tuple(got.weights.shape) == (B, H, lq, lk)
    assert not bool(got.weights.any())


def _vmap_indexes_with_index_tensors() -> bool:
    """Whether this torch's vmap runs ``t[i][0]`` for a 0-d index tensor i (2.13 does; 2.8's calls .item() and
    refuses, so FlexAttention itself cannot run such a function there)."""
    try:
        torch.vmap(lambda i: INTERVALS[i][0])(torch.arange(2))
    except RuntimeError:
        return False
    return True


@pytest.mark.skipif(
    not _vmap_indexes_with_index_tensors(),
    reason=f"torch {torch.__version__}'s vmap cannot index a tensor with a 0-d index tensor: these functions are "
    f"not valid mask_mods there (the empty cases, which never call them, still run)",
)
@pytest.mark.parametrize("fn", sorted(FUNCTIONS))
@pytest.mark.parametrize("lengths", [(1, 1), (4, 2), (6, 3)])
def test_the_same_functions_work_at_every_non_empty_size(lengths, fn):
    """The functions above are valid ones: at non-empty sizes (Lk <= 3 keys of the tables) every backend
    equals the reference, and the mask is its dense picture."""
    lq, lk = lengths
    q, k, v = make_qkv(B, H, HKV, lq, lk, DK, DV, torch.float64)
    want = mh.attention_reference(q, k, v, **FUNCTIONS[fn])
    for backend in BACKENDS[1:]:
        torch.testing.assert_close(_run(backend, q, k, v, **FUNCTIONS[fn]), want)
    picture = mh.masks.evaluate_fn(interval_mask, (1, 1, lq, lk), "mask")[0, 0]  # (Lq, Lk)
    i = torch.arange(lq)[:, None]  # (Lq, 1)
    start, end = INTERVALS[:lk, 0], INTERVALS[:lk, 1]  # (Lk,)
    assert torch.equal(picture, (i >= start) & (i < end + 2))


@pytest.mark.parametrize("fn", sorted(FUNCTIONS))
@pytest.mark.parametrize("lengths", EMPTY)
def test_flex_answers_an_empty_problem_or_refuses_as_at_any_size(registry, lengths, fn):
    """Compiled flex on the CPU refuses calls this small, as at any size under its threshold; FlexAttention's
    eager path (registered under its own name) serves them, and an empty one gets the empty result, though
    FlexAttention itself fails on a length of 0 (an internal assert, or an IndexError, with any mask)."""
    lq, lk = lengths
    q, k, v = make_qkv(B, H, HKV, lq, lk, DK, DV, torch.float32)
    registry.register(_Named(FlexBackend(compiled=False), "flex-eager"), auto=False)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = mh.attention(q, k, v, backend="flex-eager", **FUNCTIONS[fn])
        torch.testing.assert_close(out, torch.zeros(B, H, lq, DV), atol=0, rtol=0)
        with pytest.raises(ValueError, match="backend 'flex' cannot serve") as refused:
            mh.attention(q, k, v, backend="flex", **FUNCTIONS[fn])
    assert "scores (B*H*Lq*Lk), got 0" in str(refused.value)  # too small to compile for, as at Lq = Lk = 1


class _Named:
    """A backend under another name (the registry keys backends by ``name``)."""

    def __init__(self, backend, name):
        self.backend, self.name = backend, name

    def why_not(self, call):
        return self.backend.why_not(call)

    def __call__(self, call):
        return self.backend(call)


class _Unreachable:
    """A backend that serves every call and must not be run on an empty one."""

    name = "unreachable"

    def why_not(self, call):
        return iter(())

    def __call__(self, call):
        raise AssertionError(f"a backend ran on the empty problem {tuple(call.q.shape)}")


@pytest.mark.parametrize("lengths", EMPTY)
def test_no_backend_runs_on_an_empty_problem(registry, lengths):
    lq, lk = lengths
    registry.register(_Unreachable(), auto=False)
    q, k, v = make_qkv(B, H, HKV, lq, lk, DK, DV, requires_grad=True)
    got = mh.attention(q, k, v, mask=interval_mask, return_weights=True, backend="unreachable")
    assert tuple(got.output.shape) == (B, H, lq, DV) and tuple(got.weights.shape) == (B, H, lq, lk)
    assert not bool(got.output.any()) and got.output.grad_fn is not None


def test_an_empty_tile_does_not_call_the_function():
    calls = []

    def spy(b, h, q_idx, kv_idx):
        calls.append(tuple(torch.broadcast_shapes(b.shape, h.shape, q_idx.shape, kv_idx.shape)))
        return kv_idx <= q_idx

    for lq, lk in EMPTY:
        q, k, v = make_qkv(1, 1, 1, lq, lk, DK, DV)
        mh.attention_reference(q, k, v, mask=spy)
        mh.attention(q, k, v, mask=spy, backend="math")
    assert calls == []
