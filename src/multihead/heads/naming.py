"""Which modules of a model are attention modules, their names and head counts, and head specs."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from torch import Tensor, nn

from ..core.checks import is_int
from ..nn.attention import MultiHeadAttention

HeadSpec = Mapping[str, Iterable[int]] | Iterable[int]
"""Heads to act on: ``{module name: [head, ...]}``, or a plain list of heads for a bare module."""


# ------------------------------------------------------------------------------------------------
# Naming
# ------------------------------------------------------------------------------------------------


def attention_modules(model: nn.Module) -> dict[str, MultiHeadAttention]:
    """Every :class:`MultiHeadAttention` in ``model`` by qualified name, in module order (``""`` = model)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    return {name: m for name, m in model.named_modules() if isinstance(m, MultiHeadAttention)}


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
    return {name: m.num_heads for name, m in attention_modules(model).items()}


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
                f"{argument} names {name!r}, which is not a MultiHeadAttention in this model; "
                f"names: {_names_hint(modules)}"
            )
        if isinstance(idx, int):
            idx = [idx]
        h = modules[name].num_heads
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
