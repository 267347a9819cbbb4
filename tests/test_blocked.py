"""The ``blocked`` backend against dense oracles: every masking feature, both paths, gradients, skipping.

Dimensions: B batch, H query heads, Hkv kv heads, Lq/Lk lengths, D head dim.

Each case builds the function-mode call (``Normalized`` with ``mask_fn``/``bias_fn``/``segments``) and its
dense equivalent (the functions evaluated on the full grid, a (B, 1, Lq, Lk) mask from the ids): without
softcap/sinks the gold is :func:`multihead.attention_reference` on the dense masks
(:func:`multihead.testing.compare_to_reference`, the 2x rule); with them, the small float64 formula below.
"""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
from attention_cases import LargestTensor

import multihead as mh
from multihead.core import backends, masks
from multihead.core.backends.base import AttentionCall
from multihead.core.backends.blocked import PROBE, BlockedBackend, packed_runs
from multihead.core.masks import Normalized
from multihead.testing import allowed_error, compare_to_reference

pytestmark = pytest.mark.numerics  # compares with float64: tests/cpu_kernels.py

DEFAULT = BlockedBackend()
SMALL = BlockedBackend(block_q=16, span_k=32)  # many blocks and spans: the online softmax joins them


def _qkv(b, h, hkv, lq, lk, d, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, lq, d, generator=g, dtype=dtype)  # (B, H, Lq, D)
    k, v = (torch.randn(b, hkv, lk, d, generator=g, dtype=dtype) for _ in range(2))  # (B, Hkv, Lk, D)
    return q, k, v


def _grid(fn, b, h, lq, lk):
    """A function evaluated on the full (B, H, Lq, Lk) index grid (the test may: its shapes are small)."""
    idx = (torch.arange(b).view(-1, 1, 1, 1), torch.arange(h).view(1, -1, 1, 1),
           torch.arange(lq).view(1, 1, -1, 1), torch.arange(lk).view(1, 1, 1, -1))  # fmt: skip
    return torch.as_tensor(fn(*idx)).expand(b, h, lq, lk)


def _dense(q, k, *, mask_fn=None, bias_fn=None, segments=None, causal=False, mask=None, bias=None):
    """The dense (B, H, Lq, Lk) keep mask and bias (or None) equivalent to a function-mode call."""
    b, h, lq, lk = q.shape[0], q.shape[1], q.shape[2], k.shape[2]
    keep = torch.ones(b, h, lq, lk, dtype=torch.bool)
    if mask is not None:
        keep = keep & mask
    if mask_fn is not None:
        keep = keep & _grid(mask_fn, b, h, lq, lk)
    if segments is not None:
        qid, kid = segments
        keep = keep & ((qid[:, None, :, None] == kid[:, None, None, :]) & (kid[:, None, None, :] >= 0))
    if causal:
        keep = keep & mh.masks.causal(lq, lk)
    dense_bias = None if bias is None else bias.expand(b, h, lq, lk).to(q.dtype)
    if bias_fn is not None:
        fb = _grid(bias_fn, b, h, lq, lk).to(q.dtype)
        dense_bias = fb if dense_bias is None else dense_bias + fb
    return keep, dense_bias


def _formula(q, k, v, keep, bias, scale, softcap, sinks):
    """Dense attention with softcap and sinks, in q's dtype: the oracle for what the reference lacks."""
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)  # (B, H, Lk, D)
    s = q @ k.transpose(-2, -1) * scale  # (B, H, Lq, Lk)
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    if bias is not None:
        s = s + bias.to(s.dtype)
    s = s.masked_fill(~keep, -math.inf)
    top = s.amax(-1, keepdim=True)  # (B, H, Lq, 1)
    if sinks is not None:
        top = torch.maximum(top, sinks.to(s.dtype).view(1, -1, 1, 1))
    top = top.masked_fill(torch.isneginf(top), 0.0)
    e = torch.exp(s - top)
    den = e.sum(-1, keepdim=True)
    if sinks is not None:
        den = den + torch.exp(sinks.to(s.dtype).view(1, -1, 1, 1) - top)
    return (e / den.masked_fill(den == 0, 1.0)) @ v  # (B, H, Lq, D); rows with nothing: 0


