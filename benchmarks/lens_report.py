"""The report of ``benchmarks/bench_lens.py``: its JSON record as markdown (:func:`markdown`) and a chart
(:func:`chart`); the committed ``results/lens_cpu.md`` is ``markdown`` of ``results/lens_cpu.json``."""

from __future__ import annotations

from pathlib import Path

import lens_peer
import torch


def _s(d: dict, spec: str = ".3f", unit: str = "") -> str:
    return f"{d['median']:{spec}}{unit} [{d['q1']:{spec}}, {d['q3']:{spec}}]"


def _yes(met: bool) -> str:
    return "yes" if met else "**no**"


def _targets(r: dict) -> list[str]:
    nl, ca, pa, me = r["no_lens"], r["cache"], r["patching"], r["memory"]
    used, never = (
        " / ".join(_s(nl["cpu_seconds"][f"{kind} {i}"]) for i in range(nl["replicas"]))
        for kind in ("lens", "plain")
    )
    ours_c, tl_c = (ca["cpu_seconds"][k] for k in ("multihead lens.cache", "TransformerLens run_with_cache"))
    ours_p = pa["cpu_seconds"]["multihead lens.patch_heads (270 heads)"]
    mib = 2**20
    return [
        "| task | multihead | peer | ratio | target | met |",
        "| --- | --- | --- | --- | --- | --- |",
        f"| forward, no lens open ({nl['tokens']} tokens): {nl['replicas']} processes that imported, used and "
        f"closed `multihead.lens` vs {nl['replicas']} that never imported it | {used} | {never} (never imported) | "
        f"{_s(nl['ratio'], '.3f', 'x')} | within 3% | {_yes(nl['met'])} |",
        f"| cache pattern and z of all 30 layers ({ca['tokens']} tokens): `lens.cache` vs `run_with_cache` | "
        f"{_s(ours_c)} | {_s(tl_c)} | {_s(ca['ratio'], '.2f', 'x')} | <= {ca['target']}x | {_yes(ca['met'])} |",
        f"| patch z of all {pa['heads']} heads ({pa['tokens']} tokens, logit difference per example): "
        f"`lens.patch_heads` vs TransformerLens's loop | {_s(ours_p)} | {_s(pa['tl_estimate_cpu_seconds'])} "
        f"(estimated) | {_s(pa['ratio'], '.3f', 'x')} | <= {pa['target']}x | {_yes(pa['met'])} |",
        f"| bytes a cache holds (pattern and z, 30 layers, {me['tokens']} tokens) vs the asked tensors' "
        f"{me['asked_bytes'] / mib:.2f} MiB | {me['ours_cache_bytes'] / mib:.2f} MiB | "
        f"{me['tl_cache_bytes'] / mib:.2f} MiB | - | = asked | {_yes(me['met'])} |",
    ]


LAST_ONLY = "multihead lens.patch_heads (270 heads), logits_to_keep=1"


def _notes(r: dict) -> list[str]:
    nl, ca = r["no_lens"], r["cache"]
    return [
        "",
        f"No lens open: the ratio is the lens processes' mean over the plain processes' mean, per round; two "
        f"processes of the same kind differ by {_s(nl['floor']['plain'], '.3f', 'x')} (plain 0 / plain 1) and "
        f"{_s(nl['floor']['lens'], '.3f', 'x')} (lens 0 / lens 1): where the weights landed in memory. "
        f"`multihead.lens` in the plain processes' modules at the end: {nl['lens_imported']['plain 0']}.",
        "",
        f"Patching: the same sweep with `logits_to_keep=1` in both inputs (a Hugging Face causal LM's own "
        f"keyword: the unembedding only at the last position, all the metric reads; TransformerLens's patching "
        f"function passes no such option on) {_s(r['patching']['cpu_seconds'][LAST_ONLY])} s, "
        f"{_s(r['patching']['ratio_last_logits_only'], '.3f', 'x')} TransformerLens's loop (the same effects "
        f"within {r['patching']['last_logits_only_vs_all']:.1e}).",
        "",
        f"Caching: `lens.cache` over our plain forward {_s(ca['over_plain_forward'], '.3f', 'x')}; "
        f"TransformerLens's plain forward {_s(ca['cpu_seconds']['TransformerLens forward'])} s, ours "
        f"{_s(ca['cpu_seconds']['multihead forward'])} s.",
    ]


