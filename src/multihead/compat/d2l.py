"""The d2l book's attention layers (seeds 003 and 004) over :func:`multihead.attention`.

Dimensions: B batch, H heads, Lq queries, Lk key-value pairs, P = num_hiddens, D = P // H.

Same signatures as d2l (``DotProductAttention(dropout)``; ``MultiHeadAttention`` in both of the book's forms:
d2l 1.0's ``(num_hiddens, num_heads, dropout, bias=False)`` with lazy input sizes (``nn.LazyLinear``, sized
by the first call) and the earlier ``(key_size, query_size, value_size, num_hiddens, num_heads, dropout,
bias=False)``; ``forward(queries, keys, values, valid_lens)``), same ``W_q``/``W_k``/``W_v``/``W_o`` weights, same ``valid_lens`` meaning: (B,) or (B, Lq),
keys at index >= valid_len are hidden. A float ``valid_lens`` (DJL passes one) counts like d2l's
``arange < valid_len``, i.e. rounds up.

One intended difference: d2l fills hidden scores with -1e6, so a query with valid_len 0 attends
*uniformly to every key, padding included*; here it attends to nothing and its output is 0.

The attention weights are not kept by default (a module that stores them keeps a (B*H, Lq, Lk) tensor
alive). For d2l's heatmap code pass ``keep_weights=True``; then ``layer.attention.attention_weights``
holds the last call's weights with d2l's shape (B*H, Lq, Lk).
"""

from __future__ import annotations

import inspect
from typing import Any, NamedTuple, overload

from torch import Tensor, nn

from ..core.attention import attention
from ..heads.naming import Projection, register_family
from ..nn import seam
from ..nn.attention import MultiHeadAttention as _CoreMHA
from ..nn.attention import merge_heads, split_heads
from .weights import SharedWeights, from_shared, module_from_state

__all__ = ["DotProductAttention", "MultiHeadAttention"]


def _lens(valid_lens: Tensor | None) -> Tensor | None:
    """d2l allows float valid_lens: ``j < 2.5`` keeps keys 0..2, so round up."""
    if valid_lens is not None and isinstance(valid_lens, Tensor) and valid_lens.is_floating_point():
        return valid_lens.ceil().long()
    return valid_lens


class DotProductAttention(nn.Module):
    """d2l's scaled dot-product attention: queries (B, Lq, D), keys (B, Lk, D), values (B, Lk, Dv).

    ``valid_lens`` (B,) or (B, Lq). With valid_lens = [2] and Lk = 3 every query sees::

        1 1 0
    """

    def __init__(self, dropout: float = 0.0, *, keep_weights: bool = False) -> None:
        super().__init__()
        self.dropout = nn.Dropout(dropout)
        self.keep_weights = keep_weights
        self._weights: Tensor | None = None
        self.attention_fn: seam.AttentionFn = attention  # the seam's contract (multihead.nn.seam.attend)
        self.backend = "auto"
        self.num_heads = 1  # what the head tools read; MultiHeadAttention sets its own

    @property
    def attention_weights(self) -> Tensor:
        """The last call's weights, (B, Lq, Lk) here or (B*H, Lq, Lk) inside ``MultiHeadAttention``."""
        if self._weights is None:
            raise RuntimeError(  # not AttributeError: nn.Module.__getattr__ would hide this message
                "attention_weights are kept only on request: build the layer with keep_weights=True (or set "
                "layer.attention.keep_weights = True) and run a forward pass"
            )
        return self._weights

    def attend(self, q: Tensor, k: Tensor, v: Tensor, valid_lens: Tensor | None) -> Tensor:
        """Heads already split: q (B, H, Lq, D), k (B, H, Lk, D), v (B, H, Lk, Dv) -> (B, H, Lq, Dv)."""
        p = self.dropout.p if self.training else 0.0
        out, weights = seam.attend(
            self, q, k, v, valid_lens=_lens(valid_lens), dropout=p, return_weights=self.keep_weights
        )  # (B, H, Lq, Dv), (B, H, Lq, Lk) | None
        self._weights = None if weights is None else weights.detach().flatten(0, 1)  # (B*H, Lq, Lk), d2l's
        return out

    def forward(
        self, queries: Tensor, keys: Tensor, values: Tensor, valid_lens: Tensor | None = None
    ) -> Tensor:
        """(B, Lq, D), (B, Lk, D), (B, Lk, Dv) -> (B, Lq, Dv)."""
        q, k, v = (t.unsqueeze(1) for t in (queries, keys, values))  # (B, 1, L, D): one head
        return self.attend(q, k, v, valid_lens).squeeze(1)  # (B, Lq, Dv)


