"""``multihead view`` and the checkpoint-folder loader it shares with ``multihead prune``.

The loader is checked on the real all-MiniLM-L6-v2 folder and on tiny random folders of every kind;
bad folders give one-line :class:`NotACheckpoint` errors naming the folder and the cause.
"""

from __future__ import annotations

import base64
import json
import math
import zlib
from html.parser import HTMLParser

import numpy as np
import pytest
import torch
from browser import need_chromium
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("transformers")

import checkpoints  # noqa: E402  (tests/checkpoints.py)

from multihead.commands import model_dir  # noqa: E402
from multihead.testing import minilm_dir, render  # noqa: E402
from multihead.viz import page  # noqa: E402

BUILDERS = {
    "causal-lm": checkpoints.llama_folder,
    "encoder-decoder": checkpoints.bart_folder,
    "masked-lm": checkpoints.bert_mlm_folder,
}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """One tiny folder per kind, written once for the module."""
    root = tmp_path_factory.mktemp("checkpoints")
    return {kind: build(root / kind.replace("-", "_")) for kind, build in BUILDERS.items()}


# ------------------------------------------------------------------------------------------------
# The loader
# ------------------------------------------------------------------------------------------------


def test_loader_reads_the_real_checkpoint_on_multihead():
    from multihead import heads

    ckpt = model_dir.load(minilm_dir())
    assert ckpt.kind == "encoder" and type(ckpt.model).__name__ == "BertModel"
    assert ckpt.model.config._attn_implementation == "multihead" and not ckpt.model.training
    assert ckpt.max_length == 512 and ckpt.path == minilm_dir()
    assert list(heads.head_counts(ckpt.model).values()) == [12] * 6


@pytest.mark.parametrize("kind", sorted(BUILDERS))
def test_loader_detects_the_kind_of_tiny_folders(folders, kind):
    ckpt = model_dir.load(folders[kind])
    assert ckpt.kind == kind and ckpt.max_length == 64
    assert ckpt.model.config._attn_implementation == "multihead"
    assert ckpt.tokenizer("the cat sat").input_ids[0] == 1  # <s>


@pytest.mark.parametrize(
    ("architectures", "extra", "kind"),
    [
        (["BertModel"], {"model_type": "bert"}, "encoder"),
        (["GPT2Model"], {"model_type": "gpt2"}, "decoder"),
        (["GPT2LMHeadModel"], {"model_type": "gpt2"}, "causal-lm"),
        (["RobertaForMaskedLM"], {"model_type": "roberta"}, "masked-lm"),
        (["T5ForConditionalGeneration"], {"model_type": "t5"}, "encoder-decoder"),
        ([], {"model_type": "bart", "is_encoder_decoder": True}, "encoder-decoder"),
    ],
)
def test_detect_kind_from_architectures(architectures, extra, kind):
    assert model_dir.detect_kind({"architectures": architectures, **extra}) == kind


def test_minilm_dir_unpacks_once(tmp_path):
    first = minilm_dir(tmp_path)
    stamp = (first / "config.json").stat().st_mtime_ns
    assert minilm_dir(tmp_path) == first and (first / "config.json").stat().st_mtime_ns == stamp
    assert [p.name for p in tmp_path.iterdir()] == [first.name]  # no temporary folder left behind


def _bad_folders(tmp_path, good):
    """(folder, expected words) of folders that are not checkpoints."""
    import shutil

    out = [(tmp_path / "missing", "(no such directory)")]
    (tmp_path / "file.txt").write_text("x")
    out.append((tmp_path / "file.txt", "not a directory"))
    (tmp_path / "empty").mkdir()
    out.append((tmp_path / "empty", "(no config.json)"))
    for name, drop, words in [
        ("no_weights", "model.safetensors", "(no weights"),
        ("no_tokenizer", "tokenizer", "(no tokenizer"),
    ]:
        shutil.copytree(good, tmp_path / name)
        for p in (tmp_path / name).glob(f"{drop}*"):
            p.unlink()
        out.append((tmp_path / name, words))
    shutil.copytree(good, tmp_path / "bad_json")
    (tmp_path / "bad_json" / "config.json").write_text("{not json")
    out.append((tmp_path / "bad_json", "not valid JSON"))
    shutil.copytree(good, tmp_path / "unknown_arch")
    cfg = json.loads((tmp_path / "unknown_arch" / "config.json").read_text())
    cfg["architectures"] = ["NoSuchModelForCausalLM"]
    (tmp_path / "unknown_arch" / "config.json").write_text(json.dumps(cfg))
    out.append((tmp_path / "unknown_arch", "NoSuchModelForCausalLM"))
    return out


