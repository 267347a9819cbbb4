"""The fuzzed contract of :mod:`multihead.lens` (issues 45 and 46): on every module configuration and call the
module fuzz draws (GQA, rotary, cross-attention, masks of every kind, empty batches and lengths, every
backend), a lens is a pure observer, its points agree with each other as the definitions say (checked by hand
in float64, never against the lens itself), an edit changes the output exactly as recomputing by hand would,
nothing comes back NaN, and a bad request is refused naming its argument.

Dimensions: B batch, H heads, Hkv kv heads, Lq/Lk lengths, Dv value head dim, E embedding.
"""

from __future__ import annotations

import functools

import pytest
import torch
from fuzz_cases import close, fuzz, names_the_argument, no_hang
from hypothesis import given
from hypothesis import strategies as st
from test_fuzz_modules import _module, module_calls

import multihead as mh
from multihead import heads, lens
from multihead.nn.attention import merge_heads

pytestmark = pytest.mark.numerics


def _out(got):
    return got[0] if isinstance(got, tuple) else got


def _dead(scores: torch.Tensor) -> torch.Tensor:
    """Rows (B, H, Lq, 1) where every key is masked."""
    return torch.isneginf(scores).all(-1, keepdim=True)


def _by_hand_pattern(scores: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """softmax over each row's keys and, with ``sinks`` (H,), the head's sink logit in the denominator;
    rows with no key 0 -> (B, H, Lq, Lk)."""
    if sinks is None:
        p = scores.softmax(-1)
    else:
        b, h, lq, _ = scores.shape
        sink = sinks.detach().to(scores.dtype).view(1, h, 1, 1).expand(b, h, lq, 1)  # (B, H, Lq, 1)
        p = torch.cat([scores, sink], dim=-1).softmax(-1)[..., :-1]
    return torch.where(_dead(scores), 0.0, p.nan_to_num(0.0))


def _by_hand_z(pattern: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """z = pattern @ v with each kv head shared by its group of query heads."""
    group = pattern.shape[1] // v.shape[1]
    return pattern @ v.repeat_interleave(group, dim=1)  # (B, H, Lq, Dv)


@fuzz(40)
@given(module_calls())
def test_a_cache_observes_and_its_points_agree_by_hand(call):
    config, seed, inputs, kw, backend = call
    m = _module(config, seed, backend=backend)
    with no_hang():
        try:
            plain = _out(m(*inputs, **kw))
        except ValueError as e:
            assert backend != "auto" and f"backend {backend!r} cannot serve" in str(e)
            return
        with lens.cache(m, points=lens.POINTS) as c:
            seen = _out(m(*inputs, **kw))
    close(seen, plain, "the output under a cache")
    q, k, v, scores, pattern, z, result = (c["", p] for p in lens.POINTS)
    b, lq = inputs[0].shape[:2]
    h, hkv = config["num_heads"], config["kv_heads"] or config["num_heads"]
    assert q.shape[:3] == (b, h, lq) and k.shape[:2] == v.shape[:2] == (b, hkv)
    assert scores.shape == pattern.shape == (b, h, lq, k.shape[2])
    for name, t in zip(lens.POINTS, (q, k, v, pattern, z, result), strict=False):
        assert not t.isnan().any(), f"{name} holds NaN"
    assert not scores.isnan().any() and not (scores == float("inf")).any()
    want = _by_hand_pattern(scores, getattr(m, "sinks", None))
    close(pattern, want, "pattern = softmax(scores, with the sink in the denominator), dead rows zero")
    close(z, _by_hand_z(pattern, v), "z = pattern @ v")
    bias = m.out_proj.bias if m.out_proj.bias is not None else 0.0
    close(result.sum(1) + bias, seen, "the heads' results plus the bias = the output")


@fuzz(40)
@given(module_calls(), st.data())
def test_an_edit_changes_the_output_as_recomputing_by_hand(call, data):
    config, seed, inputs, kw, _ = call
    m = _module(config, seed)
    kw.pop("return_weights", None)
    with lens.cache(m, points=("v", "scores", "pattern", "z")) as c:
        base = _out(m(*inputs, **kw))
    z, h, hkv = c["", "z"], config["num_heads"], config["kv_heads"] or config["num_heads"]
    point = data.draw(st.sampled_from(["z", "pattern", "v", "scores"]))
    head = data.draw(st.integers(0, (hkv if point == "v" else h) - 1))
    factor = data.draw(st.sampled_from([0.0, -1.5, 3.0]))

    def edit(t, ctx):
        t = t.clone()
        if point == "scores":
            t[:, head] += factor  # softmax ignores a shift, unless a sink shares the denominator
        else:
            t[:, head] *= factor
        return t

    with no_hang(), lens.hooks(m, {("", point): edit}):
        got = _out(m(*inputs, **kw))
    want_z = z.clone()
    if point in ("z", "pattern"):
        want_z[:, head] *= factor  # z is linear in its head's pattern row
    elif point == "v":
        group = h // hkv
        want_z[:, head * group : (head + 1) * group] *= factor  # the query heads sharing that kv head
    sinks = getattr(m, "sinks", None)
    if point == "scores" and sinks is not None:  # the shifted head's pattern against its sink, by hand
        scores = c["", "scores"].clone()
        scores[:, head] += factor
        want_z[:, head] = _by_hand_z(_by_hand_pattern(scores, sinks), c["", "v"])[:, head]
    want = m.out_proj(merge_heads(want_z)) if point != "scores" or sinks is not None else base
    close(got, want, f"output after {point} of head {head} edited by {factor}")


@fuzz(25)
@given(module_calls(), st.data())
def test_a_zero_ablation_is_the_gated_model(call, data):
    config, seed, inputs, kw, _ = call
    m = _module(config, seed)
    chosen = data.draw(st.lists(st.integers(0, config["num_heads"] - 1), min_size=1, unique=True))
    with lens.ablate(m, {"": chosen}):
        got = _out(m(*inputs, **kw))
    with heads.masked(m, {"": chosen}):
        close(got, _out(m(*inputs, **kw)), f"zeroed heads {chosen}")


def _model() -> mh.TransformerEncoder:
    torch.manual_seed(0)
    return mh.TransformerEncoder(8, 2, 16, num_layers=2, dropout=0.0, dtype=torch.float64).eval()


X = torch.randn(2, 3, 8, dtype=torch.float64)
NAME = "layers.0.self_attn"


def _enter(m, block) -> None:
    with block:
        m(X)


def _metric(out):
    return out[:, 0, 0]  # (B,)


LENS_SPOILS = [
    ("points", lambda m: _enter(m, lens.cache(m, points="logits"))),
    ("points", lambda m: _enter(m, lens.cache(m, points=()))),
    ("points", lambda m: _enter(m, lens.cache(m, points=3))),
    ("modules", lambda m: _enter(m, lens.cache(m, points="z", modules=["nope"]))),
    ("modules", lambda m: _enter(m, lens.cache(m, points="z", modules=5))),
    ("handlers", lambda m: _enter(m, lens.hooks(m, {(NAME, "logits"): lambda t, ctx: None}))),
    ("handlers", lambda m: _enter(m, lens.hooks(m, {"z": lambda t, ctx: None}))),
    ("handlers", lambda m: _enter(m, lens.hooks(m, {(NAME, "z"): 3}))),
    ("handlers", lambda m: _enter(m, lens.hooks(m, [(NAME, "z")]))),
    ("handlers", lambda m: _enter(m, lens.hooks(m, {("nope", "z"): lambda t, ctx: None}))),
    ("handlers", lambda m: _enter(m, lens.hooks(m, {(NAME, "z"): lambda t, ctx: t.tolist()}))),
    ("handlers", lambda m: _enter(m, lens.hooks(m, {(NAME, "pattern"): lambda t, ctx: t[:, :1]}))),
    ("handlers", lambda m: _enter(m, lens.hooks(m, {(NAME, "q"): lambda t, ctx: t.float()}))),
    ("handlers", lambda m: _enter(m, lens.hooks(m, {(NAME, "result"): lambda t, ctx: t[..., :2]}))),
    ("how", lambda m: _enter(m, lens.ablate(m, {NAME: [0]}, how="noise"))),
    ("reference", lambda m: _enter(m, lens.ablate(m, {NAME: [0]}, how="mean"))),
    ("heads", lambda m: _enter(m, lens.ablate(m, {NAME: [2]}))),
    ("heads", lambda m: _enter(m, lens.ablate(m, {NAME: [-1]}))),
    ("heads", lambda m: _enter(m, lens.ablate(m, {NAME: ["a"]}))),
    ("metric", lambda m: lens.patch_heads(m, X, X, lambda out: out[0])),
    ("metric", lambda m: lens.patch_heads(m, X, X, lambda out: "bad")),
    ("corrupted", lambda m: lens.patch_heads(m, X, X[:, :2], _metric)),
    ("corrupted", lambda m: lens.patch_heads(m, X, X[:0], _metric)),
    ("point", lambda m: lens.patch_heads(m, X, X, _metric, point="logits")),
    ("chunk", lambda m: lens.patch_heads(m, X, X, _metric, chunk=0)),
    ("chunk", lambda m: lens.patch_heads(m, X, X, _metric, chunk=1.5)),
    ("modules", lambda m: lens.patch_heads(m, X, X, _metric, modules=["nope"])),
    ("model", lambda m: lens.logit_attribution(m, X, torch.tensor([0]))),
    ("target", lambda m: lens.logit_attribution(_llm(), IDS, torch.tensor([0, 1, 2]))),
    ("target", lambda m: lens.logit_attribution(_llm(), IDS, torch.ones(5))),
    ("target", lambda m: lens.logit_attribution(_llm(), IDS, "the")),
    ("position", lambda m: lens.logit_attribution(_llm(), IDS, torch.tensor([0, 1]), position=4)),
    ("position", lambda m: lens.logit_attribution(_llm(), IDS, torch.tensor([0, 1]), position=1.0)),
]


IDS = torch.tensor([[1, 5, 7, 2], [3, 3, 9, 0]])


@functools.cache
def _llm() -> torch.nn.Module:
    """A tiny Llama from a config (random weights) on multihead's attention."""
    transformers = pytest.importorskip("transformers")
    from multihead.integrations import transformers as mhtf

    mhtf.register()
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=11,
        hidden_size=8,
        intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        attn_implementation="multihead",
    )
    return transformers.LlamaForCausalLM(config).eval()


@fuzz(30)
@given(st.sampled_from(LENS_SPOILS))
def test_a_spoiled_lens_argument_is_named(spoil):
    name, call = spoil
    with no_hang(), pytest.raises((ValueError, TypeError)) as err:
        call(_model())
    assert names_the_argument(err.value, name), f"{name}: {err.value}"
