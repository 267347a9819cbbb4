"""Is a 50%-pruned all-MiniLM-L6-v2 faster, and where does the time go? Interleaved timings and a profile.

all-MiniLM-L6-v2 is pruned by ``multihead prune --heads 0.5`` on the stdlib-docs corpus's calibration lines
(``benchmarks/data/corpora.py``), refit stage only (``--recover 0 --reconstruct 0``: the later stages change
weights, not shapes, so not the speed). Then, for several input shapes (batch x tokens, real text, no
padding), the original and the pruned folder run forward in interleaved rounds
(:func:`multihead.bench.pair.time_pair`; the speed-up is the median per-round ratio, with its quartiles).
Last, one profile of each model at 32 x 128 (``torch.profiler``, operator self time), and the shapes of the
pruned layers' projections, to check that the removed heads really shrink them::

    flock /tmp/bench.lock python benchmarks/bench_prune_speed.py   # benchmarks/results/prune_speed.{json,md}
"""

from __future__ import annotations

import json
import os
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
from multihead.testing import minilm_dir

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE / "data"))
import corpora  # noqa: E402  (benchmarks/data/corpora.py)
from bench_prune import SPEEDUP_TARGET, _load, long_inputs  # noqa: E402

RESULTS = HERE / "results"
SHAPES = ((32, 128), (8, 128), (1, 128), (8, 512))  # (batch, tokens)
SETTINGS = Settings(warmup=2, min_rounds=15, max_rounds=41, budget_s=20.0)
TOP = 8  # operators listed per model in the profile


def profile(model: torch.nn.Module, x: dict, calls: int = 5) -> dict[str, float]:
    """Milliseconds per forward call spent in each operator (self CPU time), ``calls`` calls averaged."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    with torch.no_grad():
        model(**x)
        with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(calls):
                model(**x)
    rows = {e.key: e.self_cpu_time_total / 1e3 / calls for e in prof.key_averages()}
    return dict(sorted(rows.items(), key=lambda kv: -kv[1]))


def projections(model: torch.nn.Module) -> list[dict]:
    """Each layer's attention projection weight shapes, ``{name: [out, in]}`` (the heads' share of them)."""
    shapes = []
    for layer in model.encoder.layer:
        att = layer.attention
        named = {
            "query": att.self.query,
            "key": att.self.key,
            "value": att.self.value,
            "output": att.output.dense,
        }
        shapes.append({k: list(m.weight.shape) for k, m in named.items()})
    return shapes


def main() -> None:
    calibration, _ = corpora.split(corpora.CORPORA["stdlib-docs"]())
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        data, out = Path(tmp) / "lines.txt", Path(tmp) / "pruned"
        data.write_text("\n".join(calibration) + "\n", encoding="utf-8")
        opts = prune.Options(minilm_dir(), data, "0.5", out, recover=0, reconstruct=0, progress=False)
        report = prune.run(opts, echo=lambda _: None)
        original, pruned = _load(minilm_dir()), _load(out)
    tok = T.AutoTokenizer.from_pretrained(minilm_dir())
    timings = []
    for batch, length in SHAPES:
        x = long_inputs(tok, calibration, batch, length)
        with torch.no_grad():
            t = time_pair(partial(original, **x), partial(pruned, **x), settings=SETTINGS)
        timings.append({
            "batch": batch, "tokens": length, "original_ms": t.median_round[0] * 1e3,
            "pruned_ms": t.median_round[1] * 1e3, "speedup": t.speedup.median,
            "speedup_iqr": [t.speedup.q1, t.speedup.q3], "rounds": t.speedup.n, "load": os.getloadavg()[0],
        })  # fmt: skip
        print(timings[-1], flush=True)
    x = long_inputs(tok, calibration, 32, 128)
    res = {
        "pruned": report["pruned_count"], "heads_left": report["heads_left"],
        "params": [sum(p.numel() for p in m.parameters()) for m in (original, pruned)],
        "timings": timings, "profile": {"original": profile(original, x), "pruned": profile(pruned, x)},
        "projections": projections(pruned), "machine": machine().words(), "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }  # fmt: skip
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "prune_speed.json").write_text(json.dumps(res, indent=2) + "\n")
    (RESULTS / "prune_speed.md").write_text(markdown(res))
    print(markdown(res))


def markdown(res: dict) -> str:
    rows = [["batch x tokens", "original", "pruned", "speed-up [IQR]", "rounds", "1-min load"]]
    for t in res["timings"]:
        rows.append([
            f"{t['batch']} x {t['tokens']}", f"{t['original_ms']:.1f} ms", f"{t['pruned_ms']:.1f} ms",
            f"{t['speedup']:.2f}x [{t['speedup_iqr'][0]:.2f}, {t['speedup_iqr'][1]:.2f}]", str(t["rounds"]),
            f"{t['load']:.1f}",
        ])  # fmt: skip
    orig, pr = res["profile"]["original"], res["profile"]["pruned"]
    ops = list(orig)[:TOP]
    prof = [["operator (self CPU, ms per forward, 32 x 128)", "original", "pruned"]]
    prof += [[f"`{op}`", f"{orig[op]:.1f}", f"{pr.get(op, 0.0):.1f}"] for op in ops]
    prof.append(["all", f"{sum(orig.values()):.1f}", f"{sum(pr.values()):.1f}"])
    shapes = [
        ["layer", "heads left", "query / key / value weight [out, in]", "attention output weight [out, in]"]
    ]
    for i, (left, s) in enumerate(zip(res["heads_left"].values(), res["projections"], strict=True)):
        shapes.append([str(i), str(left), f"{s['query']} / {s['key']} / {s['value']}", str(s["output"])])
    main_t = next(t for t in res["timings"] if (t["batch"], t["tokens"]) == (32, 128))
    verdict = "ok" if main_t["speedup"] >= SPEEDUP_TARGET else "MISSED"
    return "\n".join([
        "# multihead prune: the speed a 50%-pruned all-MiniLM-L6-v2 buys",
        "",
        f"{res['date']}; {res['machine']}; torch {res['torch']}. Made by `benchmarks/bench_prune_speed.py` (see "
        f"its docstring). `--heads 0.5` on stdlib-docs, refit stage only: {res['pruned']} of 72 heads removed, "
        f"parameters {res['params'][0]:,} -> {res['params'][1]:,}. Forward passes of real text without padding, "
        "original and pruned in interleaved rounds; the speed-up is the median per-round ratio.",
        "",
        markdown_table(rows),
        "",
        f"Target: >= {SPEEDUP_TARGET}x at 32 x 128: {main_t['speedup']:.2f}x ({verdict}).",
        "",
        "Where the time goes (one profile of 5 forward calls each, the original's top operators):",
        "",
        markdown_table(prof),
        "",
        "The pruned model's attention projections (MiniLM: 384 wide, 12 heads of 32; a removed head takes 32 "
        "rows of query, key and value and 32 columns of the output projection):",
        "",
        markdown_table(shapes),
        "",
    ])  # fmt: skip


if __name__ == "__main__":
    main()
