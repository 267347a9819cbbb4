"""``multihead prune`` itself: :func:`run` checks every input, then prunes, refits, recovers, measures, saves."""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch import nn

from ... import heads as heads_tools
from ...bench.pair import machine
from ...progress import Progress
from .. import model_dir
from ..training import count_params
from .choose import (
    check_prunable,
    choose_and_prune,
    choose_compensable,
    compensable_order,
    gqa_groups,
    spread_subset,
)
from .floor import Floor, search
from .inputs import (
    DEFAULT_RECONSTRUCT,
    FEW_TEXTS,
    Options,
    PruneError,
    Splits,
    check_amount,
    check_out,
    encode,
    heads_to_prune,
    most_heads,
    parse_heads,
    parse_quality,
    read_texts,
    reconstruct_steps,
    recover_steps,
    recovery_lrs,
    size_scale,
    split_texts,
)
from .objectives import OBJECTIVES, Batch, Objective, crops, make_batches
from .reconstruct import layer_of, reconstruct_layers
from .recover import Recovery, recover
from .refit import feed_forward_sums, refit_layers
from .report import markdown, save, speed

__all__ = ["STAGES", "Job", "Stages", "options_from", "prepare", "run"]

Echo = Callable[[str], None]

INTERVAL_LEVEL = 0.9  # of the bootstrap interval the report gives the saved model's held-out quality

STAGES = ("pruned", "refit", "reconstructed", "recovered")
"""The command's stages in the order they run: the ``stage`` of each row of the report's quality table."""
PRUNED, REFIT, RECONSTRUCTED, RECOVERED = STAGES


@dataclass
class Job:
    """Everything :func:`run` works on, after every usage check: the loaded checkpoint, its objective,
    how many heads go, the texts (split, tokenized, batched) and the recovery steps."""

    loaded: Any
    objective: Objective
    counts: dict[str, int]
    n: int
    splits: Splits
    ids: dict[str, list[list[int]]]  # split name -> token ids
    steps: int
    reconstruct: int = DEFAULT_RECONSTRUCT  # steps per pruned layer (0: no reconstruction stage)
    batches: dict[str, list[Batch]] = field(default_factory=dict)
    floor: float | None = None  # --quality: the share of the validation quality to keep (n found by search)
    scale: float = 1.0  # of the default training steps, by the model's size (inputs.size_scale)

    def describe(self) -> str:
        s, total = self.splits, sum(self.counts.values())
        amount = (
            f"{self.n} heads"
            if self.floor is None
            else f"the most heads that keep {self.floor:g} of the quality"
        )
        return (
            f"{self.loaded.path}: {self.loaded.kind} ({type(self.loaded.model).__name__}), {total} heads in "
            f"{len(self.counts)} layers; objective: {self.objective.name}; pruning {amount}; "
            f"{len(s.train) + len(s.validation) + len(s.held_out)} texts: {len(s.train)} to choose heads, refit, "
            f"reconstruct and recover on, {len(s.validation)} to validate, {len(s.held_out)} held out"
        )

    def warning(self) -> str | None:
        total = len(self.splits.train) + len(self.splits.validation) + len(self.splits.held_out)
        if not self.splits.few:
            return None
        return (
            f"only {total} texts (fewer than {FEW_TEXTS}): the held-out quality is measured on "
            f"{len(self.splits.held_out)} of them and may not carry over to the rest of your text; give a few "
            f"hundred lines or more"
        )


def prepare(opts: Options) -> Job:
    """Check every input (:class:`PruneError` on the first bad one, nothing written) and load the checkpoint."""
    check_amount(opts.heads, opts.quality)
    if opts.importance_rounds and opts.quality is not None:
        raise PruneError("the gradient-importance peer prunes a given --heads only, not --quality")
    value = None if opts.heads is None else parse_heads(opts.heads)
    floor = None if opts.quality is None else parse_quality(opts.quality)
    recover_steps(opts.recover)  # checked now; the defaults depend on the model's size (below)
    reconstruct_steps(opts.reconstruct)
    check_out(Path(opts.out))
    splits = split_texts(read_texts(opts.data), opts.held_out, opts.validation)
    try:
        loaded = model_dir.load(opts.model_dir)
    except model_dir.NotACheckpoint as e:
        raise PruneError(str(e)) from e
    loaded.model.eval()
    counts = check_prunable(loaded.model)
    scale = size_scale(count_params(loaded.model))
    steps = recover_steps(opts.recover, scale=scale)
    reconstruct = reconstruct_steps(opts.reconstruct, scale=scale, layers=len(counts))
    groups = {} if opts.importance_rounds else gqa_groups(loaded.model)  # the peer picks single heads
    n = 0 if value is None else heads_to_prune(value, counts, groups)  # --quality: searched
    texts = {"train": splits.train, "validation": splits.validation, "held_out": splits.held_out}
    ids = {k: encode(loaded.tokenizer, v, loaded.max_length, opts.truncate) for k, v in texts.items()}
    return Job(
        loaded,
        OBJECTIVES[loaded.kind](),
        counts,
        n,
        splits,
        ids,
        steps,
        reconstruct,
        floor=floor,
        scale=scale,
    )


