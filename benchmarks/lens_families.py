"""The lens on every causal-LM family of transformers that runs on multihead (a survey, not a timing).

Every family of ``MODEL_FOR_CAUSAL_LM_MAPPING`` is built tiny with random weights, as
``tests/test_hf_families.py``'s survey builds it (the same sizes, a left-padded batch of 2 x 7 tokens). A
family that runs on multihead and equals eager (1e-5) is then looked into, and each check is by hand:

* **observer**: the logits with a cache of every point open equal the plain logits;
* **points**: in every attention module, the pattern is zero where the scores are -inf, its rows sum to at
  most 1 (sinks take the rest), it is softmax(scores) where the family has no sinks, and z = pattern @ v
  (each kv head shared by its query heads);
* **result**: the heads' results summed, plus the output projection's bias, equal that projection's output
  (recorded by a forward hook on it);
* **ablation**: zeroing head 0 of the first module (``lens.ablate``) gives the logits of ``heads.masked``;
* **patching**: ``lens.patch_heads`` over the last attention module with a per-example metric (the layers
  before it run once and are repeated, checked against the corrupted run) equals one forward per head;
* **attribution**: ``lens.logit_attribution`` runs (or refuses by name), heads plus rest equal the logit.

    python benchmarks/lens_families.py      # writes benchmarks/results/lens_families.{json,md}
"""

from __future__ import annotations

import copy
import json
import platform
import sys
import warnings
from collections import Counter
from datetime import UTC, datetime
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from test_hf_families import NAME, T, V, tiny_config  # noqa: E402

from multihead import heads, lens  # noqa: E402
from multihead.heads.naming import attention_modules, output_projection  # noqa: E402
from multihead.lens.share import shared_layer  # noqa: E402
from multihead.progress import Progress  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
TOL = 1e-5


def _models(model_type: str) -> tuple[torch.nn.Module, torch.nn.Module] | str:
    """The family's tiny eager model and the same weights on multihead, or why there is none."""
    config = tiny_config(T.CONFIG_MAPPING[model_type])
    config._experts_implementation = "eager"
    with torch.device("meta"):
        big = T.AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="eager")
    if sum(p.numel() for p in big.parameters()) > 3_000_000:
        return "not tiny at the shared sizes"
    torch.manual_seed(0)
    eager = T.AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="eager").eval()
    ours = T.AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation=NAME).eval()
    ours.load_state_dict(eager.state_dict())
    return eager, ours


def _inputs() -> dict[str, torch.Tensor]:
    ids = torch.randint(3, V, (2, 7), generator=torch.Generator().manual_seed(1))
    keep = torch.ones(2, 7, dtype=torch.long)
    keep[0, :2] = 0  # left padding on the first row
    return dict(input_ids=ids, attention_mask=keep)


def _gap(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max()) if a.numel() else 0.0


def check_points(ours: torch.nn.Module, inputs: dict, plain: torch.Tensor) -> dict[str, float]:
    """Observer, pattern and z gaps (the largest over the modules that ran)."""
    with lens.cache(ours, points=("scores", "pattern", "v", "z")) as c:
        logits = ours(**inputs).logits
    gaps = {"observer": _gap(logits, plain), "pattern": 0.0, "z": 0.0}
    for scores, pattern, v, z in (
        call
        for name in c.names()
        for call in zip(*(c.calls(name, p) for p in ("scores", "pattern", "v", "z")))
    ):  # every call (differential attention calls twice a module)
        hidden = torch.isneginf(scores)
        sums = pattern.sum(-1)
        gaps["pattern"] = max(gaps["pattern"], float(pattern[hidden].abs().max()) if hidden.any() else 0.0)
        gaps["pattern"] = max(gaps["pattern"], float((sums - 1).clamp(min=0).max()))
        whole = (sums - 1).abs() < 1e-4  # rows with no sink taking a share: pattern = softmax(scores)
        if whole.any():
            gaps["pattern"] = max(gaps["pattern"], _gap(pattern[whole], scores[whole].softmax(-1)))
        group = pattern.shape[1] // v.shape[1]
        gaps["z"] = max(gaps["z"], _gap(z, pattern @ v.repeat_interleave(group, dim=1)))
    return gaps