def _run(
    backend, q, k, v, *, scale=None, softcap=None, sinks=None, mask=None, bias=None, causal=False, **fns
):
    norm = Normalized(
        None if mask is None else mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape)),
        None if bias is None else bias.reshape((1,) * (4 - bias.dim()) + tuple(bias.shape)).to(q.dtype),
        causal,
        None,
        **fns,
    )
    call = AttentionCall(
        q, k, v, norm, scale or q.shape[-1] ** -0.5, 0.0, False, softcap=softcap, sinks=sinks
    )
    assert not list(backend.why_not(call)), list(backend.why_not(call))
    out, weights = backend(call)
    assert weights is None and out.shape == (*q.shape[:3], v.shape[-1])
    return out


def _check(backend, q, k, v, *, softcap=None, sinks=None, causal=False, mask=None, bias=None, **fns):
    """The 2x rule against the reference (dense masks) or, with softcap/sinks, the float64 formula."""
    keep, dense_bias = _dense(q, k, causal=causal, mask=mask, bias=bias, **fns)

    def fast(*_, **__):
        return _run(
            backend, q, k, v, softcap=softcap, sinks=sinks, causal=causal, mask=mask, bias=bias, **fns
        )

    if softcap is None and sinks is None:
        report = compare_to_reference(fast, q, k, v, mask=keep, bias=dense_bias)
        assert report.ok, report
        return
    args = (keep, dense_bias, q.shape[-1] ** -0.5, softcap)
    gold = _formula(q.double(), k.double(), v.double(), *args, None if sinks is None else sinks.double())
    own = float((_formula(q, k, v, *args, sinks).double() - gold).abs().max())
    err = float((fast().double() - gold).abs().max())
    assert err <= allowed_error(own, q.dtype), (err, own)


def _window(w, causal=True):
    if causal:
        return lambda b, h, q_idx, kv_idx: (q_idx - kv_idx < w) & (kv_idx <= q_idx)
    return lambda b, h, q_idx, kv_idx: (q_idx - kv_idx).abs() < w


def _alibi(h):
    slopes = torch.tensor([2.0 ** (-8 * (i + 1) / h) for i in range(h)])
    return lambda b, hh, q_idx, kv_idx: -slopes[hh] * (q_idx - kv_idx).abs()


def _packed(lengths, pad=0):
    """Segment ids of sequences packed in one row: 0 0 0 1 1 2 ... then ``pad`` padding positions (-1)."""
    ids = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)] + [torch.full((pad,), -1)])
    return ids[None]  # (1, L)


def test_the_formula_is_the_reference_without_softcap_and_sinks():
    q, k, v = _qkv(2, 4, 2, 9, 11, 8, torch.float64)
    keep, bias = _dense(q, k, mask_fn=_window(3), bias_fn=_alibi(4), causal=True)
    want = mh.attention_reference(q, k, v, mask=keep, bias=bias)
    assert torch.allclose(_formula(q, k, v, keep, bias, 8**-0.5, None, None), want, atol=1e-12)


# ----------------------------------------------------------------------------------------------
# Every feature, float64 and float32, both backend sizes
# ----------------------------------------------------------------------------------------------

