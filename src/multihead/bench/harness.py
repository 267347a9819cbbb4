"""``multihead bench``: multihead against its peers, timed side by side in one process.

Dimensions: B batch, L sequence length (Lq = Lk, self-attention), E embed_dim, H query heads,
Hkv key/value heads, D = E // H head dim.

For each case every contender runs interleaved (A B C A B C ...) after a warm-up, so machine load hits
all of them alike; a 2048 x 2048 fp32 matmul (:data:`MATMUL_N`) runs in the same rotation and gives the
machine's matmul rate for that case. Reported per contender: median time, GFLOP/s (FLOPs below), the
fraction of the matmul rate, the ratio of its time to multihead's, and peak memory growth above inputs
and weights (CPU: the process's peak resident set, reset before the call; CUDA: the allocator's peak).

FLOPs (forward): ``2*B*L*E*(H*D + 2*Hkv*D)`` for the QKV projection (= 2*B*L*E*3E for plain multi-head
attention), ``2*B*L*E*E`` for the output projection and ``4*B*H*Lq*Lk*D`` for attention, halved when
causal. Backward counts 2x the projections and 2.5x the attention. The CUDA suite's attention-only cases
(the flash-attention benchmark's shapes) count the attention term alone.

Results go to ``DIR/<device>.json``, ``DIR/<device>.md`` and ``DIR/<device>.png``.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import math
import os
import platform
import re
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..core.attention import attention
from ..nn.attention import MultiHeadAttention, merge_heads, split_heads

__all__ = ["Case", "cpu_suite", "cuda_suite", "main", "run_suite"]

MATMUL_N = 2048
OURS = "multihead"


@dataclass
class Case:
    """One benchmark case: a shape, a mode and the contenders that run it.

    ``mode``: ``"forward"`` (eval, no grad), ``"train"`` (train mode, forward + backward) or
    ``"weights"`` (eval forward that also returns the per-head weights). ``level``: ``"module"``
    (projections + attention, inputs (B, L, E)) or ``"attention"`` (attention alone, q/k/v (B, H, L, D)).
    ``memory_only``: one call per contender (long sequences), measured for peak memory.
    ``contenders``: labels; ``label@key=value`` runs a contender with one setting changed (e.g.
    ``multihead@causal=False``).
    """

    name: str
    batch: int
    length: int
    embed_dim: int
    heads: int
    kv_heads: int | None = None
    causal: bool = False
    mode: str = "forward"
    level: str = "module"
    dtype: str = "float32"
    memory_only: bool = False
    contenders: tuple[str, ...] = ()
    targets: tuple[str, ...] = ()
    overrides: dict[str, dict[str, object]] = field(default_factory=dict)

    def variant(self, label: str) -> Case:
        """This case as contender ``label`` runs it (``name@key=value`` changes one setting)."""
        if "@" not in label:
            return self
        key, value = label.split("@", 1)[1].split("=")
        parsed: object = {"True": True, "False": False}.get(value, value)
        if isinstance(parsed, str) and parsed.isdigit():
            parsed = int(parsed)
        return Case(**{**asdict(self), key: parsed})


def flops(case: Case) -> float:
    """FLOPs of one call of ``case`` (see the module docstring)."""
    b, n, e, h = case.batch, case.length, case.embed_dim, case.heads
    hkv, d = case.kv_heads or h, case.embed_dim // case.heads
    attn = 4 * b * h * n * n * d * (0.5 if case.causal else 1.0)
    proj = 0.0 if case.level == "attention" else 2 * b * n * e * (h * d + 2 * hkv * d) + 2 * b * n * e * e
    if case.mode == "train":
        return 3 * proj + 3.5 * attn
    return proj + attn


# ----------------------------------------------------------------------------------------------
# Suites
# ----------------------------------------------------------------------------------------------

_PEERS = ("torch", "naive", "keras")


def cpu_suite(quick: bool = False) -> list[Case]:
    """The CPU cases of the issue's target table (tiny shapes with ``quick``)."""

    def s(b: int, n: int) -> tuple[int, int]:
        return (2, 8) if quick else (b, n)

    e = 32 if quick else 512
    return [
        Case("self-attention forward", *s(8, 512), e, 8, contenders=(OURS, *_PEERS),
             targets=("ours >= 1.5x faster than torch", "ours >= 85% of matmul GFLOP/s")),
        Case("self-attention forward+backward", *s(8, 512), e, 8, mode="train", contenders=(OURS, *_PEERS),
             targets=("ours >= 1.15x faster than torch", "ours >= 70% of matmul GFLOP/s")),
        Case("forward returning weights", *s(8, 512), e, 8, mode="weights",
             contenders=(OURS, f"{OURS}@mode=forward", "torch", "naive", "keras"),
             targets=("ours <= 1.5x the time of multihead@mode=forward", "ours >= 1.3x faster than torch")),
        Case("causal forward", *s(2, 2048), e, 8, causal=True,
             contenders=(OURS, f"{OURS}@causal=False", "torch", "naive"),
             targets=("ours <= 0.65x the time of multihead@causal=False",)),
        Case("seed shape forward", *(s(64, 5) if not quick else (4, 5)), e, 8, contenders=(OURS, *_PEERS),
             targets=("ours no slower than torch",)),
        Case("grouped-query forward (8 q / 2 kv heads)", *s(1, 2048), e, 8, kv_heads=2,
             contenders=(OURS, f"{OURS}@kv_heads=8", "torch"),
             targets=("ours faster than multihead@kv_heads=8",)),
        Case("long forward, memory", *s(1, 32768 if not quick else 64), e, 8, memory_only=True,
             contenders=(OURS, "torch", "torch@mode=forward-train-module"),
             targets=("ours memory <= 0.8x torch",)),
        Case("long forward+backward, memory", *s(1, 8192 if not quick else 64), e, 8, mode="train",
             memory_only=True, contenders=(OURS, "torch"), targets=("ours memory <= 1.0x torch",)),
    ]  # fmt: skip


