"""Hugging Face ``transformers`` models on multihead attention, and the head tools on those models.

Dimensions: B batch, H query heads, Hkv key/value heads (H % Hkv == 0), Lq/Lk query/key lengths,
D head dim, E model width.

:func:`register` adds ``"multihead"`` to transformers' ``AttentionInterface`` (the attention function,
:func:`attention_forward`) and to its ``AttentionMaskInterface`` (the mask function,
:func:`mask_interface`: without one, transformers builds no mask at all for an unknown implementation,
and causal masking and padding are silently lost). Importing this module calls it, so after
``import multihead.integrations.transformers`` (``register()`` stays: idempotent, and ``register(name)``
adds another name)::

    model = AutoModelForCausalLM.from_config(config, attn_implementation="multihead")
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="multihead")
    model.set_attn_implementation("multihead")

A model runs exactly on multihead or is refused by name (:func:`check_model`): a model whose attention
modules do not call transformers' ``AttentionInterface`` (an eager-only family such as GIT) would hand
multihead's boolean mask to its own eager code, or bypass multihead. transformers offers no hook when an
implementation is chosen, so the refusal comes on the first forward (the mask and attention functions
check the model family of the config they are given, once per config class), and before that from
:func:`from_pretrained`, :func:`check_model` and the inspection tools.

Every call goes through :func:`multihead.nn.seam.attend`, so :func:`multihead.viz.capture`,
:func:`multihead.heads.masked`, :func:`multihead.heads.importance` and :func:`multihead.heads.prune`
work on those models by the same mechanism as on ours; the modules are named as in
``model.named_modules()``. Importing this module registers :data:`FAMILY` with :mod:`multihead.heads`.

transformers' private internals this module reads are each kept in one adapter function (section
"Private transformers internals"), each with a test that names the transformers version when it changes.

Differences from transformers' eager attention: a query row with no allowed key (e.g. a left-padding
position of a causal model) gets output 0 and weights 0 where eager attends uniformly; the outputs of
real tokens are equal.
"""

from __future__ import annotations

try:
    import transformers  # noqa: F401
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "multihead.integrations.transformers needs Hugging Face transformers: "
        "pip install 'multihead[transformers]'"
    ) from exc

from .attention import attention_forward
from .attention import segments_from_positions as segments_from_positions
from .family import ARCHITECTURES, FAMILY, Arch
from .family import LAYOUT_KEY as LAYOUT_KEY
from .family import TransformersFamily as TransformersFamily
from .internals import _model_class_for as _model_class_for
from .internals import _recording_attentions as _recording_attentions
from .internals import _routes_through_interface as _routes_through_interface
from .loading import from_pretrained
from .mask import mask_interface
from .models import check_model, unsupported
from .registry import is_registered, register

register()  # "multihead" is an attn_implementation from the moment this module is imported

__all__ = [
    "ARCHITECTURES",
    "FAMILY",
    "Arch",
    "attention_forward",
    "check_model",
    "from_pretrained",
    "is_registered",
    "mask_interface",
    "register",
    "unsupported",
]
