"""Mask builders against hand-written 0/1 pictures, and the normalisation routine."""

import pytest
import torch

from multihead import masks


def picture(rows):
    """'1 1 0' strings -> bool tensor."""
    return torch.tensor([[c == "1" for c in r.split()] for r in rows])


def test_causal_square():
    assert torch.equal(masks.causal(3), picture(["1 0 0", "1 1 0", "1 1 1"]))


def test_causal_bottom_right_short_queries():
    assert torch.equal(masks.causal(2, 5), picture(["1 1 1 1 0", "1 1 1 1 1"]))


def test_causal_more_queries_than_keys_has_dead_rows():
    assert torch.equal(masks.causal(4, 2), picture(["0 0", "0 0", "1 0", "1 1"]))


def test_sliding_window_causal():
    expected = picture(["1 0 0 0 0", "1 1 0 0 0", "0 1 1 0 0", "0 0 1 1 0", "0 0 0 1 1"])
    assert torch.equal(masks.sliding_window(5, window=2), expected)


def test_sliding_window_symmetric():
    expected = picture(["1 1 0 0", "1 1 1 0", "0 1 1 1", "0 0 1 1"])
    assert torch.equal(masks.sliding_window(4, window=2, causal=False), expected)


def test_sliding_window_bottom_right():
    assert torch.equal(masks.sliding_window(2, 5, window=3), picture(["0 1 1 1 0", "0 0 1 1 1"]))


def test_sliding_window_rejects_bad_window():
    with pytest.raises(ValueError, match="window must be a positive int"):
        masks.sliding_window(4, window=0)


def test_from_valid_lens_1d():
    m = masks.from_valid_lens(torch.tensor([3, 1]), 4)
    assert m.shape == (2, 1, 1, 4)
    assert torch.equal(m[:, 0, 0], picture(["1 1 1 0", "1 0 0 0"]))


def test_from_valid_lens_2d():
    m = masks.from_valid_lens(torch.tensor([[1, 2], [0, 3]]), 3, lq=2)
    assert m.shape == (2, 1, 2, 3)
    assert torch.equal(m[0, 0], picture(["1 0 0", "1 1 0"]))
    assert torch.equal(m[1, 0], picture(["0 0 0", "1 1 1"]))


def test_key_padding_and_tokens():
    tokens = torch.tensor([[5, 6, 0], [7, 0, 0]])
    m = masks.key_padding_from_tokens(tokens, pad_id=0)
    assert m.shape == (2, 1, 1, 3)
    assert torch.equal(m[:, 0, 0], picture(["1 1 0", "1 0 0"]))
    with pytest.raises(ValueError, match=r"\(B, Lk\) bool"):
        masks.key_padding(tokens)


def test_combine_is_and_with_broadcast():
    got = masks.combine(masks.causal(3), None, masks.from_valid_lens(torch.tensor([2]), 3))
    assert got.shape == (1, 1, 3, 3)
    assert torch.equal(got[0, 0], picture(["1 0 0", "1 1 0", "1 1 0"]))
    assert masks.combine(None, None) is None
    with pytest.raises(ValueError, match="bool"):
        masks.combine(torch.ones(2, 2))


def test_to_bias():
    b = masks.to_bias(picture(["1 0", "0 1"]))
    assert b.dtype == torch.float32
    assert b.tolist() == [[0.0, float("-inf")], [float("-inf"), 0.0]]


def test_normalize_keeps_native_causal_only_when_alone_and_square():
    target = (1, 2, 4, 4)
    assert masks.normalize(target, causal=True).causal is True
    n = masks.normalize((1, 2, 3, 4), causal=True)
    assert n.causal is False and torch.equal(n.mask[0, 0], masks.causal(3, 4))
    n = masks.normalize(target, causal=True, valid_lens=torch.tensor([2]))
    assert n.causal is False and torch.equal(
        n.mask[0, 0], picture(["1 0 0 0", "1 1 0 0", "1 1 0 0", "1 1 0 0"])
    )


def test_normalize_reopens_dead_rows_and_reports_them():
    n = masks.normalize((2, 1, 2, 3), valid_lens=torch.tensor([0, 2]))
    assert n.row_ok is not None
    assert n.row_ok.flatten().tolist() == [False, True]
    assert n.mask[0].all()  # re-opened: kernels never see an all-masked row
    assert torch.equal(n.mask[1, 0, 0], torch.tensor([True, True, False]))


def test_normalize_dead_row_from_bias_is_made_finite():
    bias = torch.tensor([[0.0, 1.0], [float("-inf"), float("-inf")]])
    n = masks.normalize((1, 1, 2, 2), bias=bias)
    assert n.row_ok.flatten().tolist() == [True, False]
    assert torch.isfinite(n.bias[0, 0, 1]).all()
    assert torch.equal(n.bias[0, 0, 0], bias[0])


def test_normalize_no_dead_rows_has_no_row_ok():
    n = masks.normalize((2, 1, 3, 3), valid_lens=torch.tensor([1, 3]))
    assert n.row_ok is None
