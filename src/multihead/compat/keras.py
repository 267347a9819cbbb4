"""``MultiHeadAttention``: a drop-in Keras 3 layer for ``keras.layers.MultiHeadAttention``.

Dimensions: B batch, T query positions, S key positions (each possibly several ``attention_axes``,
flattened to Tf/Sf), H heads, Dk = key_dim, Dv = value_dim, E query features, O output features,
Bf = the product of every non-attention, non-feature axis (batch included).

Same constructor, ``call``, config and weights (same order, shapes and names), so
``ours.set_weights(keras_layer.get_weights())`` reproduces Keras's outputs and scores. Written with
``keras.ops`` only, so it runs on every Keras backend; on the torch backend, when no dropout is active,
the attention itself is :func:`multihead.attention` (fused kernels, per-head weights on request).

Masks keep Keras's meaning (``1``/``True`` = may attend), which is also the library's. Differences,
all deliberate:

* ``query_mask=`` passed explicitly is honoured (Keras 3 replaces it by the query's ``_keras_mask``,
  silently dropping an explicit one);
* a query with no allowed key gets output 0 and scores 0 (Keras: 0 scores, uniform values average);
* ``use_causal_mask`` and ``sliding_window`` are laid along the attention axis (Keras always uses axis 1),
  and with several attention axes, where causality has no single order, they raise ``ValueError``;
* ``flash_attention`` is accepted for signature compatibility; the kernel is chosen by multihead.

This module imports Keras; ``import multihead`` does not (install ``multihead[keras]``).
"""

from __future__ import annotations

import math
import string
from collections.abc import Sequence
from typing import Any

import keras
from keras import ops
from keras.src.backend import set_keras_mask  # Keras's own layers clear consumed masks with it

__all__ = ["MultiHeadAttention"]

_LETTERS = string.ascii_lowercase

#: On the torch backend, run the attention through :func:`multihead.attention` (False: the keras.ops path).
USE_MULTIHEAD_ON_TORCH = True


def _proj_equation(free_dims: int, bound_dims: int, output_dims: int) -> tuple[str, str, int]:
    """Einsum for a projection: input (free..., bound...), kernel (bound..., out...) -> (free..., out...)."""
    free = _LETTERS[:free_dims]
    bound = _LETTERS[free_dims : free_dims + bound_dims]
    out = _LETTERS[free_dims + bound_dims : free_dims + bound_dims + output_dims]
    return f"{free}{bound},{bound}{out}->{free}{out}", out, free_dims + output_dims


def _dense_shape(output_rank: int, known: Sequence[int]) -> list[int | None]:
    """EinsumDense ``output_shape`` (everything after the batch axis): None for the free axes."""
    return [None] * (output_rank - 1 - len(known)) + list(known)


