"""``multihead prune``: the objectives' scoring, the command end to end (the real all-MiniLM-L6-v2 and tiny
random decoder and encoder-decoder folders), reloading the saved folder, and every bad input."""

from __future__ import annotations

import contextlib
import json
import logging

import pytest
import torch

pytest.importorskip("transformers")

import checkpoints  # noqa: E402  (tests/checkpoints.py)
import transformers as T  # noqa: E402

from multihead import cli, heads  # noqa: E402
from multihead.bench.measure import Settings  # noqa: E402
from multihead.commands import model_dir  # noqa: E402
from multihead.commands import prune as P  # noqa: E402
from multihead.integrations import transformers as mhtf  # noqa: E402
from multihead.testing import minilm_dir  # noqa: E402

QUICK = Settings(warmup=0, min_rounds=1, max_rounds=1, budget_s=0.0)  # one timing round: tests, not numbers

SENTENCES = [
    "the cat sat on the mat today",
    "a dog ran to the big house",
    "she looked at the red rug quickly",
    "they saw two small dogs in the garden",
    "he ran from the house yesterday",
    "the blue mat was in the garden",
    "we sat on the small rug and looked at it",
    "one cat and three dogs ran to the house",
    "it was a big red house",
    "the dog slowly looked at the cat",
    "they ran quickly to the garden today",
    "a small cat was on the blue rug",
    "he saw the big dog yesterday",
    "she sat in the house and looked at the garden",
]  # words of checkpoints.WORDS (the tiny tokenizer's vocabulary); MiniLM reads them too


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("prune_ckpt")
    return {
        "causal-lm": checkpoints.llama_folder(root / "llama"),
        "encoder-decoder": checkpoints.bart_folder(root / "bart"),
        "masked-lm": checkpoints.bert_mlm_folder(root / "bert_mlm"),
    }


@pytest.fixture
def lines(tmp_path):
    path = tmp_path / "lines.txt"
    path.write_text("\n".join(SENTENCES) + "\n", encoding="utf-8")
    return path


def options(folder, data, out, heads="0.25", recover=0, **kw):
    return P.Options(folder, data, heads, out, recover=recover, progress=False, timing=QUICK, **kw)


# ------------------------------------------------------------------------------------------------
# Objectives
# ------------------------------------------------------------------------------------------------


def _tiny_encoder():
    mhtf.register()
    torch.manual_seed(0)
    config = T.BertConfig(vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                          intermediate_size=64, max_position_embeddings=32)  # fmt: skip
    return T.BertModel(config, add_pooling_layer=False).eval().to(torch.float32).requires_grad_(True), config


def _encoder_batches(model):
    model.set_attn_implementation("multihead")
    ids = [torch.randint(5, 50, (int(n),), generator=torch.Generator().manual_seed(i)).tolist() for i, n in
           enumerate([7, 9, 5, 8, 6, 9])]  # fmt: skip
    tok = type("Tok", (), {"pad_token_id": 0, "all_special_ids": [0]})()
    batches = P.make_batches(ids, tok, "contrastive", 3, 0)
    P.add_targets(model, batches)
    return batches


def test_contrastive_gradient_is_nonzero_at_the_unpruned_model():
    model, _ = _tiny_encoder()
    batches = _encoder_batches(model)
    loss = P.objective_loss("contrastive")(model, batches[0])
    grads = torch.autograd.grad(loss, [p for p in model.parameters() if p.requires_grad], allow_unused=True)
    assert sum(float(g.abs().sum()) for g in grads if g is not None) > 0
    # whereas a plain distance to the original output is flat there: its gradient is exactly zero
    emb = P.embed(model, batches[0])
    flat = torch.autograd.grad(
        ((emb - batches[0].target) ** 2).mean(), model.encoder.layer[0].attention.self.query.weight
    )[0]
    assert float(flat.abs().max()) == 0.0
    scores = heads.importance(model, batches, P.objective_loss("contrastive"))
    assert set(scores) == set(heads.head_counts(model))
    assert all(bool((s > 0).all()) and bool(torch.isfinite(s).all()) for s in scores.values())


def test_contrastive_loss_prefers_the_matching_target():
    target = torch.eye(4)
    assert float(P.contrastive_loss(target, target)) < float(P.contrastive_loss(target, target.roll(1, 0)))


def _rows(batches):
    """Each batch's texts as lists of token ids (padding cut off by the attention mask)."""
    return [
        [ids[att.bool()].tolist() for ids, att in zip(b.inputs["input_ids"], b.inputs["attention_mask"])]
        for b in batches
    ]


