"""One call contract: the attention options as one frozen record, and what an attention function is.

Dimensions: B batch, H query heads, Hkv key/value heads (H % Hkv == 0), Lq/Lk query/key lengths,
Dk query/key head dim, Dv value head dim.

:class:`AttentionOptions` holds the ten keywords of :func:`multihead.attention` besides ``backend``
(masks, ``causal``, ``segment_ids``, ``softcap``, ``sinks``, ``scale``, ``dropout``,
``return_weights``). Every layer below the public functions passes this one record along: the core
(``prepare``, the reference), the seam (:func:`multihead.nn.seam.attend`) and the attention functions
that replace the computation (ring, Ulysses, hybrid in :mod:`multihead.distributed`). Nothing is dropped
on the way: a keyword that is None reaches the function as None.

:class:`AttentionFn` is what a module's ``attention_fn`` is: a callable with :func:`multihead.attention`'s
keywords. :class:`OptionsAttention` is the base of the attention functions that serve the record
directly: they say by name what they cannot serve (:meth:`OptionsAttention.why_not`), and the seam
hands them the record without unpacking it.
"""

from __future__ import annotations

import dataclasses
import functools
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple, Protocol

from torch import Tensor

__all__ = [
    "OPTION_NAMES",
    "AttentionFn",
    "AttentionOptions",
    "AttentionOutput",
    "OptionsAttention",
    "call_attention_fn",
    "options_of",
    "output_and_weights",
]


class AttentionOutput(NamedTuple):
    """``output`` (B, H, Lq, Dv) -- or (B, Lq, E) from a module -- and per-head ``weights`` (B, H, Lq, Lk).

    ``weights`` are the softmax probabilities *before* dropout (the attention distribution itself).
    """

    output: Tensor
    weights: Tensor


def output_and_weights(res: Tensor | AttentionOutput) -> tuple[Tensor, Tensor | None]:
    """``attention(...)``'s result as ``(output, weights or None)``: the one place the union is unpacked."""
    if isinstance(res, AttentionOutput):
        return res.output, res.weights
    return res, None


@dataclass(frozen=True, kw_only=True)
class AttentionOptions:
    """The options of one attention call (see :func:`multihead.attention` for each one's meaning).

    ``mask``: bool tensor broadcastable to (B, H, Lq, Lk) or ``fn(b, h, q_idx, kv_idx) -> bool``;
    ``bias``: float tensor or function; ``valid_lens`` (B,) or (B, Lq); ``segment_ids`` (B, L) or
    ``(q_ids (B, Lq), kv_ids (B, Lk))``; ``sinks`` (H,). Frozen: a layer that changes one makes a new
    record with :meth:`replace`.
    """

    mask: Tensor | Callable[..., Tensor] | Any | None = None
    bias: Tensor | Callable[..., Tensor] | None = None
    valid_lens: Tensor | None = None
    causal: bool = False
    segment_ids: Tensor | tuple[Tensor, Tensor] | None = None
    softcap: float | None = None
    sinks: Tensor | None = None
    scale: float | None = None
    dropout: float = 0.0
    return_weights: bool = False

    def as_kwargs(self) -> dict[str, Any]:
        """Every option as a keyword of :func:`multihead.attention` (None-valued ones included)."""
        return {name: getattr(self, name) for name in OPTION_NAMES}

    def replace(self, **changes: Any) -> AttentionOptions:
        """A copy with ``changes`` (keywords of :func:`multihead.attention`)."""
        return dataclasses.replace(self, **changes)

    def given(self) -> tuple[str, ...]:
        """Names of the options that differ from their defaults (what a call actually asks for)."""
        return tuple(name for name in OPTION_NAMES if not _is_default(name, getattr(self, name)))

    @staticmethod
    def unmasked(causal: bool, scale: float | None, dropout: float, return_weights: bool) -> AttentionOptions:
        """The record of a call with nothing but these four options -- shared, not built again, for the
        plain numbers (floats, ints, None, bools) a model passes on every call."""
        if (
            type(causal) in _PLAIN_TYPES
            and type(scale) in _PLAIN_TYPES
            and type(dropout) in _PLAIN_TYPES
            and type(return_weights) in _PLAIN_TYPES
        ):
            return _unmasked_record(causal, scale, dropout, return_weights)
        return AttentionOptions(causal=causal, scale=scale, dropout=dropout, return_weights=return_weights)

    @classmethod
    def of(cls, **kwargs: Any) -> AttentionOptions:
        """The record of :func:`multihead.attention`'s keywords; an unknown keyword is a TypeError."""
        unknown = sorted(set(kwargs) - set(OPTION_NAMES))
        if unknown:
            raise TypeError(
                f"unknown attention keyword(s) {unknown}; the options are {list(OPTION_NAMES)} (and backend)"
            )
        return cls(**kwargs)


