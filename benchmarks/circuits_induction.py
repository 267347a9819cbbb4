"""The induction circuit of SmolLM2-135M-Instruct at edge level, found by ``lens.edge_attribution`` and checked by
exact interventions: the worked example of docs/circuits.md.

Data as ``lens_induction.py``: clean ``[bos] r r`` (``SEQ`` random tokens repeated), corrupted ``[bos] r' r`` (the
first half other random tokens, so the second half repeats nothing); metric the mean log-probability of the
second half's next tokens, per example. The lens already found the heads (``results/lens_induction.md``): the
previous-token head L16H0 and the induction heads L17H3-5, L18H6-7. SmolLM2 has 3 key/value heads per layer
(GQA): query heads 3-5 share key/value head 1, heads 6-8 key/value head 2.

1. ``edge_attribution`` with ig_steps 1 and 5 on ``BATCH`` sequences: the top edges, and the edges from the
   previous-token head into the k, q and v readers of the induction heads' layers.
2. Exact checks: each of the top edges and of those previous-token edges patched alone (path patching,
   ``circuits_fd.path_patch``: the corrupted run with that one reader fed the writer's clean output), against
   its score; ``lens.faithfulness`` of the top k edges for growing k (the clean run with every other edge
   carrying the corrupted writer output), and of random edge sets of the same sizes.
3. Attribution against exact ``lens.patch_heads`` (z): per head on ``PATCH_BATCH`` sequences in layers 14-29
   (144 heads: exact patching of the early layers costs the most), and per head and position on one shorter
   sequence (``SHORT``) in layers 16-18, with ig_steps 1 and 5: Pearson correlation of the effects, the sign
   agreement among the heads that matter, and how many of the exact top 10 the estimate ranks in its top 10.

The committed record (2026-12-06) was measured on a 2-core machine under a load average of ~17: its parts ran
side by side in separate processes (``find``, ``against_patching``, the noising of each edge) and were assembled
into one record; its path-patching and faithfulness values come from the main run's printed lines (3 decimals).

One thread::

    flock /tmp/bench.lock python benchmarks/circuits_induction.py
    # writes benchmarks/results/circuits_induction.{json,md} and docs/images/circuits_induction.png
"""

from __future__ import annotations

import json
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import circuits_fd  # noqa: E402
import lens_induction as li  # noqa: E402

from multihead import lens  # noqa: E402
from multihead.bench.pair import machine  # noqa: E402
from multihead.lens import Node  # noqa: E402
from multihead.testing import smollm2_dir  # noqa: E402

ROOT = Path(__file__).resolve().parent
RESULTS, IMAGE = ROOT / "results", ROOT.parent / "docs" / "images" / "circuits_induction.png"
BATCH, PATCH_BATCH, SHORT, TOP, PATCHED = 2, 1, 10, 12, (10, 100, 1000, 3000, 10000, 30000)
PER_HEAD_LAYERS = range(14, 30)  # exact patching per head: the later 16 layers (the circuit's; the cost)
ATTN = "model.layers.{}.self_attn"
PREVIOUS = Node(ATTN.format(16), "head", 0)
INDUCTION_LAYERS = (17, 18)
PER_POSITION_LAYERS = (16, 17, 18)


def data(batch: int, seed: int, bos: int) -> tuple[dict, dict, object]:
    """(clean, corrupted, metric): ``[bos] r r`` and ``[bos] r' r``, the second half's mean log-probability."""
    clean = li.repeated(seed, batch, bos)
    g = torch.Generator().manual_seed(seed + 1)
    other = torch.randint(*li.TOKENS, (batch, li.SEQ), generator=g)
    corrupted = li.repeated(seed, batch, bos, first=other)
    return (
        {"input_ids": clean},
        {"input_ids": corrupted},
        lambda out: li.second_half_logprob(out.logits, clean),
    )


