"""Seed 002 on TensorFlow through Keras: the notebook's fused-QKV layer as written, next to multihead's layer.

Batch 30 x 4 x 512, 8 heads; the notebook's layer prints the same eight shape lines as in the notebook.
Its weights are loaded into ``multihead.compat.keras.MultiHeadAttention``: the fused ``Dense(3 * 512)``
kernel (512, 1536) is (512, 8 heads, [q | k | v] of 64) per head, so it splits into Keras's three
(512, 8, 64) kernels. Then:

* the projections, scores and per-head values agree to 1e-5 (the notebook is right up to there);
* its merge ``tf.reshape(values, (B, L, H * D))`` skips the (H, L) transpose, so the final output differs
  from ours; with the transpose put back (``merged_correctly``) it equals ours to 1e-5;
* its mask convention is 1 = hide (``scores += mask * -1e9``) and its comment says to pass a lower
  triangular matrix for a decoder: that hides the past (anti-causal); ``1 - tril`` equals our
  ``use_causal_mask=True`` scores.

Run: python examples/seeds/seed002_keras_tf.py   (KERAS_BACKEND=tensorflow; set here when unset)
"""

import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from multihead.compat.keras import MultiHeadAttention  # noqa: E402

input_dim, d_model, num_heads, batch_size, sequence_length = 512, 512, 8, 30, 4


# ---- the notebook's code, as written ------------------------------------------------------------------------


class MultiheadAttention(keras.layers.Layer):
    def __init__(self, input_dim, d_model, num_heads):
        super().__init__()
        self.input_dim = input_dim
        self.d_model = d_model
        self.num_heads = num_heads
        self.head_dim = d_model // num_heads
        self.qkv_layer = keras.layers.Dense(3 * d_model)
        self.linear_layer = keras.layers.Dense(d_model)

    def call(self, x, mask=None):
        batch_size, sequence_length, input_dim = tf.shape(x)
        print(f"x.shape: {x.shape}")
        qkv = self.qkv_layer(x)
        print(f"qkv.shape: {qkv.shape}")
        qkv = tf.reshape(qkv, (batch_size, sequence_length, self.num_heads, 3 * self.head_dim))
        print(f"qkv.shape: {qkv.shape}")
        qkv = tf.transpose(qkv, perm=[0, 2, 1, 3])
        print(f"qkv.shape: {qkv.shape}")
        q, k, v = tf.split(qkv, 3, axis=-1)
        print(f"q.shape: {q.shape}, k.shape: {k.shape}, v.shape: {v.shape}")
        values, attention = self.scaled_dot_product(q, k, v, mask)
        print(f"values.shape: {values.shape}, attention.shape: {attention.shape}")
        values = tf.reshape(values, (batch_size, sequence_length, self.num_heads * self.head_dim))  # the bug
        print(f"values.shape: {values.shape}")
        out = self.linear_layer(values)
        print(f"out.shape: {out.shape}")
        return out

    def scaled_dot_product(self, q, k, v, mask):
        d_k = tf.cast(tf.shape(k)[-1], tf.float32)
        scores = tf.matmul(q, k, transpose_b=True) / tf.math.sqrt(d_k)
        if mask is not None:
            scores += mask * -1e9
        attention = tf.nn.softmax(scores, axis=-1)
        values = tf.matmul(attention, v)
        return values, attention


# ---- the same weights in multihead's Keras layer ------------------------------------------------------------


def ours_with_notebook_weights(nb, x):
    """The fused kernel (E, 3 * H * D) read per head as (E, H, 3 * D), split into q, k, v: (E, H, D) each."""
    heads, d = nb.num_heads, nb.head_dim
    ours = MultiHeadAttention(num_heads=heads, key_dim=d)
    ours.build(x.shape, x.shape)
    kernel, bias = nb.qkv_layer.get_weights()  # (E, 3*H*D), (3*H*D,)
    kernels = np.split(kernel.reshape(kernel.shape[0], heads, 3 * d), 3, axis=-1)  # 3 x (E, H, D)
    biases = np.split(bias.reshape(heads, 3 * d), 3, axis=-1)  # 3 x (H, D)
    out_kernel, out_bias = nb.linear_layer.get_weights()  # (H*D, O), (O,)
    ours.set_weights(
        [w for pair in zip(kernels, biases) for w in pair] + [out_kernel.reshape(heads, d, -1), out_bias]
    )
    return ours


def heads_of(nb, x, mask=None):
    """The notebook's own steps up to the per-head values: q (B, H, L, D), values (B, H, L, D), weights."""
    qkv = tf.reshape(nb.qkv_layer(x), (x.shape[0], x.shape[1], nb.num_heads, 3 * nb.head_dim))
    q, k, v = tf.split(tf.transpose(qkv, perm=[0, 2, 1, 3]), 3, axis=-1)  # (B, H, L, D) each
    values, weights = nb.scaled_dot_product(q, k, v, mask)
    return values, weights


def merged_correctly(nb, values):
    """The notebook's merge with the transpose put back: (B, H, L, D) -> (B, L, H, D) -> (B, L, H*D)."""
    b, _, length, _ = values.shape
    merged = tf.reshape(tf.transpose(values, perm=[0, 2, 1, 3]), (b, length, nb.num_heads * nb.head_dim))
    return nb.linear_layer(merged)


def main(argv=None):
    keras.utils.set_random_seed(0)  # the notebook's draws were unseeded
    x = tf.random.normal((batch_size, sequence_length, input_dim))
    model = MultiheadAttention(input_dim, d_model, num_heads)
    out = model(x)  # prints the notebook's eight shape lines

    ours = ours_with_notebook_weights(model, x)
    ours_out, ours_scores = ours(x, x, return_attention_scores=True)
    values, weights = heads_of(model, x)
    scores_diff = float(tf.reduce_max(tf.abs(weights - ours_scores)))
    fixed_diff = float(tf.reduce_max(tf.abs(merged_correctly(model, values) - ours_out)))
    bug_diff = float(tf.reduce_max(tf.abs(out - ours_out)))
    print(f"scores, notebook vs multihead: max |diff| = {scores_diff:.1e}")
    print(f"output, notebook's merge (no transpose) vs multihead: max |diff| = {bug_diff:.3f}")
    print(f"output, merge with the transpose vs multihead: max |diff| = {fixed_diff:.1e}")

    tril = np.tril(np.ones((sequence_length, sequence_length), "float32"))
    _, as_commented = heads_of(model, x, mask=tril)  # the notebook's advice: hides keys j <= i
    _, inverted = heads_of(model, x, mask=1.0 - tril)  # 1 = hide, so hide the future
    _, causal_scores = ours(x, x, use_causal_mask=True, return_attention_scores=True)
    causal_diff = float(tf.reduce_max(tf.abs(inverted - causal_scores)))
    first_row = [round(float(w), 3) for w in np.asarray(as_commented)[0, 0, 0]]
    print(f"mask=tril as the notebook advises: query 0 attends to {first_row} (the future only)")
    print(f"mask=1-tril vs multihead use_causal_mask: max |diff| = {causal_diff:.1e}")
    return {
        "out": np.asarray(out),
        "scores_diff": scores_diff,
        "bug_diff": bug_diff,
        "fixed_diff": fixed_diff,
        "as_commented": np.asarray(as_commented),
        "causal_diff": causal_diff,
    }


if __name__ == "__main__":
    main()
