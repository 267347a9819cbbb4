"""The demo's data: the date-normalisation task, a user's TSV file, tokenisation and batching.

Dimensions: B batch, S source length, T target length (padded with ``PAD`` = 0).

The task (generated in-process from a seeded RNG, nothing downloaded): a date written one of many ways
-> its ISO form::

    tuesday, 3 march 2021   ->  2021-03-03
    03/03/21                ->  2021-03-03      (day/month/two-digit year; yy < 50 is 20yy)
    3 mar 2021              ->  2021-03-03

Held-out examples use *dates* (not just strings) that training never sees.
"""

from __future__ import annotations

import datetime as dt
import random
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

__all__ = [
    "BOS",
    "EOS",
    "PAD",
    "UNK",
    "DataError",
    "Dataset",
    "Vocab",
    "date_pairs",
    "characters",
    "load_tsv",
    "make_dataset",
    "tokenize",
]

PAD, BOS, EOS, UNK = 0, 1, 2, 3
SPECIALS = ["<pad>", "<bos>", "<eos>", "<unk>"]

_TOKEN = re.compile(r"[^\W\d_]+|\d+|[^\w\s]|_")  # words, numbers, single punctuation marks


def tokenize(text: str) -> list[str]:
    """Lower-case word, number and punctuation tokens: ``"Tue, 03/03/21"`` -> ``tue , 03 / 03 / 21``."""
    return _TOKEN.findall(text.lower())


def characters(text: str) -> list[str]:
    """One token per non-space character: the date task's targets, ``2021-03-03`` -> ``2 0 2 1 - 0 3 - 0 3``."""
    return [c for c in text if not c.isspace()]


# ------------------------------------------------------------------------------------------------
# The date task
# ------------------------------------------------------------------------------------------------

MONTHS = [dt.date(2000, m, 1).strftime("%B").lower() for m in range(1, 13)]
WEEKDAYS = [dt.date(2001, 1, d).strftime("%A").lower() for d in range(1, 8)]  # 2001-01-01 is a monday
FIRST, LAST = dt.date(1950, 1, 1), dt.date(2049, 12, 31)


def _ordinal(n: int) -> str:
    return f"{n}{'th' if 10 <= n % 100 <= 20 else {1: 'st', 2: 'nd', 3: 'rd'}.get(n % 10, 'th')}"


_FORMATS: list[Callable[[dt.date], str]] = [
    lambda d: f"{WEEKDAYS[d.weekday()]}, {d.day} {MONTHS[d.month - 1]} {d.year}",
    lambda d: f"{d.day:02d}/{d.month:02d}/{d.year % 100:02d}",
    lambda d: f"{d.day} {MONTHS[d.month - 1][:3]} {d.year}",
    lambda d: f"{MONTHS[d.month - 1]} {d.day}, {d.year}",
    lambda d: f"{_ordinal(d.day)} of {MONTHS[d.month - 1]} {d.year}",
    lambda d: f"{WEEKDAYS[d.weekday()][:3]} {d.day} {MONTHS[d.month - 1][:3]} {d.year % 100:02d}",
    lambda d: f"{d.day}.{d.month}.{d.year}",
    lambda d: f"{MONTHS[d.month - 1][:3]} {d.day:02d} {d.year}",
]


def format_date(date: dt.date, style: int) -> str:
    """``date`` written in one of the task's styles (0 .. 7)."""
    return _FORMATS[style](date)


def date_pairs(
    n: int, rng: random.Random, *, held_out: bool, styles: Sequence[int] | None = None
) -> list[tuple[str, str]]:
    """``n`` (source, target) pairs of random dates in random styles.

    Dates split by day number: every 10th day since 1950-01-01 (offset 7) is held out, so
    ``held_out=True`` pairs use dates that ``held_out=False`` pairs never contain.
    """
    styles = list(range(len(_FORMATS))) if styles is None else list(styles)
    span = (LAST - FIRST).days + 1
    out = []
    while len(out) < n:
        day = rng.randrange(span)
        if (day % 10 == 7) != held_out:
            continue
        date = FIRST + dt.timedelta(days=day)
        out.append((format_date(date, rng.choice(styles)), date.isoformat()))
    return out


# ------------------------------------------------------------------------------------------------
# A user's file
# ------------------------------------------------------------------------------------------------


class DataError(ValueError):
    """A malformed data file; the message names the file and the line."""


