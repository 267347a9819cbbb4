"""multihead.lens on our modules, a converted torch model and the d2l drop-in: every point against a by-hand
computation, edits against recomputing by hand, ablation, patching, composition and refusals.

Expected values come from plain torch here (projections, softmax, the module's own layers called by hand), or
from the model's own outputs (return_weights, a forward hook on the output projection), never from the lens.
"""

import math
import warnings

import pytest
import torch
from torch import nn

import multihead as mh
from multihead import heads, lens, viz
from multihead.nn import seam
from multihead.nn.attention import merge_heads

pytestmark = pytest.mark.filterwarnings("ignore:multihead. calls of")

F64 = torch.float64


def _mha(kv_heads=2, rotary=False, bias=True):
    torch.manual_seed(0)
    return mh.MultiHeadAttention(16, 4, kv_heads=kv_heads, rotary=rotary, bias=bias, dtype=F64).eval()


def _outputs_of(layer, fn):
    """``fn()``'s run with ``layer``'s outputs recorded (a forward hook): (fn's answer, [outputs])."""
    seen = []
    handle = layer.register_forward_hook(lambda m, i, o: seen.append(o.detach()))
    try:
        return fn(), seen
    finally:
        handle.remove()


def _qkv_by_hand(m, x):
    """q (B, 4, L, 4), k and v (B, 2, L, 4) of a 16-wide, 4-head, 2-kv-head module without rotary."""
    b, n, _ = x.shape
    w, bias = m.in_proj_weight, m.in_proj_bias  # rows [q (16) | k (8) | v (8)]
    q = (x @ w[:16].T + bias[:16]).view(b, n, 4, 4).transpose(1, 2)
    k = (x @ w[16:24].T + bias[16:24]).view(b, n, 2, 4).transpose(1, 2)
    v = (x @ w[24:].T + bias[24:]).view(b, n, 2, 4).transpose(1, 2)
    return q, k, v


@pytest.mark.parametrize("causal", [False, True])
def test_every_point_of_our_module_equals_the_by_hand_values(causal):
    m = _mha()
    x = torch.randn(2, 5, 16, dtype=F64)
    q, k, v = _qkv_by_hand(m, x)
    scores = q @ k.repeat_interleave(2, 1).transpose(-2, -1) / math.sqrt(4)  # (B, H, L, L)
    if causal:
        scores = scores.masked_fill(~torch.ones(5, 5, dtype=torch.bool).tril(), float("-inf"))
    pattern = scores.softmax(-1)
    z = pattern @ v.repeat_interleave(2, 1)  # (B, H, L, D)
    w = m.out_proj.weight.view(16, 4, 4)  # (E, H, D)
    result = torch.stack([z[:, h] @ w[:, h].T for h in range(4)], 1)  # (B, H, L, E)
    with lens.cache(m, points=lens.POINTS) as c:
        y = m(x, causal=causal)
    for point, want in dict(q=q, k=k, v=v, scores=scores, pattern=pattern, z=z, result=result).items():
        torch.testing.assert_close(c["", point], want, msg=point)
    torch.testing.assert_close(c["", "result"].sum(1) + m.out_proj.bias, y)
    assert c.names() == [""] and not c["", "z"].requires_grad


def test_rotary_gqa_decoding_with_a_kv_cache_joins_calls_as_the_full_run():
    m = _mha(rotary=True)
    x = torch.randn(2, 6, 16, dtype=F64)
    with lens.cache(m, points=("q", "k", "scores", "pattern", "z")) as full:
        m(x, causal=True)
    cache = mh.KVCache()
    with lens.cache(m, points=("q", "k", "scores", "pattern", "z")) as steps:
        for t in range(6):
            m(x[:, t : t + 1], cache=cache, causal=True)
    assert len(steps.calls("", "k")) == 6
    for point in ("q", "k", "pattern", "z"):  # k: the last call covers every key; the rest: joined queries
        torch.testing.assert_close(steps["", point], full["", point], msg=point)
    torch.testing.assert_close(steps["", "scores"].exp(), full["", "scores"].exp())  # -inf padding = masked
    # the points agree with each other: scores from q and k, pattern their softmax, z the pattern times v
    q, k = full["", "q"], full["", "k"].repeat_interleave(2, 1)
    want = (q @ k.transpose(-2, -1) / 2).masked_fill(
        ~torch.ones(6, 6, dtype=torch.bool).tril(), float("-inf")
    )
    torch.testing.assert_close(full["", "scores"], want)
    torch.testing.assert_close(full["", "pattern"], want.softmax(-1))


