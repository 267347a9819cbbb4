"""KV-cache decoding on the CPU: one step against its bare work, generate() throughput, small calls.

Three measurements, each timed in interleaved rounds (A B C A B C ...) in one process, so machine load
hits every contender alike; every number is a median with its interquartile range (IQR) over rounds,
and every ratio is taken per round and then summarised the same way.

1. **Decode step vs bare work** (``MultiHeadAttention``, E=512, H=8, B=1, one token, cached length L
   = 256 ... 8192): ``mha(x_t, cache=cache, causal=True)`` on the in-place :class:`multihead.KVCache`,
   and on a concatenating cache (``torch.cat`` per step, the cache before issue 14), against the
   step's bare work: QKV projection of the token, ``F.scaled_dot_product_attention`` over K/V already in
   one preallocated buffer, output projection. Before each call the caches are refilled to L positions
   (untimed), so every timed step attends to exactly L + 1 keys; a round keeps each contender's
   fastest of 5 calls (the machine this runs on is shared: a few-ms call is often descheduled).
2. **generate() tokens per second**: the demo's model (``multihead.demo.run.DemoConfig``: d_model 64,
   4 heads, 2 + 2 layers, d_ff 128) and a wider one (d_model 512, 8 heads, 6 + 6 layers, d_ff 2048),
   random weights, ``eos_id=None`` so every output has exactly the requested length (64, 512, 2048;
   greedy, and beam 4 at 64), in-place cache against the concatenating one.
3. **Small calls**: ``MultiHeadAttention`` forward against ``torch.nn.MultiheadAttention`` (same
   weights, eval, no grad) at the seed notebooks' shape B=64, L=5, E=512, H=8.

Run::

    python benchmarks/bench_decode.py            # writes benchmarks/results/decode_cpu.{json,md,png}
    python benchmarks/bench_decode.py --quick    # a smoke run with few rounds (not for the record)
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

import multihead as mh
import multihead.transformer.model as transformer_model
from multihead.bench.stats import spread
from multihead.demo.run import DemoConfig
from multihead.progress import Progress

RESULTS = Path(__file__).resolve().parent / "results"
LENGTHS = (256, 512, 1024, 2048, 4096, 8192)
TARGET = 1.3  # step / bare at L = 4096
BEST_OF = 5  # decode steps: fastest of 5 calls per contender and round
SAME = {True: "yes", False: "NO", None: "not checked"}


class ConcatCache(mh.KVCache):
    """The cache before issue 14: ``torch.cat`` of everything so far on every update (the baseline)."""

    def __init__(self, *, static: bool = False, max_len: int | None = None) -> None:
        super().__init__(static=static, max_len=max_len)
        self._ck: Tensor | None = None
        self._cv: Tensor | None = None

    keys = property(lambda self: self._ck)  # type: ignore[assignment]
    values = property(lambda self: self._cv)  # type: ignore[assignment]

    def __len__(self) -> int:
        if self._ck is not None:
            return self._ck.shape[2]
        return next((len(c) for _, c in self.children() if not c.static and not c.is_empty), 0)

    def update(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        if self._ck is None or self._cv is None:
            self._ck, self._cv = k, v
        else:
            self._ck, self._cv = torch.cat([self._ck, k], dim=2), torch.cat([self._cv, v], dim=2)
        return self._ck, self._cv

    def reorder(self, indices: Tensor, *, include_static: bool = True) -> None:
        if self._ck is not None and self._cv is not None and (include_static or not self.static):
            self._ck, self._cv = self._ck.index_select(0, indices), self._cv.index_select(0, indices)
        for _, c in self.children():
            c.reorder(indices, include_static=include_static)

    def reset(self) -> None:
        self._ck = self._cv = None
        for _, c in self.children():
            c.reset()


def summary(values: list[float]) -> dict[str, float]:
    """Median and quartiles of ``values`` (:func:`multihead.bench.stats.spread`, as a JSON-ready dict)."""
    return spread(values)._asdict()


def interleaved(
    fns: dict[str, Callable[[], object]],
    rounds: int,
    warmup: int,
    bar: Progress,
    before: Callable[[], None] | None = None,
    best_of: int = 1,
) -> dict[str, list[float]]:
    """Seconds per call of each of ``fns``, rotating the order every round.

    Each round times every function ``best_of`` times in a row and keeps the fastest: on a shared
    machine a call of a few ms is often descheduled for a whole time slice, which a per-round minimum
    filters out (the spread over rounds still shows what remains).
    """
    names = list(fns)
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(warmup + rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        for n in order:
            best = float("inf")
            for _ in range(best_of):
                if before is not None:
                    before()
                t0 = time.perf_counter()
                fns[n]()
                best = min(best, time.perf_counter() - t0)
            if r >= warmup:
                times[n].append(best)
        bar.update(1)
    return times


def ratios(num: list[float], den: list[float]) -> dict[str, float]:
    """Per-round ratios num/den, summarised."""
    return summary([a / b for a, b in zip(num, den)])


# ----------------------------------------------------------------------------------------------
# 1. One decoding step against its bare work
# ----------------------------------------------------------------------------------------------


def refill_caches(caches: tuple[mh.KVCache, ...], k: Tensor, v: Tensor) -> None:
    """Reset ``caches`` and fill them with ``k``/``v`` (B, H, L, D): every timed step sees exactly L keys."""
    for c in caches:
        c.reset()
        c.update(k, v)


def bare_step(mha: mh.MultiHeadAttention, x_t: Tensor, k_buf: Tensor, v_buf: Tensor) -> Tensor:
    """The step's bare work: QKV projection of x_t (1, 1, E), SDPA over k_buf/v_buf (1, H, L + 1, D)
    (already holding every key/value), output projection."""
    e, h = mha.embed_dim, mha.num_heads
    qkv = F.linear(x_t, mha.in_proj_weight, mha.in_proj_bias)  # (1, 1, 3E)
    q = qkv[..., :e].view(1, 1, h, e // h).transpose(1, 2)  # (1, H, 1, D)
    o = F.scaled_dot_product_attention(q, k_buf, v_buf)  # (1, H, 1, D)
    return F.linear(o.transpose(1, 2).reshape(1, 1, e), mha.out_proj.weight, mha.out_proj.bias)  # (1, 1, E)


@torch.no_grad()
def decode_steps(lengths: tuple[int, ...], rounds: int, warmup: int) -> list[dict]:
    torch.manual_seed(0)
    e, h = 512, 8
    d = e // h
    mha = mh.MultiHeadAttention(e, h).eval()
    x_t = torch.randn(1, 1, e)
    out = []
    with Progress(len(lengths) * (rounds + warmup), "decode") as bar:
        for n in lengths:
            k_pre, v_pre = torch.randn(1, h, n, d), torch.randn(1, h, n, d)  # (B, H, L, D)
            in_place, concat = mh.KVCache(), ConcatCache()
            k_buf = torch.empty(1, h, n + 1, d)  # (B, H, L + 1, D) the bare work's preallocated K/V
            v_buf = torch.empty(1, h, n + 1, d)
            k_buf[:, :, :n], v_buf[:, :, :n] = k_pre, v_pre

            caches = (in_place, concat)
            refill = functools.partial(refill_caches, caches, k_pre, v_pre)  # untimed, before every call
            fns = {
                "in-place step": lambda c=in_place: mha(x_t, cache=c, causal=True),
                "concat step": lambda c=concat: mha(x_t, cache=c, causal=True),
                "bare work": lambda k=k_buf, v=v_buf: bare_step(mha, x_t, k, v),
            }
            times = interleaved(fns, rounds, warmup, bar, before=refill, best_of=BEST_OF)
            bar.update(0, L=n)
            out.append(
                {
                    "cached_length": n,
                    "seconds": {k: summary(v) for k, v in times.items()},
                    "in_place_over_bare": ratios(times["in-place step"], times["bare work"]),
                    "concat_over_bare": ratios(times["concat step"], times["bare work"]),
                }
            )
    return out


# ----------------------------------------------------------------------------------------------
# 2. generate() throughput
# ----------------------------------------------------------------------------------------------


def models() -> dict[str, mh.Transformer]:
    demo = DemoConfig()
    configs = {
        "demo (d64, 2+2 layers)": {
            "d_model": demo.d_model,
            "num_heads": demo.num_heads,
            "layers": demo.layers,
            "d_ff": demo.d_ff,
        },
        "wide (d512, 6+6 layers)": {"d_model": 512, "num_heads": 8, "layers": 6, "d_ff": 2048},
    }
    out = {}
    for name, c in configs.items():
        torch.manual_seed(0)
        out[name] = mh.Transformer(
            40,  # about the demo's date-task vocabularies
            40,
            d_model=c["d_model"],
            num_heads=c["num_heads"],
            num_encoder_layers=c["layers"],
            num_decoder_layers=c["layers"],
            d_ff=c["d_ff"],
            dropout=0.0,
            max_len=2049,  # the demo builds 512; positions up to the longest output here
        ).eval()
    return out


def generate_with(
    model: mh.Transformer, src: Tensor, length: int, beams: int, cache_cls: type[mh.KVCache]
) -> Tensor:
    """``model.generate`` with ``cache_cls`` as its cache (the baseline swaps in :class:`ConcatCache`)."""
    transformer_model.KVCache = cache_cls  # type: ignore[misc]
    try:
        return model.generate(src, bos_id=1, eos_id=None, max_len=length, beam_size=beams)
    finally:
        transformer_model.KVCache = mh.KVCache  # type: ignore[misc]


def generate_throughput(cases: dict[str, list[tuple[int, int, int, bool]]]) -> list[dict]:
    """tokens/s per model for each (output length, beams, rounds, with the concatenating baseline);
    outputs of up to 512 tokens with a baseline are checked equal to it."""
    src = torch.randint(3, 40, (1, 24), generator=torch.Generator().manual_seed(0))  # (B, S)
    built = models()
    out = []
    with Progress(sum(c[2] for cs in cases.values() for c in cs), "generate") as bar:
        for name, model in built.items():
            for length, beams, rounds, baseline in cases[name]:
                run = functools.partial(generate_with, model, src, length, beams)
                same = torch.equal(run(mh.KVCache), run(ConcatCache)) if baseline and length <= 512 else None
                fns = {"in-place": functools.partial(run, mh.KVCache)}
                if baseline:
                    fns["concat"] = functools.partial(run, ConcatCache)
                times = interleaved(fns, rounds, 0, bar)
                tokens = src.shape[0] * length
                out.append(
                    {
                        "model": name,
                        "output_length": length,
                        "beams": beams,
                        "same_tokens": same,
                        "tokens_per_s": {k: summary([tokens / t for t in v]) for k, v in times.items()},
                        "speedup": ratios(times["concat"], times["in-place"]) if baseline else None,
                    }
                )
                print(f"  {name} T={length} K={beams}: {out[-1]['tokens_per_s']}", flush=True)
    return out


# ----------------------------------------------------------------------------------------------
# 3. Small calls: the seed notebooks' shape
# ----------------------------------------------------------------------------------------------


@torch.no_grad()
def seed_shape(rounds: int, warmup: int) -> dict:
    torch.manual_seed(0)
    b, n, e, h = 64, 5, 512, 8
    x = torch.randn(b, n, e)
    ours = mh.MultiHeadAttention(e, h).eval()
    theirs = ours.to_torch().eval()
    torch.testing.assert_close(ours(x), theirs(x, x, x, need_weights=False)[0], rtol=1e-5, atol=1e-5)
    with Progress(rounds + warmup, "seed") as bar:
        times = interleaved(
            {"multihead": lambda: ours(x), "torch": lambda: theirs(x, x, x, need_weights=False)},
            rounds,
            warmup,
            bar,
        )
    print(f"  seed shape: speed vs torch {ratios(times['torch'], times['multihead'])}", flush=True)
    return {
        "shape": {"B": b, "L": n, "E": e, "H": h},
        "seconds": {k: summary(v) for k, v in times.items()},
        "speed_vs_torch": ratios(times["torch"], times["multihead"]),
    }


# ----------------------------------------------------------------------------------------------
# Report
# ----------------------------------------------------------------------------------------------


def fmt(s: dict[str, float], scale: float = 1.0, digits: int = 2) -> str:
    return f"{s['median'] * scale:.{digits}f} ({s['q1'] * scale:.{digits}f}-{s['q3'] * scale:.{digits}f})"


def markdown(report: dict) -> str:
    lines = [
        "# KV-cache decoding on the CPU",
        "",
        f"{report['machine']}; torch {report['torch']}, {report['threads']} thread(s), {report['date']}. "
        "Median (interquartile range) over interleaved rounds; ratios are per round. The machine was "
        "shared with other jobs while this ran: read the spreads.",
        "",
        f"Decode steps: each round keeps the fastest of {BEST_OF} calls per contender (descheduling filter).",
        "",
        "## One decoding step vs its bare work (E=512, H=8, B=1)",
        "",
        f"Target: in-place step / bare work <= {TARGET} at L = 4096.",
        "",
        "| cached L | bare work ms | in-place step ms | concat step ms | in-place / bare | concat / bare |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for r in report["decode_steps"]:
        s = r["seconds"]
        lines.append(
            f"| {r['cached_length']} | {fmt(s['bare work'], 1e3, 3)} | {fmt(s['in-place step'], 1e3, 3)} | "
            f"{fmt(s['concat step'], 1e3, 3)} | {fmt(r['in_place_over_bare'])} | {fmt(r['concat_over_bare'])} |"
        )
    lines += [
        "",
        "## generate() tokens per second (batch 1, eos off: exactly the output length)",
        "",
        "| model | output length | beams | in-place tok/s | concat tok/s | speed-up | same tokens |",
        "|---|---:|---:|---:|---:|---:|:---:|",
    ]
    for r in report["generate"]:
        t = r["tokens_per_s"]
        concat, speedup = (fmt(t["concat"], 1, 0), fmt(r["speedup"])) if "concat" in t else ("-", "-")
        lines.append(
            f"| {r['model']} | {r['output_length']} | {r['beams']} | {fmt(t['in-place'], 1, 0)} | "
            f"{concat} | {speedup} | {SAME[r['same_tokens']]} |"
        )
    s = report["seed_shape"]
    lines += [
        "",
        "## Small calls: MultiHeadAttention vs torch.nn.MultiheadAttention (B=64, L=5, E=512, H=8, eval)",
        "",
        "| multihead ms | torch ms | speed vs torch (torch time / ours) |",
        "|---:|---:|---:|",
        f"| {fmt(s['seconds']['multihead'], 1e3)} | {fmt(s['seconds']['torch'], 1e3)} | "
        f"{fmt(s['speed_vs_torch'], 1, 3)} |",
        "",
    ]
    return "\n".join(lines)


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = report["decode_steps"]
    ls = [r["cached_length"] for r in steps]
    fig, (a, b, c) = plt.subplots(1, 3, figsize=(16, 4.5))
    for key, style in (("bare work", "k--"), ("in-place step", "C0o-"), ("concat step", "C3s-")):
        med = [r["seconds"][key]["median"] * 1e3 for r in steps]
        lo = [r["seconds"][key]["q1"] * 1e3 for r in steps]
        hi = [r["seconds"][key]["q3"] * 1e3 for r in steps]
        a.plot(ls, med, style, label=key)
        a.fill_between(ls, lo, hi, alpha=0.2, color=style[:2] if style[0] == "C" else "k")
    a.set(xscale="log", yscale="log", xlabel="cached length L", ylabel="ms per step", title="decode step")
    a.set_xticks(ls, [str(n) for n in ls])
    a.minorticks_off()
    a.legend()
    for key, color, label in (("in_place_over_bare", "C0", "in-place"), ("concat_over_bare", "C3", "concat")):
        med = [r[key]["median"] for r in steps]
        err = [[m - r[key]["q1"] for m, r in zip(med, steps)], [r[key]["q3"] - m for m, r in zip(med, steps)]]
        b.errorbar(ls, med, yerr=err, fmt="o-", color=color, capsize=3, label=label)
    b.axhline(TARGET, color="k", ls=":", label=f"target {TARGET}x")
    b.set(
        xscale="log",
        yscale="log",
        xlabel="cached length L",
        ylabel="step / bare work (median, IQR)",
        title="overhead over bare work",
    )
    b.set_xticks(ls, [str(n) for n in ls])
    b.set_yticks([1, 1.3, 2, 3, 5, 10], ["1", "1.3", "2", "3", "5", "10"])
    b.minorticks_off()
    b.legend()
    gen = report["generate"]
    names = [
        f"{r['model'].split(' ')[0]}\nT={r['output_length']}" + (f" K={r['beams']}" if r["beams"] > 1 else "")
        for r in gen
    ]
    xs = range(len(gen))
    for off, key, color in ((-0.2, "in-place", "C0"), (0.2, "concat", "C3")):
        have = [(x, r["tokens_per_s"][key]) for x, r in zip(xs, gen) if key in r["tokens_per_s"]]
        med = [s["median"] for _, s in have]
        err = [[m - s["q1"] for m, (_, s) in zip(med, have)], [s["q3"] - m for m, (_, s) in zip(med, have)]]
        c.bar([x + off for x, _ in have], med, 0.4, yerr=err, color=color, label=key, capsize=2)
    c.set_xticks(list(xs), names, fontsize=7)
    c.set(yscale="log", ylabel="tokens / s", title="generate() (batch 1)")
    c.legend()
    fig.suptitle(f"KV-cache decoding, CPU ({report['threads']} thread(s), shared machine)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


SECTIONS = ("decode_steps", "seed_shape", "generate")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="few rounds, short outputs (a smoke run)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    parser.add_argument("--rounds", type=int, default=100, help="interleaved rounds of the decode steps")
    parser.add_argument(
        "--sections",
        nargs="+",
        choices=SECTIONS,
        default=SECTIONS,
        help="run only these; the others are kept from an existing report of the same --name",
    )
    parser.add_argument("--out", type=Path, default=RESULTS, help="folder for decode_cpu.{json,md,png}")
    parser.add_argument("--name", default="decode_cpu")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    quick = args.quick
    path = args.out / f"{args.name}.json"
    report = json.loads(path.read_text()) if set(args.sections) != set(SECTIONS) else {}
    report.update(
        {
            "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "date": time.strftime("%Y-%m-%d %H:%M"),
        }
    )
    if "decode_steps" in args.sections:
        report["decode_steps"] = decode_steps(
            LENGTHS[:2] if quick else LENGTHS, 5 if quick else args.rounds, 2 if quick else 5
        )
    if "seed_shape" in args.sections:
        report["seed_shape"] = seed_shape(10 if quick else 300, 2 if quick else 20)
    if "generate" in args.sections:
        demo, wide = list(models())
        report["generate"] = generate_throughput(
            {demo: [(16, 1, 2, True), (16, 4, 2, True)], wide: [(16, 1, 1, True)]}
            if quick
            else {  # the wide model at 2048 tokens: one round (minutes on a busy machine)
                demo: [(64, 1, 5, True), (512, 1, 3, True), (2048, 1, 2, True), (64, 4, 5, True)],
                wide: [(64, 1, 3, True), (512, 1, 2, True), (2048, 1, 1, True), (64, 4, 3, True)],
            }
        )
    args.out.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1))
    (args.out / f"{args.name}.md").write_text(markdown(report))
    plot(report, args.out / f"{args.name}.png")
    print(markdown(report))


if __name__ == "__main__":
    main()
