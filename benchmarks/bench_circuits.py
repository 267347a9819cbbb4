"""``multihead.lens``'s circuits (gradients, attribution patching, edge attribution, faithfulness) against
TransformerLens 4.3's ``attribution_patching`` on the same checkpoints, on the CPU, one thread.

Models: SmolLM2-135M-Instruct (Llama, 30 layers x 9 heads, 3 key/value heads: GQA) and a random non-GQA Llama
(4 layers x 8 heads, ``circuits_peer.RANDOM_LLAMA``) saved with ``save_pretrained``; both tools load the same
folder (ours on ``attn_implementation="multihead"``, TransformerLens through ``boot_transformers``). Data: 8
IOI-style pairs (``circuits_peer.ioi_pairs``), metric the right name's logit minus the wrong one's at the last
position, per pair.

1. Equal, within float32 error (the 2x rule: each float32 result's error against TransformerLens in float64 is at
   most twice TransformerLens's own float32 error; ours in float64 against it shows the two compute the same
   thing): pattern and z gradients and node attribution per head and position on SmolLM2; edge attribution and
   the row-sum identity, and faithfulness of the same edges, on the random Llama.
2. Where TransformerLens refuses (GQA edges on SmolLM2; ``ig_steps > 1`` anywhere): its messages, and our reader
   columns on SmolLM2 against finite differences of the metric with that reader alone fed the clean - corrupted
   residual (``circuits_fd``, float64 with exact norms).
3. Speed, process CPU seconds, contenders interleaved in balanced orders: node attribution per head and position
   on the 8 pairs of SmolLM2 (target <= 0.33x TransformerLens), edges on the random Llama (<= 0.1x), integrated
   gradients with ig_steps=5 against 5 plain runs (a forward and a backward of the corrupted batch, the
   parameters frozen).
4. Scale, SmolLM2 on 1,000 tokens of real text, each task in a fresh process (peak resident set from
   ``ru_maxrss``): node attribution per head and position (<= 30 s), edges (<= 90 s), each <= 4 GiB.

::

    flock /tmp/bench.lock python benchmarks/bench_circuits.py      # writes results/circuits_cpu.{json,md,png}
    python benchmarks/bench_circuits.py --quick                      # 1 round, fewer pairs, nothing written
    # on a loaded machine, the parts side by side, then one record (how the committed one was made):
    python benchmarks/bench_circuits.py --parts speed_node --partial /tmp/speed_node.json   # and so on
    python benchmarks/bench_circuits.py --merge /tmp/*.json
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
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import circuits_fd  # noqa: E402
import circuits_peer as peer  # noqa: E402
from bench_lens import _timed, rounds  # noqa: E402  (the same timing rounds as the lens benchmark)
from circuits_report import chart, markdown, meta  # noqa: E402

from multihead import lens  # noqa: E402
from multihead.bench.stats import spread  # noqa: E402
from multihead.testing import smollm2_dir  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
PARTIAL = Path("/tmp/bench_circuits_partial.json")
TARGETS = {"node": 0.33, "edges": 0.1, "ig": 1.0, "scale_node_s": 30.0, "scale_edges_s": 90.0, "rss_gib": 4.0}
ERROR_RULE = 2.0
SCALE_TOKENS, IG_STEPS, FAITH_EDGES, STOP_GIB = 1000, 5, 20, 8.0
EQUAL_PAIRS = 4  # the equality checks run each tool in float32 and float64: 4 of the 8 pairs


def ours_model(folder: str, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """The checkpoint on multihead's attention, in eval mode."""
    import transformers as T

    from multihead.integrations import transformers as mhtf

    mhtf.register()
    return T.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="multihead", dtype=dtype).eval()


def inputs(data: peer.IOI) -> tuple[dict, dict, Callable]:
    """(clean, corrupted, metric) as multihead's calls take them: keyword inputs and metric(output) -> (B,)."""
    return {"input_ids": data.clean}, {"input_ids": data.corrupted}, lambda out: data.logit_diff(out.logits)


def corrupted_mean(model: torch.nn.Module, data: peer.IOI) -> float:
    """The metric's batch mean on the corrupted run."""
    with torch.no_grad():
        return float(data.logit_diff(model(data.corrupted).logits).mean())


