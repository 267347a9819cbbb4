"""Seed 000 on TensorFlow through Keras: the notebook's layer as written, next to multihead's Keras layer.

Batch 64 x 5 x 512, 8 heads, inputs from ``np.random.default_rng(42)`` as in the notebook. The notebook's
weights are unseeded glorot draws, so its printed numbers cannot be re-drawn; instead its layer is built
here (seeded) and its weights are loaded into ``multihead.compat.keras.MultiHeadAttention``:

* where the notebook is right (attention without a mask), our layer reproduces its output to 1e-5;
* ``d_k = d_model // h`` reads the *global* ``h``: ``MultiHeadAttention(4, 512)`` still gets 64-wide
  projections split into 4 heads of 16 (intended: 4 heads of 128);
* ``Dense(d_k)`` projects Q/K/V to 64 features in all, so each of the 8 heads gets 8 (intended: 64 each,
  ``key_dim=64``): its output equals *our* layer configured with ``key_dim=8``, not the intended one;
* ``scores += -inf * mask`` gives ``-inf * 0 = NaN`` on every kept score: the masked output is all NaN,
  where ours (``use_causal_mask=True``, or a bool mask, True = may attend) is finite and equals the
  notebook's own math with the mask applied correctly.

Run: python examples/seeds/seed000_keras_tf.py   (KERAS_BACKEND=tensorflow; set here when unset)
"""

import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from keras.layers import Dense, Layer  # noqa: E402

from multihead.compat.keras import MultiHeadAttention as KerasMHA  # noqa: E402

input_seq_length, h, d_model, batch_size, random_seed = 5, 8, 512, 64, 42


# ---- the notebook's code, as written (In [2], In [3]) ------------------------------------------------------


class DotProductAttention(Layer):
    def call(self, queries, keys, values, mask=None):
        d_k = tf.shape(keys)[-1]
        scores = tf.matmul(queries, keys, transpose_b=True) / tf.math.sqrt(tf.cast(d_k, tf.float32))
        if mask is not None:
            scores += float("-inf") * mask  # the bug: -inf * 0 = NaN
        weights = tf.nn.softmax(scores)
        return tf.matmul(weights, values)


class MultiHeadAttention(Layer):
    def __init__(self, n_heads, d_model, **kwargs):
        super().__init__(**kwargs)
        assert d_model % h == 0
        d_k = d_model // h  # the bug: the global h, not n_heads
        d_v = d_k
        self.attention = DotProductAttention()
        self.n_heads = n_heads
        self.d_k = d_k
        self.d_v = d_v
        self.W_q = Dense(d_k)  # the bug: d_k wide, not d_model
        self.W_k = Dense(d_k)
        self.W_v = Dense(d_v)
        self.W_o = Dense(d_model)

    def reshape_tensor(self, x, n_heads, do_split_flag):
        if do_split_flag:
            x = tf.reshape(x, shape=(tf.shape(x)[0], tf.shape(x)[1], n_heads, -1))
            x = tf.transpose(x, perm=(0, 2, 1, 3))
        else:
            x = tf.transpose(x, perm=(0, 2, 1, 3))
            x = tf.reshape(x, shape=(tf.shape(x)[0], tf.shape(x)[1], -1))
        return x

    def call(self, queries, keys, values, mask=None):
        q_reshaped = self.reshape_tensor(self.W_q(queries), self.n_heads, True)
        k_reshaped = self.reshape_tensor(self.W_k(keys), self.n_heads, True)
        v_reshaped = self.reshape_tensor(self.W_v(values), self.n_heads, True)
        o_reshaped = self.attention(q_reshaped, k_reshaped, v_reshaped, mask)
        output = self.reshape_tensor(o_reshaped, self.n_heads, False)
        return self.W_o(output)


# ---- the notebook's weights in multihead's Keras layer -----------------------------------------------------


