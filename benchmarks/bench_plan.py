"""The planner (multihead.distributed.plan) held against what this machine measures, and its map.

    flock /tmp/bench.lock python benchmarks/bench_plan.py            # writes benchmarks/results/plan_cpu.*

1. **Bytes**: every strategy's forward and backward at 2 and 4 gloo ranks, with the collectives wrapped
   to count the bytes each rank sends (P2P sends, all-to-all pieces to other ranks, all-gather inputs
   times P - 1), against ``plan``'s counts (target: within 5%); Ulysses and hybrid also in 4 head chunks.
2. **Memory**: peak resident memory per rank of a causal forward at L = 16k over 4 ranks (this rank's
   q, k, v and what the call allocates), against one process's ``multihead.attention`` on the whole
   sequence (target: <= 0.35x for ring and Ulysses), and against ``plan``'s memory; for H = 8, Hkv = 2
   and for Llama-3-8B's head counts H = 32, Hkv = 8 (Ulysses holds the K/V head its chunk reads over the
   whole sequence and one window of queries and output, so its floor is 1/P of one process's q, k, v and
   output plus one K/V head of the whole sequence).
3. **Time**: this machine's rates (attention FLOP/s of one process, gloo's bytes/s between two ranks)
   go into ``plan`` as a :class:`~multihead.distributed.Machine`; predicted and measured forward time at
   1, 2 and 4 ranks.
4. **Published figures**: ring-flash-attention's and yunchang's (USP) published iter/s on 8 GPUs next to
   ``plan``'s prediction with the matching preset and shape (:data:`PUBLISHED`; no measurement:
   ``--published-only`` recomputes just this into the existing results).
5. **Map** (plot): which strategy ``plan`` predicts fastest up to 1M tokens and 1024 ranks on the H100
   presets, for Llama-3-8B's attention (H = 32, Hkv = 8, D = 128, bf16).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_ring import _environment, _PeakMemory  # noqa: E402

import multihead as mh  # noqa: E402
from multihead import distributed as mhd  # noqa: E402
from multihead.distributed import exchange  # noqa: E402
from multihead.distributed.hybrid import HybridGroups  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
SHAPE = {"heads": 8, "kv_heads": 2, "head_dim": 64}
MANY_HEADS = {"heads": 32, "kv_heads": 8, "head_dim": 64}  # Llama-3-8B's head counts (D = 64 here)
CASES = (("ring", None), ("ulysses", None), ("ulysses", 4), ("hybrid", None), ("hybrid", 4))  # head_chunks


# ------------------------------------------------------------------------------------------------
# 1. bytes sent, counted at the collectives
# ------------------------------------------------------------------------------------------------


class _Counter:
    """Wraps the torch.distributed calls multihead uses; counts the bytes this rank sends."""

    def __init__(self):
        self.sent = 0
        self.real = {n: getattr(dist, n) for n in ("batch_isend_irecv", "all_to_all_single", "all_gather")}

    def __enter__(self):
        real = self.real

        def batch_isend_irecv(ops):
            self.sent += sum(
                op.tensor.numel() * op.tensor.element_size() for op in ops if op.op is real_isend
            )
            return real["batch_isend_irecv"](ops)

        def all_to_all_single(out, inp, out_splits=None, in_splits=None, group=None, **kw):
            me = dist.get_rank(group)
            self.sent += (inp.numel() - (in_splits[me] if in_splits else 0)) * inp.element_size()
            return real["all_to_all_single"](out, inp, out_splits, in_splits, group=group, **kw)

        def all_gather(parts, t, group=None, **kw):
            self.sent += t.numel() * t.element_size() * (dist.get_world_size(group) - 1)
            return real["all_gather"](parts, t, group=group, **kw)

        real_isend = dist.isend
        dist.batch_isend_irecv, dist.all_to_all_single, dist.all_gather = (
            batch_isend_irecv,
            all_to_all_single,
            all_gather,
        )
        return self

    def __exit__(self, *exc):
        for n, f in self.real.items():
            setattr(dist, n, f)


def _call(strategy, q, k, v, groups, chunks=None):
    if strategy == "ring":
        return mhd.ring_attention(q, k, v, causal=True, layout="zigzag")
    if strategy == "ulysses":
        return mhd.ulysses_attention(q, k, v, causal=True, layout="zigzag", head_chunks=chunks)
    return mhd.hybrid_attention(q, k, v, groups=groups, causal=True, layout="zigzag", head_chunks=chunks)


@contextlib.contextmanager
def windows(per_rank: int):
    """Ulysses and hybrid exchange (and attend) any sequence in ``per_rank`` windows per rank, as they do
    long ones (the planner, called inside, counts the same windows)."""
    saved = exchange.WINDOW_ELEMENTS, exchange.WINDOWS
    exchange.WINDOW_ELEMENTS, exchange.WINDOWS = 0, per_rank
    try:
        yield
    finally:
        exchange.WINDOW_ELEMENTS, exchange.WINDOWS = saved


INFERENCE = "ulysses inference, in windows"  # no autograd: K/V in phases (multihead.distributed.phased)


def _name(strategy, chunks):
    return strategy if chunks is None else f"{strategy} head_chunks={chunks}"


def bytes_job(total: int, shape: dict) -> dict:
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    groups = HybridGroups.create(dist.group.WORLD, 2 if world >= 4 else 1)
    n = total // world
    res = {}
    for strategy, chunks in CASES:
        q = torch.randn(1, shape["heads"], n, shape["head_dim"], requires_grad=True)
        k, v = (torch.randn(1, shape["kv_heads"], n, shape["head_dim"], requires_grad=True) for _ in range(2))
        with _Counter() as fwd:
            out = _call(strategy, q, k, v, groups, chunks)
        with _Counter() as bwd:
            out.sum().backward()
        res[_name(strategy, chunks)] = {
            "forward": fwd.sent,
            "backward": bwd.sent,
            "ulysses_size": groups.ulysses_size,
        }
    q = torch.randn(1, shape["heads"], n, shape["head_dim"])
    k, v = (torch.randn(1, shape["kv_heads"], n, shape["head_dim"]) for _ in range(2))
    with windows(3), torch.no_grad(), _Counter() as fwd:
        _call("ulysses", q, k, v, groups)
    res[INFERENCE] = {"forward": fwd.sent, "backward": 0, "ulysses_size": world}
    return {"rank": rank, **res}


def planned_inference_bytes(total: int, shape: dict, world: int) -> int:
    """What :func:`mhd.plan` says the :data:`INFERENCE` case of :func:`bytes_job` sends forward."""
    with windows(3):
        return mhd.plan(total, **shape, world=world, dtype_bytes=4, training=False)["ulysses"].sent_forward


# ------------------------------------------------------------------------------------------------
# 2. memory at 16k over 4 ranks; 3. time and rates
# ------------------------------------------------------------------------------------------------


def memory_job(total: int, shape: dict, strategy: str) -> dict:
    """Peak resident bytes of one causal forward (no grad), this rank's q, k, v included."""
    torch.set_num_threads(1)
    world = dist.get_world_size()
    groups = HybridGroups.create(dist.group.WORLD, 2) if strategy == "hybrid" else None
    n = total // world
    warm = [torch.randn(1, shape["heads"], 64, shape["head_dim"]) for _ in range(3)]
    # the warm-up runs in windows, as the long call does, so that the kernels' code pages (resident set,
    # not memory the call holds) are in the resident set before the measurement starts
    with windows(2), torch.no_grad():
        _call(strategy, *warm, groups) if world > 1 else mh.attention(*warm, causal=True)
    with _PeakMemory(torch.device("cpu")) as mem, torch.no_grad():
        q = torch.randn(1, shape["heads"], n, shape["head_dim"])
        k, v = (torch.randn(1, shape["kv_heads"], n, shape["head_dim"]) for _ in range(2))
        t0 = time.perf_counter()
        out = mh.attention(q, k, v, causal=True) if world == 1 else _call(strategy, q, k, v, groups)
        seconds = time.perf_counter() - t0
        del out
    return {"peak": mem.peak, "seconds": seconds}


