"""What the seed notebooks share, as d2l's notebooks share ``d2l``: real text, a small character model around
any attention layer, its training loop and its loss.

Dimensions: B batch, L characters per sentence (padded), E model width, V vocabulary (characters + padding).

The text is real prose the project did not write: the long descriptions of the packages ``requirements-dev.txt``
pins, as installed (``benchmarks/data/corpora.py``, corpus ``package-docs``; nothing is downloaded). The task:
predict each next character of a sentence. Every attention layer in the model sees the same ``valid_lens``
of shape (B, L): query i of sentence b may attend to the keys ``j < min(i + 1, length_b)``, the d2l form
of a causal mask over padded sentences (``valid_lens`` of shape (B, Lq), keys at index >= valid_len hidden).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import Tensor, nn

ROOT = Path(__file__).resolve().parents[1]
PAD = 0
MAX_LEN = 64  # characters per sentence (longer ones are cut)


def tiny() -> bool:
    """True when the notebooks run in the test suite's short form (``MULTIHEAD_NOTEBOOKS=tiny``)."""
    return os.environ.get("MULTIHEAD_NOTEBOOKS", "") == "tiny"


WIDTH, STEPS = (32, 10) if tiny() else (64, 300)  # the model's width E and its training steps
torch.set_num_threads(1)  # models this small train fastest on one thread (and leave the other cores alone)


def _corpora() -> ModuleType:
    """``benchmarks/data/corpora.py``: the project's one rule for cutting real prose into sentences."""
    sys.path.insert(0, str(ROOT / "benchmarks" / "data"))
    try:
        import corpora
    finally:
        sys.path.remove(str(ROOT / "benchmarks" / "data"))
    return corpora


def real_sentences() -> list[str]:
    """Real English sentences: the long descriptions of every installed distribution (corpus
    ``all-package-docs``, about 2,000 sentences here), or, in the short form, of the pinned ones only
    (``package-docs``, about 350)."""
    corpora = _corpora()
    return corpora.CORPORA["package-docs"]() if tiny() else corpora.LARGER["all-package-docs"]()


def split(sentences: list[str]) -> tuple[list[str], list[str]]:
    """``(training, held out)``: every fourth sentence held out (``corpora.split``)."""
    return _corpora().split(sentences)


@dataclass
class Text:
    """Sentences as padded character ids: ``ids`` (N, L) with ``PAD`` = 0 after each sentence's ``lengths``."""

    chars: list[str]  # id i + 1 is chars[i]
    ids: Tensor  # (N, L)
    lengths: Tensor  # (N,)

    @classmethod
    def of(cls, sentences: list[str], chars: list[str] | None = None) -> Text:
        """Encode ``sentences`` (cut to ``MAX_LEN`` characters); ``chars``: an existing vocabulary."""
        chars = chars or sorted(set("".join(sentences)))
        index = {c: i + 1 for i, c in enumerate(chars)}
        rows = [[index[c] for c in s[:MAX_LEN] if c in index] for s in sentences]
        ids = torch.full((len(rows), max(map(len, rows))), PAD)  # (N, L)
        for i, row in enumerate(rows):
            ids[i, : len(row)] = torch.tensor(row)
        return cls(chars, ids, torch.tensor([len(r) for r in rows]))

    def tokens(self, i: int) -> list[str]:
        """Sentence ``i`` as a list of characters (the labels of a head view)."""
        return [self.chars[int(t) - 1] for t in self.ids[i, : int(self.lengths[i])]]

    def batches(
        self, size: int, *, seed: int = 0, count: int | None = None
    ) -> Iterator[tuple[Tensor, Tensor]]:
        """``count`` random batches ``(ids (B, L), lengths (B,))`` (default: one pass in order)."""
        if count is None:
            order = torch.arange(len(self.ids))
        else:
            g = torch.Generator().manual_seed(seed)
            order = torch.randint(len(self.ids), (count * size,), generator=g)
        for start in range(0, len(order), size):
            pick = order[start : start + size]
            longest = int(self.lengths[pick].max())
            yield self.ids[pick, :longest], self.lengths[pick]


def causal_valid_lens(lengths: Tensor, length: int) -> Tensor:
    """(B, L) d2l valid_lens: query i of sentence b sees keys ``j < min(i + 1, lengths[b])``.

    Lengths [3, 2], L = 3 give ``[[1, 2, 3], [1, 2, 2]]``; sentence 1 sees::

        1 0 0
        1 1 0
        1 1 0
    """
    return torch.minimum(torch.arange(1, length + 1)[None, :], lengths[:, None])  # (B, L)


class Block(nn.Module):
    """A pre-norm Transformer block around any attention layer ``attn(x, x, x, valid_lens=...)``."""

    def __init__(self, attn: nn.Module, width: int) -> None:
        super().__init__()
        self.attn = attn
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.ffn = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: Tensor, valid_lens: Tensor) -> Tensor:
        """(B, L, E), valid_lens (B, L) -> (B, L, E)."""
        y = self.norm1(x)
        x = x + self.attn(y, y, y, valid_lens=valid_lens)  # (B, L, E)
        return x + self.ffn(self.norm2(x))  # (B, L, E)


