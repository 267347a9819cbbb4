"""Ring attention scaling: time and peak memory per rank over 1, 2, 4 ... processes.

* strong scaling: a fixed total sequence split over P ranks;
* weak scaling: a fixed number of tokens per rank, so the total grows with P;
* causal load balance: score entries each rank computes, contiguous vs zigzag (counted, not timed);
* baseline: single-process ``multihead.attention`` (fused SDPA) on the whole sequence.

CPU with gloo (the processes are spawned here)::

    python benchmarks/bench_ring.py                      # writes benchmarks/results/ring_cpu.{json,md,png}

GPUs with NCCL, one process per GPU (``--worlds`` up to the GPU count)::

    python benchmarks/bench_ring.py --backend nccl --worlds 1 2 4 8 --total 65536 --per-rank 16384 \\
        --dtype bfloat16 --name ring_gpu

Peak memory per rank is measured above what the rank held before the step (inputs included in that),
on CPU from the kernel's peak resident set (``VmHWM``, reset through ``/proc/self/clear_refs``, with
glibc returning large blocks at once), on GPU from ``torch.cuda.max_memory_allocated``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import torch
import torch.distributed as dist

import multihead as mh
from multihead import distributed as mhd

RESULTS = Path(__file__).resolve().parent / "results"


# ----------------------------------------------------------------------------------------------
# Inside each rank
# ----------------------------------------------------------------------------------------------


def _proc_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


class _PeakMemory:
    """Peak bytes allocated inside the ``with`` block, above the level at its start."""

    def __init__(self, device: torch.device):
        self.device = device
        self.peak = 0

    def __enter__(self):
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.base = torch.cuda.memory_allocated(self.device)
        else:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # resets VmHWM to the current resident set
            self.base = _proc_kib("VmRSS") * 1024
        return self

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak = torch.cuda.max_memory_allocated(self.device) - self.base
        else:
            self.peak = _proc_kib("VmHWM") * 1024 - self.base


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def rank_job(cfg: dict, total: int, single: bool) -> dict:
    """One fwd+bwd timing and memory measurement on this rank (``single``: plain multihead.attention)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(cfg["threads"] or max(1, (os.cpu_count() or 1) // world))
    device = torch.device("cpu")
    if dist.get_backend() == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    dtype = getattr(torch, cfg["dtype"])
    b, h, hkv, d, layout = cfg["batch"], cfg["heads"], cfg["kv_heads"], cfg["head_dim"], cfg["layout"]
    lr = len(mhd.shard(torch.arange(total), 0, rank, world, layout))  # this rank's tokens
    gen = torch.Generator(device="cpu").manual_seed(rank)
    q, k, v, g = (
        torch.randn(b, n, lr, d, generator=gen).to(device, dtype).requires_grad_(i < 3)
        for i, n in enumerate((h, hkv, hkv, h))
    )

    def step() -> None:
        for t in (q, k, v):
            t.grad = None
        if single:
            out = mh.attention(q, k, v, causal=cfg["causal"])
        else:
            out = mhd.ring_attention(q, k, v, causal=cfg["causal"], layout=layout)
        (out * g).sum().backward()
        _sync(device)

    step()  # warm-up (allocator, gloo connections)
    times = []
    for _ in range(cfg["repeats"]):
        dist.barrier()
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    dist.barrier()
    with _PeakMemory(device) as mem:
        step()
    return {
        "rank": rank,
        "tokens": lr,
        "threads": torch.get_num_threads(),
        "seconds": statistics.median(times),
        "peak_bytes": mem.peak,
    }


# ----------------------------------------------------------------------------------------------
# Driver
# ----------------------------------------------------------------------------------------------


def _progress(i: int, n: int, label: str) -> None:
    done = int(30 * i / n)
    sys.stderr.write(f"\r[{'#' * done}{' ' * (30 - done)}] {i}/{n} {label:<40}")
    sys.stderr.flush()
    if i == n:
        sys.stderr.write("\n")


def _environment(cfg: dict) -> dict:
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    except OSError:
        commit = ""
    env = {
        "date_utc": datetime.now(UTC).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
        "cpu": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "load_average_at_start": os.getloadavg(),
        "backend": cfg["backend"],
        "git_commit": commit,
        "note": "shared machine: other jobs ran at the same time; times are noisy, memory is not",
    }
    if cfg["backend"] == "nccl":
        env["gpu"] = torch.cuda.get_device_name(0)
        env["gpu_count"] = torch.cuda.device_count()
    return env


def _run(cfg: dict, world: int, total: int, single: bool = False) -> dict:
    ranks = mhd.launch(rank_job, world, (cfg, total, single), backend=cfg["backend"], timeout=600)
    return {
        "world": world,
        "total_tokens": total,
        "seconds_max": max(r["seconds"] for r in ranks),
        "peak_mib_max": max(r["peak_bytes"] for r in ranks) / 2**20,
        "ranks": ranks,
    }


def _markdown(res: dict) -> str:
    cfg = res["config"]
    lines = [
        f"# Ring attention scaling ({res['environment']['backend']})",
        "",
        f"B={cfg['batch']}, H={cfg['heads']}, Hkv={cfg['kv_heads']}, D={cfg['head_dim']}, {cfg['dtype']}, "
        f"causal={cfg['causal']}, layout={cfg['layout']}; forward + backward, median of {cfg['repeats']}; "
        f"memory = peak per rank above the inputs. Environment in the JSON "
        f"({res['environment']['cpu_count']} CPUs, load average {res['environment']['load_average_at_start']}).",
        "",
    ]
    for key, title in (("strong", "Fixed total sequence"), ("weak", "Fixed tokens per rank")):
        lines += [
            f"## {title}",
            "",
            "| ranks | total tokens | tokens/rank | time (s) | peak MiB/rank |",
            "|---|---|---|---|---|",
        ]
        for row in res[key]:
            lines.append(
                f"| {row['world']} | {row['total_tokens']} | {row['ranks'][0]['tokens']} | "
                f"{row['seconds_max']:.3f} | {row['peak_mib_max']:.1f} |"
            )
        lines.append("")
    base = res["baseline"]
    lines += [
        f"Single-process `multihead.attention` (fused SDPA) on the same {base['total_tokens']} tokens: "
        f"{base['seconds_max']:.3f} s, {base['peak_mib_max']:.1f} MiB.",
        "",
        "## Causal load balance (score entries per rank, per batch and head)",
        "",
        "| ranks | contiguous: max / mean | zigzag: max / mean |",
        "|---|---|---|",
    ]
    for row in res["balance"]:
        c, z = row["contiguous"], row["zigzag"]
        lines.append(
            f"| {row['world']} | {max(c)} / {statistics.mean(c):.0f} ({max(c) / statistics.mean(c):.2f}x) | "
            f"{max(z)} / {statistics.mean(z):.0f} ({max(z) / statistics.mean(z):.2f}x) |"
        )
    return "\n".join(lines) + "\n"


def _plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    strong, weak = res["strong"], res["weak"]
    ps = [r["world"] for r in strong]
    mem = [r["peak_mib_max"] for r in strong]
    axes[0].plot(ps, mem, "o-", label="ring attention, measured")
    axes[0].plot(ps, [mem[0] / p for p in ps], "k--", label="1/P")
    axes[0].axhline(res["baseline"]["peak_mib_max"], color="gray", ls=":", label="single-process SDPA")
    axes[0].set(
        xlabel="ranks P",
        ylabel="peak MiB per rank",
        title=f"memory, {strong[0]['total_tokens']} tokens total",
    )
    axes[1].plot(
        ps, [r["seconds_max"] for r in strong], "o-", label=f"fixed total ({strong[0]['total_tokens']})"
    )
    axes[1].plot(
        [r["world"] for r in weak],
        [r["seconds_max"] for r in weak],
        "s-",
        label=f"fixed per rank ({weak[0]['total_tokens']})",
    )
    axes[1].set(xlabel="ranks P", ylabel="seconds (fwd + bwd, slowest rank)", title="time")
    for layout, marker in (("contiguous", "o-"), ("zigzag", "s-")):
        axes[2].plot(
            [r["world"] for r in res["balance"]],
            [max(r[layout]) / statistics.mean(r[layout]) for r in res["balance"]],
            marker,
            label=layout,
        )
    axes[2].set(xlabel="ranks P", ylabel="max / mean work per rank", title="causal load balance")
    for ax in axes:
        ax.set_xticks(ps)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--backend", default="gloo", choices=["gloo", "nccl"])
    parser.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--total", type=int, default=4096, help="strong scaling: total tokens")
    parser.add_argument("--per-rank", type=int, default=1024, help="weak scaling: tokens per rank")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--layout", default="zigzag", choices=mhd.LAYOUTS)
    parser.add_argument("--no-causal", dest="causal", action="store_false")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0, help="torch threads per rank (0: CPUs // ranks)")
    parser.add_argument("--name", default="ring_cpu", help="results file stem under benchmarks/results/")
    cfg = vars(parser.parse_args())
    # glibc: hand every block >= 64 KiB straight back to the kernel, so the resident set follows the live
    # tensors and its peak is the rank's peak (inherited by the spawned ranks).
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")

    res: dict = {"config": cfg, "environment": _environment(cfg), "strong": [], "weak": []}
    jobs = [("strong", p, cfg["total"]) for p in cfg["worlds"]] + [
        ("weak", p, cfg["per_rank"] * p) for p in cfg["worlds"]
    ]
    for i, (kind, world, total) in enumerate(jobs):
        _progress(i, len(jobs) + 1, f"{kind} P={world} L={total}")
        res[kind].append(_run(cfg, world, total))
    _progress(len(jobs), len(jobs) + 1, "baseline: single-process SDPA")
    res["baseline"] = _run(cfg, 1, cfg["total"], single=True)
    _progress(len(jobs) + 1, len(jobs) + 1, "done")
    res["balance"] = [
        {"world": p, **{lay: mhd.causal_work(cfg["total"], p, lay) for lay in ("contiguous", "zigzag")}}
        for p in cfg["worlds"]
    ]

    RESULTS.mkdir(exist_ok=True)
    stem = RESULTS / cfg["name"]
    stem.with_suffix(".json").write_text(json.dumps(res, indent=1) + "\n")
    stem.with_suffix(".md").write_text(_markdown(res))
    _plot(res, stem.with_suffix(".png"))
    print(_markdown(res))


if __name__ == "__main__":
    main()