def _shape_name(shape: dict) -> str:
    return f"H={shape['heads']}, Hkv={shape['kv_heads']}, D={shape['head_dim']}"


def memory_table(length: int, shape: dict) -> dict:
    """One process, then each strategy over 4 ranks: peak, ratio to one process, planned, seconds."""
    mem = {"one process": mhd.launch(memory_job, 1, (length, shape, "ring"), start_method="fork")[0]}
    for strategy in ("ring", "ulysses", "hybrid"):
        per_rank = mhd.launch(memory_job, 4, (length, shape, strategy), start_method="fork", timeout=900)
        mem[strategy] = {
            "peak": max(r["peak"] for r in per_rank),
            "seconds": max(r["seconds"] for r in per_rank),
        }
    base = mem["one process"]["peak"]
    for strategy in ("ring", "ulysses", "hybrid"):
        est = mhd.plan(length, **shape, world=4, dtype_bytes=4, ulysses_size=2, training=False)[strategy]
        mem[strategy] |= {"ratio": mem[strategy]["peak"] / base, "planned": est.memory_bytes}
    one = mhd.plan(length, **shape, world=1, dtype_bytes=4, training=False)["ring"]
    mem["one process"]["planned"] = one.memory_bytes
    return mem


def overhead_job(total: int, shape: dict, rounds: int) -> dict:
    """At 1 rank: forward + backward seconds of each strategy over multihead.attention, per round."""
    torch.set_num_threads(1)
    groups = HybridGroups.create(dist.group.WORLD, 1)
    q = torch.randn(1, shape["heads"], total, shape["head_dim"], requires_grad=True)
    k, v = (torch.randn(1, shape["kv_heads"], total, shape["head_dim"], requires_grad=True) for _ in range(2))
    runs = {
        "attention": lambda: mh.attention(q, k, v, causal=True),
        "ring": lambda: _call("ring", q, k, v, groups),
        "ulysses": lambda: _call("ulysses", q, k, v, groups),
        "hybrid": lambda: _call("hybrid", q, k, v, groups),
    }
    ratios: dict[str, list[float]] = {n: [] for n in runs if n != "attention"}
    for _ in range(rounds):
        secs = {}
        for name, run in runs.items():
            t0 = time.perf_counter()
            run().sum().backward()
            secs[name] = time.perf_counter() - t0
        for name in ratios:
            ratios[name].append(secs[name] / secs["attention"])
    return {n: sorted(r)[len(r) // 2] for n, r in ratios.items()}


def link_job(nbytes: int, rounds: int) -> float:
    """Bytes/s one rank sends to the other with gloo (ping-pong, median)."""
    rank = dist.get_rank()
    buf = torch.empty(nbytes // 4)
    times = []
    for _ in range(rounds):
        dist.barrier()
        t0 = time.perf_counter()
        if rank == 0:
            dist.send(buf, 1)
            dist.recv(buf, 1)
        else:
            dist.recv(buf, 0)
            dist.send(buf, 0)
        times.append(time.perf_counter() - t0)
    return 2 * nbytes / sorted(times)[len(times) // 2]


def compute_rate(total: int, shape: dict, rounds: int) -> float:
    """Attention FLOP/s of one process (causal forward, one thread as each rank runs)."""
    torch.set_num_threads(1)
    q = torch.randn(1, shape["heads"], total, shape["head_dim"])
    k, v = (torch.randn(1, shape["kv_heads"], total, shape["head_dim"]) for _ in range(2))
    times = []
    with torch.no_grad():
        for _ in range(rounds):
            t0 = time.perf_counter()
            mh.attention(q, k, v, causal=True)
            times.append(time.perf_counter() - t0)
    flops = 4 * shape["heads"] * total * total * shape["head_dim"] * 0.5
    return flops / sorted(times)[len(times) // 2]


# ------------------------------------------------------------------------------------------------
# 4. published figures
# ------------------------------------------------------------------------------------------------

RFA = "zhuzilin/ring-flash-attention README, batch api table (benchmark/benchmark_kvpacked_func.py)"
YC_TABLE = "feifeibear/long-context-attention README at 8aaf163 (2024-04-01), head num=8 table"
YC_IMAGE = (
    "feifeibear/long-context-attention media/benchmark_results.png (b93c30e, 2024-04-18), zigzag qkvpack"
)
LLAMA = {"heads": 32, "kv_heads": 8, "head_dim": 128, "batch": 1}  # ring-flash-attention's Llama-3-8B shape
MHA8 = {"heads": 8, "kv_heads": 8, "head_dim": 128, "batch": 2}  # yunchang's QKV-packed benchmark shape

# (source, GPUs, preset, L total, shape, U (1 ring, 8 Ulysses, else hybrid), forward only, published iter/s);
# every run: 8 GPUs, bf16, causal, one attention call per iteration
PUBLISHED = [
    (RFA, "8xH800", "h800-nvlink", 65536, LLAMA, 1, True, 63.0),
    (RFA, "8xH800", "h800-nvlink", 65536, LLAMA, 1, False, 17.4),
    (RFA, "8xA100", "a100-nvlink", 65536, LLAMA, 1, True, 38.2),
    (RFA, "8xA100", "a100-nvlink", 65536, LLAMA, 1, False, 10.6),
    *(
        (YC_TABLE, "8xA100", "a100-nvlink", 65536, MHA8, u, False, it)
        for u, it in ((1, 8.211), (2, 11.024), (4, 12.864), (8, 10.679))
    ),
    *(
        (YC_IMAGE, "8xA100", "a100-nvlink", 131072, MHA8, u, True, it)
        for u, it in ((1, 18.211), (2, 21.383), (4, 21.916), (8, 20.992))
    ),
]


def published() -> list[dict]:
    """Each published figure next to ``plan``'s prediction with the matching preset and shape."""
    rows = []
    for source, gpus, preset, length, shape, u, fwd_only, it in PUBLISHED:
        est = mhd.plan(length, **shape, world=8, machine=preset, ulysses_size=u if 1 < u < 8 else None)
        strategy = "ring" if u == 1 else "ulysses" if u == 8 else "hybrid"
        e = est[strategy]
        planned = 1 / (e.seconds_forward if fwd_only else e.seconds)
        rows.append(
            {
                "source": source,
                "gpus": gpus,
                "preset": preset,
                "case": f"{strategy} (U={u})" if strategy == "hybrid" else strategy,
                "shape": f"L={length // 1024}k, B={shape['batch']}, H={shape['heads']}, Hkv={shape['kv_heads']}, "
                f"D={shape['head_dim']}",
                "pass": "fwd" if fwd_only else "fwd+bwd",
                "published_iter_s": it,
                "planned_iter_s": planned,
                "ratio": planned / it,
            }
        )
    return rows


# ------------------------------------------------------------------------------------------------
# 5. the map
# ------------------------------------------------------------------------------------------------


def _plot(path: Path) -> dict:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import ListedColormap

    lengths = [2**i for i in range(12, 21)]  # 4k .. 1M
    ranks = [2**i for i in range(1, 11)]  # 2 .. 1024
    names = ("ring", "ulysses", "hybrid")
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.4), sharey=True)
    table = {}
    for ax, preset in zip(axes, ("h100-nvlink", "h100-ib")):
        grid = []
        for p in ranks:
            row = []
            for length in lengths:
                if length < p:
                    row.append(float("nan"))
                    continue
                est = mhd.plan(length, heads=32, kv_heads=8, head_dim=128, world=p, machine=preset)
                best = min(names, key=lambda s: (est[s].seconds, names.index(s)))
                row.append(names.index(best))
                table[f"{preset} P={p} L={length}"] = {s: est[s].seconds for s in names} | {"best": best}
            grid.append(row)
        cmap = ListedColormap(["#4c72b0", "#dd8452", "#55a868"])
        ax.imshow(grid, origin="lower", cmap=cmap, vmin=0, vmax=2, aspect="auto")
        ax.set_xticks(range(len(lengths)), [f"{n // 1024}k" for n in lengths], rotation=45)
        ax.set_yticks(range(len(ranks)), [str(p) for p in ranks])
        ax.set_xlabel("sequence length L")
        ax.set_title(f"fastest predicted, {preset}")
    axes[0].set_ylabel("ranks P")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in ("#4c72b0", "#dd8452", "#55a868")]
    fig.legend(handles, names, loc="lower center", ncol=3)
    fig.suptitle(
        "multihead.distributed.plan: Llama-3-8B attention (H=32, Hkv=8, D=128, bf16), fwd+bwd per layer"
    )
    fig.tight_layout(rect=(0, 0.08, 1, 0.95))
    fig.savefig(path, dpi=110)
    return table


# ------------------------------------------------------------------------------------------------


def _cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    except OSError:
        return "unknown"
    return next(
        (line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name")), "?"
    )


def main() -> None:
    if "MALLOC_MMAP_THRESHOLD_" not in os.environ:  # read by glibc at start: run again with it set
        # every block >= 64 KiB goes straight back to the kernel, so the resident set follows the live
        # tensors (the forked ranks inherit it) and its peak is the rank's peak
        os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"
        os.execv(sys.executable, [sys.executable, *sys.argv])
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--memory-len", type=int, default=16384)
    parser.add_argument("--bytes-len", type=int, default=2048)
    parser.add_argument("--time-len", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--published-only",
        action="store_true",
        help="recompute only the published comparison (no measurement) into the existing results",
    )
    args = parser.parse_args()
    if args.published_only:
        res = json.loads((RESULTS / "plan_cpu.json").read_text())
        res["published"] = published()
        (RESULTS / "plan_cpu.json").write_text(json.dumps(res, indent=1))
        (RESULTS / "plan_cpu.md").write_text(_markdown(res))
        return
    env = _environment({"backend": "gloo"}) | {"cpu_model": _cpu_model(), "uptime": os.getloadavg()}
    res: dict = {"environment": env, "shape": SHAPE}

    # 1. bytes
    res["bytes"] = {}
    for world in (2, 4):
        per_rank = mhd.launch(bytes_job, world, (args.bytes_len, SHAPE), start_method="fork", timeout=600)
        for strategy, chunks in CASES:
            got = per_rank[0][_name(strategy, chunks)]
            est = mhd.plan(
                args.bytes_len,
                **SHAPE,
                world=world,
                dtype_bytes=4,
                ulysses_size=got["ulysses_size"],
                head_chunks=chunks,
            )[strategy]
            res["bytes"][f"{_name(strategy, chunks)} P={world}"] = {
                "measured_forward": got["forward"],
                "planned_forward": est.sent_forward,
                "measured_backward": got["backward"],
                "planned_backward": est.sent_backward,
                "ratio_forward": got["forward"] / est.sent_forward,
                "ratio_backward": got["backward"] / est.sent_backward,
            }
        planned = planned_inference_bytes(args.bytes_len, SHAPE, world)
        res["bytes"][f"{INFERENCE} P={world}"] = {
            "measured_forward": per_rank[0][INFERENCE]["forward"],
            "planned_forward": planned,
            "ratio_forward": per_rank[0][INFERENCE]["forward"] / planned,
        }

    # 2. memory (and forward time) at 16k: one process, then 4 ranks of each strategy, for two head counts
    res["memory"] = {
        _shape_name(shape): memory_table(args.memory_len, shape) for shape in (SHAPE, MANY_HEADS)
    }

    # 3. rates and time
    flops = compute_rate(args.time_len, SHAPE, args.rounds)
    link = mhd.launch(link_job, 2, (32 << 20, args.rounds), start_method="fork")[0]
    machine = mhd.Machine(compute=flops, link=link, latency=50e-6)
    res["rates"] = machine._asdict()
    res["overhead_1_rank"] = mhd.launch(
        overhead_job, 1, (args.time_len, SHAPE, 2 * args.rounds + 1), start_method="fork"
    )[0]
    res["time"] = {}
    for world in (2, 4):
        for strategy in ("ring", "ulysses"):
            per_rank = mhd.launch(memory_job, world, (args.time_len, SHAPE, strategy), start_method="fork")
            measured = max(r["seconds"] for r in per_rank)
            est = mhd.plan(
                args.time_len, **SHAPE, world=world, dtype_bytes=4, machine=machine, training=False
            )
            est = est[strategy]
            res["time"][f"{strategy} P={world}"] = {"measured": measured, "planned": est.seconds_forward}

    # 4. published figures and the map
    res["published"] = published()
    res["map"] = _plot(RESULTS / "plan_cpu.png")
    res["environment"]["load_average_at_end"] = os.getloadavg()
    (RESULTS / "plan_cpu.json").write_text(json.dumps(res, indent=1))
    (RESULTS / "plan_cpu.md").write_text(_markdown(res))
    print(_markdown(res))


def _markdown(res: dict) -> str:
    env = res["environment"]
    lines = [
        "# Planner vs this machine (gloo, CPU)",
        "",
        f"{env['cpu_model']}, {env['cpu_count']} cores, torch {env['torch']}, {env['date_utc']}; load average "
        f"{env['load_average_at_start']} at start, {env['load_average_at_end']} at end (a shared machine: other "
        f"jobs ran at the same time; times are noisy). Shape: B=1, H=8, Hkv=2, D=64, float32, causal, zigzag.",
        "",
        "## Bytes sent per rank (rank 0), measured at the collectives / planned",
        "",
        "| case | forward measured | planned | ratio | backward measured | planned | ratio |",
        "|---|---|---|---|---|---|---|",
    ]
    for case, b in res["bytes"].items():
        back = (
            f"{b['measured_backward']} | {b['planned_backward']} | {b['ratio_backward']:.3f}"
            if "measured_backward" in b
            else "- | - | -"
        )
        lines.append(
            f"| {case} | {b['measured_forward']} | {b['planned_forward']} | {b['ratio_forward']:.3f} | {back} |"
        )
    for shape, mem in res["memory"].items():
        lines += [
            "",
            f"## Forward peak memory per rank at L = 16k over 4 ranks ({shape}; resident set, q/k/v included)",
            "",
            "| | peak MiB | / one process (target <= 0.35) | planned MiB | forward s |",
            "|---|---|---|---|---|",
        ]
        for name, m in mem.items():
            ratio = f"{m['ratio']:.3f}" if "ratio" in m else "1"
            lines.append(
                f"| {name} | {m['peak'] / 2**20:.1f} | {ratio} | {m['planned'] / 2**20:.1f} | "
                f"{m['seconds']:.2f} |"
            )
    r = res["rates"]
    lines += [
        "",
        f"## Time: rates measured here (attention {r['compute'] / 1e9:.2f} GFLOP/s on one thread, gloo "
        f"{r['link'] / 1e9:.2f} GB/s), forward at L = 4096",
        "",
        "| case | measured s | planned s |",
        "|---|---|---|",
    ]
    lines += [f"| {c} | {t['measured']:.3f} | {t['planned']:.3f} |" for c, t in res["time"].items()]
    lines += [
        "",
        "## One rank: forward + backward time / multihead.attention (median of per-round ratios; target <= 1.1)",
        "",
        "| strategy | ratio |",
        "|---|---|",
    ]
    lines += [f"| {n} | {r:.3f} |" for n, r in res["overhead_1_rank"].items()]
    lines += [
        "",
        "## Published figures (8 GPUs, bf16, causal) and plan's prediction with the matching preset",
        "",
        "| source | GPUs | shape | strategy | pass | published iter/s | planned iter/s (preset) | planned / published |",
        "|---|---|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {p['source']} | {p['gpus']} | {p['shape']} | {p['case']} | {p['pass']} | {p['published_iter_s']} | "
        f"{p['planned_iter_s']:.1f} ({p['preset']}) | {p['ratio']:.2f} |"
        for p in res["published"]
    ]
    lines += [
        "",
        "![map](plan_cpu.png)",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
