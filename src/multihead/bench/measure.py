"""Timing and memory: interleaved rounds, peak memory of one call.

Timing: every step of a case runs once per round, in turn (A B C A B C ...), after warm-up rounds, so
machine load hits all of them alike and per-round ratios compare like with like. The number of rounds
adapts to the case: at least ``min_rounds``, more while the case stays within ``budget_s`` seconds (up
to ``max_rounds``), so fast cases get many rounds and a tight spread.

Memory: peak growth of one call above what was allocated before it. CUDA: the allocator's peak. CPU: the
process's peak resident set (``VmHWM``, reset through ``/proc/self/clear_refs``), with glibc told to hand
freed blocks back to the OS at once (:func:`track_cpu_memory`) -- which changes timings, so memory is
measured after every timing of a process.
"""

from __future__ import annotations

import contextlib
import ctypes
import re
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import NamedTuple

import torch

from .contenders import Step

__all__ = [
    "Settings",
    "available_bytes",
    "balanced_orders",
    "interleaved",
    "live_tensor_peak",
    "peak_memory",
    "track_cpu_memory",
]


class Settings(NamedTuple):
    """How a case is timed: ``warmup`` rounds, then ``min_rounds`` .. ``max_rounds`` timed rounds, as
    many as fit in ``budget_s`` seconds; the yardstick is an (``matmul_n``, ``matmul_n``) matmul in
    ``matmul_dtype``."""

    warmup: int = 2
    min_rounds: int = 11
    max_rounds: int = 101
    budget_s: float = 10.0
    matmul_n: int = 2048
    matmul_dtype: str = "float32"


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(step: Step, device: torch.device) -> float:
    if step.prepare is not None:
        step.prepare()
    sync(device)
    t0 = time.perf_counter()
    step.run()
    sync(device)
    return time.perf_counter() - t0


def interleaved(
    steps: Mapping[str, Step],
    device: torch.device,
    rounds: Settings,
    note: Callable[[str], None],
) -> tuple[dict[str, list[float]], dict[str, str]]:
    """Time ``steps`` in interleaved rounds; returns (times after warm-up per label, errors per label).

    Each round runs the steps in the next order of :func:`balanced_orders`, so that over a cycle of
    rounds every step runs right after every other equally often: what runs before a step changes its
    time (a large matmul leaves the caches cold: at B=64, L=5 the module always right after the yardstick
    took 1.06-1.12x torch's time, 1.00x and 1.06x in balanced orders). A step that raises is dropped from
    the later rounds and reported in the errors (the suite goes on).
    """
    live = dict(steps)
    times: dict[str, list[float]] = {k: [] for k in steps}
    errors: dict[str, str] = {}
    t_start, i = time.perf_counter(), 0
    while live:
        steps_now = list(live.items())
        orders = balanced_orders(len(steps_now))
        for label, step in (steps_now[j] for j in orders[i % len(orders)]):
            try:
                dt = _timed(step, device)
            except Exception as exc:  # a peer that fails is reported, the others go on
                errors[label] = f"error: {type(exc).__name__}: {exc}"[:200]
                del live[label], times[label]
                continue
            if i >= rounds.warmup:
                times[label].append(dt)
        i += 1
        done = i - rounds.warmup
        if i == rounds.warmup:
            t_start = time.perf_counter()
        note(f"round {max(done, 0)}")
        if done >= rounds.max_rounds:
            break
        if (
            done >= rounds.min_rounds
            and (time.perf_counter() - t_start) * (done + 1) / done > rounds.budget_s
        ):
            break
    return times, errors


def balanced_orders(n: int) -> list[list[int]]:
    """Orders of ``n`` steps in which every step comes right after every other step equally often: a
    Williams design, ``n`` orders for an even ``n`` (each ordered pair once), ``2n`` for an odd one (the
    orders and their mirrors, each pair twice). A rotation (A B C, B C A, C A B) would not do: it keeps
    every step's predecessor. ``balanced_orders(4)[0] == [0, 1, 3, 2]``."""
    first, lo, hi = [0], 1, n - 1
    while len(first) < n:
        first.append(lo)
        lo += 1
        if len(first) < n:
            first.append(hi)
            hi -= 1
    orders = [[(j + i) % n for j in first] for i in range(n)]
    return orders if n % 2 == 0 else orders + [o[::-1] for o in orders]


def _rss() -> tuple[int, int]:
    """(current, peak) resident set size in bytes, from /proc/self/status."""
    status = Path("/proc/self/status").read_text()
    found = [re.search(rf"{k}:\s+(\d+)", status) for k in ("VmRSS", "VmHWM")]
    cur, peak = (int(m.group(1)) * 1024 if m else 0 for m in found)
    return cur, peak


def track_cpu_memory() -> bool:
    """Make freed memory go back to the OS at once (glibc) so the resident set tracks live tensors."""
    if not Path("/proc/self/clear_refs").exists():
        return False
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD = 1 MiB, fixed: big blocks are mmap-ed
        libc.malloc_trim(0)  # return what the heap holds free now
    return True


def peak_memory(step: Step, device: torch.device) -> float | None:
    """Peak memory growth of one ``step.run()`` above what was allocated before it, in MiB."""
    if step.prepare is not None:
        step.prepare()
    sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        step.run()
        sync(device)
        return (torch.cuda.max_memory_allocated(device) - before) / 2**20
    if not track_cpu_memory():
        return None
    try:
        Path("/proc/self/clear_refs").write_text("5")  # reset the peak RSS (VmHWM)
    except OSError:
        return None
    before, _ = _rss()
    out = step.run()
    del out
    _, peak = _rss()
    return max(0.0, (peak - before) / 2**20)


def live_tensor_peak(run: Callable[[], object]) -> float:
    """MiB of live CPU tensors at the peak of ``run()``, above those alive before it: every allocation and
    free of torch's CPU allocator, in order (its profiler), so where glibc places them -- which moves a
    resident-set measurement by up to a few MiB between processes -- is left out. ``run``'s result is
    dropped inside the measurement."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = run()
        del out
    events = sorted(
        (e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"
    )
    live = peak = 0
    for _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    return peak / 2**20


def available_bytes(device: torch.device) -> int:
    """Free memory on ``device`` (CPU: ``MemAvailable``; 16 GiB when unknown)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    meminfo = Path("/proc/meminfo").read_text() if Path("/proc/meminfo").exists() else ""
    m = re.search(r"MemAvailable:\s+(\d+)", meminfo)
    return int(m.group(1)) * 1024 if m else 1 << 34
