"""The integrated-gradients path of attribution patching: the input embeddings moved in a straight line from the
corrupted run's to the clean run's.

The input embeddings are the output of the model's input embedding module (``model.get_input_embeddings()`` of
a Hugging Face model; else every ``nn.Embedding`` of the model, e.g. the source and target embeddings of a
:class:`multihead.Transformer`, each call in call order); a model with none (an attention module, a converted
encoder stack) takes floating-point inputs, and those are its embeddings. Step k of m runs the corrupted inputs
with every embedding call's output replaced by ``corrupted + k/m * (clean - corrupted)``.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from torch import Tensor, nn


def check_steps(ig_steps: object) -> int:
    """``ig_steps`` as a positive int (refused by name otherwise)."""
    if not isinstance(ig_steps, int) or isinstance(ig_steps, bool) or ig_steps < 1:
        raise ValueError(
            f"ig_steps must be a positive int (1: plain attribution patching; m > 1: the gradient averaged over "
            f"m points from the corrupted to the clean input embeddings), got {ig_steps!r}"
        )
    return ig_steps


def input_embeddings(model: nn.Module) -> list[nn.Module]:
    """The model's input embedding modules: ``get_input_embeddings()`` where the model has it, else every
    ``nn.Embedding`` in it (in module order); [] where it has none."""
    get = getattr(model, "get_input_embeddings", None)
    found = get() if callable(get) else None
    if isinstance(found, nn.Module):
        return [found]
    return [m for m in model.modules() if isinstance(m, nn.Embedding)]


def embedding_name(model: nn.Module) -> str:
    """The name (as in ``named_modules()``) of the first input embedding module; "" (the model) where none."""
    found = input_embeddings(model)
    if not found:
        return ""
    return next(name for name, m in model.named_modules() if m is found[0])


@contextmanager
def _hooked(modules: list[nn.Module], hook: Any) -> Iterator[None]:
    handles = [m.register_forward_hook(hook) for m in modules]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


class Path:
    """The straight path of one (clean, corrupted) pair: :meth:`recording` the two ends, :meth:`at` a point.

    Args:
        model: the model; ``clean``, ``corrupted``: its inputs (equal shapes).
    """

    def __init__(self, model: nn.Module, clean: object, corrupted: object) -> None:
        self.modules = input_embeddings(model)
        self.clean_inputs, self.corrupted_inputs = clean, corrupted
        if not self.modules and not _floats(corrupted):
            raise ValueError(
                f"ig_steps > 1 moves the input embeddings from corrupted to clean, but {type(model).__name__} has "
                f"no input embedding module (no get_input_embeddings(), no nn.Embedding) and no floating-point "
                f"inputs to move; use ig_steps=1"
            )
        self.ends: dict[str, list[Tensor]] = {}

    @contextmanager
    def recording(self, end: str) -> Iterator[None]:
        """Keep the embedding modules' outputs of the run inside the block as end ``end`` ("clean"/"corrupted")."""
        kept: list[Tensor] = []
        self.ends[end] = kept

        def hook(module: nn.Module, inputs: tuple[Any, ...], output: Tensor) -> None:
            kept.append(output.detach())

        with _hooked(self.modules, hook):
            yield

    @contextmanager
    def at(self, alpha: float) -> Iterator[object]:
        """Yields the inputs to run at ``alpha`` (0: corrupted, 1: clean); in the block, the embedding calls'
        outputs are moved there."""
        if not self.modules:
            yield _mix(self.corrupted_inputs, self.clean_inputs, alpha)
            return
        clean, corrupted = self.ends["clean"], self.ends["corrupted"]
        calls = iter(range(len(corrupted)))

        def hook(module: nn.Module, inputs: tuple[Any, ...], output: Tensor) -> Tensor:
            i = next(calls, None)
            if i is None or clean[i].shape != output.shape:
                raise ValueError(
                    "the input embeddings of the clean and corrupted runs do not match call for call (shapes "
                    f"{[tuple(t.shape) for t in clean]} and {[tuple(t.shape) for t in corrupted]}): the path "
                    "between them is not defined"
                )
            return corrupted[i] + alpha * (clean[i] - corrupted[i])

        with _hooked(self.modules, hook):
            yield self.corrupted_inputs


def _floats(inputs: object) -> bool:
    if isinstance(inputs, Tensor):
        return inputs.is_floating_point()
    values = inputs.values() if isinstance(inputs, Mapping) else inputs if isinstance(inputs, tuple) else ()
    return any(isinstance(v, Tensor) and v.is_floating_point() for v in values)


def _mix(corrupted: object, clean: object, alpha: float) -> object:
    """The inputs with every floating-point tensor at ``corrupted + alpha * (clean - corrupted)``."""
    if isinstance(corrupted, Tensor):
        if corrupted.is_floating_point():
            return corrupted + alpha * (clean - corrupted)  # type: ignore[operator]
        return corrupted
    if isinstance(corrupted, Mapping):
        return {k: _mix(v, clean[k], alpha) for k, v in corrupted.items()}  # type: ignore[index]
    if isinstance(corrupted, tuple):
        return tuple(_mix(a, b, alpha) for a, b in zip(corrupted, clean))  # type: ignore[arg-type]
    return corrupted


def steps(ig_steps: int) -> list[float]:
    """alpha = k/m for k = 0..m-1."""
    return [k / ig_steps for k in range(ig_steps)]
