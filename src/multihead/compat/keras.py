"""``MultiHeadAttention``: a drop-in Keras 3 layer for ``keras.layers.MultiHeadAttention``, on every backend.

Dimensions: B batch, T query positions, S key positions (each possibly several ``attention_axes``,
flattened to Tf/Sf), H heads, Dk = key_dim, Dv = value_dim, E query features, O output features,
Bf = the product of every non-attention, non-feature axis (batch included).

The layer **is** a ``keras.layers.MultiHeadAttention`` (a subclass): the constructor, config, sub-layers
(``query_dense``, ``key_dense``, ``value_dense``, ``output_dense``: ``EinsumDense`` layers named ``query``,
``key``, ``value``, ``attention_output``), weights, LoRA and quantization of the projections and the
protected extension points (``_build_attention``, ``_compute_attention``, ``_masked_softmax``,
``_compute_attention_mask``, ...) are Keras's own, so ``ours.set_weights(keras_layer.get_weights())``
reproduces Keras's outputs and scores, ``isinstance(ours, keras.layers.MultiHeadAttention)`` holds, and
subclasses written against Keras's layer (KerasHub's cached attention) work on it unchanged. What it
changes, all deliberate (``docs/compat.md``):

* a query with no allowed key gets output 0 and scores 0 on every path (Keras: 0 where it returns scores,
  but a uniform average of the values on its fused path, i.e. whenever scores are not requested);
* on the torch backend the attention itself is :func:`multihead.attention` (fused kernels), unless the
  layer drops out in training, ``_masked_softmax`` is overridden, or ``implementation="einsum"``;
* an explicit ``query_mask=`` is honoured (Keras 3 replaces it with the query's Keras mask);
* ``use_causal_mask`` and ``sliding_window`` are laid along the attention axis (Keras always uses axis 1),
  and with several attention axes, where positions have no single order, they raise ``ValueError``;
* symbolic calls (``keras.Input``) give the scores their true shape (B, H, T, S) (Keras: (B, H, T, T));
* bad arguments and shapes raise ``ValueError`` naming the argument at construction or build time.

This module imports Keras, never PyTorch: ``import multihead.compat.keras`` works on the TensorFlow and
JAX backends without torch installed (install ``multihead[keras]``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from .._extras import require

require("keras", ("keras",), "multihead.compat.keras")

import keras  # noqa: E402
from keras import ops  # noqa: E402

__all__ = ["MultiHeadAttention"]


# ----------------------------------------------------------------------------------------------
# The one use of Keras internals. A tensor's Keras mask (what ``Embedding(mask_zero=True)`` attaches and
# Keras's own MultiHeadAttention reads as ``query_mask`` and sets on its output) has no public getter or
# setter in Keras 3; everything else in this module is public API (keras.ops, keras.layers, keras.backend,
# keras.config, keras.saving). tests/test_compat_keras.py checks this adapter against Embedding's public
# behaviour and names the Keras version when it breaks.
# ----------------------------------------------------------------------------------------------


def _keras_masking() -> tuple[Any, Any]:
    """Keras's ``(get_keras_mask, set_keras_mask)``; an ImportError naming the Keras version if gone."""
    try:
        from keras.src.backend import get_keras_mask, set_keras_mask
    except ImportError as e:  # pragma: no cover - only on a Keras that moved them
        raise ImportError(
            f"multihead.compat.keras reads and sets Keras masks with keras.src.backend.get_keras_mask / "
            f"set_keras_mask (no public API exists), which Keras {keras.version()} does not have; install a "
            f"Keras 3 release that has them (3.6 or later) and report this at the multihead issue tracker"
        ) from e
    return get_keras_mask, set_keras_mask


get_keras_mask, set_keras_mask = _keras_masking()

#: ``implementation=`` values: "auto" = multihead.attention on the torch backend, Keras's einsum math
#: elsewhere; "einsum" = Keras's einsum math on every backend
IMPLEMENTATIONS = ("auto", "einsum")


