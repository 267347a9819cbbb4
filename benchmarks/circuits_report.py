"""The record of ``bench_circuits.py`` as markdown and a chart (the ratios against their targets)."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path


def meta() -> dict:
    """When, where, with what (``bench_lens.environment``), and the load average now."""
    from bench_lens import environment  # benchmarks/ is on the path: bench_circuits imports both

    return {**environment(), "load_average": [round(x, 2) for x in os.getloadavg()]}


def _e(x: float) -> str:
    return f"{x:.1e}"


def _equal_lines(rows: list[dict]) -> list[str]:
    lines = [
        "| what | shape | ours vs TL float64 | TL float32 vs TL float64 | ours vs TL | ours float64 vs TL float64 "
        "| largest | met (2x rule) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        cells = [r["what"], "x".join(map(str, r["shape"]))]
        cells += [
            _e(r[k]) for k in ("ours_vs_float64", "tl_vs_float64", "ours_vs_tl", "ours64_vs_tl64", "largest")
        ]
        lines.append("| " + " | ".join(cells) + f" | {'yes' if r['met'] else 'NO'} |")
    return lines


def _spread(s: dict) -> str:
    return f"{s['median']:.3g} ({s['q1']:.3g}-{s['q3']:.3g})"


_OK = {True: "met", False: "NOT met"}


def _speed_lines(r: dict) -> list[str]:
    node, edges = r.get("speed_node"), r.get("speed_edges")
    lines = ["| task | CPU seconds, median (IQR) |", "| --- | --- |"]
    for part in (p for p in (node, edges) if p):
        lines += [f"| {k} | {_spread(s)} |" for k, s in part["cpu_seconds"].items()]
    lines.append("")
    if node:
        lines += [
            f"- Node attribution per head and position, {node['pairs']} pairs x {node['tokens']} tokens of "
            f"SmolLM2: **{_spread(node['ratio'])}x** TransformerLens's time (target <= {node['target']}: "
            f"{_OK[node['met']]}); with `logits_to_keep=1` (the metric reads the last position): "
            f"{_spread(node['ratio_logits_to_keep_1'])}x; ours = {_spread(node['plain_runs'])} plain runs.",
            f"- Integrated gradients, ig_steps=5, node attribution: {_spread(node['ig_over_steps_plain_runs'])}x "
            f"the time of 5 plain runs ({_OK[node['ig_met']]}), {_spread(node['ig_over_steps_ig1'])}x 5 plain "
            "attributions.",
        ]
    if edges:
        lines += [
            f"- Edges on the random Llama: **{_spread(edges['ratio'])}x** TransformerLens's time "
            f"(target <= {edges['target']}: {_OK[edges['met']]})."
        ]
        if "ig_over_steps_plain_runs" in edges:
            lines.append(
                f"- On SmolLM2 an edge attribution costs {_spread(edges['smollm2_plain_runs'])} plain runs; with "
                f"ig_steps=5 {_spread(edges['ig_over_steps_plain_runs'])}x 5 plain runs ({_OK[edges['ig_met']]}), "
                f"{_spread(edges['ig_over_steps_ig1'])}x 5 plain edge attributions."
            )
    if "gqa" in r:
        lines.append(f"- TransformerLens with ig_steps=5: `{r['gqa']['tl_ig_steps']}`")
    return lines


def _gqa_lines(g: dict) -> list[str]:
    lines = [
        f"TransformerLens on SmolLM2's edges: `{g['tl_edges_smollm2']}`",
        "",
        "Ours on SmolLM2 (GQA: 3 key/value heads, each k and v reader one key/value head): the reader of each kind "
        "with the largest column, its column sum against the finite difference of the metric with that reader "
        "alone fed corrupted + eps (clean - corrupted) residual (float64, exact norms, central differences):",
        "",
        "| reader | column sum | finite difference | relative gap |",
        "| --- | --- | --- | --- |",
    ]
    rc = g["reader_columns"]
    lines += [
        f"| {x['reader']} | {x['column_sum']:+.6g} | {x['finite_difference']:+.6g} | {_e(x['relative_gap'])} |"
        for x in rc["rows"]
    ]
    return lines


def _scale_lines(s: dict) -> list[str]:
    lines = [
        f"SmolLM2 on {s['tokens']} tokens of real text (the docstrings of argparse and unittest), one thread, each "
        "task in a fresh process:",
        "",
        "| task | CPU s | wall s | resident after loading, GiB | peak resident, GiB | target | met |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for task in ("node", "edges"):
        x = s[task]
        if "error" in x:
            lines.append(f"| {task} | failed: {x['error'][-200:]!r} | | | | | NO |")
            continue
        if "aborted" in x:
            lines.append(
                f"| {task} | {x['aborted']} (CPU {x['cpu']:.0f} s) | | {x['rss_before_gib']:.2f} "
                f"| >= {x['peak_rss_gib']:.2f} (sampled) | <= {x['target_s']:.0f} s, <= {x['target_gib']:.0f} GiB | NO |"
            )
            continue
        lines.append(
            f"| {task} | {x['cpu']:.1f} | {x['wall']:.1f} | {x['rss_before_gib']:.2f} | {x['peak_rss_gib']:.2f} "
            f"| <= {x['target_s']:.0f} s, <= {x['target_gib']:.0f} GiB | {'yes' if x['met'] else 'NO'} |"
        )
    return lines


MISSING = "Not measured in this run: the part did not finish before the deadline on the shared machine."


def _section(r: dict, keys: tuple[str, ...], lines: Callable[[], list[str]]) -> list[str]:
    return lines() if all(k in r for k in keys) else [MISSING]


def markdown(r: dict) -> str:
    """The record as a page (a part missing from the record is said to be missing)."""
    m = r["meta"]
    rl = r.get("equal_random_llama", {})
    by_part = r.get("meta_by_part", {})
    lines = [
        "# multihead.lens circuits against TransformerLens 4.3 (`benchmarks/bench_circuits.py`)",
        "",
        f"{m['when']}, {m['cpu_words']} ({m['machine']}), {m['threads']} torch thread; torch {m['torch']}, "
        f"transformers {m['transformers']}, transformer-lens {m['transformer_lens']}. Times are process CPU "
        "seconds, contenders interleaved in balanced orders (the machine is shared with other jobs: load averages "
        "at the end of each part: "
        + ", ".join(f"{k} {v['load_average']}" for k, v in by_part.items())
        + "). 8 IOI-style pairs (4 in the float64 equality checks), metric the logit difference per pair.",
        "",
        "## Equal within float32 error",
        "",
        *_section(
            r, ("equal_smollm2", "equal_random_llama"), lambda: _equal_lines(r["equal_smollm2"] + rl["rows"])
        ),
        "",
        *_section(
            r,
            ("equal_random_llama",),
            lambda: [
                f"Random Llama: {rl['edges']} edges; TransformerLens edges outside our graph: "
                f"{rl['tl_edges_outside_our_graph']}; a head's row sum against its node effect: "
                f"{_e(rl['row_sum_identity'])} (largest row {rl['row_sum_largest']:.3g})."
            ],
        ),
        "",
        "## Where TransformerLens refuses",
        "",
        *_section(r, ("gqa",), lambda: _gqa_lines(r["gqa"])),
        "",
        "## Speed",
        "",
        *(_speed_lines(r) if "speed_node" in r or "speed_edges" in r else [MISSING]),
        "",
        "## Scale",
        "",
        *_section(r, ("scale",), lambda: _scale_lines(r["scale"])),
    ]
    return "\n".join(lines) + "\n"


def chart(r: dict, path: Path) -> None:
    """Each measured ratio against its target, as bars (log scale)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    node, edges, s = r.get("speed_node"), r.get("speed_edges"), r.get("scale", {})
    bars = []
    if node:
        bars += [
            ("node vs TL", node["ratio"]["median"], node["target"]),
            ("node IG5 / 5 plain", node["ig_over_steps_plain_runs"]["median"], 1.0),
        ]
    if edges:
        bars += [
            ("edges vs TL", edges["ratio"]["median"], edges["target"]),
            ("edges IG5 / 5 plain", edges["ig_over_steps_plain_runs"]["median"], 1.0),
        ]
    bars += [
        (f"{t} 1k tokens / {x['target_s']:.0f} s", x["cpu"] / x["target_s"], 1.0)
        for t, x in ((t, s.get(t, {})) for t in ("node", "edges"))
        if "cpu" in x and "aborted" not in x
    ]
    fig, ax = plt.subplots(figsize=(8, 3.6))
    names = [b[0] for b in bars]
    values = [b[1] / b[2] for b in bars]
    ax.barh(names, values, color=["tab:green" if v <= 1 else "tab:red" for v in values])
    ax.axvline(1.0, color="k", lw=1)
    ax.set_xscale("log")
    ax.set_xlabel("measured / target (left of the line: met)")
    ax.set_title(f"multihead circuits vs TransformerLens 4.3, {r['meta']['cpu']}, 1 thread", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
