"""What ``multihead prune`` writes: the pruned folder, the speed comparison, ``prune_report.{json,md}``."""

from __future__ import annotations

import json
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from ...bench.measure import Settings
from ...bench.pair import time_pair
from ...progress import Progress
from ..training import markdown_table
from .objectives import CausalLM, Objective, make_batches

__all__ = ["markdown", "save", "speed"]

_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".h5", ".msgpack", ".onnx", ".ot", ".pt", ".pth", ".ckpt")


def speed(
    original: nn.Module,
    pruned: nn.Module,
    ids: Sequence[list[int]],
    tokenizer: Any,
    objective: Objective,
    settings: Settings,
    progress: bool,
) -> dict[str, Any]:
    """Forward time of both models on one batch (up to 32 of the longest texts), in interleaved rounds
    (:func:`multihead.bench.pair.time_pair`): the median round's times and the per-round speed-up with its quartiles."""
    chosen = sorted(ids, key=len)[-32:]
    batch = make_batches(chosen, tokenizer, objective, len(chosen), 0)[0]
    b, length = batch.inputs["input_ids"].shape
    with Progress(settings.max_rounds + settings.warmup, "time", enabled=progress) as bar:
        timing = time_pair(
            lambda: objective.forward(original, batch),
            lambda: objective.forward(pruned, batch),
            settings=settings,
            note=lambda _: bar.update(1),
        )
    out = {
        "batch": b,
        "tokens": length,
        "rounds": timing.speedup.n,
        "original_ms": timing.median_round[0] * 1e3,  # the median round's: pruned / original == speedup
        "pruned_ms": timing.median_round[1] * 1e3,
        "speedup": timing.speedup.median,
        "speedup_q1": timing.speedup.q1,
        "speedup_q3": timing.speedup.q3,
    }
    if isinstance(objective, CausalLM):
        out["decode"] = decode_speed(original, pruned, batch.inputs["input_ids"][:1], settings, progress)
    return out


DECODE_STEPS = 32  # tokens generated per timed call of :func:`decode_speed`


def _decode(model: nn.Module, prompt: Tensor, steps: int) -> Any:
    """Greedy decoding of ``steps`` tokens after ``prompt`` (1, L) with the model's KV cache; the cache."""
    with torch.no_grad():
        out = model(input_ids=prompt, use_cache=True)
        for _ in range(steps):
            token = out.logits[:, -1:].argmax(-1)  # (1, 1)
            out = model(input_ids=token, past_key_values=out.past_key_values, use_cache=True)
    return out.past_key_values


def kv_bytes_per_token(model: nn.Module, prompt: Tensor) -> float:
    """The bytes the model's KV cache holds per token, measured: the cache after ``prompt`` (1, L)."""
    with torch.no_grad():
        cache = model(input_ids=prompt, use_cache=True).past_key_values
    total = sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))
    return total / prompt.shape[1]


def decode_speed(
    original: nn.Module, pruned: nn.Module, prompt: Tensor, settings: Settings, progress: bool
) -> dict[str, Any]:
    """Greedy decoding of :data:`DECODE_STEPS` tokens after ``prompt`` (1, L) with the KV cache, both models
    in interleaved rounds: tokens per second of each, and the KV cache's bytes per token of each."""
    with Progress(settings.max_rounds + settings.warmup, "decode", enabled=progress) as bar:
        timing = time_pair(
            lambda: _decode(original, prompt, DECODE_STEPS),
            lambda: _decode(pruned, prompt, DECODE_STEPS),
            settings=settings,
            note=lambda _: bar.update(1),
        )
    return {
        "prompt_tokens": prompt.shape[1],
        "steps": DECODE_STEPS,
        "rounds": timing.speedup.n,
        "original_tokens_per_s": DECODE_STEPS / timing.median_round[0],
        "pruned_tokens_per_s": DECODE_STEPS / timing.median_round[1],
        "speedup": timing.speedup.median,
        "kv_bytes_per_token": [kv_bytes_per_token(m, prompt) for m in (original, pruned)],
    }


def save(out: Path, loaded: Any, model: nn.Module, report: dict[str, Any]) -> None:
    """Write the pruned folder: weights, config, tokenizer, the source's other files, the report."""
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    loaded.tokenizer.save_pretrained(out)
    for item in Path(loaded.path).iterdir():  # e.g. sentence-transformers' modules.json and 1_Pooling/
        weights = item.suffix in _WEIGHT_SUFFIXES or item.name.endswith(".index.json")
        if weights or (out / item.name).exists() or item.name.startswith("."):
            continue
        if item.is_dir():
            shutil.copytree(item, out / item.name)
        else:
            shutil.copy2(item, out / item.name)
    (out / "prune_report.json").write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    (out / "prune_report.md").write_text(markdown(report), encoding="utf-8")


def _stage_rows(q: dict[str, Any]) -> list[list[str]]:
    rows = [["stage", "held-out quality", "validation quality", "kept", "seconds"]]
    for s in q["stages"]:
        kept = "yes" if s["kept"] else "no"
        rows.append(
            [s["stage"], f"{s['held_out']:.4f}", f"{s['validation']:.4f}", kept, f"{s['seconds']:.0f}"]
        )
    return rows