def cuda_suite(quick: bool = False) -> list[Case]:
    """The flash-attention benchmark's shapes (B*L = 16k, bf16) plus the module cases, on CUDA."""
    cases = []
    lengths = (128, 256) if quick else (512, 1024, 2048, 4096, 8192, 16384)
    for d in (64, 128):
        for causal in (False, True):
            for n in lengths:
                for mode in ("forward", "train"):
                    cases.append(
                        Case(f"attention L={n} D={d}{' causal' if causal else ''} {mode}", (16384 // n),
                             n, 2048, 2048 // d, causal=causal, mode=mode, level="attention",
                             dtype="bfloat16", contenders=(OURS, "sdpa", "naive"))
                    )  # fmt: skip
    for c in cpu_suite(quick)[:2]:
        cases.append(Case(**{**asdict(c), "dtype": "bfloat16", "name": c.name + " bf16", "targets": ()}))
    return cases


# ----------------------------------------------------------------------------------------------
# Contenders: each returns a zero-argument step (one forward, or forward + backward)
# ----------------------------------------------------------------------------------------------


class NaiveMHA(nn.Module):
    """The seed notebooks' multi-head attention: three projections, matmul, softmax, matmul."""

    def __init__(self, e: int, h: int, **factory: object) -> None:
        super().__init__()
        self.h = h
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(e, e, **factory) for _ in range(4))

    def forward(self, x: Tensor, causal: bool = False) -> Tensor:
        q, k, v = (split_heads(w(x), self.h) for w in (self.wq, self.wk, self.wv))  # (B, H, L, D)
        return self.wo(merge_heads(naive_attention(q, k, v, causal)))  # (B, L, E)