def _gap(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max())


def _row(what: str, ours: torch.Tensor, tl: torch.Tensor, exact: torch.Tensor, ours64: torch.Tensor) -> dict:
    """One equality row: each float32 result's error against TransformerLens in float64 (2x rule)."""
    ours_err, tl_err = _gap(ours, exact), _gap(tl, exact)
    return {
        "what": what,
        "shape": list(ours.shape),
        "ours_vs_float64": ours_err,
        "tl_vs_float64": tl_err,
        "ours_vs_tl": _gap(ours, tl),
        "ours64_vs_tl64": _gap(ours64, exact),
        "largest": float(exact.abs().max()),
        "met": ours_err <= ERROR_RULE * tl_err,
    }


def ours_gradients(model: torch.nn.Module, data: peer.IOI, points: tuple[str, ...]) -> dict:
    """{(layer, point): gradient} of the per-pair metric summed over the batch, through ``lens.cache``."""
    with lens.cache(model, points=points, grads=True) as c:
        data.logit_diff(model(data.corrupted).logits).sum().backward()
    model.zero_grad(set_to_none=True)
    names = [f"model.layers.{i}.self_attn" for i in range(model.config.num_hidden_layers)]
    return {(i, p): c.grad(name, p) for i, name in enumerate(names) for p in points}


def stacked(grads: dict, point: str) -> torch.Tensor:
    """(layers, ...) of one point's gradients."""
    return torch.stack([g for (_, p), g in sorted(grads.items()) if p == point])


def equal_smollm2(models: dict, data: peer.IOI) -> list[dict]:
    """Pattern and z gradients and node attribution per head and position: ours and TransformerLens, each
    tool in float32 and float64 (``models``: {"ours", "ours64", "tl", "tl64"})."""
    points = ("pattern", "z")
    grads = {
        "ours": ours_gradients(models["ours"], data, points),
        "ours64": ours_gradients(models["ours64"], data, points),
        "tl": peer.gradients(models["tl"], data.corrupted, data.logit_diff, points),
        "tl64": peer.gradients(models["tl64"], data.corrupted, data.logit_diff, points),
    }
    rows = [
        _row(f"gradient at {p}", *(stacked(grads[k], p) for k in ("ours", "tl", "tl64", "ours64")))
        for p in points
    ]
    node = {}
    for k in ("ours", "ours64"):
        est = lens.attribution_patch(models[k], *inputs(data), per_position=True)
        node[k] = est.double() - corrupted_mean(models[k], data)
    for k in ("tl", "tl64"):
        node[k] = peer.node_scores(models[k], data)
    rows.append(
        _row("node attribution per head and position", *(node[k] for k in ("ours", "tl", "tl64", "ours64")))
    )
    return rows


def graph_dense(graph: lens.Graph, table: dict) -> tuple[torch.Tensor, list]:
    """TransformerLens's {(writer, reader): score} laid out as ``graph.scores`` (W, R), and the keys it has
    that the graph does not."""
    w, r = {n: i for i, n in enumerate(graph.writers)}, {n: j for j, n in enumerate(graph.readers)}
    out, missing = torch.zeros(len(w), len(r), dtype=torch.float64), []
    for (writer, reader), score in table.items():
        if writer in w and reader in r:
            out[w[writer], r[reader]] = score
        else:
            missing.append((str(writer), str(reader)))
    return out, missing


def row_sum_identity(model: torch.nn.Module, graph: lens.Graph, data: peer.IOI) -> float:
    """max |a head's row sum - its node effect (attribution_patch(point="z") - metric(corrupted))|."""
    effects = lens.attribution_patch(model, *inputs(data)).double() - corrupted_mean(model, data)  # (N, H)
    rows = graph.node_effects().double()
    gap = 0.0
    for i, node in enumerate(graph.writers):
        if node.kind == "head":
            layer = int(node.name.split(".")[2])
            gap = max(gap, abs(float(rows[i]) - float(effects[layer, node.head])))
    return gap