def check_result(ours: torch.nn.Module, inputs: dict) -> float | str:
    """The heads' results plus the bias against the output projection's output (the largest gap over the
    modules that ran), or the lens's refusal."""
    seen: dict[str, torch.Tensor] = {}
    hooks = []
    try:
        with lens.cache(ours, points="result") as c:
            for name, module in attention_modules(ours).items():
                layer = output_projection(ours, name, module).module
                hooks.append(layer.register_forward_hook(lambda m, i, o, n=name: seen.__setitem__(n, o)))
            ours(**inputs)
    except (ValueError, TypeError) as e:
        return f"refused: {str(e)[:100]}"
    finally:
        for h in hooks:
            h.remove()
    gap, found = 0.0, attention_modules(ours)
    for name in c.names():
        layer = output_projection(ours, name, found[name]).module
        bias = getattr(layer, "bias", None)
        gap = max(gap, _gap(c[name, "result"].sum(1) + (bias if bias is not None else 0.0), seen[name]))
    return gap


def _ran(ours: torch.nn.Module, inputs: dict) -> list[str]:
    """The attention modules that ran (a causal LM's cross-attention does not)."""
    with lens.cache(ours, points="z") as ran:
        ours(**inputs)
    return ran.names()


def check_ablation(ours: torch.nn.Module, inputs: dict) -> float:
    """Head 0 of the first module zeroed by ``lens.ablate`` against ``heads.masked``."""
    first = _ran(ours, inputs)[0]
    with lens.ablate(ours, {first: [0]}):
        ablated = ours(**inputs).logits
    with heads.masked(ours, {first: [0]}):
        return _gap(ablated, ours(**inputs).logits)


def _target(inputs: dict) -> torch.Tensor:
    return inputs["input_ids"][:, -1]


def check_patching(ours: torch.nn.Module, inputs: dict) -> tuple[float, str]:
    """The last module's heads patched, batched (a per-example metric) against one forward per head; whether
    the layers before it were shared."""
    last = _ran(ours, inputs)[-1:]
    corrupted = dict(inputs, input_ids=inputs["input_ids"].roll(1, dims=1))
    target = _target(inputs)

    def per_example(out):
        return out.logits[:, -1].gather(1, target[:, None])[:, 0]  # (B,)

    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        batched = lens.patch_heads(ours, inputs, corrupted, per_example, modules=last, progress=False)
    fell_back = any("every copy now runs the whole model" in str(w.message) for w in said)
    shared = shared_layer(ours, last[0]) is not None and not fell_back
    single = lens.patch_heads(
        ours, inputs, corrupted, lambda out: per_example(out).mean(), modules=last, progress=False
    )
    return _gap(batched, single), "yes" if shared else "no (full copies)" if fell_back else "no (first layer)"


def check_attribution(ours: torch.nn.Module, inputs: dict) -> float:
    """Heads plus rest against the run's logit of the last token."""
    a = lens.logit_attribution(ours, inputs, _target(inputs))
    return _gap(a.heads.sum((0, 1)) + a.rest, a.logit)


def _or_refusal(check, *args):
    """The check's value, or the lens's refusal by name (a ValueError or TypeError) as a string."""
    try:
        return check(*args)
    except (ValueError, TypeError) as e:
        return f"refused: {str(e)[:100]}"


def check_edits(ours: torch.nn.Module, inputs: dict) -> dict[str, float | str]:
    """Ablation, patching and attribution, each a gap or a refusal."""
    patching = _or_refusal(check_patching, ours, inputs)
    return {
        "ablation": _or_refusal(check_ablation, ours, inputs),
        "patching": patching[0] if isinstance(patching, tuple) else patching,
        "prefix shared": patching[1] if isinstance(patching, tuple) else "-",
        "attribution": _or_refusal(check_attribution, ours, inputs),
    }