def test_a_transformer_stacks_points_in_run_order_and_refuses_unequal_shapes():
    torch.manual_seed(0)
    model = mh.Transformer(
        11, 11, d_model=16, num_heads=4, num_encoder_layers=2, num_decoder_layers=1, d_ff=32
    )
    model.eval()
    src, tgt = torch.randint(3, 11, (2, 7)), torch.randint(3, 11, (2, 5))
    with lens.cache(model, points="z", modules=lambda name: name.startswith("encoder")) as c:
        model(src, tgt)
    assert c.names() == ["encoder.layers.0.self_attn", "encoder.layers.1.self_attn"]
    assert c.stack("z").shape == (2, 2, 4, 7, 4)
    with lens.cache(model, points="pattern") as c:
        model(src, tgt)
    with pytest.raises(ValueError, match="shapes differ"):
        c.stack("pattern")  # (.., 7, 7) encoder, (.., 5, 5) decoder self, (.., 5, 7) cross
    with pytest.raises(KeyError, match="nothing cached"):
        c["encoder.layers.0.self_attn", "q"]


def test_a_cache_keeps_only_what_was_asked_and_changes_only_the_modules_asked(monkeypatch):
    torch.manual_seed(0)
    model = mh.TransformerEncoder(16, 4, 32, num_layers=2, dropout=0.0).eval()
    x = torch.randn(2, 5, 16)
    explicit = []
    real = seam.reference_with
    monkeypatch.setattr(seam, "reference_with", lambda *a, **k: explicit.append(1) or real(*a, **k))
    with warnings.catch_warnings():
        warnings.simplefilter(
            "error"
        )  # no "explicit path" warning: q, z and a cached pattern keep the backend
        with lens.cache(model, points=("q", "z", "pattern")) as c:
            model(x)
    assert not explicit and c.keys() == [(n, p) for n in c.names() for p in ("q", "pattern", "z")]
    assert c.nbytes() == 2 * 4 * (2 * 4 * 5 * 4 + 2 * 4 * 5 * 5 + 2 * 4 * 5 * 4)  # float32, nothing else kept
    with lens.cache(model, points="scores", modules=["layers.1.self_attn"]):
        model(x)
    assert len(explicit) == 1  # only the module asked took the explicit path
    mha = model.get_submodule("layers.0.self_attn")
    assert not mha.out_proj._forward_hooks and seam.active() == ()  # nothing left after a block


def test_composes_with_capture_masks_and_user_inspectors_in_any_nesting():
    m = _mha()
    x = torch.randn(2, 5, 16, dtype=F64)

    class Double(seam.Inspector):
        def on_heads(self, module, heads, weights):
            return heads * 2

    with heads.masked(m, [1]), lens.cache(m, points=("z", "result")) as inner:
        y_inner = m(x)
    assert inner["", "z"][:, 1].abs().max() == 0  # inside the mask: the masked model
    with lens.cache(m, points=("z", "result")) as outer, viz.capture(m) as cap, heads.masked(m, [1]):
        with seam.inspecting(Double()):
            y_outer = m(x)
    assert outer["", "z"][:, 1].abs().max() > 0 and len(cap) == 1  # outside: the heads before the mask
    for c, y in ((inner, y_inner), (outer, y_outer)):  # result: what the projection was fed, summed = output
        torch.testing.assert_close(c["", "result"].sum(1) + m.out_proj.bias, y)
    torch.testing.assert_close(outer["", "result"][:, 0], 2 * inner["", "result"][:, 0])


def _scaled(point, head, factor):
    def edit(t, ctx):
        assert ctx.point == point and ctx.name == "" and ctx.call == 0
        t = t.clone()
        t[:, head] *= factor
        return t

    return edit


