"""The flex backend on a GPU, decided on the CPU: which auto-routed calls it leaves to sdpa
(:func:`multihead.core.backends.flex.gpu_deferral`), and what it does when torch's compiler fails.

Dimensions: B batch, H heads, Hkv kv heads, Lq/Lk lengths, D head dim. The routing rule reads only the
call's masks and lengths, so CPU tensors decide it as CUDA tensors would; the compile-failure path is
reached on the CPU by taking the backend's GPU route with an eager FlexAttention underneath.
"""

import warnings

import pytest
import torch
from torch._inductor.exc import InductorError

import multihead as mh
from multihead import masks
from multihead.core.attention import prepare
from multihead.core.backends import flex as flex_mod
from multihead.core.backends.flex import SEGMENTS_ON_FLEX, FlexBackend, gpu_deferral


def _qkv(lq=40, lk=40, h=4, hkv=2, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(2, h, lq, d, generator=g),
        torch.randn(2, hkv, lk, d, generator=g),
        torch.randn(2, hkv, lk, d, generator=g),
    )


def _ids(n):
    return torch.tensor([[0] * (n // 2) + [1] * (n - n // 2)] * 2)


@pytest.mark.parametrize(
    "kw",
    [
        {"valid_lens": torch.tensor([40, 7])},
        {"mask": torch.rand(2, 1, 40, 40) > 0.3},
        {"bias": torch.randn(4, 40, 40)},
        {"sinks": torch.randn(4), "causal": True},
        {"segment_ids": _ids(40), "causal": True},
    ],
    ids=["valid_lens", "mask", "bias", "sinks", "short segments"],
)
def test_tensor_masks_go_to_sdpa(kw):
    deferral = gpu_deferral(prepare(*_qkv(), **kw))
    assert deferral is not None and deferral.to == "sdpa"


@pytest.mark.parametrize(
    "kw",
    [
        {"mask": masks.sliding_window_fn(8), "causal": True},
        {"bias": masks.alibi_fn(masks.alibi_slopes(4)), "causal": True},
        {"softcap": 20.0},
        {"mask": lambda b, h, q, kv: q >= kv},
    ],
    ids=["window function", "bias function", "softcap", "lambda"],
)
def test_functions_and_softcap_stay_with_flex(kw):
    assert gpu_deferral(prepare(*_qkv(), **kw)) is None


def test_long_packed_rows_stay_with_flex():
    n = int(SEGMENTS_ON_FLEX**0.5)
    q, k, v = (t[:1, :1, :1].expand(1, 1, n, 16) for t in _qkv())
    assert gpu_deferral(prepare(q, k, v, segment_ids=_ids(n)[:1], causal=True)) is None
    assert (
        gpu_deferral(prepare(q[:, :, :64], k[:, :, :64], v[:, :, :64], segment_ids=_ids(64)[:1])) is not None
    )


class _CompilerBroke(InductorError):
    def __init__(self):
        Exception.__init__(self, "NoValidChoicesError: No choices to select")


def _compiler_raising(err):
    """A stand-in for ``flex._compiled_flex`` whose compiled function raises ``err``."""

    def compiled():
        def run(**kw):
            raise err

        return run

    return compiled


@pytest.mark.filterwarnings("ignore:.*backward.*")
def test_a_compile_failure_runs_flex_eagerly_once_warned(monkeypatch):
    """torch's compiler failing on a call (as inductor did on an H200 for some grouped-query shapes): the
    call is answered by eager FlexAttention, with the same meaning, and one warning naming the shape."""

    monkeypatch.setattr(flex_mod, "_compiled_flex", _compiler_raising(_CompilerBroke()))
    monkeypatch.setattr(FlexBackend, "_on_cpu", lambda self, call: False)  # the GPU route, on the CPU
    flex_mod._warn_once.cache_clear()
    q, k, v = _qkv(seed=1)
    fn = masks.sliding_window_fn(8)
    with torch.no_grad(), warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        out, _ = FlexBackend()(prepare(q, k, v, mask=fn, causal=True))
        FlexBackend()(prepare(q, k, v, mask=fn, causal=True))
    notes = [w for w in seen if "could not compile flex_attention" in str(w.message)]
    assert len(notes) == 1 and "(2, 4, 40, 16)" in str(notes[0].message)
    want = mh.attention_reference(q.double(), k.double(), v.double(), mask=fn, causal=True)
    torch.testing.assert_close(out.double(), want, atol=2e-6, rtol=2e-5)


def test_other_errors_are_not_swallowed(monkeypatch):
    monkeypatch.setattr(flex_mod, "_compiled_flex", _compiler_raising(RuntimeError("CUDA out of memory")))
    monkeypatch.setattr(FlexBackend, "_on_cpu", lambda self, call: False)
    with torch.no_grad(), pytest.raises(RuntimeError, match="out of memory"):
        FlexBackend()(prepare(*_qkv(), mask=masks.sliding_window_fn(8), causal=True))
