"""Seed 003 (d2l's multi-head attention in Java/DJL), rebuilt on multihead: 2 x 4 queries, 6 key-value
pairs, 100 hiddens, 5 heads, dropout 0.5, no bias, valid_lens [3, 2] (float, as DJL passes them).

For the Java users: ``--onnx PATH`` also exports the layer to ONNX (dynamic batch and lengths) for
DJL's OnnxRuntime engine; see docs/compat.md for the Java side.

Run: python examples/seeds/seed003_d2l_djl.py [--onnx mha.onnx]
"""

import argparse

import torch

from multihead.compat.d2l import MultiHeadAttention

num_hiddens, num_heads, batch_size, num_queries, num_kvpairs = 100, 5, 2, 4, 6


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--onnx", help="also export the layer to this ONNX file")
    args = p.parse_args(argv)
    torch.manual_seed(0)
    attention = MultiHeadAttention(num_hiddens, num_hiddens, num_hiddens, num_hiddens, num_heads, 0.5, False)
    attention.eval()  # DJL: ParameterStore(manager, false) -> inference, no dropout
    valid_lens = torch.tensor([3.0, 2.0])
    X = torch.ones((batch_size, num_queries, num_hiddens))
    Y = torch.ones((batch_size, num_kvpairs, num_hiddens))
    with torch.no_grad():
        result = attention(X, Y, Y, valid_lens)
    print(tuple(result.shape))
    if args.onnx:
        from multihead.export import to_onnx

        report = to_onnx(attention, (X, Y, Y), args.onnx, example_kwargs={"valid_lens": valid_lens})
        print(f"wrote {report.path}: inputs {report.inputs}, onnxruntime max |diff| {report.max_error:.1e}")
    return result


if __name__ == "__main__":
    main()
