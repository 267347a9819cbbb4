"""Models on the GPU: the KV-cache decode loop, ``generate()``, ``torch.compile``, a small Llama on the
transformers integration, the head tools, BlockMask input, context parallelism at one rank, no host
synchronisation on the hot path, and a decode step in a CUDA graph.

Dimensions: B batch, H heads, Hkv kv heads, L/Lq/Lk lengths, D head dim, E model width, V vocabulary.

Every number is checked against float64 ground truth: a fast result in a working dtype may be at most
twice as far from the float64 run of the same model as a plain reference in that dtype is
(:func:`multihead.testing.allowed_error`). Greedy tokens are checked where random weights can tie: each
chosen token's float64 logit must be within the measured working-dtype error of the best one.

Runs on CUDA only by default (the file collects, and skips, without a GPU). ``MULTIHEAD_TEST_DEVICE=cpu``
runs everything that is not CUDA-specific on the CPU, which is how the file is checked without a GPU.
"""

from __future__ import annotations

import copy
import os
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch._dynamo.utils import counters

import multihead as mh
from multihead import distributed as mhd
from multihead import heads, viz
from multihead.testing import allowed_error, compare_to_reference, merge_floor

DEV = torch.device(os.environ.get("MULTIHEAD_TEST_DEVICE", "cuda"))
pytestmark = pytest.mark.skipif(
    DEV.type == "cuda" and not torch.cuda.is_available(),
    reason="needs CUDA (MULTIHEAD_TEST_DEVICE=cpu runs this file on the CPU)",
)
cuda_only = pytest.mark.skipif(
    DEV.type != "cuda", reason="CUDA-specific: host synchronisation and CUDA graphs exist only on a GPU"
)

DTYPES = [torch.float32, torch.bfloat16]
PAD, BOS, EOS = 0, 1, 2
_SRC = os.path.dirname(mh.__file__)


def _fresh_compiler() -> None:
    """Compile from a clean slate: no earlier test's graphs, guards or counters."""
    torch._dynamo.reset()
    counters.clear()


# ------------------------------------------------------------------------------------------------
# Helpers: the 2x rule on whole models
# ------------------------------------------------------------------------------------------------


def _err(a: torch.Tensor, gold: torch.Tensor) -> float:
    return float((a.double() - gold.double()).abs().max()) if a.numel() else 0.0


def _within(fast, ref, gold, dtype, what, extra=0.0):
    """|fast - gold| <= allowed_error(|ref - gold|, dtype) (+ ``extra``): the 2x rule for one tensor."""
    fe, re = _err(fast, gold), _err(ref, gold)
    assert torch.isfinite(fast).all(), f"{what}: not finite"
    allowed = allowed_error(re, dtype) + extra
    assert fe <= allowed, f"{what}: |fast - gold| = {fe:.3g} > {allowed:.3g} (reference's own error {re:.3g})"


def _twin(model: nn.Module, dtype: torch.dtype, device=DEV, backend: str | None = None) -> nn.Module:
    """A copy of ``model`` in ``dtype`` on ``device``; ``backend`` set on every multihead attention module."""
    twin = copy.deepcopy(model).to(device=device, dtype=dtype)
    if backend is not None:
        for m in twin.modules():
            if isinstance(m, mh.MultiHeadAttention):
                m.backend = backend
    return twin


def _randn(*shape, dtype=torch.float32, seed=0, device=DEV):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64).to(device=device, dtype=dtype)


def _greedy_choices_hold(gold_logits, chosen, tol, what):
    """Each chosen token (T,) is a best token of the float64 logits (T, V) up to ``tol``."""
    best = gold_logits.max(-1).values
    picked = gold_logits.gather(-1, chosen[:, None]).squeeze(-1)
    gap = best - picked  # (T,), >= 0
    worst = int(gap.argmax())
    assert float(gap.max()) <= tol, (
        f"{what}: step {worst} chose token {int(chosen[worst])} whose float64 logit is {float(gap[worst]):.3g} "
        f"below the best ({int(gold_logits[worst].argmax())}); tolerance {tol:.3g}"
    )


# ------------------------------------------------------------------------------------------------
# 1. The KV-cache decode loop
# ------------------------------------------------------------------------------------------------


def _mha(**kw):
    torch.manual_seed(0)
    return mh.MultiHeadAttention(32, 4, kv_heads=2, **kw).eval()


