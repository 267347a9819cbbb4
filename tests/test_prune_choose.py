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


def test_fits_add_and_subtract_as_their_rows():
    x, y = _data(n=50, seed=7)
    whole, first, second = _fit(x, y, 1), _fit(x[:20], y[:20], 1), _fit(x[20:], y[20:], 1)
    for got, want in ((first + second, whole), (whole - first, second)):
        torch.testing.assert_close(got.gram, want.gram)
        torch.testing.assert_close(got.cross, want.cross)
        torch.testing.assert_close(got.y_sum, want.y_sum)
        assert got.y_squares == pytest.approx(want.y_squares, rel=1e-12) and got.rows == want.rows


def _cv_error(x, y, folds, cols, bias, ridge):
    """Fold by fold: the fit on the other folds' rows, of ``cols`` only, measured on the fold's rows; summed.
    (:class:`LeastSquares` scales the ridge by the mean diagonal over every column, so with a ridge this is
    its answer only when ``cols`` is every column.)"""
    total = 0.0
    for f, held in enumerate(folds):
        rest = torch.cat([g for i, g in enumerate(folds) if i != f])
        w, b = _fit(x[rest][:, cols], y[rest], 1).solve(ridge=ridge, bias=bias)
        total += float(((x[held][:, cols] @ w.T + (b if bias else 0) - y[held]) ** 2).sum())
    return total


@pytest.mark.parametrize("bias", [True, False])
def test_cross_validated_residual_is_each_left_out_folds_error(bias):
    x, y = _data(n=48, seed=8)
    folds = [torch.arange(f, 48, 3) for f in range(3)]
    cv = P.CrossValidated([_fit(x[i], y[i], 1) for i in folds])
    cols = torch.tensor([0, 2, 3, 5])
    assert cv.residual(cols, ridge=0.0, bias=bias) == pytest.approx(
        _cv_error(x, y, folds, cols, bias, 0.0), rel=1e-9
    )
    every = torch.arange(6)
    assert cv.residual(every, ridge=0.05, bias=bias) == pytest.approx(
        _cv_error(x, y, folds, every, bias, 0.05), rel=1e-9
    )
    assert cv.residual(cols, bias=bias) > _fit(x, y, 1).residual(cols, bias=bias)  # out of sample costs more
    assert cv.spread() == pytest.approx(_fit(x, y, 1).spread(), rel=1e-12)


def test_one_fold_is_the_in_sample_residual():
    x, y = _data(seed=9)
    cols = torch.tensor([1, 4])
    assert P.CrossValidated([_fit(x, y, 1)]).residual(cols) == pytest.approx(_fit(x, y, 1).residual(cols))
    with pytest.raises(ValueError, match="at least one fold"):
        P.CrossValidated([P.LeastSquares(6, 4)])


def _heads_module(n, weights, seed):
    """``n`` rows of 3 heads x 4 columns; the output is a noiseless linear map of the heads, head ``h``'s
    part scaled by ``weights[h]``. Returns the rows and a generator of fresh rows of the same map."""
    g = torch.Generator().manual_seed(seed)
    maps = [w * torch.randn(4, 6, generator=g, dtype=F64) for w in weights]
    w = torch.cat(maps)  # (12, 6)

    def draw(m, gen):
        x = torch.randn(m, 12, generator=gen, dtype=F64)
        return x, x @ w

    return draw(n, g), draw


def test_out_of_sample_choice_spares_a_module_whose_fit_does_not_carry_over():
    """Module ``a`` has few rows for its 13 unknowns: in sample, the other heads' columns mimic a removed
    head's part, so removing one looks cheap. Module ``b`` has many rows and one weak head. Out of sample
    the removal from ``a`` costs more than ``b``'s weak head, and that is what the cross-validated choice sees
    and the in-sample choice does not; on fresh rows its choice is the better one."""
    (xa, ya), draw_a = _heads_module(16, [1.0, 1.0, 1.0], seed=10)
    (xb, yb), draw_b = _heads_module(400, [1.0, 1.0, 0.6], seed=11)
    heads_ = {"a": 3, "b": 3}
    in_sample = {"a": _fit(xa, ya, 1), "b": _fit(xb, yb, 1)}
    deal = {k: [torch.arange(f, len(x), 4) for f in range(4)] for k, x in (("a", xa), ("b", xb))}
    data = {"a": (xa, ya), "b": (xb, yb)}
    cv = {k: P.CrossValidated([_fit(data[k][0][i], data[k][1][i], 1) for i in deal[k]]) for k in heads_}
    chose_in, chose_cv = compensable_heads(in_sample, heads_, 1), compensable_heads(cv, heads_, 1)
    assert list(chose_in) == ["a"] and chose_cv == {"b": [2]}

    def fresh_cost(module, removed):  # the refit on the module's rows, measured on 4000 fresh ones
        x, y = data[module]
        keep = torch.cat([torch.arange(h * 4, h * 4 + 4) for h in range(3) if h not in removed])
        w, b = _fit(x[:, keep], y, 1).solve()
        xf, yf = (draw_a if module == "a" else draw_b)(4000, torch.Generator().manual_seed(12))
        return float(((xf[:, keep] @ w.T + b - yf) ** 2).sum() / ((yf - yf.mean(0)) ** 2).sum())

    (name_in, hs_in), (name_cv, hs_cv) = next(iter(chose_in.items())), next(iter(chose_cv.items()))
    assert fresh_cost(name_cv, hs_cv) < fresh_cost(name_in, hs_in)


def test_output_folds_deal_the_texts_in_turn_and_add_up_to_the_whole_fit():
    torch.manual_seed(0)
    model = _Toy().double().eval()
    ids = torch.randint(0, 30, (7, 5), generator=torch.Generator().manual_seed(2))
    att = torch.ones(7, 5, dtype=torch.long)
    att[3, 3:] = 0  # text 3 (fold 0 of 3) has 3 real tokens
    batches = [P.Batch({"input_ids": ids[:4], "attention_mask": att[:4]}),
               P.Batch({"input_ids": ids[4:], "attention_mask": att[4:]})]  # fmt: skip
    parts = P.output_folds(model, batches, P.Embedding(), 3)["mha"]
    assert [p.rows for p in parts] == [5 + 3 + 5, 5 + 5, 5 + 5]  # texts (0, 3, 6), (1, 4), (2, 5)
    whole = P.output_fits(model, batches, P.Embedding())["mha"]
    torch.testing.assert_close((parts[0] + parts[1] + parts[2]).gram, whole.gram)
    torch.testing.assert_close((parts[0] + parts[1] + parts[2]).cross, whole.cross)
