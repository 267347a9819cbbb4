"""What a sliding window given as a mask function holds, and what keeping its partial tiles saves (issue 55,
item 4).

Dimensions: B batch, H heads, L length, D head dim.

Three measurements, all with B=1, H=8, D=64, float32, ``backend="blocked"``:

1. **Live tensors** (torch's profiler: every allocation and free of the CPU allocator, in order): the peak
   above what was alive before the call, for a two-sided lambda window of 512 after one warm-up call, and
   for the unmasked call; and the bytes the tile memo keeps across calls. One thread (the kernels' own
   buffers are per thread).
2. **Resident growth in fresh processes** (the issue's check, :func:`multihead.bench.measure.peak_memory`:
   glibc's mmap threshold fixed, the heap trimmed, the peak resident set's growth over one call after one
   warm-up), at L = 16,384, window and unmasked processes alternated. This includes where glibc places the
   call's temporaries, which varies from process to process: read the spread, not one run.
3. **Time** of the window with its partial tiles kept and with the memo switched off (every tile evaluated
   on every call, as before), in interleaved rounds (:func:`multihead.bench.pair.time_pair`), for a
   two-sided window, a causal window and chunks of 512; the machine's float32 matmul rate as yardstick.
4. **Dense evaluation** of a function on a whole (1, 4, L, L) grid, in chunks of query rows against one call
   on the whole grid, interleaved.

Run: ``python benchmarks/bench_window_memory.py [--quick] [--parts live,resident,time,dense]``; writes
``benchmarks/results/window_memory_<tag>.json`` and ``.md`` (``--tag``, default the CPU's short name).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from datetime import UTC, datetime
from pathlib import Path

import torch

import multihead as mh
from multihead.bench.measure import live_tensor_peak
from multihead.bench.pair import PAIR_SETTINGS, cpu_words, machine, time_pair
from multihead.bench.window_memory import growth
from multihead.core.masks import memo as memo_module
from multihead.core.masks.blocks import _CACHE
from multihead.progress import Progress

RESULTS = Path(__file__).resolve().parent / "results"
PARTS = "live,resident,time,dense"
WINDOW = 512


MASKS = {
    "two-sided window 512": lambda b, h, i, j: (i - j).abs() <= WINDOW,
    "causal window 512": lambda b, h, i, j: (i >= j) & (i - j <= WINDOW),
    "chunks of 512": lambda b, h, i, j: i // WINDOW == j // WINDOW,
}


def progress(items: list, desc: str):
    """``items``, one step of a progress bar each."""
    with Progress(len(items), desc) as bar:
        for item in items:
            yield item
            bar.update(1)


def _qkv(n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return tuple(torch.randn(1, 8, n, 64, generator=g) for _ in range(3))  # type: ignore[return-value]


def _call(q, k, v, fn, *, memo: bool = True):
    """The attention call to measure: ``fn`` as the mask on ``blocked`` (``memo=False``: every partial tile
    evaluated), or the unmasked call (``fn`` None)."""

    def run():
        if fn is None:
            return mh.attention(q, k, v)
        undo = (lambda: None) if memo else _memo_off()
        try:
            return mh.attention(q, k, v, mask=fn, backend="blocked")
        finally:
            undo()

    return run


def live_tensors(lengths: list[int]) -> list[dict]:
    """Part 1: the window's and the unmasked call's live-tensor peaks, and what the memo keeps."""
    rows = []
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for n in progress(lengths, desc="live tensors"):
            q, k, v = _qkv(n)
            fn = MASKS["two-sided window 512"]
            window, plain = _call(q, k, v, fn), _call(q, k, v, None)
            with torch.no_grad():
                window()  # warm-up: structure, probe, memo
                plain()
                w, p = live_tensor_peak(window), live_tensor_peak(plain)
            held = sum(
                b.memo.nbytes
                for key, (_, b) in _CACHE.get(fn, {}).items()
                if b is not None and key[0][2] == n
            )
            rows.append({"L": n, "output_mib": 8 * n * 64 * 4 / 2**20, "window_mib": w, "unmasked_mib": p,
                         "memo_kib": held / 1024})  # fmt: skip
    finally:
        torch.set_num_threads(before)
    return rows


def resident(n: int, windows: int, plains: int) -> dict:
    """Part 2: resident growth of fresh processes, window and unmasked alternated."""
    order = ["window"] * windows
    for i in range(plains):
        order.insert(min(len(order), 2 * i + 1), "plain")
    got: dict[str, list[float]] = {"window": [], "plain": []}
    for kind in progress(order, desc=f"fresh processes, L={n}"):
        got[kind].append(growth(n, kind))
    med = {k: statistics.median(v) for k, v in got.items()}
    return {
        "L": n,
        **{f"{k}_mib": sorted(v) for k, v in got.items()},
        "median_ratio": med["window"] / med["plain"],
    }


def _memo_off():
    """Every partial tile evaluated on every call (the memo bypassed), and a function to undo it."""
    keep = memo_module.TileMemo.keep
    memo_module.TileMemo.keep = lambda self, fn, place, evaluate: evaluate()  # type: ignore[method-assign]
    return lambda: setattr(memo_module.TileMemo, "keep", keep)


def timing(lengths: list[int], settings) -> list[dict]:
    """Part 3: the window with kept tiles against every tile evaluated, interleaved."""
    rows = []
    for n in lengths:
        q, k, v = _qkv(n)
        for name, fn in progress(list(MASKS.items()), desc=f"time, L={n}"):
            kept, every = _call(q, k, v, fn), _call(q, k, v, fn, memo=False)
            t = time_pair(every, kept, settings=settings)
            rows.append({"L": n, "mask": name, "kept_ms": t.second_s.median * 1e3,
                         "evaluated_ms": t.first_s.median * 1e3, "kept_over_evaluated": 1 / t.speedup.median,
                         "ratio_iqr": [1 / t.speedup.q3, 1 / t.speedup.q1]})  # fmt: skip
    return rows


def dense(lengths: list[int], settings) -> list[dict]:
    """Part 4: a mask and a bias function evaluated on a whole (1, 4, L, L) grid (what a dense backend does),
    in chunks of query rows against one call on the whole grid, interleaved."""
    from multihead.core.masks import evaluate

    fns = {"window mask": (lambda b, h, i, j: (i - j).abs() <= WINDOW, "mask"),
           "ALiBi-like bias": (lambda b, h, i, j: -(i - j).abs().float() * (h + 1) / 8, "bias")}  # fmt: skip
    rows = []
    for n in lengths:
        for name, (fn, kind) in progress(list(fns.items()), desc=f"dense, L={n}"):
            target = (1, 4, n, n)

            def chunked(fn=fn, kind=kind, target=target):
                return evaluate.evaluate_fn(fn, target, kind)

            def whole(fn=fn, kind=kind, target=target):
                chunk, evaluate.CHUNK = evaluate.CHUNK, 1 << 62
                try:
                    return evaluate.evaluate_fn(fn, target, kind)
                finally:
                    evaluate.CHUNK = chunk

            t = time_pair(whole, chunked, settings=settings)
            rows.append({"L": n, "function": name, "chunked_ms": t.second_s.median * 1e3,
                         "whole_ms": t.first_s.median * 1e3, "chunked_over_whole": 1 / t.speedup.median,
                         "ratio_iqr": [1 / t.speedup.q3, 1 / t.speedup.q1]})  # fmt: skip
    return rows


def matmul_gflops() -> float:
    a = torch.randn(2048, 2048)
    a @ a
    best = min((lambda t0: (a @ a, time.perf_counter() - t0)[1])(time.perf_counter()) for _ in range(5))
    return 2 * 2048**3 / best / 1e9


def markdown(rec: dict) -> str:
    lines = [f"{rec['cpu']}; torch {rec['torch']}; {rec['when']}; float32 matmul {rec['matmul_gflops']:.0f} GFLOP/s "
             f"({rec['threads']} threads). B=1, H=8, D=64, float32, `backend=\"blocked\"`.", "",
             "**Live tensors** (profiler, one thread; peak above what was alive before the call, after one warm-up):",
             "", "| L | output MiB | window MiB (beside output) | unmasked MiB (beside output) | memo keeps |",
             "| ---: | ---: | ---: | ---: | ---: |"]  # fmt: skip
    for r in rec["live"]:
        out = r["output_mib"]
        lines.append(f"| {r['L']:,} | {out:.0f} | {r['window_mib']:.3f} ({r['window_mib'] - out:.3f}) | "
                     f"{r['unmasked_mib']:.3f} ({r['unmasked_mib'] - out:.3f}) | {r['memo_kib']:.0f} KiB |")  # fmt: skip
    res = rec["resident"]
    if res:
        lines += ["", f"**Resident growth, fresh processes** (L = {res['L']:,}; MiB, sorted):", "",
                  f"- window: {', '.join(f'{x:.2f}' for x in res['window_mib'])}",
                  f"- unmasked: {', '.join(f'{x:.2f}' for x in res['plain_mib'])}",
                  f"- median window / median unmasked: {res['median_ratio']:.3f}x"]  # fmt: skip
    lines += ["", "**Time**, partial tiles kept / evaluated on every call (interleaved rounds, median [IQR]):", "",
              "| L | mask | kept ms | evaluated ms | kept / evaluated |", "| ---: | --- | ---: | ---: | ---: |"]  # fmt: skip
    for r in rec["time"]:
        lo, hi = r["ratio_iqr"]
        lines.append(f"| {r['L']:,} | {r['mask']} | {r['kept_ms']:.0f} | {r['evaluated_ms']:.0f} | "
                     f"{r['kept_over_evaluated']:.3f} [{lo:.3f}, {hi:.3f}] |")  # fmt: skip
    if rec.get("dense"):
        lines += ["", "**Dense evaluation** of a function on a (1, 4, L, L) grid, in chunks / one call on the "
                  "whole grid (interleaved rounds, median [IQR]):", "",
                  "| L | function | chunked ms | whole ms | chunked / whole |", "| ---: | --- | ---: | ---: | ---: |"]  # fmt: skip
        for r in rec["dense"]:
            lo, hi = r["ratio_iqr"]
            lines.append(f"| {r['L']:,} | {r['function']} | {r['chunked_ms']:.0f} | {r['whole_ms']:.0f} | "
                         f"{r['chunked_over_whole']:.3f} [{lo:.3f}, {hi:.3f}] |")  # fmt: skip
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small lengths, few processes; writes nothing")
    parser.add_argument("--tag", default="zen1", help="results file suffix (the CPU's short name)")
    parser.add_argument("--parts", default=PARTS, help=f"comma-separated, of {PARTS}")
    parser.add_argument(
        "--processes", type=int, default=12, help="fresh window processes (half as many unmasked)"
    )
    args = parser.parse_args()
    settings = PAIR_SETTINGS
    lengths = [1024] if args.quick else [4096, 16384]
    m = machine()
    rec = {"when": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"), "cpu": cpu_words(), "torch": torch.__version__,
           "threads": torch.get_num_threads(), "matmul_gflops": matmul_gflops(), "machine": m.words()}  # fmt: skip
    path = RESULTS / f"window_memory_{args.tag}.json"
    if args.parts != PARTS and path.exists():  # some parts rerun: the others kept from the last run
        rec = {**json.loads(path.read_text()), **rec}
    parts = set(args.parts.split(","))
    if "live" in parts:
        rec["live"] = live_tensors(lengths)
    if "resident" in parts:
        rec["resident"] = (
            resident(lengths[-1], 2, 1)
            if args.quick
            else resident(16384, args.processes, args.processes // 2)
        )
    if "time" in parts:
        rec["time"] = timing(lengths, settings)
    if "dense" in parts:
        rec["dense"] = dense([1024] if args.quick else [4096, 8192], settings)
    for part in parts:  # when each part ran (a rerun of some parts keeps the others' times)
        rec[f"when_{part}"] = rec["when"]
    rec["load_average_end"] = [round(x, 2) for x in os.getloadavg()]
    text = markdown(rec)
    print(text)
    if not args.quick:
        RESULTS.mkdir(exist_ok=True)
        path.write_text(json.dumps(rec, indent=1) + "\n")
        (RESULTS / f"window_memory_{args.tag}.md").write_text(text)


if __name__ == "__main__":
    main()