def test_loader_refuses_what_is_not_a_checkpoint(tmp_path, folders):
    for folder, words in _bad_folders(tmp_path, folders["causal-lm"]):
        with pytest.raises(model_dir.NotACheckpoint) as e:
            model_dir.load(folder)
        message = str(e.value)
        assert words in message and str(folder) in message and "\n" not in message, message


# ------------------------------------------------------------------------------------------------
# The command: run it, then read the page back independently
# ------------------------------------------------------------------------------------------------

TEXT = "The cat sat on the mat, and the dog ran to the big red house."


def run_view(capsys, argv):
    """``(exit status, stdout, stderr)`` of ``multihead view ARGV`` in this process."""
    from multihead import cli

    try:
        code = cli.main(["view", *map(str, argv)])
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


class _Page(HTMLParser):
    """Collects the tags, external references and the embedded data of a page; fails on unbalanced tags."""

    VOID = {"meta", "br", "img", "input", "link", "hr"}

    def __init__(self):
        super().__init__()
        self.stack, self.tags, self.refs, self.data, self._in_data = [], [], [], None, False

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        self.tags.append(tag)
        self.refs += [v for k, v in a.items() if k in ("src", "href") and v]
        if tag not in self.VOID:
            self.stack.append(tag)
        self._in_data = a.get("id") == "mh-data"

    def handle_endtag(self, tag):
        assert self.stack and self.stack.pop() == tag, f"unbalanced </{tag}>"
        self._in_data = False

    def handle_data(self, data):
        if self._in_data:
            self.data = (self.data or "") + data


def read_page(path):
    """The page's embedded data (checked to be well-formed, offline HTML) with every head decoded to
    float64 arrays (H, Lq, Lk) and every thumbnail to uint8 pixels (H, R, C): our own decoder of the
    documented format, not the library's."""
    text = path.read_text(encoding="utf-8")
    assert text.startswith("<!DOCTYPE html>")
    parser = _Page()
    parser.feed(text)
    parser.close()
    assert parser.stack == [] and parser.refs == [], (parser.stack, parser.refs)
    assert "http://" not in text and "https://" not in text  # nothing to fetch: works offline
    data = json.loads(parser.data)
    for m in data["modules"]:
        lq, lk = len(data["sequences"][m["q"]]), len(data["sequences"][m["k"]])
        raw = [np.frombuffer(zlib.decompress(base64.b64decode(b)), dtype=np.uint8) for b in m["blobs"]]
        m["weights"] = np.stack([r.reshape(lk, lq).T for r in raw]).astype(np.float64) / 255  # (H, Lq, Lk)
        raw = np.frombuffer(zlib.decompress(base64.b64decode(m["thumbs"])), dtype=np.uint8)
        m["thumbs"] = raw.reshape(len(m["blobs"]), *m["thumb"])  # (H, R, C)
    return data


def eager_weights(folder, **inputs):
    """Every attention module's weights from transformers' own eager attention (the independent oracle)."""
    import transformers

    cls = getattr(transformers, json.loads((folder / "config.json").read_text())["architectures"][0])
    model = cls.from_pretrained(folder, attn_implementation="eager", local_files_only=True).eval()
    with torch.no_grad():
        return model(**inputs, output_attentions=True)


def stats_by_loops(w, special, self_attention):
    """The page's statistics of one head's weights (Lq, Lk), written as plain loops."""
    lq, lk = w.shape
    ent = np.mean([-sum(x * math.log(x) for x in row if x > 0) for row in w])
    out = {
        "entropy": ent,
        "first": np.mean(w[:, 0]),
        "special": np.mean([sum(row[j] for j in range(lk) if special[j]) for row in w]),
    }
    if self_attention:
        out["distance"] = np.mean([sum(w[i, j] * abs(i - j) for j in range(lk)) for i in range(lq)])
        out["previous"] = np.mean([w[i, i - 1] for i in range(1, lq)])
        out["same"] = np.mean([w[i, i] for i in range(lq)])
    else:
        out.update(distance=None, previous=None, same=None)
    return out


