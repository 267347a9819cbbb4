"""The end-to-end demo behind ``multihead demo``: train, decode, look inside the heads, prune, compare.

Dimensions: B batch, S source length, T target length, V target vocabulary, H heads.

1. data: the date-normalisation task generated in-process (or ``--data FILE.tsv``), split by date
   (:func:`load_data`);
2. train a small encoder-decoder :class:`~multihead.Transformer` with a progress bar (:func:`train_model`);
3. evaluate exact match on held-out examples with greedy KV-cache decoding (:func:`evaluate`);
4. capture the attention of a few decoded examples, plot it, score the heads two ways (:func:`inspect_heads`);
5. prune as many heads as keep dev accuracy within the budget (:func:`prune_heads`);
6. save both models and the config, reload the pruned one safely (:func:`save_and_reload`);
7. print the before/after table and write ``results.md`` and the HTML report (:func:`write_results`).

:func:`run` does the seven steps in order, after :func:`check_dependencies` (matplotlib, the ``viz``
extra) so that a missing dependency stops it before any work.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .. import checkpoint, heads, viz
from .._extras import require
from ..bench.measure import Settings
from ..bench.pair import PairTiming, machine, time_pair
from ..bench.stats import Spread
from ..commands import training
from ..commands.training import count_params, markdown_table, text_table
from ..progress import Progress
from ..transformer import Transformer
from .data import BOS, EOS, PAD, Dataset, Split, date_pairs, make_dataset
from .model import DemoConfig, build_model, save_models

__all__ = ["DemoConfig", "build_model", "check_dependencies", "exact_match", "run"]

Echo = Callable[[str], None]


def check_dependencies() -> None:
    """Raise :class:`ImportError` naming the ``viz`` extra now, before any training, if matplotlib is missing."""
    require("viz", ("matplotlib.figure",), "the demo's plots and HTML report")


def teacher_loss(model: nn.Module, batch: tuple[Tensor, Tensor, Tensor]) -> Tensor:
    """Teacher-forced cross-entropy, mean over the batch's real target tokens."""
    src, tgt_in, tgt_out = batch  # (B, S), (B, T), (B, T)
    logits = model(src, tgt_in)  # (B, T, V)
    return F.cross_entropy(logits.flatten(0, 1), tgt_out.flatten(), ignore_index=PAD)  # (B*T, V) vs (B*T,)


def _predict(model: Transformer, split: Split, max_len: int, batch: int = 500) -> list[Tensor]:
    out = []
    for src, _, _ in split.batches(batch):
        out.append(model.generate(src, bos_id=BOS, eos_id=EOS, max_len=max_len))  # (B, T')
    return out


def _until_eos(row: list[int]) -> list[int]:
    return row[: row.index(EOS) + 1] if EOS in row else row


def exact_match(model: Transformer, split: Split, max_len: int, *, limit: int | None = None) -> float:
    """Percentage of ``split`` (its first ``limit`` examples) whose greedy decoding equals the target.

    A prediction must reproduce every target token *and* the end token.
    """
    part = split if limit is None or limit >= len(split) else _head(split, limit)
    hits = 0
    for pred, (_, _, tgt_out) in zip(_predict(model, part, max_len), part.batches(500)):
        for p, g in zip(pred.tolist(), tgt_out.tolist()):
            hits += _until_eos(p) == _until_eos(g)
    return 100.0 * hits / max(1, len(part))


def _head(split: Split, n: int) -> Split:
    return Split(split.pairs[:n], split.src[:n], split.tgt_in[:n], split.tgt_out[:n])


class DecodeSpeeds(NamedTuple):
    """Both models' decoding speed, from the same interleaved rounds.

    ``full`` and ``pruned``: sentences/s in the median round (:class:`multihead.bench.pair.PairTiming`'s
    ``median_round``); ``speedup``: that round's ratio, the median, with its interquartile range over the
    rounds. So ``pruned / full`` is ``speedup.median``: a model shown faster never shows the smaller rate.
    """

    full: float
    pruned: float
    speedup: Spread


def speeds_of(sentences: int, timing: PairTiming) -> DecodeSpeeds:
    """The table's figures from a timing in which each model decoded ``sentences`` sentences per round."""
    full_s, pruned_s = timing.median_round
    return DecodeSpeeds(sentences / full_s, sentences / pruned_s, timing.speedup)


