"""``multihead prune --quality`` and ``multihead prune`` on a causal LM at real size, each against the peer.

Companion of ``benchmarks/bench_prune.py`` (same corpora, same external held-out rule: every fourth sentence of
``benchmarks/data/corpora.py``'s corpora is never shown to the command):

* **quality floor** -- all-MiniLM-L6-v2 with ``--quality`` 0.99 and 0.97 on each real corpus (licences,
  package-docs, stdlib-docs): how many heads the command removed, the saved model's quality on the command's
  held-out split (with its 90% interval) and on the external sentences, and the forward speed-up
  (32 texts x 128 tokens, interleaved rounds);
* **causal LM** -- SmolLM2-135M-Instruct (``multihead.testing.smollm2_dir``: 30 layers x 9 heads over 3
  key/value heads) with ``--heads 0.25`` on stdlib-docs: the held-out perplexity ratio (the command's split
  and the external sentences), wall and CPU time, peak memory, greedy decoding tokens/s and the KV cache's
  bytes per token before and after; and with ``--quality 0.97`` (a perplexity ratio of at most 1/0.97);
* **fixed fractions** -- all-MiniLM-L6-v2 with ``--heads`` 0.25 and 0.5 on each real corpus (the stages
  themselves, over three seeds, are ``benchmarks/bench_prune.py``'s);
* **the peer** a user would try first, on every one of those: Michel et al.'s gradient importance
  (``heads.importance`` of the objective's loss, :func:`multihead.commands.prune.choose_and_prune`, one round),
  the same number of heads, then the same recovery budget (the steps the command's run used), and nothing else.

Each run is its own process (so its peak memory is its own); records are saved as they finish and
``--resume`` runs only the missing ones::

    flock /tmp/bench.lock python benchmarks/bench_prune_floor.py   # benchmarks/results/prune_floor.{json,md}
    python benchmarks/bench_prune_floor.py --only minilm:licences:q0.99   # one run (its peer follows)
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import transformers as T

from multihead.bench.pair import machine
from multihead.commands import prune
from multihead.commands.training import markdown_table
from multihead.testing import minilm_dir, smollm2_dir

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE / "data"))
import corpora  # noqa: E402  (benchmarks/data/corpora.py)

RESULTS = HERE / "results"
OUT = RESULTS / "prune_floor.json"
REAL = ("licences", "package-docs", "stdlib-docs")
FLOORS = ("0.99", "0.97")
MODELS = {"minilm": minilm_dir, "smollm2": smollm2_dir}
FRACTIONS = ("0.25", "0.5")
RUNS = [
    *(f"minilm:{c}:q{q}" for c in REAL for q in FLOORS),
    "smollm2:stdlib-docs:h0.25",
    "smollm2:stdlib-docs:q0.97",
    *(f"minilm:{c}:h{f}" for c in REAL for f in FRACTIONS),
]
"""``model:corpus:amount`` -- ``qQ`` a quality floor, ``hF`` a fraction of the heads."""


def external(model_dir: Path, folder: Path, texts: list[str], objective: prune.Objective) -> float:
    """The saved folder's quality against the original's on ``texts`` (the objective's measure)."""
    from multihead.commands import model_dir as md

    original, pruned = md.load(model_dir), md.load(folder)
    tok = original.tokenizer
    batches = prune.make_batches(prune.encode(tok, texts, original.max_length, True), tok, objective, 16, 0)
    reference = objective.reference(original.model.eval(), batches)
    return objective.quality(pruned.model.eval(), reference, batches)


def one(run: str, peer_of: dict | None) -> dict:
    """Run ``run`` (or its peer, with ``peer_of`` the record of the command's run) in this process."""
    model, corpus, amount = run.split(":")
    calibration, held = corpora.split(corpora.CORPORA[corpus]())
    extra: dict = (
        {"heads": amount[1:], "quality": None} if amount[0] == "h" else {"heads": None, "quality": amount[1:]}
    )
    if peer_of is not None:  # the same heads count and recovery steps, chosen by gradient importance
        extra = {"heads": str(peer_of["pruned"]), "quality": None, "importance_rounds": 1,
                 "recover": peer_of["recovery_steps"]}  # fmt: skip
    started, cpu = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
    with tempfile.TemporaryDirectory() as tmp:
        data, out = Path(tmp) / "lines.txt", Path(tmp) / "pruned"
        data.write_text("\n".join(calibration) + "\n", encoding="utf-8")
        opts = prune.Options(MODELS[model](), data, out=out, progress=False, **extra)
        report = prune.run(opts, echo=lambda line: print(line, flush=True))
        wall, end = time.perf_counter() - started, resource.getrusage(resource.RUSAGE_SELF)
        ext = external(MODELS[model](), out, held, prune.OBJECTIVES[report["kind"]]())
    q = report["quality"]
    return {
        "run": run, "peer": peer_of is not None, "model": report["model_class"], "corpus": corpus,
        "lines": [len(calibration), len(held)], "pruned": report["pruned_count"],
        "heads_total": report["heads_before"], "metric": q["metric"], "stages": q["stages"],
        "held_out": q["final"], "interval": q["final_interval"], "external": ext,
        "floor": report.get("floor"), "recovery_steps": report["recovery"]["steps"],
        "recovery_run": report["recovery"]["steps_run"], "speed": report["speed"],
        "wall_s": wall, "cpu_s": end.ru_utime + end.ru_stime - cpu.ru_utime - cpu.ru_stime,
        "peak_mib": end.ru_maxrss / 1024, "load_after": os.getloadavg()[0], "threads": torch.get_num_threads(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }  # fmt: skip


def child(run: str, peer_of: dict | None) -> dict:
    """:func:`one` in a fresh process (its own peak memory); its record."""
    with tempfile.TemporaryDirectory() as tmp:
        record = Path(tmp) / "record.json"
        cmd = [sys.executable, __file__, "--child", run, "--record", str(record)]
        subprocess.run(cmd + (["--peer-of", json.dumps(peer_of)] if peer_of else []), check=True)
        return json.loads(record.read_text())


def markdown(res: dict) -> str:
    rows = [["run", "chooser", "heads removed", "validation kept at the floor (next)", "held-out (90% interval)",
             "external held-out", "forward speed-up", "decode tokens/s", "KV bytes/token", "wall / CPU s",
             "peak MiB"]]  # fmt: skip
    for r in res["records"]:
        f, s = r.get("floor"), r["speed"]
        nxt = f and f["next"] and f"{f['next']['heads']}: {f['next']['validation']:.4f}"
        d = s.get("decode")
        rows.append([
            r["run"], "gradient importance + recovery (peer)" if r["peer"] else "multihead prune",
            f"{r['pruned']}/{r['heads_total']}",
            f"{f['validation_at_removable']:.4f} ({nxt or 'none'})" if f else "-",
            f"{r['held_out']:.4f} ({r['interval'][0]:.4f}-{r['interval'][1]:.4f})", f"{r['external']:.4f}",
            f"{s['speedup']:.2f}x", f"{d['original_tokens_per_s']:.1f} -> {d['pruned_tokens_per_s']:.1f}" if d else "-",
            f"{d['kv_bytes_per_token'][0]:,.0f} -> {d['kv_bytes_per_token'][1]:,.0f}" if d else "-",
            f"{r['wall_s']:.0f} / {r['cpu_s']:.0f}", f"{r['peak_mib']:.0f}",
        ])  # fmt: skip
    return "\n".join([
        "# multihead prune: quality floors, a causal LM at real size, and the peer",
        "",
        f"{res['date']}; {res['machine']}; torch {res['torch']}, transformers {res['transformers']}. Made by "
        "`benchmarks/bench_prune_floor.py` (see its docstring). Quality: all-MiniLM-L6-v2, Spearman of pairwise "
        "similarities against the original's (1.0 = the same order); SmolLM2-135M-Instruct, the perplexity "
        "ratio against the original's (1.0 = unchanged, higher is worse). *External*: every fourth sentence "
        "of the corpus, never shown to the command. Wall and CPU seconds: the command's run (CPU: user + "
        "system of all its threads), on a machine shared with other work (wall time is long when it was "
        "busy; CPU time is what a quiet machine's wall time would be, times the threads). The peer: the same "
        "count of heads chosen by gradient importance, then recovery with the command run's step budget.",
        "",
        markdown_table(rows),
    ]) + "\n"  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", default=RUNS, help="runs (model:corpus:amount)")
    parser.add_argument("--resume", action="store_true", help="keep the saved records, run the missing ones")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--peer-of", help=argparse.SUPPRESS)
    parser.add_argument("--record", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        record = one(args.child, json.loads(args.peer_of) if args.peer_of else None)
        Path(args.record).write_text(json.dumps(record))
        return
    records = json.loads(OUT.read_text())["records"] if args.resume and OUT.exists() else []
    for run in args.only:
        ours = next((r for r in records if r["run"] == run and not r["peer"]), None)
        if ours is None:
            records.append(ours := child(run, None))
            save(records)
        if not any(r["run"] == run and r["peer"] for r in records):
            records.append(child(run, ours))
            save(records)


def plot(res: dict, path: Path) -> None:
    """Quality against heads removed, the command against the peer: one panel per model and corpus. The
    command's held-out quality (90% interval as bars) at each floor; the peer's at the same counts; the
    refit-only validation quality the --quality search measured at each count it tried (line)."""
    from multihead import viz

    panels = sorted({(r["run"].split(":")[0], r["corpus"]) for r in res["records"]})
    fig = viz.new_figure(figsize=(4.2 * len(panels), 3.6), layout="constrained")
    axes = fig.subplots(1, len(panels), squeeze=False)[0]
    for ax, (model, corpus) in zip(axes, panels, strict=True):
        rs = [r for r in res["records"] if r["run"].startswith(f"{model}:{corpus}:")]
        lm = model == "smollm2"  # a perplexity ratio: lower is better
        for peer, color, label in (
            (False, "C0", "multihead prune"),
            (True, "C3", "gradient importance + recovery"),
        ):
            pts = sorted((r["pruned"], r["held_out"], *r["interval"]) for r in rs if r["peer"] == peer)
            if pts:
                x, y, lo, hi = zip(*pts, strict=True)
                x = [k + 0.012 * rs[0]["heads_total"] * peer for k in x]  # side by side, not on top
                err = [
                    [a - b for a, b in zip(y, lo, strict=True)],
                    [b - a for a, b in zip(y, hi, strict=True)],
                ]
                ax.errorbar(x, y, yerr=err, fmt="o", color=color, capsize=3, label=f"{label}, held-out")
        tried = sorted(  # relative quality; a language model's panel reads perplexity ratios (1 / it)
            {
                int(k): 1 / v if lm else v
                for r in rs
                if r.get("floor")
                for k, v in r["floor"]["tried"].items()
            }.items()
        )
        if tried:
            ax.plot(
                *zip(*tried, strict=True),
                ".--",
                color="C0",
                alpha=0.5,
                label="refit only, validation (search)",
            )
        for q in sorted({r["floor"]["quality"] for r in rs if r.get("floor")}):
            ax.axhline(1 / q if lm else q, color="k", lw=0.6, ls=":")  # the floors asked for
        ax.set_xlabel(f"heads removed (of {rs[0]['heads_total']})")
        ax.set_ylabel("perplexity ratio (lower is better)" if lm else "quality kept (Spearman)")
        ax.set_title(f"{model}, {corpus}", fontsize=9)
        most = max([r["pruned"] for r in rs] + [x for x, _ in tried])
        ax.set_xlim(0, most * 1.15 + 2)  # a count is read from 0, not zoomed onto one run
        ax.legend(fontsize=7, loc="best")
    fig.savefig(path, dpi=100, metadata={"Software": None})


def save(records: list[dict]) -> None:
    res = {"records": records, "machine": machine().words(), "torch": torch.__version__,
           "transformers": T.__version__, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}  # fmt: skip
    RESULTS.mkdir(exist_ok=True)
    OUT.write_text(json.dumps(res, indent=2) + "\n")
    (RESULTS / "prune_floor.md").write_text(markdown(res))
    plot(res, RESULTS / "prune_floor.png")
    print(markdown(res))


if __name__ == "__main__":
    main()
