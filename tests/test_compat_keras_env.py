"""The Keras layer's environments: every Keras backend, no PyTorch at all, and the lazy top-level package.

Keras fixes its backend once per process, so the Keras tests run here once more per *other* backend, each in
a fresh ``python -m pytest`` (this process's own backend runs ``test_compat_keras.py`` directly). Under
``pytest -n 2`` these runs go in parallel with the rest of the suite.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from keras_env import backend_env

TESTS = Path(__file__).resolve().parent
BACKENDS = ("tensorflow", "jax", "torch")
THIS_BACKEND = os.environ.get("KERAS_BACKEND", "torch")  # what test_compat_keras.py uses in this process
#: backend -> the Python package it needs
NEEDS = {"tensorflow": "tensorflow", "jax": "jax", "torch": "torch"}


def _run(code_or_args, backend, timeout=600):
    args = code_or_args if isinstance(code_or_args, list) else ["-c", code_or_args]
    return subprocess.run(
        [sys.executable, *args], env=backend_env(backend), capture_output=True, text=True, timeout=timeout,
        cwd=TESTS.parent,
    )  # fmt: skip


@pytest.mark.parametrize("backend", [b for b in BACKENDS if b != THIS_BACKEND])
def test_keras_tests_pass_on_the_other_backends(backend):
    pytest.importorskip("keras")
    pytest.importorskip(NEEDS[backend])  # requirements-dev installs all three
    files = ["test_compat_keras.py"] + (["test_seeds_keras.py"] if backend == "tensorflow" else [])
    res = _run(
        ["-m", "pytest", "-q", "-p", "no:cacheprovider", *(str(TESTS / f) for f in files)],
        backend,
    )
    tail = (res.stdout + res.stderr)[-6000:]
    assert res.returncode == 0, f"KERAS_BACKEND={backend}: the Keras tests failed:\n{tail}"
    assert " passed" in res.stdout and " failed" not in res.stdout, tail


NO_TORCH = """
import importlib.abc, os, sys

class NoTorch(importlib.abc.MetaPathFinder):  # as if torch were not installed
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ModuleNotFoundError(f"No module named {name!r} (blocked by the test)", name=name)
        return None

sys.meta_path.insert(0, NoTorch())
os.environ["KERAS_BACKEND"] = "jax"
import numpy as np
import multihead
import multihead.compat.keras as mk

q = np.random.default_rng(0).standard_normal((2, 3, 6)).astype("float32")
layer = mk.MultiHeadAttention(num_heads=2, key_dim=3)
out, scores = layer(q, q[:, :2], use_causal_mask=True, return_attention_scores=True)
assert tuple(out.shape) == (2, 3, 6) and tuple(scores.shape) == (2, 2, 3, 2), (out.shape, scores.shape)
assert np.isfinite(np.asarray(out)).all()
assert "torch" not in sys.modules
try:
    multihead.attention  # the torch parts say plainly that torch is missing
except ModuleNotFoundError as e:
    assert "torch" in str(e)
else:
    raise AssertionError("multihead.attention resolved without torch")
print("ok without torch")
"""


def test_keras_layer_imports_and_runs_without_torch_on_jax():
    pytest.importorskip("keras")
    pytest.importorskip("jax")
    res = _run(NO_TORCH, "jax")
    assert res.returncode == 0 and "ok without torch" in res.stdout, res.stderr[-4000:]


def test_import_multihead_is_lazy_and_complete():
    code = """
import sys
import multihead, multihead.compat
assert "torch" not in sys.modules and "keras" not in sys.modules, "import multihead imported torch/keras"
names = set(dir(multihead))
assert set(multihead.__all__) <= names and {"heads", "viz", "nn", "compat"} <= names
import torch
for name in multihead.__all__:
    getattr(multihead, name)
assert multihead.attention is sys.modules["multihead.core.attention"].attention
assert isinstance(multihead.MultiHeadAttention(8, 2), torch.nn.Module)
from multihead import TransformerEncoderLayer, masks
assert multihead.heads.__name__ == "multihead.heads" and "keras" not in sys.modules
print("lazy ok")
"""
    res = _run(code, THIS_BACKEND)
    assert res.returncode == 0 and "lazy ok" in res.stdout, res.stderr[-4000:]


def test_unknown_attribute_is_an_attribute_error():
    import multihead

    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        multihead.nope  # noqa: B018
    assert not hasattr(multihead, "nope")
