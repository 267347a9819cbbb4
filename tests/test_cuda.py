"""The backend grid on CUDA: every backend x dtype x mask kind (functions and segments included) x softcap x
sinks x MHA/GQA/MQA, outputs, weights and gradients within twice the reference's own error.

Dimensions: B batch, H heads, Hkv kv heads, Lq/Lk lengths, D head dim.

Runs only where CUDA is available (it collects, and skips, elsewhere). ``flex`` compiles a Triton kernel
per shape on first use, so the grid keeps to a few shapes.
"""

import pytest
import torch

import multihead as mh
from multihead import masks
from multihead.core.attention import explain_backends
from multihead.testing import allowed_error, compare_to_reference, reduction_floor

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

DEV = "cuda"
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
BACKENDS = ["auto", "flex", "sdpa", "math"]
HEADS = {"mha": (4, 4), "gqa": (4, 2), "mqa": (4, 1)}
SHAPES = {"square": (2, 97, 97), "cache": (1, 33, 130)}  # (B, Lq, Lk)
D = 64


def _ids(b, length, seed):
    """Packed-row ids (B, L): runs of random lengths, the last few positions padding (-1)."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(b):
        cuts = sorted(torch.randint(1, length - 4, (3,), generator=g).tolist())
        row = torch.full((length,), -1, dtype=torch.long)
        start = 0
        for i, end in enumerate([*cuts, length - 3]):
            row[start:end] = i
            start = end
        rows.append(row)
    return torch.stack(rows).to(DEV)


def kind_kwargs(kind, b, h, lq, lk, seed=1):
    """Attention keywords for one kind on (B, H, Lq, Lk); float tensors in float32 (cast later)."""
    g = torch.Generator().manual_seed(seed)
    if kind == "none":
        return {}
    if kind == "causal":
        return {"causal": True}
    if kind == "mask":
        return {"mask": (torch.rand(b, 1, lq, lk, generator=g) > 0.3).to(DEV)}
    if kind == "bias":
        return {"bias": torch.randn(h, lq, lk, generator=g).to(DEV)}
    if kind == "valid_lens":  # the last batch row has no valid key: dead rows
        return {"valid_lens": torch.tensor([lk - 5, 0][-b:] if b > 1 else [0]).to(DEV)}
    if kind == "window_fn":
        return {"mask": masks.sliding_window_fn(16, lq=lq, lk=lk), "causal": True}
    if kind == "chunked_or_prefix_fn":
        return {"mask": masks.chunked_fn(32, lq=lq, lk=lk) | masks.prefix_lm_fn(4, lq=lq, lk=lk)}
    if kind == "alibi_fn":
        return {"bias": masks.alibi_fn(masks.alibi_slopes(h).to(DEV), lq=lq, lk=lk), "causal": True}
    if kind == "segments":
        ids = _ids(b, lk, seed)
        return {"segment_ids": (ids[:, lk - lq :], ids), "causal": True}
    if kind == "softcap":
        return {"softcap": 5.0, "causal": True}
    if kind == "sinks":
        return {"sinks": torch.randn(h, generator=g).to(DEV), "causal": True}
    if kind == "everything":
        ids = _ids(b, lk, seed)
        return {
            "mask": masks.sliding_window_fn(24, lq=lq, lk=lk),
            "bias": torch.randn(b, 1, lq, lk, generator=g).to(DEV),
            "segment_ids": (ids[:, lk - lq :], ids),
            "causal": True,
            "softcap": 20.0,
            "sinks": torch.randn(h, generator=g).to(DEV),
        }
    raise AssertionError(kind)


KINDS = [
    "none",
    "causal",
    "mask",
    "bias",
    "valid_lens",
    "window_fn",
    "chunked_or_prefix_fn",
    "alibi_fn",
    "segments",
    "softcap",
    "sinks",
    "everything",
]


def _cast(kw, dtype):
    return {
        n: (x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x)
        for n, x in kw.items()
    }


def _qkv(b, h, hkv, lq, lk, dtype, seed=0, requires_grad=False):
    g = torch.Generator().manual_seed(seed)
    out = []
    for heads, length in ((h, lq), (hkv, lk), (hkv, lk)):
        t = torch.randn(b, heads, length, D, generator=g, dtype=torch.float64).to(device=DEV, dtype=dtype)
        out.append(t.requires_grad_(requires_grad))
    return out


def _expected_refusal(backend, kw, lq, lk, return_weights=False):
    """The one reason a backend must decline this call on CUDA, or None if it must serve it."""
    native_causal_only = set(kw) <= {"causal"} and (not kw.get("causal") or lq == lk)
    if backend == "flex" and native_causal_only:  # nothing to skip blocks by: sdpa's own kernels serve it
        return "no mask or bias"
    if backend == "sdpa" and kw.get("softcap") is not None:
        return "cannot soft-cap"
    if backend == "flex" and return_weights:
        return "cannot return attention weights"
    if backend == "sdpa" and return_weights:
        return "cannot return attention weights"
    return None


def _serve(backend, q, k, v, kw, return_weights=False):
    """Run the call; assert a refusal is exactly the expected one. Returns the result or None if refused."""
    reasons = explain_backends(q, k, v, return_weights=return_weights, **kw)
    expected = _expected_refusal(backend, kw, q.shape[2], k.shape[2], return_weights)
    if backend != "auto" and reasons[backend]:
        assert expected is not None and any(expected in r for r in reasons[backend]), reasons[backend]
        return None
    assert expected is None, f"{backend} should refuse ({expected}) but serves"
    return mh.attention(q, k, v, backend=backend, return_weights=return_weights, **kw)


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("heads", sorted(HEADS))
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("backend", BACKENDS)
def test_grid_matches_reference(backend, dtype, kind, heads, shape):
    b, lq, lk = SHAPES[shape]
    h, hkv = HEADS[heads]
    q, k, v = _qkv(b, h, hkv, lq, lk, dtype)
    kw = _cast(kind_kwargs(kind, b, h, lq, lk), dtype)
    if _serve(backend, q, k, v, kw) is None:
        return
    report = compare_to_reference(lambda *a, **k_: mh.attention(*a, backend=backend, **k_), q, k, v, **kw)
    assert report.ok, report


@pytest.mark.parametrize("kind", ["causal", "valid_lens", "segments", "softcap", "sinks", "everything"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_math_weights_on_cuda(dtype, kind):
    b, lq, lk = SHAPES["cache"]
    q, k, v = _qkv(b, 4, 2, lq, lk, dtype)
    kw = _cast(kind_kwargs(kind, b, 4, lq, lk), dtype)
    report = compare_to_reference(
        lambda *a, **k_: mh.attention(*a, backend="math", **k_), q, k, v, return_weights=True, **kw
    )
    assert report.ok and report.fast_weights is not None, report
    for backend in ("sdpa", "flex"):
        assert _serve(backend, q, k, v, kw, return_weights=True) is None


def _grads(fn, q, k, v, kw, grad_out):
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    extra = {
        n: (x.detach().clone().requires_grad_(True) if n in ("bias", "sinks") else x) for n, x in kw.items()
    }
    fn(*leaves, **extra).backward(grad_out.to(leaves[0].dtype))
    return [t.grad for t in leaves] + [extra[n].grad for n in ("bias", "sinks") if n in extra]


@pytest.mark.parametrize(
    "kind", ["causal", "valid_lens", "window_fn", "segments", "softcap", "sinks", "everything"]
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("backend", ["flex", "sdpa", "math"])
def test_gradients_match_reference(backend, dtype, kind):
    """Gradients to q, k, v, a bias and the sinks: within twice the reference's own error, finite."""
    b, lq, lk = SHAPES["square"]
    q, k, v = _qkv(b, 4, 2, lq, lk, dtype)
    kw = _cast(kind_kwargs(kind, b, 4, lq, lk), dtype)
    if _serve(backend, q, k, v, kw) is None:
        return
    gen = torch.Generator().manual_seed(2)
    grad_out = torch.randn(b, 4, lq, D, generator=gen, dtype=torch.float64).to(DEV)
    gold = _grads(
        mh.attention_reference, *(t.double() for t in (q, k, v)), _cast(kw, torch.float64), grad_out
    )
    ref = _grads(mh.attention_reference, q, k, v, kw, grad_out)
    fast = _grads(lambda *a, **k_: mh.attention(*a, backend=backend, **k_), q, k, v, kw, grad_out)
    names = ["dq", "dk", "dv"] + [n for n in ("bias", "sinks") if n in kw]
    for name, g_fast, g_ref, g_gold in zip(names, fast, ref, gold):
        assert torch.isfinite(g_fast).all()
        ref_err = float((g_ref.double() - g_gold).abs().max())
        fast_err = float((g_fast.double() - g_gold).abs().max())
        # a bias gradient sums the score gradients it broadcast over, a sinks gradient every row of its head
        terms = {"bias": b * 4 * lq * lk // max(g_gold.numel(), 1), "sinks": b * lq}.get(name)
        extra = 0.0 if terms is None else reduction_floor(dtype, float(g_gold.abs().max()), terms)
        allowed = allowed_error(ref_err, dtype) + extra
        assert fast_err <= allowed, (name, fast_err, ref_err, allowed)


@pytest.mark.parametrize("backend", ["sdpa", "math"])
@pytest.mark.parametrize("kind", ["causal", "segments", "sinks"])
def test_dropout_is_unbiased_on_cuda(backend, kind):
    """Averaged over many draws, dropout's output approaches the output without dropout."""
    b, lq, lk = SHAPES["cache"]
    q, k, v = _qkv(b, 4, 4, lq, lk, torch.float32)
    kw = kind_kwargs(kind, b, 4, lq, lk)
    want = mh.attention(q, k, v, backend=backend, **kw)
    runs = 400
    mean = sum(mh.attention(q, k, v, backend=backend, dropout=0.2, **kw) for _ in range(runs)) / runs
    assert torch.isfinite(mean).all()
    assert float((mean - want).abs().mean()) < 0.05


def test_dead_rows_are_zero_on_every_cuda_backend():
    b, lq, lk = SHAPES["square"]
    q, k, v = _qkv(b, 4, 2, lq, lk, torch.float16)
    ids = torch.full((b, lk), -1, dtype=torch.long, device=DEV)
    ids[0, :10] = 0  # row 1 is all padding, row 0 has 87 padding queries
    for backend in BACKENDS:
        kw = {"segment_ids": ids, "sinks": torch.zeros(4, device=DEV, dtype=torch.float16)}
        out = mh.attention(q, k, v, backend=backend, **kw)
        assert out[1].abs().max() == 0 and out[0, :, 10:].abs().max() == 0 and torch.isfinite(out).all()


def test_flex_serves_function_masks_without_a_dense_grid():
    """auto picks flex for a function mask on CUDA, and the dense backends refuse past their limit."""
    q, k, v = _qkv(1, 2, 2, 4096, 4096, torch.bfloat16)
    kw = {"mask": masks.sliding_window_fn(128), "causal": True}
    reasons = explain_backends(q, k, v, **kw)
    assert reasons["flex"] == []
    big = _qkv(4, 16, 16, 4096, 4096, torch.bfloat16)
    reasons = explain_backends(*big, **kw)
    assert reasons["flex"] == [] and any("dense (B, H, Lq, Lk) grid" in r for r in reasons["math"])


def test_negative_valid_lens_act_as_zero_on_cuda():
    """On a GPU valid_lens are not read on the host (no sync): a negative length is a row with no key."""
    q, k, v = _qkv(2, 4, 2, 9, 9, torch.float32)
    for backend in BACKENDS:
        neg = mh.attention(q, k, v, backend=backend, valid_lens=torch.tensor([-3, 5], device=DEV))
        zero = mh.attention(q, k, v, backend=backend, valid_lens=torch.tensor([0, 5], device=DEV))
        assert torch.equal(neg, zero) and neg[0].abs().max() == 0