def _invalid(name: str, value: Any, expected: str) -> ValueError:
    """Keras's message form for a bad argument: names it, says what was expected and what came."""
    return ValueError(
        f"Received an invalid value for argument `{name}`, expected {expected}. Received: {name}={value!r}"
    )


def _keras_says(keras_text: str, ours: str) -> ValueError:
    """Keras's own message (what code and tests written against Keras match on), then the library's guidance."""
    return ValueError(f"{keras_text} {ours}")


def _is_positive_int(value: Any) -> bool:
    # core.checks.is_int says the same, but importing multihead.core imports torch (see module docstring)
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _check_args(
    num_heads: Any,
    key_dim: Any,
    value_dim: Any,
    dropout: Any,
    output_shape: Any,
    attention_axes: Any,
    sliding_window: Any,
    implementation: Any,
) -> None:
    """Every scalar argument of the constructor, checked before anything is built."""
    for name, value in (("num_heads", num_heads), ("key_dim", key_dim)):
        if not _is_positive_int(value):
            raise _invalid(name, value, "a positive integer")
    if value_dim is not None and not _is_positive_int(value_dim):
        raise _invalid("value_dim", value_dim, "a positive integer or `None` (= key_dim)")
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0.0 <= dropout < 1.0:
        raise _invalid("dropout", dropout, "a float in [0, 1)")
    if output_shape is not None:
        dims = (output_shape,) if isinstance(output_shape, int) else output_shape
        if not isinstance(dims, (list, tuple)) or not dims or not all(_is_positive_int(d) for d in dims):
            raise _keras_says(
                f"Invalid `output_shape`: {output_shape}. When specified, the `output_shape` should be of "
                f"type tuple, list, or int.",
                f"It must be `None`, a positive integer or a non-empty tuple of them (the output's feature "
                f"axes). Received: output_shape={output_shape!r}",
            )
    if attention_axes is not None:
        axes = (attention_axes,) if isinstance(attention_axes, int) else attention_axes
        if (
            not isinstance(axes, (list, tuple))
            or not axes
            or not all(isinstance(a, int) and not isinstance(a, bool) for a in axes)
        ):
            raise _keras_says(
                f"`attention_axes` must be an int, list, or tuple.Received: attention_axes={attention_axes}",
                "Pass `None` (every axis between batch and features), an int or a non-empty tuple of ints.",
            )
    if sliding_window is not None and not _is_positive_int(sliding_window):
        raise _keras_says(
            f"`sliding_window` must be `None` or a positive integer. Received: sliding_window={sliding_window}",
            "It is the number of positions each query sees on either side of itself, at least 1.",
        )
    if implementation not in IMPLEMENTATIONS:
        raise _invalid("implementation", implementation, f"one of {IMPLEMENTATIONS}")


