"""PyTorch's attention API over multihead.

* :class:`MultiheadAttention` -- a drop-in for ``torch.nn.MultiheadAttention``: same arguments, returns,
  masks and ``state_dict``, also inside torch's ``nn.Transformer*`` layers (:mod:`.attention`; torch's
  conventions and errors at its boundary: :mod:`.boundary`);
* :func:`convert` / :func:`revert` -- every ``nn.MultiheadAttention`` of a model you already have
  (a torchvision ViT, an open_clip model, an ``nn.Transformer``) swapped for the drop-in and back, exact
  weights and the same ``state_dict`` keys (:mod:`.convert`).
"""

from .attention import MultiheadAttention, torch_attention
from .boundary import (
    FastPathShapeError,
    InputDtypeError,
    IsCausalError,
    MaskDtypeError,
    MultiheadAttentionError,
    MultiheadAttentionRuntimeError,
    NotATensorError,
)
from .convert import convert, revert

__all__ = [
    "FastPathShapeError",
    "InputDtypeError",
    "IsCausalError",
    "MaskDtypeError",
    "MultiheadAttention",
    "MultiheadAttentionError",
    "MultiheadAttentionRuntimeError",
    "NotATensorError",
    "convert",
    "revert",
    "torch_attention",
]