def check_thumbs(module, weights):
    """Under 96 tokens a thumbnail pools nothing: its pixels are the weights (H, Lq, Lk) rounded to uint8,
    within one level (the oracle's weights differ from multihead's by float rounding)."""
    assert max(weights.shape[1:]) <= 96 and module["thumbs"].shape == weights.shape
    assert np.abs(module["thumbs"].astype(np.int64) - np.floor(255 * weights + 0.5)).max() <= 1


def check_stats(module, weights, special, self_attention):
    for h in range(weights.shape[0]):
        want = stats_by_loops(weights[h], special, self_attention)
        for col, value in want.items():
            got = module["stats"][col][h]
            assert (got is None) if value is None else got == pytest.approx(value, abs=2e-5), (
                col,
                h,
                got,
                value,
            )


def test_view_minilm_page_holds_the_captured_weights_stats_and_importance(capsys, tmp_path):
    folder, out = minilm_dir(), tmp_path / "page.html"
    code, stdout, err = run_view(
        capsys, [folder, "--text", TEXT, "--text-pair", "It was red.", "--out", out, "--importance"]
    )
    assert code == 0 and err == "" and f"wrote {out}" in stdout
    data = read_page(out)
    tok = data["sequences"]["input"]
    assert tok[0] == "[CLS]" and tok[-1] == "[SEP]" and tok.count("[SEP]") == 2
    assert data["special"]["input"] == [t in ("[CLS]", "[SEP]") for t in tok]
    from transformers import AutoTokenizer

    enc = AutoTokenizer.from_pretrained(folder)(TEXT, "It was red.", return_tensors="pt")
    want = eager_weights(folder, **enc).attentions  # 6 x (1, 12, L, L)
    assert [m["name"] for m in data["modules"]] == [f"encoder.layer.{i}.attention.self" for i in range(6)]
    for m, w in zip(data["modules"], want):
        w = w[0].double().numpy()
        assert m["kind"] == "encoder self" and m["weights"].shape == w.shape == (12, len(tok), len(tok))
        assert np.abs(m["weights"] - w).max() <= 1 / 510 + 1e-6  # uint8 quantisation
        check_stats(m, w, data["special"]["input"], True)
        check_thumbs(m, w)
        imp = np.array(m["importance"])
        assert imp.shape == (12,) and (imp >= 0).all() and np.linalg.norm(imp) == pytest.approx(1, abs=1e-4)


def test_view_decoder_page_is_causal(capsys, tmp_path, folders):
    out = tmp_path / "llama.html"
    code, _, err = run_view(capsys, [folders["causal-lm"], "--text", TEXT, "--out", out, "--importance"])
    assert code == 0 and err == ""
    data = read_page(out)
    ids = torch.tensor(
        [
            [1]
            + [
                checkpoints.WORDS.index(w) + 5
                for w in TEXT.lower().replace(",", " ,").replace(".", " .").split()
            ]
            + [2]
        ]
    )
    assert len(data["sequences"]["input"]) == ids.shape[1]
    want = eager_weights(folders["causal-lm"], input_ids=ids).attentions
    for m, w in zip(data["modules"], want, strict=True):
        w = w[0].double().numpy()  # (4, L, L)
        assert np.abs(m["weights"] - w).max() <= 1 / 510 + 1e-6
        assert (np.triu(m["weights"], k=1) == 0).all()  # nothing after the query
        check_stats(m, w, data["special"]["input"], True)
        check_thumbs(m, w)
        assert len(m["importance"]) == 4


