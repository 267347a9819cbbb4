"""The benchmark harness (``multihead bench``): smoke run, FLOP counts, statistics, targets, contenders.

Dimensions: B batch, L (cached) length, Lq/Lk query/key lengths, E embed dim, H heads, Hkv kv heads.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import multihead as mh
from multihead import cli
from multihead.bench import Case, Result, Settings, Spread, Target, cpu_suite, cuda_suite, flops, row
from multihead.bench.cases import ragged_lengths
from multihead.bench.contenders import CONTENDERS, build
from multihead.bench.report import load, markdown
from multihead.bench.runner import _measure_in_own_process
from multihead.bench.stats import per_round_ratio, spread
from multihead.bench.targets import describe, evaluate, evaluate_growth

# ----------------------------------------------------------------------------------------------
# The whole quick suite, through the CLI (the ring case runs in its own process via launch)
# ----------------------------------------------------------------------------------------------


def test_bench_quick_smoke(tmp_path, capsys):
    assert cli.main(["bench", "--quick", "--no-progress", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "cpu-quick.json").read_text())
    suite = cpu_suite(quick=True)
    assert report["quick"] and [c["case"]["name"] for c in report["cases"]] == [c.name for c in suite.cases]
    for rec in report["cases"]:
        case = rec["case"]
        ours = rec["results"][case["subject"]]
        assert ours["status"] == "ok", case["name"]
        assert ours["time_s"]["median"] > 0 and ours["time_s"]["q1"] <= ours["time_s"]["q3"]
        assert len(rec["checks"]) == len(case["targets"])
        if not case["memory_only"]:
            assert ours["time_vs_subject"]["median"] == 1.0
    ring = next(r for r in report["cases"] if r["case"]["own_process"])
    assert all(r["peak_memory_mib"] is not None for r in ring["results"].values())  # measured in the child
    assert len(report["sweeps"]) == 1 and report["sweeps"][0]["value"] is not None
    md = (tmp_path / "cpu-quick.md").read_text()
    assert "| case | contender |" in md and "| case | target |" in md and "[" in md
    assert markdown(load(tmp_path / "cpu-quick.json")) == md  # the JSON holds the whole report
    assert (tmp_path / "cpu-quick.png").stat().st_size > 1000
    assert "wrote" in capsys.readouterr().out


def test_bench_memory_case_in_its_own_process():
    """What the fresh process runs for a CPU memory case gives a full record (here in this process)."""
    (case,) = [c for c in cpu_suite(quick=True).cases if c.memory_only and c.mode == "train"]
    record = _measure_in_own_process(case, Settings(warmup=0, min_rounds=1, max_rounds=1, matmul_n=64))
    assert set(record.results) == {r.label for r in case.runs}
    ours = record.results[case.subject]
    assert ours.ok and ours.peak_memory_mib is not None and ours.time_s.median > 0
    assert [c.target for c in record.checks] == [describe(t, case.subject) for t in case.targets]


def test_only_filters_cases_and_refuses_an_unknown_name(capsys):
    suite = cpu_suite(quick=True)
    decode = suite.only("decode")
    assert decode.cases and all("decode" in c.name for c in decode.cases) and len(decode.sweeps) == 1
    assert suite.only("causal").sweeps == []  # the sweep needs every decode case
    assert cli.main(["bench", "--quick", "--only", "no such case"]) == 2
    assert "no case name contains" in capsys.readouterr().err


# ----------------------------------------------------------------------------------------------
# FLOPs: the formula against torch's own count of the matmuls a call runs
# ----------------------------------------------------------------------------------------------


def _counted(fn) -> int:
    with FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops()


def _visible(lq: int, lk: int, causal: bool) -> float:
    """Fraction of (query, key) pairs a mask leaves, by enumerating it (bottom-right causal)."""
    keep = torch.ones(lq, lk, dtype=torch.bool)
    return float((keep.tril(lk - lq) if causal else keep).float().mean())


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("kv_heads", [None, 2], ids=["mha", "gqa"])
def test_bench_flops_formula(kv_heads, causal):
    """flops() equals what FlopCounterMode counts on the math backend's actual call (matmuls only).

    The counter sees every score computed, masked or not; the formula counts the visible pairs, so the
    counted attention is scaled by the mask's visible fraction, counted from the mask itself. Backward:
    the counter sees 2 matmuls per forward matmul; the formula adds flash-attention's recomputation of
    the scores (0.5x the forward attention).
    """
    b, n, e, h = 2, 7, 32, 4
    torch.manual_seed(0)
    mod = mh.MultiHeadAttention(e, h, kv_heads=kv_heads)
    mod.backend = "math"  # plain matmuls, which the counter knows (the CPU flash kernel it does not)
    x = torch.randn(b, n, e, requires_grad=True)
    q, k, v = (t.detach() for t in mod.project(x, x, x))  # (B, H, L, D), (B, Hkv, L, D) x2
    attn = _counted(lambda: mh.attention(q, k, v, backend="math")) * _visible(n, n, causal)
    proj = _counted(lambda: mod(x, causal=causal)) - _counted(lambda: mh.attention(q, k, v, backend="math"))
    case = Case("x", b, n, e, h, kv_heads=kv_heads, causal=causal)
    assert flops(case) == pytest.approx(proj + attn)
    assert flops(Case("x", b, n, e, h, kv_heads=kv_heads, causal=causal, level="attention")) == pytest.approx(
        attn
    )
    train = _counted(lambda: mod(x, causal=causal).sum().backward())
    expected = train - 3 * _counted(lambda: mh.attention(q, k, v, backend="math")) + 3.5 * attn
    assert flops(Case("x", b, n, e, h, kv_heads=kv_heads, causal=causal, mode="train")) == pytest.approx(
        expected
    )


def test_bench_flops_of_a_decoding_step():
    """One new token against L cached keys: the step's counted matmuls (projections of one token)."""
    b, n, e, h = 1, 9, 32, 4
    mod = mh.MultiHeadAttention(e, h)
    mod.backend = "math"
    cache = mh.KVCache()
    cache.update(torch.randn(b, h, n, e // h), torch.randn(b, h, n, e // h))  # (B, H, L, D) cached
    x = torch.randn(b, 1, e)
    with torch.no_grad():
        counted = _counted(lambda: mod(x, cache=cache, causal=True))
    case = Case("x", b, n, e, h, query_length=1, causal=True, level="decode")
    assert case.lk == n + 1 and _visible(1, n + 1, True) == 1.0
    assert flops(case) == counted


# ----------------------------------------------------------------------------------------------
# Statistics and targets
# ----------------------------------------------------------------------------------------------


def test_spread_and_per_round_ratio():
    assert spread([5.0, 1.0, 3.0, 2.0, 4.0]) == Spread(3.0, 2.0, 4.0, 5)
    assert spread([2.0]) == Spread(2.0, 2.0, 2.0, 1)
    # per round: (2/1, 6/2, 4/4) = (2, 3, 1): the ratio of medians (4/2 = 2) would hide the spread
    assert per_round_ratio([2.0, 6.0, 4.0], [1.0, 2.0, 4.0]) == Spread(2.0, 1.5, 2.5, 3)
    with pytest.raises(ValueError, match="at least one round"):
        spread([])


def _ok(times, mem=None, of_matmul=None):
    return Result("ok", list(times), spread(times), of_matmul=of_matmul, peak_memory_mib=mem)


def test_targets_are_checked_by_code_and_printed_in_words():
    results = {
        "multihead": _ok([1.0, 1.0, 1.0, 1.0], mem=80.0, of_matmul=Spread(0.9, 0.88, 0.92, 4)),
        "torch": _ok([2.0, 1.0, 1.6, 1.8], mem=100.0),
        "torch@mode=forward-train-module": _ok([3.0, 3.0, 3.0, 3.0], mem=120.0),
        "naive": Result("skipped: would hold (B, H, Lq, Lk) = 32.0 GiB"),
    }
    fast = evaluate(Target("speedup", "torch", ">=", 1.5), "multihead", results)
    assert fast.target == "multihead >= 1.5x faster than torch"
    assert (
        fast.met and not fast.clear and fast.value.median == pytest.approx(1.7)
    )  # per round: 2, 1, 1.6, 1.8
    assert fast.value.q1 < 1.5 < fast.value.q3 and fast.verdict == "yes (within spread)"
    slow = evaluate(Target("speedup", "torch", ">=", 2.5), "multihead", results)
    assert slow.met is False and slow.clear and slow.verdict == "**no**"
    # a contender name stands for its best run: the smaller peak memory of the two torch runs
    mem = evaluate(Target("memory", "torch", "<=", 0.8), "multihead", results)
    assert mem.value.median == pytest.approx(0.8) and mem.met and mem.target.endswith("torch's")
    time = evaluate(Target("time", "torch@mode=forward-train-module", "<=", 0.5), "multihead", results)
    assert time.value.median == pytest.approx(1 / 3) and time.met and time.clear
    assert evaluate(Target("matmul", None, ">=", 0.85), "multihead", results).verdict == "yes"
    # the plain torch run skipped (too big): its name still stands for the run that completed
    results["torch"] = Result("skipped: would hold (B, H, Lq, Lk) = 32.0 GiB")
    assert evaluate(Target("memory", "torch", "<=", 0.8), "multihead", results).value.median == pytest.approx(
        80 / 120
    )
    assert evaluate(Target("speedup", "naive", ">=", 1.0), "multihead", results).verdict == "n/a"
    with pytest.raises(ValueError, match="sweep"):
        evaluate(Target("growth", "torch", "<=", 1.2), "multihead", results)


def test_growth_over_a_sweep():
    flat = [Spread(1.1, 1.0, 1.2, 9), Spread(1.05, 1.0, 1.1, 9), Spread(1.0, 0.95, 1.05, 9)]
    copying = [Spread(1.1, 1.0, 1.2, 9), Spread(1.8, 1.7, 1.9, 9), Spread(3.3, 3.1, 3.5, 9)]
    target = Target("growth", "bare", "<=", 1.25)
    ok, bad = evaluate_growth(target, "multihead", flat), evaluate_growth(target, "multihead", copying)
    assert ok.met and ok.value.median == pytest.approx(1.0 / 1.1)
    assert bad.met is False and bad.clear and bad.value.q1 == pytest.approx(3.1 / 1.2)
    assert evaluate_growth(target, "multihead", [None, flat[0]]).verdict == "n/a"


# ----------------------------------------------------------------------------------------------
# Contenders
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("suite", [cpu_suite, cuda_suite], ids=["cpu", "cuda"])
def test_every_row_of_a_suite_has_a_contender(suite):
    for quick in (True, False):
        for case in suite(quick).cases:
            assert case.subject in {r.label for r in case.runs}, case.name
            for r in case.runs:
                assert (r.contender, case.variant(r).level) in CONTENDERS, (case.name, r.label)


def test_unknown_contender_names_the_known_ones():
    with pytest.raises(ValueError, match=r"no contender 'ring' at level 'module'; known there: \['keras'"):
        build("ring", Case("x", 1, 4, 16, 2), torch.device("cpu"))


def test_sdpa_module_is_the_same_projections_around_sdpa():
    """The module-level sdpa peer computes what MultiHeadAttention computes (same weights, same seed)."""
    case = Case("x", 2, 9, 16, 4, causal=True, dtype="float64")
    ours, peer = (build(name, case, torch.device("cpu")).run() for name in ("multihead", "sdpa"))
    torch.testing.assert_close(peer, ours, rtol=0, atol=1e-12)


def test_cuda_suite_names_each_sdpa_backend_and_the_window_target():
    from multihead.bench.cases import cuda_suite

    suite = cuda_suite(quick=True)
    grid = [c for c in suite.cases if c.level == "module"]
    assert grid and all({r.label for r in c.runs} >= {"sdpa@sdpa_backend=flash", "torch"} for c in grid)
    window = next(c for c in suite.cases if "window" in c.name)
    assert any(t.peer == "multihead@mask=None" and t.bound == 0.25 for t in window.targets)


def test_row_labels_and_variants():
    r = row("multihead", causal=False)
    assert r.label == "multihead@causal=False"
    case = Case("x", 1, 4, 16, 2, causal=True, runs=(row("multihead"), r))
    assert case.variant(r).causal is False and case.variant(case.runs[0]) is case


@pytest.mark.parametrize("steps", [1, 3])
def test_decode_step_equals_its_bare_work_and_keeps_its_length(steps):
    """The two decode contenders compute the same output, every round from the same cached length."""
    case = Case("x", 2, 6, 32, 4, kv_heads=2, query_length=1, causal=True, level="decode", steps=steps)
    cpu = torch.device("cpu")
    ours, bare = build("multihead", case, cpu), build("bare", case, cpu)
    for _ in range(3):
        ours.prepare()
        out = ours.run()
        torch.testing.assert_close(out, bare.run())
        assert out.shape == (2, 1, 32)


# ----------------------------------------------------------------------------------------------
# Ragged batches and sliding windows
# ----------------------------------------------------------------------------------------------


def test_ragged_lengths_are_long_tailed_and_fixed():
    lengths = ragged_lengths()
    assert lengths == ragged_lengths() and len(lengths) == 32
    assert min(lengths) >= 32 and max(lengths) == 1024
    assert sorted(lengths)[16] < 300  # most sequences short, a few long


def test_flops_of_ragged_and_window_cases_count_the_visible_pairs():
    ragged = Case("x", 1, 12, 32, 4, causal=True, level="attention", lengths=(3, 9))
    parts = [Case("x", 1, n, 32, 4, causal=True, level="attention") for n in (3, 9)]
    assert flops(ragged) == sum(flops(c) for c in parts)
    n, w = 40, 7
    keep = mh.masks.sliding_window(n, window=w)  # causal window of w keys, bottom-right aligned
    window = Case("x", 2, n, 32, 4, causal=True, level="attention", window=w)
    assert flops(window) == 4 * 2 * 4 * 8 * int(keep.sum())
    assert "window=7" in window.shape() and "2 sequences of 3-9 tokens" in ragged.shape()


@pytest.mark.parametrize("mode", ["forward", "train"])
def test_packed_sequences_and_padded_compute_the_same(mode):
    """The three ragged-batch contenders run the same attention on the same numbers."""
    lengths = (3, 7, 2, 5)
    case = Case("x", 1, sum(lengths), 32, 4, causal=True, mode=mode, level="attention", lengths=lengths)
    cpu = torch.device("cpu")
    if mode == "train":  # each step runs forward + backward and returns nothing: it must not fail
        for name in ("packed", "sequences", "padded"):
            build(name, case, cpu).run()
        return
    packed = build("packed", case, cpu).run()  # (1, H, sum n, D)
    sequences = build("sequences", case, cpu).run()  # [(1, H, n, D)]
    padded = build("padded", case, cpu).run()  # (N, H, max n, D)
    for i, (piece, n) in enumerate(zip(packed.split(lengths, dim=2), lengths, strict=True)):
        torch.testing.assert_close(piece, sequences[i])
        torch.testing.assert_close(piece[0], padded[i, :, :n])


def test_window_contender_passes_a_mask_function():
    case = Case("x", 1, 24, 32, 4, causal=True, level="attention", window=5)
    got = build("multihead", case, torch.device("cpu")).run()  # (1, H, L, D)
    torch.manual_seed(0)  # the contender's inputs
    q, k, v = (torch.randn(1, 4, 24, 8) for _ in range(3))
    want = mh.attention_reference(q, k, v, mask=mh.masks.sliding_window(24, window=5))
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("suite", [cpu_suite, cuda_suite], ids=["cpu", "cuda"])
def test_every_target_names_a_run_of_its_case(suite):
    for case in suite(False).cases:
        labels = {r.label for r in case.runs}
        contenders = {r.contender for r in case.runs}
        for t in case.targets:
            assert t.peer is None or t.peer in labels or t.peer in contenders, (case.name, t)


@pytest.mark.parametrize("n", range(1, 9))
def test_balanced_orders_put_every_step_after_every_other_equally_often(n):
    from collections import Counter

    from multihead.bench.measure import balanced_orders

    orders = balanced_orders(n)
    assert all(sorted(o) == list(range(n)) for o in orders)
    after = Counter((o[j], o[j + 1]) for o in orders for j in range(n - 1))
    assert set(after) == {(a, b) for a in range(n) for b in range(n) if a != b}  # every ordered pair ...
    assert len(set(after.values())) <= 1  # ... equally often (a rotation keeps each step's predecessor)


def test_interleaved_rounds_balance_the_order_and_drop_a_failing_step():
    """Over a cycle of rounds every step runs right after every other equally often (what runs before a
    step changes its time), and a step that raises leaves the later rounds with its error reported."""
    from multihead.bench.contenders import Step
    from multihead.bench.measure import interleaved

    calls: list[str] = []

    def record(name: str):
        return Step(lambda: calls.append(name))

    def broken():
        calls.append("c")
        raise RuntimeError("no")

    settings = Settings(warmup=0, min_rounds=3, max_rounds=3, budget_s=0.0)
    steps = {"a": record("a"), "b": record("b"), "c": Step(broken)}
    times, errors = interleaved(steps, torch.device("cpu"), settings, lambda text: None)
    assert calls == ["a", "b", "c", "b", "a", "a", "b"]  # then b a, a b: each after the other once (c gone)
    assert len(times["a"]) == len(times["b"]) == 3 and "c" not in times
    assert errors["c"].startswith("error: RuntimeError: no")
    calls.clear()
    settings = Settings(warmup=0, min_rounds=4, max_rounds=4, budget_s=0.0)
    interleaved({n: record(n) for n in "wxyz"}, torch.device("cpu"), settings, lambda text: None)
    rounds = [calls[i : i + 4] for i in range(0, 16, 4)]
    pairs = {(r[j], r[j + 1]) for r in rounds for j in range(3)}
    assert len(pairs) == 12  # 4 rounds of 4 steps: all 12 ordered pairs, each once


def test_chart_of_many_cases_puts_each_contender_relative_to_the_subject_on_one_row_per_case():
    """Past BARS_UP_TO cases the left panel is one row per case: each contender's point sits at its median
    per-round time ratio to the subject, the subject on 1."""
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from multihead.bench import report as rep

    base = load(Path(__file__).parent.parent / "benchmarks" / "results" / "cuda_h100.json")
    cases = [r for r in base.cases if r.case.level != "decode"]
    assert len(cases) > rep.BARS_UP_TO
    labels = ["multihead", "flex"]
    fig, ax = plt.subplots()
    rep._relative_rows(ax, cases, labels)
    assert [t.get_text() for t in ax.get_yticklabels()] == [r.case.name for r in cases]
    for lab, points in zip(labels, ax.collections, strict=True):
        expected = [
            (r.results[lab].time_vs_subject.median, i) for i, r in enumerate(cases) if lab in r.results
        ]
        assert points.get_offsets().tolist() == [list(p) for p in expected]
    assert all(x == 1.0 for x, _ in ax.collections[0].get_offsets().tolist())  # the subject itself
    plt.close(fig)


def _bench_module(name: str):
    """A script of ``benchmarks/`` imported as a module (the folder and its ``data/`` on the path)."""
    import importlib
    import sys

    root = Path(__file__).resolve().parent.parent / "benchmarks"
    for folder in (root, root / "data"):
        if str(folder) not in sys.path:
            sys.path.insert(0, str(folder))
    return importlib.import_module(name)


def test_prune_curve_report_is_its_json_and_counts_doublings():
    pytest.importorskip("transformers")
    curve = _bench_module("bench_prune_curve")
    committed = Path(curve.RESULTS)
    res = json.loads((committed / "prune_curve.json").read_text())
    assert (committed / "prune_curve.md").read_text() == curve.markdown(res)  # the table is its JSON
    stage = [
        {"stage": s, "held_out": 0.9, "validation": 0.9, "kept": True}
        for s in ("pruned", "refit", "reconstructed", "recovered")
    ]
    two = dict(res, records=[
        {"heads": "0.5", "lines": 100, "stages": stage, "external": 0.90, "command_seconds": 1.0},
        {"heads": "0.5", "lines": 400, "stages": stage, "external": 0.92, "command_seconds": 2.0},
    ])  # fmt: skip
    assert "--heads 0.5: +0.0100 per doubling of the lines (100 -> 400)" in curve.markdown(two)


@pytest.mark.parametrize(
    ("module", "stem"), [("bench_prune", "prune"), ("bench_prune_interval", "prune_interval")]
)
def test_prune_reports_are_their_json(module, stem):
    pytest.importorskip("transformers")
    bench = _bench_module(module)
    res = json.loads((Path(bench.RESULTS) / f"{stem}.json").read_text())
    assert (Path(bench.RESULTS) / f"{stem}.md").read_text() == bench.markdown(res)


def test_prune_interval_maps_batch_rows_back_to_their_texts():
    pytest.importorskip("transformers")
    import transformers as T

    from multihead.commands import prune
    from multihead.testing import minilm_dir

    bench = _bench_module("bench_prune_interval")
    tok = T.AutoTokenizer.from_pretrained(minilm_dir())
    texts = ["a long sentence with many more words in it", "short", "a mid-sized one here", "short", "x y"]
    batches = prune.make_batches(prune.encode(tok, texts, 512, True), tok, prune.Embedding(), 2, 0)
    rows = bench._rows(batches, texts, tok)
    assert sorted(i for r in rows for i in r) == list(range(len(texts)))  # each text once, duplicates too
    ids = prune.encode(tok, texts, 512, True)
    for b, r in zip(batches, rows, strict=True):
        for got, att, i in zip(b.inputs["input_ids"], b.inputs["attention_mask"], r, strict=True):
            assert got[att.bool()].tolist() == ids[i]


@pytest.mark.parametrize(
    ("module", "stem"),
    [("lens_report", "lens_cpu"), ("lens_report", "lens_cpu_zen1"), ("lens_induction", "lens_induction")],
)
def test_lens_reports_are_their_json(module, stem):
    """The committed lens comparison (bench_lens.py) and worked example (lens_induction.py) are their JSON."""
    report = _bench_module(module)
    results = Path(__file__).resolve().parent.parent / "benchmarks" / "results"
    res = json.loads((results / f"{stem}.json").read_text())
    assert (results / f"{stem}.md").read_text() == report.markdown(res)


def test_cpu_table_in_the_docs_is_the_committed_reports():
    """docs/performance.md's per-CPU table is what benchmarks/cpu_table.py makes of the committed reports,
    with a column for each CPU and every target of the reports as a row."""
    table = _bench_module("cpu_table")
    text = table.table()
    assert text in table.DOC.read_text()
    header = text.splitlines()[0]
    assert all(column in header for column in table.COLUMNS)
    rows, cells, _ = table.collect()
    assert rows and all(cells[c] for c in table.COLUMNS)
