"""The sequence-to-sequence :class:`Transformer`: embeddings, encoder, decoder, output projection.

Dimensions: B batch, S source length, T target length, E d_model, V target vocabulary, K beams,
N = B*K decoding rows.

``Transformer.generate`` runs the free decoding functions of :mod:`multihead.transformer.decoding`
(greedy, batched beam search) over a cached one-token step of this model.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..core import masks as _masks
from ..core.checks import check_dropout, positive_int
from ..core.masks import check_segment_ids
from ..core.segments import segment_positions
from ..nn.cache import KVCache
from .decoding import beam_search, greedy
from .layers import PositionalEncoding
from .stacks import TransformerDecoder, TransformerEncoder

__all__ = ["Transformer"]


class Transformer(nn.Module):
    """Encoder-decoder Transformer for sequence-to-sequence work (token ids in, logits out).

    Args:
        src_vocab, tgt_vocab: vocabulary sizes.
        d_model, num_heads, d_ff, dropout, activation, norm_first, kv_heads: as in the layers (paper
            defaults: 512, 8, 2048, 0.1, relu, post-norm).
        num_encoder_layers, num_decoder_layers: layers in each stack (paper defaults: 6, 6).
        rotary: rotary embeddings in every self-attention *instead of* the sinusoidal encoding.
        max_len: the longest sequence the positional encoding covers.
        tie_embeddings: share the target embedding matrix with the output projection.
        pad_id: the padding token. When ``src_valid_lens``/``tgt_valid_lens`` are not given, keys equal to
            ``pad_id`` are masked; ``generate`` pads finished rows with it and never emits it. ``None``
            turns both off (then lengths must be passed explicitly).

    Modules: ``src_embed``, ``tgt_embed`` (scaled by sqrt(E) as in the paper), ``pos_encoding``
    (``None`` with rotary), ``encoder``, ``decoder``, ``out_proj`` (E -> V).

    ``model(src, tgt, *, src_valid_lens=None, tgt_valid_lens=None)``: src (B, S), tgt (B, T) long ->
    logits (B, T, tgt_vocab); teacher forcing with ``tgt`` = the shifted target (bos first).
    """

    def __init__(
        self,
        src_vocab: int,
        tgt_vocab: int,
        *,
        d_model: int = 512,
        num_heads: int = 8,
        num_encoder_layers: int = 6,
        num_decoder_layers: int = 6,
        d_ff: int = 2048,
        dropout: float = 0.1,
        activation: str = "relu",
        norm_first: bool = False,
        kv_heads: int | None = None,
        rotary: bool = False,
        max_len: int = 5000,
        tie_embeddings: bool = False,
        pad_id: int | None = 0,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        factory = {"device": device, "dtype": dtype}
        self.d_model = positive_int("d_model", d_model)
        self.src_vocab = positive_int("src_vocab", src_vocab)
        self.tgt_vocab = positive_int("tgt_vocab", tgt_vocab)
        if pad_id is not None and not (isinstance(pad_id, int) and 0 <= pad_id < tgt_vocab):
            raise ValueError(f"pad_id must be None or a token id in [0, {tgt_vocab}), got {pad_id!r}")
        self.pad_id = pad_id
        self.src_embed = nn.Embedding(src_vocab, d_model, **factory)
        self.tgt_embed = nn.Embedding(tgt_vocab, d_model, **factory)
        self.pos_encoding = (
            None if rotary else PositionalEncoding(d_model, dropout=dropout, max_len=max_len, device=device)
        )
        self.embed_dropout = nn.Dropout(check_dropout(dropout))
        layer_args = {
            "dropout": dropout,
            "activation": activation,
            "norm_first": norm_first,
            "kv_heads": kv_heads,
            "rotary": rotary,
            **factory,
        }
        self.encoder = TransformerEncoder(
            d_model, num_heads, d_ff, num_layers=num_encoder_layers, **layer_args
        )
        self.decoder = TransformerDecoder(
            d_model, num_heads, d_ff, num_layers=num_decoder_layers, **layer_args
        )
        self.out_proj = nn.Linear(d_model, tgt_vocab, **factory)
        nn.init.normal_(self.src_embed.weight, std=d_model**-0.5)
        nn.init.normal_(self.tgt_embed.weight, std=d_model**-0.5)
        if tie_embeddings:
            self.out_proj.weight = self.tgt_embed.weight

    # -- building blocks ----------------------------------------------------------------------

    def _embed(
        self, tokens: Tensor, table: nn.Embedding, offset: int = 0, segment_ids: Tensor | None = None
    ) -> Tensor:
        """(B, L) long -> (B, L, E): scaled embedding plus position (or dropout alone with rotary).

        With ``segment_ids`` (B, L) positions restart at 0 in each packed sequence."""
        if not isinstance(tokens, Tensor) or tokens.dim() != 2 or tokens.is_floating_point():
            raise ValueError(
                f"token ids must be an integer tensor (B, L), got "
                f"{tuple(tokens.shape) if isinstance(tokens, Tensor) else type(tokens).__name__}"
            )
        x = table(tokens) * math.sqrt(self.d_model)  # (B, L, E)
        if self.pos_encoding is None:
            return self.embed_dropout(x)
        if segment_ids is not None:
            ids, _ = check_segment_ids(
                segment_ids, tokens.shape[0], tokens.shape[1], tokens.shape[1], tokens.device
            )
            return self.pos_encoding(x, positions=segment_positions(ids))
        return self.pos_encoding(x, offset=offset)

    def _padding(self, tokens: Tensor, valid_lens: Tensor | None) -> dict[str, Tensor | None]:
        """Key padding of ``tokens`` (B, L) as attention keywords: ``valid_lens`` or a pad-id mask."""
        if valid_lens is not None:
            return {"mask": None, "valid_lens": valid_lens}
        if self.pad_id is not None:
            return {
                "mask": _masks.key_padding_from_tokens(tokens, self.pad_id),
                "valid_lens": None,
            }  # (B,1,1,L)
        return {"mask": None, "valid_lens": None}

    def encode(
        self, src: Tensor, *, src_valid_lens: Tensor | None = None, src_segment_ids: Tensor | None = None
    ) -> Tensor:
        """src (B, S) long -> memory (B, S, E); ``src_segment_ids`` (B, S) for packed sources."""
        x = self._embed(src, self.src_embed, segment_ids=src_segment_ids)  # (B, S, E)
        return self.encoder(x, segment_ids=src_segment_ids, **self._padding(src, src_valid_lens))

    def decode(
        self,
        tgt: Tensor,
        memory: Tensor,
        *,
        src: Tensor | None = None,
        src_valid_lens: Tensor | None = None,
        tgt_valid_lens: Tensor | None = None,
        src_segment_ids: Tensor | None = None,
        tgt_segment_ids: Tensor | None = None,
        cache: KVCache | None = None,
    ) -> Tensor:
        """tgt (B, T) long, memory (B, S, E) -> logits (B, T, V).

        The memory's padding comes from ``src_valid_lens`` or, failing that, from the ``src`` tokens
        (pass one of them unless nothing is padded). With a ``cache``, ``tgt`` holds only the new
        positions, which continue those cached; no target padding is applied then. Packed pairs:
        ``tgt_segment_ids`` (B, T) and ``src_segment_ids`` (B, S), target sequence i with source i.
        """
        pad = (
            self._padding(src, src_valid_lens)
            if src is not None
            else {"mask": None, "valid_lens": src_valid_lens}
        )
        if cache is None:
            tgt_pad = self._padding(tgt, tgt_valid_lens)
        else:
            tgt_pad = {"mask": None, "valid_lens": tgt_valid_lens}
        offset = 0 if cache is None else len(cache)
        x = self._embed(tgt, self.tgt_embed, offset, segment_ids=tgt_segment_ids)  # (B, T, E)
        h = self.decoder(
            x,
            memory,
            mask=tgt_pad["mask"],
            valid_lens=tgt_pad["valid_lens"],
            memory_mask=pad["mask"],
            memory_valid_lens=pad["valid_lens"],
            segment_ids=tgt_segment_ids,
            memory_segment_ids=src_segment_ids,
            cache=cache,
        )  # (B, T, E)
        return self.out_proj(h)  # (B, T, V)

    def forward(
        self,
        src: Tensor,
        tgt: Tensor,
        *,
        src_valid_lens: Tensor | None = None,
        tgt_valid_lens: Tensor | None = None,
        src_segment_ids: Tensor | None = None,
        tgt_segment_ids: Tensor | None = None,
    ) -> Tensor:
        """src (B, S), tgt (B, T) long -> logits (B, T, tgt_vocab); ``*_segment_ids`` for packed pairs."""
        memory = self.encode(src, src_valid_lens=src_valid_lens, src_segment_ids=src_segment_ids)  # (B, S, E)
        return self.decode(
            tgt,
            memory,
            src=src,
            src_valid_lens=src_valid_lens,
            tgt_valid_lens=tgt_valid_lens,
            src_segment_ids=src_segment_ids,
            tgt_segment_ids=tgt_segment_ids,
        )

    # -- generation ---------------------------------------------------------------------------

    def _step_logprobs(
        self,
        tokens: Tensor,
        memory: Tensor,
        src: Tensor,
        src_valid_lens: Tensor | None,
        cache: KVCache,
        eos_id: int | None,
    ) -> Tensor:
        """One cached decoding step: tokens (N,) -> next-token log-probabilities (N, V) in float32."""
        logits = self.decode(
            tokens[:, None], memory, src=src, src_valid_lens=src_valid_lens, cache=cache
        )  # (N, 1, V)
        logp = F.log_softmax(logits[:, -1].float(), dim=-1)  # (N, V)
        if self.pad_id is not None and self.pad_id != eos_id:
            logp[:, self.pad_id] = float("-inf")  # padding is never a real output token
        return logp

    @torch.no_grad()
    def generate(
        self,
        src: Tensor,
        *,
        src_valid_lens: Tensor | None = None,
        bos_id: int,
        eos_id: int | None,
        max_len: int = 100,
        beam_size: int = 1,
        length_penalty: float = 1.0,
        return_scores: bool = False,
    ) -> Tensor | tuple[Tensor, Tensor]:
        """Decode ``src`` (B, S) into target token ids (B, T'), greedily or with batched beam search.

        Args:
            src: (B, S) long source ids; ``src_valid_lens`` (B,) or the ``pad_id`` marks padding.
            bos_id: the first decoder input. eos_id: the end token (``None``: always ``max_len`` tokens).
            max_len: the most tokens generated per sequence (eos included).
            beam_size: 1 is greedy; K > 1 keeps the K best hypotheses per source.
            length_penalty: alpha; hypotheses are ranked by ``sum(log p) / length**alpha`` with length =
                generated tokens including eos (0: raw log-probability, 1: mean log-probability).
            return_scores: also return each result's ranking score (B,).

        Returns:
            (B, T') long: generated tokens *without* the bos, ``pad_id`` (or eos when ``pad_id`` is None)
            after eos, T' the longest result. With ``return_scores``: ``(tokens, scores)``.

        Runs in eval mode (dropout off) without gradients, on a :class:`~multihead.KVCache` of
        ``max_len`` positions allocated once: each step embeds one token per row, writes its keys and
        values in place, and the cross-attention keys/values are computed once. Greedy decoding is
        :func:`~multihead.transformer.decoding.greedy`, beam search
        :func:`~multihead.transformer.decoding.beam_search` (beam_size=1 equals greedy decoding).
        """
        positive_int("max_len", max_len)
        positive_int("beam_size", beam_size)
        for name, tok in (("bos_id", bos_id), ("eos_id", eos_id)):
            if tok is not None and not (isinstance(tok, int) and 0 <= tok < self.tgt_vocab):
                raise ValueError(f"{name} must be a token id in [0, {self.tgt_vocab}), got {tok!r}")
        if bos_id is None:
            raise ValueError("bos_id is required: the first decoder input token")
        fill = self.pad_id if self.pad_id is not None else (eos_id if eos_id is not None else 0)
        was_training = self.training
        self.eval()
        try:
            memory = self.encode(src, src_valid_lens=src_valid_lens)  # (B, S, E)
            k = beam_size
            if k > 1:  # every beam row gets its own copy of the source
                memory = memory.repeat_interleave(k, dim=0)  # (B*K, S, E)
                src = src.repeat_interleave(k, dim=0)  # (B*K, S)
                if src_valid_lens is not None:
                    src_valid_lens = src_valid_lens.repeat_interleave(k, dim=0)  # (B*K,)

            def step(tokens: Tensor, cache: KVCache) -> Tensor:  # (N, t) -> (N, V)
                return self._step_logprobs(tokens[:, -1], memory, src, src_valid_lens, cache, eos_id)

            start = torch.full((memory.shape[0] // k,), bos_id, dtype=torch.long, device=memory.device)
            common = {"max_len": max_len, "eos_id": eos_id, "fill": fill, "length_penalty": length_penalty}
            cache = KVCache(max_len=max_len)
            if k == 1:
                res = greedy(step, start, cache=cache, **common)
            else:
                res = beam_search(step, start, beams=k, cache=cache, **common)
        finally:
            self.train(was_training)
        return (res.tokens, res.scores) if return_scores else res.tokens