@pytest.mark.parametrize("max_len", [None, 10], ids=["growing", "max_len"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cached_decode_loop_equals_the_full_causal_call(dtype, max_len):
    """A prefill of 3 tokens then one token per step through a KVCache, on DEV, against the full causal
    call: within twice the error of the math backend's full call in the same dtype (float64 gold)."""
    model = _mha(rotary=True)
    x = _randn(2, 10, 32, dtype=torch.float64, seed=1)
    fast = _twin(model, dtype)
    cache = mh.KVCache(max_len=max_len)
    with torch.no_grad():
        steps = [fast(x[:, :3].to(dtype), cache=cache, causal=True)]
        steps += [fast(x[:, t : t + 1].to(dtype), cache=cache, causal=True) for t in range(3, 10)]
        got = torch.cat(steps, dim=1)  # (B, L, E)
        ref = _twin(model, dtype, backend="math")(x.to(dtype), causal=True)
        gold = _twin(model, torch.float64)(x, causal=True)
    assert len(cache) == 10 and cache.keys.device.type == DEV.type
    if max_len is not None:
        assert cache.capacity == max_len
    _within(got, ref, gold, dtype, "cached decode")


# ------------------------------------------------------------------------------------------------
# 2. Transformer.generate()
# ------------------------------------------------------------------------------------------------


def _transformer():
    torch.manual_seed(3)
    model = mh.Transformer(
        13, 13, d_model=32, num_heads=4, num_encoder_layers=2, num_decoder_layers=2, d_ff=64, kv_heads=2,
        rotary=True, max_len=64, pad_id=PAD,
    )  # fmt: skip
    with torch.no_grad():  # decisive logits: random output weights scaled up, so choices rarely tie
        model.out_proj.weight.mul_(8.0)
    return model.eval()


def _teacher_logits(model, src, tokens):
    """Logits (B, T, V) of ``tokens`` (B, T) given the source, by one full forward on ``[bos] + tokens[:-1]``."""
    dec_in = torch.cat([torch.full_like(tokens[:, :1], BOS), tokens[:, :-1]], dim=1)
    return model(src, dec_in)


def _generated_positions(tokens):
    """(B, T) bool: the positions up to and including each row's first eos (after it: fill)."""
    is_eos = (tokens == EOS).long()
    return (is_eos.cumsum(1) - is_eos) == 0


@pytest.mark.parametrize("beam_size", [1, 3])
def test_generate_on_device_is_greedy_or_beam_under_float64(beam_size):
    """generate() in float32 on DEV: every greedy choice is a best token of the float64 model (up to the
    float32 logits' measured error), and beam scores equal float64 teacher forcing of the returned
    hypotheses (length penalty 1: the mean log-probability)."""
    base = _transformer()
    g = torch.Generator().manual_seed(4)
    src = torch.randint(3, 13, (3, 7), generator=g).to(DEV)
    src[2, 5:] = PAD
    fast, gold_model = _twin(base, torch.float32), _twin(base, torch.float64)
    ref_model = _twin(base, torch.float32, backend="math")
    tokens, scores = fast.generate(
        src, bos_id=BOS, eos_id=EOS, max_len=9, beam_size=beam_size, return_scores=True
    )
    assert tokens.device.type == DEV.type and tokens.shape[0] == 3
    keep = _generated_positions(tokens)
    with torch.no_grad():
        gold = _teacher_logits(gold_model, src, tokens)  # (B, T, V)
        ref = _teacher_logits(ref_model, src, tokens)
        on_dev = _teacher_logits(fast, src, tokens)
    _within(on_dev[keep], ref[keep], gold[keep], torch.float32, "teacher-forced logits")
    tol = 2 * allowed_error(_err(ref[keep], gold[keep]), torch.float32)  # log_softmax: two logits' errors
    logp = gold.log_softmax(-1)
    logp[..., PAD] = float("-inf")  # generate() never emits padding (excluded after the softmax)
    picked = logp.gather(-1, tokens[..., None]).squeeze(-1)  # (B, T)
    want = torch.where(keep, picked, 0.0).sum(1) / keep.sum(1)  # mean log-probability (length_penalty=1)
    torch.testing.assert_close(scores.double(), want, rtol=0, atol=10 * tol)
    if beam_size == 1:
        _greedy_choices_hold(logp[keep], tokens[keep], tol, "greedy generate")


# ------------------------------------------------------------------------------------------------
# 3. torch.compile(fullgraph=True)
# ------------------------------------------------------------------------------------------------


def test_compiled_module_forward_equals_eager():
    """The module compiled whole (inductor: Triton on CUDA) in bf16 (the fused kernels' dtype, under the
    sdpa_kernel priority context) with causal and valid_lens, within the 2x rule of its eager run's own
    error against float64. One dtype: each compile costs seconds (the decode step below runs float32)."""
    dtype = torch.bfloat16
    _fresh_compiler()
    model = _mha()
    x = _randn(2, 16, 32, dtype=torch.float64, seed=2)
    lens = torch.tensor([16, 9], device=DEV)
    eager = _twin(model, dtype)
    compiled = torch.compile(eager, fullgraph=True)
    with torch.no_grad():
        got = compiled(x.to(dtype), causal=True, valid_lens=lens)
        want = eager(x.to(dtype), causal=True, valid_lens=lens)
        gold = _twin(model, torch.float64)(x, causal=True, valid_lens=lens)
    _within(got, want, gold, dtype, "compiled forward")


def test_compiled_decode_step_equals_eager():
    """One-token steps on a KVCache(max_len=...) compiled with fullgraph=True (inductor), against eager
    steps on their own cache: within the 2x rule against the float64 steps."""
    _fresh_compiler()
    model = _mha(rotary=True)
    x = _randn(2, 12, 32, dtype=torch.float64, seed=3)
    eager, gold_model = _twin(model, torch.float32), _twin(model, torch.float64)

    def step(x_t, cache):
        return eager(x_t, cache=cache, causal=True)

    compiled = torch.compile(step, fullgraph=True)
    caches = [mh.KVCache(max_len=12) for _ in range(3)]
    with torch.no_grad():
        for c, m, dt in zip(
            caches, (eager, eager, gold_model), (torch.float32, torch.float32, torch.float64)
        ):
            m(x[:, :4].to(dt), cache=c, causal=True)  # prefill, eagerly
        for t in range(4, 12):
            x_t = x[:, t : t + 1]
            got = compiled(x_t.float(), caches[0])
            want = step(x_t.float(), caches[1])
            gold = gold_model(x_t, cache=caches[2], causal=True)
            _within(got, want, gold, torch.float32, f"compiled decode step {t}")
    assert len(caches[0]) == 12 and caches[0].capacity == 12


# ------------------------------------------------------------------------------------------------
# 4. A small Llama on attn_implementation="multihead" against transformers' sdpa
# ------------------------------------------------------------------------------------------------


def _llama_pair(dtype):
    T = pytest.importorskip("transformers")
    from multihead.integrations import transformers as mhtf

    name = mhtf.register()
    config = T.LlamaConfig(
        vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, initializer_range=0.1, pad_token_id=0,
        bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    torch.manual_seed(0)
    sdpa = T.AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="sdpa").eval()
    ours = T.AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation=name).eval()
    ours.load_state_dict(sdpa.state_dict())
    gold = copy.deepcopy(sdpa).to(device=DEV, dtype=torch.float64)
    return ours.to(device=DEV, dtype=dtype), sdpa.to(device=DEV, dtype=dtype), gold


def _left_padded(b=3, length=9, seed=5):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 64, (b, length), generator=g)
    keep = torch.ones(b, length, dtype=torch.long)
    keep[0, :3] = 0  # left padding on the first row
    keep[2, :1] = 0
    ids[keep == 0] = 0
    return ids.to(DEV), keep.to(DEV)


