"""Reloading a model pruned by :func:`multihead.heads.prune` (its head counts are in its config)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import transformers
from torch import nn

from .family import FAMILY, LAYOUT_KEY
from .internals import _model_class_for
from .models import _refusal, unsupported
from .registry import is_registered

# ------------------------------------------------------------------------------------------------
# Reloading a pruned model
# ------------------------------------------------------------------------------------------------


def _locate(name: str, modules: Mapping[str, nn.Module], prefix: str) -> str | None:
    """``name`` (a module name in the saved model) in the model being loaded, across the base-model prefix.

    A bare ``BertModel``'s ``encoder.layer.0.attention.self`` is ``bert.encoder.layer.0.attention.self``
    in ``BertForSequenceClassification``, and the other way round.
    """
    if name in modules:
        return name
    if prefix and f"{prefix}.{name}" in modules:
        return f"{prefix}.{name}"
    if prefix and name.startswith(f"{prefix}.") and name[len(prefix) + 1 :] in modules:
        return name[len(prefix) + 1 :]
    return None


def _resize_to(model: nn.Module, layout: Mapping[str, list[int]]) -> dict[str, list[int]]:
    """Resize each module of ``layout`` in ``model`` (shapes only); returns the layout by ``model``'s names."""
    modules = dict(model.named_modules())
    prefix = getattr(model, "base_model_prefix", "") or ""
    found: dict[str, list[int]] = {}
    for name, (h, hkv) in layout.items():
        where = _locate(name, modules, prefix)
        if where is not None:
            FAMILY._resize(model, where, modules[where], [0] * h, [0] * hkv)  # loading overwrites the rows
            found[where] = [h, hkv]
    return found


def _pruned_class(base: type, layout: Mapping[str, list[int]]) -> type:
    """A subclass of ``base`` for one load: built at full size, then resized to ``layout`` (post_init).

    Nothing shared is changed (no class-wide patch), so loads in several threads do not interfere; the
    loaded model gets ``base`` back as its class.
    """

    def post_init(self: nn.Module) -> None:
        base.post_init(self)
        _resize_to(self, layout)

    return type(
        base.__name__,
        (base,),
        {"post_init": post_init, "__module__": base.__module__, "__qualname__": base.__qualname__},
    )


def from_pretrained(model_class: Any, path: str | Path, **kwargs: Any) -> nn.Module:
    """Load a ``save_pretrained`` folder, pruned by :func:`multihead.heads.prune` or not.

    Args:
        model_class: an Auto class (``AutoModelForCausalLM``, ``AutoModel``) or a model class
            (``LlamaForCausalLM``); a task class may load a bare model's folder and the other way round
            (``BertForSequenceClassification`` from a pruned ``BertModel``), as in transformers.
        path: the folder written by ``model.save_pretrained(path)`` (or a hub id of such a folder).
        kwargs: passed on to ``from_pretrained`` (``attn_implementation="multihead"``, ``dtype``, ``config``).

    A pruned model records its per-module head counts ``[H, Hkv]`` in its config (``multihead_heads``);
    each such module is resized as the model is built, and transformers then loads the saved tensors as
    usual. An unpruned folder loads exactly as ``model_class.from_pretrained(path, **kwargs)``. Safe to
    call from several threads at once. A model that cannot run on multihead attention is refused
    (:func:`check_model`) when ``attn_implementation`` names multihead.
    """
    config = kwargs.get("config") or transformers.AutoConfig.from_pretrained(path)
    layout = dict(getattr(config, LAYOUT_KEY, None) or {})
    base = _model_class_for(model_class, config)
    if is_registered(kwargs.get("attn_implementation")):
        reason = unsupported(base)
        if reason is not None:
            raise ValueError(_refusal(base.__name__, reason))
    if not layout:
        return model_class.from_pretrained(path, **kwargs)
    model = _pruned_class(base, layout).from_pretrained(path, **kwargs)
    model.__class__ = base
    modules = dict(model.named_modules())
    prefix = getattr(model, "base_model_prefix", "") or ""
    placed = {name: _locate(name, modules, prefix) for name in layout}
    wrong = sorted(
        name
        for name, where in placed.items()
        if where is None or list(FAMILY.heads(modules[where])) != list(layout[name])
    )
    if wrong:
        raise ValueError(
            f"the checkpoint's config lists pruned modules {wrong} that {base.__name__} does not have (or "
            f"did not resize); load it with the model class it was saved from, or its Auto class"
        )
    setattr(model.config, LAYOUT_KEY, {placed[name]: list(hk) for name, hk in layout.items()})
    return model
