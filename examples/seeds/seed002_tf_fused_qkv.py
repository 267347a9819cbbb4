"""Seed 002 (TF MHA with one fused QKV Dense), rebuilt on multihead: batch 30 x 4 x 512, 8 heads.

The notebook projects x with one Dense(3 * 512), reshapes to (B, L, H, 3 * 64) and splits the last
axis into q, k, v: per-head interleaving, the "fused" layout (multihead.compat.weights.from_fused). Its bug,
fixed here: it reshapes the heads' output (B, H, L, 64) straight to (B, L, H * 64) without first
transposing H and L, which mixes different positions' values into one row.

Prints the notebook's shapes, step by step. Run: python examples/seeds/seed002_tf_fused_qkv.py
"""

import torch
import torch.nn.functional as F

import multihead as mh
from multihead.compat import weights
from multihead.nn import merge_heads

input_dim, d_model, num_heads, batch_size, sequence_length = 512, 512, 8, 30, 4


def main(argv=None):
    torch.manual_seed(0)
    head_dim = d_model // num_heads
    w_qkv, b_qkv = torch.randn(3 * d_model, input_dim) / input_dim**0.5, torch.zeros(3 * d_model)
    w_o, b_o = torch.randn(d_model, d_model) / d_model**0.5, torch.zeros(d_model)
    mha = weights.module_from_state(
        weights.from_fused(weights.FusedWeights(w_qkv, w_o, b_qkv, b_o), num_heads), num_heads
    )
    x = torch.randn(batch_size, sequence_length, input_dim)
    with torch.no_grad():
        print(f"x.shape: {tuple(x.shape)}")
        qkv = F.linear(x, w_qkv, b_qkv)  # the notebook's fused projection
        print(f"qkv.shape: {tuple(qkv.shape)}")
        qkv = qkv.reshape(batch_size, sequence_length, num_heads, 3 * head_dim)
        print(f"qkv.shape: {tuple(qkv.shape)}")
        qkv = qkv.permute(0, 2, 1, 3)
        print(f"qkv.shape: {tuple(qkv.shape)}")
        q, k, v = mha.project(x, x, x)  # the library's projection: the same heads, converted weights
        assert torch.allclose(torch.cat([q, k, v], -1), qkv, atol=1e-5)
        print(f"q.shape: {tuple(q.shape)}, k.shape: {tuple(k.shape)}, v.shape: {tuple(v.shape)}")
        values, attention = mh.attention(q, k, v, return_weights=True)
        print(f"values.shape: {tuple(values.shape)}, attention.shape: {tuple(attention.shape)}")
        merged = merge_heads(values)  # transpose (B, H, L, D) -> (B, L, H, D), then flatten
        print(f"values.shape: {tuple(merged.shape)}")
        out = mha.out_proj(merged)
        print(f"out.shape: {tuple(out.shape)}")
        assert torch.allclose(out, mha(x), atol=1e-5)
        wrong = values.reshape(batch_size, sequence_length, num_heads * head_dim)  # the notebook's merge
        print(f"notebook's merge without transpose differs by {float((wrong - merged).abs().max()):.3f}")
    return out


if __name__ == "__main__":
    main()
