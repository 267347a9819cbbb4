"""Hugging Face ``transformers`` models on multihead attention, and the head tools on those models.

Dimensions: B batch, H query heads, Hkv key/value heads (H % Hkv == 0), Lq/Lk query/key lengths,
D head dim, E model width.

:func:`register` adds ``"multihead"`` to transformers' ``AttentionInterface`` (the attention function,
:func:`attention_forward`) and to its ``AttentionMaskInterface`` (the mask function,
:func:`mask_interface`: without one, transformers builds no mask at all for an unknown implementation,
and causal masking and padding are silently lost). Then::

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

import sys
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from ..core.options import AttentionOptions
from ..heads.naming import register_family
from ..heads.prune import head_rows
from ..nn import seam

try:
    import transformers
    from transformers import AttentionInterface, PreTrainedModel
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "multihead.integrations.transformers needs Hugging Face transformers: "
        "pip install 'multihead[transformers]'"
    ) from exc

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

LAYOUT_KEY = "multihead_heads"
"""Config attribute of a pruned model: ``{module name: [H, Hkv]}`` per pruned attention module."""

_BUILTIN = ("eager", "sdpa", "flex_attention", "flash_attention_2", "flash_attention_3", "flash_attention_4")
_INTERFACE_FLAGS = (
    "_supports_sdpa",
    "_supports_flex_attn",
    "_supports_flash_attn",
    "_supports_attention_backend",
)
"""transformers' documented class flags: the model runs an implementation other than its own eager code."""


# ------------------------------------------------------------------------------------------------
# Registration
# ------------------------------------------------------------------------------------------------


def register(name: str = "multihead") -> str:
    """Register multihead's attention and mask functions with transformers under ``name``; returns it.

    Idempotent. After it, ``attn_implementation=name`` works in ``from_config``/``from_pretrained`` and
    ``model.set_attn_implementation(name)``, for every model whose attention goes through transformers'
    ``AttentionInterface``; other models are refused (:func:`check_model`).
    """
    if not isinstance(name, str) or not name:
        raise TypeError(f"name must be a non-empty str, got {name!r}")
    if name in _BUILTIN:
        raise ValueError(
            f"name {name!r} is one of transformers' own attention implementations {_BUILTIN}; pick another "
            f"name, e.g. register('multihead')"
        )
    taken = ALL_ATTENTION_FUNCTIONS.get(name) if name in ALL_ATTENTION_FUNCTIONS else None
    if taken is not None and taken is not attention_forward:
        raise ValueError(
            f"name {name!r} is already registered with transformers for {getattr(taken, '__name__', taken)}; "
            f"pick another name"
        )
    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, mask_interface)
    return name


def is_registered(name: str) -> bool:
    """Whether ``name`` is an attention implementation registered by :func:`register`."""
    return (
        isinstance(name, str)
        and name in ALL_ATTENTION_FUNCTIONS
        and ALL_ATTENTION_FUNCTIONS[name] is attention_forward
    )


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


_RECORDER_WARNED: list[bool] = []


def _recording_attentions() -> bool:
    """Whether transformers is recording attention weights right now (``output_attentions=True``).

    Most models record weights with hooks inside ``capture_outputs`` and never pass ``output_attentions``
    to the attention function; the request lives in that decorator's collector. Private:
    ``transformers.utils.output_capturing._active_collector``. If it is gone, weights are always computed
    (correct, slower) and a warning names the version.
    """
    try:
        from transformers.utils.output_capturing import _active_collector

        collected = _active_collector.get()
    except (ImportError, AttributeError):
        if not _RECORDER_WARNED:
            _RECORDER_WARNED.append(True)
            warnings.warn(
                f"transformers {transformers.__version__} moved its output collector; multihead computes "
                f"attention weights on every call until it is updated",
                RuntimeWarning,
                stacklevel=3,
            )
        return True
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


# ------------------------------------------------------------------------------------------------
# The mask function
# ------------------------------------------------------------------------------------------------


