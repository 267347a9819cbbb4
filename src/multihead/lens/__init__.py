"""Every head's internals, in any model whose attention goes through the seam: cache (with gradients), hooks,
ablation, patching, logit attribution, and circuits: attribution patching, edge attribution of the residual
stream and faithfulness (guides: docs/lens.md, docs/circuits.md).

Dimensions: B batch, H query heads, Hkv key/value heads, Lq/Lk lengths, Dk/Dv head dims, O the output
projection's width (E for a self-attention block), N modules.

Modules are named as in ``model.named_modules()`` (:func:`multihead.heads.attention_modules`): our
:class:`~multihead.MultiHeadAttention` (and every Transformer layer), converted torch models
(:func:`multihead.compat.torch.convert`), the d2l drop-in (its ``attention``), and Hugging Face models on
``attn_implementation="multihead"``. The points of one attention call:

* ``"q"`` (B, H, Lq, Dk), ``"k"`` (B, Hkv, Lk, Dk), ``"v"`` (B, Hkv, Lk, Dv): as the attention computes with them
  (after the projections, rotary and the KV cache);
* ``"scores"`` (B, H, Lq, Lk): the logits before softmax, after scale, softcap and bias, ``-inf`` where masked;
* ``"pattern"`` (B, H, Lq, Lk): the softmax weights;
* ``"z"`` (B, H, Lq, Dv): each head's output before the output projection;
* ``"result"`` (B, H, Lq, O): head h's z through its columns of the output projection, without bias; the sum over
  heads plus the bias is the projection's output. Only where the module's head family knows the projection.

Reading or editing a point of a module changes that module's path only as far as needed: q, k, v, z and result
keep its backend; a cached pattern comes from the weights its attention function returns; scores, and an edited
pattern, take the explicit path (said once per module class). With no lens open nothing runs.
"""

from .attribution import Attribution, frozen_norm, logit_attribution
from .attribution_patch import attribution_patch
from .cache import Cache, cache
from .edges import edge_attribution
from .edit import ABLATIONS, Ablation, MeanAblation, ResampleAblation, ZeroAblation, ablate, hooks
from .faithful import CorruptedEdges, EdgeAblation, MeanEdges, faithfulness
from .graph import Graph, Node
from .patch import TOKENS_PER_FORWARD, patch_heads
from .sites import POINTS, Context, Handler, head_results, select

__all__ = [
    "ABLATIONS",
    "POINTS",
    "TOKENS_PER_FORWARD",
    "Ablation",
    "Attribution",
    "Cache",
    "Context",
    "CorruptedEdges",
    "EdgeAblation",
    "Graph",
    "Handler",
    "MeanAblation",
    "MeanEdges",
    "Node",
    "ResampleAblation",
    "ZeroAblation",
    "ablate",
    "attribution_patch",
    "cache",
    "edge_attribution",
    "faithfulness",
    "frozen_norm",
    "head_results",
    "hooks",
    "logit_attribution",
    "patch_heads",
    "select",
]
