"""The drop-in's checks of a forward call, in the order torch.nn.MultiheadAttention (torch 2.13) makes them,
each raising an error that is also of the class torch raises for that mistake (see :mod:`.boundary`).

Dimensions: N batch, L target (query) length, S source (key) length, E embed_dim.

torch's order: the masks' types (``torch.is_floating_point(attn_mask)``: ``TypeError``), the inputs' attributes
(``query.dim()``: ``AttributeError``), the masks' dtypes and the ranks (``AssertionError``), ``embed_dim``,
key against value (``AssertionError``), the projections (``RuntimeError`` for a dtype, or a batch or feature
size they cannot take), the shape of ``attn_mask`` (``RuntimeError``) and of ``key_padding_mask``
(``AssertionError``). On its fused inference path (eval, no grad, ``batch_first``, one tensor as query, key and
value) the native kernel reports the ranks of the masks, the shape of ``key_padding_mask`` and ``embed_dim``
as ``RuntimeError`` instead: those errors are :class:`~.boundary.FastPathShapeError`, both.
"""

from __future__ import annotations

from typing import Protocol

from torch import Tensor

from .boundary import (
    FastPathShapeError,
    MultiheadAttentionError,
    MultiheadAttentionRuntimeError,
    NotATensorError,
    _shape,
    _torch_says,
)

__all__ = ["check_call", "check_key_and_value"]


class _Sizes(Protocol):
    embed_dim: int
    num_heads: int
    kdim: int
    vdim: int
    batch_first: bool


def _check_types(query: object, key: object, value: object, kpm: object, attn_mask: object) -> None:
    """Tensors where torch needs them: a mask that is not one is a ``TypeError`` (torch's
    ``is_floating_point`` raises it), a query, key or value a :class:`NotATensorError` (torch reads
    ``.dim()`` or ``.is_nested`` of it: ``AttributeError``)."""
    for name, m in (("attn_mask", attn_mask), ("key_padding_mask", kpm)):
        if m is not None and not isinstance(m, Tensor):
            raise TypeError(
                f"{name} must be a torch.Tensor (bool: True = masked out; or float: added to the scores) or "
                f"None, got {type(m).__name__}; convert it with torch.as_tensor({name}, dtype=torch.bool)"
            )
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, Tensor):
            raise NotATensorError(
                f"{name} must be a torch.Tensor, got {type(t).__name__}; convert it with torch.as_tensor({name})"
            )


def check_call(
    m: _Sizes, query: Tensor, key: Tensor, value: Tensor, kpm: Tensor | None, attn_mask: Tensor | None
) -> bool:
    """Validate types, ranks and ``embed_dim`` like torch's ``forward`` and ``_mha_shape_check`` (with their
    texts); return whether the call is batched."""
    _check_types(query, key, value, kpm, attn_mask)
    if query.dim() not in (2, 3):
        raise _torch_says(
            f"query should be unbatched 2D or batched 3D tensor but received {query.dim()}-D query tensor",
            "Pass query (L, N, E) ((N, L, E) with batch_first=True) or unbatched (L, E)",
        )
    batched = query.dim() == 3
    kind, rank = ("batched (3-D)", 3) if batched else ("unbatched (2-D)", 2)
    if key.dim() != rank or value.dim() != rank:
        raise _torch_says(
            f"For {kind} `query`, expected `key` and `value` to be {rank}-D but found {key.dim()}-D and "
            f"{value.dim()}-D tensors respectively",
            f"Give key and value the query's rank: query {_shape(query)}, key {_shape(key)}, value {_shape(value)}",
        )
    if kpm is not None and kpm.dim() != rank - 1:
        raise _torch_says(
            f"For {kind} `query`, expected `key_padding_mask` to be `None` or {rank - 1}-D but found "
            f"{kpm.dim()}-D tensor instead",
            f"key_padding_mask is {'(N, S)' if batched else '(S,)'}, True = padding; got {_shape(kpm)}",
            FastPathShapeError,
        )
    if attn_mask is not None:
        _check_attn_mask_rank(m, query, key, attn_mask, batched)
    if not query.is_nested and query.shape[-1] != m.embed_dim:
        raise _torch_says(
            f"was expecting embedding dimension of {m.embed_dim}, but got {query.shape[-1]}",
            f"query's last dim is embed_dim; got query {_shape(query)}",
            FastPathShapeError,
        )
    return batched