OPTION_NAMES: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(AttentionOptions))
_PLAIN_TYPES = (bool, int, float, type(None))


@functools.lru_cache(maxsize=256)
def _unmasked_record(
    causal: bool, scale: float | None, dropout: float, return_weights: bool
) -> AttentionOptions:
    return AttentionOptions(causal=causal, scale=scale, dropout=dropout, return_weights=return_weights)


_DEFAULTS = {f.name: f.default for f in dataclasses.fields(AttentionOptions)}


def _is_default(name: str, value: object) -> bool:
    default = _DEFAULTS[name]
    return value is default if default is None else (not isinstance(value, Tensor) and value == default)


def options_of(options: AttentionOptions | None, keywords: dict[str, Any]) -> AttentionOptions:
    """The record of a function that takes one record *or* :func:`multihead.attention`'s keywords."""
    if options is None:
        return AttentionOptions.of(**keywords)
    if not isinstance(options, AttentionOptions):
        raise TypeError(f"options must be a multihead AttentionOptions record, got {type(options).__name__}")
    if keywords:
        raise TypeError(f"pass an AttentionOptions record or keywords, not both (got {sorted(keywords)})")
    return options


class AttentionFn(Protocol):
    """A module's attention function: :func:`multihead.attention`'s keywords (the default is that function).

    ``fn(q (B, H, Lq, Dk), k (B, Hkv, Lk, Dk), v (B, Hkv, Lk, Dv), *, mask, bias, valid_lens, causal,
    segment_ids, softcap, sinks, scale, dropout, return_weights, backend)`` -> (B, H, Lq, Dv), or
    ``AttentionOutput(output, weights (B, H, Lq, Lk))`` when ``return_weights``.
    """

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, **options: Any) -> Tensor | AttentionOutput: ...


class OptionsAttention(ABC):
    """An :class:`AttentionFn` that serves one :class:`AttentionOptions` record and names what it cannot.

    Subclasses (ring, Ulysses and hybrid attention) implement :meth:`why_not` (every reason the call
    cannot be served, by option name; none = it can) and :meth:`serve`. Called with keywords, like
    :func:`multihead.attention`, it builds the record itself; the seam calls :meth:`apply` with the
    record it already has.
    """

    name: ClassVar[str] = "attention"
    sharded: ClassVar[bool] = False  # True: q, k, v are one rank's shards of the sequences

    @abstractmethod
    def why_not(self, q: Tensor, k: Tensor, v: Tensor, options: AttentionOptions) -> Iterable[str]:
        """Every reason this function cannot serve the call (empty: it can)."""

    @abstractmethod
    def serve(
        self, q: Tensor, k: Tensor, v: Tensor, options: AttentionOptions, backend: str
    ) -> Tensor | AttentionOutput:
        """The attention output (B, H, Lq, Dv) of a call :meth:`why_not` accepted."""

    def apply(
        self, q: Tensor, k: Tensor, v: Tensor, options: AttentionOptions, backend: str = "auto"
    ) -> Tensor | AttentionOutput:
        """Refuse by name what it cannot serve (``ValueError``), else :meth:`serve`."""
        reasons = list(self.why_not(q, k, v, options))
        if reasons:
            raise ValueError(f"{self.name} cannot serve this call: " + "; ".join(reasons))
        return self.serve(q, k, v, options, backend)

    def __call__(
        self, q: Tensor, k: Tensor, v: Tensor, *, backend: str = "auto", **options: Any
    ) -> Tensor | AttentionOutput:
        return self.apply(q, k, v, AttentionOptions.of(**options), backend)


def call_attention_fn(
    fn: AttentionFn | OptionsAttention,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    options: AttentionOptions,
    backend: str,
) -> Tensor | AttentionOutput:
    """Call an attention function with the record: as it is for an :class:`OptionsAttention`, as keywords
    (every one, None-valued included) for any other function with :func:`multihead.attention`'s signature."""
    if isinstance(fn, OptionsAttention):
        return fn.apply(q, k, v, options, backend)
    return fn(q, k, v, backend=backend, **options.as_kwargs())