def decode_speeds(
    full: Transformer, pruned: Transformer, split: Split, max_len: int, min_rounds: int
) -> DecodeSpeeds:
    """Greedy KV-cache decoding of ``split`` by both models, timed as the benchmarks time (interleaved rounds).

    Each round decodes the same sentences with the full and then the pruned model, so machine load hits
    both alike (:func:`multihead.bench.pair.time_pair`); the figures are those of the median round
    (:func:`speeds_of`). At least ``min_rounds`` rounds, more within about 8 s.
    """
    settings = Settings(warmup=1, min_rounds=max(1, min_rounds), max_rounds=max(31, min_rounds), budget_s=8.0)
    with Progress(settings.max_rounds + settings.warmup, "time") as bar:
        timing = time_pair(
            lambda: _predict(full, split, max_len, batch=250),
            lambda: _predict(pruned, split, max_len, batch=250),
            settings=settings,
            note=lambda _: bar.update(1),
        )
    return speeds_of(len(split), timing)


# ------------------------------------------------------------------------------------------------
# Training
# ------------------------------------------------------------------------------------------------


@dataclass
class TrainLog:
    losses: list[float] = field(default_factory=list)
    curve: list[tuple[int, float]] = field(default_factory=list)  # (step, dev exact match %)
    seconds: float = 0.0


def train(model: Transformer, ds: Dataset, cfg: DemoConfig, max_len: int) -> TrainLog:
    """AdamW with linear warm-up and cosine decay (:mod:`multihead.commands.training`); batches drawn
    without replacement, epoch by epoch."""
    gen = torch.Generator().manual_seed(cfg.seed)
    log, draw = TrainLog(), {"order": torch.empty(0, dtype=torch.long), "pos": 0}
    checks = {round(cfg.steps * (i + 1) / cfg.curve_points) for i in range(cfg.curve_points)}

    def loss_at(_: int) -> Tensor:
        if draw["pos"] + cfg.batch_size > len(draw["order"]):
            draw["order"], draw["pos"] = torch.randperm(len(ds.train), generator=gen), 0
        idx = draw["order"][draw["pos"] : draw["pos"] + cfg.batch_size]
        draw["pos"] += cfg.batch_size
        src, ti, to = ds.train.src[idx], ds.train.tgt_in[idx], ds.train.tgt_out[idx]
        s, t = int((src != PAD).sum(1).max()), int((to != PAD).sum(1).max())
        model.train()
        return teacher_loss(model, (src[:, :s], ti[:, :t], to[:, :t]))  # trailing padding trimmed

    def on_step(step: int, loss: float) -> None:
        info = {"loss": f"{loss:.4f}"}
        if step + 1 in checks:
            log.curve.append((step + 1, exact_match(model, ds.dev, max_len, limit=300)))
            info["dev"] = f"{log.curve[-1][1]:.1f}%"
        bar.update(1, **info)

    start = time.perf_counter()
    optimiser = training.AdamW(cfg.lr, betas=(0.9, 0.98), weight_decay=0.01)
    with Progress(cfg.steps, "train") as bar:
        log.losses = training.fit(
            model.parameters(),
            loss_at,
            cfg.steps,
            optimiser,
            training.warmup_cosine(cfg.steps, cfg.warmup, floor=0.05),
            on_step=on_step,
        )
    log.seconds = time.perf_counter() - start
    return log


def plot_training(log: TrainLog, path: Path) -> object:
    """Loss per step (log scale) and dev exact match at the checkpoints, to ``path`` (PNG)."""
    fig = viz.new_figure(figsize=(7, 3.2), layout="constrained")
    ax = fig.subplots()
    ax.plot(range(1, len(log.losses) + 1), log.losses, lw=0.8, color="tab:blue")
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (cross-entropy)", color="tab:blue")
    if log.curve:
        acc = ax.twinx()
        acc.plot(*zip(*log.curve), "o-", color="tab:orange")
        acc.set_ylabel("dev exact match (%)", color="tab:orange")
        acc.set_ylim(0, 100)
    ax.set_title(f"training ({len(log.losses)} steps, {log.seconds:.0f} s)")
    fig.savefig(path, dpi=100, metadata={"Software": None})
    return fig


