"""``multihead prune --quality Q``: the search for the most heads that keep a share of the validation quality
(on a stand-in refit and validation), the command end to end on tiny random checkpoints, and its usage
errors; grouped-query heads chosen by whole groups; the benchmarks' peer (gradient importance, recovery
only)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

pytest.importorskip("transformers")

import checkpoints  # noqa: E402  (tests/checkpoints.py)

from multihead import cli  # noqa: E402
from multihead.bench.measure import Settings  # noqa: E402
from multihead.commands import prune as P  # noqa: E402

QUICK = Settings(warmup=0, min_rounds=1, max_rounds=1, budget_s=0.0)


class _Counted(torch.nn.Module):
    """A stand-in model: one attention module whose head count the fake validation reads."""

    def __init__(self, heads: int) -> None:
        super().__init__()
        import multihead as mh

        self.attn = mh.MultiHeadAttention(4 * heads, heads)


def _fake_search(heads, losses, quality):
    """Run :func:`P.search` over ``heads`` - 1 removable heads where removing ``n`` keeps ``losses[n]``."""
    original = _Counted(heads)
    order = [("attn", (h,)) for h in range(heads - 1)]
    calls = []

    def refit(model, removed):
        calls.append(sum(len(v) for v in removed.values()))
        return model

    def validate(model):
        return losses[heads - model.attn.num_heads]

    floor, model = P.search(original, order, quality, refit, validate)
    return floor, model, calls


@pytest.mark.parametrize(("quality", "expect"), [(0.995, 0), (0.975, 2), (0.955, 4), (0.94, 6), (0.5, 7)])
def test_search_finds_the_most_heads_above_the_floor(quality, expect):
    losses = [1.0 - 0.01 * n for n in range(8)]  # removing n heads keeps 1 - 0.01 n
    floor, model, calls = _fake_search(8, losses, quality)
    assert floor.n == expect and floor.most == 7
    assert all((q >= quality) == (n <= expect) for n, q in floor.tried.items())  # never a wrong side
    assert len(calls) <= 3 and set(calls) == set(floor.tried)  # log2(8) refits, each measured once
    if expect == 0:
        assert model is None
    else:
        assert model.attn.num_heads == 8 - expect and floor.tried[expect] >= quality
    nxt = floor.next_head()
    assert nxt == (None if expect == 7 else (expect + 1, pytest.approx(1.0 - 0.01 * (expect + 1))))
    d = floor.as_dict()
    assert d["removable"] == expect and (d["next"] is None) == (expect == 7)


@pytest.mark.parametrize(("text", "ok"), [("0.99", True), ("0.5", True), ("1", False), ("0", False),
                                          ("1.5", False), ("abc", False)])  # fmt: skip
def test_parse_quality(text, ok):
    if ok:
        assert P.parse_quality(text) == float(text)
    else:
        with pytest.raises(P.PruneError, match="--quality"):
            P.parse_quality(text)


def test_relative_quality_of_each_objective():
    assert P.Embedding().relative(0.97) == 0.97
    assert P.CausalLM().relative(1.25) == pytest.approx(0.8)  # perplexity ratio 1.25 keeps 1 / 1.25


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return checkpoints.llama_folder(tmp_path_factory.mktemp("floor") / "llama")


def _lines(tmp_path):
    subjects = ["the cat", "a dog", "she", "he", "they", "we", "the big dog", "one small cat"]
    verbs = ["sat on", "ran to", "looked at", "saw"]
    things = ["the mat", "the red rug", "the house", "the blue garden", "the garden"]
    path = tmp_path / "lines.txt"
    path.write_text("\n".join(f"{s} {v} {t}" for s in subjects for v in verbs for t in things[:2]) + "\n")
    return path


def test_quality_floor_end_to_end(tmp_path, llama):
    out = tmp_path / "out"
    opts = P.Options(llama, _lines(tmp_path), None, out, quality="0.9", recover=2, reconstruct=4,
                     progress=False, timing=QUICK)  # fmt: skip
    report = P.run(opts, echo=lambda _: None)
    floor = report["floor"]
    assert report["quality_arg"] == "0.9" and report["heads_arg"] is None
    assert floor["removable"] == report["pruned_count"] == report["heads_before"] - report["heads_after"]
    # 2 layers x 4 query heads over 2 key/value heads: whole groups of 2 go, each layer keeps one
    assert 1 <= floor["removable"] <= floor["most"] == 4 and floor["removable"] % 2 == 0
    tried = {int(k): v for k, v in floor["tried"].items()}
    assert tried[floor["removable"]] >= 0.9 and all(
        v < 0.9 for k, v in tried.items() if k > floor["removable"]
    )
    stages = {s["stage"]: s for s in report["quality"]["stages"]}
    refit = stages["refit"]
    assert 1 / refit["validation"] == pytest.approx(
        tried[floor["removable"]]
    )  # the search's refit is the stage's
    kept = [s for s in report["quality"]["stages"] if s["kept"]][-1]
    assert 1 / kept["validation"] >= 0.9  # the saved model keeps the floor on the validation texts
    decode = report["speed"]["decode"]  # a causal LM: greedy decoding speed and the KV cache's size
    kv_heads = [h // 2 for h in report["heads_left"].values()]  # 2 query heads per key/value head
    assert decode["kv_bytes_per_token"] == [
        2 * 2 * 2 * 8 * 4,
        sum(2 * k * 8 * 4 for k in kv_heads),
    ]  # K and V, D = 8
    assert decode["original_tokens_per_s"] > 0 and decode["pruned_tokens_per_s"] > 0
    text = (out / "prune_report.md").read_text()
    assert "KV cache per token" in text and "tokens/s" in text
    assert "`--quality 0.9`" in text and "**Quality floor 0.9:**" in text
    assert json.loads((out / "prune_report.json").read_text())["floor"] == floor


@pytest.mark.parametrize(
    ("args", "expect"),
    [
        ([], "give --heads"),
        (["--heads", "0.25", "--quality", "0.99"], "not both"),
        (["--quality", "1.5"], "--quality must be"),
    ],
)
def test_amount_usage_errors(tmp_path, llama, capsys, args, expect):
    out = tmp_path / "out"
    argv = ["prune", str(llama), "--data", str(_lines(tmp_path)), "--recover", "0", "--reconstruct", "0",
            "--out", str(out), *args]  # fmt: skip
    code = cli.main(argv)
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1 and expect in err, err
    assert not out.exists()


def test_no_head_keeps_the_floor(tmp_path, llama, monkeypatch):
    monkeypatch.setattr(P.Stages, "relative", lambda self, model: 0.5)  # every count tried keeps half
    out = tmp_path / "out"
    opts = P.Options(llama, _lines(tmp_path), None, out, quality="0.9", recover=0, reconstruct=0,
                     progress=False, timing=QUICK)  # fmt: skip
    with pytest.raises(P.PruneError, match="no head can go"):
        P.run(opts, echo=lambda _: None)
    assert not out.exists()


def test_grouped_query_heads_go_by_whole_groups_and_the_kv_heads_shrink():
    """Under GQA the choice takes the query heads sharing a key/value head together, so the pruned module has
    fewer key/value heads (an uneven pick would make heads.prune repeat them and grow the KV cache)."""
    import multihead as mh
    from multihead import heads

    torch.manual_seed(0)
    model = torch.nn.ModuleDict(
        {"a": mh.MultiHeadAttention(24, 6, kv_heads=2), "b": mh.MultiHeadAttention(24, 6)}
    )
    assert P.gqa_groups(model) == {"a": 3}
    fits = {}
    for name in ("a", "b"):
        fit = P.LeastSquares(24, 24)
        x = torch.randn(200, 24, dtype=torch.float64)
        fit.add(x, x @ torch.randn(24, 24, dtype=torch.float64))
        fits[name] = fit
    order = P.removal_order(fits, {"a": 6, "b": 6}, 8, groups=P.gqa_groups(model))
    assert all(len(u) == (3 if name == "a" else 1) for name, u in order)
    assert all(u in [(0, 1, 2), (3, 4, 5)] for name, u in order if name == "a")
    assert sum(len(u) for _, u in order) <= 8
    removed = P.grouped(order, ["a", "b"])
    small = heads.prune(model, removed)
    if "a" in removed:
        assert small["a"].kv_heads == 1 and small["a"].num_heads == 3
    with pytest.raises(P.PruneError, match="one key/value group"):
        P.heads_to_prune(9, {"a": 6, "b": 6}, {"a": 3})  # a keeps 3, b keeps 1: at most 8
    assert P.heads_to_prune(8, {"a": 6, "b": 6}, {"a": 3}) == 8


@pytest.mark.parametrize(
    ("value", "counts", "groups", "n"),
    [
        (0.25, {f"l{i}": 9 for i in range(30)}, {f"l{i}": 3 for i in range(30)}, 66),  # SmolLM2: 68 -> 66
        (8, {"a": 6, "b": 6}, {"a": 3}, 8),  # b's single heads fill in: no rounding
        (7, {"a": 6, "b": 6}, {"a": 3, "b": 3}, 6),
        (0.5, {"a": 8, "b": 8}, {"a": 2, "b": 4}, 8),  # units of 2 and 4: multiples of 2
        (3, {"a": 6}, {"a": 3}, 3),
    ],
)
def test_heads_count_is_rounded_to_whole_groups(value, counts, groups, n):
    assert P.heads_to_prune(value, counts, groups) == n


def test_fewer_heads_than_a_group_is_a_usage_error():
    with pytest.raises(P.PruneError, match="groups of 3; ask for 3 heads or more"):
        P.heads_to_prune(2, {"a": 6}, {"a": 3})


def test_first_line_states_the_heads_that_go(tmp_path, llama):
    """Under GQA (2 query heads a key/value head) ``--heads 3`` removes 2: the first line says 2, not 3."""
    lines = []
    opts = P.Options(llama, _lines(tmp_path), "3", tmp_path / "out", recover=0, reconstruct=0, progress=False,
                     timing=QUICK)  # fmt: skip
    report = P.run(opts, echo=lines.append)
    assert report["pruned_count"] == 2 == report["heads_before"] - report["heads_after"]
    assert "pruning 2 heads" in lines[0], lines[0]


def test_the_gradient_importance_peer_recovers_only(tmp_path, llama):
    out = tmp_path / "out"
    opts = P.Options(llama, _lines(tmp_path), "3", out, recover=2, importance_rounds=1, progress=False,
                     timing=QUICK)  # fmt: skip
    report = P.run(opts, echo=lambda _: None)
    assert [s["stage"] for s in report["quality"]["stages"]] == ["pruned", "recovered"]
    assert report["pruned_count"] == 3 == report["heads_before"] - report["heads_after"]  # single heads
    with pytest.raises(P.PruneError, match="not --quality"):
        P.run(dataclasses.replace(opts, heads=None, quality="0.9", out=tmp_path / "o2"), echo=lambda _: None)


def test_default_training_steps_shrink_with_the_models_size():
    assert P.size_scale(22_713_216) == 1.0 == P.size_scale(1000)  # MiniLM (the reference) and smaller
    assert P.size_scale(134_515_008) == pytest.approx(0.1689, abs=1e-4)  # SmolLM2-135M
    assert (
        P.recover_steps(None, scale=0.5) == 120 and P.recover_steps(None, reconstructed=True, scale=0.5) == 60
    )
    assert P.recover_steps("7", scale=0.1) == 7  # an explicit --recover holds
    assert P.reconstruct_steps(None) == 300 and P.reconstruct_steps(None, layers=12) == 150
    assert P.reconstruct_steps(None, scale=0.1689, layers=30) == 0  # 10 a layer: below one check's worth
    assert P.reconstruct_steps("40", scale=0.1689, layers=30) == 40