@keras.saving.register_keras_serializable(package="multihead")
class MultiHeadAttention(keras.layers.Layer):
    """Multi-head attention with ``keras.layers.MultiHeadAttention``'s arguments, weights and config.

    Args: num_heads (H), key_dim (Dk), value_dim (Dv, default Dk), dropout, use_bias, output_shape
    (default: the query's last dim), attention_axes (default: every axis but batch and features),
    sliding_window, flash_attention (ignored), kernel/bias initializers, regularizers and constraints,
    use_gate, seed (for dropout).

    Call: ``query`` (B, T, E), ``value`` (B, S, Ev), ``key`` (B, S, Ek) = value by default;
    ``query_mask`` (B, T), ``value_mask``/``key_mask`` (B, S) and ``attention_mask`` (B, T, S) [all
    1 = may attend], ``use_causal_mask`` (top-left: query i sees keys j <= i), ``training``,
    ``return_attention_scores``. Returns (B, T, O), and scores (B, H, T, S) on request. With T = S = 3,
    ``use_causal_mask`` allows::

        1 0 0
        1 1 0
        1 1 1
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
        **kwargs: Any,
    ) -> None:
        for name, value in (("num_heads", num_heads), ("key_dim", key_dim)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {name}={value!r}")
        if value_dim is not None and (
            isinstance(value_dim, bool) or not isinstance(value_dim, int) or value_dim <= 0
        ):
            raise ValueError(f"value_dim must be a positive int or None, got value_dim={value_dim!r}")
        if not 0.0 <= float(dropout) < 1.0:
            raise ValueError(f"dropout must be a probability in [0, 1), got dropout={dropout!r}")
        if sliding_window is not None and (not isinstance(sliding_window, int) or sliding_window <= 0):
            raise ValueError(f"sliding_window must be None or a positive int, got {sliding_window!r}")
        super().__init__(**kwargs)
        self.supports_masking = True  # the output carries the query's Keras mask
        self._num_heads = num_heads
        self._key_dim = key_dim
        self._value_dim = value_dim if value_dim else key_dim
        self._dropout = float(dropout)
        self._use_bias = use_bias
        self._use_gate = use_gate
        if output_shape:
            output_shape = (output_shape,) if isinstance(output_shape, int) else tuple(output_shape)
        self._output_shape = output_shape or None
        if isinstance(attention_axes, int):
            attention_axes = (attention_axes,)
        elif attention_axes is not None and not isinstance(attention_axes, (list, tuple)):
            raise ValueError(f"attention_axes must be an int, list or tuple, got {attention_axes!r}")
        self._attention_axes = None if attention_axes is None else tuple(attention_axes)
        self._sliding_window = sliding_window
        self._flash_attention = flash_attention
        self._kernel_initializer = keras.initializers.get(kernel_initializer)
        self._bias_initializer = keras.initializers.get(bias_initializer)
        self._kernel_regularizer = keras.regularizers.get(kernel_regularizer)
        self._bias_regularizer = keras.regularizers.get(bias_regularizer)
        self._activity_regularizer = keras.regularizers.get(activity_regularizer)
        self._kernel_constraint = keras.constraints.get(kernel_constraint)
        self._bias_constraint = keras.constraints.get(bias_constraint)
        self.seed = seed
        self._scale = 1.0 / math.sqrt(float(key_dim))

    # read-only properties named like Keras's
    num_heads = property(lambda self: self._num_heads)
    key_dim = property(lambda self: self._key_dim)
    value_dim = property(lambda self: self._value_dim)
    dropout = property(lambda self: self._dropout)
    use_bias = property(lambda self: self._use_bias)
    attention_axes = property(lambda self: self._attention_axes)

    def get_config(self) -> dict[str, Any]:
        ser = keras.saving.serialize_keras_object
        return {
            **super().get_config(),
            "num_heads": self._num_heads,
            "key_dim": self._key_dim,
            "value_dim": self._value_dim,
            "dropout": self._dropout,
            "use_bias": self._use_bias,
            "use_gate": self._use_gate,
            "output_shape": self._output_shape,
            "attention_axes": self._attention_axes,
            "sliding_window": self._sliding_window,
            "kernel_initializer": ser(self._kernel_initializer),
            "bias_initializer": ser(self._bias_initializer),
            "kernel_regularizer": ser(self._kernel_regularizer),
            "bias_regularizer": ser(self._bias_regularizer),
            "activity_regularizer": ser(self._activity_regularizer),
            "kernel_constraint": ser(self._kernel_constraint),
            "bias_constraint": ser(self._bias_constraint),
            "seed": self.seed,
        }

    # ------------------------------------------------------------------------------------------
    # build: the same sublayers, in the same order, as keras.layers.MultiHeadAttention
    # ------------------------------------------------------------------------------------------

    def _dense(self, rank: int, bound: int, known: Sequence[int], name: str, activation: Any = None) -> Any:
        equation, bias_axes, out_rank = _proj_equation(rank - bound, bound, len(known))
        fresh = [
            i.__class__.from_config(i.get_config())
            for i in (self._kernel_initializer, self._bias_initializer)
        ]
        return keras.layers.EinsumDense(
            equation,
            output_shape=_dense_shape(out_rank, known),
            bias_axes=bias_axes if self._use_bias else None,
            activation=activation,
            name=name,
            kernel_initializer=fresh[0],
            bias_initializer=fresh[1],
            kernel_regularizer=self._kernel_regularizer,
            bias_regularizer=self._bias_regularizer,
            activity_regularizer=self._activity_regularizer,
            kernel_constraint=self._kernel_constraint,
            bias_constraint=self._bias_constraint,
            dtype=self.dtype_policy,
        )

    def build(
        self, query_shape: Sequence[int | None], value_shape: Sequence[int | None], key_shape: Any = None
    ) -> None:
        key_shape = value_shape if key_shape is None else key_shape
        if tuple(value_shape[1:-1]) != tuple(key_shape[1:-1]):
            raise ValueError(
                f"value and key must agree on every axis but the last, got value_shape={tuple(value_shape)} "
                f"and key_shape={tuple(key_shape)}"
            )
        heads_k, heads_v = (self._num_heads, self._key_dim), (self._num_heads, self._value_dim)
        self._query_dense = self._dense(len(query_shape), 1, heads_k, "query")
        self._query_dense.build(query_shape)
        self._key_dense = self._dense(len(key_shape), 1, heads_k, "key")
        self._key_dense.build(key_shape)
        if self._use_gate:
            self._gate_dense = self._dense(len(query_shape), 1, heads_v, "gate", activation="sigmoid")
            self._gate_dense.build(query_shape)
        self._value_dense = self._dense(len(value_shape), 1, heads_v, "value")
        self._value_dense.build(value_shape)

        rank = len(query_shape) + 1  # projected: (B, T..., H, D)
        axes = self._attention_axes if self._attention_axes is not None else tuple(range(1, rank - 2))
        self._attention_axes = tuple(a if a >= 0 else (rank - 1) + a for a in axes)
        if any(not 1 <= a < rank - 2 for a in self._attention_axes):
            raise ValueError(
                f"attention_axes must name axes between the batch and the feature axis of a rank "
                f"{len(query_shape)} query, got {axes}"
            )
        self._dropout_layer = keras.layers.Dropout(
            rate=self._dropout, dtype=self.dtype_policy, seed=self.seed
        )
        out = self._output_shape or (query_shape[-1],)
        self._output_dense = self._dense(len(query_shape) + 1, 2, out, "attention_output")
        self._output_dense.build(tuple(query_shape[:-1]) + heads_v)

    # ------------------------------------------------------------------------------------------
    # call
    # ------------------------------------------------------------------------------------------

    def _positional_mask(self, t: int, s: int, use_causal_mask: bool) -> Any:
        """Causal (top-left) and sliding-window masks along the attention axis, (T, S), or None."""
        if not use_causal_mask and self._sliding_window is None:
            return None
        if len(self._attention_axes) != 1:
            raise ValueError(
                f"use_causal_mask / sliding_window need one attention axis (one order of positions), got "
                f"attention_axes={self._attention_axes}; build the mask yourself and pass attention_mask="
            )
        rows = ops.expand_dims(ops.arange(t), 1)  # (T, 1)
        cols = ops.expand_dims(ops.arange(s), 0)  # (1, S)
        mask = None
        if use_causal_mask:
            mask = ops.greater_equal(rows, cols)  # (T, S)
        if self._sliding_window is not None:
            band = ops.less(ops.abs(rows - cols), self._sliding_window)  # (T, S)
            mask = band if mask is None else ops.logical_and(mask, band)
        return mask

    def _attention_mask(
        self, query_mask: Any, value_mask: Any, key_mask: Any, attention_mask: Any, positional: Any
    ) -> Any:
        """Keras's mask merge: query (B, T, 1) & value/key (B, 1, S) & positional & attention_mask."""
        parts = []
        if query_mask is not None:
            parts.append(ops.expand_dims(ops.cast(query_mask, "bool"), -1))  # (B, T, 1)
        for m in (value_mask, key_mask):
            if m is not None:
                parts.append(ops.expand_dims(ops.cast(m, "bool"), -2))  # (B, 1, S)
        if positional is not None:
            parts.append(positional)
        if attention_mask is not None:
            parts.append(ops.cast(attention_mask, "bool"))
        if not parts:
            return None
        mask = parts[0]
        for p in parts[1:]:
            mask = ops.logical_and(mask, p)
        return mask

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
        key = value if key is None else key
        for x in (query, value, key):  # masks arrive as *_mask arguments; like Keras, consume them here
            if getattr(x, "_keras_mask", None) is not None:
                set_keras_mask(x, None)
        gate = self._gate_dense(query) if self._use_gate else None
        q = self._query_dense(query)  # (B, T..., H, Dk)
        k = self._key_dense(key)  # (B, S..., H, Dk)
        v = self._value_dense(value)  # (B, S..., H, Dv)

        rank = len(q.shape)
        attn = self._attention_axes
        batch = [i for i in range(rank - 2) if i not in attn]  # non-attention axes, without the head
        perm = (*batch, rank - 2, *attn, rank - 1)
        inverse = tuple(perm.index(i) for i in range(rank))
        qs, ks = ops.shape(q), ops.shape(k)
        bshape = [qs[i] for i in batch]
        tshape, sshape = [qs[i] for i in attn], [ks[i] for i in attn]
        bf, tf, sf = math.prod(bshape), math.prod(tshape), math.prod(sshape)
        h = self._num_heads

        def heads(x: Any, length: int, dim: int) -> Any:
            return ops.reshape(ops.transpose(x, perm), (bf, h, length, dim))  # (Bf, H, L, D)

        qh, kh, vh = heads(q, tf, self._key_dim), heads(k, sf, self._key_dim), heads(v, sf, self._value_dim)

        positional = self._positional_mask(tf, sf, use_causal_mask)
        only_causal = (
            use_causal_mask
            and self._sliding_window is None
            and tf == sf
            and all(m is None for m in (query_mask, value_mask, key_mask, attention_mask))
        )
        mask = None
        if not only_causal:
            mask = self._attention_mask(query_mask, value_mask, key_mask, attention_mask, positional)
            mask = self._mask_to_heads(mask, bshape, tshape, sshape)  # (Bf|1, H|1, Tf, Sf)

        dropping = bool(training) and self._dropout > 0
        if USE_MULTIHEAD_ON_TORCH and keras.backend.backend() == "torch" and not dropping:
            from ..core.attention import attention, output_and_weights

            res = attention(qh, kh, vh, mask=mask, causal=only_causal, return_weights=return_attention_scores)
            out, scores = output_and_weights(res)
        else:
            if only_causal:
                mask = ops.expand_dims(positional, 0)  # (1, T, S) -> broadcast over heads below
            out, scores = self._attend_ops(qh, kh, vh, mask, training)

        out = ops.reshape(out, (*bshape, h, *tshape, self._value_dim))  # (b..., H, T..., Dv)
        out = ops.transpose(out, inverse)  # (B, T..., H, Dv)
        if gate is not None:
            out = ops.multiply(out, gate)
        out = self._output_dense(out)  # (B, T..., O)
        if not return_attention_scores:
            return out
        return out, ops.reshape(scores, (*bshape, h, *tshape, *sshape))  # (b..., H, T..., S...)

    def _mask_to_heads(self, mask: Any, bshape: list[int], tshape: list[int], sshape: list[int]) -> Any:
        """A Keras-layout mask (b..., T..., S...) -> (Bf|1, H|1, Tf, Sf), broadcasting like Keras."""
        if mask is None:
            return None
        n_attn = len(tshape)
        scores_rank = len(bshape) + 1 + 2 * n_attn
        while len(mask.shape) < scores_rank:  # Keras inserts the missing axes before the head axis
            mask = ops.expand_dims(mask, -2 * n_attn - 1)
        ms = ops.shape(mask)
        hm = ms[len(bshape)]
        lead = bshape if any(ms[i] != 1 for i in range(len(bshape))) else [1] * len(bshape)
        mask = ops.broadcast_to(mask, (*lead, hm, *tshape, *sshape))  # (b..., H|1, T..., S...)
        return ops.reshape(mask, (math.prod(lead), hm, math.prod(tshape), math.prod(sshape)))

    def _attend_ops(self, q: Any, k: Any, v: Any, mask: Any, training: bool | None) -> tuple[Any, Any]:
        """Portable attention in keras.ops: q (Bf, H, Tf, Dk), k (Bf, H, Sf, Dk), v (Bf, H, Sf, Dv).

        Equals :func:`multihead.attention_reference`: masked scores are -inf, rows with no allowed key
        give weights 0 and output 0; dropout (seeded) acts on the weights used for the output only.
        """
        scores = ops.matmul(q * ops.cast(self._scale, q.dtype), ops.swapaxes(k, -1, -2))  # (Bf, H, Tf, Sf)
        row_ok = None
        if mask is not None:
            mask = ops.broadcast_to(mask, ops.shape(scores))  # (Bf, H, Tf, Sf)
            row_ok = ops.any(mask, axis=-1, keepdims=True)  # (Bf, H, Tf, 1)
            scores = ops.where(mask, scores, ops.full_like(scores, -math.inf))
            scores = ops.where(row_ok, scores, ops.zeros_like(scores))  # dead rows: finite, zeroed below
        weights = ops.softmax(scores, axis=-1)
        if row_ok is not None:
            weights = weights * ops.cast(row_ok, weights.dtype)
        dropped = self._dropout_layer(weights, training=training) if self._dropout > 0 else weights
        return ops.matmul(dropped, v), weights  # (Bf, H, Tf, Dv), (Bf, H, Tf, Sf)

    def compute_output_shape(
        self, query_shape: Sequence[int | None], value_shape: Sequence[int | None], key_shape: Any = None
    ) -> tuple[int | None, ...]:
        query_shape = tuple(query_shape)
        if self._output_shape:
            return query_shape[:-1] + tuple(self._output_shape)
        return query_shape
