"""Drop-in layers for users of other APIs, each a thin adapter over :func:`multihead.attention`.

* :mod:`multihead.compat.torch` -- ``MultiheadAttention``, a drop-in for ``torch.nn.MultiheadAttention``;
* :mod:`multihead.compat.keras` -- ``MultiHeadAttention``, a Keras 3 layer (needs ``multihead[keras]``);
* :mod:`multihead.compat.d2l` -- ``MultiHeadAttention`` with the d2l book's signature and ``valid_lens``.

Import the submodule you need; this package imports none of them (so ``import multihead`` never
imports Keras), and neither it nor :mod:`multihead.compat.keras` imports PyTorch: a Keras user on the
TensorFlow or JAX backend needs no torch installed.
"""

__all__: list[str] = []