def test_mixed_batches_hold_every_text_once_with_lengths_mixed():
    ids = [[7] * n for n in range(1, 17)]  # 16 texts of lengths 1..16
    tok = type("Tok", (), {"pad_token_id": 0, "all_special_ids": [0]})()
    sorted_rows = _rows(P.make_batches(ids, tok, "contrastive", 4, 0))
    mixed_rows = _rows(P.make_batches(ids, tok, "contrastive", 4, 3, mix=True))
    again, other = (_rows(P.make_batches(ids, tok, "contrastive", 4, seed, mix=True)) for seed in (3, 4))
    assert again == mixed_rows and other != mixed_rows  # the seed decides the batches
    assert sorted(map(len, sum(mixed_rows, []))) == list(range(1, 17))  # every text exactly once
    # length-sorted batches span 3 lengths each; dealt out at random they span far more
    assert [max(map(len, r)) - min(map(len, r)) for r in sorted_rows] == [3, 3, 3, 3]
    assert max(max(map(len, r)) - min(map(len, r)) for r in mixed_rows) > 3


@pytest.mark.parametrize("kind", ["masked-lm", "causal-lm", "encoder-decoder"])
def test_lm_objectives_label_and_score(folders, kind):
    ckpt = model_dir.load(folders[kind])
    objective = P.OBJECTIVES[kind]
    ids = P.encode(ckpt.tokenizer, SENTENCES[:6], ckpt.max_length, False)
    batches = P.make_batches(ids, ckpt.tokenizer, objective, 3, 0)
    again = P.make_batches(ids, ckpt.tokenizer, objective, 3, 0)
    for b, c in zip(batches, again):  # deterministic masks
        assert torch.equal(b.inputs["input_ids"], c.inputs["input_ids"]) and torch.equal(b.labels, c.labels)
    for b in batches:
        att = b.inputs["attention_mask"].bool()
        assert bool((b.labels[~att] == -100).all())  # padding never scored
        if objective == "masked-token":
            picked = b.labels != -100
            assert bool(picked.any(1).all())  # every text has a masked token
            assert bool((b.inputs["input_ids"][picked] == ckpt.tokenizer.mask_token_id).all())
            assert float(picked.sum() / att.sum()) < 0.5
        elif objective == "next-token":
            assert torch.equal(b.labels[att], b.inputs["input_ids"][att])
    scores = heads.importance(ckpt.model, batches, P.objective_loss(objective))
    assert set(scores) == set(heads.head_counts(ckpt.model))
    assert all(bool(torch.isfinite(s).all()) and float(s.sum()) > 0 for s in scores.values())


# ------------------------------------------------------------------------------------------------
# Small pieces
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "n"), [("0.25", 18), ("0.5", 36), ("18", 18), ("1", 1), ("0.001", 1), ("66", 66)]
)
def test_heads_to_prune(text, n):
    counts = {f"layer{i}": 12 for i in range(6)}
    assert P.heads_to_prune(P.parse_heads(text), counts) == n


@pytest.mark.parametrize("text", ["0", "1.0", "1.5", "-3", "abc", "nan", "inf", "67", "0.95"])
def test_heads_out_of_range(text):
    counts = {f"layer{i}": 12 for i in range(6)}
    with pytest.raises(P.PruneError, match="--heads"):
        P.heads_to_prune(P.parse_heads(text), counts)


def test_spearman_and_ranks():
    assert P.spearman(torch.tensor([1.0, 2, 3, 4]), torch.tensor([10.0, 30, 20, 40])) == pytest.approx(0.8)
    assert P.spearman(torch.tensor([1.0, 2, 3]), torch.tensor([3.0, 2, 1])) == pytest.approx(-1.0)
    # ties take their average rank: ranks (0, 1.5, 1.5, 3) against (0, 1, 2, 3)
    assert P.spearman(torch.tensor([1.0, 2, 2, 4]), torch.tensor([1.0, 2, 3, 4])) == pytest.approx(0.9486833)


@pytest.mark.parametrize("n", [5, 14, 100])
def test_split_held_out_is_deterministic_and_disjoint(n):
    texts = [f"t{i}" for i in range(n)]
    train, held = P.split_held_out(texts, 0.2)
    assert (train, held) == P.split_held_out(texts, 0.2)
    assert sorted(train + held) == sorted(texts) and len(held) == max(3, round(0.2 * n))


