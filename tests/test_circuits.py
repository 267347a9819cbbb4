"""Gradients at the lens's points, attribution patching, edge attribution and faithfulness on our modules,
Transformer stacks and converted torch models.

Expected values come from torch.autograd on computations written out by hand, from exact patching
(:func:`multihead.lens.patch_heads`, interventions made by hand) or from finite differences, never from the
functions under test.
"""

import math

import pytest
import torch
from torch import nn

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


# ------------------------------------------------------------------------------------------------
# Attribution patching
# ------------------------------------------------------------------------------------------------

V = 11


class TinyLM(nn.Module):
    """Token ids (B, L) -> logits (B, L, V): an embedding, a pre- or post-norm encoder stack (causal, rotary,
    GQA) and an unembedding, in float64."""

    def __init__(self, norm_first=True, kv_heads=2, layers=2, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(V, 16, dtype=F64)
        self.encoder = mh.TransformerEncoder(
            16,
            4,
            24,
            num_layers=layers,
            dropout=0.0,
            norm_first=norm_first,
            kv_heads=kv_heads,
            rotary=True,
            dtype=F64,
        )
        self.unembed = nn.Linear(16, V, dtype=F64)
        self.eval()

    def forward(self, ids):
        return self.unembed(self.encoder(self.embed(ids), causal=True))


def _ids(seed, b=3, n=6):
    return torch.randint(V, (b, n), generator=torch.Generator().manual_seed(seed))


def _logit_diff(out):
    return out[:, -1, 1] - out[:, -1, 2]  # (B,)


def _linear_metric(u):
    return lambda y: (y * u).sum((1, 2))  # (B,)


@pytest.mark.parametrize("point", ["z", "result"])
@pytest.mark.parametrize("per_position", [False, True])
def test_attribution_patch_is_exact_where_the_metric_is_linear_in_the_point(point, per_position):
    m = _mha()
    clean, corrupted = torch.randn(3, 5, 16, dtype=F64), torch.randn(3, 5, 16, dtype=F64)
    metric = _linear_metric(torch.randn(3, 5, 16, dtype=F64))
    kw = dict(point=point, per_position=per_position)
    want = lens.patch_heads(m, clean, corrupted, metric, **kw)
    got = lens.attribution_patch(m, clean, corrupted, metric, **kw)
    assert got.shape == want.shape == ((1, 4, 5) if per_position else (1, 4))
    torch.testing.assert_close(got, want.to(got.dtype), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("point", lens.POINTS)
def test_attribution_patch_approaches_patching_for_small_differences(point):
    torch.manual_seed(1)
    stack = mh.TransformerEncoder(
        16, 4, 24, num_layers=2, dropout=0.0, norm_first=True, kv_heads=2, dtype=F64
    )
    stack.eval()
    clean = torch.randn(2, 5, 16, dtype=F64)
    metric = _linear_metric(torch.randn(2, 5, 16, dtype=F64))
    errors = []
    for scale in (1e-1, 1e-2):
        corrupted = clean + scale * torch.randn(
            2, 5, 16, dtype=F64, generator=torch.Generator().manual_seed(2)
        )
        kw = dict(point=point, per_position=True)
        base = float(metric(stack(corrupted)).mean())
        want = lens.patch_heads(stack, clean, corrupted, metric, **kw).double() - base
        got = lens.attribution_patch(stack, clean, corrupted, metric, **kw).double() - base
        assert got.shape == want.shape
        errors.append(float((got - want).abs().max()) / float(want.abs().max()))
    # second order: the relative error shrinks with the difference (patch_heads answers in float32)
    assert errors[0] < 0.5 and errors[1] < errors[0] / 4, (point, errors)


def test_integrated_gradients_converge_to_patching_where_each_head_has_its_own_straight_path():
    # Only the query input differs: each head's q moves on a straight line, and with a metric linear in the
    # output each head's share of the metric depends on its own q alone, so integrated gradients of a q head
    # converge (left Riemann sum, error ~ 1/m) to the exact patch of that head; one step does not.
    m = _mha()
    key = torch.randn(2, 5, 16, dtype=F64)
    clean, corrupted = (
        (torch.randn(2, 5, 16, dtype=F64), key, key),
        (torch.randn(2, 5, 16, dtype=F64), key, key),
    )
    metric = _linear_metric(torch.randn(2, 5, 16, dtype=F64))
    want = lens.patch_heads(m, clean, corrupted, metric, point="q").double()
    errors = [
        float((lens.attribution_patch(m, clean, corrupted, metric, point="q", ig_steps=s) - want).abs().max())
        for s in (1, 8, 64)
    ]
    assert errors[0] > 1e-3 and errors[2] < errors[1] < errors[0] and errors[2] < errors[0] / 20, errors


def test_attribution_patch_refuses_bad_arguments():
    m = TinyLM()
    clean, corrupted = _ids(0), _ids(1)
    with pytest.raises(ValueError, match="ig_steps must be a positive int"):
        lens.attribution_patch(m, clean, corrupted, _logit_diff, ig_steps=0)
    with pytest.raises(ValueError, match="not a point"):
        lens.attribution_patch(m, clean, corrupted, _logit_diff, point="w")
    with pytest.raises(ValueError, match="equal shapes"):
        lens.attribution_patch(m, clean, _ids(1, n=5), _logit_diff)
    with pytest.raises(ValueError, match="metric must return"):
        lens.attribution_patch(m, clean, corrupted, lambda out: out[:, -1])


def test_integrated_gradients_on_token_inputs_average_the_gradients_along_the_embedding_path():
    m = TinyLM()
    clean, corrupted = _ids(0), _ids(1)
    got = lens.attribution_patch(m, clean, corrupted, _logit_diff, per_position=True, ig_steps=2)
    names = ["encoder.layers.0.self_attn", "encoder.layers.1.self_attn"]
    with torch.no_grad(), lens.cache(m, "z") as c:
        m(clean)
    e_clean, e_corrupted = m.embed(clean).detach(), m.embed(corrupted).detach()
    grads = []
    for alpha in (0.0, 0.5):
        handle = m.embed.register_forward_hook(
            lambda mod, i, o, a=alpha: e_corrupted + a * (e_clean - e_corrupted)
        )
        with lens.cache(m, "z", grads=True) as g:
            value = _logit_diff(m(corrupted)).mean()
            value.backward()
        handle.remove()
        if alpha == 0.0:
            base, z_corrupted = float(value), {n: g[n, "z"] for n in names}
        grads.append({n: g.grad(n, "z") for n in names})
    want = torch.stack(
        [((c[n, "z"] - z_corrupted[n]) * (grads[0][n] + grads[1][n]) / 2).sum((0, 3)) for n in names]
    )
    torch.testing.assert_close(got, base + want)


def test_attribution_patch_on_an_encoder_decoder_transformer_equals_the_cached_gradients():
    seq = mh.Transformer(
        V,
        V,
        d_model=16,
        num_heads=4,
        num_encoder_layers=1,
        num_decoder_layers=1,
        d_ff=24,
        dropout=0.0,
        kv_heads=2,
        dtype=F64,
    ).eval()
    clean, corrupted = (_ids(2), _ids(3)), (_ids(4), _ids(3))
    got = lens.attribution_patch(seq, clean, corrupted, _logit_diff, point="result")
    names = lens.select(seq, None)
    with torch.no_grad(), lens.cache(seq, "result") as c:
        seq(*clean)
    with lens.cache(seq, "result", grads=True) as g:
        value = _logit_diff(seq(*corrupted)).mean()
        value.backward()
    want = torch.stack(
        [((c[n, "result"] - g[n, "result"]) * g.grad(n, "result")).sum((0, 2, 3)) for n in names]
    )
    assert got.shape == (3, 4)
    torch.testing.assert_close(got, float(value) + want)