def test_view_encoder_decoder_page_has_every_attention(capsys, tmp_path, folders):
    out, png = tmp_path / "bart.html", tmp_path / "bart.png"
    target = "the dog ran home"
    code, _, err = run_view(
        capsys,
        [folders["encoder-decoder"], "--text", TEXT, "--text-pair", target, "--out", out, "--png", png],
    )
    assert code == 0 and err == ""
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    data = read_page(out)
    dec = data["sequences"]["decoder"]
    assert dec[0] == "</s>" and dec[1:] == [
        "<s>",
        "the",
        "dog",
        "ran",
        "<unk>",
    ]  # shifted right: the target's last goes
    kinds = [(m["kind"], m["q"], m["k"]) for m in data["modules"]]
    assert sorted(set(kinds)) == [
        ("cross", "decoder", "encoder"),
        ("decoder self", "decoder", "decoder"),
        ("encoder self", "encoder", "encoder"),
    ]
    tok = AutoTokenizer_from(folders["encoder-decoder"])
    ids = tok(TEXT, return_tensors="pt").input_ids
    dec_ids = torch.tensor([tok.convert_tokens_to_ids(dec)])
    eager = eager_weights(folders["encoder-decoder"], input_ids=ids, decoder_input_ids=dec_ids)
    want = {
        "encoder self": eager.encoder_attentions,
        "decoder self": eager.decoder_attentions,
        "cross": eager.cross_attentions,
    }
    for kind, expected in want.items():
        got = [m for m in data["modules"] if m["kind"] == kind]
        for m, w in zip(got, expected, strict=True):
            w = w[0].double().numpy()
            assert m["weights"].shape == w.shape and np.abs(m["weights"] - w).max() <= 1 / 510 + 1e-6
            check_stats(m, w, data["special"][m["k"]], kind != "cross")
            check_thumbs(m, w)
        assert len(got) == 2


def AutoTokenizer_from(folder):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)


def test_truncate_cuts_a_long_text_to_what_the_model_takes(capsys, tmp_path, folders):
    out = tmp_path / "long.html"
    code, _, _ = run_view(
        capsys, [folders["causal-lm"], "--text", "the cat " * 50, "--out", out, "--truncate"]
    )
    assert code == 0
    assert len(read_page(out)["sequences"]["input"]) == 64


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("missing folder", "not a checkpoint folder: "),
        ("no config", "(no config.json)"),
        ("too long", "is 102 tokens, more than the 64 the model takes; shorten it or pass --truncate"),
        ("missing out dir", "no such directory"),
        ("out is a dir", "is a directory"),
        ("missing png dir", "--png"),
        ("empty text", "--text is empty"),
    ],
)
def test_bad_input_exits_2_with_one_line_and_writes_nothing(capsys, tmp_path, folders, case, message):
    folder, text, out, extra = folders["causal-lm"], TEXT, tmp_path / "page.html", []
    if case == "missing folder":
        folder = tmp_path / "nope"
    elif case == "no config":
        folder = tmp_path / "empty"
        folder.mkdir()
    elif case == "too long":
        text = "the cat " * 50
    elif case == "missing out dir":
        out = tmp_path / "no" / "page.html"
    elif case == "out is a dir":
        out = tmp_path
    elif case == "missing png dir":
        extra = ["--png", tmp_path / "no" / "f.png"]
    elif case == "empty text":
        text = "  "
    before = sorted(tmp_path.rglob("*"))
    code, stdout, err = run_view(capsys, [folder, "--text", text, "--out", out, *extra])
    assert code == 2 and stdout == ""
    assert (
        len(err.strip().splitlines()) == 1 and err.startswith("multihead view: error: ") and message in err
    ), err
    assert sorted(tmp_path.rglob("*")) == before  # nothing written


def test_view_streams_each_module_and_keeps_no_float_weights(tmp_path, folders, monkeypatch):
    """The command encodes each module as soon as it has run: when a module is encoded, no earlier
    module's float weights are alive, and none is once the page is built."""
    import gc
    import weakref

    from multihead.commands import view
    from multihead.viz import encoding

    seen, encode = [], encoding.encode_module

    def spy(name, kind, weights, *args, **kw):
        gc.collect()
        assert all(r() is None for r in seen), f"{name}: an earlier module's weights are still held"
        seen.extend(weakref.ref(t) for t in (weights, weights._base) if t is not None)  # a view: its base too
        return encode(name, kind, weights, *args, **kw)

    monkeypatch.setattr(encoding, "encode_module", spy)
    ckpt = model_dir.load(folders["encoder-decoder"])
    html, modules = view.view_page(ckpt, TEXT, "the dog ran")
    gc.collect()
    assert len(modules) == 6 and len(seen) >= 6 and all(r() is None for r in seen)
    assert all(isinstance(m, page.EncodedModule) for m in modules)


