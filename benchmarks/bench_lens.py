"""``multihead.lens`` against TransformerLens 4.3 on a real causal LM (SmolLM2-135M-Instruct: 30 layers x 9
heads, 3 key/value heads), on the CPU, one thread.

Ours: the checkpoint on ``attn_implementation="multihead"``, looked into through the ``lens`` contract of
DESIGN.md only (``lens.cache``, ``lens.hooks``, ``lens.ablate``, ``lens.patch_heads``). The peer:
``TransformerBridge.boot_transformers(folder)`` over the same folder (``benchmarks/lens_peer.py`` maps its
hooks to our points). Both run under ``torch.no_grad()`` (TransformerLens records autograd graphs
otherwise, which would only slow it down).

1. Equality, on real text (the first 128 tokens of Python's ``argparse`` docstring): every layer's q and k
   after rotary, v, scores, pattern, z and result, against TransformerLens's hooks. Both are measured
   against TransformerLens in float64; ours passes where its error is at most 2x TransformerLens's own
   float32 error (the project's rule for a fast path against the reference). The same logits after the
   same edit made through each tool's hooks (a head's z zeroed; a head's q zeroed), and the same
   patching effects as TransformerLens's own loop, head by head.
2. No lens open: our forward (256 tokens) in a process that imported and used ``multihead.lens`` and
   closed it, against a fresh process that never imported it; the two processes take turns (balanced
   orders), each timing its own CPU seconds. Target: within 3%.
3. Caching pattern and z of every layer at 256 tokens: ``lens.cache`` against ``run_with_cache`` with
   the same names filter, interleaved with both plain forwards. Target: <= 0.97x.
4. Patching every one of the 270 heads' z for the IOI-style prompt pair of ``lens_peer`` (14 tokens,
   the logit difference per example): ``lens.patch_heads`` against TransformerLens's own
   ``patching.get_act_patch_attn_head_out_all_pos``, one forward per head. Its loop is timed on 30 heads
   (one per layer) and scaled by 9; its clean run is timed apart and counted once. Target: <= 0.25x.
5. Memory: the bytes a cache holds against the bytes of what was asked, and peak resident memory growth.

Times are the process's CPU seconds (one thread: waiting for the core does not count), medians and
interquartile ranges of per-round values::

    flock /tmp/bench.lock python benchmarks/bench_lens.py          # writes results/lens_cpu.{json,md,png}
    python benchmarks/bench_lens.py --quick                          # 2 rounds, nothing written
    python benchmarks/bench_lens.py --only cache --name lens_cpu_zen1  # part 3 alone: lens_cpu_zen1.{json,md}
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import lens_peer  # noqa: E402  (TransformerLens's side)
from lens_report import chart, markdown  # noqa: E402

from multihead.bench.contenders import Step  # noqa: E402
from multihead.bench.measure import balanced_orders, peak_memory, track_cpu_memory  # noqa: E402
from multihead.bench.pair import cpu_words, machine  # noqa: E402
from multihead.bench.stats import spread  # noqa: E402
from multihead.testing import smollm2_dir  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
PARTIAL = Path("/tmp/bench_lens_partial.json")
POINTS = ("q", "k", "v", "scores", "pattern", "z", "result")
EQUAL_TOKENS, CACHE_TOKENS = 128, 256
REPLICAS = 2  # processes of each kind in the no-lens comparison
CACHED = ("pattern", "z")  # what the caching task keeps
EDITS = ((3, 4, "z"), (17, 0, "z"), (25, 8, "q"))  # (layer, head, point zeroed)
TL_SWEEP = tuple((layer, layer % 9) for layer in range(30))  # the heads TransformerLens's loop is timed on
TARGETS = {"no_lens": 1.03, "cache": 0.97, "sweep": 0.25, "error": 2.0}
NAME = "model.layers.{}.self_attn"
LAST_ONLY = "multihead lens.patch_heads (270 heads), logits_to_keep=1"


def ours_model(folder: str) -> torch.nn.Module:
    """The checkpoint on multihead's attention, in eval mode."""
    import transformers as T

    from multihead.integrations import transformers as mhtf

    mhtf.register()
    return T.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="multihead").eval()


