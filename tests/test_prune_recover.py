"""``multihead prune``'s recovery (:func:`multihead.commands.prune.recover`): a learning rate whose steps
never improve the validation quality leaves the starting weights, and the next one is tried from them."""

from __future__ import annotations

import copy

import pytest
import torch

T = pytest.importorskip("transformers")

from test_prune_refit import _batches, _bert  # noqa: E402  (a tiny float64 BERT and its batches)

from multihead.commands import prune as P  # noqa: E402


def _state(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _run(qualities, lrs):
    """Recover a perturbed copy of the tiny BERT for 4 steps (a check every 2) with a validation that
    returns ``qualities`` in turn; (result, starting weights, the weights each check saw, final weights)."""
    teacher = _bert()
    student = copy.deepcopy(teacher)
    with torch.no_grad():
        for p in student.encoder.parameters():
            p += 0.05 * torch.randn(
                p.shape, generator=torch.Generator().manual_seed(p.numel()), dtype=p.dtype
            )
    start, seen, values = _state(student), [], iter(qualities)

    def validate(model):
        seen.append(_state(model))
        return next(values)

    rec = P.recover(student, teacher, _batches(), P.Embedding(), 4, lrs=lrs, seed=0, validate=validate,
                    eval_every=2, patience=2)  # fmt: skip
    return rec, start, seen, _state(student)


def _same(a, b):
    return all(torch.equal(a[k], b[k]) for k in a)


def test_a_learning_rate_that_helps_is_the_only_one_tried():
    rec, start, seen, final = _run([1.0, 2.0, 1.5], (1e-3, 1e-4))
    assert rec.lrs == [1e-3] and rec.kept_step == 2 and len(rec.losses) == 4
    assert rec.checks == [(0, 1.0), (2, 2.0), (4, 1.5)]
    assert _same(final, seen[1]) and not _same(final, start)  # the weights of the best check, step 2


def test_a_learning_rate_that_never_helps_is_undone_and_the_next_tried_from_the_start():
    # try 1: checks at 0, 2, 4 never beat the start (stops after 2 checks); try 2 improves at step 4
    rec, start, seen, final = _run([1.0, 0.5, 0.9, 1.0, 0.8, 1.2], (1e-3, 1e-4))
    assert rec.lrs == [1e-3, 1e-4] and rec.kept_step == 4 and len(rec.losses) == 8
    assert rec.checks == [(0, 1.0), (2, 0.8), (4, 1.2)]  # the last try's checks
    assert _same(seen[3], start)  # the second try starts from the starting weights, not try 1's last
    assert _same(final, seen[5]) and not _same(final, start)


def test_when_no_learning_rate_helps_the_starting_weights_stay():
    rec, start, _, final = _run([1.0, 0.5, 0.9, 1.0, 0.8, 0.7], (1e-3, 1e-4))
    assert rec.lrs == [1e-3, 1e-4] and rec.kept_step == 0 and len(rec.losses) == 8
    assert _same(final, start)


def test_recovery_starts_lower_when_fewer_than_half_the_heads_go():
    """At --heads 0.25 a try at 5e-5 never kept a step (9 of 9 runs); 1e-5 alone is tried there."""
    assert P.recovery_lrs(18, 72) == P.FEW_PRUNED_LRS == (1e-5,)
    assert P.recovery_lrs(36, 72) == P.recovery_lrs(40, 72) == P.RECOVERY_LRS == (5e-5, 1e-5)
    assert P.Options("m", "d", "0.25", "o").lrs is None  # chosen per run unless given