def equal_random_llama(models: dict, data: peer.IOI, pairs: int) -> dict:
    """Edge attribution and faithfulness on the random non-GQA Llama, ours against TransformerLens."""
    graphs = {k: lens.edge_attribution(models[k], *inputs(data)) for k in ("ours", "ours64")}
    tables = {k: peer.edge_scores(models[k], data) for k in ("tl", "tl64")}
    dense = {k: graph_dense(graphs["ours"], t) for k, t in tables.items()}
    ours_sc, ours64_sc = (graphs[k].scores.double() for k in ("ours", "ours64"))
    rows = [_row("edge attribution (W, R)", ours_sc, dense["tl"][0], dense["tl64"][0], ours64_sc)]
    kept = [(w, r) for w, r, _ in graphs["ours64"].top(FAITH_EDGES)]
    faith: dict[str, list[float]] = {k: [] for k in models}
    for i in range(pairs):
        one = data.pair(i)
        for k in ("ours", "ours64"):
            faith[k].append(float(lens.faithfulness(models[k], kept, *inputs(one))))
    for k in ("tl", "tl64"):
        faith[k] = peer.faithfulness(models[k], data.first(pairs), kept)
    per_pair = (torch.tensor(faith[k], dtype=torch.float64) for k in ("ours", "tl", "tl64", "ours64"))
    rows.append(_row(f"faithfulness of the top {FAITH_EDGES} edges, per pair", *per_pair))
    return {
        "rows": rows,
        "edges": len(graphs["ours"]),
        "tl_edges_outside_our_graph": dense["tl"][1][:5],
        "row_sum_identity": row_sum_identity(models["ours"], graphs["ours"], data),
        "row_sum_largest": float(graphs["ours"].node_effects().abs().max()),
        "faithfulness": faith,
        "kept": [(str(w), str(r)) for w, r in kept],
    }


def reader_columns(model64: torch.nn.Module, data: peer.IOI) -> dict:
    """Our reader columns on SmolLM2 (GQA) against finite differences: for the reader of each kind with the
    largest column, the column's sum (every upstream writer's edge into it) against d metric / d eps with that
    reader alone fed corrupted + eps (clean - corrupted) residual (float64, exact norms)."""
    clean, corrupted, metric = inputs(data)
    graph = lens.edge_attribution(model64, clean, corrupted, metric)
    columns = graph.scores.double().sum(0)  # (R,)
    rows = []
    for kind in ("q", "k", "v", "mlp", "logits"):
        j = max(
            (j for j, r in enumerate(graph.readers) if r.kind == kind), key=lambda j: abs(float(columns[j]))
        )
        reader = graph.readers[j]
        fd = circuits_fd.column_by_differences(model64, clean, corrupted, metric, reader)
        rows.append(
            {
                "reader": str(reader),
                "column_sum": float(columns[j]),
                "finite_difference": fd,
                "relative_gap": abs(float(columns[j]) - fd) / max(abs(fd), 1e-12),
            }
        )
    return {"rows": rows, "met": all(r["relative_gap"] <= 1e-4 for r in rows), "readers": len(graph.readers)}


def _ratio(times: dict, num: str, den: str, scale: float = 1.0) -> dict:
    pairs = zip(times[num]["cpu"], times[den]["cpu"], strict=True)
    return spread([a / (b * scale) for a, b in pairs])._asdict()


def plain_run(model: torch.nn.Module, data: peer.IOI) -> Callable[[], object]:
    """A forward and a backward of the corrupted batch, the parameters frozen (the backward reaches the input
    embeddings): the least one gradient step costs."""
    params = [p for p in model.parameters() if p.requires_grad]

    def run() -> object:
        for p in params:
            p.requires_grad_(False)
        try:
            e = model.get_input_embeddings()(data.corrupted).detach().requires_grad_()
            return torch.autograd.grad(data.logit_diff(model(inputs_embeds=e).logits).mean(), e)
        finally:
            for p in params:
                p.requires_grad_(True)

    return run