def ours_points(model: torch.nn.Module, ids: torch.Tensor, names: tuple[str, ...]) -> dict:
    """{(layer, point): tensor} of every layer through ``lens.cache``, and the logits under ``"logits"``."""
    from multihead import lens

    with torch.no_grad(), lens.cache(model, points=names) as c:
        logits = model(ids).logits
    layers = model.config.num_hidden_layers
    out: dict = {(layer, p): c[NAME.format(layer), p] for layer in range(layers) for p in names}
    out["logits"] = logits
    return out


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| over the entries both hold finite (the masked scores are compared apart)."""
    a, b = a.double(), b.double()
    keep = torch.isfinite(a) & (b > -1e30)  # TransformerLens masks with the dtype's min, not -inf
    return float((a - b)[keep].abs().max())


def equality(model: torch.nn.Module, bridge: torch.nn.Module, folder: str, ids: torch.Tensor) -> dict:
    """Every point of every layer: ours and TransformerLens (float32) against TransformerLens in float64."""
    ours = ours_points(model, ids, POINTS)
    peer = lens_peer.points(bridge, ids, POINTS)
    exact = lens_peer.points(lens_peer.boot(folder, torch.float64), ids, POINTS)
    rows, layers = [], range(model.config.num_hidden_layers)
    for p in POINTS + ("logits",):
        keys = ["logits"] if p == "logits" else [(layer, p) for layer in layers]
        ours_err = max(_max_diff(ours[k], exact[k]) for k in keys)
        peer_err = max(_max_diff(peer[k], exact[k]) for k in keys)
        rows.append(
            {
                "point": p,
                "shape": list(ours[keys[0]].shape),
                "ours_vs_float64": ours_err,
                "tl_vs_float64": peer_err,
                "ours_vs_tl": max(_max_diff(ours[k], peer[k]) for k in keys),
                "largest": max(float(exact[k][exact[k] > -1e30].abs().max()) for k in keys),
                "met": ours_err <= TARGETS["error"] * peer_err,
            }
        )
    masked = all(
        torch.equal(torch.isneginf(ours[(layer, "scores")]), exact[(layer, "scores")] < -1e30)
        for layer in layers
    )
    return {"tokens": ids.shape[1], "points": rows, "masked_entries_agree": masked}


def _ours_zeroed(
    model: torch.nn.Module, ids: torch.Tensor, layer: int, head: int, point: str
) -> torch.Tensor:
    """Our logits with ``head`` of ``layer`` zeroed at ``point``: z through ``lens.ablate``, others through
    ``lens.hooks``."""
    from multihead import lens

    def zero(x: torch.Tensor, ctx: object) -> torch.Tensor:  # x: (B, heads, L, D)
        x = x.clone()
        x[:, head] = 0.0
        return x

    name = NAME.format(layer)
    edit = (
        lens.ablate(model, {name: [head]}, how="zero")
        if point == "z"
        else lens.hooks(model, {(name, point): zero})
    )
    with torch.no_grad(), edit:
        return model(ids).logits


def edits(model: torch.nn.Module, bridge: torch.nn.Module, ids: torch.Tensor) -> list[dict]:
    """The same edit through each tool: how far it moves the logits, and how far apart the tools land."""
    with torch.no_grad():
        plain_ours, plain_tl = model(ids).logits, bridge(ids)
    base = _max_diff(plain_ours, plain_tl)
    rows = []
    for layer, head, point in EDITS:
        ours = _ours_zeroed(model, ids, layer, head, point)
        peer = lens_peer.zero_head(bridge, ids, layer, head, point)
        apart = _max_diff(ours, peer)
        rows.append(
            {
                "layer": layer,
                "head": head,
                "point": point,
                "moves_logits_by": _max_diff(peer, plain_tl),
                "ours_vs_tl": apart,
                "unedited_ours_vs_tl": base,
                "met": apart <= 2 * base,
            }
        )
    return rows


def _timed(fn: Callable[[], object], grad: bool = False) -> tuple[float, float]:
    """(CPU seconds of this process, wall seconds) of one call, without autograd unless ``grad``."""
    c0, t0 = time.process_time(), time.perf_counter()
    with torch.set_grad_enabled(grad):
        out = fn()
    del out
    return time.process_time() - c0, time.perf_counter() - t0


def rounds(
    steps: dict[str, Callable[[], object]], n: int, what: str, *, warm: bool = True, grad: bool = False
) -> dict[str, dict[str, list[float]]]:
    """``n`` rounds of every step (after one warm-up call each where ``warm``), in balanced orders (each step
    right after each other equally often), without autograd unless ``grad``: {label: {"cpu": [...], "wall":
    [...]}}. ``bench_circuits.py`` times its gradients with it too."""
    for fn in steps.values() if warm else ():
        _timed(fn, grad)
    labels, orders = list(steps), balanced_orders(len(steps))
    times: dict[str, dict[str, list[float]]] = {k: {"cpu": [], "wall": []} for k in labels}
    for r in range(n):
        for k in (labels[j] for j in orders[r % len(orders)]):
            cpu, wall = _timed(steps[k], grad)
            times[k]["cpu"].append(cpu)
            times[k]["wall"].append(wall)
        print(f"{what}: round {r + 1}/{n}", flush=True)
    return times


def _ratios(num: list[float], den: list[float]) -> dict:
    return spread([a / b for a, b in zip(num, den, strict=True)])._asdict()


def caching(model: torch.nn.Module, bridge: torch.nn.Module, ids: torch.Tensor, n: int) -> dict:
    """``lens.cache`` of pattern and z in every layer against ``run_with_cache`` with the same filter."""
    from multihead import lens

    def ours_cached() -> object:
        with lens.cache(model, points=CACHED) as c:
            model(ids)
        return c

    steps = {
        "multihead forward": lambda: model(ids),
        "multihead lens.cache": ours_cached,
        "TransformerLens forward": lambda: bridge(ids),
        "TransformerLens run_with_cache": lens_peer.cached_run(bridge, ids, CACHED),
    }
    times = rounds(steps, n, "caching")
    ours, peer = times["multihead lens.cache"]["cpu"], times["TransformerLens run_with_cache"]["cpu"]
    ratio = _ratios(ours, peer)
    return {
        "tokens": ids.shape[1],
        "points": list(CACHED),
        "times": times,
        "cpu_seconds": {k: spread(t["cpu"])._asdict() for k, t in times.items()},
        "ratio": ratio,
        "wall_ratio": _ratios(
            times["multihead lens.cache"]["wall"], times["TransformerLens run_with_cache"]["wall"]
        ),
        "over_plain_forward": _ratios(ours, times["multihead forward"]["cpu"]),
        "target": TARGETS["cache"],
        "met": ratio["median"] <= TARGETS["cache"],
    }


def patching(model: torch.nn.Module, bridge: torch.nn.Module, pair: lens_peer.PromptPair, n: int) -> dict:
    """``lens.patch_heads`` over all heads against TransformerLens's loop (timed on :data:`TL_SWEEP`)."""
    from multihead import lens

    clean, corrupted = {"input_ids": pair.clean}, {"input_ids": pair.corrupted}

    def ours(**keep: int) -> torch.Tensor:  # keep: logits_to_keep=1, the last position's logits only
        return torch.as_tensor(
            lens.patch_heads(model, clean | keep, corrupted | keep, lambda out: pair.logit_diff(out.logits))
        )

    tl_clean = lens_peer.clean_z(bridge, pair)
    steps = {
        "multihead lens.patch_heads (270 heads)": ours,
        LAST_ONLY: lambda: ours(logits_to_keep=1),
        "TransformerLens clean run_with_cache": lambda: lens_peer.clean_z(bridge, pair),
        f"TransformerLens loop ({len(TL_SWEEP)} heads)": lambda: lens_peer.patch_loop(
            bridge, pair, tl_clean, TL_SWEEP
        ),
    }
    times = rounds(steps, n, "patching")
    ours_t, last_t, clean_t, loop_t = (t["cpu"] for t in times.values())
    heads = model.config.num_hidden_layers * model.config.num_attention_heads
    estimate = [c + loop * heads / len(TL_SWEEP) for c, loop in zip(clean_t, loop_t, strict=True)]
    ratio = _ratios(ours_t, estimate)
    last = _ratios(last_t, estimate)
    with torch.no_grad():
        effects = ours()
        same = float((ours(logits_to_keep=1) - effects).abs().max())
        peer = lens_peer.patch_loop(bridge, pair, tl_clean, TL_SWEEP)
        baseline = float(pair.logit_diff(model(pair.corrupted).logits)[0])
    mine = effects[[layer for layer, _ in TL_SWEEP], [head for _, head in TL_SWEEP]]
    apart = float((mine - peer).abs().max())
    return {
        "tokens": pair.clean.shape[1],
        "heads": heads,
        "tl_heads_timed": len(TL_SWEEP),
        "times": times,
        "cpu_seconds": {k: spread(t["cpu"])._asdict() for k, t in times.items()},
        "tl_estimate_cpu_seconds": spread(estimate)._asdict(),
        "ratio": ratio,
        "target": TARGETS["sweep"],
        "met": ratio["median"] <= TARGETS["sweep"],
        "ratio_last_logits_only": last,
        "corrupted_logit_diff": baseline,
        "effects": effects.tolist(),
        "compared_heads": [list(h) for h in TL_SWEEP],
        "tl_effects": peer.tolist(),
        "ours_vs_tl": apart,
        "last_logits_only_vs_all": same,
        "largest_change": float((peer - baseline).abs().max()),
    }


