"""The public contract (DESIGN.md) stands: names importable, signatures as promised; a first forward runs."""

import importlib
import inspect

import pytest
import torch

import multihead as mh

# name -> the promised signature, as written in the contract. The real one must have these parameters
# with the same kinds and defaults, in this order; it may add keyword-only parameters with defaults.
CONTRACT = {
    "multihead.attention": "q, k, v, *, mask=None, bias=None, valid_lens=None, causal=False, segment_ids=None, "
    "softcap=None, sinks=None, scale=None, dropout=0.0, return_weights=False, backend='auto'",
    "multihead.attention_reference": "q, k, v, *, mask=None, bias=None, valid_lens=None, causal=False, "
    "segment_ids=None, softcap=None, sinks=None, scale=None, dropout=0.0, return_weights=False",
    "multihead.MultiHeadAttention.__init__": "self, embed_dim, num_heads, *, kv_heads=None, kdim=None, vdim=None, "
    "head_dim=None, v_head_dim=None, out_dim=None, bias=True, dropout=0.0, rotary=False, attention_fn=None, "
    "backend='auto', device=None, dtype=None",
    "multihead.MultiHeadAttention.forward": "self, query, key=None, value=None, *, mask=None, bias=None, "
    "valid_lens=None, causal=False, segment_ids=None, cache=None, return_weights=False",
    "multihead.TransformerEncoder.forward": "self, x, *, mask=None, valid_lens=None",
    "multihead.TransformerEncoderLayer.forward": "self, x, *, mask=None, valid_lens=None",
    "multihead.TransformerDecoder.forward": "self, x, memory, *, mask=None, valid_lens=None, causal=True, "
    "memory_mask=None, memory_valid_lens=None, cache=None",
    "multihead.TransformerDecoderLayer.forward": "self, x, memory, *, mask=None, valid_lens=None, causal=True, "
    "memory_mask=None, memory_valid_lens=None, cache=None",
    "multihead.KVCache.__init__": "self",
    "multihead.heads.importance": "model, batches, loss_fn",
    "multihead.heads.prune": "module_or_model, heads",
    "multihead.viz.plot_attention": "weights, query_tokens=None, key_tokens=None",
    "multihead.distributed.ring_attention": "q, k, v, *, causal=False, group=None",
    "multihead.export.to_onnx": "module, example_input, path",
}
NAMES = [
    "multihead.masks.causal",
    "multihead.masks.from_valid_lens",
    "multihead.masks.key_padding",
    "multihead.masks.sliding_window",
    "multihead.masks.combine",
    "multihead.MultiHeadAttention.from_torch",
    "multihead.MultiHeadAttention.to_torch",
    "multihead.TransformerEncoderLayer.from_torch",
    "multihead.TransformerDecoderLayer.from_torch",
    "multihead.PositionalEncoding",
    "multihead.FeedForward",
    "multihead.Transformer",
    "multihead.AttentionOutput",
    "multihead.compat.torch.MultiheadAttention",
    "multihead.compat.d2l.MultiHeadAttention",
    "multihead.viz.capture",
    "multihead.heads.head_counts",
    "multihead.heads.masked",
]


def resolve(dotted):
    """``multihead.a.B.c`` -> the object, as a user reaches it: attributes first (``multihead.heads.prune``
    is the function, not the submodule), importing a submodule only where no attribute has the name."""
    first, *rest = dotted.split(".")
    obj = importlib.import_module(first)
    for i, part in enumerate(rest):
        if not hasattr(obj, part):
            importlib.import_module(".".join([first, *rest[: i + 1]]))
        obj = getattr(obj, part)
    return obj


def promised(text):
    namespace = {}
    exec(f"def f({text}): pass", namespace)
    return inspect.signature(namespace["f"])


@pytest.mark.parametrize("name", list(CONTRACT))
def test_signature_keeps_the_contract(name):
    actual = list(inspect.signature(resolve(name)).parameters.values())
    expected = list(promised(CONTRACT[name]).parameters.values())
    got = [(p.name, p.kind, p.default) for p in actual[: len(expected)]]
    assert got == [(p.name, p.kind, p.default) for p in expected], f"{name}{inspect.signature(resolve(name))}"
    extra = [p for p in actual[len(expected) :] if p.kind != p.KEYWORD_ONLY or p.default is p.empty]
    assert not extra, f"{name}: added parameters must be keyword-only with a default, got {extra}"


def test_the_contract_check_can_fail():
    """A renamed, reordered or re-defaulted parameter is caught by the comparison above."""
    ok = promised("q, k, v, *, causal=False")
    for broken in ("q, k, v, *, causal=True", "q, v, k, *, causal=False", "q, k, v, causal=False"):
        b = promised(broken)
        assert [(p.name, p.kind, p.default) for p in b.parameters.values()] != [
            (p.name, p.kind, p.default) for p in ok.parameters.values()
        ]


@pytest.mark.parametrize("name", NAMES)
def test_public_name_exists(name):
    assert callable(resolve(name))


def test_public_names():
    for name in (
        "attention",
        "attention_reference",
        "AttentionOutput",
        "MultiHeadAttention",
        "masks",
        "KVCache",
    ):
        assert name in mh.__all__ and hasattr(mh, name)


def test_demo_seed_parity(capsys):
    from multihead.demo import seeds

    assert seeds.run(seed=1) == 0
    assert "OK" in capsys.readouterr().out


def test_module_self_attention_shape():
    mha = mh.MultiHeadAttention(32, 4)
    assert mha(torch.randn(2, 3, 32)).shape == (2, 3, 32)