def load_tsv(path: str | Path) -> list[tuple[str, str]]:
    """Read ``source<TAB>target`` lines (the d2l fra-eng format; a third column, e.g. attribution, is
    ignored; blank lines are skipped). Raises :class:`DataError` naming the line of the first problem."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise DataError(f"{path}: cannot read the data file ({e.strerror})") from e
    pairs = []
    for lineno, line in enumerate(raw.split(b"\n"), start=1):
        try:
            text = line.decode("utf-8").rstrip("\r")
        except UnicodeDecodeError as e:
            raise DataError(f"{path}:{lineno}: not valid UTF-8 ({e.reason} at byte {e.start})") from e
        if not text.strip():
            continue
        cols = text.split("\t")
        if len(cols) not in (2, 3):
            raise DataError(
                f"{path}:{lineno}: expected 'source<TAB>target' (2 tab-separated columns, or 3 with an "
                f"attribution), got {len(cols)} column(s): {text[:60]!r}"
            )
        src, tgt = cols[0].strip(), cols[1].strip()
        if not tokenize(src) or not tokenize(tgt):
            raise DataError(
                f"{path}:{lineno}: empty {'source' if not tokenize(src) else 'target'}: {text[:60]!r}"
            )
        pairs.append((src, tgt))
    if len(pairs) < 10:
        raise DataError(f"{path}: only {len(pairs)} pair(s); the demo needs at least 10 to train and test")
    return pairs


# ------------------------------------------------------------------------------------------------
# Vocabulary and tensors
# ------------------------------------------------------------------------------------------------


class Vocab:
    """Token <-> id, with ``<pad>`` 0, ``<bos>`` 1, ``<eos>`` 2, ``<unk>`` 3 first."""

    def __init__(self, tokens: Sequence[str]) -> None:
        self.itos = SPECIALS + sorted(set(tokens) - set(SPECIALS))
        self.stoi = {t: i for i, t in enumerate(self.itos)}

    def __len__(self) -> int:
        return len(self.itos)

    def encode(self, tokens: Sequence[str]) -> list[int]:
        return [self.stoi.get(t, UNK) for t in tokens]

    def decode(self, ids: Sequence[int]) -> list[str]:
        """Ids up to (not including) ``<eos>``; padding dropped."""
        out = []
        for i in ids:
            if i == EOS:
                break
            if i != PAD:
                out.append(self.itos[i])
        return out


def pad(seqs: Sequence[Sequence[int]]) -> Tensor:
    """Right-pad id lists with ``PAD``: (B, max length) long."""
    out = torch.full((len(seqs), max(map(len, seqs))), PAD, dtype=torch.long)
    for i, s in enumerate(seqs):
        out[i, : len(s)] = torch.tensor(s, dtype=torch.long)
    return out


@dataclass
class Split:
    """One split as tensors: ``src`` (N, S), decoder input ``tgt_in`` = bos + y, ``tgt_out`` = y + eos."""

    pairs: list[tuple[str, str]]
    src: Tensor
    tgt_in: Tensor
    tgt_out: Tensor

    def __len__(self) -> int:
        return len(self.pairs)

    def batches(self, size: int) -> list[tuple[Tensor, Tensor, Tensor]]:
        """Consecutive (src, tgt_in, tgt_out) batches, trailing padding columns trimmed."""
        out = []
        for i in range(0, len(self), size):
            src, ti, to = self.src[i : i + size], self.tgt_in[i : i + size], self.tgt_out[i : i + size]
            s, t = int((src != PAD).sum(1).max()), int((to != PAD).sum(1).max())
            out.append((src[:, :s], ti[:, :t], to[:, :t]))
        return out


@dataclass
class Dataset:
    """Train/dev/test splits with their vocabularies; ``name`` says where the pairs came from.

    ``tgt_tokenize``/``tgt_join`` split and re-join targets (characters and ``""`` for dates, words and
    ``" "`` for a user's file); sources always use :func:`tokenize`.
    """

    name: str
    src_vocab: Vocab
    tgt_vocab: Vocab
    tgt_tokenize: Callable[[str], list[str]]
    tgt_join: str
    train: Split
    dev: Split
    test: Split

    def split(self, pairs: list[tuple[str, str]]) -> Split:
        src = [self.src_vocab.encode(tokenize(s)) for s, _ in pairs]
        tgt = [self.tgt_vocab.encode(self.tgt_tokenize(t)) for _, t in pairs]
        return Split(pairs, pad(src), pad([[BOS, *t] for t in tgt]), pad([[*t, EOS] for t in tgt]))

    @property
    def max_target_len(self) -> int:
        """Longest target in tokens, eos included."""
        return max(int((s.tgt_out != PAD).sum(1).max()) for s in (self.train, self.dev, self.test))


def make_dataset(
    seed: int, *, train: int = 20000, dev: int = 1000, test: int = 1000, data: str | Path | None = None
) -> Dataset:
    """The date task (``data=None``) or a user's TSV file, shuffled with ``seed`` and split.

    A file is split 80/10/10 (sizes capped at ``train``/``dev``/``test``); the vocabularies come from
    the training split (unseen tokens map to ``<unk>``).
    """
    rng = random.Random(seed)
    if data is None:
        name, tgt_tokenize, join = "dates (generated in-process)", characters, ""
        tr = date_pairs(train, rng, held_out=False)
        held = date_pairs(dev + test, rng, held_out=True)
        dv, te = held[:dev], held[dev:]
    else:
        name, tgt_tokenize, join = str(data), tokenize, " "
        pairs = load_tsv(data)
        rng.shuffle(pairs)
        n = max(1, len(pairs) // 10)
        te, dv, tr = pairs[:n][:test], pairs[n : 2 * n][:dev], pairs[2 * n :][:train]
    src_vocab = Vocab([t for s, _ in tr for t in tokenize(s)])
    tgt_vocab = Vocab([t for _, s in tr for t in tgt_tokenize(s)])
    ds = Dataset(name, src_vocab, tgt_vocab, tgt_tokenize, join, *([None] * 3))  # type: ignore[arg-type]
    ds.train, ds.dev, ds.test = ds.split(tr), ds.split(dv), ds.split(te)
    return ds