def survey_one(model_type: str) -> dict:
    """One family's record: why it was not looked into, or every check's gap."""
    try:
        made = _models(model_type)
    except Exception as e:  # noqa: BLE001 - the survey records it
        return {"outcome": "no tiny model", "note": f"{type(e).__name__}: {str(e)[:80]}"}
    if isinstance(made, str):
        return {"outcome": "no tiny model", "note": made}
    eager, ours = made
    inputs = _inputs()
    try:
        with torch.no_grad():
            want, plain = eager(**inputs).logits, ours(**inputs).logits
    except Exception as e:  # noqa: BLE001
        return {"outcome": "does not run on multihead", "note": f"{type(e).__name__}: {str(e)[:80]}"}
    real = inputs["attention_mask"].bool()
    if _gap(plain[real], want[real]) > TOL or not attention_modules(ours):
        return {"outcome": "not on multihead (differs or no module reached)", "note": ""}
    try:
        with torch.no_grad():
            points = _or_refusal(check_points, ours, inputs, plain)
            if isinstance(points, str):
                points = {"observer": points, "pattern": "-", "z": "-"}
            gaps: dict = {
                **points,
                "result": check_result(ours, inputs),
                **check_edits(ours, inputs),
            }
    except Exception as e:  # noqa: BLE001
        return {"outcome": "lens error", "note": f"{type(e).__name__}: {str(e)[:160]}"}
    bad = [k for k, g in gaps.items() if isinstance(g, float) and g > TOL]
    refused = [k for k, g in gaps.items() if isinstance(g, str) and g.startswith("refused")]
    outcome = (
        "a check fails"
        if bad
        else "every check holds, some points refused by name"
        if refused
        else "every check holds"
    )
    return {"outcome": outcome, "gaps": gaps, "failed": bad, "refused": refused}


def main() -> int:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    warnings.simplefilter("ignore")
    T.logging.set_verbosity_error()
    families = sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    if len(sys.argv) > 1:
        families = [f for f in families if f in sys.argv[1:]]
    records = {}
    with Progress(len(families), "lens survey", enabled=True) as bar:
        for family in families:
            records[family] = survey_one(family)
            bar.update(1)
    r = {
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{platform.machine()}, torch {torch.__version__}, transformers {T.__version__}",
        "tolerance": TOL,
        "families": records,
    }
    if len(sys.argv) == 1:
        (RESULTS / "lens_families.json").write_text(json.dumps(r, indent=1))
        (RESULTS / "lens_families.md").write_text(markdown(r))
    print(markdown(r))
    return 0


def markdown(r: dict) -> str:
    fams = r["families"]
    counts = Counter(rec["outcome"] for rec in fams.values())
    looked = {f: rec for f, rec in fams.items() if "gaps" in rec}
    lines = [
        "# The lens on every causal-LM family of transformers that runs on multihead",
        "",
        f"{r['date']}, {r['machine']}. Each family built tiny with random weights (`tests/test_hf_families.py`'s "
        f"sizes), a left-padded batch of 2 x 7 tokens, float32; checks by hand, tolerance {r['tolerance']:g} "
        "(the checks: `benchmarks/lens_families.py`'s docstring). Written by `python benchmarks/lens_families.py`.",
        "",
        "| outcome | families |",
        "| --- | --- |",
        *(f"| {k} | {v} |" for k, v in counts.most_common()),
        "",
        "| family | observer | pattern | z | result | ablation | patching | prefix shared | attribution |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for f, rec in looked.items():
        g = rec["gaps"]
        cells = [
            f"{g[k]:.1e}" if isinstance(g[k], float) else g[k][:60] + ("..." if len(g[k]) > 60 else "")
            for k in (
                "observer",
                "pattern",
                "z",
                "result",
                "ablation",
                "patching",
                "prefix shared",
                "attribution",
            )
        ]
        lines.append(f"| {f} | " + " | ".join(cells) + " |")
    others = {f: rec for f, rec in fams.items() if "gaps" not in rec and rec["outcome"] != "no tiny model"}
    if others:
        lines += ["", "Not looked into (they do not run on multihead, or the lens failed):", ""]
        lines += [f"- {f}: {rec['outcome']} {rec.get('note', '')}".rstrip() for f, rec in others.items()]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
