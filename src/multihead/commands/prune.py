"""``multihead prune``: score a checkpoint's heads on your text, prune them, recover by distillation, save.

Dimensions: B batch, L tokens, E hidden width, V vocabulary, N held-out texts, P = N (N - 1) / 2 pairs.

:func:`run` does, in order (every check before any work, nothing written on a usage error):

1. load the folder on multihead (:func:`multihead.commands.model_dir.load`), read the text (one per line),
   check lengths, hold out every fifth text or so (:func:`split_held_out`, deterministic);
2. score the heads with :func:`multihead.heads.importance` on the training text (up to
   ``Options.score_texts`` texts: on MiniLM, 128 texts gave a noisy ranking, 384 a much better one)
   under the checkpoint's objective
   (:data:`OBJECTIVES`): next-token loss for a causal LM, masked-token loss for a masked LM, denoising
   loss for an encoder-decoder, and for a bare encoder (or decoder) an in-batch contrastive loss of the
   model's mean-pooled embeddings against the *original* model's (:func:`contrastive_loss`; a distance
   to the original output would have zero gradient at the unpruned model, and so no scores);
3. prune the least important heads in a few rounds, rescoring after each (no layer is ever emptied);
4. recover: distil the pruned model toward the original on the same training text, in batches that mix
   lengths (:func:`make_batches` ``mix=True``) (:func:`distill_loss`: per-layer hidden states + the
   objective's output), ``--recover`` steps;
5. measure held-out quality before and after recovery (:func:`quality`), parameters, and the forward
   speed of the original against the pruned model in interleaved rounds (:mod:`multihead.bench.pair`);
6. save the weights (safetensors), config (with ``multihead_heads``), tokenizer and the checkpoint's other
   files, and ``prune_report.json`` / ``prune_report.md``.
"""

from __future__ import annotations

import json
import math
import shutil
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .. import heads as heads_tools
from ..bench.measure import Settings
from ..bench.pair import PAIR_SETTINGS, machine, time_pair
from ..heads.naming import attention_modules, family_of, module_heads
from ..progress import Progress
from . import model_dir

__all__ = [
    "DEFAULT_RECOVER",
    "OBJECTIVES",
    "Batch",
    "Options",
    "PruneError",
    "contrastive_loss",
    "distill_loss",
    "heads_to_prune",
    "objective_loss",
    "quality",
    "read_texts",
    "run",
    "spearman",
    "split_held_out",
]

DEFAULT_RECOVER = 240
"""Default recovery steps: all-MiniLM-L6-v2 (batch 16, short texts) takes about 40 s of a quiet 2-core CPU."""

OBJECTIVES = {
    "encoder": "contrastive",
    "decoder": "contrastive",
    "masked-lm": "masked-token",
    "causal-lm": "next-token",
    "encoder-decoder": "denoising",
}
"""Checkpoint kind -> the objective its heads are scored with (and the output term of the distillation)."""

TEMPERATURE = 0.05  # of the contrastive loss: cosine similarities / 0.05
MASK_RATE = 0.15  # tokens masked for the masked-token and denoising objectives
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".h5", ".msgpack", ".onnx", ".ot", ".pt", ".pth", ".ckpt")
_CACHE_BYTES = 512 * 2**20  # teacher outputs kept between recovery steps up to this size


class PruneError(ValueError):
    """A usage error of ``multihead prune``: one line, printed without a traceback (exit status 2)."""


@dataclass
class Options:
    """What ``multihead prune`` was asked to do (strings as typed: :func:`run` validates them)."""

    model_dir: str | Path
    data: str | Path
    heads: str
    out: str | Path
    recover: int | str | None = None  # None: DEFAULT_RECOVER
    truncate: bool = False
    batch_size: int = 16
    lr: float = 2e-4
    rounds: int = 3  # prune in this many score -> prune rounds
    held_out: float = 0.2
    score_texts: int = 512  # training texts the importance scores are computed on (at most)
    seed: int = 0
    progress: bool = True
    timing: Settings = PAIR_SETTINGS


# ------------------------------------------------------------------------------------------------
# Inputs
# ------------------------------------------------------------------------------------------------


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


