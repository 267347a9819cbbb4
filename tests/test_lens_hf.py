"""multihead.lens on every Hugging Face family that runs on multihead, built tiny from configs (random weights):
the pattern equals eager attention's ``output_attentions``, each head's result sums to the output projection's
output, an edit of z equals the same edit made by hand in the eager model (on its output projection's input),
batched patching equals one forward per head, and logit attribution equals the by-hand norm and unembedding.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

T = pytest.importorskip("transformers")

from test_hf_families import V, tiny_config  # noqa: E402  (tiny sizes shared by the family tests)

from multihead import heads, lens  # noqa: E402
from multihead.heads.naming import attention_modules, output_projection  # noqa: E402
from multihead.integrations import transformers as mhtf  # noqa: E402

NAME = mhtf.register()
pytestmark = pytest.mark.filterwarnings("ignore:multihead. calls of")

FAMILIES = {
    "llama (GQA)": (T.LlamaConfig, {}, T.AutoModelForCausalLM),
    "mistral (sliding window)": (T.MistralConfig, {}, T.AutoModelForCausalLM),
    "gemma2 (softcap, windows)": (T.Gemma2Config, dict(attn_logit_softcapping=5.0), T.AutoModelForCausalLM),
    "gpt_oss (sinks)": (T.GptOssConfig, {}, T.AutoModelForCausalLM),
    "gpt2 (Conv1D)": (T.GPT2Config, {}, T.AutoModelForCausalLM),
    "bert (encoder)": (T.BertConfig, {}, T.AutoModel),
    "gpt_neox (output projection 'dense')": (T.GPTNeoXConfig, {}, T.AutoModelForCausalLM),
    "camembert (a BERT copy: the parent's output.dense)": (T.CamembertConfig, {}, T.AutoModel),
    "olmo (a LayerNorm without weights)": (T.OlmoConfig, {}, T.AutoModelForCausalLM),
}


def _pair(family):
    """The family's tiny model on eager and on multihead, same weights."""
    config_class, overrides, auto = FAMILIES[family]
    config = tiny_config(config_class, final_logit_softcapping=None, **overrides)
    config._experts_implementation = "eager"
    torch.manual_seed(0)
    eager = auto.from_config(copy.deepcopy(config), attn_implementation="eager").eval()
    with torch.no_grad():
        for p in eager.parameters():
            if (
                p.dim() == 1
            ):  # norms' weights and biases away from their 1 / 0 start (LayerNorm bias, Gemma's 1 + w)
                p.add_(0.2 * torch.randn_like(p))
    ours = auto.from_config(copy.deepcopy(config), attn_implementation=NAME).eval()
    ours.load_state_dict(eager.state_dict())
    ids = torch.randint(3, V, (2, 7), generator=torch.Generator().manual_seed(1))
    keep = torch.ones(2, 7, dtype=torch.long)
    keep[1, 5:] = 0  # right padding on the second row: padded keys are masked
    return eager, ours, dict(input_ids=ids, attention_mask=keep)


def _recorder(seen, name):
    def hook(module, inputs, output):
        seen[name] = (inputs[0].detach(), output.detach())

    return hook


def _projection_io(model, fn):
    """``fn()`` run with every attention module's output projection recorded: {name: (input, output)}."""
    seen, handles = {}, []
    for name, module in attention_modules(model).items():
        layer = output_projection(model, name, module).module
        handles.append(layer.register_forward_hook(_recorder(seen, name)))
    try:
        fn()
    finally:
        for h in handles:
            h.remove()
    return seen


@pytest.mark.parametrize("family", list(FAMILIES))
def test_points_equal_eager_and_results_sum_to_the_projection(family):
    eager, ours, inputs = _pair(family)
    with torch.no_grad():
        want = eager(**inputs, output_attentions=True)
        with lens.cache(ours, points=("pattern", "z", "result", "k")) as c:
            io = _projection_io(ours, lambda: ours(**inputs))
    names = list(attention_modules(ours))
    assert c.names() == names
    real = inputs["attention_mask"].bool()[:, None, :, None]  # (B, 1, L, 1): rows of real queries
    for i, name in enumerate(names):
        torch.testing.assert_close(c[name, "pattern"] * real, want.attentions[i] * real, atol=1e-5, rtol=1e-4)
        merged, out = io[name]
        b, h, n, d = c[name, "z"].shape
        torch.testing.assert_close(c[name, "z"].transpose(1, 2).reshape(b, n, h * d), merged)
        bias = output_projection(ours, name, attention_modules(ours)[name]).bias()
        total = c[name, "result"].sum(1) + (0 if bias is None else bias)
        torch.testing.assert_close(total, out, atol=1e-5, rtol=1e-5)
    h, hkv = heads.naming.module_heads(attention_modules(ours)[names[0]])
    assert c[names[0], "k"].shape[1] == hkv and c[names[0], "pattern"].shape[1] == h