def speed_node(model: torch.nn.Module, bridge: torch.nn.Module, data: peer.IOI, n: int) -> dict:
    """Node attribution per head and position on SmolLM2: ours (the batch at once) against TransformerLens's
    loop; ours with ``ig_steps=5``; a plain run (:func:`plain_run`)."""
    clean, corrupted, metric = inputs(data)
    last = ({**clean, "logits_to_keep": 1}, {**corrupted, "logits_to_keep": 1})
    steps = {
        "multihead attribution_patch": lambda: lens.attribution_patch(
            model, clean, corrupted, metric, per_position=True
        ),
        "multihead attribution_patch, logits_to_keep=1": lambda: lens.attribution_patch(
            model, *last, metric, per_position=True
        ),
        f"multihead attribution_patch, ig_steps={IG_STEPS}": lambda: lens.attribution_patch(
            model, clean, corrupted, metric, per_position=True, ig_steps=IG_STEPS
        ),
        "plain forward + backward": plain_run(model, data),
        "TransformerLens attribution_patch (node)": lambda: peer.node_scores(bridge, data),
    }
    times = rounds(steps, n, "node speed", grad=True)
    labels = list(steps)
    ratio = _ratio(times, labels[0], labels[4])
    ig = _ratio(times, labels[2], labels[3], IG_STEPS)
    return {
        "pairs": len(data),
        "tokens": data.clean.shape[1],
        "times": times,
        "cpu_seconds": {k: spread(t["cpu"])._asdict() for k, t in times.items()},
        "ratio": ratio,
        "ratio_logits_to_keep_1": _ratio(times, labels[1], labels[4]),
        "target": TARGETS["node"],
        "met": ratio["median"] <= TARGETS["node"],
        "plain_runs": _ratio(times, labels[0], labels[3]),
        "ig_over_steps_plain_runs": ig,
        "ig_over_steps_ig1": _ratio(times, labels[2], labels[0], IG_STEPS),
        "ig_met": ig["median"] <= TARGETS["ig"],
    }