def _splits_sequences(
    mask_function: Callable[..., Tensor], batch_size: int, length: int, device: Any
) -> bool:
    """Whether some query may not see the key just before it: packed sequences (or a chunk boundary).

    One probe per position, O(B L): ``mask_function`` is an index-based mask of transformers (evaluated
    on broadcast index tensors, as transformers does without vmap).
    """
    if length < 2:
        return False
    q = torch.arange(1, length, device=device)[None, None, :]  # (1, 1, L-1)
    b = torch.arange(batch_size, device=device)[:, None, None]  # (B, 1, 1)
    h = torch.zeros(1, dtype=torch.long, device=device)[None, :, None]  # (1, 1, 1)
    return not bool(mask_function(b, h, q, q - 1).all())


def mask_interface(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: Any = 0,
    kv_offset: Any = 0,
    mask_function: Callable[..., Tensor] | None = None,
    attention_mask: Tensor | None = None,
    allow_is_causal_skip: bool = True,
    config: Any = None,
    use_vmap: bool = False,
    device: Any = "cpu",
    **kwargs: Any,
) -> Tensor | Callable[..., Tensor] | None:
    """transformers' mask-function signature (``AttentionMaskInterface``) for multihead.

    Returns, as :func:`attention_forward` takes them:

    - a bool (B, 1, Lq, Lk) tensor, True = may attend (transformers' ``sdpa_mask``), or None where a plain
      causal or full mask needs none;
    - for packed sequences (padding-free batches: no padding mask, positions that restart) the index
      function itself, ``fn(b, h, q_idx, kv_idx) -> bool``: nothing (Lq, Lk)-sized is built, and
      :func:`attention_forward` adds the sequences as ``segment_ids``.

    Also refuses, on the first call, a model family whose attention bypasses the interface.
    """
    if config is not None:
        _check_config(config)
    call = dict(
        batch_size=batch_size,
        q_length=q_length,
        kv_length=kv_length,
        q_offset=q_offset,
        kv_offset=kv_offset,
        attention_mask=attention_mask,
        allow_is_causal_skip=allow_is_causal_skip,
        use_vmap=use_vmap,
        device=device,
        **kwargs,
    )
    if mask_function is not None:
        call["mask_function"] = mask_function
    packed = (
        mask_function is not None
        and attention_mask is None
        and not allow_is_causal_skip  # transformers turns the causal skip off for packed sequences
        and not use_vmap  # an index function (no overlays that need vmap)
        and isinstance(q_offset, int)
        and isinstance(kv_offset, int)
        and q_offset == kv_offset == 0
        and q_length == kv_length
        and _splits_sequences(mask_function, batch_size, q_length, device)
    )
    return mask_function if packed else sdpa_mask(**call)


# ------------------------------------------------------------------------------------------------
# The attention function
# ------------------------------------------------------------------------------------------------


def _weights_requested(kwargs: Mapping[str, Any]) -> bool:
    """``output_attentions`` reaches the attention function only in some models; the rest record weights
    with hooks (:func:`_recording_attentions`)."""
    return bool(kwargs.get("output_attentions")) or _recording_attentions()


def _window(lq: int, lk: int, window: int, device: torch.device) -> Tensor:
    """(Lq, Lk) bool: bottom-right aligned causal keys within the last ``window`` positions."""
    pos = torch.arange(lq, device=device)[:, None] + (lk - lq)  # (Lq, 1) absolute query positions
    keys = torch.arange(lk, device=device)[None, :]  # (1, Lk)
    return (keys <= pos) & (keys > pos - window)  # (Lq, Lk)


def segments_from_positions(position_ids: Tensor) -> Tensor:
    """(B, L) sequence ids of a packed batch: a new sequence starts where a position does not follow on.

    ``[[0, 1, 2, 0, 1, 0]]`` -> ``[[0, 0, 0, 1, 1, 2]]`` (transformers' rule for padding-free batches).
    """
    first = position_ids[:, :1] - 1  # (B, 1): the first position always "follows on"
    step = torch.diff(position_ids, prepend=first, dim=-1)  # (B, L)
    return (step != 1).cumsum(-1)  # (B, L)