def _check_shapes(
    query_shape: Sequence[int | None],
    value_shape: Sequence[int | None],
    key_shape: Sequence[int | None],
    attention_axes: Sequence[int] | None,
) -> tuple[int, ...]:
    """Build-time shape checks; returns the attention axes as non-negative axes of the query.

    query (B, T..., E), value (B, S..., Ev), key (B, S..., Ek): the same rank, ``key`` and ``value`` equal
    on every axis but the last, ``query`` and ``value`` equal on every axis that is not an attention axis
    (nor the feature axis). Unknown (None) sizes match anything.
    """

    def agree(a: int | None, b: int | None) -> bool:
        return a is None or b is None or a == b

    if len(value_shape) != len(key_shape) or not all(
        agree(a, b) for a, b in zip(value_shape[:-1], key_shape[:-1])
    ):
        raise _keras_says(
            f"All dimensions of `value` and `key`, except the last one, must be equal. Received: "
            f"value_shape={tuple(value_shape)} and key_shape={tuple(key_shape)}",
            "key defaults to value; pass key=None, or a key with value's batch and length axes.",
        )
    rank = len(query_shape)
    if rank < 3:
        raise ValueError(
            f"query must be at least (B, T, E): a batch, an attention and a feature axis; got "
            f"query_shape={tuple(query_shape)}. Add a length axis, e.g. x[:, None, :]"
        )
    if len(value_shape) != rank:
        raise ValueError(
            f"value must have the query's rank {rank}, got value_shape={tuple(value_shape)} for "
            f"query_shape={tuple(query_shape)}"
        )
    raw = tuple(range(1, rank - 1)) if attention_axes is None else tuple(attention_axes)
    axes = tuple(a + rank if a < 0 else a for a in raw)  # negative axes count from the query's end
    if any(not 1 <= a <= rank - 2 for a in axes) or len(set(axes)) != len(axes):
        raise ValueError(
            f"attention_axes must be distinct axes between the batch axis and the feature axis of the "
            f"rank-{rank} query (1 .. {rank - 2}, or {1 - rank} .. -2), got attention_axes={attention_axes}"
        )
    others = [i for i in range(rank - 1) if i not in axes]  # batch and the other non-attention axes
    if not all(agree(query_shape[i], value_shape[i]) for i in others):
        raise ValueError(
            f"query and value must be equal on every axis that is neither an attention axis {axes} nor the "
            f"feature axis, got query_shape={tuple(query_shape)} and value_shape={tuple(value_shape)}"
        )
    return axes


def _expand_mask(mask: Any, scores_rank: int, n_axes: int) -> Any:
    """A mask in Keras's layout (b..., T..., S...) -> the scores' rank, inserting axes before the heads."""
    while len(mask.shape) < scores_rank:
        mask = ops.expand_dims(mask, -2 * n_axes - 1)
    return mask


