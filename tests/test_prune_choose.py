"""``multihead prune``'s head choice by refit compensability: the residual the least-squares refit leaves
(:meth:`LeastSquares.residual`), the outputs' spread, and the greedy choice across modules, on toy maps
whose exact answer is known."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from test_prune_cmd import _Toy  # noqa: E402  (tests/test_prune_cmd.py: embeddings -> one attention layer)

from multihead import heads  # noqa: E402
from multihead.commands import prune as P  # noqa: E402
from multihead.commands.prune import choose_compensable, compensable_heads  # noqa: E402

F64 = torch.float64


def _data(n=60, d_in=6, d_out=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d_in, generator=g, dtype=F64)
    y = x @ torch.randn(d_in, d_out, generator=g, dtype=F64) + torch.randn(n, d_out, generator=g, dtype=F64)
    return x, y


def _fit(x, y, batches=3):
    fit = P.LeastSquares(x.shape[1], y.shape[1])
    for xs, ys in zip(x.chunk(batches), y.chunk(batches), strict=True):
        fit.add(xs, ys)
    return fit


@pytest.mark.parametrize("bias", [True, False])
def test_residual_is_the_refits_actual_error_on_a_column_subset(bias):
    x, y = _data()
    cols = torch.tensor([0, 1, 4])
    w, b = _fit(x[:, cols], y).solve(ridge=0.0, bias=bias)  # a fit that only ever saw those columns
    pred = x[:, cols] @ w.T + (b if bias else 0)
    expected = float(((pred - y) ** 2).sum())
    assert _fit(x, y).residual(cols, ridge=0.0, bias=bias) == pytest.approx(expected, rel=1e-9)


@pytest.mark.parametrize("ridge", [0.0, 1e-3, 0.5])
def test_residual_of_every_column_is_the_error_of_solve(ridge):
    """With the ridge too: the residual is the error of exactly the weights :meth:`solve` returns."""
    x, y = _data(seed=1)
    fit = _fit(x, y)
    w, b = fit.solve(ridge=ridge)
    expected = float(((x @ w.T + b - y) ** 2).sum())
    assert fit.residual(torch.arange(6), ridge=ridge) == pytest.approx(expected, rel=1e-9)


def test_spread_is_the_energy_about_the_mean():
    x, y = _data(seed=2)
    assert _fit(x, y).spread() == pytest.approx(float(((y - y.mean(0)) ** 2).sum()), rel=1e-12)


def _module(redundant: bool, seed: int, scale: float = 1.0, heads_=3, dv=2, n=80):
    """A module's projection data: ``heads_`` heads of ``dv`` columns. With ``redundant``, the last head's
    columns are a rank-1 linear function of head 0's (so the refit can make up for it exactly, while
    head 0 cannot be rebuilt from it)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, heads_ * dv, generator=g, dtype=F64)
    if redundant:
        x[:, -dv:] = x[:, :dv] @ torch.tensor([[2.0, -1.0], [0.0, 0.0]], dtype=F64)  # rank 1
    y = scale * (x @ torch.randn(heads_ * dv, 5, generator=g, dtype=F64) + 0.3)
    return _fit(x, y)


def test_the_head_the_refit_can_rebuild_goes_first():
    fits = {"a": _module(False, 0), "b": _module(True, 1)}
    assert compensable_heads(fits, {"a": 3, "b": 3}, 1) == {"b": [2]}
    assert fits["b"].residual(torch.arange(4), ridge=0.0) == pytest.approx(0.0, abs=1e-9 * fits["b"].spread())


def test_modules_compare_on_one_scale():
    """Scaling one module's outputs (its spread with them) changes no choice."""
    plain = {"a": _module(False, 3), "b": _module(False, 4)}
    scaled = {"a": _module(False, 3, scale=1e3), "b": _module(False, 4)}
    for n in (1, 2, 3):
        assert compensable_heads(plain, {"a": 3, "b": 3}, n) == compensable_heads(scaled, {"a": 3, "b": 3}, n)


def test_no_module_is_emptied():
    fits = {"a": _module(False, 5), "b": _module(True, 6)}
    removed = compensable_heads(fits, {"a": 3, "b": 3}, 4)
    assert sorted(len(v) for v in removed.values()) == [2, 2]
    with pytest.raises(ValueError, match="down to one head"):
        compensable_heads(fits, {"a": 3, "b": 3}, 5)


def test_choose_compensable_prunes_a_duplicated_head_and_the_refit_makes_it_exact():
    """Heads 0 and 2 of the toy layer are identical: either can go with nothing lost, so that is what the
    choice removes, and after the refit the pruned model equals the original."""
    torch.manual_seed(0)
    teacher = _Toy().double().eval()
    d = 4
    with torch.no_grad():
        w, b = teacher.mha.in_proj_weight, teacher.mha.in_proj_bias  # rows [q | k | v], each 4 heads x 4
        for part in range(3):
            rows0, rows2 = slice(part * 16, part * 16 + d), slice(part * 16 + 2 * d, part * 16 + 3 * d)
            w[rows2], b[rows2] = w[rows0], b[rows0]
    ids = torch.randint(0, 30, (8, 9), generator=torch.Generator().manual_seed(1))
    att = torch.ones(8, 9, dtype=torch.long)
    batches = [P.Batch({"input_ids": ids[:4], "attention_mask": att[:4]}),
               P.Batch({"input_ids": ids[4:], "attention_mask": att[4:]})]  # fmt: skip
    student, removed = choose_compensable(teacher, batches, P.Embedding(), 1)
    assert removed["mha"] in ([0], [2]) and heads.head_counts(student) == {"mha": 3}
    P.refit(student, teacher, batches, P.Embedding(), ["mha"], ridge=0.0)
    with torch.no_grad():
        torch.testing.assert_close(student(ids, att), teacher(ids, att), atol=1e-8, rtol=0)
