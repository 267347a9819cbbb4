"""Is the interval ``multihead prune`` gives its held-out quality honest? A check on texts it never saw.

all-MiniLM-L6-v2 is pruned by the command (``--heads 0.5``, the refit stage only: ``--recover 0
--reconstruct 0``, so no text but the calibration lines shaped the weights) on each real-text corpus's
calibration lines (``benchmarks/data/corpora.py``). The texts it never trained on -- its own held-out split and
the bench's external sentences -- are the population. 100 random subsets of the command's held-out size are
drawn from them; for each, the command's bootstrap interval (:meth:`~multihead.commands.prune.Embedding.interval`,
90%) is computed and checked against the quality over the whole population. Also reported: the spread of the
subsets' own qualities, and where the two fixed sets (the command's split, the external sentences) sit in it::

    flock /tmp/bench.lock python benchmarks/bench_prune_interval.py   # benchmarks/results/prune_interval.{json,md}
    flock /tmp/bench.lock python benchmarks/bench_prune_interval.py --quality 0.99 [--corpus licences ...]
    # --quality Q instead of --heads 0.5: benchmarks/results/prune_interval_qQ.{json,md}
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

import torch
import transformers as T

from multihead.bench.pair import machine
from multihead.commands import prune
from multihead.commands.training import markdown_table
from multihead.testing import minilm_dir

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE / "data"))
import corpora  # noqa: E402  (benchmarks/data/corpora.py)
from bench_prune import REAL, _load  # noqa: E402

RESULTS = HERE / "results"
SUBSETS = 100


def run_one(corpus: str, frac: str = "0.5", quality: str | None = None) -> dict:
    """Prune on ``corpus`` (refit stage only) at ``--heads frac``, or ``--quality quality`` when given; the
    interval's coverage over random subsets of unseen texts."""
    calibration, external = corpora.split(corpora.CORPORA[corpus]())
    held = prune.split_texts(calibration).held_out
    unseen = held + external
    tok, objective = T.AutoTokenizer.from_pretrained(minilm_dir()), prune.Embedding()
    batches = prune.make_batches(prune.encode(tok, unseen, 512, True), tok, objective, 32, 0)
    with tempfile.TemporaryDirectory() as tmp:
        data, out = Path(tmp) / "lines.txt", Path(tmp) / "pruned"
        data.write_text("\n".join(calibration) + "\n", encoding="utf-8")
        opts = prune.Options(minilm_dir(), data, None if quality else frac, out, quality=quality, recover=0,
                             reconstruct=0, progress=False)  # fmt: skip
        report = prune.run(opts, echo=lambda _: None)
        emb = objective.scores(_load(out), batches)  # (N, E), make_batches keeps the order within each batch
    ref = objective.scores(_load(minilm_dir()), batches)
    order = torch.tensor([i for b in _rows(batches, unseen, tok) for i in b])  # batch order -> text index
    emb, ref = emb[order.argsort()], ref[order.argsort()]  # rows back in the order of ``unseen``
    whole = objective.quality_of(emb, ref)
    m, gen = len(held), torch.Generator().manual_seed(0)
    values, covered, widths = [], 0, []
    for t in range(SUBSETS):
        pick = torch.randperm(len(unseen), generator=gen)[:m]
        values.append(objective.quality_of(emb[pick], ref[pick]))
        lo, hi = objective.interval(emb[pick], ref[pick], seed=t)
        widths.append(hi - lo)
        covered += lo <= whole <= hi
    v = torch.tensor(values, dtype=torch.float64)
    fixed = {"held": torch.arange(m), "external": torch.arange(m, len(unseen))}  # unseen = held + external
    return {
        "corpus": corpus,
        "heads": f"--quality {quality}" if quality else frac,
        "pruned": report["pruned_count"],
        "unseen": len(unseen),
        "subset": m,
        "whole": whole,
        "covered": covered,
        "width_mean": sum(widths) / len(widths),
        "subset_q05": float(v.quantile(0.05)),
        "subset_q95": float(v.quantile(0.95)),
        "fixed": {k: objective.quality_of(emb[p], ref[p]) for k, p in fixed.items()},
        "fixed_percentile": {
            k: float((v < objective.quality_of(emb[p], ref[p])).double().mean()) for k, p in fixed.items()
        },
    }


def _rows(batches: list, texts: list[str], tok) -> list[list[int]]:
    """Each batch's rows as indices into ``texts`` (matched by token ids; texts with the same ids share one)."""
    index: dict[tuple[int, ...], list[int]] = {}
    for i, ids in enumerate(prune.encode(tok, texts, 512, True)):
        index.setdefault(tuple(ids), []).append(i)
    out = []
    for b in batches:
        rows = []
        for ids, att in zip(b.inputs["input_ids"], b.inputs["attention_mask"], strict=True):
            rows.append(index[tuple(ids[att.bool()].tolist())].pop(0))
        out.append(rows)
    return out


def _asked(res: dict) -> str:
    r = res["records"][0]
    return r["heads"] if r["heads"].startswith("--") else f"--heads {r['heads']}"


def markdown(res: dict) -> str:
    rows = [["corpus", "heads removed", "unseen texts", "subset size", "quality, all unseen", "interval held it",
             "mean interval width", "subsets' 5th-95th percentile", "command's split (percentile)",
             "external sentences (percentile)"]]  # fmt: skip
    for r in res["records"]:
        f, p = r["fixed"], r["fixed_percentile"]
        rows.append([
            r["corpus"], str(r.get("pruned", "-")), str(r["unseen"]), str(r["subset"]), f"{r['whole']:.4f}", f"{r['covered']}/{SUBSETS}",
            f"{r['width_mean']:.4f}", f"{r['subset_q05']:.4f}-{r['subset_q95']:.4f}",
            f"{f['held']:.4f} ({p['held']:.0%})", f"{f['external']:.4f} ({p['external']:.0%})",
        ])  # fmt: skip
    return "\n".join([
        "# multihead prune: is its 90% interval honest?",
        "",
        f"{res['date']}; {res['machine']}; torch {res['torch']}. Made by `benchmarks/bench_prune_interval.py`.",
        "",
        f"all-MiniLM-L6-v2 pruned by the command at `{_asked(res)}`, refit stage only (`--recover 0 --reconstruct "
        "0`). *Unseen texts*: the command's held-out split and the bench's external sentences, which nothing "
        f"was fit on. {SUBSETS} random subsets of the command's held-out size: how often each subset's 90% "
        "bootstrap interval held the quality over all unseen texts, the interval's mean width against the "
        "subsets' own spread, and where the two fixed sets sit among the subsets (the share of subsets that "
        "measured lower).",
        "",
        markdown_table(rows),
        "",
    ])  # fmt: skip


def main() -> None:
    quality = sys.argv[sys.argv.index("--quality") + 1] if "--quality" in sys.argv else None
    corpus = sys.argv[sys.argv.index("--corpus") + 1 :] if "--corpus" in sys.argv else list(REAL)
    records = [run_one(c, quality=quality) for c in corpus]
    res = {
        "records": records,
        "machine": machine().words(),
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    RESULTS.mkdir(exist_ok=True)
    name = f"prune_interval_q{quality}" if quality else "prune_interval"
    (RESULTS / f"{name}.json").write_text(json.dumps(res, indent=2) + "\n")
    (RESULTS / f"{name}.md").write_text(markdown(res))
    print(markdown(res))


if __name__ == "__main__":
    main()