@pytest.mark.parametrize("kind", ["causal-lm", "encoder-decoder"])
def test_view_importance_is_heads_importance_on_the_unfrozen_model(folders, kind):
    """The command freezes the parameters while it scores the heads: the same scores, flags restored."""
    from multihead import heads
    from multihead.commands import view

    ckpt = model_dir.load(folders[kind])
    inputs = view.prepare_inputs(ckpt, TEXT, "the dog ran" if kind == "encoder-decoder" else None)
    ckpt.model.lm_head.weight.requires_grad_(False)  # one frozen by the user stays frozen
    flags = [p.requires_grad for p in ckpt.model.parameters()]
    want = heads.importance(ckpt.model, [inputs.kwargs], view._loss(ckpt, inputs))
    got = view.importance_scores(ckpt, inputs)
    assert [p.requires_grad for p in ckpt.model.parameters()] == flags and not all(flags)
    assert list(got) == list(want)
    for name, s in want.items():
        assert got[name] == pytest.approx(s.tolist(), rel=1e-5, abs=1e-7), name


def test_token_labels_read_as_text():
    """Byte-level BPE tokens (GPT-2, Llama 3, SmolLM2) are labelled as the text they stand for; WordPiece
    and special tokens stay as they are."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    from multihead.commands.view import readable

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    bpe = Tokenizer(models.BPE({c: i for i, c in enumerate(alphabet)}, []))
    bpe.pre_tokenizer, bpe.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    byte_level = PreTrainedTokenizerFast(tokenizer_object=bpe)
    cases = {
        "\u0120can": " can",
        "\u010a": "\u21b5",
        "\u0109": "\u21e5",
        "\u0120": "\u2423",
        "caf\u00c3\u00a9": "caf\u00e9",
    }
    cases["\u00c3"] = "\u00c3"  # the first byte of a two-byte character: no text of its own, kept as it is
    assert {t: readable(byte_level, t) for t in cases} == cases
    wordpiece = AutoTokenizer.from_pretrained(minilm_dir())
    assert [readable(wordpiece, t) for t in ("[CLS]", "##use", "cafe")] == ["[CLS]", "##use", "cafe"]


def test_stream_hands_over_what_capture_records(folders):
    from multihead import viz

    ckpt = model_dir.load(folders["causal-lm"])
    ids = torch.tensor([[1, 7, 8, 9, 10, 2]])
    got = []
    with torch.no_grad(), viz.capture(ckpt.model) as cap, viz.stream(ckpt.model, got.append):
        ckpt.model(input_ids=ids)
    assert [r.name for r in got] == cap.names() == ["model.layers.0.self_attn", "model.layers.1.self_attn"]
    for r in got:
        assert r.kind == cap.kind(r.name) and torch.equal(r.weights, cap.get(r.name))  # (1, 4, 6, 6)


# ------------------------------------------------------------------------------------------------
# The page builder on its own
# ------------------------------------------------------------------------------------------------


def test_encoded_module_is_what_the_page_carries_of_its_weights():
    torch.manual_seed(0)
    w = torch.softmax(torch.randn(3, 5, 7) * 3, dim=-1)  # (H, Lq, Lk): cross-attention
    special = [True] + [False] * 6
    m = page.PageModule("cross.0", "cross", w, "tgt", "src", importance=[0.5, 0.25, 0.25])
    e = m.encode(special)
    assert (e.heads, e.shape, e.importance) == (3, (5, 7), [0.5, 0.25, 0.25]) and e.encode(special) is e
    for h in range(3):
        assert e.head(h).shape == (5, 7) and (e.head(h) - w[h]).abs().max() <= 1 / 510 + 1e-7
    assert e.stats["distance"] == [None] * 3  # position statistics: self-attention only
    seqs = {"tgt": list("abcde"), "src": list("ABCDEFG")}
    flags = {"tgt": [False] * 5, "src": special}
    assert page.build_page([m], seqs, flags) == page.build_page([e], seqs, flags)


@settings(max_examples=25, deadline=None)
@given(lq=st.integers(1, 40), lk=st.integers(1, 40), sharpness=st.floats(0, 20), seed=st.integers(0, 2**16))
def test_encode_head_decodes_within_quantisation_error(lq, lk, sharpness, seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.softmax(torch.randn(lq, lk, dtype=torch.float64, generator=g) * sharpness, dim=-1)
    w[torch.rand(lq, generator=g) < 0.2] = 0  # rows with no allowed key: all zero
    raw = zlib.decompress(base64.b64decode(page.encode_head(w)))
    back = np.frombuffer(raw, dtype=np.uint8).reshape(lk, lq).T / 255  # key-major
    assert np.abs(back - w.numpy()).max() <= 1 / 510 + 1e-12


def test_head_stats_match_loops_and_refuse_a_wrong_special_length():
    torch.manual_seed(0)
    w = torch.softmax(torch.randn(3, 7, 7, dtype=torch.float64), dim=-1)
    special = [True, False, False, True, False, False, True]
    got = page.head_stats(w, special, self_attention=True)
    for h in range(3):
        for col, value in stats_by_loops(w[h].numpy(), special, True).items():
            assert float(got[col][h]) == pytest.approx(value, abs=1e-12), col
    cross = page.head_stats(w[:, :4], special, self_attention=False)
    assert torch.isnan(cross["distance"]).all() and not torch.isnan(cross["entropy"]).any()
    with pytest.raises(ValueError, match=r"one flag per key token \(Lk=7\), got 2"):
        page.head_stats(w, [True, False], self_attention=True)


def test_build_page_refuses_weights_that_do_not_match_the_tokens():
    m = page.PageModule("layer.0", "self", torch.full((2, 3, 3), 1 / 3), "input", "input")
    with pytest.raises(
        ValueError, match=r"layer.0: weights \(H, Lq, Lk\) = \(2, 3, 3\) but sequences give Lq=4"
    ):
        page.build_page([m], {"input": list("abcd")}, {"input": [False] * 4})
    assert "</script><script>" not in page.build_page(
        [m], {"input": ["</script><script>", "b", "c"]}, {"input": [False] * 3}
    )  # tokens cannot close the data's script element


# ------------------------------------------------------------------------------------------------
# In a real browser
# ------------------------------------------------------------------------------------------------


def test_page_renders_offline_in_chromium_without_errors(capsys, tmp_path, folders):
    """The encoder-decoder page (three kinds of modules, Lq != Lk, importance bars) in one browser run;
    ``benchmarks/bench_view.py`` renders the real checkpoint's pages at 512 and 1,024 tokens."""
    from PIL import Image

    need_chromium("the page")
    out, shot = tmp_path / "bart.html", tmp_path / "bart.png"
    argv = [
        folders["encoder-decoder"],
        "--text",
        TEXT,
        "--text-pair",
        "the dog ran",
        "--out",
        out,
        "--importance",
    ]
    assert run_view(capsys, argv)[0] == 0
    got = render(out, screenshot=shot)
    assert got.console == [] and got.status == "ready", got
    image = np.asarray(Image.open(shot).convert("RGB"), dtype=np.int16)
    assert image.shape[:2] == (1000, 1400)
    assert image.std() > 20 and len(np.unique(image.reshape(-1, 3), axis=0)) > 50  # not blank