def naive_attention(q: Tensor, k: Tensor, v: Tensor, causal: bool) -> Tensor:
    """softmax(q k^T / sqrt(D)) v with repeated K/V: q (B, H, L, D), k/v (B, Hkv, L, D) -> (B, H, L, D)."""
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)  # (B, H, L, D)
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])  # (B, H, L, L)
    if causal:
        n = q.shape[2]
        scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1), -math.inf)
    return torch.softmax(scores, dim=-1) @ v  # (B, H, L, D)


def _keras_layer(case: Case, device: torch.device) -> Callable[[Tensor], Tensor]:
    os.environ.setdefault("KERAS_BACKEND", "torch")
    import keras  # noqa: PLC0415  (optional peer)

    if keras.backend.backend() != "torch":
        raise RuntimeError(f"keras runs on the {keras.backend.backend()} backend, not torch")
    layer = keras.layers.MultiHeadAttention(num_heads=case.heads, key_dim=case.embed_dim // case.heads)
    training = case.mode == "train"
    return lambda x: layer(x, x, use_causal_mask=case.causal, training=training)


def _module_step(label: str, case: Case, device: torch.device) -> tuple[Callable[[], object], list[Tensor]]:
    """A step for a module-level contender, and the tensors whose .grad it fills."""
    dtype = getattr(torch, case.dtype)
    factory = {"device": device, "dtype": dtype}
    b, n, e, h = case.batch, case.length, case.embed_dim, case.heads
    torch.manual_seed(0)
    x = torch.randn(b, n, e, **factory, requires_grad=case.mode == "train")
    base = label.split("@")[0]
    train_module = case.mode in ("train", "forward-train-module")
    mask = (
        torch.ones(n, n, dtype=torch.bool, device=device).triu(1) if case.causal else None
    )  # torch's bool masks: True = masked out
    if base == OURS:
        mod: nn.Module = MultiHeadAttention(e, h, kv_heads=case.kv_heads, **factory)
        weights = case.mode == "weights"
        fn: Callable[[], object] = lambda: mod(x, causal=case.causal, return_weights=weights)  # noqa: E731
    elif base == "torch":
        if case.kv_heads not in (None, h):
            raise RuntimeError("torch.nn.MultiheadAttention has no grouped-query heads")
        mod = nn.MultiheadAttention(e, h, batch_first=True, **factory)
        need = case.mode == "weights"
        fn = lambda: mod(x, x, x, need_weights=need, attn_mask=mask, is_causal=case.causal)[0]  # noqa: E731
    elif base == "naive":
        mod = NaiveMHA(e, h, **factory)
        fn = lambda: mod(x, case.causal)  # noqa: E731
    elif base == "keras":
        layer = _keras_layer(case, device)
        fn = lambda: layer(x)  # noqa: E731
        return _step(fn, case, [x]), [x]
    else:
        raise ValueError(f"unknown contender {label!r}")
    mod.train(train_module)
    grads = [x, *mod.parameters()]
    return _step(fn, case, grads), grads


def _attention_step(
    label: str, case: Case, device: torch.device
) -> tuple[Callable[[], object], list[Tensor]]:
    """A step for an attention-level contender (q, k, v given)."""
    dtype = getattr(torch, case.dtype)
    b, n, h = case.batch, case.length, case.heads
    hkv, d = case.kv_heads or h, case.embed_dim // h
    torch.manual_seed(0)
    grad = case.mode == "train"
    q = torch.randn(b, h, n, d, device=device, dtype=dtype, requires_grad=grad)
    k, v = (torch.randn(b, hkv, n, d, device=device, dtype=dtype, requires_grad=grad) for _ in range(2))
    base = label.split("@")[0]
    if base == OURS:
        fn: Callable[[], object] = lambda: attention(q, k, v, causal=case.causal)  # noqa: E731
    elif base == "sdpa":
        fn = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=case.causal, enable_gqa=hkv != h)  # noqa: E731
    elif base == "naive":
        fn = lambda: naive_attention(q, k, v, case.causal)  # noqa: E731
    else:
        raise ValueError(f"unknown contender {label!r}")
    return _step(fn, case, [q, k, v]), [q, k, v]