def speed_edges(
    model: torch.nn.Module, bridge: torch.nn.Module, big: torch.nn.Module, data: peer.IOI, n: int
) -> dict:
    """Edges on the random Llama: ours against TransformerLens's loop; on SmolLM2 (``big``), ours with
    ``ig_steps=5`` against 5 plain runs."""
    clean, corrupted, metric = inputs(data)
    steps = {
        "multihead edge_attribution": lambda: lens.edge_attribution(model, clean, corrupted, metric),
        "TransformerLens attribution_patch (edge)": lambda: peer.edge_scores(bridge, data),
    }
    times = rounds(steps, n, "edge speed", grad=True)
    ratio = _ratio(times, *steps)
    ig_steps = {
        "SmolLM2 edge_attribution": lambda: lens.edge_attribution(big, clean, corrupted, metric),
        f"SmolLM2 edge_attribution, ig_steps={IG_STEPS}": lambda: lens.edge_attribution(
            big, clean, corrupted, metric, ig_steps=IG_STEPS
        ),
        "SmolLM2 plain forward + backward": plain_run(big, data),
    }
    ig_times = rounds(
        ig_steps, max(1, n // 3), "edge ig speed", warm=False, grad=True
    )  # tens of seconds a call
    labels = list(ig_steps)
    ig = _ratio(ig_times, labels[1], labels[2], IG_STEPS)
    return {
        "times": times,
        "cpu_seconds": {k: spread(t["cpu"])._asdict() for k, t in (times | ig_times).items()},
        "ratio": ratio,
        "target": TARGETS["edges"],
        "met": ratio["median"] <= TARGETS["edges"],
        "ig_times": ig_times,
        "smollm2_plain_runs": _ratio(ig_times, labels[0], labels[2]),
        "ig_over_steps_plain_runs": ig,
        "ig_over_steps_ig1": _ratio(ig_times, labels[1], labels[0], IG_STEPS),
        "ig_met": ig["median"] <= TARGETS["ig"],
    }


def scale_inputs(tokenizer: object) -> tuple[dict, dict, Callable]:
    """1,000 tokens of real text (``circuits_peer.real_text``); corrupted: every 10th token replaced by a random
    one; metric: the mean log-probability of the clean text's next tokens over every position, per example."""
    ids = peer.real_text(tokenizer, SCALE_TOKENS)
    bad = ids.clone()
    g = torch.Generator().manual_seed(0)
    bad[:, 1::10] = torch.randint(1000, 40000, bad[:, 1::10].shape, generator=g)

    def metric(out: object) -> torch.Tensor:
        logp = out.logits[:, :-1].log_softmax(-1)  # (B, L - 1, V)
        return logp.gather(-1, ids[:, 1:, None])[..., 0].mean(-1)

    return {"input_ids": ids}, {"input_ids": bad}, metric


def _watchdog(limit_gib: float, limit_cpu: float, seen: dict) -> None:
    """Sample the resident set every 0.1 s; past ``limit_gib`` or ``limit_cpu`` CPU seconds, print the record so
    far and end the process (the machine is shared: a run must not take its memory)."""
    import threading

    def watch() -> None:
        while True:
            rss = int(Path("/proc/self/statm").read_text().split()[1]) * resource.getpagesize() / 2**30
            seen["peak_rss_gib"] = max(seen.get("peak_rss_gib", 0.0), rss)
            cpu = time.process_time() - seen["cpu0"]
            if rss > limit_gib or cpu > limit_cpu:
                why = (
                    f"stopped at {rss:.1f} GiB resident" if rss > limit_gib else f"stopped at {cpu:.0f} CPU s"
                )
                print(json.dumps(seen | {"cpu": cpu, "aborted": why}), flush=True)
                os._exit(3)
            time.sleep(0.1)

    threading.Thread(target=watch, daemon=True).start()


def scale_worker(task: str) -> int:
    """One scale task in this (fresh) process: prints {"cpu", "wall", "rss_before_gib", "peak_rss_gib"} (peak:
    ``ru_maxrss``, and the sampled peak), or where it was stopped (over 3x its time target or 8 GiB)."""
    import transformers as T

    torch.set_num_threads(1)
    folder = str(smollm2_dir())
    model = ours_model(folder)
    clean, corrupted, metric = scale_inputs(T.AutoTokenizer.from_pretrained(folder))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB -> GiB
    seen = {"rss_before_gib": before, "cpu0": time.process_time()}
    _watchdog(STOP_GIB, 3 * TARGETS[f"scale_{task}_s"], seen)
    if task == "node":
        cpu, wall = _timed(
            lambda: lens.attribution_patch(model, clean, corrupted, metric, per_position=True), True
        )
    else:
        cpu, wall = _timed(
            lambda: lens.edge_attribution(model, clean, corrupted, metric, progress=True), True
        )
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print(json.dumps({"cpu": cpu, "wall": wall, "rss_before_gib": before, "peak_rss_gib": peak}), flush=True)
    return 0


def scale() -> dict:
    """Each scale task in a fresh process, one thread."""
    out = {"tokens": SCALE_TOKENS}
    for task, target in (("node", TARGETS["scale_node_s"]), ("edges", TARGETS["scale_edges_s"])):
        done = subprocess.run(
            [sys.executable, __file__, "--scale-worker", task], capture_output=True, text=True, check=False
        )
        lines = [x for x in done.stdout.splitlines() if x.startswith("{")]
        if not lines:
            out[task] = {"error": done.stderr[-2000:], "met": False}
            continue
        r = json.loads(lines[-1])
        r.pop("cpu0", None)
        r["target_s"], r["target_gib"] = target, TARGETS["rss_gib"]
        r["met"] = "aborted" not in r and r["cpu"] <= target and r["peak_rss_gib"] <= TARGETS["rss_gib"]
        out[task] = r
        print(f"scale {task}: {r}", flush=True)
    return out


class Lazy(dict):
    """Models made on first use (a part run alone loads only what it needs)."""

    def __init__(self, makers: dict[str, Callable[[], torch.nn.Module]]) -> None:
        super().__init__()
        self.makers = makers

    def __missing__(self, key: str) -> torch.nn.Module:
        self[key] = made = self.makers[key]()
        return made


def load(folder: str, random_folder: str) -> dict[str, Lazy]:
    """Every model the run uses: ours and TransformerLens's, float32 and float64, on both checkpoints; and ours
    in float64 with exact norms (for finite differences)."""

    def four(where: str) -> Lazy:
        return Lazy(
            {
                "ours": lambda: ours_model(where),
                "ours64": lambda: ours_model(where, torch.float64),
                "tl": lambda: peer.boot(where),
                "tl64": lambda: peer.boot(where, torch.float64),
                "exact64": lambda: circuits_fd.exact_norms(ours_model(where, torch.float64)),
            }
        )

    return {"smollm2": four(folder), "random": four(random_folder)}


PARTS = ("equal_smollm2", "equal_random_llama", "gqa", "speed_node", "speed_edges", "scale")


def measure(quick: bool, n: int, parts: tuple[str, ...], partial: Path) -> dict:
    """The ``parts`` asked, in order, the record kept in ``partial`` as it grows (the parts it already holds are
    kept, not measured again)."""
    import transformers as T

    torch.set_num_threads(1)
    folder = str(smollm2_dir())
    data = peer.ioi_pairs(T.AutoTokenizer.from_pretrained(folder))
    work = Path(tempfile.mkdtemp(prefix="circuits_random_llama_"))
    models = load(folder, str(peer.save_random_llama(work, folder)))
    smol, rand = models["smollm2"], models["random"]
    r: dict = json.loads(partial.read_text()) if partial.exists() else {}
    r["meta"] = meta()
    steps: dict[str, Callable[[], object]] = {
        "equal_smollm2": lambda: equal_smollm2(smol, data.first(EQUAL_PAIRS)),
        "equal_random_llama": lambda: equal_random_llama(rand, data, 1 if quick else len(data)),
        "gqa": lambda: {
            "tl_edges_smollm2": peer.refusal(smol["tl"], data),
            "tl_ig_steps": peer.ig_refusal(),
            "reader_columns": reader_columns(smol["exact64"], data.first(EQUAL_PAIRS)),
        },
        "speed_node": lambda: speed_node(smol["ours"], smol["tl"], data, n),
        "speed_edges": lambda: speed_edges(rand["ours"], rand["tl"], smol["ours"], data, n),
        "scale": scale,
    }
    for key in parts:
        if key in r:
            continue
        r[key] = steps[key]()
        partial.write_text(json.dumps(r, indent=1, default=str))
    r["meta"] = meta()  # the load average at the end
    partial.write_text(json.dumps(r, indent=1, default=str))
    return r


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--quick", action="store_true", help="1 round, 1 pair's faithfulness, nothing written"
    )
    parser.add_argument("--rounds", type=int, default=2, help="rounds of the speed comparisons")
    parser.add_argument(
        "--report", metavar="JSON", help="write the markdown and chart of a record, measure nothing"
    )
    parser.add_argument("--parts", default=",".join(PARTS), help=f"which parts, comma-separated: {PARTS}")
    parser.add_argument(
        "--partial", default=str(PARTIAL), help="the record as it grows (parts it holds are kept)"
    )
    parser.add_argument(
        "--merge", nargs="+", metavar="JSON", help="merge partial records and write the results"
    )
    parser.add_argument("--scale-worker", choices=("node", "edges"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.scale_worker:
        return scale_worker(args.scale_worker)
    if args.report:
        return write(json.loads(Path(args.report).read_text()), Path(args.report).parent)
    if args.merge:
        return write(merged(args.merge), RESULTS)
    parts = tuple(args.parts.split(","))
    r = measure(args.quick, 1 if args.quick else args.rounds, parts, Path(args.partial))
    if set(parts) != set(PARTS):  # one part of a run side by side: merged later (--merge)
        return 0
    print(markdown(r))
    return 0 if args.quick else write(r, RESULTS)


def merged(paths: list[str]) -> dict:
    """Partial records of parts run side by side (separate processes) as one; ``meta`` keeps each part's
    load average at its end."""
    r: dict = {"meta_by_part": {}}
    for path in paths:
        part = json.loads(Path(path).read_text())
        for key, value in part.items():
            if key != "meta":
                r[key] = value
                r["meta_by_part"][key] = part["meta"]
        r["meta"] = part["meta"]
    return r


def write(r: dict, folder: Path) -> int:
    """``circuits_cpu.{json,md,png}`` of the record ``r`` in ``folder``."""
    folder.mkdir(exist_ok=True)
    (folder / "circuits_cpu.json").write_text(json.dumps(r, indent=1, default=str) + "\n")
    (folder / "circuits_cpu.md").write_text(markdown(r))
    chart(r, folder / "circuits_cpu.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
