"""Transformer layers on :class:`~multihead.MultiHeadAttention`: encodings, feed-forward, encoder/decoder blocks.

Dimensions: B batch, S source length, T target length, E d_model, F d_ff, H heads.

* :class:`PositionalEncoding` -- the paper's sinusoids (with an ``offset`` for cached steps);
* :class:`FeedForward` -- Linear(E, F) -> ReLU/GELU -> dropout -> Linear(F, E);
* :class:`TransformerEncoderLayer`, :class:`TransformerDecoderLayer` -- post-norm as in the paper
  (``norm_first=False``) or pre-norm; parameter names follow ``torch.nn.TransformerEncoderLayer``/
  ``DecoderLayer`` except that the feed-forward lives in ``.ff`` and torch's ``multihead_attn`` is
  ``.cross_attn``; ``from_torch``/``to_torch`` copy exact weights.

Masks follow the library's one convention (bool True = may attend, ``valid_lens`` hide keys at
index >= valid_len); decoder self-attention is causal.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..core.checks import check_dropout, is_int, positive_int
from ..nn.attention import MultiHeadAttention
from ..nn.cache import KVCache

__all__ = [
    "FeedForward",
    "LayerBase",
    "PositionalEncoding",
    "TransformerDecoderLayer",
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
    cached decoding step passes ``offset`` = the number of positions already decoded. ``pe(x,
    positions=p)`` with p (B, L) int uses ``PE[p]`` instead (packed sequences: positions restart at 0
    in each, :func:`multihead.segments.segment_positions`).
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

    def forward(self, x: Tensor, *, offset: int = 0, positions: Tensor | None = None) -> Tensor:
        """x (B, L, E) -> dropout(x + PE[offset : offset + L]) (or ``PE[positions]``), (B, L, E)."""
        if x.dim() != 3 or x.shape[-1] != self.d_model:
            raise ValueError(f"x must have shape (B, L, {self.d_model}), got {tuple(x.shape)}")
        if positions is not None:
            if tuple(positions.shape) != tuple(x.shape[:2]) or positions.is_floating_point():
                raise ValueError(
                    f"positions must be an int tensor (B, L) = {tuple(x.shape[:2])}, got dtype "
                    f"{positions.dtype} shape {tuple(positions.shape)}"
                )
            if positions.numel() and int(positions.max()) >= self.max_len:
                raise ValueError(f"position {int(positions.max())} requested but max_len={self.max_len}")
            return self.dropout(x + self.pe[positions].to(x.dtype))  # (B, L, E)
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


class LayerBase(nn.Module):
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
    def from_torch(cls, layer: nn.Module) -> LayerBase:
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


class TransformerEncoderLayer(LayerBase):
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

    ``layer(x, *, mask=None, valid_lens=None, causal=False, segment_ids=None)``: x (B, S, E) -> (B, S, E);
    the masks go to the self-attention (bool ``mask`` True = may attend, broadcastable to (B, H, S, S);
    ``valid_lens`` (B,) hides padded keys; ``segment_ids`` (B, S) keeps packed sequences apart).
    """

    _torch_cls = nn.TransformerEncoderLayer
    num_norms = 2
    has_cross_attn = False

    def forward(
        self,
        x: Tensor,
        *,
        mask: Tensor | None = None,
        valid_lens: Tensor | None = None,
        causal: bool = False,
        segment_ids: Tensor | None = None,
    ) -> Tensor:
        """x (B, S, E) -> (B, S, E)."""
        x = self._sublayer(
            x,
            1,
            lambda h: self.self_attn(
                h, mask=mask, valid_lens=valid_lens, causal=causal, segment_ids=segment_ids
            ),
        )
        return self._sublayer(x, 2, self.ff)


def cross_segment_ids(
    segment_ids: Tensor | None, memory_segment_ids: Tensor | None
) -> tuple[Tensor, Tensor] | None:
    """The cross-attention's ``segment_ids`` pair (target ids (B, T), memory ids (B, S)), or None."""
    if memory_segment_ids is None:
        return None
    if segment_ids is None:
        raise ValueError(
            "memory_segment_ids needs segment_ids too: packed target sequence i attends to packed source "
            "sequence i, so give the target's ids (B, T) as segment_ids"
        )
    return segment_ids, memory_segment_ids


class TransformerDecoderLayer(LayerBase):
    """Masked self-attention, cross-attention to the encoder output, feed-forward; post- or pre-norm.

    Post-norm::

        x = norm1(x + dropout1(self_attn(x, causal)))
        x = norm2(x + dropout2(cross_attn(x, memory)))
        x = norm3(x + dropout3(ff(x)))

    Arguments as :class:`TransformerEncoderLayer`; rotary embeddings apply to the self-attention only.

    ``layer(x, memory, *, mask=None, valid_lens=None, causal=True, memory_mask=None,
    memory_valid_lens=None, segment_ids=None, memory_segment_ids=None, cache=None)``: x (B, T, E), memory
    (B, S, E) -> (B, T, E). ``mask``/``valid_lens``/``causal``/``segment_ids`` (B, T) go to the
    self-attention, ``memory_mask`` (broadcastable to (B, H, T, S)) and ``memory_valid_lens`` (B,) to the
    cross-attention; packed pairs attend across with ``segment_ids=(segment_ids, memory_segment_ids)``
    (target sequence i sees only source sequence i: give both, with matching ids). With a :class:`~multihead.KVCache` the layer
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
        segment_ids: Tensor | None = None,
        memory_segment_ids: Tensor | None = None,
        cache: KVCache | None = None,
    ) -> Tensor:
        """x (B, T, E), memory (B, S, E) -> (B, T, E)."""
        cross_ids = cross_segment_ids(segment_ids, memory_segment_ids)
        self_cache = None if cache is None else cache.child("self_attn")
        cross_cache = None if cache is None else cache.child("cross_attn", static=True)
        x = self._sublayer(
            x,
            1,
            lambda h: self.self_attn(
                h, mask=mask, valid_lens=valid_lens, causal=causal, segment_ids=segment_ids, cache=self_cache
            ),
        )
        x = self._sublayer(
            x,
            2,
            lambda h: self.cross_attn(
                h,
                memory,
                mask=memory_mask,
                valid_lens=memory_valid_lens,
                segment_ids=cross_ids,
                cache=cross_cache,
            ),
        )
        return self._sublayer(x, 3, self.ff)