# ------------------------------------------------------------------------------------------------
# Looking inside
# ------------------------------------------------------------------------------------------------


def report_pairs(cfg: DemoConfig, ds: Dataset) -> list[tuple[str, str]]:
    """Examples for the attention pictures: three date styles (long, dd/mm/yy, ordinal) or the first tests."""
    if cfg.data is None:
        rng = random.Random(cfg.seed + 1)
        styles = [0, 1, 4, 3, 5, 2, 6, 7][: cfg.report_examples]
        return [date_pairs(1, rng, held_out=True, styles=[s])[0] for s in styles]
    return ds.test.pairs[: cfg.report_examples]


def look_inside(
    model: Transformer, ds: Dataset, pairs: list[tuple[str, str]], max_len: int
) -> dict[str, list[viz.Panel]]:
    """Decode ``pairs`` with the KV cache while capturing every head: ``{label: report panels}``."""
    split = ds.split(pairs)
    with viz.capture(model) as cap:
        pred = model.generate(split.src, bos_id=BOS, eos_id=EOS, max_len=max_len)  # (B, T')
    examples = {}
    for i, (source, target) in enumerate(pairs):
        src_tokens = ds.src_vocab.decode(split.src[i].tolist())
        out = ds.tgt_vocab.decode(pred[i].tolist())
        produced = [*out, "<eos>"][: pred.shape[1]]  # the token each decoding step produced
        guess = ds.tgt_join.join(out)
        mark = "ok" if guess == ds.tgt_join.join(ds.tgt_tokenize(target)) else f"expected {target}"
        label = f"{source}  ->  {guess}  ({mark})"
        examples[label] = viz.panels(
            cap, src_tokens, produced, index=i, target_inputs=["<bos>", *produced[:-1]]
        )
    return examples


# ------------------------------------------------------------------------------------------------
# The demo
# ------------------------------------------------------------------------------------------------


@dataclass
class Row:
    """One model in the before/after table."""

    model: str
    heads: int
    params: int
    dev: float
    test: float
    speed: float = 0.0  # sentences/s: the test split decoded in the median round (see DecodeSpeeds)
    speedup: Spread | None = None  # per-round time ratio full / this model (None: the full model itself)


def _table(rows: list[Row]) -> list[list[str]]:
    out = [["model", "heads", "parameters", "dev exact match", "test exact match", "decode speed", "vs full"]]
    for r in rows:
        out.append(
            [
                r.model,
                str(r.heads),
                f"{r.params:,}",
                f"{r.dev:.1f}%",
                f"{r.test:.1f}%",
                f"{r.speed:,.0f} sentences/s",
                "1.00x" if r.speedup is None else f"{r.speedup.words(unit='x')}",
            ]
        )
    return out


def load_data(cfg: DemoConfig, echo: Echo) -> Dataset:
    """Step 1: the date task (or ``cfg.data``), split so that held-out examples use unseen dates."""
    ds = make_dataset(cfg.seed, train=cfg.train_size, dev=cfg.dev_size, test=cfg.test_size, data=cfg.data)
    echo(
        f"data: {ds.name}: {len(ds.train)} train / {len(ds.dev)} dev / {len(ds.test)} test pairs "
        f"(held-out dates), vocab {len(ds.src_vocab)} -> {len(ds.tgt_vocab)}; e.g. "
        + "; ".join(f"{s!r} -> {t!r}" for s, t in ds.train.pairs[:3])
    )
    return ds


def train_model(
    cfg: DemoConfig, ds: Dataset, max_len: int, out: Path, echo: Echo
) -> tuple[Transformer, TrainLog]:
    """Step 2: build and train the Transformer, plot the training curve; returns it (in eval mode) and the log."""
    model = build_model(cfg, ds)
    echo(
        f"model: Transformer d_model={cfg.d_model}, {cfg.num_heads} heads, {cfg.layers}+{cfg.layers} layers, "
        f"d_ff={cfg.d_ff}: {count_params(model):,} parameters, "
        f"{sum(heads.head_counts(model).values())} attention heads"
    )
    log = train(model, ds, cfg, max_len)
    model.eval()
    plot_training(log, out / "training.png")
    return model, log