def heads_to_prune(value: float | int, counts: dict[str, int]) -> int:
    """How many heads ``--heads value`` prunes out of ``counts`` ({module: H}); no module may lose all."""
    total, most = sum(counts.values()), sum(counts.values()) - len(counts)
    n = max(1, round(value * total)) if isinstance(value, float) else value
    if n > most:
        asked = f"{value} of {total} heads = {n}" if isinstance(value, float) else f"{n} of {total} heads"
        raise PruneError(
            f"--heads {value}: pruning {asked} would empty a layer (each of the {len(counts)} attention "
            f"layers keeps at least one head, so at most {most} can go)"
        )
    return n


def split_held_out(texts: Sequence[str], fraction: float) -> tuple[list[str], list[str]]:
    """``(train, held out)``: ``max(3, round(fraction * n))`` texts evenly spaced through the file are held out."""
    n = len(texts)
    n_held = max(3, round(fraction * n))
    if n < n_held + 2:
        raise PruneError(
            f"--data: {n} text(s) is too few: need at least {n_held + 2} (3 held out to measure quality, "
            f"2 to score and recover on)"
        )
    held = {int((i + 0.5) * n / n_held) for i in range(n_held)}
    return [t for i, t in enumerate(texts) if i not in held], [t for i, t in enumerate(texts) if i in held]


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


# ------------------------------------------------------------------------------------------------
# Batches and objectives
# ------------------------------------------------------------------------------------------------


@dataclass
class Batch:
    """One batch: the model's inputs, the LM labels (-100 = ignored) or the original model's embeddings."""

    inputs: dict[str, Tensor]  # input_ids (B, L), attention_mask (B, L)
    labels: Tensor | None = None  # (B, L) for the LM objectives
    target: Tensor | None = None  # (B, E) the original model's mean-pooled embeddings (contrastive)


def _pad_id(tokenizer: Any) -> int:
    for name in ("pad_token_id", "eos_token_id", "unk_token_id"):
        value = getattr(tokenizer, name, None)
        if isinstance(value, int):
            return value
    return 0


def make_batches(
    ids: Sequence[list[int]], tokenizer: Any, objective: str, batch_size: int, seed: int, *, mix: bool = False
) -> list[Batch]:
    """Batches of texts, right-padded; labels for the LM objectives.

    By default each batch holds texts of similar length (fewer pads). ``mix=True`` deals the texts out in
    an order shuffled by ``seed`` instead, so each batch holds texts of every length: what recovery trains
    on, because the contrastive terms compare a batch's texts with each other, and held-out quality
    compares texts of any lengths. Masked-token and denoising objectives mask ``MASK_RATE`` of each
    text's non-special tokens (at least one), chosen with a generator seeded by ``seed``: the same call
    gives the same batches every run.
    """
    gen = torch.Generator().manual_seed(seed)
    if mix:
        order = torch.randperm(len(ids), generator=gen).tolist()
    else:
        order = sorted(range(len(ids)), key=lambda i: (len(ids[i]), i))
    pad = _pad_id(tokenizer)
    special = set(getattr(tokenizer, "all_special_ids", []))
    mask_id = getattr(tokenizer, "mask_token_id", None)
    out = []
    for start in range(0, len(order), batch_size):
        rows = [ids[i] for i in order[start : start + batch_size]]
        width = max(len(r) for r in rows)
        input_ids = torch.full((len(rows), width), pad, dtype=torch.long)  # (B, L)
        attention = torch.zeros(len(rows), width, dtype=torch.long)  # (B, L)
        for b, r in enumerate(rows):
            input_ids[b, : len(r)] = torch.tensor(r)
            attention[b, : len(r)] = 1
        labels = None
        if objective == "next-token":
            labels = input_ids.masked_fill(attention == 0, -100)
        elif objective in ("masked-token", "denoising"):
            real = attention.bool() & ~torch.isin(input_ids, torch.tensor(sorted(special), dtype=torch.long))
            pick = (torch.rand(input_ids.shape, generator=gen) < MASK_RATE) & real  # (B, L)
            first = real & (real.long().cumsum(1) == 1)  # each text's first ordinary token
            pick |= first & ~pick.any(1, keepdim=True)  # at least one masked token per text
            if objective == "masked-token":
                labels = input_ids.masked_fill(~pick, -100)
            else:
                labels = input_ids.masked_fill(attention == 0, -100)
            if mask_id is not None:
                input_ids = input_ids.masked_fill(pick, mask_id)
        out.append(Batch({"input_ids": input_ids, "attention_mask": attention}, labels))
    return out