def _first(out: object) -> Tensor:
    return out[0] if isinstance(out, tuple) else out  # type: ignore[return-value]


def _step(fn: Callable[[], object], case: Case, grads: list[Tensor]) -> Callable[[], object]:
    if case.mode != "train":

        def forward() -> object:
            with torch.no_grad():
                return fn()

        return forward

    def train() -> object:
        for t in grads:
            t.grad = None
        _first(fn()).float().sum().backward()
        return None

    return train


def _matmul_step(device: torch.device, n: int) -> Callable[[], object]:
    a, b = (torch.randn(n, n, device=device) for _ in range(2))
    return lambda: a @ b


# ----------------------------------------------------------------------------------------------
# Measurement
# ----------------------------------------------------------------------------------------------


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _rss() -> tuple[int, int]:
    """(current, peak) resident set size in bytes, from /proc/self/status."""
    status = Path("/proc/self/status").read_text()
    cur, peak = (int(re.search(rf"{k}:\s+(\d+)", status).group(1)) * 1024 for k in ("VmRSS", "VmHWM"))  # type: ignore[union-attr]
    return cur, peak


def _cpu_memory_tracking() -> bool:
    """Make freed memory go back to the OS at once (glibc) so the resident set tracks live tensors."""
    if not Path("/proc/self/clear_refs").exists():
        return False
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD = 1 MiB, fixed: big blocks are mmap-ed
        libc.malloc_trim(0)  # return what the heap holds free now
    return True


def peak_memory(step: Callable[[], object], device: torch.device) -> float | None:
    """Peak memory growth of one ``step()`` above what was allocated before it, in MiB."""
    _sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        step()
        _sync(device)
        return (torch.cuda.max_memory_allocated(device) - before) / 2**20
    if not _cpu_memory_tracking():
        return None
    try:
        Path("/proc/self/clear_refs").write_text("5")  # reset the peak RSS (VmHWM)
    except OSError:
        return None
    before, _ = _rss()
    out = step()
    del out
    _, peak = _rss()
    return max(0.0, (peak - before) / 2**20)


class Progress:
    """A one-line text progress bar on stderr."""

    def __init__(self, total: int, stream: object = None) -> None:
        self.total, self.done, self.stream, self.t0 = max(1, total), 0, stream or sys.stderr, time.time()

    def update(self, note: str) -> None:
        self.done += 1
        frac = self.done / self.total
        bar = "#" * int(30 * frac) + "." * (30 - int(30 * frac))
        line = f"\r[{bar}] {self.done}/{self.total} {time.time() - self.t0:6.1f}s {note[:60]:<60}"
        self.stream.write(line)  # type: ignore[attr-defined]
        self.stream.flush()  # type: ignore[attr-defined]

    def close(self) -> None:
        self.stream.write("\n")  # type: ignore[attr-defined]


def _lxl_bytes(case: Case, label: str, device: torch.device) -> int:
    """Bytes of the (B, H, L, L) scores a contender materialises (0 when it need not)."""
    c = case.variant(label)
    full = c.batch * c.heads * c.length * c.length * torch.finfo(getattr(torch, c.dtype)).bits // 8
    base = label.split("@")[0]
    if base in ("naive", "keras") or c.mode == "weights":
        return full
    if base == "torch" and c.mode == "forward" and device.type == "cpu":  # native fast path
        return full
    return 0


def _available_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    meminfo = Path("/proc/meminfo").read_text() if Path("/proc/meminfo").exists() else ""
    m = re.search(r"MemAvailable:\s+(\d+)", meminfo)
    return int(m.group(1)) * 1024 if m else 1 << 34


