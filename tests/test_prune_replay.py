"""``multihead prune``'s layer-by-layer replay (:mod:`multihead.commands.prune.replay`): a chain of layers
replayed one at a time gives the model's own hidden states, and the refit and the reconstruction through it
give the same weights as one pass per layer (what they did before, still their path where layers do not
chain), on tiny random BERT and Llama models (3 layers: the middle one is replayed from a pruned one)."""

from __future__ import annotations

import copy
import importlib

import pytest
import torch

T = pytest.importorskip("transformers")

from multihead import heads  # noqa: E402
from multihead.commands import prune as P  # noqa: E402
from multihead.commands.prune import replay  # noqa: E402
from multihead.integrations import transformers as mhtf  # noqa: E402

R = importlib.import_module("multihead.commands.prune.reconstruct")
F = importlib.import_module("multihead.commands.prune.refit")  # the package's name refit is the function
TOK = type("Tok", (), {"pad_token_id": 0, "eos_token_id": 0, "all_special_ids": [0]})()


def _model(kind):
    mhtf.register()
    torch.manual_seed(0)
    if kind == "bert":
        config = T.BertConfig(vocab_size=40, hidden_size=16, num_hidden_layers=3, num_attention_heads=4,
                              intermediate_size=24, max_position_embeddings=32, attn_implementation="multihead")  # fmt: skip
        return T.BertModel(config, add_pooling_layer=False).double().eval(), P.Embedding(), "encoder.layer"
    config = T.LlamaConfig(vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=3,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                           initializer_range=0.3, attn_implementation="multihead")  # fmt: skip
    return T.LlamaForCausalLM(config).double().eval(), P.CausalLM(), "model.layers"


def _batches(objective, model):
    ids = [torch.randint(1, 40, (n,), generator=torch.Generator().manual_seed(i)).tolist()
           for i, n in enumerate([9, 7, 11, 8, 10, 6, 12, 9])]  # fmt: skip
    batches = P.make_batches(ids, TOK, objective, 3, 0)
    objective.prepare(model, batches)
    return batches


def _pruned(teacher, prefix):
    name = "self_attn" if prefix == "model.layers" else "attention.self"
    drop = {f"{prefix}.0.{name}": [1], f"{prefix}.2.{name}": [0, 3]}
    drop = {k: v for k, v in drop.items() if k in heads.head_counts(teacher)}
    assert len(drop) == 2
    return heads.prune(teacher, drop), drop


@pytest.mark.parametrize("kind", ["bert", "llama"])
def test_a_chain_replays_the_models_own_hidden_states(kind):
    model, objective, prefix = _model(kind)
    batches = _batches(objective, model)
    names = [f"{prefix}.{i}" for i in range(3)]
    assert replay.stack_of(model, names[1:]) == names
    chain = replay.Chain.record(model, names, batches, objective)
    assert chain is not None
    with torch.no_grad():
        hidden = [model(**b.inputs, output_hidden_states=True).hidden_states for b in batches]
    for i in range(3):
        outs = []
        chain.advance(each=lambda _b, out, outs=outs: outs.append(out))
        for b, out in enumerate(
            outs
        ):  # layer i's output = the model's hidden state i + 1 (before a final norm)
            if kind == "bert" or i < 2:
                torch.testing.assert_close(out, hidden[b][i + 1], rtol=0, atol=1e-12)


def test_a_stack_that_is_not_one_list_is_refused():
    model, _, prefix = _model("bert")
    assert replay.stack_of(model, [f"{prefix}.0", "embeddings"]) is None


@pytest.mark.parametrize("kind", ["bert", "llama"])
@pytest.mark.parametrize("stage", ["refit", "reconstruct"])
def test_chained_equals_one_pass_per_layer(kind, stage, monkeypatch):
    teacher, objective, prefix = _model(kind)
    batches = _batches(objective, teacher)
    pruned, drop = _pruned(teacher, prefix)
    results = []
    for chained in (True, False):
        student = copy.deepcopy(pruned)
        if not chained:  # the path for layers that do not chain
            monkeypatch.setattr(F, "stack_of", lambda *_: None)
            monkeypatch.setattr(R, "stack_of", lambda *_: None)
        if stage == "refit":
            out = P.refit_layers(student, teacher, batches, objective, list(drop))
        else:
            out = P.reconstruct_layers(student, teacher, batches, batches[:2], objective, list(drop), steps=30,
                                       lr=3e-3, check_every=10)  # fmt: skip
        results.append((out, student.state_dict()))
    (out_a, a), (out_b, b) = results
    if stage == "refit":
        assert out_a == out_b == (5 if kind == "bert" else 2)  # bert: 2 attention, 3 feed-forward projections
    else:
        assert out_a.keys() == out_b.keys() and len(out_a) == 2
        for k in out_a:
            assert out_a[k] == pytest.approx(out_b[k], rel=1e-9)
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-9, atol=1e-12)
    changed = [k for k in a if not torch.equal(a[k], pruned.state_dict()[k])]
    assert changed  # the stage did something