def evaluate(
    name: str, model: Transformer, ds: Dataset, cfg: DemoConfig, max_len: int, *, dev: float | None = None
) -> Row:
    """Step 3: exact match on dev (unless ``dev`` is already known) and test with greedy KV-cache
    decoding (the speed is measured later, both models side by side: :func:`measure_speed`)."""
    return Row(
        name,
        sum(heads.head_counts(model).values()),
        count_params(model),
        exact_match(model, ds.dev, max_len) if dev is None else dev,
        exact_match(model, ds.test, max_len),
    )


def measure_speed(
    full: Row, small: Row, model: Transformer, pruned: Transformer, ds: Dataset, cfg: DemoConfig, max_len: int
) -> str:
    """Fill both rows' decoding speed (:func:`decode_speeds`); returns the sentence that says how and where."""
    speeds = decode_speeds(model, pruned, ds.test, max_len, cfg.speed_repeats)
    full.speed, small.speed, small.speedup = speeds.full, speeds.pruned, speeds.speedup
    return (
        f"Decode speed: greedy KV-cache decoding of the {len(ds.test)} test sentences (batches of 250), the "
        f"two models in {speeds.speedup.n} interleaved rounds; both sentences/s and 'vs full' are those of "
        f"the median round, whose speed ratio is the median per-round ratio [interquartile range over the "
        f"rounds]. Measured on {machine().words()}: absolute speeds depend on the machine, the ratio much less."
    )


@dataclass
class Inspection:
    """What step 4 found: report panels per decoded example, importance scores, masking drops."""

    examples: dict[str, list[viz.Panel]]
    importance: dict[str, Tensor]
    drop: dict[str, Tensor]


def inspect_heads(
    model: Transformer, cfg: DemoConfig, ds: Dataset, max_len: int, out: Path, echo: Echo
) -> Inspection:
    """Step 4: capture and plot the attention of a few decoded examples, score every head two ways."""
    examples = look_inside(model, ds, report_pairs(cfg, ds), max_len)
    for label in examples:
        echo(f"  {label}")
    first_label, first = next(iter(examples.items()))
    for kind, fname in (("cross", "cross"), ("encoder self", "encoder"), ("decoder self", "decoder")):
        group = [p for p in first if p.kind == kind]
        viz.plot_attention(
            {p.name: p.weights for p in group},
            group[0].query_tokens,
            group[0].key_tokens,
            title=f"{kind} attention: {first_label}",
            path=out / f"attention_{fname}.png",
        )
    score = heads.importance(model, ds.dev.batches(250), teacher_loss)
    viz.plot_importance(
        score,
        title="head importance (Michel et al. 2019, per-layer L2-normalised)",
        path=out / "importance.png",
    )
    with Progress(sum(heads.head_counts(model).values()), "mask each") as bar:
        drop = heads.masking_drop(
            model,
            lambda m: exact_match(m, ds.dev, max_len, limit=cfg.drop_size),
            progress=lambda done, total: bar.update(1),
        )
    viz.plot_importance(
        drop,
        title="dev exact-match points lost when masking one head",
        cmap="viridis",
        path=out / "masking_drop.png",
    )
    return Inspection(examples, dict(score), dict(drop))


def prune_heads(
    model: Transformer, cfg: DemoConfig, ds: Dataset, max_len: int, echo: Echo
) -> heads.PruneResult:
    """Step 5: prune as many heads as keep dev exact match within ``cfg.prune_budget`` points."""
    echo(
        f"pruning: {cfg.prune_step:.0%} of the heads per step while dev accuracy stays within "
        f"{cfg.prune_budget} point(s)"
    )
    dev_batches = ds.dev.batches(250)
    res = heads.prune_iteratively(
        model,
        lambda m: heads.importance(m, dev_batches, teacher_loss),
        lambda m: exact_match(m, ds.dev, max_len),
        step=cfg.prune_step,
        budget=cfg.prune_budget,
        patience=cfg.prune_patience,
        progress=lambda s: echo(
            f"  try -{s.removed} heads -> {s.heads_left} left: dev {s.metric:.1f}% "
            + ("kept" if s.accepted else "rejected")
        ),
    )
    res.model.eval()
    return res