@pytest.mark.parametrize(
    "family", ["llama (GQA)", "gpt2 (Conv1D)", "bert (encoder)", "gemma2 (softcap, windows)"]
)
def test_a_z_edit_equals_the_same_edit_by_hand_in_eager(family):
    eager, ours, inputs = _pair(family)
    name = list(attention_modules(ours))[-1]
    module = attention_modules(eager)[name]
    layer = output_projection(eager, name, module).module
    h, _ = heads.naming.module_heads(module)

    def by_hand(m, args):
        x = args[0].clone()  # (B, L, H*D): head 1's columns scaled, as the lens edit below does
        width = x.shape[-1] // h
        x[..., width : 2 * width] *= 3
        return (x,)

    handle = layer.register_forward_pre_hook(by_hand)
    try:
        with torch.no_grad():
            want = eager(**inputs)
    finally:
        handle.remove()

    def edit(z, ctx):
        z = z.clone()
        z[:, 1] *= 3
        return z

    with torch.no_grad(), lens.hooks(ours, {(name, "z"): edit}):
        got = ours(**inputs)
    key = "logits" if "logits" in want else "last_hidden_state"
    real = inputs["attention_mask"].bool()
    torch.testing.assert_close(got[key][real], want[key][real], atol=1e-5, rtol=1e-5)


def test_patching_a_causal_lm_batched_equals_one_forward_per_head():
    _, ours, inputs = _pair("llama (GQA)")
    corrupted = dict(inputs, input_ids=inputs["input_ids"].roll(1, dims=1))
    target = inputs["input_ids"][:, -1]

    def per_example(out):
        logits = out.logits[:, -2]  # (B, V)
        return logits.gather(1, target[:, None])[:, 0] - logits.mean(-1)

    batched = lens.patch_heads(ours, inputs, corrupted, per_example, chunk=3)
    single = lens.patch_heads(ours, inputs, corrupted, lambda out: per_example(out).mean())
    assert batched.shape == (2, 4) and torch.isfinite(batched).all()
    torch.testing.assert_close(batched, single, atol=1e-5, rtol=1e-5)
    by_kv = lens.patch_heads(ours, inputs, corrupted, per_example, point="v")
    assert by_kv.shape == (2, 2)  # v by key/value head (GQA: 2)


def _frozen_by_hand(norm, x):
    """``g`` (B, E) of the three final norms, from their formulas and attributes."""
    if isinstance(norm, torch.nn.LayerNorm):
        return norm.weight / (x.var(-1, unbiased=False, keepdim=True) + norm.eps).sqrt()
    if type(norm).__name__ == "OlmoLayerNorm":  # F.layer_norm without weights, eps 1e-5
        return 1 / (x.var(-1, unbiased=False, keepdim=True) + 1e-5).sqrt()
    eps = getattr(norm, "variance_epsilon", None) or norm.eps
    weight = norm.weight + 1 if "Gemma" in type(norm).__name__ else norm.weight  # Gemma: x * (1 + w)
    return weight / (x.pow(2).mean(-1, keepdim=True) + eps).sqrt()


@pytest.mark.parametrize(
    "family",
    ["llama (GQA)", "gpt2 (Conv1D)", "gemma2 (softcap, windows)", "olmo (a LayerNorm without weights)"],
)
def test_logit_attribution_is_exact_and_equals_the_norm_by_hand(family):
    _, ours, inputs = _pair(family)
    ids = inputs["input_ids"][:, 2]
    base = ours.get_decoder() if hasattr(ours, "get_decoder") else ours.transformer
    norm = getattr(base, "norm", None) or getattr(base, "ln_f", None)
    with torch.no_grad():
        att = lens.logit_attribution(ours, inputs, ids, position=4)
        seen = []
        handle = norm.register_forward_hook(lambda m, i, o: seen.append(i[0]))
        with lens.cache(ours, points="result") as c:
            logits = ours(**inputs).logits[:, 4]  # (B, V)
        handle.remove()
    want = logits.gather(1, ids[:, None])[:, 0]
    torch.testing.assert_close(att.heads.sum((0, 1)) + att.rest, want)
    torch.testing.assert_close(att.logit, want)
    x = seen[0][:, 4]  # (B, E)
    g = _frozen_by_hand(norm, x)
    u = ours.get_output_embeddings().weight[ids]  # (B, E)
    for i, name in enumerate(att.names):
        r = c[name, "result"][:, :, 4]  # (B, H, E)
        if "LayerNorm" in type(norm).__name__:
            r = r - r.mean(-1, keepdim=True)
        torch.testing.assert_close(att.heads[i], (r * (g * u)[:, None]).sum(-1).T, atol=1e-5, rtol=1e-4)
    direction = torch.zeros(V)
    direction[5], direction[6] = 1.0, -1.0
    diff = lens.logit_attribution(ours, inputs, direction, position=4)
    torch.testing.assert_close(diff.logit, logits[:, 5] - logits[:, 6])


def test_hf_bad_requests_are_refused_by_name():
    _, ours, inputs = _pair("bert (encoder)")
    with pytest.raises(TypeError, match="get_output_embeddings"):
        lens.logit_attribution(ours, inputs, torch.tensor([1, 2]))
    _, llama, inputs = _pair("llama (GQA)")
    with pytest.raises(ValueError, match=r"target must be token ids of shape \(2,\)"):
        lens.logit_attribution(llama, inputs, torch.tensor([1, 2, 3]))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ValueError, match="'model.layers.0.self_attn'"):
            with lens.cache(llama, points="z", modules=["model.layers.0"]):
                pass


def test_attribution_refuses_a_head_whose_result_is_not_in_the_stream_the_final_norm_reads():
    # ELECTRA's generator head: a dense layer (hidden 32 -> embedding 128) before the final LayerNorm
    config = tiny_config(T.ElectraConfig, is_decoder=True)
    model = T.ElectraForCausalLM._from_config(config, attn_implementation=NAME).eval()
    ids = torch.randint(3, V, (2, 5), generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="results are 32 wide and the norm before the unembedding reads 128"):
        lens.logit_attribution(model, ids, ids[:, -1])
