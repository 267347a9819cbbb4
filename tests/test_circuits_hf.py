"""Gradients, attribution patching, edges and faithfulness on Hugging Face families on multihead, tiny random
configs in float64: a Llama with grouped-query attention (4 heads, 2 key/value heads), GPT-2 (Conv1D
projections, learned positions added before the first layer), and the refusals: BERT (post-norm) and GPT-NeoX
(parallel attention and MLP).

The survey (test_every_family_gives_edges_or_a_named_refusal): node attribution serves every family; edges:

| family | edges |
| --- | --- |
| Llama, Mistral, Qwen2, Qwen3, Phi-3, Gemma, SmolLM3, Starcoder2, GPT-OSS, OLMo, GPT-2, GPT-NeoX sequential | yes |
| BERT, CamemBERT | refused: post-norm |
| OLMo 2 | refused: post-norm (a norm on each sublayer's output) |
| Gemma 2 | refused: a norm on the attention's output before the residual sum |
| GPT-NeoX (parallel residual), Phi | refused: parallel block |

Expected values: patching made by hand on the model's own modules, autograd, and finite differences of the
metric along the clean - corrupted stream fed to one reader alone (where TransformerLens refuses: GQA edges).
"""

from __future__ import annotations

import pytest
import torch

T = pytest.importorskip("transformers")

from test_hf_families import V, tiny_config  # noqa: E402  (tiny sizes shared by the family tests)

from multihead import lens  # noqa: E402
from multihead.integrations import transformers as mhtf  # noqa: E402
from multihead.lens.faithful import nudged  # noqa: E402

NAME = mhtf.register()
pytestmark = pytest.mark.filterwarnings("ignore:multihead. calls of")


def _model(config_class, auto=None, **overrides):
    config = tiny_config(config_class, **overrides)
    torch.manual_seed(0)
    auto = auto or T.AutoModelForCausalLM
    model = auto.from_config(config, attn_implementation=NAME).double().eval()
    for norm in model.modules():
        if (
            type(norm).__name__ == "LlamaRMSNorm"
        ):  # it computes in float32 whatever its input: here in float64
            norm.forward = _rms_norm_in_float64.__get__(norm)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:  # norms' weights and biases away from their 1 / 0 start
                p.add_(0.2 * torch.randn_like(p))
    return model


def _rms_norm_in_float64(self, x):
    return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))


def _ids(seed, b=2, n=6):
    return torch.randint(3, V, (b, n), generator=torch.Generator().manual_seed(seed))


def _logit_diff(out):
    return out.logits[:, -1, 5] - out.logits[:, -1, 6]  # (B,)


@pytest.fixture(scope="module")
def llama():
    m = _model(T.LlamaConfig)
    clean, corrupted = _ids(0), _ids(1)
    return m, clean, corrupted, lens.edge_attribution(m, clean, corrupted, _logit_diff)


def test_gqa_llama_graph_has_key_value_heads_and_rows_sum_to_node_effects(llama):
    m, clean, corrupted, g = llama
    a0 = "model.layers.0.self_attn"
    assert g.writers[0] == lens.Node("model.embed_tokens", "embed") and g.readers[-1] == lens.Node(
        "lm_head", "logits"
    )
    kinds = [(r.kind, r.head) for r in g.readers if r.name == a0]
    assert kinds == [("q", 0), ("q", 1), ("q", 2), ("q", 3), ("k", 0), ("k", 1), ("v", 0), ("v", 1)]
    assert (
        lens.Node("model.layers.1.mlp", "mlp") in g.writers
        and lens.Node("model.layers.1.mlp", "mlp") in g.readers
    )
    node = lens.attribution_patch(m, clean, corrupted, _logit_diff)
    with torch.no_grad():
        base = float(_logit_diff(m(corrupted)).mean())
    rows = g.node_effects()
    heads = torch.stack([rows[1:5], rows[6:10]])
    torch.testing.assert_close(heads, node - base)


@pytest.mark.parametrize(
    "reader", [("q", 0, 2), ("k", 1, 1), ("v", 1, 0), ("mlp", 0, None), ("logits", None, None)]
)
def test_gqa_llama_each_readers_column_is_the_finite_difference_along_its_own_input(llama, reader):
    m, clean, corrupted, g = llama
    kind, layer, head = reader
    node = {
        "q": lens.Node(f"model.layers.{layer}.self_attn", "q", head),
        "k": lens.Node(f"model.layers.{layer}.self_attn", "k", head),
        "v": lens.Node(f"model.layers.{layer}.self_attn", "v", head),
        "mlp": lens.Node(f"model.layers.{layer}.mlp", "mlp"),
        "logits": lens.Node("lm_head", "logits"),
    }[kind]
    eps = 1e-4
    up, down = (nudged(m, clean, corrupted, _logit_diff, node, s * eps) for s in (1, -1))
    column = float(g.scores[:, g.readers.index(node)].sum())
    assert abs(column) > 1e-5
    assert (up - down) / (2 * eps) == pytest.approx(column, rel=1e-6)


