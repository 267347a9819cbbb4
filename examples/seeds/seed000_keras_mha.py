"""Seed 000 (Keras MHA from scratch), rebuilt on multihead: batch 64 x 5 x 512, 8 heads, rng seed 42.

The notebook's layer holds one Dense per Q/K/V/O and splits each projection into heads by reshape: the
"shared" layout, which maps one to one onto multihead.MultiHeadAttention (multihead.compat.weights.from_shared).
Its bugs, fixed here: it read the global ``h`` instead of ``n_heads``; it projected Q/K/V to d_k = 64
instead of d_model = 512 (so each of 8 heads got 8 features); ``scores += -inf * mask`` turns every
unmasked score into NaN (-inf * 0). Here a mask is a bool tensor, True = may attend.

Run: python examples/seeds/seed000_keras_mha.py [--keras]   (--keras: the Keras 3 drop-in layer instead)
"""

import argparse

import numpy as np
import torch

from multihead.compat import weights

input_seq_length, h, d_model, batch_size, random_seed = 5, 8, 512, 64, 42


def dense(rng, n_in, n_out):
    """A Keras Dense layer's kernel (n_in, n_out) and bias, as torch (out, in) weight and bias."""
    limit = np.sqrt(6 / (n_in + n_out))  # glorot_uniform, Keras's default
    kernel = rng.uniform(-limit, limit, (n_in, n_out))
    return torch.tensor(kernel.T, dtype=torch.float32), torch.zeros(n_out)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--keras", action="store_true")
    args = p.parse_args(argv)
    rng = np.random.default_rng(random_seed)
    queries = rng.random((batch_size, input_seq_length, d_model))
    keys = rng.random((batch_size, input_seq_length, d_model))
    values = rng.random((batch_size, input_seq_length, d_model))
    if args.keras:
        import os

        os.environ.setdefault("KERAS_BACKEND", "torch")
        from multihead.compat.keras import MultiHeadAttention

        layer = MultiHeadAttention(num_heads=h, key_dim=d_model // h)
        output = layer(queries.astype("float32"), values.astype("float32"), keys.astype("float32"))
        print(output.shape)
        return output
    (wq, bq), (wk, bk), (wv, bv), (wo, bo) = (dense(rng, d_model, d_model) for _ in range(4))
    state = weights.from_shared(weights.SharedWeights(wq, wk, wv, wo, bq, bk, bv, bo))
    multihead_attention = weights.module_from_state(state, num_heads=h)  # heads = the argument, not a global
    q, k, v = (torch.tensor(x, dtype=torch.float32) for x in (queries, keys, values))
    with torch.no_grad():
        output = multihead_attention(q, k, v)
        torch.set_printoptions(precision=8, edgeitems=2, threshold=50)
        print(output)
        torch.set_printoptions(profile="default")
        print(output.shape)
        # The notebook's `mask` (1 = hide) becomes a bool mask (True = may attend): no NaN anywhere.
        mask = torch.ones(input_seq_length, input_seq_length, dtype=torch.bool).tril()
        masked = multihead_attention(q, k, v, mask=mask)
        print("causal mask -> finite:", bool(torch.isfinite(masked).all()), tuple(masked.shape))
    return output


if __name__ == "__main__":
    main()