def _positions(keep):
    return (keep.cumsum(-1) - 1).clamp_min(0)  # what generate() gives a left-padded row


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_llama_on_multihead_equals_sdpa(dtype):
    """Logits of a left-padded batch (real tokens) within twice sdpa's own error against sdpa in float64;
    greedy generate() on multihead picks, at every step, a best token of the float64 model up to that
    error (random weights can tie), and equals sdpa's tokens where no choice was that close."""
    ours, sdpa, gold = _llama_pair(dtype)
    ids, keep = _left_padded()
    kw = {"input_ids": ids, "attention_mask": keep, "position_ids": _positions(keep)}
    with torch.no_grad():
        got, ref, want = (m(**kw).logits for m in (ours, sdpa, gold))
    real = keep.bool()
    _within(got[real], ref[real], want[real], dtype, "llama logits")

    gen = {"attention_mask": keep, "max_new_tokens": 6, "do_sample": False, "pad_token_id": 0}
    with torch.no_grad():
        out_ours, out_sdpa = ours.generate(ids, **gen), sdpa.generate(ids, **gen)
        full = torch.cat([keep, torch.ones_like(out_ours[:, ids.shape[1] :])], dim=1)
        tf = {"attention_mask": full, "position_ids": _positions(full)}
        gold_logits = gold(input_ids=out_ours, **tf).logits  # (B, L + 6, V)
        ref_logits = sdpa(input_ids=out_ours, **tf).logits
    n = ids.shape[1]
    new = out_ours[:, n:]  # (B, 6)
    predicting = slice(n - 1, out_ours.shape[1] - 1)  # logits at position p choose token p + 1
    tol = 2 * allowed_error(_err(ref_logits[:, predicting], gold_logits[:, predicting]), dtype)
    made = _generated_positions(new)  # after eos, generate() pads
    g, c = gold_logits[:, predicting][made], new[made]
    _greedy_choices_hold(g, c, tol, f"llama generate on multihead ({dtype})")
    top2 = g.topk(2, dim=-1).values
    if bool((top2[:, 0] - top2[:, 1] > 2 * tol).all()):  # every choice clear: both must agree exactly
        assert out_ours.tolist() == out_sdpa.tolist()


