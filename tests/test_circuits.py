"""Gradients at the lens's points, attribution patching, edge attribution and faithfulness on our modules,
Transformer stacks and converted torch models.

Expected values come from torch.autograd on computations written out by hand, from exact patching
(:func:`multihead.lens.patch_heads`, interventions made by hand) or from finite differences, never from the
functions under test.
"""

import math

import pytest
import torch

import multihead as mh
from multihead import lens

pytestmark = pytest.mark.filterwarnings("ignore:multihead. calls of")

F64 = torch.float64


def _mha(kv_heads=2):
    torch.manual_seed(0)
    return mh.MultiHeadAttention(16, 4, kv_heads=kv_heads, dtype=F64).eval()


def _by_hand(m, q, k, v, causal):
    """scores, pattern, z, y of our 16-wide, 4-head module from q (B, 4, L, 4), k and v (B, 2, L, 4)."""
    rep = m.num_heads // m.kv_heads
    scores = q @ k.repeat_interleave(rep, 1).transpose(-2, -1) / math.sqrt(q.shape[-1])
    if causal:
        n = q.shape[2]
        scores = scores.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
    pattern = scores.softmax(-1)
    z = pattern @ v.repeat_interleave(rep, 1)  # (B, H, L, D)
    w = m.out_proj.weight.view(16, 4, 4)  # (E, H, D)
    result = torch.einsum("bhld,ehd->bhle", z, w)
    return scores, pattern, z, result, result.sum(1) + m.out_proj.bias


@pytest.mark.parametrize("causal", [False, True])
def test_grad_at_every_point_equals_autograd_on_the_computation_by_hand(causal):
    m = _mha()
    x = torch.randn(2, 5, 16, dtype=F64)
    u = torch.randn(2, 5, 16, dtype=F64)
    with lens.cache(m, points=lens.POINTS, grads=True) as c:
        y = m(x, causal=causal)
        (y * u).sum().backward()
    q, k, v = (c["", p].clone().requires_grad_() for p in "qkv")
    scores, pattern, z, result, y2 = _by_hand(m, q, k, v, causal)
    torch.testing.assert_close(y2, y.detach())
    for t in (scores, pattern, z, result):
        t.retain_grad()
    (y2 * u).sum().backward()
    want = dict(q=q.grad, k=k.grad, v=v.grad, scores=scores.grad, pattern=pattern.grad, z=z.grad)
    want["result"] = result.grad
    for point, g in want.items():
        got = c.grad("", point)
        assert got.shape == c["", point].shape, point
        torch.testing.assert_close(got.nan_to_num(), g.nan_to_num(), msg=point)


def test_grad_refused_without_grads_or_backward():
    m = _mha()
    x = torch.randn(1, 3, 16, dtype=F64)
    with lens.cache(m, points="z") as c:
        m(x)
    with pytest.raises(ValueError, match="grads=True"):
        c.grad("", "z")
    with lens.cache(m, points="z", grads=True) as c:
        m(x)
    with pytest.raises(ValueError, match="no backward pass"):
        c.grad("", "z")
    with pytest.raises(KeyError, match="nothing cached"):
        c.grad("", "q")
    with torch.no_grad(), lens.cache(m, points="z", grads=True) as c:
        m(x)
    with pytest.raises(ValueError, match="no backward pass"):
        c.grad("", "z")
