"""One sliding-window call's peak resident growth, measured in a fresh process (issue 55's check).

Dimensions: B batch, H heads, L length, D head dim.

:func:`growth` runs this module as ``python -m multihead.bench.window_memory L KIND`` in a new interpreter:
q, k, v of (B=1, H=8, L, D=64) float32, one thread; ``KIND`` "window" is ``mh.attention`` with a two-sided
lambda window of 512 on the ``blocked`` backend (the function held across calls, as a training loop holds
its mask), "plain" the unmasked call. One warm-up call, then glibc's mmap threshold is fixed and the heap
trimmed (:func:`~multihead.bench.measure.track_cpu_memory`) and one call's peak growth printed in MiB
(:func:`~multihead.bench.measure.peak_memory`). A fresh process each, because where glibc places a call's
temporaries depends on the process's history. Used by ``tests/test_window_memory.py`` and
``benchmarks/bench_window_memory.py``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

__all__ = ["KINDS", "growth"]

KINDS = ("window", "plain")


def growth(length: int, kind: str, *, timeout: float = 600.0) -> float:
    """MiB of peak resident growth of one call of ``kind`` ("window" or "plain") at L = ``length``, in a
    fresh process running this source tree; a ``RuntimeError`` with the child's stderr if it fails."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    src = str(Path(__file__).resolve().parents[2])  # the folder holding this package
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (src, os.environ.get("PYTHONPATH"))))}
    done = subprocess.run(
        [sys.executable, "-m", "multihead.bench.window_memory", str(length), kind],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
    )
    if done.returncode != 0:
        raise RuntimeError(
            f"the {kind} child at L = {length} exited {done.returncode}: {done.stderr[-2000:]}"
        )
    return float(done.stdout.split()[-1])


def _child(length: int, kind: str) -> float:
    import torch

    import multihead as mh

    from .contenders import Step
    from .measure import peak_memory, track_cpu_memory

    torch.set_num_threads(1)
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 8, length, 64) for _ in range(3))  # (B, H, L, D)
    window = lambda b, h, i, j: (i - j).abs() <= 512  # noqa: E731  held across calls

    def call() -> torch.Tensor:
        with torch.no_grad():
            if kind == "window":
                return mh.attention(q, k, v, mask=window, backend="blocked")
            return mh.attention(q, k, v)

    call()  # the warm-up
    track_cpu_memory()
    peak = peak_memory(Step(call), torch.device("cpu"))
    if peak is None:
        raise RuntimeError("peak resident memory needs Linux's /proc/self/clear_refs")
    return peak


if __name__ == "__main__":
    print(_child(int(sys.argv[1]), sys.argv[2]))
