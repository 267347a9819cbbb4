"""Inputs shared by the backend tests: q/k/v and the keyword arguments of each mask kind.

Dimensions: B batch, H heads, Hkv kv heads, Lq/Lk lengths, Dk/Dv head dims.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import multihead as mh

MODERN_KINDS = ["segments", "window_fn", "alibi_fn", "softcap+sinks"]


def make_qkv(b, h, hkv, lq, lk, dk, dv, dtype=torch.float32, seed=0, requires_grad=False):
    """q (B, H, Lq, Dk), k (B, Hkv, Lk, Dk), v (B, Hkv, Lk, Dv), drawn in float64 and cast to ``dtype``."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, lq, dk, generator=g, dtype=torch.float64).to(dtype)
    k = torch.randn(b, hkv, lk, dk, generator=g, dtype=torch.float64).to(dtype)
    v = torch.randn(b, hkv, lk, dv, generator=g, dtype=torch.float64).to(dtype)
    if requires_grad:
        for t in (q, k, v):
            t.requires_grad_(True)
    return q, k, v


def mask_kwargs(kind, b, h, lq, lk, seed=1, bias_dtype=torch.float32):
    """Attention keywords for one mask kind, with a few fully masked rows where the kind allows.

    The kinds of issue 21 (``MODERN_KINDS``): packed ``segments`` (padding ids sorted first, so some
    queries are padding), a ``window_fn`` mask function, an ``alibi_fn`` bias function (a plain
    function, not a BiasFunction) and ``softcap+sinks``."""
    g = torch.Generator().manual_seed(seed)
    if kind == "none":
        return {}
    if kind == "causal":
        return {"causal": True}
    if kind == "mask":
        return {"mask": torch.rand(b, 1, lq, lk, generator=g) > 0.3}
    if kind == "bias":
        return {"bias": torch.randn(h, lq, lk, generator=g, dtype=bias_dtype)}
    if kind == "valid_lens":  # the second batch row has no valid key: dead rows
        return {"valid_lens": torch.tensor([max(1, lk - 2), 0][:b])}
    if kind == "valid_lens_1d":
        return {"valid_lens": torch.randint(0, lk + 1, (b,), generator=g)}
    if kind == "valid_lens_2d":
        return {"valid_lens": torch.randint(0, lk + 1, (b, lq), generator=g)}
    if kind == "window+causal":
        return {"mask": mh.masks.sliding_window(lq, lk, window=3), "causal": True}
    if kind == "segments":  # packed rows, queries at the end (bottom right), causal within each sequence
        ids = torch.sort(torch.randint(-1, 3, (b, max(lq, lk)), generator=g), dim=1).values  # (B, L)
        return {"segment_ids": (ids[:, ids.shape[1] - lq :], ids[:, ids.shape[1] - lk :]), "causal": True}
    if kind == "window_fn":
        return {"mask": mh.masks.sliding_window_fn(3, lq=lq, lk=lk), "causal": True}
    if kind == "alibi_fn":
        return {"bias": mh.masks.alibi_fn(h, lq=lq, lk=lk).fn, "valid_lens": torch.tensor([lk, 1][:b])}
    if kind == "softcap+sinks":
        return {"softcap": 4.0, "sinks": torch.randn(h, generator=g, dtype=bias_dtype), "causal": True}
    if kind == "all":
        return {
            "mask": torch.rand(lq, lk, generator=g) > 0.2,
            "bias": torch.randn(b, h, lq, lk, generator=g),
            "valid_lens": torch.randint(1, lk + 1, (b,), generator=g),
            "causal": True,
        }
    raise AssertionError(kind)


class LargestTensor(TorchDispatchMode):
    """Records the largest number of elements of any tensor an op creates (``with LargestTensor() as seen``)."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out
