"""``multihead view`` on real checkpoints: command time, peak memory, page size and headless-Chromium render time.

Two checkpoints:

* SmolLM2-135M-Instruct (``LlamaForCausalLM``, 30 layers x 9 heads = 270 heads;
  :func:`multihead.testing.smollm2_dir`) on 1,000 tokens of real English text: the long descriptions of the
  packages ``requirements-dev.txt`` pins (``benchmarks/data/corpora.py``), joined and cut at the 1,000th
  token of the model's tokenizer. The command runs as its own process, once plain and once with
  ``--importance``; reported: its wall time and peak resident set (the child's ``ru_maxrss``, from
  ``os.wait4``), and the page's size. Targets: <= 20 s, <= 1.5 GiB, <= 16 MiB, a browser opens it in about a second
  or two, and ``--importance`` in about a minute. ``--before SRC`` also runs the same two commands from another
  source tree (``PYTHONPATH=SRC``, e.g. a checkout of the commit before a change), interleaved with these,
  and renders its plain page in the same rounds as this tree's.
* all-MiniLM-L6-v2 (``BertModel``, 6 layers x 12 heads; :func:`multihead.testing.minilm_dir`) at 512 tokens,
  and at 1,024 from a copy of it whose position table is the original's repeated twice (config, tokenizer
  limit and weights edited; the patterns stay realistic, the model is not meant for that length).

Each page is opened once by ``chromium --headless --dump-dom`` (it must log nothing and reach
``data-status="ready"``), then timed in interleaved rounds with an empty page: real seconds from
navigating an already started headless Chromium (DevTools protocol, host resolution disabled) to the
page's script reporting everything drawn (:func:`multihead.testing.render_seconds`). Median [IQR]::

    python benchmarks/bench_view.py                        # writes benchmarks/results/view.{json,md}
    python benchmarks/bench_view.py --before /old/src      # and the same commands from an older tree
    python benchmarks/bench_view.py --quick                # one round, nothing written
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path

import torch

from multihead.bench.measure import balanced_orders
from multihead.bench.pair import machine
from multihead.bench.stats import spread
from multihead.testing import minilm_dir, render, render_seconds, smollm2_dir

sys.path.insert(0, str(Path(__file__).resolve().parent / "data"))
import corpora  # noqa: E402  (benchmarks/data/corpora.py: real text the project did not write)

RESULTS = Path(__file__).resolve().parent / "results"
SRC = Path(__file__).resolve().parent.parent / "src"
TOKENS = 1000
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


def real_text(folder: Path, tokens: int) -> str:
    """The pinned packages' prose (``corpora.package_texts``), cut after the ``tokens``-th token of the
    checkpoint's tokenizer; the cut text tokenizes back to exactly ``tokens`` tokens (checked)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    text = " ".join(corpora.sentences(corpora.package_texts()))
    enc = tok(text, return_offsets_mapping=True)
    if len(enc["input_ids"]) < tokens:
        raise SystemExit(f"the corpus has {len(enc['input_ids'])} tokens, fewer than {tokens}")
    cut = text[: enc["offset_mapping"][tokens - 1][1]]
    if len(tok(cut)["input_ids"]) != tokens:
        raise SystemExit(f"the text cut at token {tokens} tokenizes to {len(tok(cut)['input_ids'])} tokens")
    return cut


@dataclass(frozen=True)
class Command:
    """One ``multihead view`` process: wall seconds, its peak resident set (MiB) and the page (MiB)."""

    wall_s: float
    peak_mib: float
    page_mib: float


def run_view(src: Path, argv: list[str], page: Path) -> Command:
    """``python -m multihead view *argv`` as a child with ``src`` first on its path; its own peak RSS."""
    env = dict(os.environ, PYTHONPATH=str(src))
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        start = time.perf_counter()
        proc = subprocess.Popen(
            [sys.executable, "-m", "multihead", "view", *argv, "--out", str(page)],
            env=env,
            stdout=out,
            stderr=err,
        )
        _, status, usage = os.wait4(proc.pid, 0)  # reaped here, so this child's own rusage (not Popen.wait)
        wall = time.perf_counter() - start
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        if proc.returncode != 0:
            raise SystemExit(f"multihead view {argv[0]} failed ({src}): {err.read().decode()[-2000:]}")
        said = out.read().decode().strip()
    print(said, f"in {wall:.1f} s, peak {usage.ru_maxrss / 1024:.0f} MiB", flush=True)
    return Command(round(wall, 1), round(usage.ru_maxrss / 1024, 1), round(page.stat().st_size / 2**20, 3))


