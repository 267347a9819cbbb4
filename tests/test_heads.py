import io

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from toy_models import ToySeq2Seq, toy_inputs

import multihead as mh
from multihead import heads

# ------------------------------------------------------------------------------------------------
# A planted model: head 2 finds the marked position and copies its value; heads 0, 1, 3 are random.
# ------------------------------------------------------------------------------------------------

V, L, E, H, D, SIGNAL = 8, 6, 16, 4, 8, 2  # values, length, features, heads, head dim, planted head


def planted_data(n, seed):
    """Features: [one-hot value (8) | marker (1) | cls bit (1) | noise (6)]; label = the marked value."""
    g = torch.Generator().manual_seed(seed)
    values = torch.randint(0, V, (n, L), generator=g)
    where = torch.randint(0, L, (n,), generator=g)
    x = torch.zeros(n, L, E)
    x[..., :V] = F.one_hot(values, V).float()
    x[torch.arange(n), where, V] = 1.0
    x[..., V + 2 :] = torch.randn(n, L, E - V - 2, generator=g)
    cls = torch.zeros(n, 1, E)
    cls[..., V + 1] = 1.0
    return cls, x, values[torch.arange(n), where]


class Planted(nn.Module):
    """Built, not trained: head 2's value slot is read out as the logits; the other heads add small noise."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.attn = mh.MultiHeadAttention(E, H, head_dim=D)
        self.clf = nn.Linear(E, V, bias=False)
        w = self.attn.in_proj_weight.data  # rows [q (H*D) | k (H*D) | v (H*D)]
        q, k, v = (slice(j * H * D + SIGNAL * D, j * H * D + (SIGNAL + 1) * D) for j in range(3))
        w[q], w[k], w[v] = 0.0, 0.0, 0.0
        w[q.start, V + 1] = 1.0  # the cls bit asks ...
        w[k.start, V] = 40.0  # ... for the marked key
        w[v.start : v.start + V, :V] = torch.eye(V)  # and reads its value
        o = self.attn.out_proj.weight.data  # (E, H*D)
        o.mul_(0.1)  # noise heads: small random contributions
        o[:, SIGNAL * D : (SIGNAL + 1) * D] = 0.0
        o[:V, SIGNAL * D : SIGNAL * D + V] = torch.eye(V)  # the value lands on output features 0..7
        self.clf.weight.data.zero_()
        self.clf.weight.data[:, :V] = 10 * torch.eye(V)

    def forward(self, batch):
        cls, x, _ = batch
        return self.clf(self.attn(cls, x)[:, 0])


def loss_fn(model, batch):
    return F.cross_entropy(model(batch), batch[2])


def accuracy(model, batch):
    with torch.no_grad():
        return 100.0 * float((model(batch).argmax(-1) == batch[2]).float().mean())


@pytest.fixture(scope="module")
def planted():
    model = Planted().eval()
    test = planted_data(256, seed=2)
    assert accuracy(model, test) > 95.0  # the planted head does carry the task
    return model, test


def test_importance_ranks_planted_head_first(planted):
    model, test = planted
    scores = heads.importance(model, [test], loss_fn)
    assert set(scores) == {"attn"}
    assert int(scores["attn"].argmax()) == SIGNAL
    assert heads.rank(scores)[-1] == ("attn", SIGNAL)
    assert torch.allclose(scores["attn"].norm(), torch.tensor(1.0))  # per-layer L2 normalisation
    drop = heads.masking_drop(model, lambda m: accuracy(m, test))
    assert int(drop["attn"].argmax()) == SIGNAL
    assert drop["attn"][SIGNAL] > 50.0  # masking the pointer head loses the task ...
    others = [h for h in range(H) if h != SIGNAL]
    assert drop["attn"][others].abs().max() < 10.0  # ... masking a noise head barely matters


def test_importance_equals_per_example_gradient_of_out_proj_columns():
    """Independent check: a gate on head h scales out_proj's columns of h, so dL/dgate = <dL/dW_h, W_h>."""
    torch.manual_seed(0)
    model = ToySeq2Seq(kv_heads=2).double()
    x, y = toy_inputs(model, batch=4)
    target = torch.randn_like(y)

    def loss(m, batch):
        return F.mse_loss(m(batch[0], batch[1]), batch[2])

    batches = [(x[:2], y[:2], target[:2]), (x[2:], y[2:], target[2:])]
    got = heads.importance(model, batches, loss, normalize=False)
    for name, m in heads.attention_modules(model).items():
        dv = m.v_head_dim
        per_example = []
        for b in range(4):
            model.zero_grad()
            F.mse_loss(model(x[b : b + 1], y[b : b + 1]), target[b : b + 1]).backward()
            prod = m.out_proj.weight.grad * m.out_proj.weight.detach()  # (O, H*Dv)
            per_example.append(prod.unflatten(1, (m.num_heads, dv)).sum(dim=(0, 2)).abs())  # (H,)
        # batches of 2 with a batch-mean loss: each batch contributes mean |.| over its examples
        want = torch.stack(per_example).mean(0)
        torch.testing.assert_close(got[name].double(), want, rtol=1e-5, atol=1e-9)