# ------------------------------------------------------------------------------------------------
# 5. Head tools
# ------------------------------------------------------------------------------------------------


class _Stack(nn.Module):
    def __init__(self, e=32, h=4, kv_heads=None):
        super().__init__()
        self.blocks = nn.ModuleList([mh.MultiHeadAttention(e, h, kv_heads=kv_heads) for _ in range(2)])

    def forward(self, x, **kw):
        for blk in self.blocks:
            x = x + blk(x, causal=True, **kw)
        return x


def _stack(**kw):
    torch.manual_seed(7)
    return _Stack(**kw).eval()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_capture_gives_the_reference_weights(dtype):
    """viz.capture on DEV: each block's weights equal attention_reference's weights on the block's own
    projections of its input (computed here from the float64 model), within the 2x rule."""
    base = _stack(kv_heads=2)
    x = _randn(2, 11, 32, dtype=torch.float64, seed=8)
    model, gold_model = _twin(base, dtype), _twin(base, torch.float64)
    with torch.no_grad(), viz.capture(model) as cap:
        model(x.to(dtype))
    assert cap.names() == ["blocks.0", "blocks.1"]
    h = x
    with torch.no_grad():
        for i, blk in enumerate(gold_model.blocks):
            q, k, v = blk.project(h, h, h)  # (B, H, L, D), (B, Hkv, L, D) x2, float64
            gold = mh.attention_reference(q, k, v, causal=True, return_weights=True).weights
            ref = mh.attention_reference(
                q.to(dtype), k.to(dtype), v.to(dtype), causal=True, return_weights=True
            )
            _within(cap.get(f"blocks.{i}"), ref.weights.cpu(), gold.cpu(), dtype, f"captured blocks.{i}")
            h = h + blk(h, causal=True)


def _zero_heads(model, spec, dv):
    """An independent gated model: the masked heads' columns of out_proj set to zero."""
    out = copy.deepcopy(model)
    with torch.no_grad():
        for name, idx in spec.items():
            w = out.get_submodule(name).out_proj.weight  # (E, H * Dv)
            for h in idx:
                w[:, h * dv : (h + 1) * dv] = 0.0
    return out


SPEC = {"blocks.0": [1, 3], "blocks.1": [0]}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_masked_and_pruned_models_equal_zeroed_heads(dtype):
    """heads.masked on DEV equals out_proj with those heads' columns zeroed; heads.prune's smaller model
    equals the masked one; both within the 2x rule against the zeroed model in float64."""
    base = _stack()
    x = _randn(2, 10, 32, dtype=torch.float64, seed=9)
    zeroed = _zero_heads(base, SPEC, dv=8)
    model, ref, gold = _twin(base, dtype), _twin(zeroed, dtype, backend="math"), _twin(zeroed, torch.float64)
    with torch.no_grad():
        with heads.masked(model, SPEC):
            got = model(x.to(dtype))
        unmasked = model(x.to(dtype))
        want, truth = ref(x.to(dtype)), gold(x)
        pruned = heads.prune(model, SPEC)
        got_pruned = pruned(x.to(dtype))
    assert _err(unmasked, truth) > 10 * _err(want, truth)  # masking changes the output: the test can fail
    assert heads.head_counts(pruned) == {"blocks.0": 2, "blocks.1": 3}
    assert next(pruned.parameters()).device.type == DEV.type
    _within(got, want, truth, dtype, "masked")
    _within(got_pruned, want, truth, dtype, "pruned")


