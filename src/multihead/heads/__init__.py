"""Head importance and head pruning for every :class:`~multihead.MultiHeadAttention` in a model.

Dimensions: B batch, H query heads, Hkv key/value heads, G = H // Hkv query heads per key/value head,
Lq/Lk query/key lengths, Dk query/key head dim, Dv value head dim, E embed_dim, O out_dim.

Heads are named by the attention module's qualified name in ``model.named_modules()`` (``""`` for a
bare module) and the head index *within that module as it is now*: ``{"decoder.layers.0.cross_attn":
[1, 3]}``. Three tools, all built on the gate hook of :mod:`multihead.nn.seam` (nothing is stored on
the modules):

* :func:`masked` zeroes chosen heads' outputs for the duration of a ``with`` block (the *gated model*);
* :func:`importance` scores each head by Michel et al. (2019), *Are Sixteen Heads Really Better than
  One?*: a gate ``xi_h`` (= 1) multiplies head h's output, and ``I_h = E_x |dL(x)/dxi_h|``;
  :func:`masking_drop` is the slower, direct alternative: the metric lost when one head is masked;
* :func:`prune` physically removes heads (their rows of the Q/K/V projections, their columns of
  ``out_proj``), so the smaller model computes exactly what the gated model does;
  :func:`prune_iteratively` repeats score -> prune -> evaluate within an accuracy budget.

A pruned model's ``state_dict`` has smaller tensors than a freshly built model: reload it with
:func:`load_pruned`, which resizes the fresh model's attention modules to the checkpoint's shapes.

Attention modules of other libraries join through a :class:`HeadFamily` (:func:`register_family`):
importing :mod:`multihead.integrations.transformers` registers Hugging Face attention modules, so every
tool here works on a transformers model running ``attn_implementation="multihead"``.
"""

from .importance import importance, masked, masking_drop, rank
from .naming import HeadFamily, HeadSpec, attention_kind, attention_modules, head_counts, register_family
from .prune import PruneResult, PruneStep, load_pruned, prune, prune_iteratively

__all__ = [
    "HeadFamily",
    "HeadSpec",
    "PruneResult",
    "PruneStep",
    "attention_kind",
    "attention_modules",
    "head_counts",
    "importance",
    "load_pruned",
    "masked",
    "masking_drop",
    "prune",
    "prune_iteratively",
    "rank",
    "register_family",
]