def means(model: torch.nn.Module, clean: dict, corrupted: dict, metric: object) -> tuple[float, float]:
    with torch.no_grad():
        return float(metric(model(**clean)).mean()), float(metric(model(**corrupted)).mean())


def _edge(w: Node, r: Node, score: float) -> dict:
    return {"writer": str(w), "reader": str(r), "score": score}


def find(model: torch.nn.Module, clean: dict, corrupted: dict, metric: object) -> dict:
    """Edge attribution with ig_steps 1 and 5: the top edges and the previous-token head's edges."""
    out: dict = {}
    for steps in (1, 5):
        t0 = time.process_time()
        graph = lens.edge_attribution(model, clean, corrupted, metric, ig_steps=steps, progress=True)
        seconds = time.process_time() - t0
        w = graph.writers.index(PREVIOUS)
        mine = [
            (graph.readers[j], float(graph.scores[w, j]))
            for j in range(len(graph.readers))
            if graph.readers[j].name in {ATTN.format(i) for i in INDUCTION_LAYERS}
        ]
        order = graph.scores.abs().flatten().argsort(descending=True)
        rank = {int(i): k + 1 for k, i in enumerate(order.tolist())}
        cols = len(graph.readers)
        out[steps] = {
            "graph": graph,
            "cpu_seconds": seconds,
            "edges": len(graph),
            "top": [_edge(*e) for e in graph.top(TOP)],
            "previous_token_edges": sorted(
                (_edge(PREVIOUS, r, s) | {"rank": rank[w * cols + graph.readers.index(r)]} for r, s in mine),
                key=lambda e: -abs(e["score"]),
            ),
        }
    return out


def exact_edges(
    model: torch.nn.Module, clean: dict, corrupted: dict, metric: object, graph: lens.Graph
) -> list:
    """Each of the top edges and the previous-token head's top 6 edges patched alone, against its score."""
    w = graph.writers.index(PREVIOUS)
    prev = sorted(range(len(graph.readers)), key=lambda j: -abs(float(graph.scores[w, j])))[:6]
    chosen = graph.top(TOP) + [(PREVIOUS, graph.readers[j], float(graph.scores[w, j])) for j in prev]
    rows, seen = [], set()
    for writer, reader, score in chosen:
        if (writer, reader) in seen:
            continue
        seen.add((writer, reader))
        exact = circuits_fd.path_patch(model, clean, corrupted, metric, writer, reader)
        rows.append(_edge(writer, reader, score) | {"path_patched": exact})
        print(f"path patching {writer} -> {reader}: score {score:+.3f}, exact {exact:+.3f}", flush=True)
    return rows


def parse(node: str) -> Node:
    """A node from its printed form: ``"model.layers.16.self_attn:head0"`` -> Node(name, "head", 0)."""
    name, rest = node.rsplit(":", 1)
    kind = rest.rstrip("0123456789")
    return Node(name, kind, int(rest[len(kind) :]) if rest != kind else None)


def noising(r: dict) -> None:
    """Each edge of ``r["exact_edges"]`` also patched the other way (noising): the clean run with that reader
    alone fed the writer's corrupted output; ``"noised"`` = metric(noised) - metric(clean), what the clean
    behaviour loses without that edge. Denoising one input of an AND (a head that needs both its key and its
    value) restores little; noising it removes much."""
    import transformers as T

    torch.set_num_threads(1)
    folder = str(smollm2_dir())
    bos = T.AutoTokenizer.from_pretrained(folder).bos_token_id
    model = _model(folder)
    clean, corrupted, metric = data(r["meta"]["batch"], 0, bos)
    for e in r["exact_edges"]:
        e["noised"] = circuits_fd.path_patch(
            model, corrupted, clean, metric, parse(e["writer"]), parse(e["reader"])
        )
        print(f"noising {e['writer']} -> {e['reader']}: {e['noised']:+.3f}", flush=True)


