"""Compiled FlexAttention on the CPU (multihead.core.backends.flex_cpu): the routing policy, the block mask
built from a function's tile structure (a user's BlockMask refined, never changed in meaning), the
fallback when compiling fails, and the compiled kernel's numbers against the float64 reference.

The numeric cases compile (a few seconds each, cached on disk by inductor afterwards), so there are few."""

from __future__ import annotations

import os
import warnings

import pytest
import torch

import multihead as mh
from multihead.core import backends
from multihead.core.attention import prepare
from multihead.core.backends import flex_cpu
from multihead.core.backends.flex import FlexBackend
from multihead.core.backends.flex_cpu import CpuFlex, to_flex
from multihead.core.masks.blocks import Blocks, from_flex, refine, structure
from multihead.testing import compare_to_reference

flex_attention = pytest.importorskip(
    "torch.nn.attention.flex_attention", reason="FlexAttention (torch >= 2.5)"
)
if not hasattr(flex_attention, "create_block_mask"):
    pytest.skip("this torch's FlexAttention lacks create_block_mask", allow_module_level=True)


def _qkv(h=4, hkv=4, lq=96, lk=96, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(1, h, lq, d, generator=g), torch.randn(1, hkv, lk, d, generator=g),
            torch.randn(1, hkv, lk, d, generator=g))  # fmt: skip


def band(b, h, q, kv):
    return (q - kv < 20) & (kv - q < 20)


# ----------------------------------------------------------------------------------------------
# Policy: which calls, when
# ----------------------------------------------------------------------------------------------


def test_auto_routing_waits_for_a_hot_large_call_and_refuses_what_it_cannot_serve(monkeypatch):
    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    monkeypatch.setattr(flex_cpu, "_TORCH", flex_cpu.VERIFIED)  # the policy, on any torch
    cpu = CpuFlex(min_scores=4 * 96 * 96 - 1, hot=3)
    q, k, v = _qkv()
    call = prepare(q, k, v, mask=band)
    assert list(cpu.why_not(call)) == []
    assert [cpu.defers(call) is None for _ in range(4)] == [False, False, True, True]  # the 3rd call on
    small = prepare(q[:, :, :95], k, v, mask=band)
    assert any("smaller ones cost less" in r for r in cpu.why_not(small))
    unbounded = prepare(q, k, v, mask=lambda b, h, i, j: i.float().sin() > 0)
    assert "cannot be bounded" in CpuFlex(min_scores=1, hot=1).defers(unbounded).reason
    refused = {
        "causal": prepare(q, k, v, mask=band, causal=True),
        "float64": prepare(q.double(), k.double(), v.double(), mask=band),
        "dense mask": prepare(q, k, v, mask=torch.ones(96, 96, dtype=torch.bool)),
        "sinks": prepare(q, k, v, mask=band, sinks=torch.zeros(4)),
        "Dk != Dv": prepare(q, k, v[..., :8], mask=band),
    }
    for name, c in refused.items():
        assert list(cpu.why_not(c)), name
    with torch.enable_grad():
        assert any("no backward" in r for r in cpu.why_not(prepare(q.requires_grad_(), k, v, mask=band)))


