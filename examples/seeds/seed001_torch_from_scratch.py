"""Seed 001 (PyTorch MHA from scratch), rebuilt on multihead: 8 heads, d_model 512, batch 2 x 5.

The notebook keeps one ``nn.Linear(512, 64)`` per head for each of Q, K and V: the "per_head" layout,
converted with multihead.compat.weights.from_per_head. Its bugs, fixed here: ``torch.cat([head_outputs], -1)``
wraps the list in a list (a TypeError); ``Attention`` builds a LayerNorm it never uses and ignores its
mask (``if self.mask: pass`` leaves the weights None); ``TransformerEncoderLayer`` is not an nn.Module
(so its weights are invisible to optimizers and ``.to()``), calls ``MultiHeadAttention()`` without
arguments, ``F.layer_norm`` without a shape, and has no ReLU between its two feed-forward Linears.

Run: python examples/seeds/seed001_torch_from_scratch.py
"""

import torch
from torch import nn

import multihead as mh
from multihead.compat import weights

h, d_model, seq_len = 8, 512, 5


class EncoderLayer(nn.Module):
    """The notebook's encoder layer, working: post-norm residual blocks around attention and a ReLU FFN."""

    def __init__(self, h, d_model, d_ff=2048):
        super().__init__()
        self.mha = mh.MultiHeadAttention(d_model, h)
        self.norm1, self.norm2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.feed_forward = nn.Sequential(nn.Linear(d_model, d_ff), nn.ReLU(), nn.Linear(d_ff, d_model))

    def forward(self, x, valid_lens=None):
        x = self.norm1(x + self.mha(x, valid_lens=valid_lens))  # (B, L, d_model)
        return self.norm2(x + self.feed_forward(x))  # (B, L, d_model)


def main(argv=None):
    torch.manual_seed(0)
    wqs, wks, wvs = ([nn.Linear(d_model, d_model // h) for _ in range(h)] for _ in range(3))
    inputs = torch.rand((2, seq_len, d_model))
    with torch.no_grad():
        for wq, wv, wk in zip(wqs, wks, wvs):
            print(wq(inputs).size(), wv(inputs).size(), wk(inputs).size())

        wo = nn.Linear(d_model, d_model)
        per_head = weights.PerHeadWeights(
            [m.weight for m in wqs], [m.weight for m in wks], [m.weight for m in wvs], wo.weight,
            [m.bias for m in wqs], [m.bias for m in wks], [m.bias for m in wvs], wo.bias,
        )  # fmt: skip
        mha = weights.module_from_state(weights.from_per_head(per_head), num_heads=h)
        q, kv = inputs, torch.rand((2, 7, d_model))
        print("MultiHeadAttention(q, kv):", mha(q, kv).size())
        print("with valid_lens [7, 3]:", mha(q, kv, valid_lens=torch.tensor([7, 3])).size())

    layer = EncoderLayer(h, d_model)
    out = layer(inputs)
    print("EncoderLayer:", out.size(), "parameters:", sum(p.numel() for p in layer.parameters()))
    return out


if __name__ == "__main__":
    main()
