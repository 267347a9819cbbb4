"""What ``multihead prune`` is given: its options, the text file, ``--heads``, ``--recover``,
``--reconstruct``, the splits.

Every check here raises :class:`PruneError` (one line; the CLI exits with status 2) before any work.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...bench.measure import Settings
from ...bench.pair import PAIR_SETTINGS
from .. import model_dir

__all__ = [
    "DEFAULT_RECONSTRUCT",
    "DEFAULT_RECOVER",
    "DEFAULT_RECOVER_RECONSTRUCTED",
    "FEW_TEXTS",
    "MIN_TEXTS",
    "Options",
    "FEW_PRUNED_LRS",
    "RECOVERY_LRS",
    "REPORT_TIMING",
    "PruneError",
    "Splits",
    "check_out",
    "encode",
    "heads_to_prune",
    "most_heads",
    "check_amount",
    "parse_heads",
    "parse_quality",
    "read_texts",
    "reconstruct_steps",
    "recover_steps",
    "recovery_lrs",
    "size_scale",
    "split_texts",
]

DEFAULT_RECOVER = 240
"""Default recovery steps (at most: it stops early once the validation texts stop improving)."""
DEFAULT_RECOVER_RECONSTRUCTED = 120
"""Default recovery steps when the reconstruction stage was kept. After it, distillation kept a step in 12
of 18 runs of ``benchmarks/bench_prune.py`` (2026-11-26 19:37 UTC) for at most +0.003 on the command's
held-out split, while its 240 steps took up to 91 s of the 193 s that the slowest run took (target 180 s)."""

MIN_HELD_OUT = 8  # texts the reported quality is measured on (28 pairs for the Spearman of similarities)
RECOVERY_LRS = (5e-5, 1e-5)
"""Recovery's learning rates, tried in turn until one improves the validation quality
(:func:`multihead.commands.prune.recover`), when half the heads or more go. 2e-4 undid the refit
(validation fell by 0.06 in 40 steps); 5e-5 improves it at ``--heads`` 0.5 on all-MiniLM-L6-v2 (8 of 9
runs: 3 corpora x 3 seeds), but after the refit at 0.25 none of its steps did in 9 of 9, where 1e-5 did in
7 (``benchmarks/results/prune.md``): see :func:`recovery_lrs`."""
FEW_PRUNED_LRS = (1e-5,)
"""Recovery's learning rates when fewer than half the heads go: the refit leaves less to recover, and a
try at 5e-5 only spent 80 steps (30-40 s) before 1e-5 ran (the same result: a failed try restores the
weights, and each try draws the same batches)."""


def recovery_lrs(pruned: int, total: int) -> tuple[float, ...]:
    """The learning rates recovery tries when ``pruned`` of ``total`` heads go."""
    return RECOVERY_LRS if 2 * pruned >= total else FEW_PRUNED_LRS


MIN_VALIDATION = 4  # texts that choose between stages and stop recovery
MIN_TRAIN = 8  # texts that choose the heads, refit, reconstruct and recover on
MIN_TEXTS = MIN_HELD_OUT + MIN_VALIDATION + MIN_TRAIN
"""The fewest texts ``multihead prune`` works with: fewer is a usage error naming this number."""

FEW_TEXTS = 200
"""Below this many texts the command warns that its quality may not carry over to the rest of the user's
text (the held-out and validation sets are then a few dozen texts at most)."""


class PruneError(model_dir.BadInput):
    """A usage error of ``multihead prune``: one line, printed without a traceback (exit status 2)."""


REPORT_TIMING = PAIR_SETTINGS._replace(warmup=1, min_rounds=5)
"""How the report times both models: :data:`~multihead.bench.pair.PAIR_SETTINGS` (as many interleaved rounds
as fit in its 10 s budget) with one warm-up round and at least 5 timed. A call of a large model takes seconds
(SmolLM2-135M: 4.8 s a forward of 32 texts x 62 tokens, 3 s to decode 32 tokens, on 2 cores), so the budget
ends after the minimum: 2 + 7 rounds of both cost that model 140 s of the command's 10 minutes; 1 + 5 cost
80 s, and the interquartile range of the per-round ratios still shows the spread."""


@dataclass
class Options:
    """What ``multihead prune`` was asked to do (strings as typed: :func:`multihead.commands.prune.run`
    validates them)."""

    model_dir: str | Path
    data: str | Path
    heads: str | None  # a fraction or a count; None with ``quality``
    out: str | Path
    recover: int | str | None = None  # None: DEFAULT_RECOVER
    reconstruct: int | str | None = None  # steps per layer; None: DEFAULT_RECONSTRUCT
    truncate: bool = False
    batch_size: int = 16
    lrs: tuple[float, ...] | None = None  # recovery's learning rates, tried in turn (None: recovery_lrs)
    held_out: float = 0.2  # of the texts, measured on only (the report's quality)
    validation: float = 0.1  # of the texts, to choose between stages and stop recovery early
    refit_texts: int = 1024  # training texts the heads are chosen and the projections refit on (at most)
    crops: int = 2  # the refit also fits on this many random crops of each of those texts (objectives.crops)
    eval_every: int = 40  # recovery steps between validation checks
    patience: int = 2  # validation checks without improvement before recovery stops
    seed: int = 0
    progress: bool = True
    timing: Settings = REPORT_TIMING
    quality: str | float | None = None  # --quality: the share of the validation quality to keep
    importance_rounds: int = 0  # > 0: the benchmarks' peer -- heads chosen by gradient importance in this
    # many rounds (Michel et al., choose.choose_and_prune), no refit or reconstruction stage, recovery alone


def read_texts(path: str | Path) -> list[str]:
    """The non-blank lines of a UTF-8 text file, stripped; :class:`PruneError` if there are none."""
    p = Path(path)
    if not p.exists():
        raise PruneError(f"--data {p}: no such file (give a text file with one text per line)")
    if p.is_dir():
        raise PruneError(f"--data {p}: a directory, not a text file with one text per line")
    try:
        raw = p.read_text(encoding="utf-8")
    except OSError as e:
        raise PruneError(f"--data {p}: cannot read it ({e.strerror or e})") from e
    except UnicodeDecodeError as e:
        raise PruneError(f"--data {p}: not UTF-8 text ({e.reason} at byte {e.start})") from e
    texts = [line.strip() for line in raw.splitlines() if line.strip()]
    if not texts:
        raise PruneError(f"--data {p}: empty (no non-blank lines); give one text per line")
    return texts


def parse_heads(text: str) -> float | int:
    """``"0.25"`` -> 0.25 (a fraction in (0, 1)); ``"18"`` -> 18 (a count >= 1)."""
    try:
        value = float(text)
    except (TypeError, ValueError):
        value = math.nan
    if value.is_integer() and value >= 1 and "." not in str(text):
        return int(value)
    if 0 < value < 1:
        return value
    raise PruneError(
        f"--heads must be a fraction in (0, 1) (e.g. 0.25 prunes a quarter of the heads) or a count >= 1, "
        f"got {text!r}"
    )


def parse_quality(text: Any) -> float:
    """``"0.99"`` -> 0.99: the share of the original's validation quality ``--quality`` keeps, in (0, 1)."""
    try:
        value = float(text)
    except (TypeError, ValueError):
        value = math.nan
    if not 0 < value < 1:
        raise PruneError(
            f"--quality must be the share of the original's quality to keep, in (0, 1) (e.g. 0.99), got {text!r}"
        )
    return value