FEATURES = {
    "causal": dict(causal=True, mask_fn=lambda b, h, q_idx, kv_idx: kv_idx >= 0),
    "window": dict(mask_fn=_window(7)),
    "window-bidirectional": dict(mask_fn=_window(5, causal=False)),
    "window-and-causal-flag": dict(mask_fn=lambda b, h, q_idx, kv_idx: q_idx - kv_idx < 6, causal=True),
    "alibi": dict(bias_fn=_alibi(4)),
    "alibi-window-causal": dict(bias_fn=_alibi(4), mask_fn=_window(9), causal=True),
    "per-batch-and-head": dict(mask_fn=lambda b, h, q_idx, kv_idx: (kv_idx + b + h) % 3 != 0),
    "dead-rows": dict(mask_fn=lambda b, h, q_idx, kv_idx: (q_idx % 5 != 0) & (kv_idx <= q_idx)),
    "softcap": dict(softcap=2.0, mask_fn=_window(8)),
    "sinks": dict(sinks=torch.tensor([0.5, -1.0, 2.0, 0.0]), mask_fn=_window(8)),
    "softcap-sinks-alibi": dict(softcap=3.0, sinks=torch.tensor([1.0, 0.0, -2.0, 3.0]), bias_fn=_alibi(4),
                                causal=True, mask_fn=lambda b, h, q_idx, kv_idx: kv_idx >= 0),
    "sinks-dead-rows": dict(sinks=torch.tensor([0.5, -1.0, 2.0, 0.0]),
                            mask_fn=lambda b, h, q_idx, kv_idx: q_idx % 4 != 1),
}  # fmt: skip


