"""``multihead prune``'s feed-forward refit (:func:`refit_feed_forward`): on a tiny BERT whose exact answer
is known (only its feed-forward output projections were changed), and its pull toward the original weights."""

from __future__ import annotations

import copy

import pytest
import torch

T = pytest.importorskip("transformers")

from test_prune_cmd import _Toy  # noqa: E402  (tests/test_prune_cmd.py: embeddings -> one attention layer)

from multihead import heads  # noqa: E402
from multihead.commands import prune as P  # noqa: E402
from multihead.integrations import transformers as mhtf  # noqa: E402


def _bert():
    mhtf.register()
    torch.manual_seed(0)
    config = T.BertConfig(vocab_size=40, hidden_size=8, num_hidden_layers=2, num_attention_heads=2,
                          intermediate_size=12, max_position_embeddings=32, attn_implementation="multihead")  # fmt: skip
    return T.BertModel(config, add_pooling_layer=False).double().eval()


def _batches():
    ids = [torch.randint(1, 40, (n,), generator=torch.Generator().manual_seed(i)).tolist()
           for i, n in enumerate([9, 7, 11, 8, 10, 9, 6, 12])]  # fmt: skip  # 72 tokens > 13 unknowns per output
    tok = type("Tok", (), {"pad_token_id": 0, "all_special_ids": [0]})()
    return P.make_batches(ids, tok, P.Embedding(), 4, 0)


def _perturbed(teacher):
    """The teacher with noise added to every layer's feed-forward output projection (weight and bias)."""
    student = copy.deepcopy(teacher)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for layer in student.encoder.layer:
            layer.output.dense.weight += 0.3 * torch.randn(
                layer.output.dense.weight.shape, generator=g, dtype=torch.float64
            )
            layer.output.dense.bias += 0.3 * torch.randn(
                layer.output.dense.bias.shape, generator=g, dtype=torch.float64
            )
    return student


def test_feed_forward_sums_finds_each_layers_projection_and_norm():
    model = _bert()
    found = P.feed_forward_sums(model)
    assert [(p, n) for p, n in found] == [
        (layer.output.dense, layer.output.LayerNorm) for layer in model.encoder.layer
    ]
    assert P.feed_forward_sums(_Toy()) == []  # no BERT-style layer: nothing to refit


def test_refit_feed_forward_restores_the_teachers_projections_exactly():
    """Only the feed-forward output projections differ, so layer 0's sum differs by exactly the weight
    change times its input; once layer 0 is restored, layer 1's inputs equal the teacher's and it is too."""
    teacher = _bert()
    student = _perturbed(teacher)
    batches = _batches()
    assert P.refit_feed_forward(student, teacher, batches, P.Embedding(), ridge=0.0) == 2
    for s, t in zip(student.encoder.layer, teacher.encoder.layer, strict=True):
        torch.testing.assert_close(s.output.dense.weight, t.output.dense.weight, atol=1e-8, rtol=0)
        torch.testing.assert_close(s.output.dense.bias, t.output.dense.bias, atol=1e-8, rtol=0)
    b = batches[0].inputs
    with torch.no_grad():
        torch.testing.assert_close(
            student(**b).last_hidden_state, teacher(**b).last_hidden_state, atol=1e-8, rtol=0
        )


def test_refit_feed_forward_ridge_pulls_toward_the_students_own_weights():
    teacher = _bert()
    student = _perturbed(teacher)
    before = [layer.output.dense.weight.detach().clone() for layer in student.encoder.layer]
    P.refit_feed_forward(student, teacher, _batches(), P.Embedding(), ridge=1e9)  # no room to move
    for layer, w in zip(student.encoder.layer, before, strict=True):
        torch.testing.assert_close(layer.output.dense.weight, w, atol=1e-6, rtol=0)


def test_refit_feed_forward_after_pruning_brings_the_output_closer():
    """Heads pruned from layer 0: the attention refit, then the feed-forward refit, each bring the last
    hidden state closer to the teacher's on the calibration tokens."""
    teacher = _bert()
    batches = _batches()
    student = heads.prune(teacher, {"encoder.layer.0.attention.self": [1]})

    def error(model):
        with torch.no_grad():
            return sum(float(((model(**b.inputs).last_hidden_state - teacher(**b.inputs).last_hidden_state) ** 2
                              * b.inputs["attention_mask"][..., None]).sum()) for b in batches)  # fmt: skip

    pruned = error(student)
    P.refit(student, teacher, batches, P.Embedding(), ["encoder.layer.0.attention.self"])
    refit = error(student)
    P.refit_feed_forward(student, teacher, batches, P.Embedding())
    assert error(student) < refit < pruned


def test_refit_feed_forward_does_nothing_without_feed_forward_layers():
    torch.manual_seed(0)
    teacher = _Toy().eval()
    student = heads.prune(teacher, {"mha": [1]})
    before = {k: v.clone() for k, v in student.state_dict().items()}
    batch = P.Batch(
        {"input_ids": torch.randint(0, 30, (4, 8)), "attention_mask": torch.ones(4, 8, dtype=torch.long)}
    )
    assert P.refit_feed_forward(student, teacher, [batch], P.Embedding()) == 0
    assert all(torch.equal(v, student.state_dict()[k]) for k, v in before.items())