def test_importance_on_device_equals_float64_on_cpu():
    """heads.importance in float32 on DEV: finite, and within the 2x rule of float32 on the CPU against
    float64 on the CPU."""
    base = _stack(kv_heads=2)
    xs = [_randn(2, 10, 32, dtype=torch.float64, seed=s, device="cpu") for s in (10, 11)]
    ys = [_randn(2, 10, 32, dtype=torch.float64, seed=s, device="cpu") for s in (12, 13)]

    def scores(dtype, device):
        model = _twin(base, dtype, device=device)
        batches = [(x.to(device, dtype), y.to(device, dtype)) for x, y in zip(xs, ys)]
        return heads.importance(model, batches, lambda m, b: F.mse_loss(m(b[0]), b[1]), normalize=False)

    got, ref, gold = scores(torch.float32, DEV), scores(torch.float32, "cpu"), scores(torch.float64, "cpu")
    assert set(got) == {"blocks.0", "blocks.1"}
    for name in got:
        assert got[name].shape == (4,) and bool(torch.isfinite(got[name]).all())
        assert float(gold[name].min()) > 0  # every head matters a little: a zero would hide a broken gate
        _within(got[name].cpu(), ref[name], gold[name], torch.float32, f"importance {name}")


# ------------------------------------------------------------------------------------------------
# 6. BlockMask input
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_block_mask_input_equals_the_dense_mask_and_flex_attention(dtype):
    """A causal window of 40 as torch's BlockMask (built on DEV) passed as mask=: within the 2x rule of
    attention_reference with the same dense mask; torch's flex_attention on the same BlockMask (compiled
    on CUDA in bf16, eager otherwise) within the same bound, so the two agree within twice it."""
    from torch.nn.attention import flex_attention as flex

    _fresh_compiler()
    b, h, n, d = 2, 4, 256, 32

    def window(bi, hi, qi, ki):
        return (ki <= qi) & (qi - ki < 40)

    bm = flex.create_block_mask(window, None, None, n, n, device=DEV)
    i = torch.arange(n, device=DEV)
    dense = (i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] < 40)  # (Lq, Lk)
    q, k, v = (_randn(b, h, n, d, dtype=dtype, seed=s) for s in (20, 21, 22))
    report = compare_to_reference(
        lambda q_, k_, v_, mask: mh.attention(q_, k_, v_, mask=bm), q, k, v, mask=dense
    )
    assert report.ok, report
    compiled = DEV.type == "cuda" and dtype == torch.bfloat16  # one Triton compile keeps the file fast
    flex_fn = torch.compile(flex.flex_attention) if compiled else flex.flex_attention
    theirs = flex_fn(q, k, v, block_mask=bm)
    gold = mh.attention_reference(q.double(), k.double(), v.double(), mask=dense)
    fe, allowed = _err(theirs, gold), report.allowed(report.reference)
    assert fe <= allowed, f"torch's flex_attention: |flex - gold| = {fe:.3g} > {allowed:.3g} ({report})"
    gap = _err(mh.attention(q, k, v, mask=bm), theirs)
    assert gap <= 2 * allowed, f"|multihead - flex_attention| = {gap:.3g} > {2 * allowed:.3g}"


# ------------------------------------------------------------------------------------------------
# 7. Context parallelism at one rank
# ------------------------------------------------------------------------------------------------


