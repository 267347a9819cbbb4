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
        base = float(metric(stack(corrupted)).detach().mean())
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

    class OneHot(nn.Module):  # token ids in, no embedding module: no input embeddings to move
        def __init__(self):
            super().__init__()
            self.table = nn.Parameter(torch.randn(V, 16, dtype=F64))
            self.attn = _mha()

        def forward(self, ids):
            return self.attn(nn.functional.one_hot(ids, V).to(F64) @ self.table)

    with pytest.raises(ValueError, match="no input embedding module"):
        lens.attribution_patch(OneHot(), clean, corrupted, lambda out: out[:, -1, 0], ig_steps=2)


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
            base, z_corrupted = float(value.detach()), {n: g[n, "z"] for n in names}
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
    torch.testing.assert_close(got, float(value.detach()) + want)
    with pytest.raises(
        ValueError, match="several attention modules"
    ):  # the cross-attention reads the encoder
        lens.edge_attribution(seq, clean, corrupted, _logit_diff)


# ------------------------------------------------------------------------------------------------
# Edges and faithfulness
# ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny():
    m = TinyLM()
    clean, corrupted = _ids(0), _ids(1)
    return m, clean, corrupted, lens.edge_attribution(m, clean, corrupted, _logit_diff)


def layout_of(m, inputs):
    from multihead.heads.naming import attention_modules
    from multihead.lens.readers import layout
    from multihead.lens.stream import find_stream

    return layout(find_stream(m, inputs, attention_modules(m))[0])


def test_graph_nodes_and_upstream_follow_the_stack(tiny):
    m, clean, corrupted, g = tiny
    a0, a1 = "encoder.layers.0.self_attn", "encoder.layers.1.self_attn"
    assert g.writers[0] == lens.Node("embed", "embed") and g.readers[-1] == lens.Node(
        "encoder.norm", "logits"
    )
    assert len(g.writers) == 1 + 2 * (4 + 1) and len(g.readers) == 2 * (4 + 2 + 2 + 1) + 1
    assert g.scores.shape == g.upstream.shape == (11, 19)
    w = {n: i for i, n in enumerate(g.writers)}
    r = {n: j for j, n in enumerate(g.readers)}
    up = g.upstream
    assert up[w[lens.Node(a0, "head", 1)], r[lens.Node("encoder.layers.0.ff", "mlp")]]
    assert not up[w[lens.Node(a0, "head", 1)], r[lens.Node(a0, "q", 1)]]
    assert up[w[lens.Node("encoder.layers.0.ff", "mlp")], r[lens.Node(a1, "k", 1)]]
    assert not up[w[lens.Node("encoder.layers.1.ff", "mlp")], r[lens.Node(a1, "v", 0)]]
    assert (g.scores[~up] == 0).all() and int(up.sum()) == len(g.edges())
    assert torch.equal(up, layout_of(m, clean).upstream())  # the run's order agrees with the layout's
    top = g.top(5)
    assert [abs(s) for _, _, s in top] == sorted((abs(s) for _, _, s in top), reverse=True)
    assert abs(top[0][2]) == float(g.scores.abs().max())
    assert len(g.top(10_000)) == len(g.edges()) and all(up[w[a], r[b]] for a, b, _ in g.top(10_000))
    assert repr(g).startswith("Graph(11 writers, 19 readers")
    part = lens.edge_attribution(m, clean, corrupted, _logit_diff, modules=[a1])  # layer 1's nodes only
    rows = [0, *range(6, 11)]
    cols = [*range(9, 19)]
    assert part.writers == [g.writers[i] for i in rows] and part.readers == [g.readers[j] for j in cols]
    torch.testing.assert_close(part.scores, g.scores[rows][:, cols])


