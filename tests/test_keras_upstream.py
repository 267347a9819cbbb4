"""Keras's own MultiHeadAttention tests, run against multihead's Keras layer on every Keras backend.

The Keras wheel ships ``keras/src/layers/attention/multi_head_attention_test.py``. Each backend gets a fresh
``python -m pytest`` on that file (Keras fixes its backend once per process) with a plugin that puts
:class:`multihead.compat.keras.MultiHeadAttention` where the file reads ``layers.MultiHeadAttention``;
every one of its tests must pass. Cost on 2 CPU cores: about 30 s each on torch and TensorFlow, about 60 s on
JAX (its tests compile with XLA; ``keras_env.backend_env`` switches XLA's optimisation passes off).
"""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
from keras_env import backend_env

BACKENDS = ("tensorflow", "jax", "torch")
PLUGIN = """
import keras
import keras.src.layers

from multihead.compat.keras import MultiHeadAttention

keras.src.layers.MultiHeadAttention = MultiHeadAttention  # what the test file reads (`layers.MultiHeadAttention`)
keras.layers.MultiHeadAttention = MultiHeadAttention


def pytest_collection_modifyitems(session, config, items):
    modules = {item.module for item in items}
    assert modules and all(m.layers.MultiHeadAttention is MultiHeadAttention for m in modules), "not swapped"
    print(f"\\nswapped in multihead's layer for {len(items)} tests")
"""


def _keras_test_file() -> Path:
    spec = importlib.util.find_spec("keras")
    if spec is None or spec.origin is None:
        pytest.skip("keras is not installed")
    path = Path(spec.origin).parent / "src" / "layers" / "attention" / "multi_head_attention_test.py"
    assert path.is_file(), f"this Keras wheel has no {path.name}; the check needs the file Keras ships"
    return path


@pytest.mark.parametrize("backend", BACKENDS)
def test_keras_own_mha_tests_pass_on_our_layer(backend, tmp_path):
    pytest.importorskip(backend)
    test_file = _keras_test_file()
    (tmp_path / "multihead_keras_swap.py").write_text(PLUGIN)
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    requires_trainable_backend\n")
    src = Path(__file__).resolve().parent.parent / "src"
    env = backend_env(
        backend, PYTHONPATH=os.pathsep.join([str(tmp_path), str(src), os.environ.get("PYTHONPATH", "")])
    )
    args = ["-m", "pytest", "-q", "-s", "-c", str(tmp_path / "pytest.ini"), "-p", "no:cacheprovider"]
    args += ["-p", "multihead_keras_swap", "-W", "ignore::DeprecationWarning", str(test_file)]
    res = subprocess.run(
        [sys.executable, *args], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=900
    )
    tail = (res.stdout + res.stderr)[-6000:]
    assert "swapped in multihead's layer" in res.stdout, tail
    assert res.returncode == 0, f"KERAS_BACKEND={backend}: Keras's own MHA tests failed on our layer:\n{tail}"
    assert " passed" in res.stdout and " failed" not in res.stdout, tail
