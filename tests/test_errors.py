"""Every documented bad input raises a clear error that names the argument, the shapes/dtypes and a fix."""

import pytest
import torch

import multihead as mh

Q = torch.randn(2, 4, 3, 8)
K = torch.randn(2, 2, 5, 8)
V = torch.randn(2, 2, 5, 6)


def test_embed_dim_not_divisible():
    with pytest.raises(ValueError, match=r"embed_dim \(10\) must be divisible by num_heads \(4\).*head_dim="):
        mh.MultiHeadAttention(10, 4)


def test_head_dim_makes_any_embed_dim_work():
    assert mh.MultiHeadAttention(10, 4, head_dim=3)(torch.randn(1, 2, 10)).shape == (1, 2, 10)


def test_num_heads_not_divisible_by_kv_heads():
    with pytest.raises(ValueError, match=r"num_heads \(8\) must be divisible by kv_heads \(3\)"):
        mh.MultiHeadAttention(16, 8, kv_heads=3)


@pytest.mark.parametrize("bad", [0, -2, 2.5, True])
def test_non_positive_sizes(bad):
    with pytest.raises(ValueError, match="num_heads must be a positive int"):
        mh.MultiHeadAttention(16, bad)


def test_rank_mismatch():
    with pytest.raises(ValueError, match=r"k must be 4-D \(B, H, L, D\), got shape \(2, 5, 8\).*transpose"):
        mh.attention(Q, K[:, 0], V)


def test_head_dim_mismatch():
    with pytest.raises(
        ValueError, match=r"q and k must share the head dim Dk, got q \(2, 4, 3, 8\) and k \(2, 2, 5, 7\)"
    ):
        mh.attention(Q, torch.randn(2, 2, 5, 7), V)


def test_heads_not_multiple():
    with pytest.raises(ValueError, match=r"H=4 must be a multiple of key/value heads Hkv=3"):
        mh.attention(Q, torch.randn(2, 3, 5, 8), torch.randn(2, 3, 5, 6))


def test_batch_mismatch():
    with pytest.raises(ValueError, match="share the batch size B, got 2, 1, 1"):
        mh.attention(Q, K[:1], V[:1])


def test_kv_length_mismatch():
    with pytest.raises(
        ValueError, match=r"must agree on Hkv and Lk, got k \(2, 2, 5, 8\) and v \(2, 2, 4, 6\)"
    ):
        mh.attention(Q, K, V[:, :, :4])


def test_qkv_dtype_mismatch():
    with pytest.raises(
        TypeError, match=r"share one dtype, got q torch.float32, k torch.float64.*k.to\(q.dtype\)"
    ):
        mh.attention(Q, K.double(), V)


def test_integer_inputs():
    with pytest.raises(
        TypeError, match=r"q must be a floating-point tensor, got dtype torch.int64; use q.float\(\)"
    ):
        mh.attention(Q.long(), K, V)


def test_mask_not_broadcastable():
    with pytest.raises(
        ValueError, match=r"mask of shape \(3, 4\) does not broadcast to \(B, H, Lq, Lk\) = \(2, 4, 3, 5\)"
    ):
        mh.attention(Q, K, V, mask=torch.ones(3, 4, dtype=torch.bool))


def test_bias_not_broadcastable():
    with pytest.raises(
        ValueError, match=r"bias of shape \(3, 3, 5\) does not broadcast to \(B, H, Lq, Lk\) = \(2, 4, 3, 5\)"
    ):
        mh.attention(Q, K, V, bias=torch.zeros(3, 3, 5))


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int32, torch.int64])
def test_integer_mask_says_how_to_convert(dtype):
    with pytest.raises(
        ValueError, match=r"mask must be a bool tensor .* got dtype .*mask.bool\(\).*mask == 0"
    ):
        mh.attention(Q, K, V, mask=torch.ones(3, 5, dtype=dtype))


def test_float_mask_points_to_bias():
    with pytest.raises(ValueError, match="pass it as `bias=`"):
        mh.attention(Q, K, V, mask=torch.zeros(3, 5))


def test_integer_bias():
    with pytest.raises(TypeError, match="bias must be a floating-point tensor.*bool tensor as `mask=`"):
        mh.attention(Q, K, V, bias=torch.zeros(3, 5, dtype=torch.long))


@pytest.mark.parametrize(
    ("valid_lens", "error", "message"),
    [
        (torch.tensor([1, 2, 3]), ValueError, r"valid_lens must have shape \(2,\) or \(2, 3\), got \(3,\)"),
        (
            torch.ones(2, 4, dtype=torch.long),
            ValueError,
            r"valid_lens must have shape \(2,\) or \(2, 3\), got \(2, 4\)",
        ),
        (torch.ones(2, 3, 1, dtype=torch.long), ValueError, r"got \(2, 3, 1\)"),
        (
            torch.tensor([1.0, 2.0]),
            TypeError,
            r"valid_lens must be an integer tensor, got dtype torch.float32.*long\(\)",
        ),
        (torch.tensor([2, -1]), ValueError, r"valid_lens must be >= 0, got minimum -1"),
        ([1, 2], TypeError, r"wrap it with torch.tensor"),
    ],
)
def test_bad_valid_lens(valid_lens, error, message):
    with pytest.raises(error, match=message):
        mh.attention(Q, K, V, valid_lens=valid_lens)


@pytest.mark.parametrize("p", [-0.1, 1.0, 1.5, "0.1"])
def test_dropout_out_of_range(p):
    with pytest.raises(ValueError, match=r"dropout must be a probability in \[0, 1\)"):
        mh.attention(Q, K, V, dropout=p)
    with pytest.raises(ValueError, match=r"dropout must be a probability in \[0, 1\)"):
        mh.MultiHeadAttention(8, 2, dropout=p)


def test_bad_scale():
    with pytest.raises(ValueError, match="scale must be a finite number"):
        mh.attention(Q, K, V, scale=float("nan"))


def test_module_input_dtype_mismatch():
    m = mh.MultiHeadAttention(8, 2)
    with pytest.raises(
        TypeError,
        match=r"query has dtype torch.float64 but the module's parameters are torch.float32.*module.to",
    ):
        m(torch.randn(1, 3, 8, dtype=torch.float64))


def test_module_wrong_feature_size():
    m = mh.MultiHeadAttention(8, 2, kdim=5)
    with pytest.raises(ValueError, match=r"query must have shape \(B, L, 8\) .*embed_dim.*got \(1, 3, 7\)"):
        m(torch.randn(1, 3, 7), torch.randn(1, 2, 5))
    with pytest.raises(ValueError, match=r"key must have shape \(B, L, 5\) .*kdim.*got \(1, 2, 8\)"):
        m(torch.randn(1, 3, 8), torch.randn(1, 2, 8), torch.randn(1, 2, 8))


def test_module_key_value_length_mismatch():
    m = mh.MultiHeadAttention(8, 2)
    with pytest.raises(
        ValueError, match=r"must share B, and key/value Lk.*key \(1, 4, 8\), value \(1, 5, 8\)"
    ):
        m(torch.randn(1, 3, 8), torch.randn(1, 4, 8), torch.randn(1, 5, 8))


def test_module_mask_error_names_shapes():
    m = mh.MultiHeadAttention(8, 2)
    with pytest.raises(
        ValueError, match=r"mask of shape \(2, 3, 3\) does not broadcast to \(B, H, Lq, Lk\) = \(1, 2, 4, 4\)"
    ):
        m(torch.randn(1, 4, 8), mask=torch.ones(2, 3, 3, dtype=torch.bool))
