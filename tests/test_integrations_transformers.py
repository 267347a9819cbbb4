"""Hugging Face transformers models on multihead: equal to eager attention, and the head tools on them.

Every model is built from a tiny config with random weights (no hub access). Each architecture is
compared with transformers' own eager attention on the same weights.
"""

import copy
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch

T = pytest.importorskip("transformers")

from multihead import heads, viz  # noqa: E402
from multihead.integrations import transformers as mhtf  # noqa: E402

NAME = mhtf.register()
V = 50  # vocabulary


@dataclass(frozen=True)
class Case:
    """One architecture: a tiny model, its inputs, and the output projection of an attention module."""

    config: Callable[[], object]
    auto: object  # Auto class
    decoder: bool  # generate() applies (decoder-only or encoder-decoder)
    text: bool = True
    out_proj: Callable[[str], str] = lambda name: f"{name}.o_proj"


def _common(**kw):
    return dict(vocab_size=V, **kw)


CASES = {
    "bert": Case(
        lambda: T.BertConfig(
            **_common(
                hidden_size=32,
                num_hidden_layers=2,
                num_attention_heads=4,
                intermediate_size=37,
                max_position_embeddings=32,
            )
        ),
        T.AutoModelForMaskedLM,
        False,
        out_proj=lambda n: n.rpartition(".")[0] + ".output.dense",
    ),
    "roberta": Case(
        lambda: T.RobertaConfig(
            **_common(
                hidden_size=32,
                num_hidden_layers=2,
                num_attention_heads=4,
                intermediate_size=37,
                max_position_embeddings=40,
                pad_token_id=1,
            )
        ),
        T.AutoModelForMaskedLM,
        False,
        out_proj=lambda n: n.rpartition(".")[0] + ".output.dense",
    ),
    "gpt2": Case(
        lambda: T.GPT2Config(
            **_common(n_embd=32, n_layer=2, n_head=4, n_positions=32, bos_token_id=1, eos_token_id=2)
        ),
        T.AutoModelForCausalLM,
        True,
        out_proj=lambda n: f"{n}.c_proj",
    ),
    "llama": Case(  # grouped-query heads: 4 query heads over 2 key/value heads
        lambda: T.LlamaConfig(
            **_common(
                hidden_size=32,
                intermediate_size=37,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                max_position_embeddings=32,
            )
        ),
        T.AutoModelForCausalLM,
        True,
    ),
    "mistral": Case(  # sliding window of 3 over sequences of 7: the window matters
        lambda: T.MistralConfig(
            **_common(
                hidden_size=32,
                intermediate_size=37,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                sliding_window=3,
                max_position_embeddings=32,
            )
        ),
        T.AutoModelForCausalLM,
        True,
    ),
    "qwen2": Case(  # multi-query heads, a sliding window on the second layer only
        lambda: T.Qwen2Config(
            **_common(
                hidden_size=32,
                intermediate_size=37,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=1,
                use_sliding_window=True,
                sliding_window=3,
                max_window_layers=1,
                max_position_embeddings=32,
            )
        ),
        T.AutoModelForCausalLM,
        True,
    ),
    "vit": Case(
        lambda: T.ViTConfig(
            image_size=8,
            patch_size=2,
            num_channels=3,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=37,
        ),
        T.AutoModel,
        False,
        text=False,
    ),
    "bart": Case(  # encoder-decoder: encoder self, decoder self and cross-attention
        lambda: T.BartConfig(
            **_common(
                d_model=32,
                encoder_layers=2,
                decoder_layers=2,
                encoder_attention_heads=4,
                decoder_attention_heads=4,
                encoder_ffn_dim=37,
                decoder_ffn_dim=37,
                max_position_embeddings=32,
            )
        ),
        T.AutoModelForSeq2SeqLM,
        True,
        out_proj=lambda n: f"{n}.out_proj",
    ),
}
DECODERS = [k for k, c in CASES.items() if c.decoder]


