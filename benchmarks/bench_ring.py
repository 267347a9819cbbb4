"""Ring attention: time and peak memory per rank over 1, 2, 4 ... processes, against one process.

* strong scaling: a fixed total sequence split over P ranks;
* weak scaling: a fixed number of tokens per rank, so the total grows with P;
* the peer: single-process ``multihead.attention`` on the same total, measured in the same run;
* causal load balance: score entries each rank computes, contiguous vs zigzag (counted, not timed).

Every case runs once per round and the rounds interleave the cases (in a shuffled order, the same on
every rank), so a slow spell of a shared machine lands on all of them; each number is the median over
the rounds with its interquartile range, and each ratio is taken round by round (ring and peer measured
seconds apart) before its median and IQR. All cases run in ONE launch of max(P) processes: a case on P
ranks uses the process group of ranks 0..P-1, while the others wait at a barrier.

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
import random
import statistics
import subprocess
import time
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path

import torch
import torch.distributed as dist

import multihead as mh
from multihead import distributed as mhd
from multihead.bench.stats import spread
from multihead.progress import Progress

RESULTS = Path(__file__).resolve().parent / "results"
TARGETS = {"time": 1.3, "memory": 1.5}  # one rank vs multihead.attention (issue 14)


@dataclass(frozen=True)
class Case:
    """One measured configuration: ``impl`` "ring" on ``world`` ranks or "attention" (one process)."""

    impl: str
    world: int
    total: int

    @property
    def label(self) -> str:
        return f"{self.impl} P={self.world} L={self.total}"


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


def _inputs(cfg: dict, case: Case, rank: int, device: torch.device) -> list[torch.Tensor]:
    """q, k, v (leaves) and the output gradient of this rank's shard: (B, H|Hkv, L_r, D)."""
    b, h, hkv, d = cfg["batch"], cfg["heads"], cfg["kv_heads"], cfg["head_dim"]
    lr = len(mhd.shard(torch.arange(case.total), 0, rank, case.world, cfg["layout"]))  # this rank's tokens
    gen = torch.Generator(device="cpu").manual_seed(rank)
    dtype = getattr(torch, cfg["dtype"])
    return [
        torch.randn(b, n, lr, d, generator=gen).to(device, dtype).requires_grad_(i < 3)
        for i, n in enumerate((h, hkv, hkv, h))
    ]