def _batch(job: Job, opts: Options) -> None:
    """Batch the texts and store what the objective needs from the original model."""
    tok, obj, size = job.loaded.tokenizer, job.objective, opts.batch_size
    job.batches = {
        "train": make_batches(job.ids["train"], tok, obj, size, opts.seed),
        "mixed": make_batches(job.ids["train"], tok, obj, size, opts.seed + 2, mix=True),
        "validation": make_batches(job.ids["validation"], tok, obj, size, opts.seed + 3),
        "held_out": make_batches(job.ids["held_out"], tok, obj, size, opts.seed + 1),
    }
    job.batches["choose"] = spread_subset(job.batches["train"], opts.refit_texts)
    cropped = make_batches(crops(job.ids["train"], opts.seed, opts.crops), tok, obj, size, opts.seed + 4)
    job.batches["refit"] = job.batches["choose"] + (
        spread_subset(cropped, opts.crops * opts.refit_texts) if cropped else []
    )


class Stages:
    """The quality of each stage on the validation and the held-out texts, and which stages were kept."""

    def __init__(self, job: Job, echo: Echo) -> None:
        self.objective, self.echo = job.objective, echo
        original = job.loaded.model
        self.sets = {k: (job.batches[k], job.objective.reference(original, job.batches[k])) for k in
                     ("validation", "held_out")}  # fmt: skip
        self.rows: list[dict[str, Any]] = []
        self.held_out_scores: list[Any] = []  # per row: its model's held-out scores (for the interval)
        self.clock = time.perf_counter()  # when the stage being made began

    def validate(self, model: nn.Module) -> float:
        """Validation quality as a number where higher is better (what chooses between stages)."""
        return self.objective.goodness(self._validation(model))

    def relative(self, model: nn.Module) -> float:
        """Validation quality as the share of the original's kept (what ``--quality`` compares with)."""
        return self.objective.relative(self._validation(model))

    def _validation(self, model: nn.Module) -> float:
        batches, ref = self.sets["validation"]
        return self.objective.quality(model, ref, batches)

    def measure(self, stage: str, model: nn.Module, *, kept: bool | None = None, note: str = "") -> None:
        """Measure ``model`` as stage ``stage``; ``kept=None``: kept if it improves the validation quality
        on the last kept stage. The row's ``seconds``: making and measuring the stage (since the last one)."""
        scores = {k: self.objective.scores(model, b) for k, (b, _) in self.sets.items()}
        q = {k: self.objective.quality_of(scores[k], ref) for k, (_, ref) in self.sets.items()}
        if kept is None:
            good = self.objective.goodness
            kept = good(q["validation"]) > good(self.last_kept()["validation"])
        now, began = time.perf_counter(), self.clock
        self.clock = now
        self.rows.append(
            {"stage": stage, "held_out": q["held_out"], "validation": q["validation"], "kept": kept,
             "seconds": now - began}
        )  # fmt: skip
        self.held_out_scores.append(scores["held_out"])
        self.echo(
            f"{stage}: held-out {self.objective.metric} {q['held_out']:.4f} (validation {q['validation']:.4f})"
            + ("" if kept else ", not kept: it did not improve the validation quality")
            + (f"; {note}" if note else "")
        )

    def interval(self) -> tuple[float, float]:
        """A 90% bootstrap interval of the last kept stage's held-out quality over the held-out texts
        (:meth:`~.objectives.Objective.interval`), from the scores its measurement took."""
        scores = self.held_out_scores[self._last_kept_row()]
        return self.objective.interval(scores, self.sets["held_out"][1], level=INTERVAL_LEVEL)

    def last_kept(self) -> dict[str, Any]:
        """The last stage kept (its model is the one saved)."""
        return self.rows[self._last_kept_row()]

    def _last_kept_row(self) -> int:
        return max(i for i, r in enumerate(self.rows) if r["kept"])