def save_and_reload(
    out: Path,
    cfg: DemoConfig,
    ds: Dataset,
    model: Transformer,
    res: heads.PruneResult,
    max_len: int,
    echo: Echo,
) -> bool:
    """Step 6: save both models and the config; reload the pruned one safely; True if it predicts the same."""
    saved = save_models(out, cfg, ds, model, res.model, res.pruned)
    reloaded = checkpoint.load_model(
        build_model(cfg, ds), saved.pruned
    ).eval()  # torch.load(weights_only=True)
    same = all(
        torch.equal(a, b)
        for a, b in zip(_predict(reloaded, ds.test, max_len), _predict(res.model, ds.test, max_len))
    )
    echo(
        f"saved {saved.model.name}, {saved.pruned.name} and {saved.config.name}; the pruned checkpoint "
        f"reloaded into a fresh model: {'identical predictions' if same else 'PREDICTIONS DIFFER'}"
    )
    return same


def write_results(
    out: Path,
    cfg: DemoConfig,
    ds: Dataset,
    rows: list[Row],
    res: heads.PruneResult,
    seen: Inspection,
    echo: Echo,
    speed_note: str = "",
) -> None:
    """Step 7: the before/after table (printed and ``results.md``) and the HTML report."""
    table = _table(rows)
    pruned_rows = [["module", "kind", "heads removed (original index)", "heads left"]] + [
        [name, heads.attention_kind(name), ", ".join(map(str, res.pruned.get(name, []))) or "-", str(h)]
        for name, h in heads.head_counts(res.model).items()
    ]
    echo("\n" + text_table(table) + "\n" + (f"\n{speed_note}\n" if speed_note else ""))
    (out / "results.md").write_text(
        f"# multihead demo (seed {cfg.seed}, {ds.name})\n\n{markdown_table(table)}\n\n{speed_note}\n\n"
        f"## Pruned heads\n\n{markdown_table(pruned_rows)}\n"
    )
    viz.write_report(
        out / "report.html",
        seen.examples,
        importance=seen.importance,
        drop=seen.drop,
        tables={"Before and after pruning": table, "Pruned heads": pruned_rows},
        images={"Training": (out / "training.png").read_bytes()},
        title=f"multihead demo: {ds.name}",
    )


def run(cfg: DemoConfig, out: str | Path, *, echo: Echo = print) -> dict[str, object]:
    """Run the whole demo, writing its artefacts under ``out``; returns the numbers it printed.

    Artefacts: ``training.png``, ``attention_cross.png``, ``attention_encoder.png``,
    ``attention_decoder.png``, ``importance.png``, ``masking_drop.png``, ``report.html``,
    ``results.md``, ``model.pt``, ``model_pruned.pt`` and ``config.json`` (:mod:`multihead.demo.model`).
    Raises :class:`ImportError` naming the ``viz`` extra before any work if matplotlib is missing.
    """
    check_dependencies()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    torch.manual_seed(cfg.seed)
    ds = load_data(cfg, echo)
    max_len = ds.max_target_len + 2
    model, log = train_model(cfg, ds, max_len, out, echo)
    full = evaluate("full", model, ds, cfg, max_len)
    echo(
        f"trained in {log.seconds:.0f} s: held-out exact match {full.test:.1f}% (test), {full.dev:.1f}% (dev)"
    )
    seen = inspect_heads(model, cfg, ds, max_len, out, echo)
    res = prune_heads(model, cfg, ds, max_len, echo)
    small = evaluate("pruned", res.model, ds, cfg, max_len, dev=res.metric)  # pruning measured dev already
    speed_note = measure_speed(full, small, model, res.model, ds, cfg, max_len)
    same = save_and_reload(out, cfg, ds, model, res, max_len, echo)
    write_results(out, cfg, ds, [full, small], res, seen, echo, speed_note)
    echo(
        f"report: {out / 'report.html'} (and PNGs, results.md) in {out}/; "
        f"whole demo {time.perf_counter() - started:.0f} s"
    )
    return {
        "full": asdict(full),
        "pruned": asdict(small),
        "speedup": small.speedup,
        "machine": machine().words(),
        "pruned_heads": res.pruned,
        "train_seconds": log.seconds,
        "reload_identical": same,
    }