def mean_pool(hidden: Tensor, attention_mask: Tensor) -> Tensor:
    """Mean of the real tokens' vectors: hidden (B, L, E), mask (B, L) -> (B, E)."""
    m = attention_mask.unsqueeze(-1).to(hidden.dtype)  # (B, L, 1)
    return (hidden * m).sum(1) / m.sum(1).clamp_min(1)


def embed(model: nn.Module, batch: Batch) -> Tensor:
    """The model's mean-pooled last hidden state (B, E) (what sentence-embedding models output)."""
    out = model(**batch.inputs)
    return mean_pool(out.last_hidden_state, batch.inputs["attention_mask"])


def contrastive_loss(emb: Tensor, target: Tensor, temperature: float = TEMPERATURE) -> Tensor:
    """In-batch contrastive loss (InfoNCE) of embeddings ``emb`` (B, E) against ``target`` (B, E).

    Text i's embedding must be closer (cosine) to target i than to the batch's other targets:
    ``cross_entropy(cos(emb_i, target_j) / temperature, i)``. At ``emb == target`` its gradient is not
    zero (the softmax is never one-hot), so it scores heads even at the unpruned model.
    """
    logits = F.normalize(emb, dim=-1) @ F.normalize(target, dim=-1).T / temperature  # (B, B)
    return F.cross_entropy(logits, torch.arange(len(emb), device=emb.device))


def objective_loss(objective: str) -> Callable[[nn.Module, Batch], Tensor]:
    """``loss_fn(model, batch)`` of ``objective`` (a value of :data:`OBJECTIVES`), for head importance."""
    if objective == "contrastive":

        def loss_fn(model: nn.Module, batch: Batch) -> Tensor:
            assert batch.target is not None
            return contrastive_loss(embed(model, batch), batch.target)

        return loss_fn

    def lm_loss(model: nn.Module, batch: Batch) -> Tensor:
        return model(**batch.inputs, labels=batch.labels).loss

    return lm_loss


def add_targets(model: nn.Module, batches: Sequence[Batch]) -> None:
    """Store the (original) model's embeddings in each batch's ``target`` (contrastive objective)."""
    with torch.no_grad():
        for b in batches:
            b.target = embed(model, b)


# ------------------------------------------------------------------------------------------------
# Choosing and pruning heads
# ------------------------------------------------------------------------------------------------


def check_prunable(model: nn.Module) -> dict[str, int]:
    """``{module: H}`` of every attention module; :class:`PruneError` if one cannot be pruned."""
    modules = attention_modules(model)
    if not modules:
        raise PruneError(f"{type(model).__name__} has no attention module that runs on multihead")
    for name, m in modules.items():
        family = family_of(m)
        if family is not None:
            try:
                family.check_prunable(name, m)
            except ValueError as e:
                raise PruneError(str(e).splitlines()[0]) from e
    return {name: module_heads(m)[0] for name, m in modules.items()}


def choose_and_prune(
    model: nn.Module,
    batches: Sequence[Batch],
    loss_fn: Callable[[nn.Module, Batch], Tensor],
    n: int,
    rounds: int,
    bar: Progress | None,
) -> tuple[nn.Module, dict[str, list[int]]]:
    """Prune ``n`` heads in ``rounds`` rounds: score (importance), prune the least important, repeat.

    Returns the pruned copy and the removed heads per module, as indices of the original model.
    """
    current = model
    origin = {name: list(range(h)) for name, h in heads_tools.head_counts(model).items()}  # now -> original
    removed: dict[str, list[int]] = {name: [] for name in origin}
    rounds = max(1, min(rounds, n))
    for r in range(rounds):
        k = n * (r + 1) // rounds - n * r // rounds
        score = heads_tools.importance(current, _counted(batches, bar), loss_fn)
        left = heads_tools.head_counts(current)
        drop: dict[str, list[int]] = {}
        for name, h in heads_tools.rank(score):
            if k == 0:
                break
            if left[name] - len(drop.get(name, [])) > 1:
                drop.setdefault(name, []).append(h)
                k -= 1
        for name, hs in drop.items():
            removed[name] += [origin[name][h] for h in hs]
            origin[name] = [o for i, o in enumerate(origin[name]) if i not in hs]
        current = heads_tools.prune(current, drop)
    return current, {k: sorted(v) for k, v in removed.items() if v}