def ours_with_notebook_weights(nb, x):
    """multihead's layer holding the notebook layer's weights: ``n_heads`` heads of ``d_k / n_heads``.

    Keras's kernels are (E, H, D) for Q/K/V and (H, D, O) for the output; the notebook's Dense kernels
    (E, H*D) and (H*D, O) split their H*D axis head-major, exactly as its reshape does.
    """
    heads, width = nb.n_heads, nb.d_k // nb.n_heads
    ours = KerasMHA(num_heads=heads, key_dim=width, output_shape=nb.W_o.units)
    ours.build(x.shape, x.shape)
    weights = []
    for dense in (nb.W_q, nb.W_k, nb.W_v):
        kernel, bias = dense.get_weights()  # (E, H*D), (H*D,)
        weights += [kernel.reshape(-1, heads, width), bias.reshape(heads, width)]  # (E, H, D), (H, D)
    kernel, bias = nb.W_o.get_weights()  # (H*D, O), (O,)
    weights += [kernel.reshape(heads, width, -1), bias]  # (H, D, O)
    ours.set_weights(weights)
    return ours


def main(argv=None):
    keras.utils.set_random_seed(0)  # the notebook's glorot draws were unseeded
    rng = np.random.default_rng(random_seed)
    queries = rng.random((batch_size, input_seq_length, d_model)).astype("float32")
    keys = rng.random((batch_size, input_seq_length, d_model)).astype("float32")
    values = rng.random((batch_size, input_seq_length, d_model)).astype("float32")

    multihead_attention = MultiHeadAttention(h, d_model)
    output = multihead_attention(queries, keys, values)
    print(output)

    ours = ours_with_notebook_weights(multihead_attention, queries)
    same = ours(queries, values, keys)  # Keras's order: query, value, key
    diff = float(tf.reduce_max(tf.abs(same - output)))
    print(f"multihead with the notebook's weights (8 heads of {ours.key_dim}): max |diff| = {diff:.1e}")

    four = MultiHeadAttention(4, d_model)
    four(queries, keys, values)
    print(
        f"global h: MultiHeadAttention(4, 512) has heads of {four.d_k // four.n_heads} features "
        f"(intended {d_model // 4}); multihead: {KerasMHA(num_heads=4, key_dim=d_model // 4).key_dim}"
    )
    intended = KerasMHA(num_heads=h, key_dim=d_model // h)
    intended(queries, values, keys)
    print(
        f"Dense(d_k): {multihead_attention.W_q.get_weights()[0].shape} query kernel, {h} heads of "
        f"{multihead_attention.d_k // h}; intended {tuple(intended.query_dense.kernel.shape)}, {h} heads of "
        f"{intended.key_dim}"
    )

    hide = 1.0 - np.tril(np.ones((input_seq_length, input_seq_length), "float32"))  # notebook: 1 = hide
    masked = multihead_attention(queries, keys, values, mask=hide)
    nan_share = float(np.isnan(np.asarray(masked)).mean())
    causal = ours(queries, values, keys, use_causal_mask=True)
    q, k, v = (
        multihead_attention.reshape_tensor(d(x), h, True)
        for d, x in (
            (multihead_attention.W_q, queries),
            (multihead_attention.W_k, keys),
            (multihead_attention.W_v, values),
        )
    )
    scores = tf.matmul(q, k, transpose_b=True) / np.sqrt(float(multihead_attention.d_k // h))
    fixed = tf.matmul(tf.nn.softmax(tf.where(hide > 0, -np.inf, scores)), v)  # the mask, applied correctly
    fixed = multihead_attention.W_o(multihead_attention.reshape_tensor(fixed, h, False))
    mask_diff = float(tf.reduce_max(tf.abs(causal - fixed)))
    print(
        f"-inf * mask: NaN share {nan_share:.2f}; multihead use_causal_mask finite: "
        f"{bool(np.isfinite(np.asarray(causal)).all())}, max |diff| to the mask applied correctly = {mask_diff:.1e}"
    )
    return {
        "output": np.asarray(output),
        "diff": diff,
        "head_width_with_4_heads": four.d_k // four.n_heads,
        "nan_share": nan_share,
        "causal": np.asarray(causal),
        "mask_diff": mask_diff,
    }


if __name__ == "__main__":
    main()