def faithfulness_curve(
    model: torch.nn.Module, clean: dict, corrupted: dict, metric: object, graph: lens.Graph
) -> list:
    """The recovered fraction with the top k edges kept, and with k random edges kept, for each k."""
    everything = graph.edges()
    g = torch.Generator().manual_seed(0)
    rows = []
    for k in PATCHED:
        top = lens.faithfulness(model, graph.top(k), clean, corrupted, metric)
        pick = torch.randperm(len(everything), generator=g)[:k].tolist()
        rand = lens.faithfulness(model, [everything[i] for i in pick], clean, corrupted, metric)
        rows.append({"edges": k, "top": top, "random": rand})
        print(f"faithfulness, {k} edges: top {top:.3f}, random {rand:.3f}", flush=True)
    return rows


def _agreement(est: torch.Tensor, exact: torch.Tensor, base: float) -> dict:
    """Of the effects (the patched metric minus ``base``, metric(corrupted)): Pearson correlation, sign agreement
    where |exact effect| > 5% of its largest, top-10 overlap by |effect|."""
    a, b = est.double().flatten() - base, exact.double().flatten() - base
    keep = torch.isfinite(a) & torch.isfinite(b)
    a, b = a[keep], b[keep]
    r = float(torch.corrcoef(torch.stack([a, b]))[0, 1])
    big = b.abs() > 0.05 * b.abs().max()
    top_a, top_b = (
        set(a.abs().argsort(descending=True)[:10].tolist()),
        set(b.abs().argsort(descending=True)[:10].tolist()),
    )
    return {
        "pearson": r,
        "sign_agreement": float((a[big].sign() == b[big].sign()).double().mean()),
        "that_matter": int(big.sum()),
        "top10_overlap": len(top_a & top_b),
    }


def against_patching(model: torch.nn.Module, bos: int) -> dict:
    """Attribution (ig_steps 1 and 5) against exact patch_heads: per head, and per head and position."""
    out: dict = {}
    settings = {
        "per head": dict(
            batch=PATCH_BATCH, per_position=False, modules=[ATTN.format(i) for i in PER_HEAD_LAYERS]
        ),
        "per head and position": dict(
            batch=1, per_position=True, modules=[ATTN.format(i) for i in PER_POSITION_LAYERS]
        ),
    }
    for what, s in settings.items():
        seq = li.SEQ
        if s["per_position"]:
            li.SEQ = SHORT  # a shorter sequence: every head x position is one patched forward
        try:
            clean, corrupted, metric = data(s["batch"], 7, bos)
            t0 = time.process_time()
            exact = lens.patch_heads(
                model, clean, corrupted, metric, per_position=s["per_position"], modules=s["modules"]
            )
            row = {"exact_cpu_seconds": time.process_time() - t0, "tokens": clean["input_ids"].shape[1]}
            base = means(model, clean, corrupted, metric)[1]
            for steps in (1, 5):
                t0 = time.process_time()
                est = lens.attribution_patch(
                    model,
                    clean,
                    corrupted,
                    metric,
                    per_position=s["per_position"],
                    modules=s["modules"],
                    ig_steps=steps,
                )
                row[f"ig_steps={steps}"] = _agreement(est, exact, base) | {
                    "cpu_seconds": time.process_time() - t0
                }
                if not s["per_position"]:
                    out.setdefault("heads", {})[steps] = est.tolist()
            out[what] = row
            if not s["per_position"]:
                out["heads"]["exact"] = exact.tolist()
                out["heads"]["corrupted"] = base
        finally:
            li.SEQ = seq
        print(f"{what}: {row}", flush=True)
    return out


