"""The Transformer on :class:`~multihead.MultiHeadAttention`: encodings, blocks, stacks, seq2seq, decoding.

Dimensions: B batch, S source length, T target length, E d_model, F d_ff, V vocabulary size,
K beams, N = B*K decoding rows.

* :class:`PositionalEncoding` -- the paper's sinusoids (with an ``offset`` for cached steps);
* :class:`FeedForward` -- Linear(E, F) -> ReLU/GELU -> dropout -> Linear(F, E);
* :class:`TransformerEncoderLayer`, :class:`TransformerDecoderLayer` -- post-norm as in the paper
  (``norm_first=False``) or pre-norm; parameter names follow ``torch.nn.TransformerEncoderLayer``/
  ``DecoderLayer`` except that the feed-forward lives in ``.ff`` and torch's ``multihead_attn`` is
  ``.cross_attn``; ``from_torch``/``to_torch`` copy exact weights;
* :class:`TransformerEncoder`, :class:`TransformerDecoder` -- stacks of N layers (6 by default), with a
  final LayerNorm for pre-norm stacks;
* :class:`Transformer` -- embeddings, encoder, decoder and output projection for sequence-to-sequence
  work, with :meth:`Transformer.generate` (greedy and batched beam search on a :class:`~multihead.KVCache`).

Masks follow the library's one convention (bool True = may attend, ``valid_lens`` hide keys at
index >= valid_len); decoder self-attention is causal.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..core import masks as _masks
from ..core.checks import check_dropout, is_int, positive_int
from ..nn.attention import MultiHeadAttention
from ..nn.cache import KVCache

__all__ = [
    "FeedForward",
    "PositionalEncoding",
    "Transformer",
    "TransformerDecoder",
    "TransformerDecoderLayer",
    "TransformerEncoder",
    "TransformerEncoderLayer",
]

_ACTIVATIONS: dict[str, Callable[[Tensor], Tensor]] = {"relu": F.relu, "gelu": F.gelu}


def _check_activation(activation: str) -> str:
    if activation not in _ACTIVATIONS:
        raise ValueError(f"activation must be one of {sorted(_ACTIVATIONS)}, got {activation!r}")
    return activation


# ----------------------------------------------------------------------------------------------
# Positional encoding and feed-forward
# ----------------------------------------------------------------------------------------------


class PositionalEncoding(nn.Module):
    """Sinusoidal positional encoding of "Attention Is All You Need", followed by dropout.

    ``PE[p, 2i] = sin(p / 10000**(2i/E))`` and ``PE[p, 2i+1] = cos(p / 10000**(2i/E))``.

    Args:
        d_model: E (odd sizes work: the last cosine column is dropped).
        dropout: dropout applied to ``x + PE`` in training mode.
        max_len: the longest position + 1 that can be encoded.

    ``pe(x, offset=0)`` with x (B, L, E) returns ``dropout(x + PE[offset : offset + L])`` (B, L, E); a
    cached decoding step passes ``offset`` = the number of positions already decoded.
    """

    def __init__(
        self,
        d_model: int,
        *,
        dropout: float = 0.0,
        max_len: int = 5000,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.d_model = positive_int("d_model", d_model)
        self.max_len = positive_int("max_len", max_len)
        self.dropout = nn.Dropout(check_dropout(dropout))
        pos = torch.arange(max_len, dtype=torch.float64, device=device)[:, None]  # (max_len, 1)
        freq = torch.exp(
            torch.arange(0, d_model, 2, dtype=torch.float64, device=device) * (-math.log(10000.0) / d_model)
        )  # (ceil(E/2),)
        pe = torch.zeros(max_len, d_model, dtype=torch.float64, device=device)  # (max_len, E)
        pe[:, 0::2] = torch.sin(pos * freq)
        pe[:, 1::2] = torch.cos(pos * freq[: d_model // 2])
        self.register_buffer("pe", pe.float(), persistent=False)  # (max_len, E)

    def extra_repr(self) -> str:
        return f"d_model={self.d_model}, max_len={self.max_len}"

    def forward(self, x: Tensor, *, offset: int = 0) -> Tensor:
        """x (B, L, E) -> dropout(x + PE[offset : offset + L]), (B, L, E)."""
        if x.dim() != 3 or x.shape[-1] != self.d_model:
            raise ValueError(f"x must have shape (B, L, {self.d_model}), got {tuple(x.shape)}")
        if not is_int(offset, 0):
            raise ValueError(f"offset must be a non-negative int, got {offset!r}")
        end = offset + x.shape[1]
        if end > self.max_len:
            raise ValueError(
                f"positions up to {end - 1} requested but max_len={self.max_len}; build the "
                f"PositionalEncoding (or Transformer) with max_len >= {end}"
            )
        return self.dropout(x + self.pe[offset:end].to(x.dtype))  # (B, L, E)


class FeedForward(nn.Module):
    """Position-wise feed-forward: ``linear2(dropout(activation(linear1(x))))``, (B, L, E) -> (B, L, E).

    Args:
        d_model: E. d_ff: F, the hidden size (2048 for E = 512 in the paper).
        dropout: on the hidden activations, in training mode.
        activation: ``"relu"`` or ``"gelu"`` (exact GELU, as ``torch.nn.functional.gelu``).
        bias: biases on both linear layers.
    """

    def __init__(
        self,
        d_model: int,
        d_ff: int = 2048,
        *,
        dropout: float = 0.0,
        activation: str = "relu",
        bias: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        factory = {"device": device, "dtype": dtype}
        self.activation = _check_activation(activation)
        self.linear1 = nn.Linear(
            positive_int("d_model", d_model), positive_int("d_ff", d_ff), bias=bias, **factory
        )
        self.dropout = nn.Dropout(check_dropout(dropout))
        self.linear2 = nn.Linear(d_ff, d_model, bias=bias, **factory)

    def extra_repr(self) -> str:
        return f"activation={self.activation!r}"

    def forward(self, x: Tensor) -> Tensor:
        """(B, L, E) -> (B, L, E)."""
        return self.linear2(self.dropout(_ACTIVATIONS[self.activation](self.linear1(x))))


# ----------------------------------------------------------------------------------------------
# Layers
# ----------------------------------------------------------------------------------------------

# torch.nn.Transformer*Layer parameter names -> ours (and back).
_TORCH_NAMES = (("linear1.", "ff.linear1."), ("linear2.", "ff.linear2."), ("multihead_attn.", "cross_attn."))


def _rename(key: str, to_ours: bool) -> str:
    for theirs, ours in _TORCH_NAMES:
        src, dst = (theirs, ours) if to_ours else (ours, theirs)
        if key.startswith(src):
            return dst + key[len(src) :]
    return key


def _torch_activation(layer: nn.Module) -> str:
    act = layer.activation
    if act is F.relu or isinstance(act, nn.ReLU):
        return "relu"
    if act is F.gelu or (isinstance(act, nn.GELU) and act.approximate == "none"):
        return "gelu"
    raise ValueError(
        f"only ReLU and exact GELU activations can be loaded, got {act!r}; build the torch layer with "
        f"activation='relu' or 'gelu'"
    )


class _Layer(nn.Module):
    """Shared parts of the encoder and decoder layers: FFN, norms, dropouts, residual wiring, interop."""

    _torch_cls: type[nn.Module]
    num_norms: int
    has_cross_attn: bool

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        d_ff: int = 2048,
        *,
        dropout: float = 0.1,
        activation: str = "relu",
        norm_first: bool = False,
        kv_heads: int | None = None,
        rotary: bool = False,
        layer_norm_eps: float = 1e-5,
        bias: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        factory = {"device": device, "dtype": dtype}
        self.d_model = positive_int("d_model", d_model)
        self.norm_first = bool(norm_first)
        dropout = check_dropout(dropout)
        self.self_attn = MultiHeadAttention(
            d_model, num_heads, kv_heads=kv_heads, bias=bias, dropout=dropout, rotary=rotary, **factory
        )
        self.ff = FeedForward(d_model, d_ff, dropout=dropout, activation=activation, bias=bias, **factory)
        for i in range(1, self.num_norms + 1):
            setattr(self, f"norm{i}", nn.LayerNorm(d_model, eps=layer_norm_eps, bias=bias, **factory))
            setattr(self, f"dropout{i}", nn.Dropout(dropout))
        if self.has_cross_attn:  # keys/values come from the encoder: no rotary positions there
            self.cross_attn = MultiHeadAttention(
                d_model, num_heads, kv_heads=kv_heads, bias=bias, dropout=dropout, **factory
            )

    def _sublayer(self, x: Tensor, i: int, fn: Callable[[Tensor], Tensor]) -> Tensor:
        """Residual block ``i``: pre-norm ``x + drop(fn(norm(x)))`` or post-norm ``norm(x + drop(fn(x)))``."""
        norm, drop = getattr(self, f"norm{i}"), getattr(self, f"dropout{i}")
        if self.norm_first:
            return x + drop(fn(norm(x)))
        return norm(x + drop(fn(x)))

    def _config(self) -> dict[str, object]:
        attn = self.self_attn
        return {
            "d_model": self.d_model,
            "nhead": attn.num_heads,
            "dim_feedforward": self.ff.linear1.out_features,
            "dropout": self.dropout1.p,
            "activation": self.ff.activation,
            "layer_norm_eps": self.norm1.eps,
            "norm_first": self.norm_first,
            "bias": self.ff.linear1.bias is not None,
        }

    @classmethod
    def from_torch(cls, layer: nn.Module) -> _Layer:
        """A layer with ``layer``'s exact weights, configuration and train/eval mode.

        ``layer`` is a ``torch.nn.TransformerEncoderLayer`` (for :class:`TransformerEncoderLayer`) or
        ``TransformerDecoderLayer`` (for :class:`TransformerDecoderLayer`), batch first or not (ours is
        always batch first), post-norm or pre-norm, ReLU or exact GELU.
        """
        if not isinstance(layer, cls._torch_cls):
            raise TypeError(
                f"{cls.__name__}.from_torch expects a {cls._torch_cls.__name__}, got {type(layer).__name__}"
            )
        ref = layer.linear1.weight
        new = cls(
            layer.linear1.in_features,
            layer.self_attn.num_heads,
            layer.linear1.out_features,
            dropout=layer.dropout.p,
            activation=_torch_activation(layer),
            norm_first=layer.norm_first,
            layer_norm_eps=layer.norm1.eps,
            bias=layer.linear1.bias is not None,
            device=ref.device,
            dtype=ref.dtype,
        )
        new.self_attn = MultiHeadAttention.from_torch(layer.self_attn)
        if new.has_cross_attn:
            new.cross_attn = MultiHeadAttention.from_torch(layer.multihead_attn)
        new.load_state_dict({_rename(k, True): v for k, v in layer.state_dict().items()}, strict=True)
        new.train(layer.training)
        return new

    def to_torch(self) -> nn.Module:
        """The matching ``torch.nn.Transformer*Layer(batch_first=True)`` with these exact weights.

        Only for what torch can express: kv_heads == num_heads, no rotary embeddings.
        """
        for attn in (m for m in self.modules() if isinstance(m, MultiHeadAttention)):
            if attn.kv_heads != attn.num_heads or attn.rotary is not None:
                raise ValueError(
                    f"torch.nn.{self._torch_cls.__name__} cannot express grouped-query heads or rotary "
                    f"embeddings (kv_heads={attn.kv_heads}, num_heads={attn.num_heads}, "
                    f"rotary={attn.rotary is not None})"
                )
        ref = self.norm1.weight
        m = self._torch_cls(**self._config(), batch_first=True, device=ref.device, dtype=ref.dtype)
        m.load_state_dict({_rename(k, False): v for k, v in self.state_dict().items()}, strict=True)
        m.train(self.training)
        return m


class TransformerEncoderLayer(_Layer):
    """Self-attention and feed-forward, each in a residual block with LayerNorm.

    Post-norm (``norm_first=False``, the paper and seed 001)::

        x = norm1(x + dropout1(self_attn(x)));  x = norm2(x + dropout2(ff(x)))

    Pre-norm (``norm_first=True``)::

        x = x + dropout1(self_attn(norm1(x)));  x = x + dropout2(ff(norm2(x)))

    Args:
        d_model: E. num_heads: H. d_ff: F.
        dropout: on the attention weights, the FFN hidden layer and each residual branch.
        activation: ``"relu"`` or ``"gelu"``. norm_first: pre-norm instead of post-norm.
        kv_heads: grouped-query key/value heads. rotary: rotary embeddings in the self-attention.
        layer_norm_eps, bias: as in ``torch.nn.TransformerEncoderLayer``.

    ``layer(x, *, mask=None, valid_lens=None, causal=False)``: x (B, S, E) -> (B, S, E); the masks go to
    the self-attention (bool ``mask`` True = may attend, broadcastable to (B, H, S, S); ``valid_lens``
    (B,) hides padded keys).
    """

    _torch_cls = nn.TransformerEncoderLayer
    num_norms = 2
    has_cross_attn = False

    def forward(
        self, x: Tensor, *, mask: Tensor | None = None, valid_lens: Tensor | None = None, causal: bool = False
    ) -> Tensor:
        """x (B, S, E) -> (B, S, E)."""
        x = self._sublayer(x, 1, lambda h: self.self_attn(h, mask=mask, valid_lens=valid_lens, causal=causal))
        return self._sublayer(x, 2, self.ff)


class TransformerDecoderLayer(_Layer):
    """Masked self-attention, cross-attention to the encoder output, feed-forward; post- or pre-norm.

    Post-norm::

        x = norm1(x + dropout1(self_attn(x, causal)))
        x = norm2(x + dropout2(cross_attn(x, memory)))
        x = norm3(x + dropout3(ff(x)))

    Arguments as :class:`TransformerEncoderLayer`; rotary embeddings apply to the self-attention only.

    ``layer(x, memory, *, mask=None, valid_lens=None, causal=True, memory_mask=None,
    memory_valid_lens=None, cache=None)``: x (B, T, E), memory (B, S, E) -> (B, T, E). ``mask``/
    ``valid_lens``/``causal`` go to the self-attention, ``memory_mask`` (broadcastable to (B, H, T, S))
    and ``memory_valid_lens`` (B,) to the cross-attention. With a :class:`~multihead.KVCache` the layer
    decodes incrementally: ``cache.child("self_attn")`` grows by T each call and
    ``cache.child("cross_attn")`` (static) holds the memory's keys/values after the first call.
    """

    _torch_cls = nn.TransformerDecoderLayer
    num_norms = 3
    has_cross_attn = True

    def forward(
        self,
        x: Tensor,
        memory: Tensor,
        *,
        mask: Tensor | None = None,
        valid_lens: Tensor | None = None,
        causal: bool = True,
        memory_mask: Tensor | None = None,
        memory_valid_lens: Tensor | None = None,
        cache: KVCache | None = None,
    ) -> Tensor:
        """x (B, T, E), memory (B, S, E) -> (B, T, E)."""
        self_cache = None if cache is None else cache.child("self_attn")
        cross_cache = None if cache is None else cache.child("cross_attn", static=True)
        x = self._sublayer(
            x,
            1,
            lambda h: self.self_attn(h, mask=mask, valid_lens=valid_lens, causal=causal, cache=self_cache),
        )
        x = self._sublayer(
            x,
            2,
            lambda h: self.cross_attn(
                h, memory, mask=memory_mask, valid_lens=memory_valid_lens, cache=cross_cache
            ),
        )
        return self._sublayer(x, 3, self.ff)


# ----------------------------------------------------------------------------------------------
# Stacks
# ----------------------------------------------------------------------------------------------


class _Stack(nn.Module):
    """N layers in a ``ModuleList`` and, for pre-norm stacks, a final LayerNorm ``norm``."""

    _layer_cls: type[_Layer]
    _torch_cls: type[nn.Module]

    def __init__(
        self,
        layer: _Layer | int,
        *args: object,
        num_layers: int = 6,
        final_norm: bool | None = None,
        **kwargs: object,
    ) -> None:
        super().__init__()
        positive_int("num_layers", num_layers)
        if isinstance(layer, _Layer):
            if not isinstance(layer, self._layer_cls):
                raise TypeError(
                    f"{type(self).__name__} stacks {self._layer_cls.__name__}, got {type(layer).__name__}"
                )
            if args or kwargs:
                raise TypeError("pass either a layer to copy or the layer's constructor arguments, not both")
            layers = [layer] + [copy.deepcopy(layer) for _ in range(num_layers - 1)]
        else:
            layers = [self._layer_cls(layer, *args, **kwargs) for _ in range(num_layers)]  # type: ignore[arg-type]
        self.layers = nn.ModuleList(layers)
        first = layers[0]
        self.norm_first = first.norm_first
        use_norm = self.norm_first if final_norm is None else bool(final_norm)
        ref = first.norm1.weight
        self.norm = (
            nn.LayerNorm(
                first.d_model,
                eps=first.norm1.eps,
                bias=first.norm1.bias is not None,
                device=ref.device,
                dtype=ref.dtype,
            )
            if use_norm
            else None
        )

    def _finish(self, x: Tensor) -> Tensor:
        return x if self.norm is None else self.norm(x)

    @classmethod
    def from_torch(cls, stack: nn.Module) -> _Stack:
        """A stack with the exact weights of a ``torch.nn.TransformerEncoder``/``TransformerDecoder``."""
        if not isinstance(stack, cls._torch_cls):
            raise TypeError(
                f"{cls.__name__}.from_torch expects a {cls._torch_cls.__name__}, got {type(stack).__name__}"
            )
        layers = [cls._layer_cls.from_torch(m) for m in stack.layers]
        new = cls(layers[0], num_layers=len(layers), final_norm=stack.norm is not None)
        new.layers = nn.ModuleList(layers)
        if stack.norm is not None:
            assert new.norm is not None
            new.norm.load_state_dict(stack.norm.state_dict())
        new.train(stack.training)
        return new


class TransformerEncoder(_Stack):
    """``num_layers`` :class:`TransformerEncoderLayer` s (6 by default), then a final LayerNorm if pre-norm.

    ``TransformerEncoder(layer, num_layers=6)`` stacks deep copies of ``layer`` (torch's behaviour: the
    copies start equal); ``TransformerEncoder(d_model, num_heads, d_ff, ..., num_layers=6)`` builds
    independently initialised layers from :class:`TransformerEncoderLayer`'s arguments.
    ``final_norm`` (default: the layers' ``norm_first``) adds the final LayerNorm ``.norm``.

    ``enc(x, *, mask=None, valid_lens=None, causal=False)``: x (B, S, E) -> (B, S, E).
    """

    _layer_cls = TransformerEncoderLayer
    _torch_cls = nn.TransformerEncoder

    def forward(
        self, x: Tensor, *, mask: Tensor | None = None, valid_lens: Tensor | None = None, causal: bool = False
    ) -> Tensor:
        """x (B, S, E) -> (B, S, E)."""
        for layer in self.layers:
            x = layer(x, mask=mask, valid_lens=valid_lens, causal=causal)
        return self._finish(x)


class TransformerDecoder(_Stack):
    """``num_layers`` :class:`TransformerDecoderLayer` s (6 by default), then a final LayerNorm if pre-norm.

    Built like :class:`TransformerEncoder`. ``dec(x, memory, *, mask=None, valid_lens=None, causal=True,
    memory_mask=None, memory_valid_lens=None, cache=None)``: x (B, T, E), memory (B, S, E) -> (B, T, E).

    Incremental decoding: one ``cache = KVCache()`` serves the whole stack (``cache.child(str(i))`` per
    layer)::

        cache = KVCache()
        for t in range(T):
            y_t = dec(x[:, t : t + 1], memory, cache=cache)   # (B, 1, E), equals dec(x)[:, t : t + 1]
    """

    _layer_cls = TransformerDecoderLayer
    _torch_cls = nn.TransformerDecoder

    def forward(
        self,
        x: Tensor,
        memory: Tensor,
        *,
        mask: Tensor | None = None,
        valid_lens: Tensor | None = None,
        causal: bool = True,
        memory_mask: Tensor | None = None,
        memory_valid_lens: Tensor | None = None,
        cache: KVCache | None = None,
    ) -> Tensor:
        """x (B, T, E), memory (B, S, E) -> (B, T, E)."""
        if cache is not None and not isinstance(cache, KVCache):
            raise TypeError(f"cache must be a multihead.KVCache, got {type(cache).__name__}")
        for i, layer in enumerate(self.layers):
            x = layer(
                x,
                memory,
                mask=mask,
                valid_lens=valid_lens,
                causal=causal,
                memory_mask=memory_mask,
                memory_valid_lens=memory_valid_lens,
                cache=None if cache is None else cache.child(str(i)),
            )
        return self._finish(x)


# ----------------------------------------------------------------------------------------------
# The sequence-to-sequence model
# ----------------------------------------------------------------------------------------------


class Transformer(nn.Module):
    """Encoder-decoder Transformer for sequence-to-sequence work (token ids in, logits out).

    Args:
        src_vocab, tgt_vocab: vocabulary sizes.
        d_model, num_heads, num_encoder_layers, num_decoder_layers, d_ff, dropout, activation,
            norm_first, kv_heads: as in the layers (paper defaults: 512, 8, 6, 6, 2048, 0.1, relu, post-norm).
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

    def _embed(self, tokens: Tensor, table: nn.Embedding, offset: int = 0) -> Tensor:
        """(B, L) long -> (B, L, E): scaled embedding plus position (or dropout alone with rotary)."""
        if not isinstance(tokens, Tensor) or tokens.dim() != 2 or tokens.is_floating_point():
            raise ValueError(
                f"token ids must be an integer tensor (B, L), got "
                f"{tuple(tokens.shape) if isinstance(tokens, Tensor) else type(tokens).__name__}"
            )
        x = table(tokens) * math.sqrt(self.d_model)  # (B, L, E)
        if self.pos_encoding is None:
            return self.embed_dropout(x)
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

    def encode(self, src: Tensor, *, src_valid_lens: Tensor | None = None) -> Tensor:
        """src (B, S) long -> memory (B, S, E)."""
        return self.encoder(self._embed(src, self.src_embed), **self._padding(src, src_valid_lens))

    def decode(
        self,
        tgt: Tensor,
        memory: Tensor,
        *,
        src: Tensor | None = None,
        src_valid_lens: Tensor | None = None,
        tgt_valid_lens: Tensor | None = None,
        cache: KVCache | None = None,
    ) -> Tensor:
        """tgt (B, T) long, memory (B, S, E) -> logits (B, T, V).

        The memory's padding comes from ``src_valid_lens`` or, failing that, from the ``src`` tokens
        (pass one of them unless nothing is padded). With a ``cache``, ``tgt`` holds only the new
        positions, which continue those cached; no target padding is applied then.
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
        x = self._embed(tgt, self.tgt_embed, offset=0 if cache is None else len(cache))  # (B, T, E)
        h = self.decoder(
            x,
            memory,
            mask=tgt_pad["mask"],
            valid_lens=tgt_pad["valid_lens"],
            memory_mask=pad["mask"],
            memory_valid_lens=pad["valid_lens"],
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
    ) -> Tensor:
        """src (B, S), tgt (B, T) long -> logits (B, T, tgt_vocab)."""
        memory = self.encode(src, src_valid_lens=src_valid_lens)  # (B, S, E)
        return self.decode(tgt, memory, src=src, src_valid_lens=src_valid_lens, tgt_valid_lens=tgt_valid_lens)

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

        Runs in eval mode (dropout off) without gradients, on a :class:`~multihead.KVCache`: each step
        embeds one token per row and the cross-attention keys/values are computed once. Beam search
        ranks all K*V continuations of the K beams by the length-normalised score at every step;
        finished beams stay in the beam (continuing with padding at no cost) until all K of a source
        are finished or ``max_len`` is reached; beam_size=1 therefore equals greedy decoding.
        """
        positive_int("max_len", max_len)
        positive_int("beam_size", beam_size)
        for name, tok in (("bos_id", bos_id), ("eos_id", eos_id)):
            if tok is not None and not (isinstance(tok, int) and 0 <= tok < self.tgt_vocab):
                raise ValueError(f"{name} must be a token id in [0, {self.tgt_vocab}), got {tok!r}")
        if bos_id is None:
            raise ValueError("bos_id is required: the first decoder input token")
        was_training = self.training
        self.eval()
        try:
            memory = self.encode(src, src_valid_lens=src_valid_lens)  # (B, S, E)
            tokens, scores = self._beam_search(
                memory, src, src_valid_lens, bos_id, eos_id, max_len, beam_size, length_penalty
            )
        finally:
            self.train(was_training)
        return (tokens, scores) if return_scores else tokens

    def _beam_search(
        self,
        memory: Tensor,
        src: Tensor,
        src_valid_lens: Tensor | None,
        bos_id: int,
        eos_id: int | None,
        max_len: int,
        k: int,
        alpha: float,
    ) -> tuple[Tensor, Tensor]:
        """Batched beam search (k = 1: greedy); returns the best tokens (B, T') and their scores (B,)."""
        b, dev = memory.shape[0], memory.device
        fill = self.pad_id if self.pad_id is not None else (eos_id if eos_id is not None else 0)
        if k > 1:  # every beam row gets its own copy of the source
            memory = memory.repeat_interleave(k, dim=0)  # (N, S, E)
            src = src.repeat_interleave(k, dim=0)  # (N, S)
            src_valid_lens = None if src_valid_lens is None else src_valid_lens.repeat_interleave(k, dim=0)
        scores = torch.full((b, k), float("-inf"), device=dev)  # (B, K) sum of log-probs
        scores[:, 0] = 0.0  # one live beam at the start: the others would duplicate it
        lengths = torch.zeros(b, k, dtype=torch.long, device=dev)  # (B, K) tokens incl. eos
        finished = torch.zeros(b, k, dtype=torch.bool, device=dev)  # (B, K)
        seqs = torch.empty(b, k, 0, dtype=torch.long, device=dev)  # (B, K, t)
        tokens = torch.full((b * k,), bos_id, dtype=torch.long, device=dev)  # (N,)
        row0 = torch.arange(b, device=dev)[:, None] * k  # (B, 1) first row of each source
        cache = KVCache()
        for t in range(max_len):
            logp = self._step_logprobs(tokens, memory, src, src_valid_lens, cache, eos_id).view(
                b, k, -1
            )  # (B, K, V)
            v = logp.shape[-1]
            # A finished beam continues only with `fill`, at no cost.
            logp = logp.masked_fill(finished[..., None], float("-inf"))
            logp[..., fill] = torch.where(finished, 0.0, logp[..., fill])
            cand = scores[..., None] + logp  # (B, K, V)
            cand_len = torch.where(finished, lengths, t + 1).float()[..., None]  # (B, K, 1)
            ranked = (cand / cand_len**alpha).view(b, k * v)  # (B, K*V)
            if k == 1:
                top = ranked.argmax(dim=-1, keepdim=True)  # (B, 1)
            else:
                top = ranked.topk(k, dim=-1).indices  # (B, K), best first
            parent, tok = top // v, top % v  # (B, K), (B, K)
            scores = cand.view(b, k * v).gather(1, top)  # (B, K)
            was_done = finished.gather(1, parent)  # (B, K)
            lengths = torch.where(was_done, lengths.gather(1, parent), t + 1)
            finished = was_done | (tok == eos_id) if eos_id is not None else was_done
            seqs = torch.cat(
                [seqs.gather(1, parent[..., None].expand(-1, -1, t)), tok[..., None]], dim=2
            )  # (B, K, t+1)
            if k > 1:
                cache.reorder(
                    (row0 + parent).view(-1), include_static=False
                )  # beams of a source share memory
            if bool(finished.all()):
                break
            tokens = tok.view(-1)  # (N,)
        best = seqs[:, 0]  # (B, T) the top-ranked hypothesis
        best_len = lengths[:, 0]  # (B,)
        best_score = scores[:, 0] / best_len.float() ** alpha  # (B,)
        return best[:, : int(best_len.max())], best_score