@pytest.fixture(scope="module", params=list(CASES))
def arch(request):
    """(name, case, eager model, multihead model) with the same weights, in eval mode."""
    case = CASES[request.param]
    torch.manual_seed(0)
    eager = case.auto.from_config(case.config(), attn_implementation="eager").eval()
    ours = copy.deepcopy(eager)
    ours.set_attn_implementation(NAME)
    return request.param, case, eager, ours


def inputs(name, case, *, side="right"):
    """Model inputs: a batch of 2, the first row padded by 2 on ``side``; and the real-token mask (B, L)."""
    g = torch.Generator().manual_seed(1)
    if not case.text:
        return {"pixel_values": torch.randn(2, 3, 8, 8, generator=g)}, torch.ones(2, 17, dtype=torch.bool)
    ids = torch.randint(3, V, (2, 7), generator=g)
    keep = torch.ones(2, 7, dtype=torch.long)
    if side == "left":
        keep[0, :2] = 0
    else:
        keep[0, -2:] = 0
    batch = {"input_ids": ids, "attention_mask": keep}
    if name == "bart":
        batch["decoder_input_ids"] = torch.randint(3, V, (2, 5), generator=g)
        return batch, None  # decoder rows are all real (only the encoder side is padded)
    return batch, keep.bool()


def main_output(out):
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


@pytest.mark.parametrize("side", ["right", "left"])
def test_outputs_and_weights_equal_eager(arch, side):
    name, case, eager, ours = arch
    batch, real = inputs(name, case, side=side)
    with torch.no_grad():
        want = eager(**batch, output_attentions=True)
        got = ours(**batch, output_attentions=True)
    a, b = main_output(want), main_output(got)
    if real is not None:
        a, b = a[real], b[real]  # non-padding positions
    torch.testing.assert_close(b, a, rtol=0, atol=1e-5)
    for key in ("attentions", "encoder_attentions", "decoder_attentions", "cross_attentions"):
        ws, wg = getattr(want, key, None), getattr(got, key, None)
        if not ws:
            continue
        assert wg is not None and len(wg) == len(ws) > 0, key
        for w_eager, w_ours in zip(ws, wg):
            assert w_ours.shape == w_eager.shape
            rows = real if real is not None and key == "attentions" else None  # query rows of real tokens
            if rows is not None:
                w_eager, w_ours = w_eager.transpose(1, 2)[rows], w_ours.transpose(1, 2)[rows]  # (N, H, Lk)
            torch.testing.assert_close(w_ours, w_eager, rtol=0, atol=1e-5)


def test_without_output_attentions_no_weights_and_same_output(arch):
    name, case, eager, ours = arch
    batch, real = inputs(name, case)
    with torch.no_grad():
        out = ours(**batch)
        ref = ours(**batch, output_attentions=True)
    assert getattr(out, "attentions", None) is None
    torch.testing.assert_close(main_output(out), main_output(ref), rtol=0, atol=1e-5)


@pytest.mark.parametrize("name", DECODERS)
def test_greedy_generate_identical_tokens(name):
    case = CASES[name]
    torch.manual_seed(0)
    eager = case.auto.from_config(case.config(), attn_implementation="eager").eval()
    ours = copy.deepcopy(eager)
    ours.set_attn_implementation(NAME)
    batch, _ = inputs(name, case, side="left")
    batch.pop("decoder_input_ids", None)
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert ours.generate(**batch, **kw).tolist() == eager.generate(**batch, **kw).tolist()


def test_float_mask_and_fully_masked_rows_are_zero():
    """A custom 4D float mask is added as given; a query row with no allowed key outputs 0 (eager: uniform)."""
    torch.manual_seed(0)
    cfg = CASES["llama"].config()
    eager = T.AutoModel.from_config(cfg, attn_implementation="eager").eval()
    ours = copy.deepcopy(eager)
    ours.set_attn_implementation(NAME)
    ids = torch.randint(3, V, (1, 5))
    allowed = torch.ones(5, 5).tril().bool()
    allowed[0] = False  # query 0 may see nothing
    mask = torch.zeros(1, 1, 5, 5).masked_fill(~allowed, torch.finfo(torch.float32).min)
    with torch.no_grad():
        want = eager(ids, attention_mask=mask, output_attentions=True)
        got = ours(ids, attention_mask=mask, output_attentions=True)
    torch.testing.assert_close(got.attentions[0][:, :, 1:], want.attentions[0][:, :, 1:], rtol=0, atol=1e-5)
    assert torch.equal(got.attentions[0][:, :, 0], torch.zeros_like(got.attentions[0][:, :, 0]))
    torch.testing.assert_close(want.attentions[0][0, 0, 0], torch.full((5,), 0.2))  # eager: uniform


