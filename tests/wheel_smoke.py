"""Smoke test of the built wheel, run by ``make test`` in a fresh virtual environment holding only the
wheel and what it declares (torch and torch's own dependencies; no numpy, no extra).

Run it with that environment's interpreter from outside the repository, so that ``import multihead``
finds the installed wheel: ``cd build && smoke-venv/bin/python ../tests/wheel_smoke.py``.
Prints one line per check and a summary; runs every check, then exits 1 if any failed.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

START = time.perf_counter()
CHECKS: list[Callable[[], str]] = []
OPTIONAL = (
    "numpy",
    "matplotlib",
    "keras",
    "onnx",
    "onnxruntime",
    "onnxscript",
    "transformers",
    "safetensors",
)


def check(fn: Callable[[], str]) -> Callable[[], str]:
    CHECKS.append(fn)
    return fn


@check
def installed_not_the_source_tree() -> str:
    import multihead

    where = Path(multihead.__file__).resolve()
    assert Path(sys.prefix).resolve() in where.parents, f"imported {where}, not the installed wheel"
    assert (where.parent / "py.typed").is_file(), "py.typed is missing from the wheel"
    dist = importlib.metadata.distribution("multihead")
    assert dist.version == multihead.__version__, (dist.version, multihead.__version__)
    assert any(f.name == "LICENSE" for f in dist.files or []), "LICENSE is not in the wheel"
    assert dist.metadata["License-Expression"] == "MIT"
    return f"multihead {dist.version} from {where.parent}"


@check
def only_torch_is_installed() -> str:
    present = [name for name in OPTIONAL if importlib.util.find_spec(name) is not None]
    assert not present, f"the core's declared dependencies pulled in {present}"
    return "no " + ", ".join(OPTIONAL)


@check
def core_works() -> str:
    import torch

    import multihead as mh

    torch.manual_seed(0)
    mha = mh.MultiHeadAttention(16, 4, kv_heads=2)
    x = torch.randn(2, 5, 16)
    y, w = mha(x, causal=True, valid_lens=torch.tensor([5, 3]), return_weights=True)
    assert y.shape == (2, 5, 16) and w.shape == (2, 4, 5, 5)
    q, k, v = torch.randn(2, 4, 3, 8), torch.randn(2, 2, 6, 8), torch.randn(2, 2, 6, 8)
    out = mh.attention(q, k, v, mask=mh.masks.causal(3, 6))
    torch.testing.assert_close(out, mh.attention_reference(q, k, v, mask=mh.masks.causal(3, 6)))
    model = mh.Transformer(12, 12, d_model=16, num_heads=2, num_encoder_layers=1, num_decoder_layers=1,
                           d_ff=32, dropout=0.0).eval()  # fmt: skip
    assert model.generate(torch.randint(3, 12, (2, 4)), bos_id=1, eos_id=2, max_len=5).shape[0] == 2
    leaked = sorted({m.split(".")[0] for m in sys.modules} & set(OPTIONAL))
    assert not leaked, leaked
    return "attention, MultiHeadAttention, Transformer.generate"


@check
def pruned_checkpoint_round_trip() -> str:
    import torch

    import multihead as mh
    from multihead import checkpoint, heads

    def build() -> mh.Transformer:
        return mh.Transformer(12, 12, d_model=16, num_heads=4, num_encoder_layers=1, num_decoder_layers=1,
                              d_ff=32, dropout=0.0).eval()  # fmt: skip

    small = heads.prune(build(), {"encoder.layers.0.self_attn": [0, 2]})
    with tempfile.TemporaryDirectory() as tmp:
        path = checkpoint.save(small, Path(tmp) / "small.pt")
        again = checkpoint.load_model(build(), path).eval()
        try:
            checkpoint.save(small, Path(tmp) / "small.safetensors")
            raise AssertionError("saved .safetensors without safetensors installed")
        except ImportError as e:
            assert "pip install 'multihead[safetensors]'" in str(e), e
    src, tgt = torch.randint(1, 12, (2, 5)), torch.randint(1, 12, (2, 4))
    with torch.no_grad():
        assert torch.equal(again(src, tgt), small(src, tgt))
    return ".pt round trip of a pruned model; .safetensors names its extra"


@check
def missing_extras_say_which() -> str:
    from multihead import viz

    try:
        viz.new_figure()
        raise AssertionError("viz.new_figure() worked without matplotlib")
    except ImportError as e:
        assert "multihead[viz]" in str(e), e
    try:
        import multihead.compat.keras  # noqa: F401

        raise AssertionError("multihead.compat.keras imported without keras")
    except ImportError as e:
        assert "keras" in str(e), e
    return "viz, keras, safetensors"


def in_process(*argv: str) -> tuple[int, str, str]:
    """``(status, stdout, stderr)`` of ``multihead.cli.main(argv)`` (argparse's exits included)."""
    import contextlib
    import io

    from multihead.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(argv))
        except SystemExit as e:
            code = e.code
    return code, out.getvalue(), err.getvalue()


@check
def cli_entry_points() -> str:
    import multihead

    exe = Path(sys.executable).with_name("multihead")  # the console script the wheel declares
    proc = subprocess.run([str(exe), "--version"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == f"multihead {multihead.__version__}", proc
    with tempfile.TemporaryDirectory() as tmp:  # python -m multihead, and the demo without matplotlib
        start = time.perf_counter()
        proc = subprocess.run(
            [sys.executable, "-m", "multihead", "demo", "--out", "out"], capture_output=True, text=True,
            timeout=120, cwd=tmp,
        )  # fmt: skip
        seconds = time.perf_counter() - start
        assert proc.returncode == 1, proc
        assert "pip install 'multihead[viz]'" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
        assert not os.path.exists(os.path.join(tmp, "out")), "the demo started working before the check"
    return f"multihead --version; python -m multihead demo: exit 1 naming multihead[viz] in {seconds:.1f} s"


@check
def cli_help_usage_errors_and_extras() -> str:
    for sub in ("demo", "export", "bench"):
        code, out, _ = in_process(sub, "--help")
        assert code == 0 and "examples:" in out, (sub, out)
    code, _, err = in_process("export", "--len", "1")
    assert code == 2 and err.strip().splitlines()[-1].startswith("multihead export: error:"), err
    code, _, err = in_process("export", "--out", os.devnull)
    assert code == 1 and "pip install 'multihead[onnx]'" in err and "Traceback" not in err, err
    return "--help of demo/export/bench, usage error -> 2, export without onnx -> 1"


def main() -> int:
    passed = failed = 0
    for fn in CHECKS:
        try:
            print(f"ok   {fn.__name__}: {fn()}", flush=True)
            passed += 1
        except Exception as e:  # report every check, then fail
            print(f"FAIL {fn.__name__}: {type(e).__name__}: {e}", flush=True)
            failed += 1
    print(f"wheel smoke test: {passed} checks passed, {failed} failed ({time.perf_counter() - START:.1f} s)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
