"""examples/train_context_parallel.py: 2 ranks train exactly as one process, and resume from a checkpoint."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("transformers")

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "train_context_parallel.py"
TINY = [
    "--text",
    "100000",
    "--seq-len",
    "96",
    "--hidden",
    "32",
    "--heads",
    "4",
    "--kv-heads",
    "2",
    "--lr",
    "3e-3",
]


def _example():
    spec = importlib.util.spec_from_file_location("train_context_parallel", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_two_ranks_train_as_one_process_and_resume(tmp_path):
    ex = _example()
    ckpt = str(tmp_path / "ckpt")
    two = ex.main(["--world", "2", "--steps", "5", "--save", ckpt, "--save-every", "3", *TINY])
    one = ex.main(["--world", "1", "--steps", "5", *TINY])
    assert len(two) == len(one) == 5 and two[-1] < two[0]  # it learns
    for a, b in zip(two, one):
        assert abs(a - b) <= 1e-4 * abs(b), (two, one)
    # from the checkpoint of step 3, on another strategy: steps 4 and 5 again
    resumed = ex.main(
        ["--world", "2", "--steps", "5", "--resume", f"{ckpt}/step-3", "--strategy", "ulysses", *TINY]
    )
    assert len(resumed) == 2
    for a, b in zip(resumed, two[3:]):
        assert abs(a - b) <= 1e-4 * abs(b), (resumed, two)