@pytest.mark.parametrize("point", ["q", "k", "v", "scores", "pattern", "z", "result"])
def test_an_edit_at_any_point_equals_recomputing_by_hand(point):
    m = _mha()
    x = torch.randn(2, 5, 16, dtype=F64)
    q, k, v = _qkv_by_hand(m, x)
    scale = {"q": (q, 0), "k": (k, 1), "v": (v, 1)}
    if point in scale:
        t, h = scale[point]
        t[:, h] *= 3
    scores = q @ k.repeat_interleave(2, 1).transpose(-2, -1) / 2
    if point == "scores":
        scores[:, 2] *= 3
    pattern = scores.softmax(-1)
    if point == "pattern":
        pattern[:, 2] *= 3
    z = pattern @ v.repeat_interleave(2, 1)
    if point == "z":
        z[:, 2] *= 3
    w = m.out_proj.weight.view(16, 4, 4)
    result = torch.stack([z[:, h] @ w[:, h].T for h in range(4)], 1)  # (B, H, L, E)
    if point == "result":
        result[:, 2] *= 3
    want = result.sum(1) + m.out_proj.bias
    head = {"q": 0, "k": 1, "v": 1}.get(point, 2)
    with lens.hooks(m, {("", point): _scaled(point, head, 3)}):
        torch.testing.assert_close(m(x), want)


def test_an_edit_propagates_downstream_as_the_edited_module_output_would():
    torch.manual_seed(0)
    model = mh.TransformerEncoder(16, 4, 32, num_layers=2, dropout=0.0, dtype=F64).eval()
    x = torch.randn(2, 5, 16, dtype=F64)
    first = model.get_submodule("layers.0.self_attn")
    with lens.cache(model, points="z", modules=["layers.0.self_attn"]) as c:
        model(x)
    z = c["layers.0.self_attn", "z"].clone()
    z[:, 3] = 0.5
    by_hand = first.out_proj(merge_heads(z))  # the edited module's output, recomputed by hand
    handle = first.register_forward_hook(lambda m, i, o: by_hand)
    try:
        want = model(x)
    finally:
        handle.remove()

    def edit(t, ctx):
        t = t.clone()
        t[:, 3] = 0.5
        return t

    with lens.hooks(model, {("layers.0.self_attn", "z"): edit}):
        torch.testing.assert_close(model(x), want)


def test_ablations_zero_equals_masked_mean_and_resample_by_hand():
    m = _mha()
    x, ref = torch.randn(2, 5, 16, dtype=F64), torch.randn(3, 5, 16, dtype=F64)
    with lens.ablate(m, {"": [0, 2]}):
        zeroed = m(x)
    with heads.masked(m, [0, 2]):
        torch.testing.assert_close(zeroed, m(x))
    q, k, v = _qkv_by_hand(m, ref)
    z_ref = (q @ k.repeat_interleave(2, 1).transpose(-2, -1) / 2).softmax(-1) @ v.repeat_interleave(2, 1)
    picks = torch.randint(3, (2,), generator=torch.Generator().manual_seed(0))
    for how, values in (("mean", z_ref.mean((0, 2))[None, :, None]), ("resample", z_ref[picks])):
        with lens.cache(m, points="z") as c:
            m(x)
        z = c["", "z"].clone()
        z[:, [1, 3]] = values.expand_as(z)[:, [1, 3]]
        with lens.ablate(m, {"": [1, 3]}, how=how, reference=ref):
            torch.testing.assert_close(m(x), m.out_proj(merge_heads(z)))


@pytest.mark.parametrize(
    ("point", "per_position"),
    [("z", False), ("k", False), ("z", True), ("pattern", False), ("result", True), ("q", False)],
)
def test_patching_batched_equals_one_forward_per_head(point, per_position):
    torch.manual_seed(0)
    model = mh.TransformerEncoder(16, 4, 32, num_layers=2, kv_heads=2, dropout=0.0, dtype=F64)
    model.eval()
    clean, corrupted = torch.randn(2, 4, 16, dtype=F64), torch.randn(2, 4, 16, dtype=F64)

    def per_example(out):
        return out[:, -1, :3].sum(-1)  # (B,)

    batched = lens.patch_heads(
        model, clean, corrupted, per_example, point=point, per_position=per_position, chunk=5
    )
    single = lens.patch_heads(
        model, clean, corrupted, lambda out: per_example(out).mean(), point=point, per_position=per_position
    )
    h = 2 if point == "k" else 4
    assert batched.shape == ((2, h, 4) if per_position else (2, h))
    torch.testing.assert_close(batched, single)
    # one entry by hand: the clean point of one head written into the corrupted run
    with lens.cache(model, points=point) as c:
        model(clean)
    source = c["layers.1.self_attn", point]

    def write(t, ctx):
        t = t.clone()
        if per_position:
            t[:, 1, 2] = source[:, 1, 2]
        else:
            t[:, 1] = source[:, 1]
        return t

    with lens.hooks(model, {("layers.1.self_attn", point): write}):
        want = per_example(model(corrupted)).mean()
    got = batched[1, 1, 2] if per_position else batched[1, 1]
    torch.testing.assert_close(got, want.float(), check_dtype=False)