def _counted(batches: Sequence[Batch], bar: Progress | None) -> Iterator[Batch]:
    for b in batches:
        yield b
        if bar is not None:
            bar.update(1)


# ------------------------------------------------------------------------------------------------
# Recovery by distillation
# ------------------------------------------------------------------------------------------------


@dataclass
class Outputs:
    """What distillation compares: hidden states (each (B, L', E)) with their token masks, and the output."""

    hidden: list[Tensor]
    masks: list[Tensor]  # (B, L') each, 1 = a real token
    out: Tensor  # (B, E) embeddings (contrastive) or (B, L, V) logits (LM objectives)


def outputs(model: nn.Module, batch: Batch, objective: str) -> Outputs:
    """Run ``model`` on ``batch`` with every layer's hidden states (encoder and decoder for seq2seq)."""
    att = batch.inputs["attention_mask"]
    if objective == "denoising":
        o = model(**batch.inputs, labels=batch.labels, output_hidden_states=True)
        dec = (batch.labels != -100).long()  # type: ignore[union-attr]
        hidden = [*o.encoder_hidden_states, *o.decoder_hidden_states]
        masks = [att] * len(o.encoder_hidden_states) + [dec] * len(o.decoder_hidden_states)
        return Outputs(hidden, masks, o.logits)
    o = model(**batch.inputs, output_hidden_states=True)
    hidden = list(o.hidden_states)
    out = mean_pool(hidden[-1], att) if objective == "contrastive" else o.logits
    return Outputs(hidden, [att] * len(hidden), out)


def distill_loss(student: Outputs, teacher: Outputs, objective: str) -> Tensor:
    """Distillation loss of the pruned model toward the original.

    Per-layer hidden states: mean squared error over real tokens, divided by the teacher's mean square
    (so every layer counts alike), averaged over layers; plus the output term: for the contrastive
    objective, :func:`contrastive_loss` of the student's embeddings against the teacher's plus
    ``1 - cos``; for the LM objectives, KL(teacher || student) of the next-token distributions over real
    tokens.
    """
    terms = []
    for s, t, m in zip(student.hidden, teacher.hidden, teacher.masks, strict=True):
        w = m.unsqueeze(-1).to(s.dtype)  # (B, L', 1)
        err = ((s - t) ** 2 * w).sum() / (t**2 * w).sum().clamp_min(1e-12)
        terms.append(err)
    loss = torch.stack(terms).mean()
    if objective == "contrastive":
        cos = F.cosine_similarity(student.out, teacher.out, dim=-1)  # (B,)
        return loss + contrastive_loss(student.out, teacher.out) + (1 - cos).mean()
    m = teacher.masks[-1].bool()  # (B, L)
    log_s = F.log_softmax(student.out[m], dim=-1)  # (n, V)
    log_t = F.log_softmax(teacher.out[m], dim=-1)  # (n, V)
    return loss + F.kl_div(log_s, log_t, log_target=True, reduction="batchmean")


def recover(
    student: nn.Module,
    teacher: nn.Module,
    batches: Sequence[Batch],
    objective: str,
    steps: int,
    opts: Options,
    bar: Progress | None,
) -> list[float]:
    """Distil ``student`` toward ``teacher`` for ``steps`` AdamW steps; returns the losses.

    Token embeddings stay frozen (the pruned heads never changed them); dropout is off (eval mode);
    learning rate: linear warm-up over the first 10% of the steps, then linear decay to zero.
    """
    params = [p for n, p in student.named_parameters() if "embeddings" not in n and "embed_tokens" not in n]
    for p in student.parameters():
        p.requires_grad_(False)
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.AdamW(params, lr=opts.lr, weight_decay=0.0)
    warm = max(1, steps // 10)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: (s + 1) / warm if s < warm else max(0.0, (steps - s) / max(1, steps - warm))
    )
    gen = torch.Generator().manual_seed(opts.seed)
    cache: dict[int, Outputs] = {}
    cached_bytes = 0
    order: list[int] = []
    losses = []
    student.eval()
    for _ in range(steps):
        if not order:
            order = torch.randperm(len(batches), generator=gen).tolist()
        i = order.pop()
        t = cache.get(i)
        if t is None:
            with torch.no_grad():
                t = outputs(teacher, batches[i], objective)
            size = sum(h.numel() for h in t.hidden) * 4 + t.out.numel() * 4
            if cached_bytes + size <= _CACHE_BYTES:
                cache[i], cached_bytes = t, cached_bytes + size
        loss = distill_loss(outputs(student, batches[i], objective), t, objective)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        losses.append(float(loss.detach()))
        if bar is not None:
            bar.update(1, loss=f"{losses[-1]:.4f}")
    for p in student.parameters():
        p.requires_grad_(True)
    return losses


