"""Running the layers before a patch once: the shared prefix of a batched patching forward.

Dimensions: B the corrupted batch, C copies of it in one forward (one patch each), L sequence length.

In a batched patching forward (:func:`~multihead.lens.patch_heads`) every copy is the corrupted run until the
first patched module. When that module sits in a layer of a stack (an item of an ``nn.ModuleList``: a decoder
layer, an encoder layer, a block), the layers before it compute the same thing in every copy. :class:`Prefix`
runs the model on the corrupted batch itself (B rows, not C*B) and repeats the layer's inputs C times as the
layer is entered, so only the layers from the first patch on run C times.

Nothing about an architecture is assumed beyond "layers in a ``ModuleList``, batch on dim 0": the first shared
forward carries one unpatched copy and compares its metric with the corrupted run's; if it differs, or the
forward fails, sharing is switched off for the sweep (said once) and that forward is run again in full.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn

from ..heads.naming import layer_of


def shared_layer(model: nn.Module, name: str) -> nn.Module | None:
    """The layer to repeat at when a forward's first patch is in attention module ``name``: the layer holding
    it (:func:`~multihead.heads.naming.layer_of`); None when it is in no stack or is its stack's first layer
    (nothing runs before it to share)."""
    layer = layer_of(model, name)
    if layer is None or layer.rpartition(".")[2] == "0":
        return None
    return model.get_submodule(layer)


def repeat_batch(value: Any, batch: int, copies: int) -> Any:
    """``value`` with every tensor whose dim 0 is ``batch`` repeated ``copies`` times along dim 0 (copy c: rows
    c*B .. c*B+B-1), inside tuples, lists and mappings (returned as dicts) too; anything else as it is."""
    if isinstance(value, Tensor):
        if value.dim() >= 1 and value.shape[0] == batch:
            return value.repeat(copies, *([1] * (value.dim() - 1)))  # (C*B, ...)
        return value
    if isinstance(value, Mapping):
        return {k: repeat_batch(v, batch, copies) for k, v in value.items()}
    if isinstance(value, (tuple, list)) and not hasattr(value, "_fields"):
        return type(value)(repeat_batch(v, batch, copies) for v in value)
    return value


class Prefix:
    """Shares the layers before the first patched module across the copies of a patching sweep.

    ``layers[i]``: the layer to repeat at for the i-th patched module (:func:`shared_layer`). :meth:`expanding` repeats
    the inputs of one layer; ``on`` tells whether sharing is (still) on, :meth:`verify` switches it off when the
    check copy disagrees.
    """

    def __init__(self, model: nn.Module, names: list[str]) -> None:
        self.layers = [shared_layer(model, name) for name in names]
        self.checked = False
        self.on = True

    def layer_for(self, module: int) -> nn.Module | None:
        """The layer to repeat at when the forward's first patch is in module number ``module``: None when
        sharing is off or :func:`shared_layer` gave none."""
        return self.layers[module] if self.on else None

    @contextmanager
    def expanding(self, layer: nn.Module, batch: int, copies: int) -> Iterator[None]:
        """While the block runs, ``layer``'s positional and keyword inputs are repeated ``copies`` times."""

        def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
            return repeat_batch(args, batch, copies), repeat_batch(kwargs, batch, copies)

        handle = layer.register_forward_pre_hook(hook, with_kwargs=True)
        try:
            yield
        finally:
            handle.remove()

    def verify(self, check: Tensor, corrupted: Tensor) -> bool:
        """Whether the unpatched copy's per-example metric ``check`` reproduces the corrupted run's (to the
        working precision); switches sharing off, saying so once, when it does not."""
        self.checked = True
        eps = torch.finfo(corrupted.dtype).eps if corrupted.is_floating_point() else 0.0
        tol = 4 * eps**0.5 * max(1.0, float(corrupted.abs().max()))
        if check.shape == corrupted.shape and bool(torch.all((check - corrupted).abs() <= tol)):
            return True
        self.refuse(
            f"the unpatched copy's metric {check.tolist()} is not the corrupted run's {corrupted.tolist()}"
        )
        return False

    def refuse(self, why: str) -> None:
        """Sharing off for the rest of the sweep, said once."""
        self.on = False
        warnings.warn(
            f"patch_heads: running the layers before a patch once and repeating their output did not reproduce "
            f"the corrupted run on this model ({why}); every copy now runs the whole model",
            stacklevel=4,
        )


def shared_run(
    prefix: Prefix, layer: nn.Module, batch: int, copies: int, forward: Callable[[], Any]
) -> Any | None:
    """``forward()`` with ``layer``'s inputs repeated ``copies`` times; None (sharing switched off) if it fails."""
    try:
        with prefix.expanding(layer, batch, copies):
            return forward()
    except (RuntimeError, ValueError, IndexError) as err:
        prefix.refuse(f"{type(err).__name__}: {str(err)[:200]}")
        return None