def test_capture_equals_output_attentions(arch):
    name, case, eager, ours = arch
    batch, _ = inputs(name, case)
    with torch.no_grad():
        want = eager(**batch, output_attentions=True)
        with viz.capture(ours) as cap:
            ours(**batch)
    if name == "bart":
        expected = list(want.encoder_attentions) + list(want.decoder_attentions) + list(want.cross_attentions)
        kinds = {"encoder self": 2, "decoder self": 2, "cross": 2}
        order = cap.names("encoder self") + cap.names("decoder self") + cap.names("cross")
    else:
        expected, kinds, order = list(want.attentions), None, cap.names()
    assert len(order) == len(expected) == len(heads.head_counts(ours))
    for n, w in zip(order, expected):
        torch.testing.assert_close(cap.get(n), w, rtol=0, atol=1e-5)
    if kinds:
        assert {k: len(cap.names(k)) for k in kinds} == kinds


def _remove_head(model, out_proj, head, d):
    """Zero one head's slice at the input of the output projection (independent of multihead)."""

    def hook(_, args):
        (x,) = args
        x = x.clone()
        x[..., head * d : (head + 1) * d] = 0
        return (x,)

    return model.get_submodule(out_proj).register_forward_pre_hook(hook)


def test_masked_equals_head_removal_and_prune_equals_masked(arch, tmp_path):
    name, case, eager, ours = arch
    batch, real = inputs(name, case)
    target = list(heads.head_counts(ours))[-1]  # the last attention module (cross-attention for BART)
    handle = _remove_head(eager, case.out_proj(target), 1, 32 // 4)  # D = width 32 / 4 heads
    try:
        with torch.no_grad():
            want = main_output(eager(**batch))
    finally:
        handle.remove()
    with torch.no_grad(), heads.masked(ours, {target: [1]}):
        gated = main_output(ours(**batch))
    torch.testing.assert_close(gated, want, rtol=0, atol=1e-5)

    spec = (
        {target: [1]}
        if name in ("gpt2", "bart", "vit")
        else {target: [1], list(heads.head_counts(ours))[0]: [0, 3]}
    )
    with torch.no_grad(), heads.masked(ours, spec):
        gated = main_output(ours(**batch))
    pruned = heads.prune(ours, spec)
    assert sum(p.numel() for p in pruned.parameters()) < sum(p.numel() for p in ours.parameters())
    counts = heads.head_counts(pruned)
    assert all(counts[n] == 4 - len(h) for n, h in spec.items())
    with torch.no_grad():
        small = main_output(pruned(**batch))
    sel = (lambda t: t[real]) if real is not None else (lambda t: t)
    torch.testing.assert_close(sel(small), sel(gated), rtol=0, atol=1e-5)

    pruned.save_pretrained(tmp_path)  # and back: from the folder, as from a downloaded checkpoint
    again = mhtf.from_pretrained(case.auto, tmp_path, attn_implementation=NAME)
    assert heads.head_counts(again) == counts
    with torch.no_grad():
        torch.testing.assert_close(main_output(again(**batch)), small, rtol=0, atol=0)


def test_importance_and_iterative_pruning_on_llama():
    torch.manual_seed(0)
    model = T.AutoModelForCausalLM.from_config(CASES["llama"].config(), attn_implementation=NAME).eval()
    ids = torch.randint(3, V, (2, 6))

    def loss_fn(m, batch):
        return m(batch, labels=batch).loss

    scores = heads.importance(model, [ids], loss_fn)
    assert set(scores) == set(heads.head_counts(model))
    assert all(s.shape == (4,) and torch.isfinite(s).all() and (s > 0).any() for s in scores.values())
    with torch.no_grad():
        base = float(loss_fn(model, ids))
    result = heads.prune_iteratively(
        model,
        lambda m: heads.importance(m, [ids], loss_fn),
        lambda m: -float(loss_fn(m, ids).detach()),
        budget=1e9,
        step=0.25,
    )
    assert result.num_pruned == 6  # every module keeps one head (min_heads=1), 8 - 2
    assert base == float(loss_fn(model, ids).detach())  # the model given is left unchanged


def test_write_report_on_captured_hf_model(tmp_path):
    pytest.importorskip("matplotlib")
    torch.manual_seed(0)
    model = T.AutoModelForCausalLM.from_config(CASES["gpt2"].config(), attn_implementation=NAME).eval()
    tokens = ["The", "cat", "sat", "on", "the", "mat"]
    ids = torch.arange(3, 3 + len(tokens))[None]
    with torch.no_grad(), viz.capture(model) as cap:
        model(ids)
    path = viz.write_report(tmp_path / "r.html", {"the cat": viz.panels(cap, tokens, tokens)})
    text = path.read_text()
    assert "transformer.h.1.attn" in text and "mat" in text


def test_dropout_in_training_only():
    torch.manual_seed(0)
    cfg = CASES["bert"].config()
    cfg.attention_probs_dropout_prob = 0.5
    model = T.AutoModel.from_config(cfg, attn_implementation=NAME)
    ids = torch.randint(3, V, (2, 6))
    with torch.no_grad():
        a, b = model(ids).last_hidden_state, model(ids).last_hidden_state
        model.eval()
        c, d = model(ids).last_hidden_state, model(ids).last_hidden_state
    assert not torch.allclose(a, b) and torch.equal(c, d)


# ------------------------------------------------------------------------------------------------
# Bad input
# ------------------------------------------------------------------------------------------------


def test_register_is_idempotent_and_refuses_taken_names():
    assert mhtf.register() == NAME == mhtf.register(NAME)
    with pytest.raises(ValueError, match="transformers' own"):
        mhtf.register("sdpa")
    with pytest.raises(TypeError, match="non-empty str"):
        mhtf.register("")
    T.AttentionInterface.register("someone_else", lambda *a, **k: None)
    with pytest.raises(ValueError, match="already registered"):
        mhtf.register("someone_else")


def test_unregistered_names_are_clear_errors():
    cfg = CASES["llama"].config()
    with pytest.raises((ValueError, KeyError), match="multihead_nope"):
        T.AutoModel.from_config(cfg, attn_implementation="multihead_nope")
    model = T.AutoModel.from_config(cfg, attn_implementation=NAME)
    with pytest.raises(ValueError, match="not an attention module.*layers.0.self_attn"):
        heads.masked(model, {"layers.0.attn": [0]}).__enter__()
    eager = T.AutoModel.from_config(cfg, attn_implementation="eager")
    with pytest.raises(ValueError, match="bypasses multihead.*set_attn_implementation"):
        viz.capture(eager).__enter__()


def test_prune_every_head_and_unsupported_architecture_are_clear_errors():
    model = T.AutoModel.from_config(CASES["llama"].config(), attn_implementation=NAME)
    with pytest.raises(ValueError, match="cannot prune all 4 heads of 'layers.1.self_attn'"):
        heads.prune(model, {"layers.0.self_attn": [0], "layers.1.self_attn": [0, 1, 2, 3]})
    cfg = T.GPTNeoXConfig(
        vocab_size=V,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=4,
        intermediate_size=37,
        max_position_embeddings=32,
    )
    other = T.AutoModel.from_config(cfg, attn_implementation=NAME)
    assert heads.head_counts(other) == {"layers.0.attention": 4}  # found, inspectable ...
    with pytest.raises(ValueError, match="GPTNeoXAttention.*cannot prune"):  # ... but not prunable
        heads.prune(other, {"layers.0.attention": [1]})


def test_attention_sinks_of_another_shape_are_refused():
    """multihead takes one sink logit per head (gpt-oss's ``s_aux``); other layouts are refused by shape."""
    q, k, v = (torch.randn(1, 2, 3, 4) for _ in range(3))
    with pytest.raises(ValueError, match=r"sinks of shape \(1, 2, 3, 1\).*shape \(2,\).*eager"):
        mhtf.attention_forward(_Module(), q, k, v, None, sinks=torch.zeros(1, 2, 3, 1))


IMPORT_REGISTERS = """\
import transformers as T
import multihead.integrations.transformers as mhtf
cfg = T.LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                    num_attention_heads=4, num_key_value_heads=2)
model = T.AutoModelForCausalLM.from_config(cfg, attn_implementation="multihead")
print(model.config._attn_implementation, mhtf.is_registered("multihead"))
"""


def test_importing_the_integration_registers_multihead():
    """No register() call: the import alone makes attn_implementation="multihead" loadable (a fresh process,
    since this one has registered already)."""
    out = subprocess.run([sys.executable, "-c", IMPORT_REGISTERS], capture_output=True, text=True, check=True)
    assert out.stdout.split()[-2:] == ["multihead", "True"]


def test_import_multihead_does_not_import_transformers():
    code = "import sys, multihead, multihead.heads, multihead.viz; print('transformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# ------------------------------------------------------------------------------------------------
# The attention function on its own: the paths no tiny model reaches
# ------------------------------------------------------------------------------------------------


class _Module(torch.nn.Module):
    is_causal = True


@pytest.mark.parametrize(
    "lq, lk, kwargs, allowed",
    [
        # no mask, Lq = Lk: causal, the lower triangle
        (4, 4, {}, lambda: torch.ones(4, 4).tril().bool()),
        # no mask, Lk > Lq (prefill into an empty static cache): top-left causal, later slots unseen
        (3, 5, {}, lambda: torch.ones(3, 5).tril().bool()),
        # no mask and a sliding window of 2: each query sees itself and the key before it
        (
            4,
            4,
            {"sliding_window": 2},
            lambda: torch.ones(4, 4).tril().bool() & torch.ones(4, 4).triu(-1).bool(),
        ),
        # one query (decoding): every key
        (1, 5, {}, lambda: torch.ones(1, 5).bool()),
    ],
)
def test_attention_forward_without_a_mask(lq, lk, kwargs, allowed):
    import multihead as mh

    g = torch.Generator().manual_seed(0)
    q, k, v = (
        torch.randn(2, 4, lq, 8, generator=g),
        torch.randn(2, 2, lk, 8, generator=g),
        torch.randn(2, 2, lk, 8, generator=g),
    )
    out, w = mhtf.attention_forward(_Module(), q, k, v, None, scaling=0.3, output_attentions=True, **kwargs)
    want = mh.attention_reference(q, k, v, mask=allowed(), scale=0.3, return_weights=True)
    assert out.shape == (2, lq, 4, 8)  # (B, Lq, H, D), transformers' layout
    torch.testing.assert_close(out.transpose(1, 2), want.output, rtol=0, atol=1e-6)
    torch.testing.assert_close(w, want.weights, rtol=0, atol=1e-6)


def test_attention_forward_position_bias_softcap_and_sinks():
    import multihead as mh

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 3, 4, generator=g) for _ in range(3))
    bias = torch.randn(1, 2, 3, 3, generator=g)
    sinks = torch.randn(2, generator=g)
    mask = torch.tensor([[True, True, False]]).expand(3, 3)[None, None]  # (1, 1, Lq, Lk)
    out, w = mhtf.attention_forward(_Module(), q, k, v, mask, position_bias=bias, softcap=0.7, s_aux=sinks)
    assert w is None  # weights only when asked
    want = mh.attention_reference(q, k, v, mask=mask, bias=bias, softcap=0.7, sinks=sinks)
    torch.testing.assert_close(out.transpose(1, 2), want, rtol=0, atol=1e-6)