def rank_job(cfg: dict, cases: list[Case]) -> dict:
    """Every round runs every case once (shuffled order); returns this rank's seconds and peak bytes."""
    rank = dist.get_rank()
    device = torch.device("cpu")
    if dist.get_backend() == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    worlds = sorted({c.world for c in cases})
    groups = {p: dist.new_group(list(range(p))) for p in worlds}  # every rank creates every group
    cpus = os.cpu_count() or 1
    tensors = {c: _inputs(cfg, c, rank, device) for c in cases if rank < c.world}

    def step(case: Case) -> None:
        q, k, v, g = tensors[case]
        for t in (q, k, v):
            t.grad = None
        if case.impl == "attention":
            out = mh.attention(q, k, v, causal=cfg["causal"])
        else:
            out = mhd.ring_attention(
                q, k, v, causal=cfg["causal"], layout=cfg["layout"], group=groups[case.world]
            )
        (out * g).sum().backward()
        _sync(device)

    def measure(case: Case) -> tuple[float, int] | None:
        dist.barrier()
        if rank >= case.world:
            return None
        torch.set_num_threads(cfg["threads"] or max(1, cpus // case.world))
        dist.barrier(group=groups[case.world])
        with _PeakMemory(device) as mem:
            t0 = time.perf_counter()
            step(case)
            seconds = time.perf_counter() - t0
        return seconds, mem.peak

    for case in cases:  # warm-up: allocator, gloo connections, kernels
        measure(case)
    rng = random.Random(0)  # the same order on every rank
    rows: dict[str, list] = {c.label: [] for c in cases}
    bar = Progress(cfg["rounds"], "ring", enabled=rank == 0)
    for r in range(cfg["rounds"]):
        order = list(cases)
        rng.shuffle(order)
        for case in order:
            got = measure(case)
            if got is not None:
                rows[case.label].append(got)
        bar.update(1, round=r + 1)
    bar.close()
    dist.barrier()
    return {"rank": rank, "rows": rows}


# ----------------------------------------------------------------------------------------------
# Driver
# ----------------------------------------------------------------------------------------------


def _spread(values: list[float]) -> dict:
    """Median and interquartile range (:func:`multihead.bench.stats.spread`, as a JSON-ready dict)."""
    return spread(values)._asdict()


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
        "note": "shared machine: other jobs ran at the same time; times are noisy, ratios are per round",
    }
    if cfg["backend"] == "nccl":
        env["gpu"] = torch.cuda.get_device_name(0)
        env["gpu_count"] = torch.cuda.device_count()
    return env


def _summarise(cfg: dict, cases: list[Case], per_rank: list[dict]) -> dict:
    """Per case: per-round slowest-rank seconds and largest peak; medians, IQRs, ratios to the peer."""
    rounds = {}
    for c in cases:
        ranks = [r["rows"][c.label] for r in per_rank if r["rank"] < c.world]
        rounds[c] = [
            (max(rk[i][0] for rk in ranks), max(rk[i][1] for rk in ranks) / 2**20)
            for i in range(cfg["rounds"])
        ]
    peer = {c.total: c for c in cases if c.impl == "attention"}
    out = []
    for c in cases:
        secs, mib = [s for s, _ in rounds[c]], [m for _, m in rounds[c]]
        row = {
            **asdict(c),
            "kinds": _kinds(cfg, c),
            "tokens_per_rank": -(-c.total // c.world),
            "seconds": _spread(secs),
            "peak_mib": _spread(mib),
        }
        if c.impl == "ring" and c.total in peer:
            p = rounds[peer[c.total]]
            row["time_ratio"] = _spread([s / ps for (s, _), (ps, _) in zip(rounds[c], p)])
            row["memory_ratio"] = _spread([m / pm for (_, m), (_, pm) in zip(rounds[c], p)])
        row["rounds"] = rounds[c]
        out.append(row)
    return {"cases": out}


def _kinds(cfg: dict, c: Case) -> list[str]:
    """Which tables a case belongs to: "strong" (fixed total), "weak" (fixed per rank), "peer"."""
    if c.impl == "attention":
        return ["peer"]
    kinds = ["strong"] if c.total == cfg["total"] else []
    return kinds + (["weak"] if cfg["per_rank"] and c.total == cfg["per_rank"] * c.world else [])


def _fmt(s: dict, digits: int = 3) -> str:
    return f"{s['median']:.{digits}f} [{s['q1']:.{digits}f}, {s['q3']:.{digits}f}]"


def _markdown(res: dict) -> str:
    cfg, env = res["config"], res["environment"]
    lines = [
        f"# Ring attention scaling ({env['backend']})",
        "",
        f"B={cfg['batch']}, H={cfg['heads']}, Hkv={cfg['kv_heads']}, D={cfg['head_dim']}, {cfg['dtype']}, "
        f"causal={cfg['causal']}, layout={cfg['layout']}; forward + backward. Median [interquartile range] over "
        f"{cfg['rounds']} interleaved rounds; time = slowest rank, memory = largest peak per rank above its "
        f"inputs; ratios are taken round by round against single-process `multihead.attention` on the same "
        f"total. Environment in the JSON ({env['cpu_count']} CPUs shared with other jobs, load average "
        f"{tuple(round(x, 1) for x in env['load_average_at_start'])}).",
        "",
    ]
    one = [r for r in res["cases"] if r["impl"] == "ring" and r["world"] == 1 and "strong" in r["kinds"]]
    if one:
        r = one[0]
        t, m = r["time_ratio"], r["memory_ratio"]
        lines += [
            "## One rank vs `multihead.attention`",
            "",
            "| L | time ratio | target | peak memory ratio | target |",
            "|---|---|---|---|---|",
            f"| {r['total']} | {_fmt(t, 2)} | <= {TARGETS['time']} "
            f"({'met' if t['median'] <= TARGETS['time'] else 'missed'}) | {_fmt(m, 2)} | <= {TARGETS['memory']} "
            f"({'met' if m['median'] <= TARGETS['memory'] else 'missed'}) |",
            "",
        ]
    titles = (
        ("strong", "Fixed total sequence"),
        ("weak", "Fixed tokens per rank"),
        ("peer", "Single process"),
    )
    for kind, title in titles:
        rows = sorted((r for r in res["cases"] if kind in r["kinds"]), key=lambda r: (r["world"], r["total"]))
        if not rows:
            continue
        lines += [
            f"## {title}",
            "",
            "| impl | ranks | total tokens | tokens/rank | time (s) | peak MiB/rank | time / peer | memory / peer |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in rows:
            tr = _fmt(r["time_ratio"], 2) if "time_ratio" in r else "-"
            mr = _fmt(r["memory_ratio"], 2) if "memory_ratio" in r else "-"
            lines.append(
                f"| {r['impl']} | {r['world']} | {r['total']} | {r['tokens_per_rank']} | {_fmt(r['seconds'])} | "
                f"{_fmt(r['peak_mib'], 1)} | {tr} | {mr} |"
            )
        lines.append("")
    lines += [
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

    def err(rows: list[dict], key: str) -> tuple[list, list, list]:
        med = [r[key]["median"] for r in rows]
        return (
            med,
            [m - r[key]["q1"] for m, r in zip(med, rows)],
            [r[key]["q3"] - m for m, r in zip(med, rows)],
        )

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    strong = sorted((r for r in res["cases"] if "strong" in r["kinds"]), key=lambda r: r["world"])
    weak = sorted((r for r in res["cases"] if "weak" in r["kinds"]), key=lambda r: r["world"])
    peer = {r["total"]: r for r in res["cases"] if "peer" in r["kinds"]}
    ps = [r["world"] for r in strong]
    total = strong[0]["total"]
    mem, lo, hi = err(strong, "peak_mib")
    axes[0].errorbar(ps, mem, yerr=[lo, hi], fmt="o-", capsize=3, label="ring attention, measured")
    axes[0].plot(ps, [mem[0] / p for p in ps], "k--", label="1/P of one rank")
    if total in peer:
        axes[0].axhline(peer[total]["peak_mib"]["median"], color="gray", ls=":", label="multihead.attention")
    axes[0].set(xlabel="ranks P", ylabel="peak MiB per rank", title=f"memory, {total} tokens total")
    for rows, marker, label in ((strong, "o-", f"fixed total ({total})"), (weak, "s-", "fixed per rank")):
        t, lo, hi = err(rows, "seconds")
        axes[1].errorbar([r["world"] for r in rows], t, yerr=[lo, hi], fmt=marker, capsize=3, label=label)
    if total in peer:
        axes[1].axhline(
            peer[total]["seconds"]["median"], color="gray", ls=":", label=f"multihead.attention ({total})"
        )
    axes[1].set(xlabel="ranks P", ylabel="seconds (fwd + bwd, slowest rank)", title="time (median, IQR)")
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
    parser.add_argument("--per-rank", type=int, default=1024, help="weak scaling: tokens per rank (0: skip)")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--layout", default="zigzag", choices=mhd.LAYOUTS)
    parser.add_argument("--no-causal", dest="causal", action="store_false")
    parser.add_argument("--rounds", type=int, default=11)
    parser.add_argument("--threads", type=int, default=0, help="torch threads per rank (0: CPUs // ranks)")
    parser.add_argument("--name", default="ring_cpu", help="results file stem under benchmarks/results/")
    parser.add_argument("--replot", action="store_true", help="only rewrite the .md and .png from the .json")
    cfg = vars(parser.parse_args())
    stem = RESULTS / cfg.pop("name")
    if cfg.pop("replot"):
        res = json.loads(stem.with_suffix(".json").read_text())
        for row in res["cases"]:
            row["kinds"] = _kinds(res["config"], Case(row["impl"], row["world"], row["total"]))
        _write(res, stem)
        return
    # glibc: hand every block >= 64 KiB straight back to the kernel, so the resident set follows the live
    # tensors and its peak is the rank's peak (inherited by the spawned ranks).
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")

    rings = [Case("ring", p, cfg["total"]) for p in cfg["worlds"]]
    if cfg["per_rank"]:
        rings += [Case("ring", p, cfg["per_rank"] * p) for p in cfg["worlds"]]
    cases = list(dict.fromkeys(rings))  # a case in both scalings is measured once
    cases += [Case("attention", 1, t) for t in sorted({c.total for c in cases})]
    res: dict = {"config": cfg, "environment": _environment(cfg)}
    per_rank = mhd.launch(rank_job, max(cfg["worlds"]), (cfg, cases), backend=cfg["backend"], timeout=3000)
    res.update(_summarise(cfg, cases, per_rank))
    res["balance"] = [
        {"world": p, **{lay: mhd.causal_work(cfg["total"], p, lay) for lay in ("contiguous", "zigzag")}}
        for p in cfg["worlds"]
    ]

    _write(res, stem)


def _write(res: dict, stem: Path) -> None:
    """``stem``.json (every number), .md (the tables), .png (the plots)."""
    stem.parent.mkdir(exist_ok=True)
    stem.with_suffix(".json").write_text(json.dumps(res, indent=1) + "\n")
    stem.with_suffix(".md").write_text(_markdown(res))
    _plot(res, stem.with_suffix(".png"))
    print(_markdown(res))


if __name__ == "__main__":
    main()
