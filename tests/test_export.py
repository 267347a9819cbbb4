"""ONNX export: the file runs in onnxruntime with new batch sizes and lengths and matches eager to 1e-5."""

import argparse
import json

import pytest
import torch

import multihead as mh
from multihead import cli, export

ort = pytest.importorskip("onnxruntime")  # the optional extra multihead[onnx]; installed by requirements-dev
pytestmark = pytest.mark.filterwarnings(
    "ignore::DeprecationWarning", "ignore::UserWarning", "ignore::FutureWarning"
)


def _cli_args(**over):
    p = argparse.ArgumentParser()
    export.add_cli(p.add_subparsers(dest="command"))
    argv = ["export", "--embed-dim", "16", "--heads", "2", "--seed", "3"]
    for k, v in over.items():
        argv += [f"--{k.replace('_', '-')}", str(v)]
    return argv, p.parse_args(argv)


def test_cli_export_then_onnxruntime_matches_eager_on_new_shapes(tmp_path, capsys):
    out = tmp_path / "mha.onnx"
    argv, args = _cli_args(out=out)
    assert cli.main(argv) == 0
    printed = capsys.readouterr().out
    assert "['batch', 'len0', 16]" in printed and "OK" in printed
    module, _, _ = export._example(args)  # same seed -> same weights
    session = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    assert [i.name for i in session.get_inputs()] == ["query", "key", "valid_lens"]
    g = torch.Generator().manual_seed(1)
    for b, lq, lk in ((3, 4, 9), (1, 6, 2)):
        q, kv = torch.randn(b, lq, 16, generator=g), torch.randn(b, lk, 16, generator=g)
        lens = torch.arange(b) % (lk + 1)  # includes 0: a query row with no key -> zeros, also in ONNX
        with torch.no_grad():
            eager = module(q, kv, valid_lens=lens)
        (got,) = session.run(None, {"query": q.numpy(), "key": kv.numpy(), "valid_lens": lens.numpy()})
        assert got.shape == (b, lq, 16)
        torch.testing.assert_close(torch.from_numpy(got), eager, atol=1e-5, rtol=1e-5)


def test_to_onnx_self_attention_has_dynamic_axes(tmp_path):
    torch.manual_seed(0)
    mha = mh.MultiHeadAttention(12, 3).eval()
    report = export.to_onnx(mha, torch.randn(2, 5, 12), tmp_path / "self.onnx")
    assert report.inputs == {"query": ["batch", "len0", 12]}
    assert report.max_error is not None and report.max_error <= 1e-5
    assert [s[:2] for s in report.shapes] == [[2, 5], [3, 7], [4, 10]]


def test_to_onnx_rejects_non_tensor_inputs(tmp_path):
    with pytest.raises(TypeError, match="example_input"):
        export.to_onnx(mh.MultiHeadAttention(8, 2), [[1.0]], tmp_path / "x.onnx")


@pytest.fixture(scope="module")
def saved_demo(tmp_path_factory):
    """The demo's tiny model (random weights) and its pruned copy, written by the demo's own save code."""
    from multihead import heads
    from multihead.demo import data
    from multihead.demo.model import DemoConfig, build_model, save_models

    out = tmp_path_factory.mktemp("demo-out")
    cfg = DemoConfig(d_model=16, num_heads=2, layers=1, d_ff=32, train_size=50, dev_size=10, test_size=10)
    ds = data.make_dataset(0, train=cfg.train_size, dev=cfg.dev_size, test=cfg.test_size)
    torch.manual_seed(0)
    model = build_model(cfg, ds).eval()
    removed = {"encoder.layers.0.self_attn": [1], "decoder.layers.0.cross_attn": [0]}
    pruned = heads.prune(model, removed).eval()
    return save_models(out, cfg, ds, model, pruned, removed), pruned


def test_cli_exports_the_demos_saved_model_and_onnxruntime_matches(saved_demo, tmp_path, capsys):
    saved, pruned = saved_demo
    out = tmp_path / "dates.onnx"
    assert cli.main(["export", "--checkpoint", str(saved.pruned), "--out", str(out)]) == 0
    assert "exporting Transformer" in capsys.readouterr().out
    session = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    assert [i.name for i in session.get_inputs()] == ["src", "tgt", "src_valid_lens"]
    g = torch.Generator().manual_seed(2)
    for b, s, t in ((3, 6, 4), (5, 9, 7)):  # shapes other than the export's example (2, 7, 5)
        src, tgt = (
            torch.randint(1, pruned.src_vocab, (b, s), generator=g),
            torch.randint(1, pruned.tgt_vocab, (b, t), generator=g),
        )
        lens = torch.randint(1, s + 1, (b,), generator=g)
        with torch.no_grad():
            eager = pruned(src, tgt, src_valid_lens=lens)  # the model as it was before saving
        feed = {"src": src.numpy(), "tgt": tgt.numpy(), "src_valid_lens": lens.numpy()}
        (got,) = session.run(None, feed)
        torch.testing.assert_close(torch.from_numpy(got), eager, atol=1e-5, rtol=1e-5)


def test_load_trained_reads_safetensors_with_an_explicit_config(saved_demo, tmp_path):
    pytest.importorskip("safetensors")
    from multihead import checkpoint

    saved, pruned = saved_demo
    path = checkpoint.save(pruned, tmp_path / "p.safetensors")
    again = export.load_trained(path, saved.config)
    src, tgt = torch.randint(1, 10, (2, 5)), torch.randint(1, 10, (2, 3))
    with torch.no_grad():
        assert torch.equal(again(src, tgt), pruned(src, tgt))
    bad = tmp_path / "bad.json"
    bad.write_text('{"model": {"class": "Sequential", "kwargs": {}}}')
    with pytest.raises(ValueError, match="'Sequential' is not one of"):
        export.load_trained(path, bad)
    cfg = json.loads(saved.config.read_text())
    cfg["model"]["kwargs"]["d_model"] = 32  # not the checkpoint's model
    bad.write_text(json.dumps(cfg))
    with pytest.raises(checkpoint.CheckpointError, match=r"p\.safetensors does not fit the Transformer"):
        export.load_trained(path, bad)


def test_random_transformer_has_example_inputs():
    _, args = _cli_args(model="transformer")
    module, (src, tgt), kwargs = export._example(args)
    assert isinstance(module, mh.Transformer) and src.shape == (2, 7) and tgt.shape == (2, 5)
    assert list(kwargs) == ["src_valid_lens"]


def test_d2l_layer_with_float_valid_lens_exports(tmp_path):
    """DJL passes valid_lens as float (seed 003): the export keeps its batch axis dynamic and verifies."""
    from multihead.compat.d2l import MultiHeadAttention as D2L

    torch.manual_seed(0)
    att = D2L(100, 100, 100, 100, 5, 0.5).eval()
    x, y = torch.randn(2, 4, 100), torch.randn(2, 6, 100)
    report = export.to_onnx(
        att, (x, y, y), tmp_path / "d2l.onnx", example_kwargs={"valid_lens": torch.tensor([3.0, 2.0])}
    )
    assert report.max_error <= 1e-5
    assert [s[0] for s in report.shapes] == [2, 3, 4]  # verified at three batch sizes