class _Kernels:
    """The two contenders, counted, on a fake clock that advances by each one's cost: flex's compiled entry
    point without a compiler (nor flex's own compiled wrapper: the block mask's mask_mod, exactly) and
    blocked."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, flex_s: float = 0.0, blocked_s: float = 0.0) -> None:
        self.now, self.costs = 0.0, {"flex": flex_s, "blocked": blocked_s}
        self.calls, self.made = {"flex": 0, "blocked": 0}, []
        monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
        monkeypatch.setattr(flex_cpu, "_TORCH", flex_cpu.VERIFIED)
        monkeypatch.setattr(flex_cpu, "_entry_point", lambda: self.flex)
        monkeypatch.setattr(flex_cpu, "_clock", lambda: self.now)

    def _tick(self, name: str) -> None:
        self.now, self.calls[name] = self.now + self.costs[name], self.calls[name] + 1

    def flex(self, q, k, v, block_mask, scale, enable_gqa):
        self._tick("flex")
        self.made.append(mh.attention_reference(q, k, v, mask=block_mask.mask_mod).to(q.dtype))
        return self.made[-1]

    def blocked(self, call):
        self._tick("blocked")
        return backends.get("blocked")(call)[0]


def _causal(b, h, i, j):
    return j <= i  # query tile t of 1,024 sees t + 1 tiles of 128 keys: 576 keys on average


def _narrow(b, h, i, j):
    return (i - j < 16) & (j - i < 16)  # 2 or 3 tiles: 2.75 x 128 = 352 keys


@pytest.mark.parametrize(("flex_s", "blocked_s", "winner"), [(2.0, 1.0, "blocked"), (1.0, 3.0, "flex")])
@pytest.mark.parametrize("kind", ["causal", "narrow band", "BlockMask"])
def test_auto_routing_measures_once_and_keeps_the_faster(monkeypatch, flex_s, blocked_s, winner, kind):
    """Which of ATen's fused kernel (blocked) and the compiled template is faster depends on the CPU and the
    mask (on a Zen 1, AVX2 only, blocked won every mask, narrow bands included; on AVX-512 EPYCs the template
    won bands): the first hot call of a (function, shape) compiles, runs both MEASURE_ROUNDS times and the
    faster serves it from then on; a BlockMask passed in is measured the same way."""
    kernels = _Kernels(monkeypatch, flex_s, blocked_s)
    q, k, v = (torch.randn(1, 2, 1024, 8) for _ in range(3))
    cpu = CpuFlex(min_scores=1, hot=1)
    mask = {
        "causal": _causal,
        "narrow band": _narrow,
        "BlockMask": flex_attention.create_block_mask(_narrow, None, None, 1024, 1024, device="cpu"),
    }[kind]
    call = prepare(q, k, v, mask=mask)
    assert cpu.defers(call) is None  # not measured yet: this call compiles and measures
    with torch.no_grad():
        out = cpu(call, kernels.blocked)
    assert out is kernels.made[0]  # the call's own result, not one of the measured calls
    rounds = flex_cpu.MEASURE_ROUNDS
    assert kernels.calls == {"flex": 1 + rounds, "blocked": rounds}  # the call itself, then each in turn
    deferral = cpu.defers(call)
    if winner == "blocked":
        assert deferral is not None and deferral.to == "blocked"
        assert "keys on average" in deferral.reason
        assert "1000.0 ms against the compiled template's 2000.0" in deferral.reason
    else:
        assert deferral is None
        with torch.no_grad():
            cpu(call, kernels.blocked)  # measured once: never again
        assert kernels.calls == {"flex": 2 + rounds, "blocked": rounds}


def test_long_span_limits_the_measurement_to_wide_tiles(monkeypatch):
    """``long_span`` > 0 measures only (function, shape)s whose query tiles see that many keys on average."""
    kernels = _Kernels(monkeypatch)
    q, k, v = (torch.randn(1, 2, 1024, 8) for _ in range(3))
    cpu = CpuFlex(min_scores=1, hot=1, long_span=384)
    rounds = flex_cpu.MEASURE_ROUNDS
    with torch.no_grad():
        cpu(prepare(q, k, v, mask=_narrow), kernels.blocked)  # 352 keys: not measured
        assert kernels.calls == {"flex": 1, "blocked": 0}
        cpu(prepare(q, k, v, mask=_causal), kernels.blocked)  # 576 keys: measured
        assert kernels.calls == {"flex": 2 + rounds, "blocked": rounds}


def test_the_registry_routes_small_cpu_calls_with_functions_as_before():
    q, k, v = _qkv()
    with torch.no_grad():
        for _ in range(3):
            assert backends.select(prepare(q, k, v, mask=band)).name == "sdpa"  # dense, below MIN_SCORES


def test_a_failed_compile_warns_once_and_blocked_answers(monkeypatch):
    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    monkeypatch.setattr(flex_cpu, "_TORCH", flex_cpu.VERIFIED)  # the fallback, on any torch

    def broken():
        raise RuntimeError("no C++ compiler\nmore")

    monkeypatch.setattr(flex_cpu, "_entry_point", broken)
    backend = FlexBackend(cpu=CpuFlex(min_scores=1, hot=1), fallback=backends.get("blocked"))
    q, k, v = _qkv()
    call = prepare(q, k, v, mask=band)
    with pytest.raises(RuntimeError, match="no C"):  # without a fallback: the error itself
        FlexBackend(cpu=CpuFlex(min_scores=1, hot=1))(call)
    with pytest.warns(RuntimeWarning, match="no C\\+\\+ compiler; the blocked|blocked backend serves it"):
        out, _ = backend(call)
    torch.testing.assert_close(out, mh.attention_reference(q, k, v, mask=band), rtol=1e-5, atol=1e-5)
    assert any("compiled flex failed" in r for r in backend.why_not(call))


# ----------------------------------------------------------------------------------------------
# Block masks from tile structure
# ----------------------------------------------------------------------------------------------


def _dense(blocks: Blocks) -> torch.Tensor:
    """(Lq, Lk) codes of a structure: 0 empty, 1 partial, 2 full."""
    code = blocks.allowed.to(torch.int8) + blocks.full.to(torch.int8)
    return code.repeat_interleave(blocks.block_q, 0).repeat_interleave(blocks.block_k, 1)[
        : blocks.lq, : blocks.lk
    ]


@pytest.mark.parametrize("lq,lk", [(256, 256), (200, 330)])
def test_refine_keeps_a_block_masks_meaning(lq, lk):
    """A coarse BlockMask with a block dropped and a partial block declared full: refined to finer tiles,
    every pair is allowed exactly as flex_attention reads the coarse one."""
    bm = flex_attention.create_block_mask(band, None, None, lq, lk, device="cpu", BLOCK_SIZE=128)
    coarse = from_flex(bm, (1, 1, lq, lk)).blocks
    allowed = coarse.allowed.clone()
    full = coarse.full.clone()
    allowed[0, 0] = False  # a block left out: nothing there is attended
    full[1, 1] = allowed[1, 1] = True  # declared full: the mask_mod is never asked there
    coarse = Blocks(128, 128, lq, lk, allowed, full)
    fine = refine(coarse, structure(band, (1, 1, lq, lk), 32, 32))
    i, j = torch.arange(lq)[:, None], torch.arange(lk)[None]
    want = _dense(coarse).eq(2) | (_dense(coarse).eq(1) & band(0, 0, i, j))
    code = _dense(fine)
    assert not (want & code.eq(0)).any(), "an allowed pair in a tile called empty"
    assert (want[code.eq(2)]).all(), "a forbidden pair in a tile called full"
    got = code.eq(2) | (code.eq(1) & band(0, 0, i, j))
    assert torch.equal(got, want)


def test_to_flex_lists_the_structures_tiles():
    blocks = structure(band, (1, 1, 200, 200), 64, 64)
    bm = to_flex(blocks, band)
    back = from_flex(bm, (1, 1, 200, 200)).blocks
    assert torch.equal(back.allowed, blocks.allowed) and torch.equal(back.full, blocks.full)


# ----------------------------------------------------------------------------------------------
# The compiled kernel, against the float64 reference (these compile: few cases)
# ----------------------------------------------------------------------------------------------

_IDS = torch.tensor([0] * 40 + [1] * 70 + [2] * 50)  # documents of a captured tensor


def _documents(b, h, q, kv):
    return (_IDS[q] == _IDS[kv]) & (kv <= q)


def _user_block_mask(lq, lk):
    return flex_attention.create_block_mask(band, None, None, lq, lk, device="cpu", BLOCK_SIZE=128)


CASES = {
    # a band with Lq != Lk, grouped heads and query rows that see no key (output 0)
    "band gqa Lq!=Lk": dict(shape=(4, 2, 150, 110), mask=lambda b, h, q, kv: (q - kv < 20) & (kv - q < 20)),
    "documents (captured ids)": dict(shape=(4, 4, 160, 160), mask=_documents),
    "user BlockMask, refined": dict(shape=(4, 4, 200, 200), mask="user"),
}


@pytest.mark.numerics
@pytest.mark.parametrize("name", list(CASES))
def test_compiled_flex_on_cpu_matches_the_reference(name):
    """Under ATEN_CPU_CAPABILITY=avx2 (tests/cpu_kernels.py reruns this after the main suite compiled the
    same cases for AVX-512) it must compile for AVX2 and never load the AVX-512 graphs inductor cached on
    disk (wrong results, seen). Under ``default`` or a torch before flex_cpu.VERIFIED (the floor job) the
    tested behaviour is the refusal: nothing compiles (see flex_cpu's docstring for why)."""
    h, hkv, lq, lk = CASES[name]["shape"]
    q, k, v = _qkv(h, hkv, lq, lk)
    mask = CASES[name]["mask"]
    mask = _user_block_mask(lq, lk) if mask == "user" else mask
    backend = FlexBackend(cpu=CpuFlex(min_scores=1, hot=1))
    if os.environ.get("ATEN_CPU_CAPABILITY") == "default" or flex_cpu._TORCH < flex_cpu.VERIFIED:
        call = prepare(q, k, v, mask=mask)
        assert any(("ATEN_CPU_CAPABILITY" in r) or ("needs torch" in r) for r in backend.why_not(call))
        assert backends.select(call).name != "flex"
        return

    def run(q, k, v, mask):
        call = prepare(q, k, v, mask=mask)
        assert list(backend.why_not(call)) == [] and backend.defers(call) is None
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)  # a fallback to blocked would not test flex
            return backend(call)[0]

    with torch.no_grad():
        rep = compare_to_reference(run, q, k, v, mask=mask)
    assert rep.ok, rep
    if name.startswith("band"):  # rows 130.. see no key (Lk = 110): zero, as on every backend
        assert run(q, k, v, mask)[:, :, 130:].abs().max() == 0