def test_gqa_llama_faithfulness_ends_and_a_dropped_k_edge_by_hand(llama):
    m, clean, corrupted, g = llama
    assert lens.faithfulness(m, g, clean, corrupted, _logit_diff) == pytest.approx(1.0, abs=1e-10)
    assert lens.faithfulness(m, [], clean, corrupted, _logit_diff) == pytest.approx(0.0, abs=1e-10)
    # drop embed -> layer 1's k head 1: that k head is computed from the stream without the embedding's clean
    # output (by hand: the layer's own norm and attention on that stream), the rest of the clean run unchanged
    a1 = "model.layers.1.self_attn"
    edge = (lens.Node("model.embed_tokens", "embed"), lens.Node(a1, "k", 1))
    with torch.no_grad():
        delta = m.model.embed_tokens(clean) - m.model.embed_tokens(corrupted)
        norm = m.model.layers[1].input_layernorm
        handle = norm.register_forward_pre_hook(lambda mod, args: (args[0] - delta,))
        with lens.cache(m, "k", modules=[a1]) as c:
            m(clean)
        handle.remove()
        k_edit = c[a1, "k"][:, 1]

        def swap(k, ctx):
            k = k.clone()
            k[:, 1] = k_edit
            return k

        with lens.hooks(m, {(a1, "k"): swap}):
            value = float(_logit_diff(m(clean)).mean())
        low, high = (float(_logit_diff(m(x)).mean()) for x in (corrupted, clean))
    kept = [(w, r) for w, r, _ in g.edges() if (w, r) != edge]
    got = lens.faithfulness(m, kept, clean, corrupted, _logit_diff)
    assert got == pytest.approx((value - low) / (high - low), abs=1e-10)


def test_gpt2_edges_rows_sum_to_node_effects_and_faithfulness_ends():
    m = _model(T.GPT2Config)
    clean, corrupted = _ids(2), _ids(3)
    g = lens.edge_attribution(m, clean, corrupted, _logit_diff, ig_steps=2)
    node = lens.attribution_patch(m, clean, corrupted, _logit_diff, ig_steps=2)
    with torch.no_grad():
        base = float(_logit_diff(m(corrupted)).mean())
    rows = g.node_effects()
    torch.testing.assert_close(torch.stack([rows[1:5], rows[6:10]]), node - base)
    assert g.writers[0].name == "transformer.wte" and g.readers[-1].name == "lm_head"
    assert lens.faithfulness(m, g, clean, corrupted, _logit_diff) == pytest.approx(1.0, abs=1e-10)
    assert lens.faithfulness(m, [], clean, corrupted, _logit_diff) == pytest.approx(0.0, abs=1e-10)


def test_gqa_grads_at_k_and_v_equal_autograd_through_the_key_value_heads():
    m = _model(T.LlamaConfig)
    ids = _ids(4)
    a = "model.layers.1.self_attn"
    with lens.cache(m, ("k", "v", "z"), modules=[a], grads=True) as c:
        _logit_diff(m(ids)).sum().backward()
    assert c.grad(a, "k").shape == c[a, "k"].shape == (2, 2, 6, 8)
    # by hand: d metric / d k through the layer's attention recomputed from cached q, k, v and the z gradient
    with lens.cache(m, "q", modules=[a]) as cq, torch.no_grad():
        m(ids)
    q, k, v = cq[a, "q"], c[a, "k"].clone().requires_grad_(), c[a, "v"].clone().requires_grad_()
    kk, vv = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    scores = q @ kk.transpose(-2, -1) / 8**0.5
    scores = scores.masked_fill(~torch.ones(6, 6, dtype=torch.bool).tril(), float("-inf"))
    z = scores.softmax(-1) @ vv
    torch.testing.assert_close(z.detach(), c[a, "z"])
    gk, gv = torch.autograd.grad(z, (k, v), grad_outputs=c.grad(a, "z"))
    torch.testing.assert_close(c.grad(a, "k"), gk)
    torch.testing.assert_close(c.grad(a, "v"), gv)