def check_amount(heads: Any, quality: Any) -> None:
    """Exactly one of ``--heads`` and ``--quality`` must be given."""
    if heads is None and quality is None:
        raise PruneError(
            "give --heads (how many heads go, e.g. 0.25) or --quality (the share of the quality to keep, e.g. 0.99)"
        )
    if heads is not None and quality is not None:
        raise PruneError(
            f"give --heads or --quality, not both (got --heads {heads} and --quality {quality}): --heads fixes "
            "how many heads go, --quality finds the most that keep that share of the quality"
        )


def heads_to_prune(value: float | int, counts: dict[str, int], groups: dict[str, int] | None = None) -> int:
    """How many heads ``--heads value`` prunes out of ``counts`` ({module: H}); no module may lose all.
    ``groups`` ({module: G}): modules whose heads go in groups of G (grouped-query attention: each keeps one
    group at least). The count is what the choice removes: rounded down to a multiple of the units' common
    size (the greatest common divisor of every module's G, 1 for a module without groups; SmolLM2-135M's
    ``--heads 0.25`` of 270 heads: 67.5 -> 68 -> 66, whole groups of 3)."""
    groups = groups or {}
    total, most = sum(counts.values()), most_heads(counts, groups)
    unit = math.gcd(*(groups.get(name, 1) for name in counts))
    n = max(1, round(value * total)) if isinstance(value, float) else value
    if n < unit:
        raise PruneError(
            f"--heads {value}: {n} heads, but under grouped-query attention heads go in whole key/value "
            f"groups of {unit}; ask for {unit} heads or more"
        )
    n -= n % unit
    if n > most:
        asked = f"{value} of {total} heads = {n}" if isinstance(value, float) else f"{n} of {total} heads"
        keeps = "at least one head" + (
            " (one key/value group under grouped-query attention)" if groups else ""
        )
        raise PruneError(
            f"--heads {value}: pruning {asked} would empty a layer (each of the {len(counts)} attention "
            f"layers keeps {keeps}, so at most {most} can go)"
        )
    return n


def most_heads(counts: dict[str, int], groups: dict[str, int]) -> int:
    """The most heads that can go when each module keeps one head, or one group of ``groups[module]``."""
    return sum(h - groups.get(name, 1) for name, h in counts.items())


def _steps(value: int | str | None, default: int, flag: str, zero: str) -> int:
    """A ``--recover`` / ``--reconstruct`` value as a number of steps >= 0 (None: ``default``)."""
    if value is None:
        return default
    try:
        steps = int(value)
    except (TypeError, ValueError):
        steps = -1
    if steps < 0 or str(value).strip() != str(steps):
        raise PruneError(f"{flag} must be a number of steps >= 0 (0 = {zero}), got {value!r}")
    return steps


