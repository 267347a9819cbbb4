"""Seed 004 on TensorFlow through Keras: d2l's multi-head attention as written, next to multihead's layer.

The notebook's example: 2 x 4 queries, 6 key-value pairs, 100 hiddens, 5 heads, dropout 0.5, integer
``valid_lens`` [3, 2], called with ``training=False`` -> ``TensorShape([2, 4, 100])``. d2l's ``W_q``,
``W_k``, ``W_v``, ``W_o`` (no bias) load into ``multihead.compat.keras.MultiHeadAttention`` (kernels (100, 5, 20)
and (5, 20, 100)), and ``valid_lens`` becomes Keras's ``value_mask`` (B, S) or ``attention_mask``
(B, T, S), True = may attend. Then:

* outputs and per-head weights agree to 1e-5 for ``valid_lens`` of shape (B,) and (B, Lq);
* d2l's ``masked_softmax`` fills hidden scores with -1e6, so a query whose valid_len is 0 attends
  *uniformly to every key, padding included*, and returns the mean of the padded values; ours gives 0.

d2l's ``d2l.py`` (downloaded by the notebook) is not fetched: its TensorFlow ``sequence_mask``,
``masked_softmax`` and ``DotProductAttention`` are written out below as d2l defines them.

Run: python examples/seeds/seed004_keras_tf.py   (KERAS_BACKEND=tensorflow; set here when unset)
"""

import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from multihead.compat.keras import MultiHeadAttention as KerasMHA  # noqa: E402

num_hiddens, num_heads = 100, 5
batch_size, num_queries, num_kvpairs = 2, 4, 6


# ---- d2l (TensorFlow edition): the helpers the notebook imports, and the notebook's layer ------------------


def sequence_mask(X, valid_len, value=0):
    maxlen = X.shape[1]
    mask = tf.range(start=0, limit=maxlen, dtype=tf.float32)[None, :] < tf.cast(
        valid_len[:, None], tf.float32
    )
    if len(X.shape) == 3:
        return tf.where(tf.expand_dims(mask, axis=-1), X, value)
    return tf.where(mask, X, value)


def masked_softmax(X, valid_lens):
    if valid_lens is None:
        return tf.nn.softmax(X, axis=-1)
    shape = X.shape
    if len(valid_lens.shape) == 1:
        valid_lens = tf.repeat(valid_lens, repeats=shape[1])
    else:
        valid_lens = tf.reshape(valid_lens, shape=-1)
    X = sequence_mask(tf.reshape(X, shape=(-1, shape[-1])), valid_lens, value=-1e6)  # the bug: -1e6
    return tf.nn.softmax(tf.reshape(X, shape=shape), axis=-1)


class DotProductAttention(keras.layers.Layer):
    def __init__(self, dropout, **kwargs):
        super().__init__(**kwargs)
        self.dropout = keras.layers.Dropout(dropout)

    def call(self, queries, keys, values, valid_lens, **kwargs):
        d = queries.shape[-1]
        scores = tf.matmul(queries, keys, transpose_b=True) / tf.math.sqrt(tf.cast(d, dtype=tf.float32))
        self.attention_weights = masked_softmax(scores, valid_lens)
        return tf.matmul(self.dropout(self.attention_weights, **kwargs), values)


def transpose_qkv(X, num_heads):
    X = tf.reshape(X, shape=(X.shape[0], X.shape[1], num_heads, -1))
    X = tf.transpose(X, perm=(0, 2, 1, 3))
    return tf.reshape(X, shape=(-1, X.shape[2], X.shape[3]))


def transpose_output(X, num_heads):
    X = tf.reshape(X, shape=(-1, num_heads, X.shape[1], X.shape[2]))
    X = tf.transpose(X, perm=(0, 2, 1, 3))
    return tf.reshape(X, shape=(X.shape[0], X.shape[1], -1))


class MultiHeadAttention(keras.layers.Layer):
    def __init__(
        self, key_size, query_size, value_size, num_hiddens, num_heads, dropout, bias=False, **kwargs
    ):
        super().__init__(**kwargs)
        self.num_heads = num_heads
        self.attention = DotProductAttention(dropout)
        self.W_q = keras.layers.Dense(num_hiddens, use_bias=bias)
        self.W_k = keras.layers.Dense(num_hiddens, use_bias=bias)
        self.W_v = keras.layers.Dense(num_hiddens, use_bias=bias)
        self.W_o = keras.layers.Dense(num_hiddens, use_bias=bias)

    def call(self, queries, keys, values, valid_lens, **kwargs):
        queries = transpose_qkv(self.W_q(queries), self.num_heads)
        keys = transpose_qkv(self.W_k(keys), self.num_heads)
        values = transpose_qkv(self.W_v(values), self.num_heads)
        if valid_lens is not None:
            valid_lens = tf.repeat(valid_lens, repeats=self.num_heads, axis=0)
        output = self.attention(queries, keys, values, valid_lens, **kwargs)
        output_concat = transpose_output(output, self.num_heads)
        return self.W_o(output_concat)