def test_importance_leaves_parameters_and_mode_alone():
    model = ToySeq2Seq().train()
    x, y = toy_inputs(model)
    heads.importance(model, [(x, y)], lambda m, b: m(*b).square().mean())
    assert model.training
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("bad", [[], [(torch.zeros(1),)]])
def test_importance_errors(bad):
    model = ToySeq2Seq()
    with pytest.raises(ValueError, match="batch|attention|scalar"):
        heads.importance(model, bad, lambda m, b: torch.zeros(2))


# ------------------------------------------------------------------------------------------------
# Pruning
# ------------------------------------------------------------------------------------------------

SPECS = [
    {"encoder.layers.0.self_attn": [1]},
    {"encoder.layers.1.self_attn": [0, 1], "decoder.layers.0.cross_attn": [3]},  # a whole KV group when G=2
    {"decoder.layers.0.self_attn": [0, 2, 3], "decoder.layers.1.cross_attn": [1, 2]},  # uneven groups
]


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize(
    "config",
    [
        {},
        {"kv_heads": 2},
        {"kv_heads": 1},
        {"bias": False, "kdim": 12},  # separate q/k/v projection weights in cross-attention
        {"kv_heads": 2, "kdim": 12},
    ],
)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_prune_equals_gated_model(spec, config, dtype):
    torch.manual_seed(0)
    model = ToySeq2Seq(**config).to(dtype).eval()
    x, y = toy_inputs(model)
    with torch.no_grad():
        with heads.masked(model, spec):
            gated = model(x, y)
        full = model(x, y)
        pruned = heads.prune(model, spec)
        out = pruned(x, y)
    assert not torch.equal(gated, full)  # the masked heads did contribute
    torch.testing.assert_close(out, gated, rtol=0, atol=1e-6 if dtype == torch.float64 else 1e-5)
    counts, before = heads.head_counts(pruned), heads.head_counts(model)
    for name in before:
        assert counts[name] == before[name] - len(spec.get(name, []))
    if "kv_heads" not in config:  # (uneven GQA groups may duplicate a KV head: see the next test)
        assert sum(p.numel() for p in pruned.parameters()) < sum(p.numel() for p in model.parameters())
    for m in heads.attention_modules(pruned).values():
        assert m.num_heads % m.kv_heads == 0
        assert m.out_proj.in_features == m.num_heads * m.v_head_dim == m.out_proj.weight.shape[1]


def test_prune_removes_whole_kv_group_only_when_all_its_heads_go():
    mha = mh.MultiHeadAttention(16, 4, kv_heads=2)  # groups {0, 1} -> kv 0, {2, 3} -> kv 1
    uneven = heads.prune(mha, [0])  # groups {1} and {2, 3}: KV head 1 is duplicated, one per query head
    assert (uneven.num_heads, uneven.kv_heads) == (3, 3)
    torch.testing.assert_close(uneven.in_proj_weight[16:20], uneven.in_proj_weight[20:24], rtol=0, atol=0)
    small = heads.prune(mha, [0, 1])
    assert (small.num_heads, small.kv_heads) == (2, 1)
    assert small.in_proj_weight.shape == (2 * 4 + 1 * 4 + 1 * 4, 16)
    assert (mha.num_heads, mha.kv_heads) == (4, 2)  # not in place by default


def test_prune_bare_module_in_place_matches_masking():
    torch.manual_seed(1)
    mha = mh.MultiHeadAttention(12, 3, head_dim=5, v_head_dim=7, out_dim=9).double()
    x = torch.randn(2, 4, 12, dtype=torch.double)
    with heads.masked(mha, [2]):
        want = mha(x)
    same = heads.prune(mha, [2], inplace=True)
    assert same is mha and mha.num_heads == 2
    torch.testing.assert_close(mha(x), want, rtol=0, atol=1e-6)


def test_prune_all_heads_of_a_layer_is_rejected():
    model = ToySeq2Seq()
    spec = {"encoder.layers.0.self_attn": [0], "decoder.layers.0.cross_attn": [0, 1, 2, 3]}
    with pytest.raises(ValueError, match="cannot prune all 4 heads of 'decoder.layers.0.cross_attn'"):
        heads.prune(model, spec, inplace=True)
    assert heads.head_counts(model)["encoder.layers.0.self_attn"] == 4  # nothing changed


@pytest.mark.parametrize(
    "spec, match",
    [
        ({"nope": [0]}, "not an attention module"),
        ({"encoder.layers.0.self_attn": [4]}, r"\[0, 4\)"),
        ({"encoder.layers.0.self_attn": ["a"]}, "head indices"),
        ([0], "mapping"),
    ],
)
def test_prune_bad_heads(spec, match):
    with pytest.raises((ValueError, TypeError), match=match):
        heads.prune(ToySeq2Seq(), spec)


