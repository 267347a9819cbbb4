"""Private transformers internals: one adapter each (tests/test_hf_public.py names the version on change)."""

from __future__ import annotations

import inspect
import warnings
from typing import Any

import transformers
from transformers import PreTrainedModel

# ------------------------------------------------------------------------------------------------
# Private transformers internals: one adapter each (tests/test_hf_public.py names the version on change)
# ------------------------------------------------------------------------------------------------


def _routes_through_interface(model_class: type) -> bool:
    """transformers' own judgement whether ``model_class``'s attention calls ``AttentionInterface``.

    Private: ``PreTrainedModel._can_set_attn_implementation`` (what ``set_attn_implementation`` consults
    before switching a model).
    """
    check = getattr(model_class, "_can_set_attn_implementation", None)
    if check is None:
        raise RuntimeError(
            f"transformers {transformers.__version__} has no PreTrainedModel._can_set_attn_implementation, "
            f"which multihead reads to refuse models that bypass AttentionInterface; multihead needs an update"
        )
    return bool(check())


def _calls_attention_interface(module_class: type) -> bool:
    """Whether ``module_class.forward`` looks up transformers' attention functions: it names
    ``ALL_ATTENTION_FUNCTIONS`` (read from its code object's global names, decorators unwrapped).

    Private: the convention every attention module of transformers' modeling files follows
    (``ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, eager_attention_forward)``).
    It finds the attention modules that models record only through a wrapper (T5's ``T5Attention``
    inside the recorded ``T5LayerSelfAttention``), which ``_can_record_outputs`` does not name.
    """
    forward = getattr(module_class, "forward", None)
    code = getattr(inspect.unwrap(forward), "__code__", None) if forward is not None else None
    return code is not None and "ALL_ATTENTION_FUNCTIONS" in code.co_names


_COLLECTOR: list[Any] = []  # transformers' collector context variable, once found (None: it moved)


def _collector() -> Any:
    """``transformers.utils.output_capturing._active_collector``, looked up once; None if it is gone (a
    warning names the version)."""
    if not _COLLECTOR:
        try:
            from transformers.utils.output_capturing import _active_collector
        except ImportError:
            _active_collector = None
        _COLLECTOR.append(_active_collector)
        if _active_collector is None:
            warnings.warn(
                f"transformers {transformers.__version__} moved its output collector; multihead computes "
                f"attention weights on every call until it is updated",
                RuntimeWarning,
                stacklevel=4,
            )
    return _COLLECTOR[0]


def _recording_attentions() -> bool:
    """Whether transformers is recording attention weights right now (``output_attentions=True``).

    Most models record weights with hooks inside ``capture_outputs`` and never pass ``output_attentions``
    to the attention function; the request lives in that decorator's collector. Private:
    ``transformers.utils.output_capturing._active_collector``. If it is gone, weights are always computed
    (correct, slower) and a warning names the version.
    """
    collector = _collector()
    if collector is None:
        return True
    collected = collector.get()
    return bool(collected) and any(key.endswith("attentions") for key in collected)


def _model_class_for(model_class: Any, config: Any) -> type:
    """The concrete model class ``model_class.from_pretrained`` builds for ``config``.

    An Auto class picks it from its mapping (private: ``_BaseAutoModelClass._model_mapping``); a model
    class is itself.
    """
    if isinstance(model_class, type) and issubclass(model_class, PreTrainedModel):
        return model_class
    mapping = getattr(model_class, "_model_mapping", None)
    if mapping is None:
        raise TypeError(
            f"model_class must be a transformers Auto class or PreTrainedModel subclass, got {model_class!r}"
        )
    if type(config) not in mapping:
        raise ValueError(
            f"{getattr(model_class, '__name__', model_class)} has no model for {type(config).__name__}; "
            f"pick the Auto class (or model class) of the checkpoint's task"
        )
    found = mapping[type(config)]
    return found[0] if isinstance(found, (list, tuple)) else found