def _equality(r: dict) -> list[str]:
    e = r["equality"]
    lines = [
        "| point | shape (one layer) | ours vs float64 | TransformerLens vs float64 | ours vs TransformerLens | "
        "largest value | met (ours <= 2x TransformerLens's error) |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for p in e["points"]:
        lines.append(
            f"| {p['point']} | {tuple(p['shape'])} | {p['ours_vs_float64']:.2e} | {p['tl_vs_float64']:.2e} | "
            f"{p['ours_vs_tl']:.2e} | {p['largest']:.3g} | {_yes(p['met'])} |"
        )
    lines += ["", f"Masked scores: ours -inf exactly where TransformerLens's hold the float min: "
              f"{_yes(e['masked_entries_agree'])}.", "", "| edit (same head, same point, each tool's own hooks) | "
              "moves the logits by | ours vs TransformerLens | unedited ours vs TransformerLens | met (<= 2x unedited) |",
              "| --- | --- | --- | --- | --- |"]  # fmt: skip
    for x in r["edits"]:
        how = '`lens.ablate(how="zero")` / `hook_z`' if x["point"] == "z" else "`lens.hooks` / `hook_rot_q`"
        lines.append(
            f"| layer {x['layer']} head {x['head']}: {x['point']} zeroed ({how}) | {x['moves_logits_by']:.3f} | "
            f"{x['ours_vs_tl']:.2e} | {x['unedited_ours_vs_tl']:.2e} | {_yes(x['met'])} |"
        )
    return lines


def _patching(r: dict) -> list[str]:
    pa = r["patching"]
    effects = torch.tensor(pa["effects"])
    top = torch.topk(effects.flatten(), 5).indices.tolist()
    heads = ", ".join(
        f"L{i // effects.shape[1]}H{i % effects.shape[1]} {effects.flatten()[i]:+.2f}" for i in top
    )
    return [
        f"Logit difference ({lens_peer.ANSWERS[0].strip()} - {lens_peer.ANSWERS[1].strip()}) of the corrupted run "
        f"{pa['corrupted_logit_diff']:+.3f}; patched one head at a time on {len(pa['compared_heads'])} heads (one "
        f"per layer), the largest change {pa['largest_change']:.3f}; ours and TransformerLens's effects differ by "
        f"at most {pa['ours_vs_tl']:.1e}. TransformerLens's time for all {pa['heads']} heads is estimated: its loop timed on "
        f"those {pa['tl_heads_timed']} heads, times {pa['heads']}/{pa['tl_heads_timed']}, plus its clean run once. The heads whose clean z moves it most (ours, all 270): {heads}.",
    ]


def _memory(r: dict) -> list[str]:
    me = r["memory"]
    lines = [
        f'`lens.cache(points=("pattern", "z"))` kept {me["ours_modules"]} modules (the first: '
        f"`{me['ours_first_module']}`) and {me['ours_cache_bytes']:,} bytes for {me['asked_bytes']:,} asked; "
        f"an unasked point (q): {me['ours_unasked_point']}. TransformerLens's cache: {me['tl_cache_bytes']:,} bytes.",
        "",
        "| call | peak resident memory growth (MiB) |",
        "| --- | --- |",
    ]
    lines += [f"| {k} | {v:.1f} |" for k, v in me["peak_growth_mib"].items()]
    return lines


def markdown(r: dict) -> str:
    """The record ``r`` as markdown: the whole comparison, or the caching part alone (``--only cache``)."""
    if set(r) == {"meta", "cache"}:
        return cache_markdown(r)
    m = r["meta"]
    head = [
        "# `multihead.lens` vs TransformerLens 4.3 on a real causal LM (CPU)",
        "",
        f"{m['when']}, {m['cpu_words']}; {m['machine']}; torch {m['torch']}, transformers {m['transformers']}, "
        f"transformer_lens {m['transformer_lens']}. Model: {m['model']}; text: {m['text']}. Times are the "
        "process's CPU seconds per call (one thread), median [IQR] over interleaved rounds in balanced orders; "
        "ratios are per round (multihead / peer). Written by `benchmarks/bench_lens.py` "
        "(TransformerLens's side and its hook names: `benchmarks/lens_peer.py`).",
        "",
        "## Targets",
        "",
    ]
    mapping = ["| multihead point | TransformerLens hook |", "| --- | --- |"]
    mapping += [f"| {p} | `blocks.{{l}}.{h}` |" for p, h in lens_peer.HOOKS.items()]
    parts = [
        head + _targets(r) + _notes(r),
        ["## Equality on real text (" + str(r["equality"]["tokens"]) + " tokens, every layer)", ""]
        + _equality(r),
        ["## Patching effects", ""] + _patching(r),
        ["## Memory", ""] + _memory(r),
        ["## Hooks compared", ""] + mapping,
    ]
    return "\n\n".join("\n".join(p) for p in parts) + "\n"


def cache_markdown(r: dict) -> str:
    """The markdown of a record of part 3 alone (``--only cache``)."""
    m, c = r["meta"], r["cache"]
    sec = c["cpu_seconds"]

    def s(k: str) -> str:
        return f"{sec[k]['median']:.3f} [{sec[k]['q1']:.3f}, {sec[k]['q3']:.3f}]"

    def x(d: dict) -> str:
        return f"{d['median']:.3f}x [{d['q1']:.3f}, {d['q3']:.3f}]"

    rows = [
        "# `lens.cache` vs TransformerLens's `run_with_cache` on SmolLM2-135M (CPU, part 3 alone)",
        "",
        f"{m['when']}, {m['cpu_words']}; {m['machine']}; torch {m['torch']}, transformers {m['transformers']}, "
        f"transformer_lens {m['transformer_lens']}. Pattern and z of all 30 layers at {c['tokens']} tokens; "
        f"{len(c['times']['multihead forward']['cpu'])} interleaved rounds in balanced orders, each call timed "
        "in the process's CPU seconds (one torch thread: the machine is shared, waiting for a core does not "
        "count). Written by `benchmarks/bench_lens.py --only cache`.",
        "",
        "| run | CPU seconds per call |",
        "| --- | --- |",
        *(f"| {k} | {s(k)} |" for k in sec),
        "",
        f"`lens.cache` / `run_with_cache`: **{x(c['ratio'])}** (target <= {c['target']}x: "
        f"{'met' if c['met'] else 'not met'}); wall-clock ratio {x(c['wall_ratio'])}; `lens.cache` over our "
        f"plain forward {x(c['over_plain_forward'])}.",
    ]
    return "\n".join(rows) + "\n"


def chart(r: dict, path: Path) -> None:
    """Left: the three time ratios against their targets. Right: each point's largest error against
    TransformerLens in float64, ours and TransformerLens's own float32 run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.2))
    rows = [
        ("forward, no lens open\n(vs never imported)", r["no_lens"]),
        ("cache pattern + z\n(vs run_with_cache)", r["cache"]),
        ("patch 270 heads\n(vs TL's loop)", r["patching"]),
    ]
    for y, (_, rec) in enumerate(rows):
        hi = rec["target"]
        q = rec["ratio"]
        left.barh(y, q["median"], color="tab:blue" if rec["met"] else "tab:red")
        left.errorbar(
            q["median"], y, xerr=[[q["median"] - q["q1"]], [q["q3"] - q["median"]]], color="k", capsize=3
        )
        left.plot([hi, hi], [y - 0.4, y + 0.4], color="k", ls="--")
        left.text(q["median"] + 0.02, y, f"{q['median']:.3f}x", va="center")
    left.set_yticks(range(len(rows)), [row[0] for row in rows])
    left.set_xlabel("multihead time / the peer's (CPU s, per round); dashed: target")
    left.invert_yaxis()
    pts = r["equality"]["points"]
    xs = range(len(pts))
    right.bar([x - 0.2 for x in xs], [p["ours_vs_float64"] for p in pts], 0.4, label="multihead (float32)")
    right.bar(
        [x + 0.2 for x in xs], [p["tl_vs_float64"] for p in pts], 0.4, label="TransformerLens (float32)"
    )
    right.set_yscale("log")
    right.set_xticks(list(xs), [p["point"] for p in pts])
    right.set_ylabel("max |error| vs TransformerLens in float64")
    right.legend()
    fig.suptitle(
        f"multihead.lens vs TransformerLens {r['meta']['transformer_lens']}, SmolLM2-135M, {r['meta']['cpu']}"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