def _make(label: str, case: Case, device: torch.device) -> tuple[Callable[[], object], list[Tensor]]:
    c = case.variant(label)
    return (_attention_step if c.level == "attention" else _module_step)(label, c, device)


def _interleaved(
    case: Case,
    steps: dict[str, Callable[[], object]],
    device: torch.device,
    rounds: int,
    warmup: int,
    progress: Progress,
    results: dict[str, dict],
) -> dict[str, list[float]]:
    """Run every step once per round, in turn (A B C A B C ...); the times after the warm-up rounds."""
    times: dict[str, list[float]] = {k: [] for k in steps}
    for i in range(warmup + rounds):
        for label, step in list(steps.items()):
            try:
                _sync(device)
                t0 = time.perf_counter()
                step()
                _sync(device)
                dt = time.perf_counter() - t0
            except Exception as exc:  # a peer that fails here is reported, the suite goes on
                results[label] = {"status": f"error: {type(exc).__name__}: {exc}"[:200]}
                del steps[label], times[label]
                continue
            if i >= warmup:
                times[label].append(dt)
        progress.update(f"{case.name} ({i + 1}/{warmup + rounds})")
    return times


def _stats(case: Case, times: list[float], matmul_gflops: float | None, mem: float | None) -> dict:
    median = statistics.median(times)
    gflops = flops(case) / median / 1e9
    return {
        "status": "ok",
        "median_s": median,
        "times_s": times,
        "gflops": gflops,
        "fraction_of_matmul": gflops / matmul_gflops if matmul_gflops else None,
        "peak_memory_mib": mem,
    }


def run_case(
    case: Case,
    device: torch.device,
    rounds: int,
    warmup: int,
    progress: Progress,
    matmul_n: int = MATMUL_N,
    *,
    memory: bool = True,
) -> dict:
    """Time (interleaved) and measure one case; returns its JSON record.

    ``memory=False`` leaves the peak memory of a timed case to :func:`add_memory` (run after every
    timing: on the CPU, memory tracking changes how glibc hands out memory, and with it the timings).
    """
    steps: dict[str, Callable[[], object]] = {}
    results: dict[str, dict] = {}
    for label in case.contenders:
        need = _lxl_bytes(case, label, device)
        if need and need > _available_bytes(device) // 2:
            results[label] = {"status": f"skipped: would materialise (B, H, L, L) = {need / 2**30:.1f} GiB"}
            continue
        try:
            steps[label], _ = _make(label, case, device)
        except (ImportError, ModuleNotFoundError):
            results[label] = {"status": "not installed"}
        except Exception as exc:  # a peer that cannot run this case says why, the suite goes on
            results[label] = {"status": f"unavailable: {exc}"[:200]}
    if not case.memory_only:
        steps["matmul"] = _matmul_step(device, matmul_n)
    matmul_gflops = None
    if case.memory_only:  # one call each (long sequences): its time and its peak memory
        small = Case(**{**asdict(case), "length": min(case.length, 256)})
        for label in steps:  # first-call costs (thread pools, lazy init) out of the measurement
            _make(label, small, device)[0]()
        for label, step in steps.items():
            t0 = time.perf_counter()
            mem = peak_memory(step, device)
            median = time.perf_counter() - t0
            results[label] = _stats(case.variant(label), [median], None, mem)
            progress.update(f"{case.name}: {label}")
    else:
        times = _interleaved(case, steps, device, rounds, warmup, progress, results)
        matmul_gflops = 2 * matmul_n**3 / statistics.median(times.pop("matmul")) / 1e9
        for label in times:
            mem = peak_memory(steps[label], device) if memory else None
            results[label] = _stats(case.variant(label), times[label], matmul_gflops, mem)
    results = {label: results[label] for label in case.contenders if label in results}
    record = {k: v for k, v in asdict(case).items() if k not in ("overrides",)}
    record.update(flops=flops(case), matmul_gflops=matmul_gflops, results=results)
    return _compare(case, record)


