"""Layer-wise reconstruction (``multihead.commands.prune.reconstruct``): toy layers with a known answer."""

from __future__ import annotations

import copy

import pytest
import torch

T = pytest.importorskip("transformers")

from test_prune_cmd import _Toy  # noqa: E402  (tests/test_prune_cmd.py: embeddings -> one attention layer)
from test_prune_refit import _batches  # noqa: E402  (8 short texts)

from multihead.commands import prune as P  # noqa: E402
from multihead.integrations import transformers as mhtf  # noqa: E402

ATTN0 = "encoder.layer.0.attention.self"


def _bert():
    """A tiny float64 BERT whose attention matters to its layers' output (weights drawn at std 0.5: at
    the usual 0.02 the residual drowns what the heads add)."""
    mhtf.register()
    torch.manual_seed(0)
    config = T.BertConfig(vocab_size=40, hidden_size=8, num_hidden_layers=2, num_attention_heads=2,
                          intermediate_size=12, max_position_embeddings=32, initializer_range=0.5,
                          attn_implementation="multihead")  # fmt: skip
    return T.BertModel(config, add_pooling_layer=False).double().eval()


def _with_patterns_changed(teacher):
    """The teacher with noise on layer 0's query and key projections: its attention patterns differ, which no
    linear refit of the output can undo; the teacher's own weights are the exact answer."""
    student = copy.deepcopy(teacher)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for lin in (
            student.encoder.layer[0].attention.self.query,
            student.encoder.layer[0].attention.self.key,
        ):
            lin.weight += 0.8 * torch.randn(lin.weight.shape, generator=g, dtype=torch.float64)
    return student


def _params(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_layer_of_names_the_list_element_holding_the_attention():
    model = _bert()
    assert P.layer_of(model, ATTN0) == "encoder.layer.0"
    assert P.layer_of(model, "encoder.layer.1.attention.self") == "encoder.layer.1"
    assert P.layer_of(_Toy(), "attn") is None  # no nn.ModuleList above it


def test_reconstruction_brings_the_layer_back_and_touches_nothing_else():
    teacher = _bert()
    student = _with_patterns_changed(teacher)
    before = _params(student)
    batches = _batches()
    done = P.reconstruct_layers(
        student, teacher, batches, batches, P.Embedding(), [ATTN0], steps=300, lr=1e-2
    )
    assert list(done) == ["encoder.layer.0"]
    start, end = done["encoder.layer.0"]
    assert start > 0.05 and end < 0.1 * start  # the error, relative to the output's mean square
    after = _params(student)
    trained = [n for n in before if not torch.equal(before[n], after[n])]
    assert trained and all(n.startswith("encoder.layer.0.attention.") for n in trained)
    assert all(p.requires_grad for p in student.parameters())  # as they were before the call
    with torch.no_grad():  # the whole model is closer to the teacher than before
        b = batches[0].inputs
        gap = (student(**b).last_hidden_state - teacher(**b).last_hidden_state).abs().max()
        orig = (
            (_with_patterns_changed(teacher)(**b).last_hidden_state - teacher(**b).last_hidden_state)
            .abs()
            .max()
        )
    assert gap < 0.5 * orig


def test_a_step_that_makes_validation_worse_is_not_kept():
    """At a learning rate that only makes things worse, every check loses to the start: the weights stay."""
    teacher = _bert()
    student = _with_patterns_changed(teacher)
    before = _params(student)
    batches = _batches()
    done = P.reconstruct_layers(student, teacher, batches, batches, P.Embedding(), [ATTN0], steps=20, lr=50.0)
    start, end = done["encoder.layer.0"]
    assert end == start
    assert all(torch.equal(before[n], p) for n, p in student.named_parameters())


def test_a_causal_lm_layer_is_replayed_without_its_cache():
    """Llama's layers get a KV cache from the model; replaying one must neither append to it nor fail."""
    mhtf.register()
    torch.manual_seed(0)
    config = T.LlamaConfig(vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                           initializer_range=0.5, attn_implementation="multihead")  # fmt: skip
    teacher = T.LlamaForCausalLM(config).double().eval()
    student = copy.deepcopy(teacher)
    with torch.no_grad():
        q = student.model.layers[1].self_attn.q_proj.weight
        q += 0.8 * torch.randn(q.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    ids = [
        torch.randint(1, 40, (n,), generator=torch.Generator().manual_seed(i)).tolist()
        for i, n in enumerate([9, 7, 11, 8])
    ]
    tok = type("Tok", (), {"pad_token_id": 0, "eos_token_id": 0, "all_special_ids": [0]})()
    objective = P.CausalLM()
    batches = P.make_batches(ids, tok, objective, 2, 0)
    done = P.reconstruct_layers(
        student, teacher, batches, batches, objective, ["model.layers.1.self_attn"], steps=60, lr=1e-2
    )
    start, end = done["model.layers.1"]
    assert end < 0.5 * start