def _last_token_sum(out):
    return out[:, -1, :3].sum(-1)  # (B,)


def test_patching_runs_the_layers_before_a_patch_once_and_matches_one_forward_per_head():
    torch.manual_seed(0)
    model = mh.TransformerEncoder(16, 4, 32, num_layers=3, dropout=0.0, dtype=F64).eval()
    clean, corrupted = torch.randn(2, 4, 16, dtype=F64), torch.randn(2, 4, 16, dtype=F64)
    seen = {i: [] for i in range(3)}  # the batch of each layer's output
    handles = [
        layer.register_forward_hook(lambda mod, args, out, i=i: seen[i].append(out.shape[0]))
        for i, layer in enumerate(model.layers)
    ]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        shared = lens.patch_heads(model, clean, corrupted, _last_token_sum, chunk=4)  # 4: one layer a forward
    for handle in handles:
        handle.remove()
    # clean run, corrupted run, then one forward per layer's 4 heads (4 copies of B = 2): layer 0's forward
    # shares nothing; layer 1's runs layer 0 once and carries the unpatched check copy (5 copies); layer 2's
    # runs layers 0 and 1 once
    assert seen == {0: [2, 2, 8, 2, 2], 1: [2, 2, 8, 10, 2], 2: [2, 2, 8, 10, 8]}
    single = lens.patch_heads(model, clean, corrupted, lambda out: _last_token_sum(out).mean())
    torch.testing.assert_close(shared, single)
    # only the last layer's heads: the two layers before it run once, on the corrupted batch
    seen = {i: [] for i in range(3)}
    handles = [
        layer.register_forward_hook(lambda mod, args, out, i=i: seen[i].append(out.shape[0]))
        for i, layer in enumerate(model.layers)
    ]
    last = lens.patch_heads(model, clean, corrupted, _last_token_sum, modules=["layers.2.self_attn"])
    for handle in handles:
        handle.remove()
    assert seen == {0: [2, 2, 2], 1: [2, 2, 2], 2: [2, 2, 10]}  # clean, corrupted, 4 copies + the check copy
    torch.testing.assert_close(last, single[2:])