def test_long_page_renders_pooled_thumbnails_and_the_head_view_in_chromium(tmp_path):
    """300 tokens: thumbnails pooled to 96 x 96, a head view taller than its box (only the rows in view
    drawn): the page draws everything without an error; a broken thumbnail sets its status to error."""
    from PIL import Image

    need_chromium("the page")
    n = 300
    w = torch.softmax(torch.randn(2, 2, n, n), dim=-1)  # (modules, H, L, L)
    w[0, 0] = torch.eye(n)
    modules = [page.PageModule(f"layers.{i}.attn", "self", w[i], "input", "input") for i in range(2)]
    out, shot = tmp_path / "long.html", tmp_path / "long.png"
    out.write_text(
        page.build_page(modules, {"input": [f"t{i}" for i in range(n)]}, {"input": [False] * n}),
        encoding="utf-8",
    )
    got = render(out, screenshot=shot)
    assert got.console == [] and got.status == "ready", got
    image = np.asarray(Image.open(shot).convert("RGB"), dtype=np.int16)
    assert image.std() > 20 and len(np.unique(image.reshape(-1, 3), axis=0)) > 50  # not blank
    thumb = modules[1].encode([False] * n).thumbs
    out.write_text(out.read_text(encoding="utf-8").replace(thumb, thumb[:40]), encoding="utf-8")  # cut short
    broken = render(out)
    assert broken.status == "error" and broken.console, broken