@keras.saving.register_keras_serializable(package="multihead")
class MultiHeadAttention(keras.layers.MultiHeadAttention):
    """``keras.layers.MultiHeadAttention`` with multihead's semantics and kernels (see the module docstring).

    Args: Keras's own (num_heads H, key_dim Dk, value_dim Dv, dropout, use_bias, output_shape, attention_axes,
    sliding_window, flash_attention, initializers, regularizers, constraints, use_gate, seed), plus
    ``implementation``: "auto" (default; :func:`multihead.attention` on the torch backend) or "einsum"
    (Keras's einsum math on every backend).

    Call: ``query`` (B, T, E), ``value`` (B, S, Ev), ``key`` (B, S, Ek) = value by default;
    ``query_mask`` (B, T), ``value_mask``/``key_mask`` (B, S) and ``attention_mask`` (B, T, S) [all
    1 = may attend], ``use_causal_mask`` (top-left: query i sees keys j <= i), ``training``,
    ``return_attention_scores``. Returns (B, T, O), and scores (B, H, T, S) on request. With T = S = 3,
    ``use_causal_mask`` allows::

        1 0 0
        1 1 0
        1 1 1

    Extra: :meth:`enable_lora` puts LoRA adapters on the projections and freezes everything else.
    """

    def __init__(
        self,
        num_heads: int,
        key_dim: int,
        value_dim: int | None = None,
        dropout: float = 0.0,
        use_bias: bool = True,
        output_shape: int | Sequence[int] | None = None,
        attention_axes: int | Sequence[int] | None = None,
        sliding_window: int | None = None,
        flash_attention: bool | None = None,
        kernel_initializer: Any = "glorot_uniform",
        bias_initializer: Any = "zeros",
        kernel_regularizer: Any = None,
        bias_regularizer: Any = None,
        activity_regularizer: Any = None,
        kernel_constraint: Any = None,
        bias_constraint: Any = None,
        use_gate: bool = False,
        seed: int | None = None,
        implementation: str = "auto",
        **kwargs: Any,
    ) -> None:
        _check_args(
            num_heads,
            key_dim,
            value_dim,
            dropout,
            output_shape,
            attention_axes,
            sliding_window,
            implementation,
        )
        super().__init__(
            num_heads=num_heads,
            key_dim=key_dim,
            value_dim=value_dim,
            dropout=float(dropout),
            use_bias=use_bias,
            output_shape=output_shape,
            attention_axes=attention_axes,
            sliding_window=sliding_window,
            flash_attention=flash_attention,
            kernel_initializer=kernel_initializer,
            bias_initializer=bias_initializer,
            kernel_regularizer=kernel_regularizer,
            bias_regularizer=bias_regularizer,
            activity_regularizer=activity_regularizer,
            kernel_constraint=kernel_constraint,
            bias_constraint=bias_constraint,
            use_gate=use_gate,
            seed=seed,
            **kwargs,
        )
        self._implementation = implementation

    @property
    def implementation(self) -> str:
        return self._implementation

    def get_config(self) -> dict[str, Any]:
        return {**super().get_config(), "implementation": self._implementation}

    # ------------------------------------------------------------------------------------------
    # build: Keras's sub-layers, after our shape checks
    # ------------------------------------------------------------------------------------------

    def build(
        self,
        query_shape: Sequence[int | None],
        value_shape: Sequence[int | None],
        key_shape: Sequence[int | None] | None = None,
    ) -> None:
        key_shape = value_shape if key_shape is None else key_shape
        _check_shapes(query_shape, value_shape, key_shape, self._attention_axes)
        super().build(query_shape, value_shape, key_shape)

    def compute_output_shape(
        self,
        query_shape: Sequence[int | None],
        value_shape: Sequence[int | None],
        key_shape: Sequence[int | None] | None = None,
    ) -> tuple[int | None, ...]:
        _check_shapes(query_shape, value_shape, value_shape if key_shape is None else key_shape, None)
        return super().compute_output_shape(query_shape, value_shape, key_shape)

    def compute_output_spec(
        self,
        query: Any,
        value: Any,
        key: Any = None,
        query_mask: Any = None,
        value_mask: Any = None,
        key_mask: Any = None,
        attention_mask: Any = None,
        return_attention_scores: bool = False,
        training: bool | None = None,
        use_causal_mask: bool = False,
    ) -> Any:
        """Symbolic shapes: output (B, T..., O) and, on request, scores (b..., H, T..., S...)."""
        self._check_flash(return_attention_scores)
        key_shape = None if key is None else key.shape
        out = keras.KerasTensor(
            self.compute_output_shape(query.shape, value.shape, key_shape), dtype=self.compute_dtype
        )
        if not return_attention_scores:
            return out
        axes = _check_shapes(query.shape, value.shape, key_shape or value.shape, self._attention_axes)
        batch = [query.shape[i] for i in range(len(query.shape) - 1) if i not in axes]
        shape = (*batch, self._num_heads, *(query.shape[a] for a in axes), *(value.shape[a] for a in axes))
        return out, keras.KerasTensor(shape, dtype=self.compute_dtype)

    # ------------------------------------------------------------------------------------------
    # call
    # ------------------------------------------------------------------------------------------

    def _check_flash(self, return_attention_scores: bool) -> None:
        if self._flash_attention and return_attention_scores:
            raise _keras_says(
                "Returning attention scores is not supported when flash attention is enabled. Please disable "
                "flash attention to access attention scores.",
                "Flash kernels never form the scores: construct the layer with flash_attention=False (and "
                "call keras.config.disable_flash_attention() if it is enabled globally).",
            )

    def call(
        self,
        query: Any,
        value: Any,
        key: Any = None,
        query_mask: Any = None,
        value_mask: Any = None,
        key_mask: Any = None,
        attention_mask: Any = None,
        return_attention_scores: bool = False,
        training: bool | None = None,
        use_causal_mask: bool = False,
    ) -> Any:
        self._check_flash(return_attention_scores)
        if use_causal_mask:
            self._single_attention_axis("use_causal_mask")
        key = value if key is None else key
        if query_mask is None:  # Keras fills the *_mask arguments from the inputs' Keras masks
            query_mask = get_keras_mask(query)
        for x in (query, value, key):  # consumed here, as in Keras: the sub-layers must not see them
            set_keras_mask(x, None)

        # Causal alone goes to the kernels' own causal flag, unless a subclass computes the attention.
        causal_only = (
            use_causal_mask
            and all(m is None for m in (query_mask, value_mask, key_mask, attention_mask))
            and self._sliding_window is None
            and type(self)._compute_attention is MultiHeadAttention._compute_attention
        )
        if not causal_only:
            attention_mask = self._compute_attention_mask(
                query,
                value,
                query_mask=query_mask,
                value_mask=value_mask,
                key_mask=key_mask,
                attention_mask=attention_mask,
                use_causal_mask=use_causal_mask,
            )
        gate = self._gate_dense(query) if self._use_gate else None
        query = self._query_dense(query)  # (B, T..., H, Dk)
        key = self._key_dense(key)  # (B, S..., H, Dk)
        value = self._value_dense(value)  # (B, S..., H, Dv)
        extra = {"use_causal_mask": True} if causal_only else {}  # subclasses with the older signature
        out, scores = self._compute_attention(
            query, key, value, attention_mask, training, return_attention_scores, **extra
        )
        if gate is not None:
            out = ops.multiply(out, gate)
        out = self._output_dense(out)  # (B, T..., O)
        if query_mask is not None:
            set_keras_mask(out, query_mask)
        return (out, scores) if return_attention_scores else out

    # ------------------------------------------------------------------------------------------
    # positional masks: along the attention axis
    # ------------------------------------------------------------------------------------------

    def _single_attention_axis(self, what: str) -> int:
        if len(self._attention_axes) != 1:
            raise ValueError(
                f"{what} needs one attention axis (one order of positions), got attention_axes="
                f"{self._attention_axes}; build the mask yourself and pass attention_mask="
            )
        return self._attention_axes[0]

    def _positions(self, query: Any, value: Any, what: str) -> tuple[Any, Any]:
        """Query positions (1, T, 1) and key positions (1, 1, S) along the attention axis."""
        axis = self._single_attention_axis(what)
        t = ops.shape(query)[axis]
        s = t if value is None else ops.shape(value)[axis]
        rows = ops.reshape(ops.arange(t, dtype="int32"), (1, t, 1))  # (1, T, 1)
        cols = ops.reshape(ops.arange(s, dtype="int32"), (1, 1, s))  # (1, 1, S)
        return rows, cols

    def _compute_causal_mask(self, query: Any, value: Any = None) -> Any:
        """(1, T, S), True where key j <= query i (top-left aligned, as Keras), along the attention axis."""
        rows, cols = self._positions(query, value, "use_causal_mask")
        return ops.greater_equal(rows, cols)

    def _compute_sliding_window_mask(self, query: Any, value: Any = None) -> Any:
        """(1, T, S), True where |i - j| < sliding_window, along the attention axis."""
        rows, cols = self._positions(query, value, "sliding_window")
        return ops.less(ops.abs(rows - cols), self._sliding_window)

    # ------------------------------------------------------------------------------------------
    # the attention
    # ------------------------------------------------------------------------------------------

    def _masked_softmax(self, attention_scores: Any, attention_mask: Any = None) -> Any:
        """Softmax over the key axes; masked keys get 0, and so does every key of a fully masked query."""
        if attention_mask is None:
            return self._softmax(attention_scores)
        mask = ops.cast(attention_mask, "bool")
        mask = _expand_mask(mask, len(attention_scores.shape), len(self._attention_axes))
        probs = self._softmax(attention_scores, mask=mask)
        # Keras 3.15's Softmax zeroes masked keys itself; explicit here, so the documented zeros for a
        # fully masked query do not depend on the Keras version
        return ops.where(mask, probs, ops.zeros_like(probs))

    def _compute_attention(
        self,
        query: Any,
        key: Any,
        value: Any,
        attention_mask: Any = None,
        training: bool | None = None,
        return_attention_scores: bool = False,
        use_causal_mask: bool = False,
    ) -> tuple[Any, Any]:
        """Attention over projected q (B, T..., H, Dk), k (B, S..., H, Dk), v (B, S..., H, Dv).

        ``attention_mask`` is in Keras's layout (b..., T..., S...), broadcastable, True = may attend;
        ``use_causal_mask`` (only with no mask) asks for a top-left causal mask. Returns the output
        (B, T..., H, Dv) and the scores (b..., H, T..., S...) (None when not requested on a fused path).
        """
        self._check_flash(return_attention_scores)
        dropping = bool(training) and self._dropout > 0.0
        torch_route = (
            keras.backend.backend() == "torch"
            and self._implementation == "auto"
            and not dropping
            and type(self)._masked_softmax is MultiHeadAttention._masked_softmax
        )
        if torch_route:
            return self._attend_multihead(
                query, key, value, attention_mask, use_causal_mask, return_attention_scores
            )
        if use_causal_mask:
            causal = self._compute_causal_mask(query, value)  # (1, T, S)
            attention_mask = causal if attention_mask is None else ops.logical_and(attention_mask, causal)
        if self._flash_attention and not dropping and len(query.shape) == 4:
            return self._attend_flash(query, key, value, attention_mask), None
        return self._attend_einsum(query, key, value, attention_mask, training)

    def _attend_einsum(
        self, query: Any, key: Any, value: Any, mask: Any, training: bool | None
    ) -> tuple[Any, Any]:
        """Keras's math: einsum scores, :meth:`_masked_softmax`, dropout on the weights, einsum combine."""
        query = ops.multiply(query, ops.cast(self._inverse_sqrt_key_dim, query.dtype))
        scores = ops.einsum(self._dot_product_equation, key, query)  # (b..., H, T..., S...)
        scores = self._masked_softmax(scores, mask)
        dropped = self._dropout_layer(scores, training=training) if self._dropout > 0.0 else scores
        return ops.einsum(self._combine_equation, dropped, value), scores  # (B, T..., H, Dv)

    def _attend_flash(self, query: Any, key: Any, value: Any, mask: Any) -> Any:
        """``keras.ops.dot_product_attention(flash_attention=True)``, with fully masked queries zeroed."""
        if mask is not None:
            mask = _expand_mask(ops.cast(mask, "bool"), 4, 1)  # (B|1, H|1, T, S)
        out = ops.dot_product_attention(
            query, key, value, mask=mask, scale=self._inverse_sqrt_key_dim, flash_attention=True
        )  # (B, T, H, Dv)
        if mask is None:
            return out
        alive = ops.any(mask, axis=-1)  # (B|1, H|1, T)
        alive = ops.expand_dims(ops.transpose(alive, (0, 2, 1)), -1)  # (B|1, T, H|1, 1)
        return ops.where(alive, out, ops.zeros_like(out))

    def _attend_multihead(
        self, query: Any, key: Any, value: Any, mask: Any, causal: bool, return_scores: bool
    ) -> tuple[Any, Any]:
        """:func:`multihead.attention` on the torch backend: Keras's layout in and out."""
        from ..core.attention import attention, output_and_weights  # torch backend: torch is installed

        rank = len(query.shape)
        axes = self._attention_axes
        batch = [i for i in range(rank - 2) if i not in axes]  # non-attention axes, without the head
        perm = (*batch, rank - 2, *axes, rank - 1)
        inverse = tuple(perm.index(i) for i in range(rank))
        qs, ks = ops.shape(query), ops.shape(key)
        bshape = [qs[i] for i in batch]
        tshape, sshape = [qs[i] for i in axes], [ks[i] for i in axes]
        bf, tf, sf, h = math.prod(bshape), math.prod(tshape), math.prod(sshape), self._num_heads

        def heads(x: Any, length: int, dim: int) -> Any:
            return ops.reshape(ops.transpose(x, perm), (bf, h, length, dim))  # (Bf, H, L, D)

        qh, kh, vh = (
            heads(query, tf, self._key_dim),
            heads(key, sf, self._key_dim),
            heads(value, sf, self._value_dim),
        )
        if causal and tf != sf:  # multihead's causal is bottom-right aligned; Keras's is top-left
            mask, causal = self._compute_causal_mask(query, value), False
        if mask is not None:
            mask = self._mask_to_heads(mask, bshape, tshape, sshape)  # (Bf|1, H|1, Tf, Sf)
        res = attention(
            qh,
            kh,
            vh,
            mask=mask,
            causal=causal,
            scale=self._inverse_sqrt_key_dim,
            return_weights=return_scores,
        )
        out, scores = output_and_weights(res)  # (Bf, H, Tf, Dv), (Bf, H, Tf, Sf) | None
        out = ops.reshape(out, (*bshape, h, *tshape, self._value_dim))  # (b..., H, T..., Dv)
        out = ops.transpose(out, inverse)  # (B, T..., H, Dv)
        if scores is not None:
            scores = ops.reshape(scores, (*bshape, h, *tshape, *sshape))  # (b..., H, T..., S...)
        return out, scores

    def _mask_to_heads(self, mask: Any, bshape: list[int], tshape: list[int], sshape: list[int]) -> Any:
        """A Keras-layout mask (b..., T..., S...) -> (Bf|1, H|1, Tf, Sf), broadcasting like Keras."""
        mask = _expand_mask(ops.cast(mask, "bool"), len(bshape) + 1 + 2 * len(tshape), len(tshape))
        ms = ops.shape(mask)
        hm = ms[len(bshape)]
        lead = bshape if any(ms[i] != 1 for i in range(len(bshape))) else [1] * len(bshape)
        mask = ops.broadcast_to(mask, (*lead, hm, *tshape, *sshape))  # (b..., H|1, T..., S...)
        return ops.reshape(mask, (math.prod(lead), hm, math.prod(tshape), math.prod(sshape)))

    # ------------------------------------------------------------------------------------------
    # LoRA
    # ------------------------------------------------------------------------------------------

    def enable_lora(
        self,
        rank: int,
        lora_alpha: float | None = None,
        a_initializer: Any = "he_uniform",
        b_initializer: Any = "zeros",
        targets: Sequence[str] = ("query_dense", "key_dense", "value_dense", "output_dense"),
    ) -> None:
        """LoRA adapters of rank ``rank`` on the ``targets`` projections; every other weight is frozen.

        Each target is Keras's ``EinsumDense.enable_lora`` (its kernel frozen, the adapters A (in..., rank),
        B (rank, out) trained, merged into the kernel when saved); biases, the gate and the projections not
        in ``targets`` stop training too, so only the adapters learn. The layer must be built.
        """
        if not _is_positive_int(rank):
            raise _invalid("rank", rank, "a positive integer")
        names = ("query_dense", "key_dense", "value_dense", "output_dense")
        unknown = [t for t in targets if t not in names]
        if unknown or not targets:
            raise _invalid("targets", tuple(targets), f"a non-empty subset of {names}")
        if not self.built:
            raise ValueError("enable_lora needs a built layer: call it once (or build it) first")
        gate = (self._gate_dense,) if self._use_gate else ()
        for layer in (*(getattr(self, n) for n in names), *gate):
            for (
                variable
            ) in layer.weights:  # variable-level: a later `layer.trainable = True` keeps them frozen
                variable.trainable = False
        for name in targets:
            getattr(self, name).enable_lora(
                rank, lora_alpha, a_initializer=a_initializer, b_initializer=b_initializer
            )