# ------------------------------------------------------------------------------------------------
# Quality
# ------------------------------------------------------------------------------------------------


def _ranks(x: Tensor) -> Tensor:
    """Ranks of ``x`` (N,) from 0, ties given their average rank."""
    order = torch.argsort(x)
    r = torch.empty_like(x)
    r[order] = torch.arange(len(x), dtype=x.dtype)
    uniq, inv = torch.unique(x, return_inverse=True)
    sums = torch.zeros(len(uniq), dtype=x.dtype).index_add_(0, inv, r)
    return (sums / torch.bincount(inv, minlength=len(uniq)).to(x.dtype))[inv]


def spearman(a: Tensor, b: Tensor) -> float:
    """Spearman rank correlation of two (N,) tensors (Pearson correlation of their average ranks)."""
    ra, rb = _ranks(a.double()), _ranks(b.double())
    ra, rb = ra - ra.mean(), rb - rb.mean()
    denom = (ra.norm() * rb.norm()).item()
    return float((ra @ rb).item() / denom) if denom > 0 else float("nan")


def pair_similarities(emb: Tensor) -> Tensor:
    """Cosine similarity of every pair of rows of ``emb`` (N, E) -> (P,) (upper triangle, row-major)."""
    z = F.normalize(emb, dim=-1)
    i, j = torch.triu_indices(len(emb), len(emb), offset=1)
    return (z[i] * z[j]).sum(-1)  # (P,)


@dataclass
class Evaluation:
    """Held-out quality of a pruned model: ``value`` (see ``metric``) and the raw loss when there is one."""

    metric: str
    value: float
    loss: float | None = None


def _held_loss(model: nn.Module, batches: Sequence[Batch]) -> float:
    """Token-weighted mean objective loss over ``batches`` (LM objectives)."""
    total, count = 0.0, 0
    with torch.no_grad():
        for b in batches:
            n = int((b.labels != -100).sum())  # type: ignore[union-attr]
            total += float(model(**b.inputs, labels=b.labels).loss) * n
            count += n
    return total / max(1, count)


def quality(
    model: nn.Module, reference: nn.Module | Tensor | float, batches: Sequence[Batch], objective: str
) -> Evaluation:
    """Held-out quality of ``model`` against the original.

    Contrastive objective (encoders): Spearman rank correlation of ``model``'s pairwise cosine
    similarities with the original's over the held-out texts (1.0 = the same order). ``reference``: the
    original's held-out embeddings (N, E). LM objectives: held-out perplexity ratio
    ``exp(loss - original loss)`` (1.0 = unchanged, higher is worse); ``reference``: the original's loss.
    """
    if objective == "contrastive":
        with torch.no_grad():
            emb = torch.cat([embed(model, b) for b in batches])  # (N, E)
        assert isinstance(reference, Tensor)
        return Evaluation(
            "spearman of pairwise similarities",
            spearman(pair_similarities(emb), pair_similarities(reference)),
        )
    loss = _held_loss(model, batches)
    assert isinstance(reference, float)
    return Evaluation("perplexity ratio", math.exp(loss - reference), loss)


# ------------------------------------------------------------------------------------------------
# The command
# ------------------------------------------------------------------------------------------------


def _params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def _check_out(out: Path) -> None:
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise PruneError(f"--out {out}: exists and is not an empty folder; name a new folder")


def _recover_steps(value: int | str | None) -> int:
    if value is None:
        return DEFAULT_RECOVER
    try:
        steps = int(value)
    except (TypeError, ValueError):
        steps = -1
    if steps < 0 or str(value).strip() != str(steps):
        raise PruneError(f"--recover must be a number of steps >= 0 (0 = no recovery), got {value!r}")
    return steps


