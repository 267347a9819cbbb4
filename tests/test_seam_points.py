"""The seam's points (q, k, v, scores, pattern): what an inspector reads there and what its edits do.

The expected values are computed by hand here (projections, softmax, a mask), never by the code under test.
"""

import math
import warnings

import pytest
import torch

import multihead as mh
from multihead.nn import seam


class Points(seam.Inspector):
    """Records every point it asks for; ``edit`` maps a point to a function that replaces it."""

    def __init__(self, points, edit=None):
        self.points = frozenset(points)
        self.seen = {}
        self.edit = edit or {}

    def on_point(self, module, point, tensor):
        self.seen[point] = tensor.detach().clone()
        fn = self.edit.get(point)
        return None if fn is None else fn(tensor)


def _module(kv_heads=2):
    torch.manual_seed(0)
    return mh.MultiHeadAttention(16, 4, kv_heads=kv_heads, dtype=torch.float64).eval()


def _by_hand(m, x, valid_lens=None):
    """q, k, v heads, scores (masked -inf), pattern and heads of ``m`` on ``x`` (B, L, 16), by hand."""
    b, length, _ = x.shape
    w, bias = m.in_proj_weight, m.in_proj_bias  # rows [q (16) | k (8) | v (8)]
    q = (x @ w[:16].T + bias[:16]).view(b, length, 4, 4).transpose(1, 2)  # (B, H, L, D)
    k = (x @ w[16:24].T + bias[16:24]).view(b, length, 2, 4).transpose(1, 2)  # (B, Hkv, L, D)
    v = (x @ w[24:].T + bias[24:]).view(b, length, 2, 4).transpose(1, 2)
    kk, vv = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)  # (B, H, L, D)
    scores = q @ kk.transpose(-2, -1) / math.sqrt(4)  # (B, H, L, L)
    if valid_lens is not None:
        hidden = torch.arange(length)[None, :] >= valid_lens[:, None]  # (B, L)
        scores = scores.masked_fill(hidden[:, None, None, :], float("-inf"))
    pattern = torch.softmax(scores, -1)
    return q, k, v, scores, pattern, pattern @ vv


def test_every_point_is_what_the_attention_computes_with():
    m = _module()
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    valid = torch.tensor([5, 3])
    expected = _by_hand(m, x, valid)
    inspector = Points(seam.POINTS)
    with seam.inspecting(inspector), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        y = m(x, valid_lens=valid)
    for point, want in zip(("q", "k", "v", "scores", "pattern"), expected, strict=False):
        torch.testing.assert_close(inspector.seen[point], want, msg=point)
    torch.testing.assert_close(y, m(x, valid_lens=valid))  # reading changes nothing


@pytest.mark.parametrize("point", ["q", "k", "v", "scores", "pattern"])
def test_an_edit_propagates_exactly_as_recomputing_by_hand(point):
    m = _module()
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    q, k, v, scores, pattern, _ = _by_hand(m, x)
    if point == "q":
        q = q * 2
    elif point in ("k", "v"):
        k, v = (k * 2, v) if point == "k" else (k, v * 2)
    if point in ("q", "k"):
        scores = q @ k.repeat_interleave(2, 1).transpose(-2, -1) / 2
    if point == "scores":
        scores = scores.clone()
        scores[..., 0] = float("-inf")  # no query may see key 0 any more
    pattern = torch.softmax(scores, -1)
    if point == "pattern":
        pattern = torch.zeros_like(pattern)
        pattern[..., -1] = 1.0  # every query reads the last value only
    heads = pattern @ v.repeat_interleave(2, 1)  # (B, H, L, D)
    want = m.out_proj(heads.transpose(1, 2).reshape(2, 5, 16))
    edit = {
        "q": lambda t: t * 2,
        "k": lambda t: t * 2,
        "v": lambda t: t * 2,
        "scores": lambda t: t.index_fill(-1, torch.tensor([0]), float("-inf")),
        "pattern": lambda t: torch.zeros_like(t).index_fill(-1, torch.tensor([4]), 1.0),
    }
    with seam.inspecting(Points([point], {point: edit[point]})), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.testing.assert_close(m(x), want)


def test_scores_that_close_every_key_give_zero_rows_and_finite_gradients():
    m = _module()
    x = torch.randn(1, 3, 16, dtype=torch.float64, requires_grad=True)
    edit = {"scores": lambda t: torch.full_like(t, float("-inf"))}
    with seam.inspecting(Points(["scores"], edit)), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        y = m(x)
    torch.testing.assert_close(y, m.out_proj.bias.expand(1, 3, 16))  # every head 0: the bias alone
    y.sum().backward()
    assert torch.isfinite(x.grad).all()


def test_inspectors_see_points_outermost_first_and_edits_of_the_outer_one():
    m = _module()
    x = torch.randn(1, 4, 16, dtype=torch.float64)
    outer = Points(["q"], {"q": lambda t: t * 0})
    inner = Points(["q"])
    with seam.inspecting(outer), seam.inspecting(inner):
        m(x)
    assert outer.seen["q"].abs().sum() > 0 and inner.seen["q"].abs().sum() == 0


def test_a_wrong_shape_is_refused_by_name():
    m = _module()
    with seam.inspecting(Points(["k"], {"k": lambda t: t[:, :1]})), pytest.raises(ValueError, match="'k'"):
        m(torch.randn(1, 4, 16, dtype=torch.float64))


def test_scores_of_a_custom_attention_function_are_refused_and_q_still_works():
    m = _module()
    m.attention_fn = lambda q, k, v, **kw: mh.attention(q, k, v, **kw)
    x = torch.randn(1, 4, 16, dtype=torch.float64)
    with seam.inspecting(Points(["pattern"])), pytest.raises(ValueError, match="attention_fn"):
        m(x)
    inspector = Points(["q"])
    with seam.inspecting(inspector):
        m(x)
    assert inspector.seen["q"].shape == (1, 4, 4, 4)


def test_the_reroute_is_said_once_per_module_class_and_backend():
    class Once(mh.MultiHeadAttention):  # a class of its own: no earlier test has been told about it
        pass

    torch.manual_seed(0)
    m = Once(16, 4, dtype=torch.float64)
    x = torch.randn(1, 4, 16, dtype=torch.float64)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with seam.inspecting(Points(["pattern"])):
            m(x)
            m(x)
    assert len([w for w in caught if "explicit path" in str(w.message)]) == 1


def test_points_and_weights_may_be_asked_of_some_modules_only():
    class Only(Points):
        def __init__(self, module):
            super().__init__(["pattern"])
            self.module, self.weights = module, []

        def points_for(self, module):
            return self.points if module is self.module else frozenset()

        def weights_for(self, module):
            return module is not self.module  # the other module's weights, through return_weights

        def on_heads(self, module, heads, weights):
            self.weights.append(weights is not None)
            return heads

    first, second = _module(), _module()
    x = torch.randn(1, 4, 16, dtype=torch.float64)
    inspector = Only(first)
    with seam.inspecting(inspector), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        first(x)
        second(x)
    assert list(inspector.seen) == ["pattern"] and inspector.weights == [True, True]
    torch.testing.assert_close(inspector.seen["pattern"], _by_hand(first, x)[4])
    inspector = Only(None)
    with seam.inspecting(inspector):
        first(x)
    assert not inspector.seen and inspector.weights == [True]  # no point asked of it: its own path
