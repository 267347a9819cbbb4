"""Hugging Face ``transformers`` models on multihead attention, and the head tools on those models.

Dimensions: B batch, H query heads, Hkv key/value heads (H % Hkv == 0), Lq/Lk query/key lengths,
D head dim, E model width.

:func:`register` adds ``"multihead"`` to transformers' ``AttentionInterface`` (the attention function,
:func:`attention_forward`) and to its ``AttentionMaskInterface`` (the mask function: without one,
transformers builds no mask at all for an unknown implementation, and causal masking and padding are
silently lost). Then::

    model = AutoModelForCausalLM.from_config(config, attn_implementation="multihead")
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="multihead")
    model.set_attn_implementation("multihead")

Every call goes through :func:`multihead.nn.seam.attend` with the Hugging Face attention module as
``module``, so :func:`multihead.viz.capture`, :func:`multihead.heads.masked`,
:func:`multihead.heads.importance` and :func:`multihead.heads.prune` work on those models by the same
mechanism as on ours; the modules are named as in ``model.named_modules()``. Importing this module
registers :data:`FAMILY` with :mod:`multihead.heads`, which teaches the head tools the per-architecture
layouts of :data:`ARCHITECTURES`.

Differences from transformers' eager attention: a query row with no allowed key (e.g. a left-padding
position of a causal model) gets output 0 and weights 0 where eager attends uniformly; the outputs of
real tokens are equal.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from ..core.attention import attention
from ..heads.naming import register_family
from ..heads.prune import head_rows
from ..nn import seam

try:
    import transformers
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    from transformers.utils import output_capturing
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
    "from_pretrained",
    "is_registered",
    "register",
]

LAYOUT_KEY = "multihead_heads"
"""Config attribute of a pruned model: ``{module name: [H, Hkv]}`` per pruned attention module."""

_BUILTIN = ("eager", "sdpa", "flex_attention", "flash_attention_2", "flash_attention_3", "flash_attention_4")
_REFUSED = ("softcap", "s_aux", "sinks")  # kwargs that change the math and that multihead cannot honour


# ------------------------------------------------------------------------------------------------
# Registration
# ------------------------------------------------------------------------------------------------


def register(name: str = "multihead") -> str:
    """Register multihead's attention and mask functions with transformers under ``name``; returns it.

    Idempotent. After it, ``attn_implementation=name`` works in ``from_config``/``from_pretrained`` and
    ``model.set_attn_implementation(name)``. The mask function is transformers' boolean ``sdpa_mask``
    (True = may attend, multihead's convention), which may return None for a plain causal or unpadded
    call; :func:`attention_forward` then applies ``causal`` itself, as transformers' sdpa does.
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
    AttentionMaskInterface.register(name, sdpa_mask)
    return name


def is_registered(name: str) -> bool:
    """Whether ``name`` is an attention implementation registered by :func:`register`."""
    return (
        isinstance(name, str)
        and name in ALL_ATTENTION_FUNCTIONS
        and ALL_ATTENTION_FUNCTIONS[name] is attention_forward
    )


# ------------------------------------------------------------------------------------------------
# The attention function
# ------------------------------------------------------------------------------------------------


def _weights_requested(kwargs: Mapping[str, Any]) -> bool:
    """``output_attentions`` reaches the attention function only in some models; the rest record weights
    with hooks inside ``capture_outputs``, whose active collector lists what the caller asked for."""
    if kwargs.get("output_attentions"):
        return True
    collected = output_capturing._active_collector.get()
    return bool(collected) and any(key.endswith("attentions") for key in collected)


def _equip(module: nn.Module) -> None:
    """Give a Hugging Face attention module what the seam reads: ``attention_fn`` and ``backend``."""
    if "attention_fn" not in module.__dict__:
        module.attention_fn = attention
        module.backend = "auto"


def _window(lq: int, lk: int, window: int, device: torch.device) -> Tensor:
    """(Lq, Lk) bool: bottom-right aligned causal keys within the last ``window`` positions."""
    pos = torch.arange(lq, device=device)[:, None] + (lk - lq)  # (Lq, 1) absolute query positions
    keys = torch.arange(lk, device=device)[None, :]  # (1, Lk)
    return (keys <= pos) & (keys > pos - window)  # (Lq, Lk)


def attention_forward(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
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
        attention_mask: bool (B|1, 1, Lq, Lk), True = may attend; or float, added to the scores (the
            dtype's minimum is treated as -inf); or None: causal when the module is, for Lq > 1.
        dropout: on the weights (transformers passes 0 in eval mode).
        scaling: score scale (default 1/sqrt(D)).
        kwargs: ``sliding_window`` (applied when no mask carries it), ``position_bias`` (added to the
            scores), ``output_attentions``; ``softcap`` and attention sinks are refused.

    Returns:
        ``(output (B, Lq, H, D), weights (B, H, Lq, Lk) or None)``: weights only when the caller asked
        for them (``output_attentions=True``) -- otherwise the fused path runs.
    """
    for name in _REFUSED:
        if kwargs.get(name) is not None:
            raise ValueError(
                f"{type(module).__name__} passes {name}={kwargs[name]!r}, which multihead attention cannot "
                f"honour (it would be silently ignored); run this model with attn_implementation='eager'"
            )
    if kwargs.get("cache") is not None:
        raise ValueError(
            "multihead attention does not serve transformers' paged cache (continuous batching); use "
            "attn_implementation='sdpa' or 'eager' for generate_batch"
        )
    _equip(module)
    lq, lk = query.shape[2], key.shape[2]
    mask = bias = None
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
    elif attention_mask.dtype == torch.bool:
        mask = attention_mask  # (B|1, 1, Lq, Lk)
    else:
        floor = torch.finfo(attention_mask.dtype).min
        bias = attention_mask.masked_fill(attention_mask <= floor, float("-inf"))  # (B|1, 1, Lq, Lk)
    position_bias = kwargs.get("position_bias")
    if position_bias is not None:
        bias = position_bias if bias is None else bias + position_bias  # (B|1, H|1, Lq, Lk)
    heads, weights = seam.attend(
        module,  # type: ignore[arg-type]
        query,
        key,
        value,
        mask=mask,
        bias=bias,
        causal=causal,
        scale=scaling,
        dropout=dropout,
        return_weights=_weights_requested(kwargs),
    )  # (B, H, Lq, D), (B, H, Lq, Lk) | None
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


def _calls_attention_interface(cls: type) -> bool:
    """Whether ``cls.forward`` looks up transformers' attention functions (then it is an attention module)."""
    forward = getattr(cls, "forward", None)
    code = getattr(getattr(forward, "__wrapped__", forward), "__code__", None)
    return code is not None and "ALL_ATTENTION_FUNCTIONS" in code.co_names


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
            type(module).__name__ in ARCHITECTURES or _calls_attention_interface(type(module))
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
        config = getattr(model, "config", None)
        if isinstance(config, transformers.PretrainedConfig):  # what from_pretrained() needs to rebuild it
            layout = dict(getattr(config, LAYOUT_KEY, None) or {})
            layout[name] = [new_h, new_hkv]
            setattr(config, LAYOUT_KEY, layout)


FAMILY = register_family(TransformersFamily())
"""The registered family: :mod:`multihead.heads` and :mod:`multihead.viz` act on Hugging Face modules."""


# ------------------------------------------------------------------------------------------------
# Reloading a pruned model
# ------------------------------------------------------------------------------------------------


@contextmanager
def _resized_on_init(layout: Mapping[str, list[int]]) -> Iterator[None]:
    """While the block runs, every model built whose modules carry ``layout``'s names is resized to it.

    ``from_pretrained`` builds the model from its config (full head counts) and then loads the saved
    tensors; resizing right after construction (``post_init``) lets transformers' own loading -- key
    renames, shards, tied weights, dtype, devices -- fill the pruned shapes.
    """
    base = transformers.PreTrainedModel
    original = base.post_init

    def post_init(self: nn.Module) -> None:
        original(self)
        modules = dict(self.named_modules())
        if all(name in modules for name in layout):
            for name, (h, hkv) in layout.items():
                FAMILY.reshape(
                    self, name, modules[name], [0] * h, [0] * hkv
                )  # shapes only: loading overwrites

    base.post_init = post_init  # type: ignore[method-assign]
    try:
        yield
    finally:
        base.post_init = original  # type: ignore[method-assign]


def from_pretrained(model_class: Any, path: str | Path, **kwargs: Any) -> nn.Module:
    """Load a ``save_pretrained`` folder, pruned by :func:`multihead.heads.prune` or not.

    Args:
        model_class: an Auto class (``AutoModelForCausalLM``) or a model class (``LlamaForCausalLM``).
        path: the folder written by ``model.save_pretrained(path)`` (or a hub id of such a folder).
        kwargs: passed on to ``model_class.from_pretrained`` (``attn_implementation="multihead"``, ``dtype``).

    A pruned model records its per-module head counts ``[H, Hkv]`` in its config (``multihead_heads``);
    each such module is resized as the model is built, and transformers then loads the saved tensors as
    usual. An unpruned folder loads exactly as ``model_class.from_pretrained(path, **kwargs)``.
    """
    config = kwargs.get("config") or transformers.AutoConfig.from_pretrained(path)
    layout = getattr(config, LAYOUT_KEY, None) or {}
    with _resized_on_init(layout):
        model = model_class.from_pretrained(path, **kwargs)
    modules = dict(model.named_modules())
    wrong = {
        n: hk for n, hk in layout.items() if n not in modules or list(FAMILY.heads(modules[n])) != list(hk)
    }
    if wrong:
        raise ValueError(
            f"the checkpoint's config lists pruned modules {sorted(wrong)} that {type(model).__name__} does "
            f"not have (or did not resize); load it with the model class it was saved from"
        )
    return model