def _speed_batch(ids: Sequence[list[int]], tokenizer: Any) -> Batch:
    """Up to 32 of the texts, padded to the longest: the one batch both models are timed on."""
    chosen = sorted(ids, key=len)[-32:]
    return make_batches(chosen, tokenizer, "contrastive", len(chosen), 0)[0]


def _save(out: Path, loaded: Any, model: nn.Module, report: dict[str, Any]) -> None:
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


def markdown(report: dict[str, Any]) -> str:
    """The report as markdown: what was pruned, the before/after table, where the numbers came from."""
    q = report["quality"]
    s = report["speed"]
    direction = (
        "1.0 = same order as the original"
        if "spearman" in q["metric"]
        else "1.0 = unchanged, higher is worse"
    )
    rows = [
        ("heads", f"{report['heads_before']}", f"{report['heads_after']}"),
        ("parameters", f"{report['params_before']:,}", f"{report['params_after']:,}"),
        (
            f"forward time ({s['batch']} texts x {s['tokens']} tokens)",
            f"{s['original_ms']:.1f} ms",
            f"{s['pruned_ms']:.1f} ms (speed-up {s['speedup']:.2f}x [{s['speedup_q1']:.2f}, {s['speedup_q3']:.2f}])",
        ),
        (
            f"held-out {q['metric']}",
            "1.0 (reference)",
            f"{q['after_prune']:.4f} pruned, {q['after_recovery']:.4f} recovered",
        ),
    ]
    lines = [
        f"# multihead prune: {report['model']}",
        "",
        f"{report['kind']} checkpoint, objective: {report['objective']}; pruned {report['pruned_count']} of "
        f"{report['heads_before']} heads (`--heads {report['heads_arg']}`), recovery {report['recover_steps']} "
        f"steps; {report['texts_train']} texts to score and recover on, {report['texts_held_out']} held out.",
        "",
        "| | original | pruned |",
        "|---|---|---|",
        *(f"| {a} | {b} | {c} |" for a, b, c in rows),
        "",
        f"Quality: {q['metric']} on the held-out texts ({direction}). Speed: forward passes of the two "
        f"models in {s['rounds']} interleaved rounds on the same batch; median and interquartile range of the "
        f"per-round ratios. Machine: {report['machine']}. Took {report['seconds']:.0f} s.",
        "",
        "## Heads removed (original indices)",
        "",
        "| module | removed | left |",
        "|---|---|---|",
        *(
            f"| {name} | {', '.join(map(str, report['removed'].get(name, []))) or '-'} | {left} |"
            for name, left in report["heads_left"].items()
        ),
    ]
    return "\n".join(lines) + "\n"