def _compare(case: Case, record: dict) -> dict:
    """Fill in the ratios to multihead and the target checks of ``record``."""
    results = record["results"]
    ours = results.get(OURS, {}).get("median_s")
    ours_mem = results.get(OURS, {}).get("peak_memory_mib")
    for r in results.values():
        if r.get("status") == "ok" and ours:
            r["time_vs_multihead"] = r["median_s"] / ours
            if ours_mem is not None and r["peak_memory_mib"]:
                r["memory_vs_multihead"] = r["peak_memory_mib"] / max(ours_mem, 1e-9)
    record["checks"] = [_check(t, record) for t in case.targets]
    return record


def add_memory(case: Case, record: dict, device: torch.device, progress: Progress) -> dict:
    """Measure the peak memory of every contender of a timed case that ran (one call each)."""
    for label, r in record["results"].items():
        if r.get("status") == "ok" and r.get("peak_memory_mib") is None:
            step, _inputs = _make(label, case, device)  # the inputs stay alive: they are not growth
            step()  # warm (lazy initialisation, thread pools) as in the timed runs
            r["peak_memory_mib"] = peak_memory(step, device)
            progress.update(f"{case.name}: memory of {label}")
    return _compare(case, record)


def _check(target: str, record: dict) -> dict:
    """Evaluate one target sentence of :func:`cpu_suite` against a case record."""
    res = record["results"]
    ours = res.get(OURS, {})
    out = {"target": target, "value": None, "met": None}
    if ours.get("status") != "ok":
        return out
    m = re.fullmatch(
        r"ours (>=|<=) ([\d.]+)x faster than (\S+)|ours no slower than (\S+)|ours faster than (\S+)", target
    )
    m2 = re.fullmatch(r"ours (<=) ([\d.]+)x the time of (\S+)", target)
    m3 = re.fullmatch(r"ours >= (\d+)% of matmul GFLOP/s", target)
    m4 = re.fullmatch(r"ours memory <= ([\d.]+)x (\S+)", target)
    if m:
        if m.group(3):
            peer, need = m.group(3), float(m.group(2))
        else:
            peer, need = m.group(4) or m.group(5), 1.0
        speedup = _best(res, peer, "median_s")
        if speedup is not None:
            out["value"] = round(speedup / ours["median_s"], 3)
            out["met"] = out["value"] >= need if not m.group(5) else out["value"] > 1.0
    elif m2:
        other = res.get(m2.group(3), {})
        if other.get("status") == "ok":
            out["value"] = round(ours["median_s"] / other["median_s"], 3)
            out["met"] = out["value"] <= float(m2.group(2))
    elif m3 and ours.get("fraction_of_matmul") is not None:
        out["value"] = round(ours["fraction_of_matmul"], 3)
        out["met"] = out["value"] >= int(m3.group(1)) / 100
    elif m4 and ours.get("peak_memory_mib") is not None:
        peer_mem = _best(res, m4.group(2), "peak_memory_mib")
        if peer_mem:
            out["value"] = round(ours["peak_memory_mib"] / peer_mem, 3)
            out["met"] = out["value"] <= float(m4.group(1))
    return out


def _best(res: dict, peer: str, key: str) -> float | None:
    """The smallest ``key`` over the peer's runs (``peer`` and ``peer@...`` variants) that completed."""
    vals = [
        r[key]
        for label, r in res.items()
        if (label == peer or ("@" not in peer and label.split("@")[0] == peer)) and r.get(key) is not None
    ]
    return min(vals) if vals else None


