"""Which modules of a model are attention modules, their names and head counts, and head specs.

Attention modules are :class:`~multihead.MultiHeadAttention` layers and the modules of every registered
:class:`HeadFamily`: attention layers of other libraries whose attention runs through
:func:`multihead.nn.seam.attend` (e.g. Hugging Face models via :mod:`multihead.integrations.transformers`,
which registers its family when imported). Inspection code reads heads only through the helpers here.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import NamedTuple, Protocol

from torch import Tensor, nn

from ..core.checks import is_int
from ..nn.attention import MultiHeadAttention

HeadSpec = Mapping[str, Iterable[int]] | Iterable[int]
"""Heads to act on: ``{module name: [head, ...]}``, or a plain list of heads for a bare module."""


# ------------------------------------------------------------------------------------------------
# Families of attention modules from other libraries
# ------------------------------------------------------------------------------------------------


class Projection(NamedTuple):
    """An attention module's output projection: the layer its merged heads (B, Lq, H*Dv) go through.

    ``transposed``: the layer stores its weight (in, out) (transformers' ``Conv1D``) instead of
    ``nn.Linear``'s (out, in). :meth:`weight` is (O, H*Dv) either way.
    """

    module: nn.Module
    transposed: bool = False

    def weight(self) -> Tensor:
        """(O, H*Dv): what ``F.linear`` takes."""
        w = self.module.weight
        return w.T if self.transposed else w

    def bias(self) -> Tensor | None:
        """(O,) or None."""
        return getattr(self.module, "bias", None)


class HeadFamily(Protocol):
    """Attention modules from outside multihead that the head tools can inspect, mask and prune.

    A family's modules call :func:`multihead.nn.seam.attend` with themselves as ``module`` (so capture and
    head gates reach them by the same mechanism as :class:`MultiHeadAttention`).
    """

    name: str

    def owns(self, module: nn.Module) -> bool:
        """Whether ``module`` is an attention module of this family."""
        ...

    def heads(self, module: nn.Module) -> tuple[int, int]:
        """``(H, Hkv)``: the module's query and key/value heads now."""
        ...

    def kind(self, name: str, module: nn.Module) -> str | None:
        """``"cross"`` etc. when the family knows better than :func:`attention_kind`, else None."""
        ...

    def check_routed(self, model: nn.Module) -> None:
        """Raise ``ValueError`` (with the fix) if ``model``'s attention does not go through the seam."""
        ...

    def check_prunable(self, name: str, module: nn.Module) -> None:
        """Raise ``ValueError`` naming the architecture if :meth:`reshape` cannot handle ``module``."""
        ...

    def reshape(
        self, model: nn.Module, name: str, module: nn.Module, q_heads: list[int], kv_heads: list[int]
    ) -> None:
        """Keep query heads ``q_heads`` and key/value heads ``kv_heads`` (repeats allowed), in that order."""
        ...

    def output_projection(self, model: nn.Module, name: str, module: nn.Module) -> Projection | None:
        """The layer ``module``'s merged heads go through (``name``: its name in ``model``), or None where the
        family does not know it (then :mod:`multihead.lens` refuses the point ``"result"`` by name).
        Optional: a family without this method knows none."""
        ...


_FAMILIES: dict[str, HeadFamily] = {}


def register_family(family: HeadFamily) -> HeadFamily:
    """Let the head tools act on ``family``'s modules (idempotent: one entry per ``family.name``)."""
    _FAMILIES[family.name] = family
    return family


def family_of(module: nn.Module) -> HeadFamily | None:
    """The registered family owning ``module`` (None for our own modules and non-attention modules)."""
    for family in _FAMILIES.values():
        if family.owns(module):
            return family
    return None


# ------------------------------------------------------------------------------------------------
# Naming
# ------------------------------------------------------------------------------------------------


