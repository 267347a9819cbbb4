"""What seed 002 (TensorFlow, fused QKV) prints, line for line: its examples on torch and on Keras must too."""

SEED002_SHAPE_LINES = [
    "x.shape: (30, 4, 512)",
    "qkv.shape: (30, 4, 1536)",
    "qkv.shape: (30, 4, 8, 192)",
    "qkv.shape: (30, 8, 4, 192)",
    "q.shape: (30, 8, 4, 64), k.shape: (30, 8, 4, 64), v.shape: (30, 8, 4, 64)",
    "values.shape: (30, 8, 4, 64), attention.shape: (30, 8, 4, 4)",
    "values.shape: (30, 4, 512)",
    "out.shape: (30, 4, 512)",
]