# ------------------------------------------------------------------------------------------------
# End to end
# ------------------------------------------------------------------------------------------------


def _reload(out, cls):
    return mhtf.from_pretrained(cls, out, attn_implementation=mhtf.register())


@pytest.fixture(scope="module")
def minilm_pruned(tmp_path_factory):
    """all-MiniLM-L6-v2 pruned by a quarter (one scoring round, 5 recovery steps): (report, folder)."""
    root = tmp_path_factory.mktemp("minilm")
    data = root / "lines.txt"
    data.write_text("\n".join(SENTENCES) + "\n", encoding="utf-8")
    out = root / "pruned"
    opts = options(minilm_dir(), data, out, heads="0.25", recover=5, rounds=1)
    return P.run(opts, echo=lambda _: None), out


def test_minilm_end_to_end(minilm_pruned):
    report, out = minilm_pruned
    for name in ("model.safetensors", "config.json", "tokenizer.json", "prune_report.json", "prune_report.md",
                 "modules.json", "1_Pooling"):  # fmt: skip
        assert (out / name).exists(), name
    saved = json.loads((out / "prune_report.json").read_text())
    assert saved["heads_before"] == 72 and saved["heads_after"] == 54 == report["heads_after"]
    assert saved["objective"] == "contrastive" and saved["recover_steps"] == 5
    assert saved["params_after"] < saved["params_before"]
    assert -1 <= saved["quality"]["after_prune"] <= 1 and -1 <= saved["quality"]["after_recovery"] <= 1
    assert saved["speed"]["speedup"] > 0 and saved["machine"]
    assert "| heads | 72 | 54 |" in (out / "prune_report.md").read_text()
    layout = json.loads((out / "config.json").read_text())["multihead_heads"]
    assert sum(h for h, _ in layout.values()) + 12 * (6 - len(layout)) == 54
    model = _reload(out, T.AutoModel).eval()
    assert sum(heads.head_counts(model).values()) == 54
    # the saved folder reproduces the held-out quality the report states
    original = _reload(minilm_dir(), T.AutoModel).eval()
    tok = T.AutoTokenizer.from_pretrained(out)
    _, held = P.split_held_out(SENTENCES, 0.2)
    batch = P.make_batches(P.encode(tok, held, 512, False), tok, "contrastive", 16, 0)[0]
    with torch.no_grad():
        ours, theirs = P.embed(model, batch), P.embed(original, batch)
    q = P.spearman(P.pair_similarities(ours), P.pair_similarities(theirs))
    assert q == pytest.approx(saved["quality"]["after_recovery"], abs=1e-5)


def test_pruned_encoder_loads_into_the_task_class(minilm_pruned):
    _, out = minilm_pruned
    base = _reload(out, T.AutoModel).eval()
    task = _reload(out, T.BertForSequenceClassification).eval()
    x = {
        "input_ids": torch.tensor([[101, 1996, 4937, 102]]),
        "attention_mask": torch.ones(1, 4, dtype=torch.long),
    }
    with torch.no_grad():
        torch.testing.assert_close(task.bert(**x).last_hidden_state, base(**x).last_hidden_state)


@pytest.mark.parametrize(
    ("kind", "task_class"), [("causal-lm", "LlamaModel"), ("encoder-decoder", "BartModel")]
)
def test_tiny_lm_end_to_end(tmp_path, folders, lines, kind, task_class):
    out = tmp_path / "pruned"
    report = P.run(options(folders[kind], lines, out, heads="0.25", recover=2), echo=lambda _: None)
    assert report["objective"] == P.OBJECTIVES[kind] and report["quality"]["metric"] == "perplexity ratio"
    assert report["quality"]["after_recovery"] > 0 and report["quality"]["original_loss"] > 0
    loaded = model_dir.load(
        out
    )  # the checkpoint's own class (LlamaForCausalLM, BartForConditionalGeneration)
    assert heads.head_counts(loaded.model) == report["heads_left"]
    assert report["heads_after"] == report["heads_before"] - report["pruned_count"]
    x = torch.tensor([[1, 5, 6, 7, 2]])
    with torch.no_grad():
        if kind == "causal-lm":
            full = loaded.model(input_ids=x).logits
            again = _reload(out, T.AutoModelForCausalLM).eval()(input_ids=x).logits
        else:
            full = loaded.model(input_ids=x, decoder_input_ids=x).logits
            again = _reload(out, T.AutoModelForSeq2SeqLM).eval()(input_ids=x, decoder_input_ids=x).logits
    torch.testing.assert_close(full, again)