def _segments(kwargs: Mapping[str, Any], batch: int, length: int) -> Tensor | None:
    """Sequence ids (B, L) of a packed batch from ``position_ids`` or ``cu_seq_lens_q``; None if absent."""
    positions = kwargs.get("position_ids")
    if isinstance(positions, Tensor) and positions.dim() == 2 and positions.shape[-1] == length:
        return segments_from_positions(positions.expand(batch, -1))  # (B, L)
    starts = kwargs.get("cu_seq_lens_q")
    if isinstance(starts, Tensor) and batch == 1 and int(starts[-1]) == length:
        index = torch.arange(length, device=starts.device)  # (L,)
        return torch.searchsorted(starts[1:], index, right=True)[None]  # (1, L)
    return None


def attention_forward(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | Callable[..., Tensor] | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[Tensor, Tensor | None]:
    """transformers' attention-function signature over :func:`multihead.nn.seam.attend`.

    Args:
        module: the Hugging Face attention module (its ``is_causal`` is read when no mask is given).
        query: (B, H, Lq, D); key, value: (B, Hkv, Lk, D) -- grouped-query heads are used as they are,
            K/V are never repeated.
        attention_mask: what :func:`mask_interface` returns -- bool (B|1, 1, Lq, Lk), True = may attend;
            an index function of packed sequences; or None: causal when the module is, for Lq > 1 --
            or a float mask, added to the scores (the dtype's minimum is treated as -inf).
        dropout: on the weights (transformers passes 0 in eval mode).
        scaling: score scale (default 1/sqrt(D)).
        kwargs: ``sliding_window`` (applied when no mask carries it), ``position_bias`` (added to the
            scores), ``softcap`` (Gemma 2), ``s_aux``/``sinks`` (gpt-oss's per-head sink logits (H,)),
            ``position_ids``/``cu_seq_lens_q`` (packed sequences: a new sequence where the positions
            restart, also when transformers, with a cache on, did not look), ``output_attentions``.

    Returns:
        ``(output (B, Lq, H, D), weights (B, H, Lq, Lk) or None)``: weights whenever transformers asks
        for them (``output_attentions=True``) -- otherwise the fused path runs.
    """
    config = getattr(module, "config", None)
    if config is not None:
        _check_config(config)
    if kwargs.get("cache") is not None:
        raise ValueError(
            "multihead attention does not serve transformers' paged cache (continuous batching); use "
            "attn_implementation='sdpa' or 'eager' for generate_batch"
        )
    lq, lk = query.shape[2], key.shape[2]
    mask = bias = segment_ids = None
    causal = False
    if attention_mask is None:
        wants_causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
        window = kwargs.get("sliding_window")
        if wants_causal and lq > 1 and lk > lq:
            # prefill into an empty static cache: the keys after Lq are future slots (top-left causal)
            mask = torch.arange(lq, device=query.device)[:, None] >= torch.arange(lk, device=query.device)
        elif wants_causal and window is not None and lk > window:
            mask = _window(lq, lk, window, query.device)  # (Lq, Lk)
        else:
            causal = bool(wants_causal) and lq > 1
        if wants_causal and lq == lk > 1:
            # no mask: transformers saw no padding, and no packing when a cache is on (it then skips its
            # packed-sequence check); positions that restart still mean packed rows
            segment_ids = _segments(kwargs, query.shape[0], lq)  # (B, L)
            if segment_ids is not None and not bool(segment_ids[:, -1].any()):
                segment_ids = None  # one sequence per row: nothing to separate
    elif not isinstance(attention_mask, Tensor):
        mask = attention_mask  # packed sequences: transformers' index function (see mask_interface)
        segment_ids = _segments(kwargs, query.shape[0], lq) if lq == lk else None  # (B, L)
    elif attention_mask.dtype == torch.bool:
        mask = attention_mask  # (B|1, 1, Lq, Lk)
    else:
        floor = torch.finfo(attention_mask.dtype).min
        bias = attention_mask.masked_fill(attention_mask <= floor, float("-inf"))  # (B|1, 1, Lq, Lk)
    position_bias = kwargs.get("position_bias")
    if position_bias is not None:
        bias = position_bias if bias is None else bias + position_bias  # (B|1, H|1, Lq, Lk)
    sinks = kwargs.get("s_aux", kwargs.get("sinks"))
    if sinks is not None and tuple(sinks.shape) != (query.shape[1],):
        raise ValueError(
            f"{type(module).__name__} passes attention sinks of shape {tuple(sinks.shape)}; multihead takes one "
            f"sink logit per query head, shape ({query.shape[1]},) (gpt-oss's s_aux); run this model with "
            f"attn_implementation='eager'"
        )
    options = AttentionOptions(
        mask=mask,
        bias=bias,
        causal=causal,
        scale=scaling,
        dropout=dropout,
        segment_ids=segment_ids,
        softcap=kwargs.get("softcap"),
        sinks=sinks,
        return_weights=_weights_requested(kwargs),
    )
    heads, weights = seam.attend(module, query, key, value, options)  # type: ignore[arg-type]
    # (B, H, Lq, D), (B, H, Lq, Lk) | None
    return heads.transpose(1, 2).contiguous(), weights  # (B, Lq, H, D)


# ------------------------------------------------------------------------------------------------
# Architectures: where each attention class keeps its heads
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Arch:
    """How one Hugging Face attention class stores its heads (a row of :data:`ARCHITECTURES`).

    Head counts are read from the projection shapes (H = q rows / D, Hkv = k rows / D); the attribute
    fields name what :func:`multihead.heads.prune` must update on the module for it to run.
    """

    q: str  # query projection; for a fused projection, its name (rows [q | k | v])
    k: str | None  # key projection (None: fused into ``q``)
    v: str | None  # value projection (None: fused into ``q``)
    o: str  # output projection; a leading "../" means relative to the attention module's parent
    head_dim: str = "head_dim"  # attribute holding D
    heads_attr: str | None = None  # attribute holding H, if the module keeps one
    groups_attr: str | None = None  # attribute holding H // Hkv, if the module keeps one
    width_attrs: tuple[str, ...] = ()  # attributes equal to H * D
    conv1d: bool = False  # weights stored (in, out) (transformers' Conv1D) instead of nn.Linear's (out, in)
    cross: tuple[str, ...] = ()  # last parts of module names that are cross-attention


_LLAMA = Arch("q_proj", "k_proj", "v_proj", "o_proj", groups_attr="num_key_value_groups")
_BERT = Arch(
    "query",
    "key",
    "value",
    "../output.dense",
    head_dim="attention_head_size",
    heads_attr="num_attention_heads",
    width_attrs=("all_head_size",),
)

ARCHITECTURES: dict[str, Arch] = {
    "LlamaAttention": _LLAMA,
    "MistralAttention": _LLAMA,
    "Qwen2Attention": _LLAMA,
    "BertSelfAttention": _BERT,
    "RobertaSelfAttention": _BERT,
    "GPT2Attention": Arch(
        "c_attn", None, None, "c_proj", heads_attr="num_heads", width_attrs=("split_size",), conv1d=True
    ),
    "ViTAttention": Arch("q_proj", "k_proj", "v_proj", "o_proj", heads_attr="num_attention_heads"),
    "BartAttention": Arch(
        "q_proj", "k_proj", "v_proj", "out_proj", heads_attr="num_heads", cross=("encoder_attn",)
    ),
}
"""Attention class name -> its :class:`Arch`: the classes :func:`multihead.heads.prune` can shrink."""


_RECORDED: dict[type, bool] = {}  # module class -> whether a model records its attention weights


def _recorded_attention_classes(module_class: type) -> bool:
    """Whether the models of ``module_class``'s modeling file record attention weights from it.

    transformers' documented output recording: each model declares in ``_can_record_outputs`` (read by
    ``PreTrainedModel.can_record_outputs``) which module classes produce its ``attentions`` (and
    ``cross_attentions``, ...): exactly the modules that call the attention function.
    """
    if module_class not in _RECORDED:
        found = False
        for obj in list(vars(sys.modules.get(module_class.__module__, object)).values()):
            if isinstance(obj, type) and issubclass(obj, PreTrainedModel):
                recordable = getattr(obj, "_can_record_outputs", None) or {}
                for key, targets in recordable.items():
                    if key.endswith("attentions") and _names_class(targets, module_class):
                        found = True
        _RECORDED[module_class] = found
    return _RECORDED[module_class]


def _names_class(targets: Any, module_class: type) -> bool:
    """Whether a ``_can_record_outputs`` value (class, class name, OutputRecorder, or a list) names it."""
    if isinstance(targets, (list, tuple)):
        return any(_names_class(t, module_class) for t in targets)
    if isinstance(targets, type):
        return targets is module_class
    if isinstance(targets, str):
        return targets == module_class.__name__
    target = getattr(targets, "target_class", None)
    name = getattr(targets, "class_name", None)
    return target is module_class or (name is not None and module_class.__name__.endswith(name))


def _out_proj(model: nn.Module, name: str, path: str) -> nn.Module:
    """The output projection at ``path`` of module ``name``; a leading "../" starts at the module's parent."""
    if path.startswith("../"):
        parent = name.rpartition(".")[0]
        return model.get_submodule(f"{parent}.{path[3:]}" if parent else path[3:])
    return model.get_submodule(f"{name}.{path}" if name else path)


def _rows(layer: nn.Module, conv1d: bool) -> int:
    """Output features of an nn.Linear (out, in) or a Conv1D (in, out)."""
    return layer.weight.shape[1 if conv1d else 0]


def _select(layer: nn.Module, idx: Tensor, *, outputs: bool, conv1d: bool) -> None:
    """Keep output features (``outputs``) or input features ``idx`` of ``layer``, in place."""
    dim = (1 if conv1d else 0) if outputs else (0 if conv1d else 1)
    idx = idx.to(layer.weight.device)

    def keep(p: nn.Parameter, d: int) -> nn.Parameter:
        new = nn.Parameter(p.detach().index_select(d, idx).clone())
        new.requires_grad_(p.requires_grad)
        return new

    layer.weight = keep(layer.weight, dim)
    if outputs and getattr(layer, "bias", None) is not None:
        layer.bias = keep(layer.bias, 0)
    size = len(idx)
    for attr in ("out_features", "nf") if outputs else ("in_features", "nx"):
        if hasattr(layer, attr):
            setattr(layer, attr, size)


class TransformersFamily:
    """The :class:`multihead.heads.naming.HeadFamily` of Hugging Face attention modules."""

    name = "transformers"

    def owns(self, module: nn.Module) -> bool:
        return isinstance(getattr(module, "config", None), transformers.PretrainedConfig) and (
            type(module).__name__ in ARCHITECTURES or _recorded_attention_classes(type(module))
        )

    def _arch(self, name: str, module: nn.Module) -> Arch:
        arch = ARCHITECTURES.get(type(module).__name__)
        if arch is None:
            raise ValueError(
                f"{name!r} is a {type(module).__name__}, an architecture multihead cannot prune yet (it "
                f"knows {', '.join(sorted(ARCHITECTURES))}); it still runs, captures and masks heads on "
                f"multihead -- add an Arch record to multihead.integrations.transformers.ARCHITECTURES"
            )
        if getattr(module, "is_cross_attention", False) and arch.k is None:
            raise ValueError(f"{name!r}: pruning {type(module).__name__} cross-attention is not supported")
        return arch

    def check_prunable(self, name: str, module: nn.Module) -> None:
        self._arch(name, module)

    def heads(self, module: nn.Module) -> tuple[int, int]:
        arch = ARCHITECTURES.get(type(module).__name__)
        if arch is None:  # an architecture without a record: read what the module or its config says
            for attr in ("num_heads", "num_attention_heads"):
                if isinstance(getattr(module, attr, None), int):
                    h = getattr(module, attr)
                    break
            else:
                h = module.config.num_attention_heads
            return h, getattr(module, "num_key_value_heads", None) or h // getattr(
                module, "num_key_value_groups", 1
            )
        d = getattr(module, arch.head_dim)
        q = _rows(module.get_submodule(arch.q), arch.conv1d)
        if arch.k is None:  # fused [q | k | v], equal head counts
            return q // (3 * d), q // (3 * d)
        return q // d, _rows(module.get_submodule(arch.k), arch.conv1d) // d

    def kind(self, name: str, module: nn.Module) -> str | None:
        arch = ARCHITECTURES.get(type(module).__name__)
        if arch is not None and name.rsplit(".", 1)[-1] in arch.cross:
            return "cross"
        return None

    def check_routed(self, model: nn.Module) -> None:
        check_model(model)
        for name, m in model.named_modules():
            if self.owns(m):
                impl = getattr(m.config, "_attn_implementation", None)
                if not is_registered(impl):
                    raise ValueError(
                        f"{name!r} runs attn_implementation={impl!r}, which bypasses multihead: capture, "
                        f"masked and importance see only multihead attention. Run "
                        f"multihead.integrations.transformers.register() and "
                        f"model.set_attn_implementation('multihead') first"
                    )

    def reshape(
        self, model: nn.Module, name: str, module: nn.Module, q_heads: list[int], kv_heads: list[int]
    ) -> None:
        self._resize(model, name, module, q_heads, kv_heads)
        config = getattr(model, "config", None)
        if isinstance(config, transformers.PretrainedConfig):  # what from_pretrained() needs to rebuild it
            layout = dict(getattr(config, LAYOUT_KEY, None) or {})
            layout[name] = [len(q_heads), len(kv_heads)]
            setattr(config, LAYOUT_KEY, layout)

    def _resize(
        self, model: nn.Module, name: str, module: nn.Module, q_heads: list[int], kv_heads: list[int]
    ) -> None:
        """Keep ``q_heads`` and ``kv_heads`` of ``module`` (its projections and head-count attributes)."""
        arch = self._arch(name, module)
        h, hkv = self.heads(module)
        d = getattr(module, arch.head_dim)
        q_idx, kv_idx = head_rows(q_heads, d), head_rows(kv_heads, d)
        if arch.k is None:  # fused rows [q | k | v], each H*D
            fused = torch.cat([q_idx, h * d + kv_idx, (h + hkv) * d + kv_idx])
            _select(module.get_submodule(arch.q), fused, outputs=True, conv1d=arch.conv1d)
        else:
            _select(module.get_submodule(arch.q), q_idx, outputs=True, conv1d=arch.conv1d)
            _select(module.get_submodule(arch.k), kv_idx, outputs=True, conv1d=arch.conv1d)
            _select(module.get_submodule(arch.v), kv_idx, outputs=True, conv1d=arch.conv1d)
        _select(_out_proj(model, name, arch.o), q_idx, outputs=False, conv1d=arch.conv1d)
        new_h, new_hkv = len(q_heads), len(kv_heads)
        if arch.heads_attr is not None:
            setattr(module, arch.heads_attr, new_h)
        if arch.groups_attr is not None:
            setattr(module, arch.groups_attr, new_h // new_hkv)
        for attr in arch.width_attrs:
            setattr(module, attr, new_h * d)


FAMILY = register_family(TransformersFamily())
"""The registered family: :mod:`multihead.heads` and :mod:`multihead.viz` act on Hugging Face modules."""


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