def worker(kind: str) -> int:
    """One side of the no-lens comparison, driven over stdin/stdout: "ready", then one "cpu wall" line per
    "go", and at the end whether ``multihead.lens`` was ever imported in this process."""
    torch.set_num_threads(1)
    folder = str(smollm2_dir())
    model = ours_model(folder)
    ids = lens_peer.real_text(tokenizer(folder), CACHE_TOKENS)
    if kind == "lens":  # imported, used once and closed: what "no lens open" means
        from multihead import lens

        with torch.no_grad(), lens.cache(model, points=CACHED):
            model(ids)
    for _ in range(2):
        _timed(lambda: model(ids))
    print("ready", flush=True)
    for line in sys.stdin:
        if line.strip() != "go":
            break
        print(*_timed(lambda: model(ids)), flush=True)
    print(json.dumps({"lens_imported": "multihead.lens" in sys.modules}), flush=True)
    return 0


def no_lens(n: int) -> dict:
    """Our forward in processes that used the lens and in processes that never imported it, taking turns.

    Two processes of each kind (:data:`REPLICAS`): two processes of the same kind differ too (where their
    weights landed in memory moves a forward by a few percent), so the ratio of the kinds' means is set
    against the ratio between two processes of the same kind, the noise floor."""
    workers = [f"{kind} {i}" for kind in ("plain", "lens") for i in range(REPLICAS)]
    procs = {
        w: subprocess.Popen(
            [sys.executable, __file__, "--worker", w.split()[0]],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for w in workers
    }
    for p in procs.values():
        while p.stdout.readline().strip() != "ready":
            pass
    times: dict[str, dict[str, list[float]]] = {w: {"cpu": [], "wall": []} for w in workers}
    orders = balanced_orders(len(workers))
    for r in range(n):
        for w in (workers[j] for j in orders[r % len(orders)]):
            procs[w].stdin.write("go\n")
            procs[w].stdin.flush()
            cpu, wall = map(float, procs[w].stdout.readline().split())
            times[w]["cpu"].append(cpu)
            times[w]["wall"].append(wall)
        print(f"no lens: round {r + 1}/{n}", flush=True)
    imported = {
        w: json.loads(p.communicate("stop\n")[0].strip().splitlines()[-1])["lens_imported"]
        for w, p in procs.items()
    }
    mean = {
        kind: [sum(x) / REPLICAS for x in zip(*(times[f"{kind} {i}"]["cpu"] for i in range(REPLICAS)))]
        for kind in ("plain", "lens")
    }
    ratio = _ratios(mean["lens"], mean["plain"])
    return {
        "tokens": CACHE_TOKENS,
        "replicas": REPLICAS,
        "times": times,
        "cpu_seconds": {w: spread(t["cpu"])._asdict() for w, t in times.items()},
        "lens_imported": imported,
        "ratio": ratio,
        "floor": {
            kind: _ratios(times[f"{kind} 0"]["cpu"], times[f"{kind} 1"]["cpu"]) for kind in ("plain", "lens")
        },
        "target": TARGETS["no_lens"],
        "met": 1 / TARGETS["no_lens"] <= ratio["median"] <= TARGETS["no_lens"] and not imported["plain 0"],
    }


def _storage_bytes(tensors: list[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (a view of something larger counts it all)."""
    seen = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(seen.values())


def memory(model: torch.nn.Module, bridge: torch.nn.Module, ids: torch.Tensor) -> dict:
    """What each cache holds against what was asked, and each call's peak resident memory growth."""
    from multihead import lens

    cfg = model.config
    d = cfg.hidden_size // cfg.num_attention_heads
    b, n = ids.shape
    asked = cfg.num_hidden_layers * b * cfg.num_attention_heads * n * (n + d) * 4  # pattern + z, float32

    def ours_cached() -> object:
        with torch.no_grad(), lens.cache(model, points=CACHED) as c:
            model(ids)
        return c

    c = ours_cached()
    names = list(c.names())
    ours_bytes = _storage_bytes([c[name, p] for name in c.names() for p in CACHED])
    try:
        c[NAME.format(0), "q"]
        other = "returned a tensor"
    except (KeyError, ValueError) as exc:
        other = f"refused: {type(exc).__name__}"
    tl_run = lens_peer.cached_run(bridge, ids, CACHED)
    _, tl_cache = tl_run()
    tl_bytes = _storage_bytes(list(tl_cache.cache_dict.values()))
    del c, tl_cache
    track_cpu_memory()  # from here on freed blocks go back to the OS (changes timings: measured last)
    steps = {
        "multihead forward": lambda: model(ids),
        "multihead lens.cache": ours_cached,
        "TransformerLens forward": lambda: bridge(ids),
        "TransformerLens run_with_cache": tl_run,
    }
    with torch.no_grad():
        peak = {k: peak_memory(Step(fn), torch.device("cpu")) for k, fn in steps.items()}
    return {
        "tokens": n,
        "asked_bytes": asked,
        "ours_cache_bytes": ours_bytes,
        "ours_modules": len(names),
        "ours_first_module": names[0],
        "ours_unasked_point": other,
        "tl_cache_bytes": tl_bytes,
        "peak_growth_mib": peak,
        "met": ours_bytes == asked,
    }


def tokenizer(folder: str) -> object:
    import transformers as T

    return T.AutoTokenizer.from_pretrained(folder)


def environment() -> dict:
    """When, on which machine, with which torch, transformers and TransformerLens, in how many threads (the
    lens and circuits benchmarks' records share it)."""
    import importlib.metadata

    import transformers as T

    m = machine()
    return {
        "when": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "cpu": m.cpu,
        "cpu_words": cpu_words(),
        "machine": m.words(),
        "torch": torch.__version__,
        "transformers": T.__version__,
        "transformer_lens": importlib.metadata.version("transformer-lens"),
        "threads": torch.get_num_threads(),
    }


def meta() -> dict:
    import os

    return {
        **environment(),
        "load_average_end": [round(x, 2) for x in os.getloadavg()],
        "model": "SmolLM2-135M-Instruct (LlamaForCausalLM, 30 layers x 9 heads, 3 key/value heads, float32)",
        "text": "the docstring of Python's argparse module (inspect.getdoc)",
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="2 rounds each, nothing written")
    parser.add_argument("--rounds", type=int, default=11, help="rounds of the caching and no-lens timings")
    parser.add_argument("--sweep-rounds", type=int, default=5, help="rounds of the patching sweep timing")
    parser.add_argument(
        "--report", metavar="JSON", help="write the markdown and chart of a record, measure nothing"
    )
    parser.add_argument(
        "--only", choices=("cache",), help="measure this part alone (its own markdown, no chart)"
    )
    parser.add_argument("--name", default="lens_cpu", help="results/NAME.{json,md,png} (default lens_cpu)")
    parser.add_argument("--worker", choices=("plain", "lens"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args.worker)
    if args.report:
        r = json.loads(Path(args.report).read_text())
        return write(r, Path(args.report).parent, args.name)
    n, n_sweep = (2, 2) if args.quick else (args.rounds, args.sweep_rounds)
    torch.set_num_threads(1)
    folder = str(smollm2_dir())
    tok = tokenizer(folder)
    model, bridge = ours_model(folder), lens_peer.boot(folder)
    if args.only == "cache":
        r = {"meta": meta(), "cache": caching(model, bridge, lens_peer.real_text(tok, CACHE_TOKENS), n)}
        r["meta"] = meta()  # the load average at the end
        print(markdown(r))
        return 0 if args.quick else write(r, RESULTS, args.name)
    pair = lens_peer.prompt_pair(tok)
    short, long = (lens_peer.real_text(tok, n) for n in (EQUAL_TOKENS, CACHE_TOKENS))
    parts: dict[str, Callable[[], object]] = {
        "equality": lambda: equality(model, bridge, folder, short),
        "edits": lambda: edits(model, bridge, short),
        "no_lens": lambda: no_lens(n),
        "cache": lambda: caching(model, bridge, long, n),
        "patching": lambda: patching(model, bridge, pair, n_sweep),
        "memory": lambda: memory(model, bridge, long),
    }
    r: dict = {"meta": meta()}
    for key, part in parts.items():
        r[key] = part()
        PARTIAL.write_text(json.dumps(r, indent=1))  # a crash keeps what was measured
    r["meta"] = meta()  # the load average at the end
    print(markdown(r))
    return 0 if args.quick else write(r, RESULTS, args.name)


def write(r: dict, folder: Path, name: str = "lens_cpu") -> int:
    """``NAME.{json,md,png}`` of the record ``r`` in ``folder`` (a record of the cache part alone: json and
    md)."""
    folder.mkdir(exist_ok=True)
    (folder / f"{name}.json").write_text(json.dumps(r, indent=1) + "\n")
    (folder / f"{name}.md").write_text(markdown(r))
    if set(r) != {"meta", "cache"}:  # the whole comparison: its chart too
        chart(r, folder / f"{name}.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
