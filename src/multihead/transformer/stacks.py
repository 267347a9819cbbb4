"""Stacks of Transformer layers: :class:`TransformerEncoder` and :class:`TransformerDecoder`.

Dimensions: B batch, S source length, T target length, E d_model.

N layers (6 by default) in a ``ModuleList``, with a final LayerNorm for pre-norm stacks; ``from_torch``
loads ``torch.nn.TransformerEncoder``/``TransformerDecoder`` weights exactly. One
:class:`~multihead.KVCache` serves a whole decoder stack (a child per layer).
"""

from __future__ import annotations

import copy

from torch import Tensor, nn

from ..core.checks import positive_int
from ..nn.cache import KVCache
from .layers import LayerBase, TransformerDecoderLayer, TransformerEncoderLayer

__all__ = ["TransformerDecoder", "TransformerEncoder"]


class _Stack(nn.Module):
    """N layers in a ``ModuleList`` and, for pre-norm stacks, a final LayerNorm ``norm``."""

    _layer_cls: type[LayerBase]
    _torch_cls: type[nn.Module]

    def __init__(
        self,
        layer: LayerBase | int,
        *args: object,
        num_layers: int = 6,
        final_norm: bool | None = None,
        **kwargs: object,
    ) -> None:
        super().__init__()
        positive_int("num_layers", num_layers)
        if isinstance(layer, LayerBase):
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

    ``enc(x, *, mask=None, valid_lens=None, causal=False, segment_ids=None)``: x (B, S, E) -> (B, S, E).
    """

    _layer_cls = TransformerEncoderLayer
    _torch_cls = nn.TransformerEncoder

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
        for layer in self.layers:
            x = layer(x, mask=mask, valid_lens=valid_lens, causal=causal, segment_ids=segment_ids)
        return self._finish(x)


class TransformerDecoder(_Stack):
    """``num_layers`` :class:`TransformerDecoderLayer` s (6 by default), then a final LayerNorm if pre-norm.

    Built like :class:`TransformerEncoder`. ``dec(x, memory, *, mask=None, valid_lens=None, causal=True,
    memory_mask=None, memory_valid_lens=None, segment_ids=None, memory_segment_ids=None, cache=None)``:
    x (B, T, E), memory (B, S, E) -> (B, T, E).

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
        segment_ids: Tensor | None = None,
        memory_segment_ids: Tensor | None = None,
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
                segment_ids=segment_ids,
                memory_segment_ids=memory_segment_ids,
                cache=None if cache is None else cache.child(str(i)),
            )
        return self._finish(x)
