"""Which Hugging Face models run on multihead attention, and the refusal of those that cannot."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from torch import nn
from transformers import PreTrainedModel

from .internals import _routes_through_interface

_BUILTIN = ("eager", "sdpa", "flex_attention", "flash_attention_2", "flash_attention_3", "flash_attention_4")
_INTERFACE_FLAGS = (
    "_supports_sdpa",
    "_supports_flex_attn",
    "_supports_flash_attn",
    "_supports_attention_backend",
)
"""transformers' documented class flags: the model runs an implementation other than its own eager code."""

# ------------------------------------------------------------------------------------------------
# Which models run on multihead
# ------------------------------------------------------------------------------------------------


def unsupported(model_class: type) -> str | None:
    """Why ``model_class`` (a ``PreTrainedModel`` subclass) cannot run on multihead, or None if it can.

    A model runs on multihead when its attention goes through transformers' ``AttentionInterface``:
    it declares an implementation besides eager (``_supports_sdpa``, ``_supports_flex_attn``,
    ``_supports_flash_attn`` or ``_supports_attention_backend``) and transformers itself lets its
    implementation be switched (its attention modules call the interface).
    """
    if not any(getattr(model_class, flag, False) for flag in _INTERFACE_FLAGS):
        return "it runs only transformers' eager attention, written inside its own modules"
    if not _routes_through_interface(model_class):
        return "its attention modules compute attention themselves instead of calling AttentionInterface"
    return None


def _refusal(who: str, reason: str) -> str:
    """The refusal message for the model(s) ``who`` (class names), for the ``reason`` of :func:`unsupported`."""
    return (
        f"{who} cannot run on multihead attention: {reason}, so "
        f"attn_implementation='multihead' would hand multihead's boolean mask to that code or bypass "
        f"multihead (a silently wrong or uninspectable model). Load it with attn_implementation='eager' "
        f"(or 'sdpa' where it supports it)"
    )


def check_model(model: nn.Module) -> None:
    """Raise ``ValueError`` naming the class if some part of ``model`` cannot run on multihead attention.

    Checks ``model`` and every ``PreTrainedModel`` inside it (vision towers, encoders) with
    :func:`unsupported`.
    """
    for part in model.modules():
        if isinstance(part, PreTrainedModel):
            reason = unsupported(type(part))
            if reason is not None:
                where = "" if part is model else f" (its part {type(part).__name__})"
                raise ValueError(_refusal(f"{type(model).__name__}{where}", reason))


_CONFIG_VERDICTS: dict[type, str | None] = {}  # config class -> refusal message or None (written once each)


def _check_config(config: Any) -> None:
    """Refuse, on the first forward, a model family that cannot run on multihead (cached per config class).

    The mask and attention functions get the model's config but not the model: the family is every
    model class built from the config's class (``config_class``) that Python has loaded.
    """
    key = type(config)
    if key not in _CONFIG_VERDICTS:
        _CONFIG_VERDICTS[key] = _config_refusal(key)
    message = _CONFIG_VERDICTS[key]
    if message is not None:
        raise ValueError(message)


def _subclasses(cls: type) -> Iterator[type]:
    for sub in cls.__subclasses__():
        yield sub
        yield from _subclasses(sub)


def _config_refusal(config_class: type) -> str | None:
    family = {c for c in _subclasses(PreTrainedModel) if getattr(c, "config_class", None) is config_class}
    refused = {c.__name__: unsupported(c) for c in family if not c.__name__.endswith("PreTrainedModel")}
    refused = {name: reason for name, reason in refused.items() if reason is not None}
    if not refused:
        return None
    names = sorted(refused)
    return _refusal(f"{' / '.join(names)} (the models of {config_class.__name__})", refused[names[0]])


_SDPA_FAMILIES: dict[type, bool] = {}  # config class -> whether a model of it declares sdpa support


def _trusts_is_causal(config: Any) -> bool:
    """Whether a causal mask may be skipped (None) and read back from each module's ``is_causal``.

    That is sdpa's contract in transformers (``sdpa_mask`` skips a plain causal mask, the attention reads
    ``module.is_causal``), run for every family that declares sdpa support. Of those that do not, the
    decoder-only ones (Gemma 2, gpt-oss: soft-capping and sinks) keep causal modules; an encoder-decoder
    shares one attention class between encoder, decoder and cross-attention, and PEGASUS-X's decoder
    self-attention says ``is_causal=False``: there the causal mask is built. Cached per config class.
    """
    key = type(config)
    if key not in _SDPA_FAMILIES:
        family = [c for c in _subclasses(PreTrainedModel) if getattr(c, "config_class", None) is key]
        _SDPA_FAMILIES[key] = any(getattr(c, "_supports_sdpa", False) for c in family)
    return _SDPA_FAMILIES[key] or not getattr(config, "is_encoder_decoder", False)