def _in_fresh_process(case: Case, rounds: int, progress: Progress, *, quick: bool = False) -> dict:
    """Run a CPU memory case alone in a new process: a peak resident set measured after other cases
    carries their heap (fragments, thread arenas) and is not comparable between contenders.

    ``quick``: ``case`` comes from the quick suite (the child looks it up there by name).
    """
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "multihead", "bench", "--only", case.name, "--out", tmp, "--no-progress"]
        cmd += ["--rounds", str(rounds), *(["--quick"] if quick else [])]
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"memory case {case.name!r} failed in its own process:\n{done.stderr[-2000:]}")
        report = json.loads((Path(tmp) / ("cpu-quick.json" if quick else "cpu.json")).read_text())
    (record,) = [r for r in report["cases"] if r["name"] == case.name]
    for label in case.contenders:
        progress.update(f"{case.name}: {label} (own process)")
    return record


def run_suite(
    cases: list[Case],
    device: torch.device,
    *,
    rounds: int = 7,
    warmup: int = 2,
    progress: bool = True,
    matmul_n: int = MATMUL_N,
    isolate_memory: bool = True,
) -> dict:
    """Run ``cases`` on ``device``; returns the full JSON-able report.

    ``isolate_memory``: on the CPU, run each memory-only case in its own process (clean heap)."""
    # Every timing first, under the allocator's normal behaviour (as users run); then the memory
    # measurements, which on the CPU make glibc return each freed block to the OS at once.
    total = sum(len(c.contenders) if c.memory_only else warmup + rounds + len(c.contenders) for c in cases)
    bar = Progress(total, sys.stderr if progress else open(os.devnull, "w"))  # noqa: SIM115
    timed = [c for c in cases if not c.memory_only]
    by_case = {id(c): run_case(c, device, rounds, warmup, bar, matmul_n, memory=False) for c in timed}
    if device.type == "cpu":
        _cpu_memory_tracking()  # before any memory measurement, so that no freed block lingers in the heap
    for c in cases:
        if c.memory_only and device.type == "cpu" and isolate_memory and len(cases) > 1:
            by_case[id(c)] = _in_fresh_process(c, rounds, bar)
        elif c.memory_only:
            by_case[id(c)] = run_case(c, device, rounds, warmup, bar, matmul_n)
        else:
            add_memory(c, by_case[id(c)], device, bar)
    records = [by_case[id(c)] for c in cases]
    bar.close()
    return {
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "rounds": rounds,
        "matmul_n": matmul_n,
        "warmup": warmup,
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "cases": records,
    }


# ----------------------------------------------------------------------------------------------
# Reports
# ----------------------------------------------------------------------------------------------


def _fmt(x: float | None, spec: str) -> str:
    return "" if x is None else format(x, spec)