def attention_modules(model: nn.Module) -> dict[str, nn.Module]:
    """Every attention module in ``model`` by qualified name, in module order (``""`` = model).

    :class:`MultiHeadAttention` layers and the modules of registered :class:`HeadFamily` s.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    return {
        name: m
        for name, m in model.named_modules()
        if isinstance(m, MultiHeadAttention) or family_of(m) is not None
    }


def layer_of(model: nn.Module, name: str) -> str | None:
    """The name of the layer holding module ``name``: the element of an ``nn.ModuleList`` nearest above it
    (None when there is none). Pruning replays a model layer by layer from it, patching shares the layers
    before it."""
    parts = name.split(".")
    for i in range(len(parts) - 1, 0, -1):
        if parts[i].isdigit() and isinstance(model.get_submodule(".".join(parts[:i])), nn.ModuleList):
            return ".".join(parts[: i + 1])
    return None


def module_heads(module: nn.Module) -> tuple[int, int]:
    """``(H, Hkv)`` of an attention module (ours or a registered family's)."""
    if isinstance(module, MultiHeadAttention):
        return module.num_heads, module.kv_heads
    family = family_of(module)
    if family is None:
        raise TypeError(f"{type(module).__name__} is not an attention module multihead knows")
    return family.heads(module)


def output_projection(model: nn.Module, name: str, module: nn.Module) -> Projection | None:
    """The output projection of attention module ``name`` of ``model`` (its merged heads (B, Lq, H*Dv) go
    through it): ``out_proj`` of a :class:`MultiHeadAttention`, its family's answer otherwise (None: unknown)."""
    if isinstance(module, MultiHeadAttention):
        return Projection(module.out_proj)
    family = family_of(module)
    find = getattr(family, "output_projection", None)
    return None if find is None else find(model, name, module)


def module_kind(name: str, module: nn.Module) -> str:
    """The kind of an attention module: its family's answer, else :func:`attention_kind` of its name."""
    family = None if isinstance(module, MultiHeadAttention) else family_of(module)
    kind = None if family is None else family.kind(name, module)
    return attention_kind(name) if kind is None else kind


def check_routed(model: nn.Module) -> None:
    """Raise if some attention of ``model`` bypasses the seam (then capture and gates would miss it)."""
    for family in _FAMILIES.values():
        family.check_routed(model)


def attention_kind(name: str) -> str:
    """``"encoder self"``, ``"decoder self"``, ``"cross"`` or ``"self"``, read from a qualified name.

    ``"decoder.layers.1.cross_attn"`` -> ``"cross"``, ``"encoder.layers.0.self_attn"`` ->
    ``"encoder self"``; a name that mentions neither encoder nor decoder is plain ``"self"``.
    """
    parts = name.lower().split(".")
    if "cross" in parts[-1]:
        return "cross"
    for side in ("decoder", "encoder"):
        if any(p.startswith(side) for p in parts):
            return f"{side} self"
    return "self"


def head_counts(model: nn.Module) -> dict[str, int]:
    """Current number of query heads of each attention module, by name."""
    return {name: module_heads(m)[0] for name, m in attention_modules(model).items()}


def _resolve(model: nn.Module, heads: HeadSpec, *, argument: str = "heads") -> dict[str, list[int]]:
    """Validate a :data:`HeadSpec` against ``model``: ``{name: sorted unique head indices}``."""
    modules = attention_modules(model)
    if isinstance(heads, Mapping):
        spec = dict(heads)
    elif isinstance(model, MultiHeadAttention):
        spec = {"": heads}
    else:
        raise TypeError(
            f"{argument} must be a mapping {{module name: [head, ...]}} for a model with several attention "
            f"modules (got {type(heads).__name__}); names: {_names_hint(modules)}"
        )
    out: dict[str, list[int]] = {}
    for name, idx in spec.items():
        if name not in modules:
            raise ValueError(
                f"{argument} names {name!r}, which is not an attention module of this model; "
                f"names: {_names_hint(modules)}"
            )
        if isinstance(idx, int):
            idx = [idx]
        h = module_heads(modules[name])[0]
        picked = []
        for i in idx:
            i = int(i) if isinstance(i, Tensor) and i.numel() == 1 else i
            if not is_int(i, 0) or i >= h:
                raise ValueError(
                    f"{argument}[{name!r}] must hold head indices in [0, {h}) (the module has {h} heads "
                    f"now), got {i!r}"
                )
            picked.append(i)
        out[name] = sorted(set(picked))
    return out


def _names_hint(modules: Mapping[str, nn.Module]) -> str:
    names = [repr(n) for n in modules]
    return ", ".join(names[:8]) + (f", ... ({len(names)} in all)" if len(names) > 8 else "") or "(none)"