def test_cli_runs_prune(tmp_path, folders, lines, capsys):
    out = tmp_path / "pruned"
    code = cli.main(["prune", str(folders["masked-lm"]), "--data", str(lines), "--heads", "2", "--recover", "1",
                     "--out", str(out)])  # fmt: skip
    assert code == 0
    assert json.loads((out / "prune_report.json").read_text())["heads_after"] == 6
    assert "prune_report.md" in capsys.readouterr().out


# ------------------------------------------------------------------------------------------------
# Bad input: exit 2, one line on stderr, nothing written
# ------------------------------------------------------------------------------------------------


def _bad(tmp_path, folders, lines, capsys, argv_for):
    out = tmp_path / "out"
    argv = argv_for(str(folders["masked-lm"]), str(lines), str(out))
    try:
        code = cli.main(argv)
    except SystemExit as e:
        code = e.code
    err = capsys.readouterr().err
    assert code == 2
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert not out.exists()
    return err


@pytest.mark.parametrize(
    ("case", "expect"),
    [
        ("not a checkpoint", "not a checkpoint folder"),
        ("missing data", "no such file"),
        ("empty data", "empty"),
        ("data is a folder", "a directory"),
        ("data not utf-8", "not UTF-8"),
        ("too few texts", "too few"),
        ("heads 0", "--heads"),
        ("heads 1.5", "--heads"),
        ("heads abc", "--heads"),
        ("empties a layer", "would empty a layer"),
        ("fraction empties a layer", "would empty a layer"),
        ("recover -1", "--recover"),
        ("text too long", "--truncate"),
        ("out not empty", "--out"),
    ],
)
def test_bad_input(tmp_path, folders, lines, capsys, case, expect):
    data = lines
    model = None
    heads_arg, recover = "0.25", "0"
    if case == "not a checkpoint":
        model = tmp_path / "nothing"
        model.mkdir()
    elif case == "missing data":
        data = tmp_path / "none.txt"
    elif case == "empty data":
        data.write_text("\n  \n")
    elif case == "data is a folder":
        data = tmp_path
    elif case == "data not utf-8":
        data.write_bytes(b"caf\xe9\n")
    elif case == "too few texts":
        data.write_text("the cat\nthe dog\nthe rug\n")
    elif case.startswith("heads "):
        heads_arg = case.split()[1]
    elif case == "empties a layer":
        heads_arg = "7"  # 2 layers x 4 heads: at most 6 can go
    elif case == "fraction empties a layer":
        heads_arg = "0.9"
    elif case == "recover -1":
        recover = "-1"
    elif case == "text too long":
        data.write_text("\n".join(SENTENCES + ["the cat " * 40]))  # 82 tokens > 64
    elif case == "out not empty":
        (tmp_path / "out").mkdir()
        (tmp_path / "out" / "keep.txt").write_text("mine")

    def argv(folder, data_path, out):
        return ["prune", str(model or folder), "--data", str(data), "--heads", heads_arg, "--recover", recover,
                "--out", out]  # fmt: skip

    if case == "out not empty":
        code_err = _bad_existing(tmp_path, argv, capsys, folders, lines)
        assert expect in code_err
        return
    with _transformers_warnings() as warned:  # its handler writes past capsys: a line of its own on stderr
        assert expect in _bad(tmp_path, folders, lines, capsys, argv)
    assert not warned, [r.getMessage() for r in warned]


@contextlib.contextmanager
def _transformers_warnings():
    """The warnings transformers logs meanwhile (its library logger does not propagate to the root)."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append  # type: ignore[method-assign]
    root = T.logging.get_logger()
    root.addHandler(handler)
    try:
        yield records
    finally:
        root.removeHandler(handler)


def _bad_existing(tmp_path, argv, capsys, folders, lines):
    out = tmp_path / "out"
    code = cli.main(argv(str(folders["masked-lm"]), str(lines), str(out)))
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    return err


def test_truncate_accepts_long_texts(tmp_path, folders, lines):
    lines.write_text("\n".join(SENTENCES + ["the cat " * 40]))
    out = tmp_path / "pruned"
    P.run(options(folders["masked-lm"], lines, out, heads="1", truncate=True), echo=lambda _: None)
    assert (out / "model.safetensors").is_file()


def test_help_has_examples_and_the_default_recovery(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["prune", "--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0 and "examples:\n  multihead prune" in out
    assert f"default {P.DEFAULT_RECOVER}" in out