def measure() -> dict:
    """Every part; the graphs themselves are dropped from the record (their top edges are kept)."""
    import transformers as T

    torch.set_num_threads(1)
    t0 = time.perf_counter()
    folder = str(smollm2_dir())
    bos = T.AutoTokenizer.from_pretrained(folder).bos_token_id
    model = _model(folder)
    clean, corrupted, metric = data(BATCH, 0, bos)
    r: dict = {"clean_metric_corrupted_metric": means(model, clean, corrupted, metric)}
    found = find(model, clean, corrupted, metric)
    graph = found[5]["graph"]
    r["found"] = {k: {x: y for x, y in v.items() if x != "graph"} for k, v in found.items()}
    r["exact_edges"] = exact_edges(model, clean, corrupted, metric, graph)
    r["faithfulness"] = faithfulness_curve(model, clean, corrupted, metric, graph)
    r["against_patching"] = against_patching(model, bos)
    m = machine()
    r["meta"] = {
        "when": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": m.words(),
        "cpu": m.cpu,
        "wall_seconds": time.perf_counter() - t0,
        "batch": BATCH,
        "seq": li.SEQ,
    }
    return r


def _model(folder: str) -> torch.nn.Module:
    import transformers as T

    from multihead.integrations import transformers as mhtf

    mhtf.register()
    return T.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="multihead").eval()