def markdown(report: dict) -> str:
    """The report as markdown: one table of contenders per case, then the targets."""
    unit, scale = ("TFLOP/s", 1e-3) if report["device"].startswith("cuda") else ("GFLOP/s", 1.0)
    lines = [
        f"Device {report['device']} ({report['device_name']}), torch {report['torch']}, "
        f"{report['threads']} threads, {report['date']}; median of {report['rounds']} interleaved runs "
        f"after {report['warmup']} warm-up.",
        "",
        f"| case | contender | median ms | {unit} | of matmul | time / multihead | peak MiB |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for rec in report["cases"]:
        shape = f"B={rec['batch']} L={rec['length']} E={rec['embed_dim']} H={rec['heads']}"
        shape += f" Hkv={rec['kv_heads']}" if rec["kv_heads"] else ""
        for label, r in rec["results"].items():
            head = f"{rec['name']} ({shape}, {rec['mode']}, {rec['dtype']})" if label == OURS else ""
            if r.get("status") != "ok":
                lines.append(f"| {head} | {label} | {r.get('status')} | | | | |")
                continue
            lines.append(
                f"| {head} | {label} | {r['median_s'] * 1e3:.1f} | {_fmt(r['gflops'] * scale, '.1f')} "
                f"| {_fmt(r['fraction_of_matmul'], '.0%')} | {_fmt(r.get('time_vs_multihead'), '.2f')}x "
                f"| {_fmt(r['peak_memory_mib'], '.0f')} |"
            )
    checks = [(rec["name"], c) for rec in report["cases"] for c in rec["checks"]]
    if checks:
        lines += ["", "| case | target | measured | met |", "| --- | --- | ---: | :---: |"]
        for name, c in checks:
            met = {True: "yes", False: "**no**", None: "n/a"}[c["met"]]
            lines.append(f"| {name} | {c['target']} | {_fmt(c['value'], '.3f')} | {met} |")
    return "\n".join(lines) + "\n"


def chart(report: dict, path: Path) -> None:
    """A bar chart of the rate of every contender per case (fraction of the matmul rate on CPU)."""
    import matplotlib  # noqa: PLC0415  (optional, only for the chart)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    cases = [r for r in report["cases"] if not r["memory_only"]]
    labels = sorted({lab for r in cases for lab in r["results"]}, key=lambda s: (s != OURS, s))
    fig, ax = plt.subplots(figsize=(max(8, 1.4 * len(cases)), 5))
    width = 0.8 / max(1, len(labels))
    for j, lab in enumerate(labels):
        ys = [r["results"].get(lab, {}).get("gflops") or 0.0 for r in cases]
        ax.bar([i + j * width for i in range(len(cases))], ys, width, label=lab)
    rates = [r["matmul_gflops"] for r in cases if r["matmul_gflops"]]
    if rates:
        ax.axhline(statistics.median(rates), color="k", ls="--", lw=1, label="2048x2048 matmul")
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(cases))])
    ax.set_xticklabels([r["name"].replace(" ", "\n", 2) for r in cases], fontsize=7)
    ax.set_ylabel("GFLOP/s (higher is better)")
    ax.set_title(
        f"multi-head attention on {report['device']} ({report['threads']} threads, torch {report['torch']})"
    )
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write(report: dict, out: Path, stem: str) -> list[Path]:
    """Write ``stem``.json / .md / .png under ``out``; returns the paths."""
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / f"{stem}.json", out / f"{stem}.md", out / f"{stem}.png"]
    paths[0].write_text(json.dumps(report, indent=1) + "\n")
    paths[1].write_text(markdown(report))
    try:
        chart(report, paths[2])
    except ImportError:
        paths.pop()
    return paths


def main(argv: list[str] | None = None) -> int:
    """``multihead bench [--quick] [--device cpu|cuda] [--out DIR]``."""
    parser = argparse.ArgumentParser(prog="multihead bench", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``bench`` options, shared by ``multihead bench`` and :func:`main`."""
    parser.add_argument("--quick", action="store_true", help="tiny shapes, a few seconds (a smoke test)")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--out", default="benchmarks/results", help="folder for JSON, markdown and PNG")
    parser.add_argument("--rounds", type=int, default=None, help="timed runs per contender (default 7)")
    parser.add_argument("--only", default=None, help="run only cases whose name contains this text")
    parser.add_argument("--no-progress", action="store_true")


def run(args: argparse.Namespace) -> int:
    """Run the suite the parsed ``args`` describe and write its reports."""
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("multihead bench: --device cuda but torch.cuda.is_available() is False", file=sys.stderr)
        return 2
    cases = (cuda_suite if device.type == "cuda" else cpu_suite)(args.quick)
    if args.only:
        cases = [c for c in cases if args.only in c.name]
    rounds = args.rounds or (2 if args.quick else 7)
    report = run_suite(
        cases,
        device,
        rounds=rounds,
        warmup=1 if args.quick else 2,
        progress=not args.no_progress,
        matmul_n=256 if args.quick else MATMUL_N,
        isolate_memory=not args.quick,
    )
    report["quick"] = bool(args.quick)
    stem = device.type + ("-quick" if args.quick else "")
    for p in write(report, Path(args.out), stem):
        print(f"wrote {p}")
    print(markdown(report))
    return 0