def _check_attn_mask_rank(m: _Sizes, query: Tensor, key: Tensor, attn_mask: Tensor, batched: bool) -> None:
    """2-D or 3-D; unbatched and 3-D, its shape too (torch checks that one with the ranks: ``AssertionError``)."""
    kind = "batched (3-D)" if batched else "unbatched (2-D)"
    if attn_mask.dim() not in (2, 3):
        raise _torch_says(
            f"For {kind} `query`, expected `attn_mask` to be `None`, 2-D or 3-D but found "
            f"{attn_mask.dim()}-D tensor instead",
            f"attn_mask is (L, S) or {'(N*num_heads, L, S)' if batched else '(num_heads, L, S)'}; got "
            f"{_shape(attn_mask)}",
            FastPathShapeError,
        )
    if not batched and attn_mask.dim() == 3:
        want = (m.num_heads, query.shape[0], key.shape[0])
        if tuple(attn_mask.shape) != want:
            raise _torch_says(
                f"Expected `attn_mask` shape to be {want} but got {tuple(attn_mask.shape)}",
                f"A 3-D attn_mask of an unbatched query is (num_heads, L, S) with L = {want[1]}, S = {want[2]}",
            )


def _nse(t: Tensor, batched: bool, batch_first: bool) -> tuple[int, int, int]:
    """(N, length, features) of a dense query, key or value in the caller's layout (unbatched: N = 1)."""
    if not batched:
        return 1, t.shape[0], t.shape[1]
    n, length = (t.shape[0], t.shape[1]) if batch_first else (t.shape[1], t.shape[0])
    return n, length, t.shape[2]


def check_key_and_value(m: _Sizes, query: Tensor, key: Tensor, value: Tensor, batched: bool) -> None:
    """Key against value, then key and value against the projections and the query's batch, as torch's
    ``multi_head_attention_forward`` finds them (dense tensors in the caller's layout; ranks checked)."""
    (n, _, _), (nk, sk, ek), (nv, sv, ev) = (_nse(t, batched, m.batch_first) for t in (query, key, value))
    packed = m.kdim == m.vdim == m.embed_dim  # torch's _qkv_same_embed_dim: one in_proj_weight
    if (nk, sk) != (nv, sv) or (packed and ek != ev):
        raise _torch_says(
            f"key shape {tuple(key.shape)} does not match value shape {tuple(value.shape)}",
            "key and value hold one vector per source position: the same batch size N and length S"
            + (", and here (kdim == vdim) the same feature size" if packed else ""),
        )
    if ek != m.kdim or ev != m.vdim:
        # packed: key and value pass through one (3E, E) projection, whose matmul refuses them (RuntimeError);
        # separate q/k/v weights: torch asserts each weight's shape against its input first (AssertionError)
        raise _torch_says(
            f"expected key features kdim = {m.kdim} and value features vdim = {m.vdim}, got key "
            f"{tuple(key.shape)} and value {tuple(value.shape)}",
            "the last dim of key is kdim and of value vdim (the module's constructor arguments; default "
            "embed_dim)",
            MultiheadAttentionRuntimeError if packed else MultiheadAttentionError,
        )
    if nk != n:
        raise _torch_says(
            f"expected key and value of the query's batch size N = {n}, got {nk} (query {tuple(query.shape)}, "
            f"key {tuple(key.shape)})",
            f"query, key and value are {'(N, L, E)' if m.batch_first else '(L, N, E)'} with one N",
            MultiheadAttentionRuntimeError,
        )
