"""The objective a checkpoint's heads are scored, distilled and measured with: one class per kind.

Dimensions: B batch, L tokens, L' a hidden state's tokens, E hidden width, V vocabulary, N texts,
P = N (N - 1) / 2 pairs of texts.

Each :class:`Objective` holds its labels (:meth:`~Objective.labels`), its loss (head importance for
:func:`~multihead.commands.prune.choose_and_prune`; the command itself chooses by refit residual),
its distillation term (:meth:`~Objective.distill`) and its held-out quality (:meth:`~Objective.quality`):

==================== ================== ============================== ==============================
checkpoint kind       class               loss (scores the heads)        quality (1.0 = the original)
==================== ================== ============================== ==============================
causal LM             :class:`CausalLM`   next-token cross-entropy        held-out perplexity ratio
masked LM             :class:`MaskedLM`   masked-token cross-entropy      held-out perplexity ratio
encoder-decoder       :class:`Seq2Seq`    denoising cross-entropy         held-out perplexity ratio
bare encoder/decoder  :class:`Embedding`  in-batch contrastive (InfoNCE)  Spearman of pair similarities
==================== ================== ============================== ==============================
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = [
    "OBJECTIVES",
    "Batch",
    "CausalLM",
    "Embedding",
    "MaskedLM",
    "Objective",
    "Outputs",
    "Seq2Seq",
    "TextLosses",
    "contrastive_loss",
    "crops",
    "make_batches",
    "mean_pool",
    "pair_similarities",
    "spearman",
]

TEMPERATURE = 0.05  # of the contrastive loss: cosine similarities / 0.05
MASK_RATE = 0.15  # tokens masked for the masked-token and denoising objectives
BOOTSTRAP_DRAWS = 200  # resamples of the held-out texts for the interval of the reported quality
BOOTSTRAP_PAIRS = 20_000_000  # Spearman of similarities: text pairs ranked over all draws, at most ...
MIN_DRAWS = 50  # ... but never fewer draws than this (1,000 held-out texts: 50 draws, about 5 s)


@dataclass
class Batch:
    """One batch: the model's inputs, the LM labels (-100 = ignored) or the original model's embeddings."""

    inputs: dict[str, Tensor]  # input_ids (B, L), attention_mask (B, L)
    labels: Tensor | None = None  # (B, L) for the LM objectives
    target: Tensor | None = None  # (B, E) the original model's mean-pooled embeddings (contrastive)


@dataclass
class Outputs:
    """What distillation compares: hidden states (each (B, L', E)) with their token masks, and the output."""

    hidden: list[Tensor]
    masks: list[Tensor]  # (B, L') each, 1 = a real token
    out: Tensor  # (B, E) embeddings or (B, L, V) logits

    def nbytes(self) -> int:
        return (
            sum(h.numel() * h.element_size() for h in self.hidden)
            + self.out.numel() * self.out.element_size()
        )


@dataclass
class TextLosses:
    """Each text's summed loss ``sums`` (N,) over its ``counts`` (N,) labelled tokens (LM objectives)."""

    sums: Tensor
    counts: Tensor

    def __len__(self) -> int:
        return len(self.sums)


class Objective:
    """How one kind of checkpoint is scored, distilled toward the original and measured (a base class).

    ``name`` is what the report prints; ``metric`` names :meth:`quality`'s number and ``higher_is_better``
    its direction; :meth:`goodness` turns it into a number where higher is always better.
    """

    name: ClassVar[str]
    metric: ClassVar[str]
    direction: ClassVar[str]
    higher_is_better: ClassVar[bool]

    def labels(self, input_ids: Tensor, attention: Tensor, tokenizer: Any, gen: torch.Generator) -> Batch:
        """The batch of ``input_ids`` (B, L) / ``attention`` (B, L) with this objective's inputs and labels."""
        return Batch({"input_ids": input_ids, "attention_mask": attention})

    def prepare(self, original: nn.Module, batches: Sequence[Batch]) -> None:
        """Store what the loss needs from the original model in ``batches`` (nothing by default)."""

    def forward(self, model: nn.Module, batch: Batch) -> Any:
        """``model`` run on ``batch`` (its outputs), as the other methods run it."""
        return model(**batch.inputs)

    def loss(self, model: nn.Module, batch: Batch) -> Tensor:
        """The scalar loss whose gradients score the heads (:func:`multihead.heads.importance`)."""
        return model(**batch.inputs, labels=batch.labels).loss

    def outputs(self, model: nn.Module, batch: Batch) -> Outputs:
        """``model``'s hidden states of every layer and its output on ``batch``."""
        o = model(**batch.inputs, output_hidden_states=True)
        hidden = list(o.hidden_states)
        return Outputs(hidden, [batch.inputs["attention_mask"]] * len(hidden), o.logits)

    def distill(self, student: Outputs, teacher: Outputs) -> Tensor:
        """Distillation loss: per-layer hidden-state error (each layer's mean squared error over real tokens
        divided by the teacher's mean square, averaged over layers) plus :meth:`output_term`."""
        terms = []
        for s, t, m in zip(student.hidden, teacher.hidden, teacher.masks, strict=True):
            w = m.unsqueeze(-1).to(s.dtype)  # (B, L', 1)
            terms.append(((s - t) ** 2 * w).sum() / (t**2 * w).sum().clamp_min(1e-12))
        return torch.stack(terms).mean() + self.output_term(student, teacher)

    def output_term(self, student: Outputs, teacher: Outputs) -> Tensor:
        """KL(teacher || student) of the next-token distributions over real tokens (LM objectives)."""
        m = teacher.masks[-1].bool()  # (B, L)
        log_s = F.log_softmax(student.out[m], dim=-1)  # (n, V)
        log_t = F.log_softmax(teacher.out[m], dim=-1)  # (n, V)
        return F.kl_div(log_s, log_t, log_target=True, reduction="batchmean")

    def scores(self, model: nn.Module, batches: Sequence[Batch]) -> Any:
        """What :meth:`quality_of` needs of ``model`` on ``batches``, text by text (one row per text, in the
        order of the batches): each text's summed loss and its label count (LM objectives)."""
        sums, counts = [], []
        with torch.no_grad():
            for b in batches:
                logits, labels = self.aligned(self.forward(model, b).logits, b.labels)  # (B, L', V), (B, L')
                ce = F.cross_entropy(
                    logits.float().transpose(1, 2), labels, ignore_index=-100, reduction="none"
                )
                sums.append(ce.sum(1).double())
                counts.append((labels != -100).sum(1).double())
        return TextLosses(torch.cat(sums), torch.cat(counts))

    def aligned(self, logits: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
        """``logits`` (B, L, V) and ``labels`` (B, L) of one batch, position by position the prediction and
        its label (the logits already predict their own position's label by default)."""
        return logits, labels

    def reference(self, original: nn.Module, batches: Sequence[Batch]) -> Any:
        """What :meth:`quality` compares with: the original's :meth:`scores` on ``batches``."""
        return self.scores(original, batches)

    def quality_of(self, scores: Any, reference: Any, pick: Tensor | None = None) -> float:
        """The quality of ``scores`` against ``reference`` over the texts ``pick`` (indices, repeats allowed:
        a bootstrap draw; None: every text). LM objectives: the perplexity ratio ``exp(loss - original
        loss)``, token-weighted mean losses (1.0 = unchanged, higher is worse)."""
        if pick is None:
            pick = torch.arange(len(scores))
        mine, theirs = (
            scores.sums[pick].sum() / scores.counts[pick].sum().clamp_min(1),
            reference.sums[pick].sum() / reference.counts[pick].sum().clamp_min(1),
        )
        return math.exp(float(mine - theirs))

    def quality(self, model: nn.Module, reference: Any, batches: Sequence[Batch]) -> float:
        """:meth:`quality_of` ``model``'s :meth:`scores` on ``batches`` against ``reference``, every text."""
        return self.quality_of(self.scores(model, batches), reference)

    def draws(self, n: int) -> int:
        """Bootstrap resamples :meth:`interval` takes for ``n`` texts (:data:`BOOTSTRAP_DRAWS`)."""
        return BOOTSTRAP_DRAWS

    def interval(
        self, scores: Any, reference: Any, *, level: float = 0.9, draws: int | None = None, seed: int = 0
    ) -> tuple[float, float]:
        """A ``level`` bootstrap interval of :meth:`quality_of` over the texts: ``draws`` (None:
        :meth:`draws`) resamples of the texts with replacement (a generator seeded by ``seed``), the
        quantiles of their qualities. How far the quality measured on these texts may be from the same
        measure on other texts of the same kind."""
        gen, n = torch.Generator().manual_seed(seed), len(scores)
        draws = self.draws(n) if draws is None else draws
        values = torch.tensor([
            self.quality_of(scores, reference, torch.randint(n, (n,), generator=gen)) for _ in range(draws)
        ], dtype=torch.float64)  # fmt: skip
        tail = (1 - level) / 2
        return float(values.nanquantile(tail)), float(values.nanquantile(1 - tail))

    def goodness(self, value: float) -> float:
        """``value`` of :meth:`quality` as a number where higher is better (to compare stages)."""
        return value if self.higher_is_better else -value

    def relative(self, value: float) -> float:
        """``value`` of :meth:`quality` as the share of the original's quality kept (1.0 = unchanged, higher
        is better): what ``--quality`` compares with. The quality itself for a correlation; ``1 / ratio``
        for a perplexity ratio (``--quality 0.99``: perplexity at most ``1 / 0.99`` times the original's)."""
        return value if self.higher_is_better else 1.0 / value


class _LanguageModel(Objective):
    metric = "perplexity ratio"
    direction = "1.0 = unchanged, higher is worse"
    higher_is_better = False


class CausalLM(_LanguageModel):
    """A causal LM (``...ForCausalLM``): next-token loss; every real token is a label."""

    name = "next-token"

    def labels(self, input_ids: Tensor, attention: Tensor, tokenizer: Any, gen: torch.Generator) -> Batch:
        labels = input_ids.masked_fill(attention == 0, -100)  # (B, L)
        return Batch({"input_ids": input_ids, "attention_mask": attention}, labels)

    def aligned(self, logits: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
        """Position t predicts token t + 1."""
        return logits[:, :-1], labels[:, 1:]


def _mask_tokens(
    input_ids: Tensor, attention: Tensor, tokenizer: Any, gen: torch.Generator
) -> tuple[Tensor, Tensor]:
    """``(masked input_ids, picked)``: ``MASK_RATE`` of each text's ordinary tokens (at least one) picked
    with ``gen`` and replaced by the mask token (when the tokenizer has one); both (B, L)."""
    special = torch.tensor(sorted(set(getattr(tokenizer, "all_special_ids", []))), dtype=torch.long)
    real = attention.bool() & ~torch.isin(input_ids, special)  # (B, L)
    pick = (torch.rand(input_ids.shape, generator=gen) < MASK_RATE) & real  # (B, L)
    first = real & (real.long().cumsum(1) == 1)  # each text's first ordinary token
    pick |= first & ~pick.any(1, keepdim=True)  # at least one masked token per text
    mask_id = getattr(tokenizer, "mask_token_id", None)
    return (input_ids if mask_id is None else input_ids.masked_fill(pick, mask_id)), pick


class MaskedLM(_LanguageModel):
    """A masked LM (``...ForMaskedLM``): the masked tokens are the labels."""

    name = "masked-token"

    def labels(self, input_ids: Tensor, attention: Tensor, tokenizer: Any, gen: torch.Generator) -> Batch:
        masked, pick = _mask_tokens(input_ids, attention, tokenizer, gen)
        return Batch({"input_ids": masked, "attention_mask": attention}, input_ids.masked_fill(~pick, -100))


class Seq2Seq(_LanguageModel):
    """An encoder-decoder (``...ForConditionalGeneration``): denoising, the decoder rebuilds the whole text
    from a masked copy; distillation compares encoder and decoder hidden states."""

    name = "denoising"

    def labels(self, input_ids: Tensor, attention: Tensor, tokenizer: Any, gen: torch.Generator) -> Batch:
        masked, _ = _mask_tokens(input_ids, attention, tokenizer, gen)
        return Batch(
            {"input_ids": masked, "attention_mask": attention}, input_ids.masked_fill(attention == 0, -100)
        )

    def forward(self, model: nn.Module, batch: Batch) -> Any:
        return model(**batch.inputs, labels=batch.labels)  # the decoder's inputs are the shifted labels

    def outputs(self, model: nn.Module, batch: Batch) -> Outputs:
        o = model(**batch.inputs, labels=batch.labels, output_hidden_states=True)
        dec = (batch.labels != -100).long()  # type: ignore[union-attr]  # (B, L)
        att = batch.inputs["attention_mask"]
        masks = [att] * len(o.encoder_hidden_states) + [dec] * len(o.decoder_hidden_states)
        return Outputs([*o.encoder_hidden_states, *o.decoder_hidden_states], masks, o.logits)


class Embedding(Objective):
    """A bare encoder (or decoder) giving sentence embeddings: mean-pooled last hidden states.

    Loss: in-batch contrastive (:func:`contrastive_loss`) of the model's embeddings against the
    *original* model's (a distance to the original output would have zero gradient at the unpruned model,
    and so no scores). Quality: Spearman rank correlation of the pairwise cosine similarities of the
    held-out texts with the original's.
    """

    name = "contrastive"
    metric = "spearman of pairwise similarities"
    direction = "1.0 = same order as the original"
    higher_is_better = True

    def prepare(self, original: nn.Module, batches: Sequence[Batch]) -> None:
        with torch.no_grad():
            for b in batches:
                b.target = embed(original, b)

    def loss(self, model: nn.Module, batch: Batch) -> Tensor:
        assert batch.target is not None, "Embedding.prepare(original, batches) first"
        return contrastive_loss(embed(model, batch), batch.target)

    def outputs(self, model: nn.Module, batch: Batch) -> Outputs:
        o = model(**batch.inputs, output_hidden_states=True)
        hidden, att = list(o.hidden_states), batch.inputs["attention_mask"]
        return Outputs(hidden, [att] * len(hidden), mean_pool(hidden[-1], att))

    def output_term(self, student: Outputs, teacher: Outputs) -> Tensor:
        """:func:`contrastive_loss` of the student's embeddings against the teacher's, plus ``1 - cos``."""
        cos = F.cosine_similarity(student.out, teacher.out, dim=-1)  # (B,)
        return contrastive_loss(student.out, teacher.out) + (1 - cos).mean()

    def scores(self, model: nn.Module, batches: Sequence[Batch]) -> Tensor:
        """``model``'s embeddings of the texts of ``batches``, (N, E)."""
        with torch.no_grad():
            return torch.cat([embed(model, b) for b in batches])

    def draws(self, n: int) -> int:
        """Fewer than :data:`BOOTSTRAP_DRAWS` where ``n`` texts make many pairs: each draw ranks all
        ``n (n - 1) / 2`` of them (:data:`BOOTSTRAP_PAIRS` in all, at least :data:`MIN_DRAWS` draws)."""
        pairs = max(1, n * (n - 1) // 2)
        return max(MIN_DRAWS, min(BOOTSTRAP_DRAWS, BOOTSTRAP_PAIRS // pairs))

    def quality_of(self, scores: Tensor, reference: Tensor, pick: Tensor | None = None) -> float:
        """Spearman of the pairwise cosine similarities of ``scores`` (N, E) against ``reference``'s, over the
        pairs of distinct texts among ``pick`` (None: every text)."""
        return spearman(pair_similarities(scores, pick), pair_similarities(reference, pick))


OBJECTIVES: dict[str, type[Objective]] = {
    "encoder": Embedding,
    "decoder": Embedding,
    "masked-lm": MaskedLM,
    "causal-lm": CausalLM,
    "encoder-decoder": Seq2Seq,
}
"""Checkpoint kind (:data:`multihead.commands.model_dir.KINDS`) -> its objective's class."""


def make_batches(
    ids: Sequence[list[int]],
    tokenizer: Any,
    objective: Objective,
    batch_size: int,
    seed: int,
    *,
    mix: bool = False,
) -> list[Batch]:
    """Batches of texts, right-padded, with ``objective``'s labels.

    By default each batch holds texts of similar length (fewer pads). ``mix=True`` deals the texts out in
    an order shuffled by ``seed`` instead, so each batch holds texts of every length: what recovery trains
    on, because the contrastive terms compare a batch's texts with each other, and held-out quality
    compares texts of any lengths. Masks are drawn with a generator seeded by ``seed``: the same call gives
    the same batches every run.
    """
    gen = torch.Generator().manual_seed(seed)
    if mix:
        order = torch.randperm(len(ids), generator=gen).tolist()
    else:
        order = sorted(range(len(ids)), key=lambda i: (len(ids[i]), i))
    pad = _pad_id(tokenizer)
    out = []
    for start in range(0, len(order), batch_size):
        rows = [ids[i] for i in order[start : start + batch_size]]
        width = max(len(r) for r in rows)
        input_ids = torch.full((len(rows), width), pad, dtype=torch.long)  # (B, L)
        attention = torch.zeros(len(rows), width, dtype=torch.long)  # (B, L)
        for b, r in enumerate(rows):
            input_ids[b, : len(r)] = torch.tensor(r)
            attention[b, : len(r)] = 1
        out.append(objective.labels(input_ids, attention, tokenizer, gen))
    return out


def crops(ids: Sequence[list[int]], seed: int, copies: int = 1) -> list[list[int]]:
    """``copies`` random crops of each text: its first and last token (a tokenizer's [CLS] / [SEP] or the
    like) around a contiguous span of 50% to 90% of the tokens between them, drawn with a generator seeded
    by ``seed`` (the same call gives the same crops every run); copy after copy of the texts. Texts with
    fewer than two tokens between their ends are left out.

    What the refit adds to its calibration tokens: more distinct contexts for each projection's fit from
    the same text (partial sentences still read as text). On all-MiniLM-L6-v2 (seed 0,
    ``benchmarks/bench_prune.py``) one crop per text raised the refit stage's validation Spearman by
    +0.0003 to +0.0084 on both real-text corpora at ``--heads`` 0.25 and 0.5, two by +0.0011 to +0.0020 more
    (external held-out: +0.0015 to +0.0186 in all); pairs of texts joined into one lowered it (package-docs at
    0.5: validation 0.9315 -> 0.9283) and dropping 15% of the tokens helped less than crops there.
    """
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(copies):
        for row in ids:
            inner = row[1:-1]
            if len(inner) < 2:
                continue
            k = max(2, int(len(inner) * (0.5 + 0.4 * float(torch.rand(1, generator=gen)))))  # span length
            start = int(torch.randint(0, len(inner) - k + 1, (1,), generator=gen))
            out.append([row[0], *inner[start : start + k], row[-1]])
    return out


def _pad_id(tokenizer: Any) -> int:
    for name in ("pad_token_id", "eos_token_id", "unk_token_id"):
        value = getattr(tokenizer, name, None)
        if isinstance(value, int):
            return value
    return 0


def mean_pool(hidden: Tensor, attention_mask: Tensor) -> Tensor:
    """Mean of the real tokens' vectors: hidden (B, L, E), mask (B, L) -> (B, E)."""
    m = attention_mask.unsqueeze(-1).to(hidden.dtype)  # (B, L, 1)
    return (hidden * m).sum(1) / m.sum(1).clamp_min(1)


def embed(model: nn.Module, batch: Batch) -> Tensor:
    """The model's mean-pooled last hidden state (B, E) (what sentence-embedding models output)."""
    return mean_pool(model(**batch.inputs).last_hidden_state, batch.inputs["attention_mask"])


def contrastive_loss(emb: Tensor, target: Tensor, temperature: float = TEMPERATURE) -> Tensor:
    """In-batch contrastive loss (InfoNCE) of embeddings ``emb`` (B, E) against ``target`` (B, E).

    Text i's embedding must be closer (cosine) to target i than to the batch's other targets:
    ``cross_entropy(cos(emb_i, target_j) / temperature, i)``. At ``emb == target`` its gradient is not
    zero (the softmax is never one-hot), so it scores heads even at the unpruned model.
    """
    logits = F.normalize(emb, dim=-1) @ F.normalize(target, dim=-1).T / temperature  # (B, B)
    return F.cross_entropy(logits, torch.arange(len(emb), device=emb.device))


def _ranks(x: Tensor) -> Tensor:
    """Ranks of ``x`` (N,) from 0, ties given their average rank."""
    values, order = torch.sort(x)
    _, group, counts = torch.unique_consecutive(values, return_inverse=True, return_counts=True)
    first = torch.cumsum(counts, 0) - counts  # each run of equal values: its first rank
    ranks = torch.empty_like(x)
    ranks[order] = (first.to(x.dtype) + (counts.to(x.dtype) - 1) / 2)[group]  # a run's mean rank
    return ranks


def spearman(a: Tensor, b: Tensor) -> float:
    """Spearman rank correlation of two (N,) tensors (Pearson correlation of their average ranks)."""
    ra, rb = _ranks(a.double()), _ranks(b.double())
    ra, rb = ra - ra.mean(), rb - rb.mean()
    denom = (ra.norm() * rb.norm()).item()
    return float((ra @ rb).item() / denom) if denom > 0 else float("nan")


def pair_similarities(emb: Tensor, pick: Tensor | None = None) -> Tensor:
    """Cosine similarity of every pair of rows of ``emb`` (N, E) -> (P,) (upper triangle, row-major); with
    ``pick`` (indices, repeats allowed: a bootstrap draw), of every pair of positions of ``pick`` that name
    distinct rows. Read from the (N, N) Gram matrix, never a (P, E) tensor."""
    if pick is None:
        pick = torch.arange(len(emb))
    i, j = torch.triu_indices(len(pick), len(pick), offset=1)
    distinct = pick[i] != pick[j]  # a row drawn twice is not a pair
    z = F.normalize(emb, dim=-1)
    return (z @ z.T)[pick[i[distinct]], pick[j[distinct]]]  # (P,)