def _d2l_v1(num_hiddens: int, num_heads: int, dropout: float, bias: bool = False) -> None:
    """d2l 1.0 (the current book, ``d2l`` 1.0.x): input sizes are lazy."""


def _d2l_v0(
    key_size: int,
    query_size: int,
    value_size: int,
    num_hiddens: int,
    num_heads: int,
    dropout: float,
    bias: bool = False,
) -> None:
    """The book before 1.0 (d2l 0.x, DJL's port): input sizes given."""


_FORMS = {form: inspect.signature(form) for form in (_d2l_v1, _d2l_v0)}


def _shown(form: Any) -> str:
    """A form's signature as a user writes it: ``(num_hiddens, num_heads, dropout, bias=False)``."""
    params = [p.replace(annotation=inspect.Parameter.empty) for p in _FORMS[form].parameters.values()]
    return str(inspect.Signature(params))


class _Args(NamedTuple):
    """One constructor call, either form: ``sizes`` (key, query, value) or None for lazy layers."""

    sizes: tuple[int, int, int] | None
    num_hiddens: int
    num_heads: int
    dropout: float
    bias: bool


def _parse(args: tuple[Any, ...], kwargs: dict[str, Any]) -> _Args:
    """Bind a constructor call to d2l 1.0's form or the earlier one (5+ positionals or a *_size keyword)."""
    old = len(args) > 4 or any(k in kwargs for k in ("key_size", "query_size", "value_size"))
    form = _d2l_v0 if old else _d2l_v1
    try:
        bound = _FORMS[form].bind(*args, **kwargs)
    except TypeError as e:
        raise TypeError(
            f"MultiHeadAttention{_shown(form)}: {e}. d2l's two forms are MultiHeadAttention{_shown(_d2l_v1)} "
            f"(d2l 1.0, lazy input sizes) and MultiHeadAttention{_shown(_d2l_v0)} (before 1.0)"
        ) from None
    bound.apply_defaults()
    a = bound.arguments
    sizes = (a["key_size"], a["query_size"], a["value_size"]) if old else None
    return _Args(sizes, a["num_hiddens"], a["num_heads"], a["dropout"], a["bias"])


def _linear(in_features: int | None, out_features: int, bias: bool) -> nn.Module:
    """``nn.Linear``, or ``nn.LazyLinear`` (in_features from the first call) when the size is not given."""
    if in_features is None:
        return nn.LazyLinear(out_features, bias=bias)
    return nn.Linear(in_features, out_features, bias=bias)