def smollm2_commands(tmp: Path, before: Path | None) -> tuple[dict[str, Command], dict[str, Path]]:
    """The four (or two) SmolLM2 commands, in the order before/after alternating; their pages."""
    folder = smollm2_dir()
    argv = [str(folder), "--text", real_text(folder, TOKENS)]
    trees = {"after": SRC} if before is None else {"before": before, "after": SRC}
    runs = [(tree, extra) for extra in ([], ["--importance"]) for tree in trees]
    if before is not None:
        runs[2:] = runs[2:][::-1]  # before, after, after, before: neither always goes first
    done, pages = {}, {}
    for tree, extra in runs:
        key = tree + (" --importance" if extra else "")
        pages[key] = tmp / f"smollm2-{key.replace(' --', '-')}.html"
        done[key] = run_view(trees[tree], argv + extra, pages[key])
    return done, pages


def render_times(pages: dict[str, Path], rounds: int) -> dict[str, dict]:
    """Each page rendered once (clean: no console message, status ready), then timed in balanced rounds."""
    check = {}
    for k, p in pages.items():
        check[k] = render(p)
        if check[k].status != "ready" or check[k].console:
            raise SystemExit(f"page {k} did not render cleanly: {check[k]}")
    names = list(pages)
    seconds: dict[str, list[float]] = {k: [] for k in names}
    orders = balanced_orders(len(names))  # interleaved: each after each other equally often
    for r in range(rounds):
        for k in (names[j] for j in orders[r % len(orders)]):
            seconds[k].append(render_seconds(pages[k]))
        print(
            f"round {r + 1}/{rounds}: " + ", ".join(f"{k}: {seconds[k][-1]:.2f} s" for k in names), flush=True
        )
    out = {}
    for k in names:
        t = spread(seconds[k])
        out[k] = {
            "render_s": [round(x, 2) for x in (t.median, t.q1, t.q3)],
            "browser_process_wall_s": round(check[k].wall_s, 1),
        }
    return out


def minilm_pages(tmp: Path) -> tuple[dict[str, Command], dict[str, Path]]:
    """all-MiniLM-L6-v2's pages at 512 and 1,024 tokens (a long text cut with ``--truncate``)."""
    folders = {
        "minilm 512": minilm_dir(),
        "minilm 1024": doubled_positions(minilm_dir(), tmp / "minilm-1024"),
    }
    done, pages = {}, {}
    for k, folder in folders.items():
        pages[k] = tmp / f"{k.replace(' ', '-')}.html"
        done[k] = run_view(SRC, [str(folder), "--text", TEXT * 40, "--truncate"], pages[k])
    return done, pages


def measure(args: argparse.Namespace, tmp: Path) -> dict:
    """Every command and render of the run, with the machine it ran on."""
    commands, pages = smollm2_commands(tmp, args.before)
    more, minilm = minilm_pages(tmp)
    commands.update(more)
    blank = tmp / "blank.html"
    blank.write_text('<!DOCTYPE html><html><body data-status="ready" data-ms="0"></body></html>')
    before = {"before": pages["before"]} if args.before else {}  # its page too, in the same rounds
    shown = {"blank": blank, **before, "after": pages["after"], **minilm}
    renders = render_times(shown, 1 if args.quick else args.rounds)
    m = machine()
    return {
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "cpu": m.cpu,
        "cores": m.cores,
        "torch_threads": m.threads,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "rounds": 1 if args.quick else args.rounds,
        "tokens": TOKENS,
        "before": None if args.before is None else describe(args.before),
        "commands": {k: asdict(c) for k, c in commands.items()},
        "renders": renders,
    }


def describe(src: Path) -> str:
    """The source tree as its git commit says it (or its path)."""
    got = subprocess.run(
        ["git", "-C", str(src), "log", "-1", "--format=%h %s"], capture_output=True, text=True, check=False
    )
    return got.stdout.strip()[:100] or str(src)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="one render round, nothing written")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--before", type=Path, help="a source tree (src/) to run the SmolLM2 commands from too"
    )
    return run_and_record(parser.parse_args(), measure, markdown, "view")