@pytest.fixture
def one_rank_group(tmp_path):
    """A process group of this process alone: nccl on CUDA (a failure to start it fails the test), gloo on
    the CPU."""
    backend = "nccl" if DEV.type == "cuda" else "gloo"
    if DEV.type == "cuda":
        torch.cuda.set_device(DEV.index or 0)
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group(backend, store=store, rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def _cp_run(model, x, gy, keep, ids, strategy=None):
    """Output (B, L, E) and the gradients of x and of every parameter, optionally inside context_parallel."""
    model.zero_grad()
    xr = x.clone().requires_grad_()
    if strategy is None:
        y = model(xr, mask=mh.masks.key_padding(keep), segment_ids=ids)
        (y * gy).sum().backward()
    else:
        with mhd.context_parallel(model, strategy=strategy) as cp:
            installed = {type(b.attention_fn).__name__ for b in model.blocks}
            assert installed == {f"{strategy.capitalize()}Attention"}, installed  # the strategy does run
            part = cp.shard({"x": xr, "gy": gy, "keep": keep, "ids": ids})
            y = model(part["x"], mask=mh.masks.key_padding(part["keep"]), segment_ids=part["ids"])
            (y * part["gy"]).sum().backward()
    return {"out": y.detach(), "dx": xr.grad, **{n: p.grad for n, p in model.named_parameters()}}


@pytest.mark.parametrize("strategy", ["ring", "ulysses", "hybrid"])
def test_context_parallel_at_one_rank_equals_one_process(one_rank_group, strategy):
    """context_parallel on a 1-rank group (nccl on CUDA) with padding and packed sequences: output and
    every gradient within the 2x rule of the plain float32 run against float64."""
    base = _stack(e=24, h=6, kv_heads=2)
    x64, gy64 = (
        _randn(2, 16, 24, dtype=torch.float64, seed=30),
        _randn(2, 16, 24, dtype=torch.float64, seed=31),
    )
    keep = torch.ones(2, 16, dtype=torch.bool, device=DEV)
    keep[1, 12:] = False
    ids = torch.tensor([[0] * 5 + [1] * 11, [0] * 16], device=DEV)
    model = _twin(base, torch.float32)
    got = _cp_run(model, x64.float(), gy64.float(), keep, ids, strategy)
    ref = _cp_run(_twin(base, torch.float32, backend="math"), x64.float(), gy64.float(), keep, ids)
    gold = _cp_run(_twin(base, torch.float64), x64, gy64, keep, ids)
    assert all(b.attention_fn is mh.attention for b in model.blocks)  # restored on leaving the block
    for name in gold:  # one part at one rank: merge_floor's 2 ulps of the flash backward formula
        extra = merge_floor(torch.float32, float(gold[name].abs().max()), 1)
        _within(got[name], ref[name], gold[name], torch.float32, f"{strategy}: {name}", extra)


@pytest.mark.parametrize("fn", ["ring_attention", "ulysses_attention"])
def test_sequence_parallel_attention_at_one_rank_matches_the_reference(one_rank_group, fn):
    """mhd.ring_attention / ulysses_attention on one rank, bf16 with causal and valid_lens: within the
    2x rule against attention_reference."""
    q = _randn(2, 4, 40, 32, dtype=torch.bfloat16, seed=40)
    k, v = (_randn(2, 2, 40, 32, dtype=torch.bfloat16, seed=s) for s in (41, 42))
    report = compare_to_reference(
        getattr(mhd, fn), q, k, v, causal=True, valid_lens=torch.tensor([40, 23], device=DEV)
    )
    assert report.ok, report


# ------------------------------------------------------------------------------------------------
# 8. No host synchronisation on the hot path (CUDA only)
# ------------------------------------------------------------------------------------------------


def _without_sync(fn, what):
    """Run ``fn`` once to warm up, then again under ``set_sync_debug_mode("error")``; a synchronising call
    fails the test, naming the multihead source lines on its stack."""
    fn()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn()
    except RuntimeError as exc:
        stack = traceback.extract_tb(exc.__traceback__)
        frames = [
            f"{os.path.relpath(f.filename, os.path.dirname(_SRC))}:{f.lineno} ({f.name}: {f.line})"
            for f in stack
            if f.filename.startswith(_SRC)
        ]
        last = f"{stack[-1].filename}:{stack[-1].lineno} ({stack[-1].name})" if stack else "?"
        pytest.fail(
            f'{what} raised under set_sync_debug_mode("error") (a host synchronisation): {exc}\n'
            "multihead frames, outermost first:\n" + "\n".join(frames) + f"\ninnermost frame: {last}"
        )
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()


@cuda_only
@pytest.mark.parametrize("kind", ["causal", "valid_lens", "mask", "segment_ids"])
def test_training_step_does_not_synchronise(kind):
    """MultiHeadAttention forward + backward in bf16, every input already on the GPU."""
    model = _twin(_mha(), torch.bfloat16).train()
    x = _randn(2, 64, 32, dtype=torch.bfloat16, seed=50).requires_grad_()
    gy = _randn(2, 64, 32, dtype=torch.bfloat16, seed=51)
    kw = {
        "causal": {"causal": True},
        "valid_lens": {"valid_lens": torch.tensor([64, 37], device=DEV), "causal": True},
        "mask": {"mask": _randn(2, 1, 64, 64, seed=52) > -0.5},
        "segment_ids": {"segment_ids": torch.tensor([[0] * 20 + [1] * 44, [0] * 60 + [-1] * 4], device=DEV)},
    }[kind]

    def step():
        model.zero_grad(set_to_none=True)
        x.grad = None
        (model(x, **kw) * gy).sum().backward()

    _without_sync(step, f"training step ({kind})")
    assert x.grad is not None and bool(torch.isfinite(x.grad).all())


@cuda_only
@pytest.mark.parametrize("fixed_shape", [False, True], ids=["growing", "fixed_shape"])
def test_decode_step_does_not_synchronise(fixed_shape):
    """One cached decode step of MultiHeadAttention (rotary, grouped heads) on a KVCache(max_len=...), and
    on KVCache(max_len, fixed_shape=True), whose positions, write and mask of the unwritten positions all
    stay on the device."""
    model = _twin(_mha(rotary=True), torch.bfloat16)
    x = _randn(2, 16, 32, dtype=torch.bfloat16, seed=53)
    cache = mh.KVCache(max_len=16, fixed_shape=fixed_shape)
    pos = iter(range(8, 16))
    with torch.no_grad():
        model(x[:, :8], cache=cache, causal=True)  # prefill

        def step():
            t = next(pos)
            model(x[:, t : t + 1], cache=cache, causal=True)

        _without_sync(step, f"decode step (fixed_shape={fixed_shape})")
    assert len(cache) == 10


# ------------------------------------------------------------------------------------------------
# 9. A decode step in a CUDA graph (CUDA only)
# ------------------------------------------------------------------------------------------------

B9, H9, HKV9, N9, D9 = 2, 8, 2, 128, 64


def _decode_buffers():
    q = torch.zeros(B9, H9, 1, D9, device=DEV, dtype=torch.bfloat16)
    k, v = (torch.zeros(B9, HKV9, N9, D9, device=DEV, dtype=torch.bfloat16) for _ in range(2))
    return q, k, v, torch.ones(B9, dtype=torch.long, device=DEV)


def _refill(q, k, v, lens, seed, new_lens):
    q.copy_(_randn(*q.shape, dtype=q.dtype, seed=seed))
    k.copy_(_randn(*k.shape, dtype=k.dtype, seed=seed + 1))
    v.copy_(_randn(*v.shape, dtype=v.dtype, seed=seed + 2))
    lens.copy_(torch.tensor(new_lens))


LENS9 = [[5, 9], [6, 10], [128, 64], [1, 77]]


@cuda_only
def test_fixed_buffer_decode_step_replays_in_a_cuda_graph():
    """mh.attention of one query step over fixed (B, Hkv, N, D) key/value buffers, the valid lengths a
    device tensor updated in place, captured once in a torch.cuda.CUDAGraph and replayed.

    The functional form of what KVCache(max_len=N, fixed_shape=True) does inside MultiHeadAttention (see
    test_module_decode_step_in_one_cuda_graph). Each replay equals eager and is within the 2x rule
    against attention_reference."""
    q, k, v, lens = _decode_buffers()
    _refill(q, k, v, lens, 60, LENS9[0])

    def step():
        return mh.attention(q, k, v, valid_lens=lens)

    _without_sync(step, "fixed-buffer decode step")  # a sync would break the capture (and the CUDA context)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for i, new in enumerate(LENS9):
        _refill(q, k, v, lens, 70 + 10 * i, new)
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out, step())
        report = compare_to_reference(lambda *a, **kw: out.clone(), q, k, v, valid_lens=lens)
        assert report.ok, (new, report)


