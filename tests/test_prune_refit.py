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


def _perturbed_both(teacher):
    """The teacher with noise added to every layer's attention output projection and feed-forward output
    projection (weights and biases): what :func:`P.refit_layers` with no ridge must undo exactly."""
    student = _perturbed(teacher)
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for layer in student.encoder.layer:
            for p in layer.attention.output.dense.parameters():
                p += 0.3 * torch.randn(p.shape, generator=g, dtype=torch.float64)
    return student


def test_refit_layers_interleaved_restores_every_projection_exactly():
    """Layer 0's attention output projection sees the teacher's inputs, so its exact fit is the teacher's;
    then layer 0's feed-forward projection, then layer 1's: interleaved, each fit sees the teacher's inputs."""
    teacher = _bert()
    student = _perturbed_both(teacher)
    done = P.refit_layers(student, teacher, _batches(), P.Embedding(), ridge=0.0, feed_forward_ridge=0.0)
    assert done == 4  # modules=None: every attention module's output projection, and both feed-forward ones
    for s, t in zip(student.encoder.layer, teacher.encoder.layer, strict=True):
        for proj in ("attention.output.dense", "output.dense"):
            for name in ("weight", "bias"):
                got, want = (
                    s.get_submodule(proj).get_parameter(name),
                    t.get_submodule(proj).get_parameter(name),
                )
                torch.testing.assert_close(got, want, atol=1e-8, rtol=0)


def test_refit_then_feed_forward_in_two_passes_is_not_exact():
    """The same perturbed student refit in two passes (every attention projection, then every feed-forward
    one): layer 1's attention fit sees layer 0's still-perturbed feed-forward output, so it is not the
    teacher's: what interleaving fixes."""
    teacher = _bert()
    student = _perturbed_both(teacher)
    modules = list(heads.head_counts(teacher))
    P.refit(student, teacher, _batches(), P.Embedding(), modules, ridge=0.0)
    P.refit_feed_forward(student, teacher, _batches(), P.Embedding(), ridge=0.0)
    got = student.encoder.layer[1].attention.output.dense.weight.detach()
    want = teacher.encoder.layer[1].attention.output.dense.weight.detach()
    assert float((got - want).abs().max()) > 1e-3


def test_crops_keep_the_ends_around_a_contiguous_span():
    ids = [list(range(100, 100 + n)) for n in (3, 4, 12, 30)]  # 3: one token between the ends, left out
    out = P.crops(ids, seed=0)
    assert out == P.crops(ids, seed=0) and out != P.crops(ids, seed=1)  # seeded
    assert len(out) == 3
    two = P.crops(ids, seed=0, copies=2)
    assert two[:3] == out and len(two) == 6 and two[3:] != out  # a second, different crop of each
    for row, crop in zip(ids[1:] * 2, two, strict=True):
        inner, span = row[1:-1], crop[1:-1]
        assert (crop[0], crop[-1]) == (row[0], row[-1])
        assert max(2, int(0.5 * len(inner))) <= len(span) <= max(2, int(0.9 * len(inner)))
        start = inner.index(span[0])
        assert inner[start : start + len(span)] == span  # contiguous, in order
