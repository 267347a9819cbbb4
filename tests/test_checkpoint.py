"""Safe checkpoints: pruned models round-trip through .safetensors and .pt; pickled code is refused."""

from __future__ import annotations

import importlib
import json
import os
import pickle

import pytest
import torch

import multihead as mh
from multihead import checkpoint, heads
from multihead.demo import data
from multihead.demo.model import DemoConfig, build_model

pytest.importorskip("safetensors")  # the optional extra multihead[safetensors]; requirements-dev installs it

TINY = DemoConfig(d_model=16, num_heads=4, layers=1, d_ff=32, train_size=50, dev_size=10, test_size=10)
DROP = {"encoder.layers.0.self_attn": [1, 3], "decoder.layers.0.cross_attn": [0]}
DECODE = dict(bos_id=data.BOS, eos_id=data.EOS, max_len=10)


@pytest.fixture(scope="module")
def demo_models():
    """The demo's model (random weights, tiny sizes), a pruned copy, and held-out sources."""
    ds = data.make_dataset(0, train=TINY.train_size, dev=TINY.dev_size, test=TINY.test_size)
    torch.manual_seed(0)
    model = build_model(TINY, ds).eval()
    return ds, model, heads.prune(model, DROP).eval()


@pytest.mark.parametrize("suffix", [".safetensors", ".pt"])
def test_pruned_demo_model_round_trips_with_identical_predictions(demo_models, tmp_path, suffix):
    ds, _, pruned = demo_models
    path = checkpoint.save(pruned, tmp_path / f"pruned{suffix}")
    if suffix == ".pt":  # a plain state dict that the safe loader reads as it is
        state = torch.load(path, weights_only=True)
        assert set(state) == set(pruned.state_dict())
    again = checkpoint.load_model(build_model(TINY, ds), path).eval()
    assert heads.head_counts(again) == heads.head_counts(pruned)
    src, tgt = ds.test.src, ds.test.tgt_in
    with torch.no_grad():
        assert torch.equal(again(src, tgt), pruned(src, tgt))
    assert torch.equal(again.generate(src, **DECODE), pruned.generate(src, **DECODE))


def test_safetensors_metadata_holds_the_head_counts_and_they_are_used(demo_models, tmp_path, monkeypatch):
    ds, _, pruned = demo_models
    path = checkpoint.save(pruned, tmp_path / "p.safetensors", metadata={"task": "dates"})
    ckpt = checkpoint.load(path)
    assert ckpt.metadata["task"] == "dates" and ckpt.metadata[checkpoint.VERSION_KEY] == mh.__version__
    counts = ckpt.head_counts
    assert counts["encoder.layers.0.self_attn"] == (2, 2) and counts["decoder.layers.0.cross_attn"] == (3, 3)
    assert counts["decoder.layers.0.self_attn"] == (4, 4)

    def no_inference(*_):
        raise AssertionError("head counts inferred from shapes although the metadata has them")

    monkeypatch.setattr(importlib.import_module("multihead.heads.prune"), "_counts_from_shapes", no_inference)
    again = checkpoint.load_model(build_model(TINY, ds), path)
    assert {n: (m.num_heads, m.kv_heads) for n, m in heads.attention_modules(again).items()} == counts


def test_load_pruned_takes_head_counts_and_checks_them(demo_models):
    ds, _, pruned = demo_models
    counts = checkpoint.head_counts(pruned)
    again = heads.load_pruned(build_model(TINY, ds), pruned.state_dict(), head_counts=counts)
    assert checkpoint.head_counts(again) == counts
    bad = {**counts, "encoder.layers.0.self_attn": (3, 2)}
    with pytest.raises(ValueError, match=r"head_counts\['encoder.layers.0.self_attn'\].*multiple"):
        heads.load_pruned(build_model(TINY, ds), pruned.state_dict(), head_counts=bad)


def test_tied_weights_are_stored_once_and_stay_tied(tmp_path):
    torch.manual_seed(0)
    kw = dict(
        d_model=8, num_heads=2, num_encoder_layers=1, num_decoder_layers=1, d_ff=16, tie_embeddings=True
    )
    model = mh.Transformer(11, 13, **kw).eval()
    path = checkpoint.save(model, tmp_path / "tied.safetensors")
    aliases = json.loads(checkpoint.load(path).metadata[checkpoint.ALIASES_KEY])
    assert aliases == {"out_proj.weight": "tgt_embed.weight"}
    again = checkpoint.load_model(mh.Transformer(11, 13, **kw), path).eval()
    assert again.out_proj.weight is again.tgt_embed.weight
    src, tgt = torch.randint(1, 11, (2, 5)), torch.randint(1, 13, (2, 4))
    with torch.no_grad():
        assert torch.equal(again(src, tgt), model(src, tgt))


class Payload:
    """Unpickling this calls os.mkdir(marker): harmless, and visible if it ever runs."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.mkdir, (self.marker,)


def test_a_pickle_with_a_payload_is_refused_and_never_runs(tmp_path):
    marker = tmp_path / "payload-ran"
    path = tmp_path / "evil.pt"
    torch.save({"weight": torch.zeros(2), "extra": Payload(str(marker))}, path)
    with pytest.raises(pickle.UnpicklingError):
        torch.load(path, weights_only=True)
    with pytest.raises(checkpoint.CheckpointError, match="refused by torch.load\\(weights_only=True\\)"):
        checkpoint.load(path)
    with pytest.raises(checkpoint.CheckpointError):
        checkpoint.load_model(mh.MultiHeadAttention(4, 2), path)
    assert not marker.exists()
    torch.load(path, weights_only=False)  # the control: the unsafe load does run it
    assert marker.is_dir()


def test_bad_files_and_arguments_give_clear_errors(tmp_path):
    mha = mh.MultiHeadAttention(4, 2)
    torch.save([torch.zeros(1)], tmp_path / "list.pt")
    with pytest.raises(checkpoint.CheckpointError, match="expected a state dict"):
        checkpoint.load(tmp_path / "list.pt")
    with pytest.raises(FileNotFoundError, match="no checkpoint file"):
        checkpoint.load(tmp_path / "missing.safetensors")
    with pytest.raises(ValueError, match=r"metadata is stored only in \.safetensors files"):
        checkpoint.save(mha, tmp_path / "m.pt", metadata={"a": "b"})
    with pytest.raises(ValueError, match="reserved"):
        checkpoint.save(mha, tmp_path / "m.safetensors", metadata={"multihead.heads": "{}"})
    with pytest.raises(TypeError, match="str to str"):
        checkpoint.save(mha, tmp_path / "m.safetensors", metadata={"a": 1})
    (tmp_path / "junk.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(checkpoint.CheckpointError, match="not a readable .safetensors file"):
        checkpoint.load(tmp_path / "junk.safetensors")


def test_missing_safetensors_names_the_extra(tmp_path, monkeypatch):
    for name in ("safetensors", "safetensors.torch"):
        monkeypatch.setitem(__import__("sys").modules, name, None)  # import -> ImportError
    with pytest.raises(ImportError, match=r"pip install 'multihead\[safetensors\]'"):
        checkpoint.save(mh.MultiHeadAttention(4, 2), tmp_path / "m.safetensors")
    checkpoint.save(mh.MultiHeadAttention(4, 2), tmp_path / "m.pt")  # .pt files need nothing more