@pytest.mark.parametrize("backend", [DEFAULT, SMALL], ids=["default", "small-blocks"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("feature", list(FEATURES))
def test_features_match_the_reference(feature, dtype, backend):
    kwargs = dict(FEATURES[feature])
    if "sinks" in kwargs:
        kwargs["sinks"] = kwargs["sinks"].to(dtype)
    q, k, v = _qkv(2, 4, 2, 45, 45, 16, dtype)
    _check(backend, q, k, v, **kwargs)


@pytest.mark.parametrize(
    ("h", "hkv", "lq", "lk", "d"),
    [(4, 4, 1, 1, 8), (4, 1, 97, 97, 8), (6, 2, 37, 97, 59), (2, 2, 97, 37, 16), (1, 1, 1025, 1025, 8),
     (4, 2, 1, 50, 16)],
    ids=["L1", "mqa-97", "gqa-Lq<Lk-D59", "Lq>Lk", "L1025", "one-query"],
)  # fmt: skip
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
def test_awkward_shapes(h, hkv, lq, lk, d, dtype):
    q, k, v = _qkv(1, h, hkv, lq, lk, d, dtype)
    _check(SMALL if lq < 1025 else DEFAULT, q, k, v, mask_fn=_window(40), bias_fn=_alibi(h), causal=True)
    sinks = torch.linspace(-1, 1, h, dtype=dtype)
    _check(
        SMALL if lq < 1025 else DEFAULT, q, k, v, mask_fn=_window(30, causal=False), softcap=4.0, sinks=sinks
    )


def test_dense_mask_and_bias_with_functions():
    """Dense tensors AND/add with the functions; rows the dense mask kills are re-opened + row_ok."""
    q, k, v = _qkv(2, 4, 4, 33, 33, 8, torch.float64)
    mask = torch.rand(2, 1, 33, 33, generator=torch.Generator().manual_seed(1)) > 0.3
    bias = torch.randn(1, 4, 33, 33, dtype=torch.float64)
    _check(SMALL, q, k, v, mask=mask, bias=bias, mask_fn=_window(12))
    norm = mh.masks.normalize((2, 4, 33, 33), mask=mask & (torch.arange(33) != 3).view(1, 1, -1, 1))
    assert norm.row_ok is not None  # row 3 is dead in the dense part
    norm.mask_fn = _window(12)
    out, _ = SMALL(AttentionCall(q, k, v, norm, 8**-0.5, 0.0, False))
    keep, _ = _dense(q, k, mask=mask & (torch.arange(33) != 3).view(1, 1, -1, 1), mask_fn=_window(12))
    assert torch.allclose(out, mh.attention_reference(q, k, v, mask=keep), atol=1e-12)
    assert out[:, :, 3].abs().max() == 0


# ----------------------------------------------------------------------------------------------
# Segment ids: the varlen path (packed runs) and the tiled fallback
# ----------------------------------------------------------------------------------------------


def test_packed_runs_finds_the_layout():
    ids = torch.tensor([[0, 0, 1, 1, 1, -1, 2], [3, 3, 3, 3, -1, -1, -1]])
    assert packed_runs(ids, ids) == [[(0, 2, 0, 2), (2, 5, 2, 5), (6, 7, 6, 7)], [(0, 4, 0, 4)]]
    assert packed_runs(torch.tensor([[0, 1, 0]]), torch.tensor([[0, 1, 2]])) is None  # 0 twice: not packed
    kv = torch.tensor([[5, 5, 0, 0, 0, 0, 0, 0, 9]])  # ids may differ in order and length on each side
    assert packed_runs(torch.tensor([[0, 0, 5, 7]]), kv) == [[(0, 2, 2, 8), (2, 3, 0, 2)]]


SEGMENTS = {
    "packed": (_packed([5, 9, 1, 20, 3], pad=4), None),
    "no-padding": (_packed([16, 16]), None),
    "interleaved (tiled)": (torch.tensor([[0, 1, 0, 1, 2, 2, -1, 0, 1, 2] * 4]), None),
    "query id without keys": (torch.tensor([[0] * 10 + [1] * 10 + [2] * 20]),
                              torch.tensor([[0] * 10 + [-1] * 10 + [2] * 20])),
}  # fmt: skip


@pytest.mark.parametrize("inference", [False, True], ids=["grad", "no-grad"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("extra", ["causal", "window", "alibi", "softcap-sinks", "none"])
@pytest.mark.parametrize("layout", list(SEGMENTS))
def test_segments(layout, extra, dtype, inference):
    """Both ways out of the varlen path: pieces joined by ``cat`` (autograd on) and written into one
    buffer (no grad), gaps and ids without keys included."""
    qid, kid = SEGMENTS[layout]
    kid = qid if kid is None else kid
    qid, kid = qid.expand(2, -1).clone(), kid.expand(2, -1).clone()
    qid[1] = qid[1].flip(0)  # the second row another layout
    kid[1] = kid[1].flip(0)
    n = qid.shape[1]
    q, k, v = _qkv(2, 4, 2, n, n, 8, dtype)
    kwargs = {
        "causal": dict(causal=True),
        "window": dict(mask_fn=_window(4)),
        "alibi": dict(bias_fn=_alibi(4)),
        "softcap-sinks": dict(
            softcap=2.5, sinks=torch.tensor([0.0, 1.0, -1.0, 2.0], dtype=dtype), causal=True
        ),
        "none": {},
    }[extra]
    with torch.no_grad() if inference else contextlib.nullcontext():
        for backend in (DEFAULT, SMALL):
            _check(backend, q, k, v, segments=(qid, kid), **kwargs)


def test_segments_dead_rows_are_zero():
    ids = _packed([6, 4], pad=5)
    q, k, v = _qkv(1, 2, 2, 15, 15, 8)
    out = _run(DEFAULT, q, k, v, segments=(ids, ids), causal=True)
    assert out[:, :, 10:].abs().max() == 0 and out[:, :, :10].abs().min() >= 0
    qid = torch.tensor([[0] * 5 + [1] * 10])
    out = _run(DEFAULT, q, k, v, segments=(qid, torch.tensor([[0] * 15])))  # id 1 has no key
    assert out[:, :, 5:].abs().max() == 0 and out[:, :, :5].abs().max() > 0


@pytest.mark.parametrize("extra", ["causal", "window-alibi", "softcap-sinks"])
def test_varlen_gradients_match_the_reference(extra):
    """Training on a packed batch: gradients of q, k, v (and sinks) as the dense reference gives them."""
    ids = _packed([7, 12, 1, 9], pad=3)
    kwargs = {
        "causal": dict(causal=True),
        "window-alibi": dict(mask_fn=_window(5), bias_fn=_alibi(4), causal=True),
        "softcap-sinks": dict(softcap=2.0, sinks=torch.tensor([0.0, 1.0, -1.0, 2.0], dtype=torch.float64)),
    }[extra]
    q, k, v = (t.requires_grad_() for t in _qkv(1, 4, 2, 32, 32, 8, torch.float64))
    sinks, softcap = kwargs.pop("sinks", None), kwargs.pop("softcap", None)
    if sinks is not None:
        sinks.requires_grad_()
    keep, bias = _dense(q, k, segments=(ids, ids), **kwargs)
    grads = []
    for fn in (
        lambda: _run(DEFAULT, q, k, v, segments=(ids, ids), sinks=sinks, softcap=softcap, **kwargs),
        lambda: _formula(q, k, v, keep, bias, 8**-0.5, softcap, sinks),
    ):
        out = fn()
        out.backward(torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view(out.shape))
        leaves = (q, k, v) + ((sinks,) if sinks is not None else ())
        grads.append([t.grad.clone() for t in leaves])
        for t in leaves:
            t.grad = None
    for got, want in zip(*grads, strict=True):
        assert torch.isfinite(got).all() and torch.allclose(got, want, atol=1e-10)


@pytest.mark.parametrize("feature", ["window-alibi", "softcap-sinks"])
def test_tiled_gradients_match_the_formula(feature):
    kwargs = {
        "window-alibi": dict(mask_fn=_window(9), bias_fn=_alibi(2), causal=True),
        "softcap-sinks": dict(mask_fn=lambda b, h, q_idx, kv_idx: q_idx % 6 != 2, softcap=1.5),
    }[feature]
    q, k, v = (t.requires_grad_() for t in _qkv(2, 2, 1, 40, 40, 8, torch.float64))
    sinks = (
        torch.tensor([0.3, -0.7], dtype=torch.float64, requires_grad=True) if "softcap" in kwargs else None
    )
    keep, bias = _dense(q, k, **{n: x for n, x in kwargs.items() if n != "softcap"})
    leaves = [t for t in (q, k, v, sinks) if t is not None]
    got = torch.autograd.grad(_run(SMALL, q, k, v, sinks=sinks, **kwargs).square().sum(), leaves)
    ref = _formula(q, k, v, keep, bias, 8**-0.5, kwargs.get("softcap"), sinks)
    want = torch.autograd.grad(ref.square().sum(), leaves)
    for a, b in zip(got, want, strict=True):
        assert torch.allclose(a, b, atol=1e-10)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("hkv", [4, 2])
def test_window_training_through_the_fused_kernel_matches_the_reference(dtype, hkv):
    """A causal window as a plain lambda under autograd: blocks of queries whose key spans overlap, each one
    fused-kernel call (the training path), q, k and v cut by one-buffer pieces; values and gradients
    against the float64 reference."""
    q, k, v = _qkv(2, 4, hkv, 200, 200, 8, torch.float64)
    window = lambda b, h, q_idx, kv_idx: (q_idx >= kv_idx) & (q_idx - kv_idx < 48)  # noqa: E731
    grads = []
    fused = BlockedBackend(block_q=32, block_k=16)  # one span of at most 80 keys a block: the fused kernel
    for run, kind in ((lambda *t: _run(fused, *t, mask_fn=window), dtype),
                      (lambda *t: mh.attention_reference(*t, mask=window), torch.float64)):  # fmt: skip
        leaves = [t.detach().to(kind).requires_grad_() for t in (q, k, v)]
        out = run(*leaves)
        grads.append([out.detach().double(), *torch.autograd.grad(out.square().sum(), leaves)])
    for got, want in zip(*grads, strict=True):
        assert torch.isfinite(got).all()
        assert torch.allclose(got.double(), want, atol=1e-10 if dtype == torch.float64 else 1e-4)


def test_pieces_share_one_gradient_buffer():
    """Overlapping, repeated and unused pieces: the gradient is slicing's; no slice_backward runs."""
    from multihead.core.backends._pieces import pieces

    t = torch.randn(1, 2, 10, 3, dtype=torch.float64, requires_grad=True)
    got = pieces(t, [(0, 4), (2, 7), (0, 4), (6, 10)])
    assert list(got) == [(0, 4), (2, 7), (6, 10)] and torch.equal(got[2, 7], t[:, :, 2:7])
    weights = [torch.randn(1, 2, n, 3, dtype=torch.float64) for n in (4, 5)]
    loss = (got[0, 4] * weights[0]).sum() + (got[2, 7] * weights[1]).sum()  # (6, 10) unused
    assert "SliceBackward" not in str(loss.grad_fn.next_functions)
    want = (t[:, :, 0:4] * weights[0]).sum() + (t[:, :, 2:7] * weights[1]).sum()
    assert torch.equal(*(torch.autograd.grad(x, t)[0] for x in (loss, want)))
    with torch.no_grad():
        assert pieces(t, [(1, 3)])[1, 3].grad_fn is None


# ----------------------------------------------------------------------------------------------
# Cost: skipped tiles, no (Lq, Lk) tensor
# ----------------------------------------------------------------------------------------------


def test_tiles_beyond_the_window_are_never_computed_nor_evaluated_past_the_diagonal():
    """A causal sliding window: the mask function is evaluated only on spans up to the diagonal, the bias
    function (evaluated only where scores are computed) only on keys inside the window's reach."""
    n, w, blk = 512, 32, 64
    evaluated, computed = [], []

    def window(b, h, q_idx, kv_idx):
        evaluated.append((int(q_idx.min()), int(q_idx.max()), int(kv_idx.min()), int(kv_idx.max())))
        return q_idx - kv_idx < w

    def spy_bias(b, h, q_idx, kv_idx):
        computed.append((int(q_idx.min()), int(q_idx.max()), int(kv_idx.min()), int(kv_idx.max())))
        return torch.zeros(())

    q, k, v = _qkv(1, 2, 2, n, n, 8)
    _run(BlockedBackend(block_q=blk, span_k=128), q, k, v, mask_fn=window, bias_fn=spy_bias, causal=True)
    assert all(k0 <= q1 for _, q1, k0, _ in evaluated)  # never a chunk wholly past the diagonal
    assert sum((q1 - q0 + 1) * (k1 - k0 + 1) for q0, q1, k0, k1 in evaluated) < 0.6 * n * n
    pairs = sum((q1 - q0 + 1) * (k1 - k0 + 1) for q0, q1, k0, k1 in computed)
    assert pairs <= n * (w + blk)  # the visible band (n*w) plus one block's width: not n*n/2
    assert all(q0 - k0 < w + blk and k1 <= q1 for q0, q1, k0, k1 in computed)


@pytest.mark.parametrize("grad", [False, True], ids=["inference", "autograd"])
@pytest.mark.parametrize("path", ["tiled", "varlen"])
def test_no_tensor_of_the_scores_size(path, grad):
    """No op creates a tensor as large as one head's (Lq, Lk) scores (here B = H = 1: the output and
    the inputs are L * D = L * 16 elements, L*L is 16x that)."""
    n = 256
    q, k, v = (t.requires_grad_(grad) for t in _qkv(1, 1, 1, n, n, 16))
    kwargs = (
        dict(mask_fn=_window(64), causal=True)
        if path == "tiled"
        else dict(segments=(_packed([75, 125, 56]),) * 2)
    )
    with torch.set_grad_enabled(grad), LargestTensor() as seen:
        out = _run(BlockedBackend(block_q=32, span_k=128), q, k, v, **kwargs)
        if grad:
            out.sum().backward()
    limit = max(PROBE, 32 * 128) if path == "tiled" else 125 * 125  # a probe or one span / the longest run
    assert seen.largest <= max(limit, n * 16) < n * n


# ----------------------------------------------------------------------------------------------
# Which calls it serves, and the auto order
# ----------------------------------------------------------------------------------------------


def _reasons(q, k, v, *, return_weights=False, dropout=0.0, softcap=None, **fns):
    norm = Normalized(None, None, False, None, **fns)
    return list(DEFAULT.why_not(AttentionCall(q, k, v, norm, 0.1, dropout, return_weights, softcap=softcap)))


def test_why_not_names_each_reason():
    q, k, v = _qkv(1, 2, 2, 8, 8, 4)
    fn = dict(mask_fn=_window(2))
    assert _reasons(q, k, v, **fn) == []
    assert "return_weights" in _reasons(q, k, v, return_weights=True, **fn)[0]
    assert "dropout" in _reasons(q, k, v, dropout=0.1, **fn)[0]
    assert "dtypes" in _reasons(*(t.half() for t in (q, k, v)), **fn)[0]
    assert "CPU only" in _reasons(*(t.to("meta") for t in (q, k, v)), **fn)[0]
    assert "sdpa" in _reasons(q, k, v)[0]  # dense masks, nothing else: sdpa's kernel
    assert "math" in _reasons(q, k, v, softcap=5.0)[0]  # dense softcap, short: math
    big = _qkv(1, 1, 1, 1024, 1024, 4)
    assert _reasons(*big, softcap=5.0) == []


def test_blocked_comes_after_sdpa_and_before_math():
    order = backends.AUTO_ORDER
    assert order.index("sdpa") < order.index("blocked") == order.index("math") - 1


def test_constructor_checks_its_sizes():
    with pytest.raises(ValueError, match="block_q must be a positive int"):
        BlockedBackend(block_q=0)


# ----------------------------------------------------------------------------------------------
# End to end through multihead.attention
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(mask=_window(6), causal=True),
        dict(bias=_alibi(4), mask=_window(9, causal=False)),
        dict(segment_ids=_packed([9, 14, 3], pad=6).expand(2, -1), causal=True),
        dict(
            segment_ids=_packed([9, 14, 3], pad=6).expand(2, -1),
            softcap=3.0,
            sinks=torch.tensor([0.0, 1.0, -1.0, 0.5]),
        ),
        dict(mask=_window(5), softcap=2.0, valid_lens=torch.tensor([30, 11])),
    ],
    ids=["window", "alibi-window", "segments", "segments-softcap-sinks", "window-softcap-valid-lens"],
)
def test_through_attention_matches_the_reference(kwargs):
    q, k, v = _qkv(2, 4, 2, 32, 32, 8, torch.float64)
    got = mh.attention(q, k, v, backend="blocked", **kwargs)
    want = mh.attention_reference(q, k, v, **kwargs)
    assert torch.allclose(got, want, atol=1e-12)


def test_auto_picks_blocked_where_a_dense_grid_would_be_too_big():
    """Past the dense backends' grid limit a function-mode CPU call goes to blocked, not math."""
    q, k, v = (t.expand(1, 1, 9000, 1) for t in _qkv(1, 1, 1, 1, 1, 1))  # 81M scores: over 2**26
    why = mh.core.explain_backends(q, k, v, mask=_window(8), causal=True)
    assert why["sdpa"] and why["blocked"] == []
    assert next(n for n in backends.AUTO_ORDER if not why[n]) == "blocked"
    why = mh.core.explain_backends(q, k, v, softcap=5.0)  # dense with softcap: sdpa cannot, blocked can
    assert next(n for n in backends.AUTO_ORDER if not why[n]) == "blocked"


@pytest.mark.parametrize(
    "fn",
    [
        masks.sliding_window_fn(7),
        masks.sliding_window_fn(5, causal=False, lq=40, lk=48),
        masks.chunked_fn(16, lq=40, lk=48) | masks.sliding_window_fn(3, lq=40, lk=48),
        masks.causal_fn(40, 48) & masks.prefix_lm_fn(torch.tensor([5, 30]), lq=40, lk=48),
    ],
    ids=["window", "window-both-sides", "chunked-or-window", "causal-and-prefix"],
)
def test_key_ranges_skip_tiles_and_keep_the_output(fn):
    """With a library mask function the tiled path evaluates it only inside its key range, and the
    output still equals the reference."""
    evaluated = []

    def spy(b, h, q_idx, kv_idx):
        evaluated.append((int(q_idx.min()), int(q_idx.max()) + 1, int(kv_idx.min()), int(kv_idx.max()) + 1))
        return fn(b, h, q_idx, kv_idx)

    spied = masks.MaskFunction(spy, bound=fn.bound)
    q, k, v = _qkv(2, 4, 2, 40, 48, 8, torch.float64)
    got = _run(SMALL, q, k, v, mask_fn=spied)
    want = mh.attention_reference(q, k, v, mask=fn)
    assert torch.allclose(got, want, atol=1e-12)
    for q0, q1, k0, k1 in evaluated:  # every probe inside its block's key range
        lo, hi = fn.key_range(q0, q1)
        assert lo <= k0 and k1 <= hi, ((q0, q1, k0, k1), (lo, hi))
    assert evaluated  # the function was consulted


def test_a_window_function_is_evaluated_only_near_its_band():
    """sliding_window_fn at L=512, W=32: the mask function is evaluated on about n * (W + block) pairs,
    not the n*n/2 below the diagonal that a plain lambda costs."""
    n, w, blk = 512, 32, 64
    fn = masks.sliding_window_fn(w)
    evaluated = []

    def spy(b, h, q_idx, kv_idx):
        evaluated.append((int(q_idx.min()), int(q_idx.max()), int(kv_idx.min()), int(kv_idx.max())))
        return fn(b, h, q_idx, kv_idx)

    q, k, v = _qkv(1, 2, 2, n, n, 8)
    _run(BlockedBackend(block_q=blk, span_k=128), q, k, v, mask_fn=masks.MaskFunction(spy, bound=fn.bound),
         causal=True)  # fmt: skip
    pairs = sum((q1 - q0 + 1) * (k1 - k0 + 1) for q0, q1, k0, k1 in evaluated)
    assert pairs <= n * (w + blk)
    assert all(q0 - k0 < w + blk and k1 <= q1 for q0, q1, k0, k1 in evaluated)


def test_auto_sends_small_packed_cpu_batches_to_blocked():
    """Padding-free packing (16 x 8 tokens in one row) is under the dense limit, yet auto routes it to
    blocked's per-sequence path (sdpa defers: it would score every pair of the row); backend='sdpa'
    still serves it, and both equal the reference."""
    ids = _packed([8] * 16)  # (1, 128)
    q, k, v = _qkv(1, 4, 2, 128, 128, 8, torch.float64)
    call = AttentionCall(q, k, v, mh.masks.normalize((1, 4, 128, 128), segment_ids=ids, causal=True),
                         8**-0.5, 0.0, False)  # fmt: skip
    assert backends.select(call).name == "blocked"
    assert "packed segment ids on CPU" in backends.get("sdpa").defers(call).reason
    want = mh.attention_reference(q, k, v, segment_ids=ids, causal=True)
    for name in ("auto", "sdpa"):
        got = mh.attention(q, k, v, segment_ids=ids, causal=True, backend=name)
        assert torch.allclose(got, want, atol=1e-12)
    unpacked = torch.tensor([[0, 1] * 64])  # ids interleaved: not the packed layout, sdpa keeps it
    call = AttentionCall(
        q, k, v, mh.masks.normalize((1, 4, 128, 128), segment_ids=unpacked), 8**-0.5, 0.0, False
    )
    assert backends.select(call).name == "sdpa"


@pytest.mark.parametrize("other_thread", [False, True])
def test_torch_threads_change_only_while_no_other_python_thread_runs(other_thread):
    """blocked runs its tile mask ops on one torch thread; torch's count is process-wide, so it may
    change only while the caller is the process's only Python thread."""
    import threading

    seen = []

    def band(b, h, q, kv):
        seen.append(torch.get_num_threads())
        return (q - kv).abs() < 8

    before = torch.get_num_threads()
    stop = threading.Event()
    waiter = threading.Thread(target=stop.wait) if other_thread else None
    torch.set_num_threads(2)
    try:
        if waiter is not None:
            waiter.start()
        q, k, v = (torch.randn(1, 2, 64, 8) for _ in range(3))
        alone = threading.active_count() == 1  # False too where an earlier test left a thread running
        mh.attention(q, k, v, mask=band, backend="blocked")
    finally:
        stop.set()
        if waiter is not None:
            waiter.join()
        torch.set_num_threads(before)
    assert min(seen) == (1 if alone else 2)
    assert alone or other_thread or threading.active_count() > 1