class MultiHeadAttention(nn.Module):
    """d2l's multi-head attention: ``W_q``/``W_k``/``W_v`` project to ``num_hiddens``, split into heads.

    Two constructors, as in the book's editions::

        MultiHeadAttention(num_hiddens, num_heads, dropout, bias=False)          # d2l 1.0: lazy sizes
        MultiHeadAttention(key_size, query_size, value_size, num_hiddens, num_heads, dropout, bias=False)

    Args:
        key_size, query_size, value_size: input feature sizes of keys, queries and values (earlier form;
            d2l 1.0's form leaves them to the first call, through ``nn.LazyLinear``).
        num_hiddens: P, the projection size (D = P // num_heads per head) and the output size.
        num_heads: H.
        dropout: dropout on the attention weights (training mode).
        bias: biases in the four Linear layers (d2l's default: none).
        keep_weights: record the last weights in ``self.attention.attention_weights`` (B*H, Lq, Lk).

    Forward: queries (B, Lq, query_size), keys (B, Lk, key_size), values (B, Lk, value_size),
    valid_lens (B,) or (B, Lq) or None -> (B, Lq, num_hiddens).
    """

    @overload
    def __init__(
        self,
        num_hiddens: int,
        num_heads: int,
        dropout: float,
        bias: bool = False,
        *,
        keep_weights: bool = False,
    ) -> None: ...

    @overload
    def __init__(
        self,
        key_size: int,
        query_size: int,
        value_size: int,
        num_hiddens: int,
        num_heads: int,
        dropout: float,
        bias: bool = False,
        *,
        keep_weights: bool = False,
    ) -> None: ...

    def __init__(self, *args: Any, keep_weights: bool = False, **kwargs: Any) -> None:
        super().__init__()
        sizes, num_hiddens, num_heads, dropout, bias = _parse(args, kwargs)
        if num_hiddens % num_heads:
            raise ValueError(
                f"num_hiddens ({num_hiddens}) must be divisible by num_heads ({num_heads}): each head gets "
                f"num_hiddens // num_heads features"
            )
        self.num_heads = num_heads
        self.attention = DotProductAttention(dropout, keep_weights=keep_weights)
        self.attention.num_heads = num_heads
        key_size, query_size, value_size = (None, None, None) if sizes is None else sizes
        self.W_q = _linear(query_size, num_hiddens, bias)
        self.W_k = _linear(key_size, num_hiddens, bias)
        self.W_v = _linear(value_size, num_hiddens, bias)
        self.W_o = _linear(None if sizes is None else num_hiddens, num_hiddens, bias)  # lazy in d2l 1.0 too

    def forward(
        self, queries: Tensor, keys: Tensor, values: Tensor, valid_lens: Tensor | None = None
    ) -> Tensor:
        """(B, Lq, query_size), (B, Lk, key_size), (B, Lk, value_size) -> (B, Lq, num_hiddens)."""
        q = split_heads(self.W_q(queries), self.num_heads)  # (B, H, Lq, D)
        k = split_heads(self.W_k(keys), self.num_heads)  # (B, H, Lk, D)
        v = split_heads(self.W_v(values), self.num_heads)  # (B, H, Lk, D)
        out = self.attention.attend(q, k, v, valid_lens)  # (B, H, Lq, D)
        return self.W_o(merge_heads(out))  # (B, Lq, P)

    def to_multihead(self) -> _CoreMHA:
        """The same layer as a :class:`multihead.MultiHeadAttention` (exact weights; mask with valid_lens=)."""
        if any(isinstance(p, nn.parameter.UninitializedParameter) for p in self.parameters()):
            raise ValueError(
                "to_multihead needs the input sizes, which this d2l 1.0 layer (lazy nn.LazyLinear) learns on "
                "its first call: run one forward pass first, or build it with the sizes, "
                "MultiHeadAttention(key_size, query_size, value_size, num_hiddens, num_heads, dropout)"
            )
        ws = [m.weight.detach() for m in (self.W_q, self.W_k, self.W_v, self.W_o)]
        bs = [None if m.bias is None else m.bias.detach() for m in (self.W_q, self.W_k, self.W_v, self.W_o)]
        state = from_shared(SharedWeights(*ws, *bs))
        return module_from_state(state, self.num_heads).train(self.training)


class D2LFamily:
    """The :class:`multihead.heads.HeadFamily` of the d2l drop-in: its :class:`DotProductAttention` is the
    module that calls the seam (capture, head masks, importance and :mod:`multihead.lens` see it by that
    name, e.g. ``"attention"`` inside a :class:`MultiHeadAttention`); ``W_o`` of the layer holding it is the
    output projection. Pruning goes through :meth:`MultiHeadAttention.to_multihead`."""

    name = "d2l"

    def owns(self, module: nn.Module) -> bool:
        return isinstance(module, DotProductAttention)

    def heads(self, module: nn.Module) -> tuple[int, int]:
        return module.num_heads, module.num_heads  # type: ignore[return-value]

    def kind(self, name: str, module: nn.Module) -> str | None:
        return None

    def check_routed(self, model: nn.Module) -> None:
        return None

    def check_prunable(self, name: str, module: nn.Module) -> None:
        raise ValueError(
            f"{name!r} is a d2l DotProductAttention, which multihead cannot prune in place: convert its layer "
            f"with MultiHeadAttention.to_multihead() and prune that"
        )

    def reshape(
        self, model: nn.Module, name: str, module: nn.Module, q_heads: list[int], kv_heads: list[int]
    ) -> None:
        self.check_prunable(name, module)

    def output_projection(self, model: nn.Module, name: str, module: nn.Module) -> Projection | None:
        parent = model.get_submodule(name.rpartition(".")[0]) if name else None
        if isinstance(parent, MultiHeadAttention) and parent.attention is module:
            return Projection(parent.W_o)
        return None  # a bare DotProductAttention has no output projection


FAMILY = register_family(D2LFamily())
"""The registered family: the head tools and the lens act on the d2l drop-in."""
