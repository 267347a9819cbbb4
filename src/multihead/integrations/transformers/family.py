"""Where each Hugging Face attention class keeps its heads: the head family of :mod:`multihead.heads`.

Dimensions: H query heads, Hkv key/value heads, D head dim.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import transformers
from torch import Tensor, nn

from ...heads.naming import Projection, register_family
from ...heads.prune import head_rows
from .internals import _calls_attention_interface
from .models import check_model
from .registry import is_registered

LAYOUT_KEY = "multihead_heads"
"""Config attribute of a pruned model: ``{module name: [H, Hkv]}`` per pruned attention module."""

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


CROSS_NAMES = ("encoder_attn", "EncDecAttention", "crossattention", "cross_attn", "cross_attention")
"""Module-name parts transformers' families give cross-attention (BART/Whisper, T5, BERT, ...): a module
whose name has one is ``"cross"`` to the inspection tools, whatever else its name says."""


_OUTPUT_NAMES = ("o_proj", "out_proj", "dense", "c_proj", "o", "wo")
"""Output projections of the attention classes without an :class:`Arch` record, by the names transformers'
families give them (Gemma, Mistral's kin, gpt-oss, Cohere: ``o_proj``; GPT-NeoX, CTRL: ``dense``; GPTBigCode and
GPT-2's copies: ``c_proj``; T5's kin: ``o``); a BERT copy's (Camembert, ELECTRA, ERNIE, ...) is its parent's
``output.dense`` (:data:`_SIBLING_OUTPUT`). A guess is safe: the lens checks at run time that the layer is fed
the merged heads, and refuses the point ``"result"`` by name where it is not."""

_SIBLING_OUTPUT = "../output.dense"

_ATTENTION_CLASSES: dict[type, bool] = {}  # module class -> whether it calls the attention function


def _is_attention_class(module_class: type) -> bool:
    """Whether ``module_class`` calls transformers' attention functions itself: the modules that reach
    multihead, whose heads the inspection tools act on (cached per class).

    Not the classes a model records its weights from (``_can_record_outputs``): many record a wrapper
    (T5's ``T5LayerSelfAttention``, Swin's ``SwinStage``, SAM's two-way blocks), which never reaches
    multihead; owning those made capture miss T5's attention and head counts of Swin fail.
    """
    if module_class not in _ATTENTION_CLASSES:
        _ATTENTION_CLASSES[module_class] = _calls_attention_interface(module_class)
    return _ATTENTION_CLASSES[module_class]


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
            type(module).__name__ in ARCHITECTURES or _is_attention_class(type(module))
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
            for attr in ("num_heads", "num_attention_heads", "n_heads"):
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
        cross = CROSS_NAMES + (arch.cross if arch is not None else ())
        if any(part in cross for part in name.split(".")):
            return "cross"
        return None

    def output_projection(self, model: nn.Module, name: str, module: nn.Module) -> Projection | None:
        """The :class:`Arch` record's ``o``; for a class without one, its ``o_proj`` or ``out_proj`` Linear."""
        arch = ARCHITECTURES.get(type(module).__name__)
        if arch is not None:
            return Projection(_out_proj(model, name, arch.o), transposed=arch.conv1d)
        for attr in _OUTPUT_NAMES:
            layer = getattr(module, attr, None)
            if isinstance(layer, nn.Linear):
                return Projection(layer)
            if isinstance(layer, transformers.pytorch_utils.Conv1D):
                return Projection(layer, transposed=True)
        try:
            layer = _out_proj(model, name, _SIBLING_OUTPUT)
        except AttributeError:
            return None
        return Projection(layer) if isinstance(layer, nn.Linear) else None

    def check_routed(self, model: nn.Module) -> None:
        check_model(model)
        for name, m in model.named_modules():
            if self.owns(m):
                impl = getattr(m.config, "_attn_implementation", None)
                if not is_registered(impl):
                    raise ValueError(
                        f"{name!r} runs attn_implementation={impl!r}, which bypasses multihead: capture, "
                        f"masked and importance see only multihead attention. Run "
                        f"model.set_attn_implementation('multihead') first, or load the model with "
                        f"attn_implementation='multihead' (`import multihead.integrations.transformers` "
                        f"registers that name)"
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
