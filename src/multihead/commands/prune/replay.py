"""Running a model's layers one at a time over every batch: work that scales with layers plus tokens.

Dimensions: B batch, L tokens, E hidden width.

A stage that goes through the layers in order (the refit, the reconstruction) needs, at each layer, that
layer's input as the layers before it were left. Running the model up to each layer again costs one pass
per layer: layers x layers x tokens. A :class:`Chain` instead records, in one pass per batch, the arguments
the model passes each layer (all but the hidden state: masks, positions, rotary tables, which do not change
when a layer's weights do) and the first layer's hidden state (B, L, E); :meth:`Chain.advance` then runs
one layer on the current hidden state of every batch and keeps its output as the next layer's input:
each layer runs once per batch.

That holds where the layers form a chain: the output of each layer is the next layer's input unchanged (a
decoder-only or encoder-only stack: Llama, GPT-2, BERT...). :meth:`Chain.record` checks it on every batch
while it records and returns None where it does not hold (an encoder-decoder, a layer run twice, something
between two layers), and the callers fall back to one pass per layer. A KV cache is left out of every
recorded call (replaying must not append to one).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from ...heads.naming import layer_of
from .objectives import Batch, Objective

__all__ = ["Call", "Chain", "first", "layer_of", "no_cache", "run_stopped", "stack_of"]

Call = tuple[tuple[Any, ...], dict[str, Any]]


class _Stop(Exception):
    """Raised by a capture hook once it has what it needs: the rest of the forward pass is skipped."""


def _is_cache(value: object) -> bool:
    """Whether ``value`` is a KV cache (a ``transformers`` ``Cache``, by its class or a base's name)."""
    return any(c.__name__.endswith("Cache") for c in type(value).__mro__[:-1])


def no_cache(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Call:
    """The layer's arguments with any KV cache left out (replaying must not append to one): a cache object
    under any name (``past_key_values`` in transformers 5.23, ``cache`` in 5.24) becomes None."""
    out = {k: (None if "past_key" in k or _is_cache(v) else v) for k, v in kwargs.items()}
    if "use_cache" in out:
        out["use_cache"] = False
    return tuple(None if _is_cache(a) else a for a in args), out


def first(out: Any) -> Tensor:
    """A layer's hidden-state output: the output itself, or the first element of a tuple."""
    return out[0] if isinstance(out, tuple) else out


def _hidden_of(call: Call) -> Tensor:
    args, kwargs = call
    return args[0] if args else kwargs["hidden_states"]


def _without_hidden(call: Call) -> Call:
    args, kwargs = call
    if args:
        return (None, *args[1:]), kwargs
    return args, {**kwargs, "hidden_states": None}


def _with_hidden(call: Call, hidden: Tensor) -> Call:
    args, kwargs = call
    if args:
        return (hidden, *args[1:]), kwargs
    return args, {**kwargs, "hidden_states": hidden}


def stack_of(model: nn.Module, layers: Sequence[str]) -> list[str] | None:
    """Every element of the one ``nn.ModuleList`` that holds all of ``layers`` (names like
    ``model.layers.3``), in order; None when they are not all in one list."""
    lists = {name.rpartition(".")[0] for name in layers}
    if len(lists) != 1:
        return None
    (prefix,) = lists
    stack = model.get_submodule(prefix)
    return [f"{prefix}.{i}" for i in range(len(stack))] if isinstance(stack, nn.ModuleList) else None


class Chain:
    """The calls of layers ``names`` (consecutive elements of one stack) on every batch, and each batch's
    hidden state entering the next layer to run (see the module docstring)."""

    def __init__(self, model: nn.Module, names: list[str], calls: list[list[Call]], hidden: list[Tensor]):
        self.model, self.names = model, names
        self.calls = calls  # calls[b][i]: layer names[i]'s arguments on batch b, the hidden state left out
        self.hidden = hidden  # hidden[b]: (B, L, E), the input of layer names[self.at]
        self.at = 0

    @classmethod
    def record(
        cls, model: nn.Module, names: list[str], batches: Sequence[Batch], objective: Objective
    ) -> Chain | None:
        """One pass of ``model`` per batch (stopped after layer ``names[-1]``); None where the layers do not
        chain (the output of one is not the next one's input)."""
        layers = [model.get_submodule(n) for n in names]
        calls: list[list[Call]] = []
        hidden: list[Tensor] = []
        for b in batches:
            seen = _record_batch(model, layers, objective, b)
            if seen is None:
                return None
            calls.append([_without_hidden(c) for c in seen])
            hidden.append(_hidden_of(seen[0]))
        return cls(model, names, calls, hidden)

    def call(self, b: int) -> Call:
        """Batch ``b``'s call of the current layer, with its current input."""
        return _with_hidden(self.calls[b][self.at], self.hidden[b])

    def run(self, b: int) -> Tensor:
        """The current layer's output on batch ``b`` (no gradient; nothing kept)."""
        args, kwargs = self.call(b)
        with torch.no_grad():
            return first(self.layer(*args, **kwargs))

    @property
    def layer(self) -> nn.Module:
        return self.model.get_submodule(self.names[self.at])

    @property
    def name(self) -> str:
        return self.names[self.at]

    def advance(
        self,
        *,
        before: Callable[[int], None] | None = None,
        each: Callable[[int, Tensor], None] | None = None,
    ) -> None:
        """Run the current layer on every batch, its output the next layer's input (``before(b)`` is called
        before batch ``b`` runs, ``each(b, output)`` after); then the next layer is current."""
        for b in range(len(self.hidden)):
            if before is not None:
                before(b)
            out = self.run(b)
            if each is not None:
                each(b, out)
            self.hidden[b] = out
        self.at += 1


def _record_batch(
    model: nn.Module, layers: list[nn.Module], objective: Objective, batch: Batch
) -> list[Call] | None:
    """Each of ``layers``' call on ``batch`` (one pass, stopped after the last); None when a layer's input
    is not the previous one's output, or a layer runs more than once."""
    seen: list[Call] = []
    last: list[Tensor] = []
    broken = False

    def pre(index: int) -> Callable[..., None]:
        def hook(_: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            nonlocal broken
            call = no_cache(args, kwargs)
            if len(seen) != index or (index and _hidden_of(call) is not last[-1]):
                broken = True
                raise _Stop
            seen.append(call)

        return hook

    def post(index: int) -> Callable[..., None]:
        def hook(_: nn.Module, args: tuple[Any, ...], out: Any) -> None:
            last.append(first(out))
            if index == len(layers) - 1:
                raise _Stop

        return hook

    handles = [layer.register_forward_pre_hook(pre(i), with_kwargs=True) for i, layer in enumerate(layers)]
    handles += [layer.register_forward_hook(post(i)) for i, layer in enumerate(layers)]
    run_stopped(model, objective, batch, handles)
    return None if broken or len(seen) != len(layers) else seen


def run_stopped(model: nn.Module, objective: Objective, batch: Batch, handles: Sequence[Any]) -> None:
    """Run ``model`` on ``batch`` without gradients until a hook raises :class:`_Stop` (or to the end); the
    hooks' ``handles`` are removed afterwards, also on an error."""
    try:
        with torch.no_grad():
            objective.forward(model, batch)
    except _Stop:
        pass
    finally:
        for h in handles:
            h.remove()