@cuda_only
def test_reduce_overhead_decode_step_uses_cuda_graphs():
    """The same step compiled with mode="reduce-overhead": inductor records it in a CUDA graph (no
    cudagraph skip counted) and every call equals eager within the 2x rule against the reference."""
    q, k, v, lens = _decode_buffers()
    _without_sync(lambda: mh.attention(q, k, v, valid_lens=lens), "fixed-buffer decode step")
    _fresh_compiler()
    compiled = torch.compile(
        lambda q_, k_, v_, l_: mh.attention(q_, k_, v_, valid_lens=l_), mode="reduce-overhead"
    )
    for i, new in enumerate(LENS9):
        _refill(q, k, v, lens, 80 + 10 * i, new)
        got = compiled(q, k, v, lens).clone()
        report = compare_to_reference(lambda *a, got=got, **kw: got, q, k, v, valid_lens=lens)
        assert report.ok, (new, report)
    assert counters["inductor"]["cudagraph_skips"] == 0, dict(counters["inductor"])


@cuda_only
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_module_decode_step_in_one_cuda_graph(dtype):
    """MultiHeadAttention (rotary, grouped heads) on KVCache(max_len, fixed_shape=True), the step compiled
    with mode="reduce-overhead": recorded as a CUDA graph (no skip counted) and replayed for every token,
    each step within the 2x rule of the growing cache's eager steps (math backend) against float64."""
    _fresh_compiler()
    model = _mha(rotary=True)
    x = _randn(2, 12, 32, dtype=torch.float64, seed=55)
    fast, ref_model = _twin(model, dtype), _twin(model, dtype, backend="math")
    gold_model = _twin(model, torch.float64)
    cache, ref_cache, gold_cache = mh.KVCache(max_len=12, fixed_shape=True), mh.KVCache(), mh.KVCache()
    step = torch.compile(lambda x_t: fast(x_t, cache=cache, causal=True), mode="reduce-overhead")
    with torch.no_grad():
        fast(x[:, :4].to(dtype), cache=cache, causal=True)  # prefill, eagerly
        ref_model(x[:, :4].to(dtype), cache=ref_cache, causal=True)
        gold_model(x[:, :4], cache=gold_cache, causal=True)
        for t in range(4, 12):
            got = step(x[:, t : t + 1].to(dtype)).clone()
            ref = ref_model(x[:, t : t + 1].to(dtype), cache=ref_cache, causal=True)
            gold = gold_model(x[:, t : t + 1], cache=gold_cache, causal=True)
            _within(got, ref, gold, dtype, f"graphed decode step {t}")
    assert len(cache) == 12
    assert counters["inductor"]["cudagraph_skips"] == 0, dict(counters["inductor"])