def run(opts: Options, *, echo: Callable[[str], None] = print) -> dict[str, Any]:
    """Run ``multihead prune``; returns the report (also written under ``opts.out``).

    Raises :class:`PruneError` (a usage error, one line) before writing anything, for: a folder that is
    not a checkpoint, a missing/unreadable/empty data file or too few texts, ``--heads`` out of range or
    emptying a layer, ``--recover`` < 0, a text longer than the model takes without ``truncate``, a
    non-empty ``out``, an architecture whose heads cannot be pruned.
    """
    started = time.perf_counter()
    out = Path(opts.out)
    value = parse_heads(opts.heads)
    steps = _recover_steps(opts.recover)
    _check_out(out)
    texts = read_texts(opts.data)
    train_texts, held_texts = split_held_out(texts, opts.held_out)
    try:
        loaded = model_dir.load(opts.model_dir)
    except model_dir.NotACheckpoint as e:
        raise PruneError(str(e)) from e
    original = loaded.model.eval()
    counts = check_prunable(original)
    n = heads_to_prune(value, counts)
    objective = OBJECTIVES[loaded.kind]
    train_ids = encode(loaded.tokenizer, train_texts, loaded.max_length, opts.truncate)
    held_ids = encode(loaded.tokenizer, held_texts, loaded.max_length, opts.truncate)
    # every usage check is done: from here on the work
    total = sum(counts.values())
    echo(
        f"{loaded.path}: {loaded.kind} ({type(original).__name__}), {total} heads in {len(counts)} layers; "
        f"objective: {objective}; pruning {n} heads; {len(train_texts)} texts to score and recover on, "
        f"{len(held_texts)} held out"
    )
    train = make_batches(train_ids, loaded.tokenizer, objective, opts.batch_size, opts.seed)
    mixed = make_batches(train_ids, loaded.tokenizer, objective, opts.batch_size, opts.seed + 2, mix=True)
    held = make_batches(held_ids, loaded.tokenizer, objective, opts.batch_size, opts.seed + 1)
    score_batches = _score_subset(train, opts.score_texts)
    if objective == "contrastive":
        add_targets(original, score_batches)
        add_targets(original, held)
        if steps:
            add_targets(original, mixed)
        reference: Tensor | float = torch.cat([b.target for b in held])  # type: ignore[misc]
    else:
        reference = _held_loss(original, held)
    torch.manual_seed(opts.seed)
    rounds = max(1, min(opts.rounds, n))
    with Progress(rounds * len(score_batches), "score", enabled=opts.progress) as bar:
        pruned, removed = choose_and_prune(original, score_batches, objective_loss(objective), n, rounds, bar)
    before = quality(pruned, reference, held, objective)
    echo(f"pruned {n} heads: held-out {before.metric} {before.value:.4f} before recovery")
    losses: list[float] = []
    if steps:
        with Progress(steps, "recover", enabled=opts.progress) as bar:
            losses = recover(pruned, original, mixed, objective, steps, opts, bar)
    pruned.eval()
    after = quality(pruned, reference, held, objective) if steps else before
    echo(f"held-out {after.metric} {after.value:.4f} after {steps} recovery steps")
    speed = _speed(original, pruned, train_ids + held_ids, loaded.tokenizer, opts)
    report = {
        "model": str(loaded.path),
        "kind": loaded.kind,
        "model_class": type(original).__name__,
        "objective": objective,
        "heads_arg": str(opts.heads),
        "pruned_count": n,
        "heads_before": total,
        "heads_after": sum(heads_tools.head_counts(pruned).values()),
        "heads_left": heads_tools.head_counts(pruned),
        "removed": removed,
        "params_before": _params(original),
        "params_after": _params(pruned),
        "recover_steps": steps,
        "recover_loss_first_last": [losses[0], losses[-1]] if losses else None,
        "texts_train": len(train_texts),
        "texts_held_out": len(held_texts),
        "quality": {
            "metric": before.metric,
            "after_prune": before.value,
            "after_recovery": after.value,
            "original_loss": reference if isinstance(reference, float) else None,
        },
        "speed": speed,
        "machine": machine().words(),
        "seconds": time.perf_counter() - started,
    }
    _save(out, loaded, pruned, report)
    echo(markdown(report))
    echo(f"wrote {out}/ (model.safetensors, config.json, tokenizer, prune_report.json, prune_report.md)")
    return report


def _score_subset(batches: list[Batch], texts: int) -> list[Batch]:
    """Batches spread through ``batches`` holding about ``texts`` texts in all (scoring need not see all)."""
    per = max(1, len(batches[0].inputs["input_ids"]))
    k = max(1, min(len(batches), math.ceil(texts / per)))
    return [batches[int((i + 0.5) * len(batches) / k)] for i in range(k)]


def _speed(
    original: nn.Module, pruned: nn.Module, ids: list[list[int]], tokenizer: Any, opts: Options
) -> dict:
    """Forward time of both models on one batch, interleaved rounds (:func:`multihead.bench.pair.time_pair`)."""
    batch = _speed_batch(ids, tokenizer)
    b, length = batch.inputs["input_ids"].shape
    with Progress(opts.timing.max_rounds + opts.timing.warmup, "time", enabled=opts.progress) as bar:
        timing = time_pair(
            lambda: original(**batch.inputs),
            lambda: pruned(**batch.inputs),
            settings=opts.timing,
            note=lambda _: bar.update(1),
        )
    return {
        "batch": b,
        "tokens": length,
        "rounds": timing.speedup.n,
        "original_ms": timing.first_s.median * 1e3,
        "pruned_ms": timing.second_s.median * 1e3,
        "speedup": timing.speedup.median,
        "speedup_q1": timing.speedup.q1,
        "speedup_q3": timing.speedup.q3,
    }


def options_from(args: Any) -> Options:
    """:class:`Options` from the CLI's parsed arguments."""
    return Options(
        model_dir=args.model_dir,
        data=args.data,
        heads=args.heads,
        out=args.out,
        recover=args.recover,
        truncate=args.truncate,
        progress=True,
    )