@pytest.mark.parametrize("ig_steps", [1, 3])
def test_a_writers_row_sums_to_its_node_effect(tiny, ig_steps):
    m, clean, corrupted, g = tiny
    if ig_steps > 1:
        g = lens.edge_attribution(m, clean, corrupted, _logit_diff, ig_steps=ig_steps)
    node = lens.attribution_patch(m, clean, corrupted, _logit_diff, ig_steps=ig_steps)
    base = float(_logit_diff(m(corrupted)).detach().mean())
    rows = g.node_effects()
    heads = torch.stack([rows[1:5], rows[6:10]])  # (layers, heads)
    torch.testing.assert_close(heads, node - base)
    if ig_steps == 1:  # the embed writer's row: its first-order effect, by autograd on the embedding by hand
        e_clean = m.embed(clean).detach()
        e = m.embed(corrupted).detach().requires_grad_()
        (grad,) = torch.autograd.grad(_logit_diff(m.unembed(m.encoder(e, causal=True))).mean(), e)
        torch.testing.assert_close(rows[0], ((e_clean - e.detach()) * grad).sum())


def test_faithfulness_all_edges_is_one_and_none_is_zero(tiny):
    m, clean, corrupted, g = tiny
    assert lens.faithfulness(m, g, clean, corrupted, _logit_diff) == pytest.approx(1.0, abs=1e-12)
    assert lens.faithfulness(m, [], clean, corrupted, _logit_diff) == pytest.approx(0.0, abs=1e-12)
    every = [(w, r) for w, r, _ in g.edges()]
    assert lens.faithfulness(m, every, clean, corrupted, _logit_diff) == pytest.approx(1.0, abs=1e-12)


def _fraction(m, clean, corrupted, value):
    low, high = (float(_logit_diff(m(x)).detach().mean()) for x in (corrupted, clean))
    return (value - low) / (high - low)


def test_dropping_one_edge_equals_that_edges_patch_by_hand(tiny):
    m, clean, corrupted, g = tiny
    a0, a1 = "encoder.layers.0.self_attn", "encoder.layers.1.self_attn"
    every = [(w, r) for w, r, _ in g.edges()]
    with torch.no_grad(), lens.cache(m, "result") as rc:
        m(clean)
    with torch.no_grad(), lens.cache(m, "result") as rk:
        m(corrupted)
    d_embed = (m.embed(clean) - m.embed(corrupted)).detach()
    d_head = rc[a0, "result"][:, 1] - rk[a0, "result"][:, 1]  # (B, L, E)
    norms = m.encoder.layers[1].norm1, m.encoder.layers[0].norm2, m.encoder.norm

    def without(delta, norm):  # the reader at ``norm``'s input sees the writer's corrupted output
        handle = norm.register_forward_pre_hook(lambda mod, args: (args[0] - delta,))
        with torch.no_grad():
            value = float(_logit_diff(m(clean)).mean())
        handle.remove()
        return value

    cases = [
        ((lens.Node("embed", "embed"), lens.Node("encoder.norm", "logits")), without(d_embed, norms[2])),
        ((lens.Node(a0, "head", 1), lens.Node("encoder.layers.0.ff", "mlp")), without(d_head, norms[1])),
    ]
    # one q head of layer 1 reads the stream without the embed writer's clean output: its q by hand from that
    # stream through the layer's own norm and attention module, written into the clean run's q at head 2
    with torch.no_grad(), lens.cache(m, "q", modules=[a1]) as stream_q:
        handle = norms[0].register_forward_pre_hook(lambda mod, args: (args[0] - d_embed,))
        m(clean)
        handle.remove()
    q_edit = stream_q[a1, "q"][:, 2]

    def swap(q, ctx):
        q = q.clone()
        q[:, 2] = q_edit
        return q

    with torch.no_grad(), lens.hooks(m, {(a1, "q"): swap}):
        cases.append(
            ((lens.Node("embed", "embed"), lens.Node(a1, "q", 2)), float(_logit_diff(m(clean)).mean()))
        )
    for edge, value in cases:
        got = lens.faithfulness(m, [e for e in every if e != edge], clean, corrupted, _logit_diff)
        assert got == pytest.approx(_fraction(m, clean, corrupted, value), abs=1e-10), edge