@cuda_only
def test_block_mask_calls_after_the_first_do_not_synchronise():
    """A BlockMask passed to every layer: the first call converts it (host copies), later calls reuse the
    conversion and hand the BlockMask to flex_attention as it is."""
    from torch.nn.attention import flex_attention as flex

    n = 256
    bm = flex.create_block_mask(
        lambda b, h, qi, ki: (ki <= qi) & (qi - ki < 64), None, None, n, n, device=DEV
    )
    q, k, v = (_randn(2, 4, n, 32, dtype=torch.bfloat16, seed=s) for s in (56, 57, 58))
    with torch.no_grad():
        _without_sync(lambda: mh.attention(q, k, v, mask=bm), "BlockMask call")


# ------------------------------------------------------------------------------------------------
# 8. The lens on the device
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_lens_points_patching_and_attribution_on_device(dtype):
    """multihead.lens on a Llama (GQA) on DEV: every point cached on DEV within the 2x rule of the same points
    cached in float64 (the reference's own error: the same model on the math backend); a batched patching sweep
    equals one forward per head; each head's result sums to its output projection's; heads + rest == logit."""
    import warnings

    from multihead import lens

    ours = _llama_pair(dtype)[0]
    on_cpu = copy.deepcopy(ours).cpu()  # the same model in dtype on the CPU: the reference's own error
    gold = copy.deepcopy(ours).double()  # the same weights in float64
    ids, keep = _left_padded()
    kw = {"input_ids": ids, "attention_mask": keep, "position_ids": _positions(keep)}
    points = ("q", "k", "v", "scores", "pattern", "z", "result")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the explicit path is said once
        got, ref, want = {}, {}, {}
        for model, out in ((ours, got), (on_cpu, ref), (gold, want)):
            device = next(model.parameters()).device
            with torch.no_grad(), lens.cache(model, points=points) as c:
                model(**{name: t.to(device) for name, t in kw.items()})
            out.update({key: c[key].to(DEV) for key in c.keys()})
    real = keep.bool()[:, None, :, None]  # (B, 1, L, 1): real query rows
    for key, w in want.items():
        finite = torch.isfinite(w) & real if key[1] in ("q", "scores", "pattern", "z", "result") else None
        g, r = got[key], ref[key]
        if finite is not None:
            finite = finite.expand_as(w)
            g, r, w = g[finite], r[finite], w[finite]
        _within(
            g,
            r,
            w,
            dtype,
            f"lens {key}",
            extra=merge_floor(dtype, float(w.abs().max()) if w.numel() else 0, 4),
        )

    clean = {"input_ids": ids, "attention_mask": keep}
    corrupted = {"input_ids": ids.flip(1), "attention_mask": keep}

    def metric(out):  # (B,): the last position's logit of token 5
        return out.logits[:, -1, 5].float()

    with torch.no_grad():
        batched = lens.patch_heads(ours, clean, corrupted, metric, progress=False)
        one_by_one = lens.patch_heads(
            ours, clean, corrupted, lambda out: float(metric(out).mean()), progress=False
        )
    tol = 4 * allowed_error(0.0, dtype) * float(one_by_one.abs().max() + 1)
    torch.testing.assert_close(
        batched, one_by_one, atol=tol + (0.05 if dtype == torch.bfloat16 else 1e-4), rtol=0
    )

    target = ids[:, -1]
    with torch.no_grad():
        attribution = lens.logit_attribution(ours, clean, target)
    total = attribution.heads.sum((0, 1)) + attribution.rest
    torch.testing.assert_close(total.float(), attribution.logit.float(), atol=1e-2, rtol=1e-3)
    assert attribution.heads.device.type == DEV.type
