"""Seed 004 (d2l's multi-head attention in TensorFlow), rebuilt on multihead: the same 2 x 4 x 100
example with 6 key-value pairs, 5 heads, dropout 0.5 and integer valid_lens [3, 2], called with
training=False. Also shows the per-head weights d2l's heatmaps read (kept only on request).

Run: python examples/seeds/seed004_d2l_tf.py
"""

import torch

from multihead.compat.d2l import MultiHeadAttention

num_hiddens, num_heads = 100, 5
batch_size, num_queries, num_kvpairs, valid_lens = 2, 4, 6, torch.tensor([3, 2])


def main(argv=None):
    torch.manual_seed(0)
    attention = MultiHeadAttention(
        num_hiddens, num_hiddens, num_hiddens, num_hiddens, num_heads, 0.5, keep_weights=True
    )
    X = torch.ones((batch_size, num_queries, num_hiddens))
    Y = torch.ones((batch_size, num_kvpairs, num_hiddens))
    out = attention.eval()(X, Y, Y, valid_lens)  # training=False
    print(out.shape)
    weights = attention.attention.attention_weights  # (batch * heads, queries, kv pairs), as in d2l
    print(
        "attention_weights:",
        tuple(weights.shape),
        "row sums:",
        [round(s, 4) for s in weights.sum(-1)[0].tolist()],
    )
    return out


if __name__ == "__main__":
    main()