def _prune(
    job: Job, opts: Options, stages: Stages
) -> tuple[nn.Module, dict[str, list[int]], nn.Module | None, Floor | None]:
    """Choose the heads the refit can best make up for (:func:`choose_compensable`) and prune them. With
    ``--quality``: as many of them as keep that share of the validation quality after the refit
    (:func:`~.floor.search`), and that refit model too (the refit stage's). Returns the pruned model, the
    removed heads, the refit model (None without ``--quality``) and the search's :class:`~.floor.Floor`."""
    original, batches = job.loaded.model, job.batches["choose"]
    if opts.importance_rounds:  # the peer: Michel et al.'s gradient importance
        job.objective.prepare(original, batches)
        pruned, removed = choose_and_prune(original, batches, job.objective, job.n, opts.importance_rounds)
        return pruned, removed, None, None
    if job.floor is None:
        pruned, removed = choose_compensable(original, batches, job.objective, job.n)
        job.n = sum(map(len, removed.values()))  # fewer under grouped-query attention: whole groups go
        return pruned, removed, None, None
    most = most_heads(job.counts, gqa_groups(original))
    order = compensable_order(original, batches, job.objective, most)
    floor, refit = search(
        original, order, job.floor, lambda m, removed: _refit_copy(job, opts, m, removed), stages.relative
    )
    for n, q in sorted(floor.tried.items()):
        stages.echo(
            f"--quality {job.floor:g}: {n} heads removed and refit keep {q:.4f} of the validation quality"
        )
    if floor.n == 0:
        raise PruneError(
            f"--quality {job.floor:g}: no head can go (removing the first and refitting keeps "
            f"{min(floor.tried.items())[1]:.6f} of the validation quality); lower --quality"
        )
    job.n = floor.n
    removed = floor.removed
    return heads_tools.prune(original, removed), removed, refit, floor


def _refit_copy(job: Job, opts: Options, pruned: nn.Module, removed: dict[str, list[int]]) -> nn.Module:
    """A copy of ``pruned`` with each pruned layer's attention output projection and each layer's feed-forward
    output projection refit, layer by layer, on the training texts and ``opts.crops`` random crops of each
    (:func:`refit_layers`)."""
    candidate = copy.deepcopy(pruned)
    original, batches = job.loaded.model, job.batches["refit"]
    with Progress(len(removed) + len(feed_forward_sums(pruned)), "refit", enabled=opts.progress) as bar:
        refit_layers(
            candidate, original, batches, job.objective, list(removed), progress=lambda: bar.update(1)
        )
    return candidate


def _refit(
    job: Job,
    opts: Options,
    pruned: nn.Module,
    removed: dict[str, list[int]],
    stages: Stages,
    candidate: nn.Module | None = None,
) -> nn.Module:
    """The refit stage (:func:`_refit_copy`, or ``candidate`` when the ``--quality`` search made it already);
    kept if validation improves."""
    candidate = _refit_copy(job, opts, pruned, removed) if candidate is None else candidate
    stages.measure(REFIT, candidate)
    return candidate if stages.rows[-1]["kept"] else pruned


def _reconstruct(
    job: Job, opts: Options, model: nn.Module, removed: dict[str, list[int]], stages: Stages
) -> tuple[nn.Module, dict[str, list[float]]]:
    """Train each pruned layer to reproduce the original layer's output (:func:`reconstruct_layers`), on the
    training texts and their crops, stopped on the validation texts; kept if validation improves (and then
    recovery's default steps drop to :data:`~.inputs.DEFAULT_RECOVER_RECONSTRUCTED`). No stage with
    ``--reconstruct 0``. Also returns each layer's validation error ``[before, after]``."""
    if not job.reconstruct:
        return model, {}
    candidate = copy.deepcopy(model)
    layers = {layer_of(candidate, name) for name in removed} - {None}
    with Progress(len(layers), "reconstruct", enabled=opts.progress) as bar:
        errors = reconstruct_layers(
            candidate, job.loaded.model, job.batches["refit"], job.batches["validation"], job.objective,
            list(removed), steps=job.reconstruct, seed=opts.seed, progress=lambda: bar.update(1),
        )  # fmt: skip
    stages.measure(RECONSTRUCTED, candidate)
    errors_lists = {k: list(v) for k, v in errors.items()}
    if not stages.rows[-1]["kept"]:
        return model, errors_lists
    job.steps = recover_steps(
        opts.recover, reconstructed=True, scale=job.scale
    )  # less left: a shorter default
    return candidate, errors_lists


def _recover(job: Job, opts: Options, model: nn.Module, stages: Stages) -> Recovery:
    """Distil toward the original (:mod:`.recover`), stopped on the validation texts; at the next learning rate
    of ``opts.lrs`` (default :func:`~.inputs.recovery_lrs`) when no step of one improved them."""
    if not job.steps:
        return Recovery()
    lrs = opts.lrs or recovery_lrs(job.n, sum(job.counts.values()))
    with Progress(job.steps * len(lrs), "recover", enabled=opts.progress) as bar:  # at most
        rec = recover(
            model, job.loaded.model, job.batches["mixed"], job.objective, job.steps, lrs=lrs, seed=opts.seed,
            validate=stages.validate, eval_every=opts.eval_every, patience=opts.patience,
            progress=lambda loss: bar.update(1, loss=f"{loss:.4f}"),
        )  # fmt: skip
    model.eval()
    stages.measure(
        RECOVERED,
        model,
        kept=rec.kept_step > 0,
        note=f"{len(rec.losses)} steps run (learning rate {', '.join(f'{lr:g}' for lr in rec.lrs)}), step "
        f"{rec.kept_step} kept",
    )
    return rec