def markdown(r: dict) -> str:
    """The record as a page."""
    m, (mc, mr) = r["meta"], r["clean_metric_corrupted_metric"]
    lines = [
        "# The induction circuit of SmolLM2-135M-Instruct at edge level (`benchmarks/circuits_induction.py`)",
        "",
        f"{m['when']}, {m['machine']}, {m['wall_seconds']:.0f} s wall. {m['batch']} sequences of {m['seq']} random "
        f"tokens repeated twice after BOS; corrupted: the first half other random tokens. Metric: mean log-probability "
        f"of the second half, {mc:.2f} clean, {mr:.2f} corrupted.",
        "",
    ]
    for steps, f in r["found"].items():
        lines += [
            f"## Edge attribution, ig_steps={steps} ({f['edges']} edges, {f['cpu_seconds']:.0f} CPU s)",
            "",
            "| top edge | score |",
            "| --- | --- |",
            *(f"| {e['writer']} -> {e['reader']} | {e['score']:+.3f} |" for e in f["top"]),
            "",
            f"The previous-token head {PREVIOUS} into layers {INDUCTION_LAYERS}' readers (rank among all edges):",
            "",
            "| reader | score | rank |",
            "| --- | --- | --- |",
            *(f"| {e['reader']} | {e['score']:+.3f} | {e['rank']} |" for e in f["previous_token_edges"][:8]),
            "",
        ]
    lines += [
        "## Each edge patched alone (path patching) against its score (ig_steps=5)",
        "",
        "Denoising: the corrupted run with that one reader fed the writer's clean output (what the score estimates); "
        "noising: the clean run with that one reader fed the writer's corrupted output (metric change).",
        "",
        "| edge | score | denoising (exact) | noising (exact) |",
        "| --- | --- | --- | --- |",
        *(
            f"| {e['writer']} -> {e['reader']} | {e['score']:+.3f} | {e['path_patched']:+.3f} | "
            + (f"{e['noised']:+.3f} |" if "noised" in e else "- |")
            for e in r["exact_edges"]
        ),
        "",
        "## Faithfulness: the top k edges kept (every other edge carries the corrupted writer output)",
        "",
        "| edges kept | top k by ig_steps=5 score | k random edges |",
        "| --- | --- | --- |",
        *(f"| {x['edges']} | {x['top']:.3f} | {x['random']:.3f} |" for x in r["faithfulness"]),
        "",
        "## Attribution against exact patch_heads (z)",
        "",
        "| granularity | tokens | ig_steps | Pearson r | sign agreement (heads that matter) | top-10 overlap | CPU s (exact) |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for what in ("per head", "per head and position"):
        row = r["against_patching"][what]
        for steps in (1, 5):
            a = row[f"ig_steps={steps}"]
            sign = "n/a" if a["sign_agreement"] is None else f"{a['sign_agreement']:.2f} ({a['that_matter']})"
            top = "n/a" if a["top10_overlap"] is None else f"{a['top10_overlap']}/10"
            lines.append(
                f"| {what} | {row['tokens']} | {steps} | {a['pearson']:.3f} | {sign} | {top} | "
                f"{a['cpu_seconds']:.1f} ({row['exact_cpu_seconds']:.0f}) |"
            )
    return "\n".join(lines) + "\n"


def figure(r: dict, path: Path) -> None:
    """Three panels: attribution against exact patching per head; scores against path patching; faithfulness."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 3, figsize=(13, 4))
    heads = r["against_patching"]["heads"]
    base = heads.get("corrupted", 0.0)  # the patched metrics as effects
    exact = torch.tensor(heads["exact"]).flatten() - base
    for steps, mark in ((1, "x"), (5, "o")):
        est = torch.tensor(heads[str(steps)]).flatten() - base
        a = r["against_patching"]["per head"][f"ig_steps={steps}"]
        ax[0].scatter(
            exact, est, s=12, marker=mark, label=f"ig_steps={steps} (r = {a['pearson']:.2f})", alpha=0.7
        )
    lim = float(exact.abs().max()) * 1.1
    ax[0].plot([-lim, lim], [-lim, lim], "k:", lw=1)
    ax[0].set(xlabel="exact patch_heads effect", ylabel="attribution_patch estimate", title="every head (z)")
    ax[0].legend(fontsize=8)
    e = r["exact_edges"]
    ax[1].scatter([x["path_patched"] for x in e], [x["score"] for x in e], s=14)
    for x in e:
        if x["writer"].startswith(str(PREVIOUS)):
            ax[1].annotate(
                f"L16H0->{x['reader'].split('.')[2]}:{x['reader'].split(':')[1]}",
                (x["path_patched"], x["score"]),
                fontsize=7,
            )
    lim = max(max(abs(x["score"]), abs(x["path_patched"])) for x in e) * 1.1
    ax[1].plot([-lim, lim], [-lim, lim], "k:", lw=1)
    ax[1].set(
        xlabel="exact effect of patching the edge alone", ylabel="edge score (ig_steps=5)", title="edges"
    )
    f = r["faithfulness"]
    ax[2].plot([x["edges"] for x in f], [x["top"] for x in f], "o-", label="top k edges")
    ax[2].plot([x["edges"] for x in f], [x["random"] for x in f], "s--", label="k random edges")
    ax[2].set(xscale="log", xlabel="edges kept", ylabel="recovered fraction", title="faithfulness")
    ax[2].legend(fontsize=8)
    fig.suptitle(f"SmolLM2-135M induction circuit, {r['meta']['cpu']}, 1 thread", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    global BATCH, PATCH_BATCH, SHORT, TOP, PATCHED, PER_POSITION_LAYERS
    quick = "--quick" in sys.argv  # a smoke run: small everything, nothing written
    if quick:
        BATCH, PATCH_BATCH, SHORT, TOP, PATCHED, PER_POSITION_LAYERS = 1, 1, 3, 2, (10,), (17,)
    if "--noising" in sys.argv:  # add the noising direction to the committed record's edges
        r = json.loads((RESULTS / "circuits_induction.json").read_text())
        noising(r)
        (RESULTS / "circuits_induction.json").write_text(json.dumps(r, indent=1) + "\n")
        sys.argv.append("--report")
    if "--report" in sys.argv:  # draw the committed record again, measure nothing
        r = json.loads((RESULTS / "circuits_induction.json").read_text())
        (RESULTS / "circuits_induction.md").write_text(markdown(r))
        figure(r, IMAGE)
        return 0
    r = json.loads(json.dumps(measure()))  # the record as it is written (keys as strings)
    if quick:
        print(markdown(r))
        figure(r, Path("/tmp/circuits_induction_quick.png"))
        return 0
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "circuits_induction.json").write_text(json.dumps(r, indent=1) + "\n")
    (RESULTS / "circuits_induction.md").write_text(markdown(r))
    figure(r, IMAGE)
    print(markdown(r))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
