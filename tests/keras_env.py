"""The environment of a fresh Python process that runs Keras on one backend (Keras fixes its backend once per
process, so the tests of the other backends run in subprocesses).

On JAX nearly all of those runs' time is XLA compiling small graphs (Keras's own MHA tests take as long
with Keras's own layer). XLA's optimisation passes are switched off there: the compiled code computes the
same results, and the runs take about half the time (Keras's test file on JAX: 109 s -> 56 s on 2 cores).
"""

from __future__ import annotations

import os

FAST_XLA = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"


def backend_env(backend: str, **extra: str) -> dict[str, str]:
    """``os.environ`` with ``KERAS_BACKEND=backend``, TensorFlow's logging quiet, and on JAX a CPU-only,
    fast-compiling XLA (``FAST_XLA`` before any ``XLA_FLAGS`` already set)."""
    env = {**os.environ, "KERAS_BACKEND": backend, "TF_CPP_MIN_LOG_LEVEL": "2", **extra}
    if backend == "jax":
        env["JAX_PLATFORMS"] = "cpu"
        env["XLA_FLAGS"] = f"{FAST_XLA} {os.environ.get('XLA_FLAGS', '')}".strip()
    return env