class CharModel(nn.Module):
    """Next-character prediction: embeddings -> ``layers`` blocks ``make_block(i)`` -> logits (B, L, V)."""

    def __init__(
        self, vocab: int, width: int, make_block: Callable[[int], nn.Module], layers: int = 2
    ) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab + 1, width)
        self.position = nn.Embedding(MAX_LEN, width)
        self.blocks = nn.ModuleList(make_block(i) for i in range(layers))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab + 1)

    def forward(self, ids: Tensor, lengths: Tensor) -> Tensor:
        """ids (B, L), lengths (B,) -> logits (B, L, V)."""
        x = self.embed(ids) + self.position.weight[: ids.shape[1]]  # (B, L, E)
        valid_lens = causal_valid_lens(lengths, ids.shape[1])  # (B, L)
        for block in self.blocks:
            x = block(x, valid_lens)
        return self.head(self.norm(x))  # (B, L, V)


def loss(model: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
    """Mean cross-entropy of each next character over the real characters (what ``heads.importance`` takes)."""
    ids, lengths = batch  # (B, L), (B,)
    logits = model(ids[:, :-1], lengths - 1)  # (B, L-1, V)
    return F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten(), ignore_index=PAD)


def evaluate(model: nn.Module, text: Text, size: int = 64) -> float:
    """Mean next-character loss (nats) over every sentence of ``text``."""
    with torch.no_grad():
        parts = [(float(loss(model, b)), len(b[0])) for b in text.batches(size)]
    return sum(v * n for v, n in parts) / sum(n for _, n in parts)


def train(model: nn.Module, text: Text, steps: int, *, batch: int = 32, lr: float = 3e-3) -> list[float]:
    """AdamW on random batches of ``text``; the loss of every step."""
    torch.manual_seed(0)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    model.train()
    for b in text.batches(batch, count=steps):
        value = loss(model, b)
        opt.zero_grad()
        value.backward()
        opt.step()
        losses.append(float(value.detach()))
    return losses


# ------------------------------------------------------------------------------------------------
# d2l's own math (seeds 003 and 004), the reference their notebooks check the library against
# ------------------------------------------------------------------------------------------------


def transpose_qkv(X: Tensor, num_heads: int) -> Tensor:
    """d2l: (B, L, P) -> (B*H, L, P/H)."""
    X = X.reshape(X.shape[0], X.shape[1], num_heads, -1).permute(0, 2, 1, 3)  # (B, H, L, P/H)
    return X.reshape(-1, X.shape[2], X.shape[3])  # (B*H, L, P/H)


def transpose_output(X: Tensor, num_heads: int) -> Tensor:
    """d2l: (B*H, L, P/H) -> (B, L, P), the inverse of :func:`transpose_qkv`."""
    X = X.reshape(-1, num_heads, X.shape[1], X.shape[2]).permute(0, 2, 1, 3)  # (B, L, H, P/H)
    return X.reshape(X.shape[0], X.shape[1], -1)  # (B, L, P)


def masked_softmax(X: Tensor, valid_lens: Tensor) -> Tensor:
    """d2l: softmax over the last axis of X (N, Lq, Lk) with keys ``j >= valid_len`` set to -1e6 first;
    valid_lens (N,) or (N, Lq)."""
    shape = X.shape
    lens = valid_lens.repeat_interleave(shape[1]) if valid_lens.dim() == 1 else valid_lens.reshape(-1)
    hidden = torch.arange(shape[-1])[None, :] >= lens[:, None]  # (N*Lq, Lk)
    return torch.softmax(X.reshape(-1, shape[-1]).masked_fill(hidden, -1e6).reshape(shape), dim=-1)


def d2l_forward(
    layer: nn.Module, queries: Tensor, keys: Tensor, values: Tensor, valid_lens: Tensor
) -> tuple[Tensor, Tensor]:
    """d2l's ``MultiHeadAttention.forward`` (eval mode) with ``layer``'s ``W_q``, ``W_k``, ``W_v``, ``W_o``:
    ``(output (B, Lq, P), weights (B*H, Lq, Lk))``. ``valid_lens`` (B,) or (B, Lq), repeated per head."""
    h = layer.num_heads
    q, k, v = (
        transpose_qkv(layer.W_q(queries), h),
        transpose_qkv(layer.W_k(keys), h),
        transpose_qkv(layer.W_v(values), h),
    )
    weights = masked_softmax(
        q @ k.transpose(1, 2) / q.shape[-1] ** 0.5, valid_lens.repeat_interleave(h, dim=0)
    )
    return layer.W_o(transpose_output(weights @ v, h)), weights  # (B, Lq, P), (B*H, Lq, Lk)