def _reconstruction_section(errors: dict[str, list[float]] | None) -> list[str]:
    """The report's reconstruction section (none without the stage)."""
    if not errors:
        return []
    rows = [["layer", "validation error before", "after"]]
    rows += [[name, f"{before:.4f}", f"{after:.4f}"] for name, (before, after) in errors.items()]
    return [
        "## Reconstruction",
        "",
        markdown_table(rows),
        "",
        "Each pruned layer's output error on the validation texts (mean squared error over real tokens, "
        "divided by the original output's mean square) before and after its training.",
        "",
    ]


def _asked(report: dict[str, Any]) -> str:
    if report.get("quality_arg") is not None:
        return f"`--quality {report['quality_arg']}`"
    return f"`--heads {report['heads_arg']}`"


def _floor_line(floor: dict[str, Any]) -> str:
    """What ``--quality`` found: how many heads could go at that floor and what one more would have cost."""
    nxt = floor["next"]
    after = (
        f"one head more ({nxt['heads']}) would have kept {nxt['validation']:.4f}, below the floor"
        if nxt
        else f"no head more can go (every layer keeps one: {floor['most']} at most)"
    )
    return (
        f"**Quality floor {floor['quality']:g}:** {floor['removable']} of the heads can go keeping "
        f"{floor['validation_at_removable']:.4f} of the original's validation quality after the refit; {after}. "
        f"Tried (heads: validation share kept): "
        + ", ".join(f"{k}: {v:.4f}" for k, v in floor["tried"].items())
        + ". The later stages are kept only when they raise the validation quality."
    )


def _decode_rows(d: dict[str, Any] | None) -> list[list[str]]:
    if not d:
        return []
    before, after = d["kv_bytes_per_token"]
    return [
        [
            f"greedy decoding ({d['steps']} tokens after {d['prompt_tokens']}, KV cache)",
            f"{d['original_tokens_per_s']:.1f} tokens/s",
            f"{d['pruned_tokens_per_s']:.1f} tokens/s (speed-up {d['speedup']:.2f}x)",
        ],
        ["KV cache per token", f"{before:,.0f} bytes", f"{after:,.0f} bytes ({after / before:.0%})"],
    ]


def markdown(report: dict[str, Any]) -> str:
    """The report as markdown: what was pruned, what each stage gave, where the numbers came from."""
    q, s, t = report["quality"], report["speed"], report["texts"]
    rows = [
        ["", "original", "pruned"],
        ["heads", f"{report['heads_before']}", f"{report['heads_after']}"],
        ["parameters", f"{report['params_before']:,}", f"{report['params_after']:,}"],
        [
            f"forward time ({s['batch']} texts x {s['tokens']} tokens)",
            f"{s['original_ms']:.1f} ms",
            f"{s['pruned_ms']:.1f} ms (speed-up {s['speedup']:.2f}x [{s['speedup_q1']:.2f}, {s['speedup_q3']:.2f}])",
        ],
        *_decode_rows(s.get("decode")),
        [
            f"held-out {q['metric']}",
            "1.0 (reference)",
            f"{q['after_prune']:.4f} pruned, {q['final']:.4f} saved "
            f"({q['interval_level']:.0%} interval {q['final_interval'][0]:.4f}-{q['final_interval'][1]:.4f})",
        ],
    ]
    rec = report["recovery"]
    lines = [
        f"# multihead prune: {report['model']}",
        "",
        f"{report['kind']} checkpoint, objective: {report['objective']}; pruned {report['pruned_count']} of "
        f"{report['heads_before']} heads ({_asked(report)}); {t['total']} texts: {t['train']} to "
        f"choose heads, refit, reconstruct and recover on, {t['validation']} to validate (choose stages, stop recovery), "
        f"{t['held_out']} held out (measured only).",
        *(["", f"**Warning:** {report['warning']}"] if report.get("warning") else []),
        *(["", _floor_line(report["floor"])] if report.get("floor") else []),
        "",
        markdown_table(rows),
        "",
        "## Stages",
        "",
        markdown_table(_stage_rows(q)),
        "",
        f"Quality: {q['metric']} ({q['direction']}). A stage is kept when it improves the validation quality. "
        f"The saved model's interval: {q['interval_level']:.0%} of {q['interval_draws']} resamples of the "
        f"{t['held_out']} held-out texts (drawn with replacement) measure within it: how much the figure depends "
        "on which of your texts were held out. Other text, even from the same source, can differ by more. "
        f"Recovery: {rec['steps_run']} steps run (at most {rec['steps']} per learning rate tried: "
        f"{', '.join(f'{lr:g}' for lr in rec.get('lrs_tried', [])) or 'none'}), the weights of step "
        f"{rec['kept_step']} of the last try kept (0 = none helped)."
        + (
            f" Default training steps scaled by {report['default_steps_scale']:.2f} for the model's size "
            f"(reconstruction: {report['reconstruct_steps']} steps a layer{', none' if not report['reconstruct_steps'] else ''})."
            if report.get("default_steps_scale", 1.0) < 1.0
            else ""
        )
        + f" Speed: forward passes of the two models in "
        f"{s['rounds']} interleaved rounds on the same batch; median and interquartile range of the per-round "
        f"ratios. Machine: {report['machine']}. "
        f"Took {report['seconds']:.0f} s.",
        "",
        *_reconstruction_section(report.get("reconstruction")),
        "## Heads removed (original indices)",
        "",
        markdown_table(
            [["module", "removed", "left"]]
            + [
                [name, ", ".join(map(str, report["removed"].get(name, []))) or "-", str(left)]
                for name, left in report["heads_left"].items()
            ]
        ),
    ]
    return "\n".join(lines) + "\n"