# ---- the same weights and masks in multihead's Keras layer ---------------------------------------------------


def ours_with_d2l_weights(d2l, queries, keys):
    """W_q/W_k/W_v kernels (E, H*D) -> (E, H, D); W_o (H*D, O) -> (H, D, O): d2l splits heads head-major."""
    h = d2l.num_heads
    ours = KerasMHA(
        num_heads=h, key_dim=num_hiddens // h, use_bias=False, dropout=0.5, output_shape=num_hiddens
    )
    ours.build(queries.shape, keys.shape)
    kernels = [dense.get_weights()[0] for dense in (d2l.W_q, d2l.W_k, d2l.W_v)]
    out_kernel = d2l.W_o.get_weights()[0]
    ours.set_weights(
        [k.reshape(k.shape[0], h, -1) for k in kernels] + [out_kernel.reshape(h, -1, out_kernel.shape[1])]
    )
    return ours


def keras_mask(valid_lens, num_keys):
    """d2l's valid_lens as a Keras mask, True = may attend: (B,) -> value_mask (B, S); (B, T) -> (B, T, S)."""
    lens = np.asarray(valid_lens)
    return np.arange(num_keys) < lens[..., None]


def compare(d2l, ours, queries, keys, valid_lens):
    """Max |diff| of the outputs, and of d2l's (B*H, T, S) weights against our (B, H, T, S) scores."""
    theirs = d2l(queries, keys, keys, tf.constant(valid_lens), training=False)
    mask = keras_mask(valid_lens, keys.shape[1])
    kw = {"value_mask": mask} if mask.ndim == 2 else {"attention_mask": mask}
    out, scores = ours(queries, keys, return_attention_scores=True, training=False, **kw)
    weights = tf.reshape(scores, (-1, *scores.shape[2:]))  # (B*H, T, S), d2l's layout
    return (
        float(tf.reduce_max(tf.abs(out - theirs))),
        float(tf.reduce_max(tf.abs(weights - d2l.attention.attention_weights))),
        np.asarray(theirs),
        np.asarray(out),
    )


def main(argv=None):
    keras.utils.set_random_seed(0)
    attention = MultiHeadAttention(num_hiddens, num_hiddens, num_hiddens, num_hiddens, num_heads, 0.5)
    valid_lens = tf.constant([3, 2])
    X = tf.ones((batch_size, num_queries, num_hiddens))
    Y = tf.ones((batch_size, num_kvpairs, num_hiddens))
    print(
        repr(attention(X, Y, Y, valid_lens, training=False).shape)
    )  # the notebook's cell: TensorShape([2, 4, 100])

    ours = ours_with_d2l_weights(attention, X, Y)
    rng = np.random.default_rng(0)
    Xr = rng.standard_normal((batch_size, num_queries, num_hiddens)).astype("float32")
    Yr = rng.standard_normal((batch_size, num_kvpairs, num_hiddens)).astype("float32")
    diffs = {}
    for name, lens in (("(B,)", [3, 2]), ("(B, Lq)", [[1, 2, 3, 4], [6, 5, 4, 3]])):
        out_diff, weight_diff, _, _ = compare(attention, ours, Xr, Yr, lens)
        diffs[name] = (out_diff, weight_diff)
        print(
            f"valid_lens {name}: outputs max |diff| = {out_diff:.1e}, weights max |diff| = {weight_diff:.1e}"
        )

    _, _, theirs, out = compare(attention, ours, Xr, Yr, [3, 0])
    d2l_row = attention.attention.attention_weights[num_heads, 0]  # batch 1, head 0, query 0
    print(
        f"valid_len 0: d2l weights {[round(float(w), 3) for w in d2l_row]} (every key, padding included), "
        f"output |max| {np.abs(theirs[1]).max():.3f}; multihead output |max| {np.abs(out[1]).max():.3f}"
    )
    return {
        "diffs": diffs,
        "d2l_zero_len": theirs[1],
        "ours_zero_len": out[1],
        "d2l_row": np.asarray(d2l_row),
    }


if __name__ == "__main__":
    main()