REFERENCE_PARAMS = 22_713_216
"""Parameters of all-MiniLM-L6-v2, the model the default steps were measured on: for a larger model the
defaults shrink in proportion (:func:`size_scale`), so that the training stages cost about what they cost
there (a step's work grows with the parameters)."""
REFERENCE_LAYERS = 6  # all-MiniLM-L6-v2's layers: the default reconstruction steps are per layer there
MIN_RECONSTRUCT = 25
"""Fewer default reconstruction steps per layer than this (one validation check's worth) and the stage is
skipped: its checks would cost more than its steps."""


def size_scale(params: int) -> float:
    """How much of the default training steps a model of ``params`` parameters gets: ``REFERENCE_PARAMS /
    params``, at most 1 (SmolLM2-135M: 0.17)."""
    return min(1.0, REFERENCE_PARAMS / max(params, 1))


def recover_steps(value: int | str | None, *, reconstructed: bool = False, scale: float = 1.0) -> int:
    """``--recover`` as a number of steps (None: :data:`DEFAULT_RECOVER`, or
    :data:`DEFAULT_RECOVER_RECONSTRUCTED` when the reconstruction stage was kept, times ``scale``:
    :func:`size_scale`)."""
    default = DEFAULT_RECOVER_RECONSTRUCTED if reconstructed else DEFAULT_RECOVER
    return _steps(value, round(default * scale), "--recover", "no recovery")


DEFAULT_RECONSTRUCT = 300
"""Default reconstruction steps per pruned layer (:mod:`.reconstruct`; at most: the best check is kept)."""


def reconstruct_steps(value: int | str | None, *, scale: float = 1.0, layers: int = REFERENCE_LAYERS) -> int:
    """``--reconstruct`` as a number of steps per layer (None: :data:`DEFAULT_RECONSTRUCT` for a model of
    :data:`REFERENCE_LAYERS` layers, the same steps in all shared among ``layers`` and times ``scale``
    (:func:`size_scale`); 0 below :data:`MIN_RECONSTRUCT` a layer)."""
    per_layer = DEFAULT_RECONSTRUCT * scale * REFERENCE_LAYERS / max(layers, 1)
    default = round(per_layer) if per_layer >= MIN_RECONSTRUCT else 0
    return _steps(value, default, "--reconstruct", "no reconstruction")


def check_out(out: Path) -> None:
    """``--out`` must be new or an empty folder."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise PruneError(f"--out {out}: exists and is not an empty folder; name a new folder")


@dataclass(frozen=True)
class Splits:
    """The texts, split: ``train`` (choose heads, refit, reconstruct, recover), ``validation`` (choose stages, stop recovery),
    ``held_out`` (measured only: the quality the report states)."""

    train: list[str]
    validation: list[str]
    held_out: list[str]

    @property
    def few(self) -> bool:
        """Fewer than :data:`FEW_TEXTS` texts in all: the report's quality may not carry over."""
        return len(self.train) + len(self.validation) + len(self.held_out) < FEW_TEXTS


def _evenly(n: int, k: int) -> set[int]:
    """``k`` indices spread evenly through ``range(n)``."""
    return {int((i + 0.5) * n / k) for i in range(k)}


def split_texts(texts: Sequence[str], held_out: float = 0.2, validation: float = 0.1) -> Splits:
    """Deterministic split: ``max(8, round(held_out * n))`` texts evenly spaced through the file are held
    out, then ``max(4, round(validation * n))`` evenly spaced through the rest validate; :class:`PruneError`
    below :data:`MIN_TEXTS` texts."""
    n = len(texts)
    if n < MIN_TEXTS:
        raise PruneError(
            f"--data: {n} text(s) is too few: multihead prune needs at least {MIN_TEXTS} ({MIN_HELD_OUT} held "
            f"out to measure quality, {MIN_VALIDATION} to validate, {MIN_TRAIN} to prune and recover on)"
        )
    held = _evenly(n, max(MIN_HELD_OUT, round(held_out * n)))
    rest = [t for i, t in enumerate(texts) if i not in held]
    val = _evenly(len(rest), max(MIN_VALIDATION, round(validation * n)))
    return Splits(
        [t for i, t in enumerate(rest) if i not in val],
        [t for i, t in enumerate(rest) if i in val],
        [t for i, t in enumerate(texts) if i in held],
    )


def encode(tokenizer: Any, texts: Sequence[str], max_length: int | None, truncate: bool) -> list[list[int]]:
    """Token ids of each text (special tokens added); :class:`PruneError` for one over ``max_length``."""
    with model_dir.quiet_tokenizer():
        ids = [list(x) for x in tokenizer(list(texts), add_special_tokens=True)["input_ids"]]
    if max_length is None:
        return ids
    for i, row in enumerate(ids):
        if len(row) > max_length:
            if not truncate:
                raise PruneError(
                    f"--data: text {i + 1} ({texts[i][:40]!r}...) is {len(row)} tokens, longer than the "
                    f"model takes ({max_length}); shorten it or pass --truncate"
                )
            ids[i] = row[:max_length]
    return ids