def test_post_norm_and_parallel_blocks_are_refused_by_name_node_attribution_still_serves():
    bert = _model(T.BertConfig, auto=T.AutoModel)
    clean, corrupted = _ids(5), _ids(6)

    def metric(out):
        return out.last_hidden_state[:, 0, :3].sum(-1)

    with pytest.raises(ValueError, match="post-norm"):
        lens.edge_attribution(bert, clean, corrupted, metric)
    assert lens.attribution_patch(bert, clean, corrupted, metric).shape == (2, 4)
    neox = _model(T.GPTNeoXConfig, use_parallel_residual=True)
    with pytest.raises(ValueError, match="parallel block"):
        lens.edge_attribution(neox, clean, corrupted, _logit_diff)


SURVEY = {
    "llama": (T.LlamaConfig, {}, None),
    "mistral": (T.MistralConfig, {}, None),
    "qwen2": (T.Qwen2Config, {}, None),
    "qwen3": (T.Qwen3Config, {}, None),
    "phi3": (T.Phi3Config, {}, None),
    "gemma": (T.GemmaConfig, {}, None),
    "smollm3": (T.SmolLM3Config, {}, None),
    "starcoder2": (T.Starcoder2Config, {}, None),
    "gpt_oss": (T.GptOssConfig, {}, None),
    "olmo": (T.OlmoConfig, {}, None),
    "gpt_neox sequential": (T.GPTNeoXConfig, dict(use_parallel_residual=False), None),
    "camembert": (T.CamembertConfig, {}, "post-norm"),
    "olmo2": (T.Olmo2Config, {}, "post-norm"),
    "gemma2": (T.Gemma2Config, dict(final_logit_softcapping=None), "norm on the attention's output"),
    "phi": (T.PhiConfig, {}, "parallel block"),
    # its mixture of experts returns the tokens flattened (B*L, E): once a RuntimeError in the stream check
    "llama4_text": (T.Llama4TextConfig, {}, "not shaped like the stream"),
}


@pytest.mark.parametrize("family", list(SURVEY))
def test_every_family_gives_edges_or_a_named_refusal(family):
    config_class, overrides, refusal = SURVEY[family]
    encoder = config_class is T.CamembertConfig
    m = _model(config_class, auto=T.AutoModel if encoder else None, **overrides)
    if hasattr(m.config, "_experts_implementation"):
        m.config._experts_implementation = "eager"

    def metric(out):
        return out.last_hidden_state[:, 0, :3].sum(-1) if encoder else _logit_diff(out)

    clean, corrupted = {"input_ids": _ids(7)}, {"input_ids": _ids(8)}
    node = lens.attribution_patch(m, clean, corrupted, metric)
    if refusal is not None:
        with pytest.raises(ValueError, match=refusal):
            lens.edge_attribution(m, clean, corrupted, metric)
        return
    g = lens.edge_attribution(m, clean, corrupted, metric)
    with torch.no_grad():
        base = float(metric(m(**corrupted)).mean())
    heads = [i for i, w in enumerate(g.writers) if w.kind == "head"]
    torch.testing.assert_close(g.node_effects()[heads].view(node.shape), node - base)
    assert lens.faithfulness(m, g, clean, corrupted, metric) == pytest.approx(1.0, abs=1e-9)
    assert lens.faithfulness(m, [], clean, corrupted, metric) == pytest.approx(0.0, abs=1e-9)


@pytest.mark.parametrize("point", ["z", "k", "pattern"])
def test_the_clean_run_of_attribution_patch_stops_after_the_last_module_asked(llama, point):
    """The clean run reads only each module's point: the unembedding (and, with ``modules=`` the first layer,
    every later layer) never runs there, and the estimate is what a full clean run gives (z or k sources
    taken from lens.cache by hand)."""
    m, clean, corrupted, _ = llama
    calls = []
    handle = m.lm_head.register_forward_hook(lambda *a: calls.append(1))
    try:
        est = lens.attribution_patch(m, clean, corrupted, _logit_diff, point=point)
    finally:
        handle.remove()
    assert len(calls) == 1  # the corrupted run's alone
    with torch.no_grad(), lens.cache(m, point) as c:
        m(clean)
    with lens.cache(m, point, grads=True) as g:
        value = _logit_diff(m(corrupted)).mean()
        value.backward()
    m.zero_grad()
    by_hand = torch.stack(
        [value.detach() + ((c[n, point] - g[n, point]) * g.grad(n, point)).sum((0, 2, 3)) for n in c.names()]
    )
    torch.testing.assert_close(est.to(by_hand.dtype), by_hand, rtol=1e-5, atol=1e-6)
