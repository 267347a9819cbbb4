"""``multihead view`` and the checkpoint-folder loader it shares with ``multihead prune``.

The loader is checked on the real all-MiniLM-L6-v2 folder and on tiny random folders of every kind;
bad folders give one-line :class:`NotACheckpoint` errors naming the folder and the cause.
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")

import checkpoints  # noqa: E402  (tests/checkpoints.py)

from multihead.commands import model_dir  # noqa: E402
from multihead.testing import minilm_dir  # noqa: E402

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