def test_mean_ablation_of_edges_uses_the_references_mean_outputs(tiny):
    m, clean, corrupted, g = tiny
    ref = _ids(7, b=4)
    keep = g.edges()
    assert lens.faithfulness(
        m, keep, clean, corrupted, _logit_diff, ablation="mean", reference=ref
    ) == pytest.approx(1.0, abs=1e-12)
    # all but embed -> logits: the final norm reads the stream with the embedding's clean output replaced by the
    # reference's mean embedding (over its batch and positions)
    edge = (lens.Node("embed", "embed"), lens.Node("encoder.norm", "logits"))
    with torch.no_grad():
        delta = m.embed(clean) - m.embed(ref).mean((0, 1))
    handle = m.encoder.norm.register_forward_pre_hook(lambda mod, args: (args[0] - delta,))
    with torch.no_grad():
        value = float(_logit_diff(m(clean)).mean())
    handle.remove()
    kept = [(w, r) for w, r, _ in keep if (w, r) != edge]
    got = lens.faithfulness(m, kept, clean, corrupted, _logit_diff, ablation="mean", reference=ref)
    assert got == pytest.approx(_fraction(m, clean, corrupted, value), abs=1e-10)


def test_edges_and_faithfulness_refuse_bad_arguments_by_name(tiny):
    m, clean, corrupted, g = tiny
    with pytest.raises(TypeError, match="lens.Node"):
        lens.faithfulness(m, [("embed", "logits")], clean, corrupted, _logit_diff)
    with pytest.raises(ValueError, match="not a writer"):
        lens.faithfulness(m, [(lens.Node("x", "head", 0), g.readers[0])], clean, corrupted, _logit_diff)
    late = (g.writers[-1], g.readers[0])  # layer 1's MLP -> layer 0's q head 0
    with pytest.raises(ValueError, match="not an edge"):
        lens.faithfulness(m, [late], clean, corrupted, _logit_diff)
    with pytest.raises(ValueError, match="needs reference"):
        lens.faithfulness(m, [], clean, corrupted, _logit_diff, ablation="mean")
    with pytest.raises(ValueError, match="ablation must be"):
        lens.faithfulness(m, [], clean, corrupted, _logit_diff, ablation="zero")
    with pytest.raises(ValueError, match="ig_steps"):
        lens.edge_attribution(m, clean, corrupted, _logit_diff, ig_steps=1.5)
    with pytest.raises(ValueError, match="post-norm"):
        lens.edge_attribution(TinyLM(norm_first=False), clean, corrupted, _logit_diff)


def test_a_converted_torch_encoder_edges_with_an_mlp_over_two_children():
    from multihead.compat.torch import convert

    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 4, 24, dropout=0.0, batch_first=True, norm_first=True, dtype=F64)
    stack = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False, norm=nn.LayerNorm(16, dtype=F64))
    enc = convert(stack).eval()
    clean, corrupted = torch.randn(2, 5, 16, dtype=F64), torch.randn(2, 5, 16, dtype=F64)

    def metric(out):
        return out[:, -1, :3].sum(-1)

    g = lens.edge_attribution(enc, clean, corrupted, metric, ig_steps=2)
    assert g.writers[0] == lens.Node("", "embed") and lens.Node("layers.1.linear2", "mlp") in g.readers
    node = lens.attribution_patch(enc, clean, corrupted, metric, ig_steps=2)
    with torch.no_grad():
        base = float(metric(enc(corrupted)).mean())
    rows = g.node_effects()
    torch.testing.assert_close(torch.stack([rows[1:5], rows[6:10]]), node - base)
    assert lens.faithfulness(enc, g, clean, corrupted, metric) == pytest.approx(1.0, abs=1e-12)
    assert lens.faithfulness(enc, [], clean, corrupted, metric) == pytest.approx(0.0, abs=1e-12)
    post = convert(
        nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 4, 24, batch_first=True, dtype=F64), 1)
    )
    with pytest.raises(ValueError, match="post-norm"):
        lens.edge_attribution(post.eval(), clean, corrupted, metric)