def _recovery_record(job: Job, rec: Recovery) -> dict[str, Any]:
    return {
        "steps": job.steps,
        "steps_run": len(rec.losses),
        "kept_step": rec.kept_step,
        "lrs_tried": rec.lrs,
        "checks": rec.checks,
        "loss_first_last": [rec.losses[0], rec.losses[-1]] if rec.losses else None,
    }


def _report(
    job: Job,
    opts: Options,
    model: nn.Module,
    removed: dict,
    stages: Stages,
    rec: Recovery,
    errors: dict,
    floor: Floor | None,
) -> dict:
    original, s = job.loaded.model, job.splits
    final = stages.last_kept()
    return {
        "model": str(job.loaded.path),
        "kind": job.loaded.kind,
        "model_class": type(original).__name__,
        "objective": job.objective.name,
        "heads_arg": None if opts.heads is None else str(opts.heads),
        "quality_arg": None if opts.quality is None else str(opts.quality),
        "floor": None if floor is None else floor.as_dict(),
        "pruned_count": job.n,
        "heads_before": sum(job.counts.values()),
        "heads_after": sum(heads_tools.head_counts(model).values()),
        "heads_left": heads_tools.head_counts(model),
        "removed": removed,
        "params_before": count_params(original),
        "params_after": count_params(model),
        "texts": {
            "train": len(s.train),
            "validation": len(s.validation),
            "held_out": len(s.held_out),
            "total": len(s.train) + len(s.validation) + len(s.held_out),
        },  # fmt: skip
        "warning": job.warning(),
        "reconstruction": errors,  # layer -> validation error [before, after] (relative mean square)
        "default_steps_scale": job.scale,
        "reconstruct_steps": job.reconstruct,
        "recovery": _recovery_record(job, rec),
        "quality": {
            "metric": job.objective.metric,
            "direction": job.objective.direction,
            "stages": stages.rows,
            "after_prune": stages.rows[0]["held_out"],
            "final": final["held_out"],
            "final_interval": list(stages.interval()),
            "interval_level": INTERVAL_LEVEL,
            "interval_draws": job.objective.draws(len(s.held_out)),
            "final_stage": final["stage"],
        },
        "speed": speed(
            original,
            model,
            job.ids["train"] + job.ids["held_out"],
            job.loaded.tokenizer,
            job.objective,
            opts.timing,
            opts.progress,
        ),  # fmt: skip
        "machine": machine().words(),
    }


def run(opts: Options, *, echo: Echo = print) -> dict[str, Any]:
    """Run ``multihead prune``; returns the report (also written under ``opts.out``).

    Raises :class:`PruneError` (a usage error, one line) before writing anything, for: a folder that is
    not a checkpoint, a missing/unreadable/empty data file or too few texts, ``--heads`` out of range or
    emptying a layer, ``--recover`` < 0, a text longer than the model takes without ``truncate``, a
    non-empty ``out``, an architecture whose heads cannot be pruned.
    """
    started = time.perf_counter()
    job = prepare(opts)  # every usage check is done: from here on the work
    echo(job.describe())
    if job.warning():
        echo(f"warning: {job.warning()}")
    _batch(job, opts)
    stages = Stages(job, echo)
    pruned, removed, refit, floor = _prune(job, opts, stages)
    stages.measure(PRUNED, pruned, kept=True)
    model, errors = pruned, {}
    if not opts.importance_rounds:  # the peer recovers only
        model = _refit(job, opts, pruned, removed, stages, refit)
        model, errors = _reconstruct(job, opts, model, removed, stages)
    rec = _recover(job, opts, model, stages)
    report = _report(job, opts, model, removed, stages, rec, errors, floor)
    report["seconds"] = time.perf_counter() - started
    save(Path(opts.out), job.loaded, model, report)
    echo(markdown(report))
    echo(f"wrote {opts.out}/ (model.safetensors, config.json, tokenizer, prune_report.json, prune_report.md)")
    return report


def options_from(args: Any) -> Options:
    """:class:`Options` from the CLI's parsed arguments."""
    return Options(
        model_dir=args.model_dir,
        data=args.data,
        heads=args.heads,
        quality=args.quality,
        out=args.out,
        recover=args.recover,
        reconstruct=args.reconstruct,
        truncate=args.truncate,
        progress=True,
    )
