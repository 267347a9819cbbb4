"""Small models with the Transformer's attention layout, for the head-tool tests (no Transformer needed).

Names follow ``multihead.Transformer``: ``encoder.layers.i.self_attn``, ``decoder.layers.i.self_attn``,
``decoder.layers.i.cross_attn``.
"""

import torch
from torch import nn

import multihead as mh


class _Layer(nn.Module):
    def __init__(self, d, h, cross, kv_heads, bias, kdim):
        super().__init__()
        self.self_attn = mh.MultiHeadAttention(d, h, kv_heads=kv_heads, bias=bias)
        if cross:
            self.cross_attn = mh.MultiHeadAttention(d, h, kv_heads=kv_heads, bias=bias, kdim=kdim, vdim=kdim)


class _Stack(nn.Module):
    def __init__(self, n, *args):
        super().__init__()
        self.layers = nn.ModuleList([_Layer(*args) for _ in range(n)])


class ToySeq2Seq(nn.Module):
    """Residual encoder/decoder made only of attention: x (B, S, kdim or d), y (B, T, d) -> (B, T, d)."""

    def __init__(self, d=16, h=4, *, kv_heads=None, bias=True, kdim=None, layers=2):
        super().__init__()
        self.encoder = _Stack(layers, d, h, False, kv_heads, bias, None)
        self.decoder = _Stack(layers, d, h, True, kv_heads, bias, kdim)
        self.to_memory = nn.Linear(d, kdim or d)

    def forward(self, x, y, *, weights=None):
        """``weights``: a dict to fill with every module's ``return_weights=True`` weights (B, H, Lq, Lk)."""

        def call(name, m, *args, **kw):
            if weights is None:
                return m(*args, **kw)
            out, weights[name] = m(*args, return_weights=True, **kw)
            return out

        for i, layer in enumerate(self.encoder.layers):
            x = x + call(f"encoder.layers.{i}.self_attn", layer.self_attn, x)
        memory = self.to_memory(x)
        for i, layer in enumerate(self.decoder.layers):
            y = y + call(f"decoder.layers.{i}.self_attn", layer.self_attn, y, causal=True)
            y = y + call(f"decoder.layers.{i}.cross_attn", layer.cross_attn, y, memory)
        return y


def toy_inputs(model, batch=3, src=5, tgt=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    p = next(model.parameters())
    d = model.encoder.layers[0].self_attn.embed_dim
    x = torch.randn(batch, src, d, generator=g).to(p.dtype)
    y = torch.randn(batch, tgt, d, generator=g).to(p.dtype)
    return x, y
