"""The ``multihead`` command's conventions: --version, --help with examples, exit codes, one-line errors."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import pytest

import multihead
from multihead import cli
from multihead.progress import Progress

SRC = Path(multihead.__file__).resolve().parents[1]


def run_main(capsys, argv):
    """``(exit status, stdout, stderr)`` of ``multihead ARGV`` in this process (argparse exits count)."""
    try:
        code = cli.main(argv)
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def test_version(capsys):
    code, out, _ = run_main(capsys, ["--version"])
    assert code == 0 and out.strip() == f"multihead {multihead.__version__}"


@pytest.mark.parametrize("argv", [[], ["demo"], ["bench"], ["export"], ["view"]])
def test_every_command_has_help_with_examples(capsys, argv):
    code, out, _ = run_main(capsys, [*argv, "--help"])
    assert code == 0
    assert "examples:\n  multihead " + (argv[0] if argv else "") in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([], "the following arguments are required"),
        (["train"], "invalid choice: 'train'"),
        (["demo", "--steps", "0"], "--steps: must be >= 1"),
        (["export", "--config", "c.json"], "--config goes with --checkpoint"),
        (["export", "--checkpoint", "m.pt", "--heads", "2"], "--heads: the model comes from --checkpoint"),
        (["export", "--len", "1"], "--len must be >= 2"),
        (["view", "--text", "t", "--out", "p.html"], "the following arguments are required: MODEL_DIR"),
        (["view", "model", "--out", "p.html"], "the following arguments are required: --text"),
    ],
)
def test_usage_errors_exit_2_with_one_line(capsys, argv, message):
    code, _, err = run_main(capsys, argv)
    assert code == 2
    last = err.strip().splitlines()[-1]
    assert last.startswith("multihead") and message in last and "Traceback" not in err


def test_view_of_a_missing_folder_is_a_usage_error(capsys, tmp_path):
    pytest.importorskip("transformers")  # the extra is checked first (exit 1 without it)
    code, out, err = run_main(
        capsys, ["view", str(tmp_path / "nope"), "--text", "t", "--out", str(tmp_path / "p.html")]
    )
    assert code == 2 and out == "" and not (tmp_path / "p.html").exists()
    assert (
        err.strip()
        == f"multihead view: error: not a checkpoint folder: {tmp_path / 'nope'} (no such directory)"
    )


def test_missing_checkpoint_is_a_usage_error(capsys, tmp_path):
    pytest.importorskip("onnxscript")  # the extra is checked first (exit 1 without it)
    code, _, err = run_main(capsys, ["export", "--checkpoint", str(tmp_path / "nope.pt")])
    assert code == 2
    assert err.strip() == f"multihead export: error: no checkpoint file {str(tmp_path / 'nope.pt')!r}"


BLOCK = """\
import contextlib, io, json, sys, time

class Blocker:  # the named top-level packages cannot be imported, as if not installed
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {blocked!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)

sys.meta_path.insert(0, Blocker())
from multihead.cli import main
results = []
for argv in {argvs!r}:
    out, err, start = io.StringIO(), io.StringIO(), time.perf_counter()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    results.append([code, out.getvalue(), err.getvalue(), time.perf_counter() - start])
print(json.dumps(results))
"""


def run_without(blocked: set[str], argvs: list[list[str]], cwd: Path) -> list[tuple[int, str, str, float]]:
    """``(status, stdout, stderr, seconds)`` of ``multihead ARGV`` for each of ``argvs``, in a fresh
    interpreter in which the ``blocked`` packages cannot be imported."""
    code = BLOCK.format(blocked=blocked, argvs=argvs)
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=120,
        env={"PYTHONPATH": str(SRC), "PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_missing_extras_fail_at_once_naming_the_extra(tmp_path):
    """``multihead demo`` without matplotlib stops before training; ``export`` without onnx before exporting;
    ``view`` without transformers (or matplotlib, with --png) before loading. One interpreter runs all four."""
    demo, export, view, view_png = run_without(
        {"matplotlib", "onnx", "onnxscript", "transformers"},
        [
            ["demo", "--out", "out"],
            ["export", "--out", "m.onnx"],
            ["view", "model", "--text", "t", "--out", "p.html"],
            ["view", "model", "--text", "t", "--out", "p.html", "--png", "f.png"],
        ],
        tmp_path,
    )
    code, out, err, _ = demo
    assert code == 1
    assert err.strip() == (
        "multihead demo: matplotlib not installed, needed for the demo's plots and HTML report: "
        "pip install 'multihead[viz]'"
    )
    # nothing ran before the check: not the seed table, not one training step (no output folder); no
    # wall-clock bound here -- it failed on a loaded machine, and these two facts are what it stood for
    assert out == ""
    assert not (tmp_path / "out").exists()
    code, _, err, _ = export
    assert code == 1
    assert err.strip() == (
        "multihead export: onnx and onnxscript not installed, needed for ONNX export: "
        "pip install 'multihead[onnx]'"
    )
    assert not (tmp_path / "m.onnx").exists()
    assert view[:3] == [
        1,
        "",
        "multihead view: transformers not installed, needed for loading a Hugging Face checkpoint folder: "
        "pip install 'multihead[transformers]'\n",
    ]
    assert view_png[:3] == [
        1,
        "",
        "multihead view: matplotlib not installed, needed for multihead view --png: pip install 'multihead[viz]'\n",
    ]
    assert not (tmp_path / "p.html").exists() and not (tmp_path / "f.png").exists()


def test_progress_redraws_only_on_a_terminal():
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    log, tty = io.StringIO(), Terminal()
    for stream in (log, tty):
        with Progress(8, "train", file=stream) as bar:
            for _ in range(8):
                bar.update(1, loss="0.5")
    lines = log.getvalue().splitlines()
    assert "\r" not in log.getvalue()
    assert [line.split("]")[1].split()[0] for line in lines] == ["25%", "50%", "75%", "100%"]
    assert tty.getvalue().startswith("\r") and tty.getvalue().count("\n") == 1