def run_and_record(
    args: argparse.Namespace,
    measure: Callable[[argparse.Namespace, Path], dict],
    markdown: Callable[[dict], str],
    stem: str,
) -> int:
    """``measure(args, tmp)`` in a scratch folder (removed after), its result printed and, unless
    ``args.quick``, written as ``results/<stem>.json`` and ``.md`` (this benchmark's and bench_view_inline's)."""
    tmp = Path(tempfile.mkdtemp(prefix=f"bench-{stem.replace('_', '-')}-"))
    try:
        result = measure(args, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(json.dumps(result, indent=2))
    if args.quick:
        return 0
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{stem}.json").write_text(json.dumps(result, indent=2) + "\n")
    (RESULTS / f"{stem}.md").write_text(markdown(result))
    return 0


def _iqr(v: list[float]) -> str:
    return f"{v[0]:.2f} s [{v[1]:.2f}, {v[2]:.2f}]"


def _smollm2_table(r: dict) -> list[str]:
    c = r["commands"]
    trees = ["before", "after"] if r["before"] else ["after"]
    lines = [
        "| source | command | wall | peak RSS | page | target | met |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for tree in trees:
        plain, imp = c[tree], c[tree + " --importance"]
        met = plain["wall_s"] <= 20 and plain["peak_mib"] <= 1536 and plain["page_mib"] <= 16
        lines.append(
            f"| {tree} | `view` | {plain['wall_s']:.1f} s | {plain['peak_mib'] / 1024:.2f} GiB | "
            f"{plain['page_mib']:.2f} MiB | <= 20 s, <= 1.5 GiB, <= 16 MiB | {'yes' if met else 'no'} |"
        )
        lines.append(
            f"| {tree} | `view --importance` | {imp['wall_s']:.1f} s | {imp['peak_mib'] / 1024:.2f} GiB | "
            f"{imp['page_mib']:.2f} MiB | about a minute | {'yes' if imp['wall_s'] <= 75 else 'no'} |"
        )
    return lines


def markdown(r: dict) -> str:
    busy = ""
    if r["load_average"][0] > r["cores"] + 1:  # more than this run's own work: other jobs shared the machine
        busy = " (the machine was shared by other jobs, which inflates every time here)"
    rd, c = r["renders"], r["commands"]
    lines = [
        "# `multihead view` on real checkpoints: time, memory, page size, render time",
        "",
        f"{r['date']}, {r['cpu']}, {r['cores']} cores, {r['torch_threads']} torch threads, torch {r['torch']}, "
        f"Python {r['python']}, load average {r['load_average']} at the end{busy}.",
        "",
        f"## SmolLM2-135M-Instruct (30 layers x 9 heads), {r['tokens']:,} tokens of real text",
        "",
        "Each command is its own process (wall time and its peak resident set, model loading included).",
        ("*before*: " + r["before"] + "; *after*: this tree. Run in the order before, after, after, before.")
        if r["before"]
        else "",
        "",
        *_smollm2_table(r),
        "",
        f"The page renders in headless Chromium in {_iqr(rd['after']['render_s'])} (every thumbnail and the head "
        f"view drawn; an empty page: {_iqr(rd['blank']['render_s'])}); one whole `chromium --headless "
        f"--dump-dom` run of it takes {rd['after']['browser_process_wall_s']:.1f} s"
        + (f"; *before*'s page: {_iqr(rd['before']['render_s'])}." if "before" in rd else "."),
        "",
        "## all-MiniLM-L6-v2 (6 layers x 12 heads)",
        "",
        "| tokens | checkpoint | page | render | browser process | command |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for n, what in ((512, "all-MiniLM-L6-v2"), (1024, "positions repeated to 1,024")):
        k = f"minilm {n}"
        lines.append(
            f"| {n:,} | {what} | {c[k]['page_mib']:.2f} MiB | {_iqr(rd[k]['render_s'])} | "
            f"{rd[k]['browser_process_wall_s']:.1f} s | {c[k]['wall_s']:.1f} s, {c[k]['peak_mib']:.0f} MiB |"
        )
    lines += [
        "",
        f"*Render*: {r['rounds']} interleaved rounds (balanced orders), real seconds from telling an already "
        "started headless Chromium (DevTools protocol, every host name unresolvable) to open the page from "
        "file:// until the page reports every thumbnail and the head view drawn. Median [IQR]. Weights travel "
        "as uint8 (error <= 1/510), deflated per head and base64-encoded; each head's thumbnail is made by the "
        "command (the uint8 weights max-pooled to at most 96 x 96, a module's deflated in one blob), so opening "
        "the page inflates (DecompressionStream) 9 KiB per head and only the head the head view shows, which "
        "draws only the rows scrolled into view. The command encodes each module's weights "
        "as soon as the module has run (`viz.stream`) and keeps no float weights. Reproduce: "
        "`python benchmarks/bench_view.py [--before OLD/src]` (needs chromium and the dev extra).",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