class _InputSkips(nn.Module):
    """A stack whose every layer also adds the model's input: the input's batch reaches each layer from outside
    its arguments, so the layers before a patch cannot simply be run once and repeated."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(
            mh.TransformerEncoderLayer(16, 4, 32, dropout=0.0, dtype=F64) for _ in range(3)
        )

    def forward(self, x):
        h = x
        for layer in self.layers:
            h = layer(h) + x
        return h


def test_patching_a_stack_it_cannot_share_warns_once_and_runs_every_copy_in_full():
    torch.manual_seed(0)
    model = _InputSkips().eval()
    clean, corrupted = torch.randn(2, 4, 16, dtype=F64), torch.randn(2, 4, 16, dtype=F64)
    with pytest.warns(UserWarning, match="every copy now runs the whole model") as said:
        batched = lens.patch_heads(model, clean, corrupted, _last_token_sum, chunk=4)
    assert len(said) == 1
    single = lens.patch_heads(model, clean, corrupted, lambda out: _last_token_sum(out).mean())
    torch.testing.assert_close(batched, single)


def test_the_shared_prefix_check_holds_to_working_precision_only():
    from multihead.lens.share import Prefix

    base = torch.tensor([5.0, -3.0])
    assert Prefix(nn.Module(), []).verify(base + 1e-5, base)
    prefix = Prefix(nn.Module(), [])
    with pytest.warns(UserWarning, match="not the corrupted run's"):
        assert not prefix.verify(base + 0.1, base)
    assert not prefix.on


def test_a_converted_torch_model_and_the_d2l_drop_in():
    from multihead.compat import d2l
    from multihead.compat.torch import convert

    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 4, 32, dropout=0.0, batch_first=True)
    ours = convert(nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)).eval()
    x = torch.randn(2, 5, 16)
    attn = ours.get_submodule("layers.0.self_attn")
    with lens.cache(ours, points=("pattern", "result")) as c:
        _, outs = _outputs_of(attn.out_proj, lambda: ours(x))
    _, weights = attn(x, x, x, need_weights=True, average_attn_weights=False)  # the drop-in's own weights
    torch.testing.assert_close(c["layers.0.self_attn", "pattern"], weights)
    torch.testing.assert_close(c["layers.0.self_attn", "result"].sum(1) + attn.out_proj.bias, outs[0])

    torch.manual_seed(0)
    book = d2l.MultiHeadAttention(16, 4, 0.0, keep_weights=True).eval()
    x, lens_ = torch.randn(2, 5, 8), torch.tensor([3, 5])
    with lens.cache(book, points=("pattern", "z", "result")) as c:
        y = book(x, x, x, lens_)
    assert c.names() == ["attention"]
    torch.testing.assert_close(c["attention", "pattern"].flatten(0, 1), book.attention.attention_weights)
    torch.testing.assert_close(c["attention", "result"].sum(1), y)  # d2l's W_o has no bias
    with lens.ablate(book, {"attention": [1]}):
        ablated = book(x, x, x, lens_)
    with heads.masked(book, {"attention": [1]}):
        torch.testing.assert_close(ablated, book(x, x, x, lens_))


def test_bad_requests_are_refused_by_name():
    m = _mha()
    x = torch.randn(1, 3, 16, dtype=F64)
    with pytest.raises(ValueError, match="'nope'.*names: ''"):
        with lens.cache(m, points="z", modules=["nope"]):
            pass
    with pytest.raises(ValueError, match="'logits', which is not a point"):
        with lens.cache(m, points=("z", "logits")):
            pass
    with pytest.raises(ValueError, match=r"handlers.*shape \(1, 2, 3, 4\)"):
        with lens.hooks(m, {("", "z"): lambda t, ctx: t[:, :2]}):
            m(x)
    with pytest.raises(ValueError, match=r"must hold head indices in \[0, 4\)"):
        with lens.ablate(m, {"": [4]}):
            pass
    with pytest.raises(ValueError, match="needs reference inputs"):
        with lens.ablate(m, {"": [0]}, how="mean"):
            pass
    with pytest.raises(ValueError, match="how must be one of"):
        with lens.ablate(m, {"": [0]}, how="noise"):
            pass
    with pytest.raises(ValueError, match="metric must return a scalar or one value per example"):
        lens.patch_heads(m, x, x, lambda out: out[0])
    with pytest.raises(ValueError, match="equal shapes"):
        lens.patch_heads(m, x, x[:, :2], lambda out: out.sum())
    from multihead.compat import d2l

    bare = d2l.DotProductAttention()
    with pytest.raises(ValueError, match="'result' of ''.*output projection"):
        with lens.cache(bare, points="result"):
            pass
    with pytest.raises(TypeError, match="get_output_embeddings"):
        lens.logit_attribution(m, x, torch.tensor([0]))


def test_a_projection_fed_something_else_is_refused_for_result():
    class Scaled(mh.MultiHeadAttention):
        def forward(self, x):
            q, k, v = self.project(x, x, x)
            out, _ = seam.attend(self, q, k, v)
            return self.out_proj(2 * merge_heads(out))  # not the merged heads

    torch.manual_seed(0)
    m = Scaled(16, 4)
    with lens.cache(m, points="result"), pytest.raises(ValueError, match="not the merged heads"):
        m(torch.randn(1, 3, 16))


def test_importance_scores_a_model_seen_through_a_lens_and_the_lens_sees_the_gates():
    torch.manual_seed(0)
    model = mh.TransformerEncoder(16, 4, 32, num_layers=2, dropout=0.0).eval()
    x = torch.randn(2, 5, 16)
    kept = []

    def loss_fn(m, batch):
        with lens.cache(m, points=("z", "result")) as c:
            loss = m(batch).pow(2).mean()
        kept.append(c)
        return loss

    with lens.ablate(model, {"layers.0.self_attn": [1]}):
        scores = heads.importance(model, [x], loss_fn, normalize=False)
    assert scores["layers.0.self_attn"][1] == 0  # an ablated head's gate changes nothing
    assert scores["layers.0.self_attn"][0] > 0 and kept[0]["layers.0.self_attn", "z"][:, 1].abs().max() == 0
    assert not kept[0]["layers.1.self_attn", "result"].requires_grad