@pytest.mark.parametrize("config", [{}, {"kv_heads": 2, "kdim": 12, "bias": False}])
def test_pruned_model_saves_and_loads(config):
    torch.manual_seed(0)
    model = ToySeq2Seq(**config).eval()
    pruned = heads.prune(model, SPECS[2])
    buf = io.BytesIO()
    torch.save(pruned.state_dict(), buf)
    buf.seek(0)
    fresh = ToySeq2Seq(**config).eval()
    with pytest.raises(RuntimeError, match="size mismatch"):  # why load_pruned exists
        fresh.load_state_dict(torch.load(buf))
    buf.seek(0)
    loaded = heads.load_pruned(fresh, torch.load(buf))
    assert heads.head_counts(loaded) == heads.head_counts(pruned)
    x, y = toy_inputs(model)
    with torch.no_grad():
        torch.testing.assert_close(loaded(x, y), pruned(x, y), rtol=0, atol=0)


# ------------------------------------------------------------------------------------------------
# Iterative pruning
# ------------------------------------------------------------------------------------------------


def test_prune_iteratively_keeps_the_planted_head_within_budget(planted):
    model, test = planted
    base = accuracy(model, test)
    steps = []
    res = heads.prune_iteratively(
        model,
        lambda m: heads.importance(m, [test], loss_fn),
        lambda m: accuracy(m, test),
        step=0.5,
        budget=2.0,
        progress=steps.append,
    )
    assert res.baseline == base
    assert res.metric >= base - 2.0
    assert res.metric == accuracy(res.model, test)
    assert SIGNAL not in res.pruned.get("attn", [])
    assert res.num_pruned == H - heads.head_counts(res.model)["attn"] >= 2
    assert steps == res.history and all(s.accepted == (s.metric >= base - 2.0) for s in steps)
    assert heads.head_counts(model)["attn"] == H  # the input model is untouched


@pytest.mark.parametrize("patience", [None, 2])
def test_prune_iteratively_zero_budget_rejects_harmful_steps(patience):
    """With a metric that punishes every pruned head, nothing is pruned: the schedule halves to one head,
    then tries every head alone once (or stops after ``patience`` rejections in a row)."""
    model = ToySeq2Seq()
    total = sum(heads.head_counts(model).values())
    res = heads.prune_iteratively(
        model,
        lambda m: {n: torch.arange(h, dtype=torch.float) for n, h in heads.head_counts(m).items()},
        lambda m: float(sum(heads.head_counts(m).values())),
        step=0.25,
        budget=0.0,
        patience=patience,
    )
    assert total == 24
    assert res.num_pruned == 0 and res.pruned == {}
    singles = total if patience is None else patience
    assert [s.removed for s in res.history] == [6, 3] + [1] * singles
    assert not any(s.accepted for s in res.history)


def test_prune_iteratively_skips_a_head_the_metric_needs():
    """The least important head by score is the one the metric needs: it is kept and the others still go."""
    model = ToySeq2Seq()
    needed = ("encoder.layers.0.self_attn", 0)
    first = sorted(heads.head_counts(model))
    assert needed[0] in first

    def scores(m: torch.nn.Module) -> dict[str, torch.Tensor]:
        out = {n: torch.ones(h) for n, h in heads.head_counts(m).items()}
        if heads.head_counts(m)[needed[0]] == heads.head_counts(model)[needed[0]]:
            out[needed[0]][needed[1]] = 0.0  # ranked first while it is still there
        return out

    def metric(m: torch.nn.Module) -> float:
        # 100 while head 0 of the needed module survives (its first query-projection row is unchanged)
        w = dict(m.named_parameters())[f"{needed[0]}.in_proj_weight"]
        ref = dict(model.named_parameters())[f"{needed[0]}.in_proj_weight"]
        return 100.0 if torch.equal(w[0], ref[0]) else 0.0

    res = heads.prune_iteratively(model, scores, metric, step=1 / 24, budget=0.5)
    assert needed[1] not in res.pruned.get(needed[0], [])
    left = heads.head_counts(res.model)
    assert all(h == 1 for h in left.values())  # everything else down to min_heads=1
    assert res.metric == 100.0


@pytest.mark.parametrize("kw", [{"step": 0.0}, {"budget": -1.0}, {"min_heads": 0}, {"patience": 0}])
def test_prune_iteratively_bad_arguments(kw):
    with pytest.raises(ValueError, match=next(iter(kw))):
        heads.prune_iteratively(ToySeq2Seq(), lambda m: {}, lambda m: 0.0, **kw)


def test_attention_kind():
    assert heads.attention_kind("encoder.layers.0.self_attn") == "encoder self"
    assert heads.attention_kind("decoder.layers.3.self_attn") == "decoder self"
    assert heads.attention_kind("decoder.layers.3.cross_attn") == "cross"
    assert heads.attention_kind("attn") == "self"
