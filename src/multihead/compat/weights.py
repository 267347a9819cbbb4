"""Weight converters between the seeds' three projection weight formats and the library's.

Dimensions: E embed_dim (d_model), H heads, D head dim, Ek/Ev key/value input sizes, O output size.
All weights use torch's ``nn.Linear`` convention, (out_features, in_features); a Keras ``Dense`` kernel
is the transpose (``kernel.T``).

The library's layout (= ``torch.nn.MultiheadAttention``, see :mod:`multihead.attention`):
``in_proj_weight`` (3*H*D, E) with row blocks [q | k | v] (or ``q/k/v_proj_weight`` when the key/value
sizes differ), head ``i`` owning rows [i*D, (i+1)*D) of each block; ``out_proj.weight`` (O, H*D).

The seeds' formats:

* **shared** (seed 000, d2l 003/004): one Linear per q/k/v, (H*D, E), whose output is reshaped to
  (..., H, D). Head ``i`` owns rows [i*D, (i+1)*D): exactly the library's row blocks.
* **per_head** (seed 001): H separate Linear(E -> D) per q/k/v; head ``i`` is list entry ``i``.
* **fused** (seed 002): one Linear(E -> 3*H*D) whose output is reshaped to (..., H, 3*D) and split
  into q, k, v, so row ``h*3D + t*D + d`` is part ``t`` (q=0, k=1, v=2) of head ``h``. With H = 2,
  D = 1 the fused rows are ``q0 k0 v0 q1 k1 v1``; the library's are ``q0 q1 k0 k1 v0 v1``.

Each ``from_*`` returns a ``state_dict`` for :class:`multihead.MultiHeadAttention` (load it with
``load_state_dict`` or build the module with :func:`module_from_state`); each ``to_*`` goes back.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from ..nn.attention import MultiHeadAttention

__all__ = [
    "FusedWeights",
    "PerHeadWeights",
    "SharedWeights",
    "from_fused",
    "from_per_head",
    "from_shared",
    "module_from_state",
    "to_fused",
    "to_per_head",
    "to_shared",
]


class SharedWeights(NamedTuple):
    """Seed 000 / d2l: ``w_q`` (H*D, E), ``w_k`` (H*D, Ek), ``w_v`` (H*Dv, Ev), ``w_o`` (O, H*Dv), biases."""

    w_q: Tensor
    w_k: Tensor
    w_v: Tensor
    w_o: Tensor
    b_q: Tensor | None = None
    b_k: Tensor | None = None
    b_v: Tensor | None = None
    b_o: Tensor | None = None


class PerHeadWeights(NamedTuple):
    """Seed 001: per-head lists ``w_q[i]`` (D, E), ``w_k[i]`` (D, Ek), ``w_v[i]`` (Dv, Ev); ``w_o`` (O, H*Dv)."""

    w_q: Sequence[Tensor]
    w_k: Sequence[Tensor]
    w_v: Sequence[Tensor]
    w_o: Tensor
    b_q: Sequence[Tensor] | None = None
    b_k: Sequence[Tensor] | None = None
    b_v: Sequence[Tensor] | None = None
    b_o: Tensor | None = None


class FusedWeights(NamedTuple):
    """Seed 002: ``w_qkv`` (3*H*D, E) interleaved per head, ``w_o`` (O, H*D), biases."""

    w_qkv: Tensor
    w_o: Tensor
    b_qkv: Tensor | None = None
    b_o: Tensor | None = None


def _state(
    wq: Tensor,
    wk: Tensor,
    wv: Tensor,
    wo: Tensor,
    bq: Tensor | None,
    bk: Tensor | None,
    bv: Tensor | None,
    bo: Tensor | None,
) -> dict[str, Tensor]:
    """The library's state_dict from separate q/k/v/out weights (missing biases of a biased set -> 0)."""
    if wq.shape[0] != wk.shape[0]:
        raise ValueError(
            f"query and key projections must have the same output size H*D, got w_q {tuple(wq.shape)} "
            f"and w_k {tuple(wk.shape)}"
        )
    if wo.shape[1] != wv.shape[0]:
        raise ValueError(
            f"w_o (O, H*Dv) must take the value projection's output, got w_o {tuple(wo.shape)} and "
            f"w_v {tuple(wv.shape)}"
        )
    state: dict[str, Tensor] = {}
    e = wq.shape[1]
    if wk.shape[1] == e and wv.shape[1] == e:
        state["in_proj_weight"] = torch.cat([wq, wk, wv])  # (Nq+Nk+Nv, E)
    else:
        state.update(q_proj_weight=wq, k_proj_weight=wk, v_proj_weight=wv)
    biases = (bq, bk, bv, bo)
    if any(b is not None for b in biases):
        zq, zk, zv = (b if b is not None else wq.new_zeros(w.shape[0]) for b, w in zip(biases, (wq, wk, wv)))
        state["in_proj_bias"] = torch.cat([zq, zk, zv])  # (Nq+Nk+Nv,)
        state["out_proj.bias"] = bo if bo is not None else wo.new_zeros(wo.shape[0])
    state["out_proj.weight"] = wo
    return state


def _split_state(state: Mapping[str, Tensor]) -> SharedWeights:
    """The library's state_dict back to separate q/k/v/out weights (the shared layout)."""
    if "in_proj_weight" in state:
        w = state["in_proj_weight"]
        nv = state["out_proj.weight"].shape[1]  # H*Dv
        if (w.shape[0] - nv) % 2:
            raise ValueError(
                f"in_proj_weight {tuple(w.shape)} is not [q | k | v] with equal q and k sizes (value size "
                f"{nv}); convert a grouped-query module's weights with its proj_weights() instead"
            )
        nq = (w.shape[0] - nv) // 2
        wq, wk, wv = w.split([nq, nq, nv])
    else:
        wq, wk, wv = state["q_proj_weight"], state["k_proj_weight"], state["v_proj_weight"]
    bq = bk = bv = bo = None
    if "in_proj_bias" in state:
        bq, bk, bv = state["in_proj_bias"].split([wq.shape[0], wk.shape[0], wv.shape[0]])
        bo = state.get("out_proj.bias")
    return SharedWeights(wq, wk, wv, state["out_proj.weight"], bq, bk, bv, bo)


def from_shared(w: SharedWeights) -> dict[str, Tensor]:
    """Seed 000 / d2l weights (one Linear per q/k/v, split into heads by reshape) -> library state_dict."""
    return _state(*w)


def to_shared(state: Mapping[str, Tensor]) -> SharedWeights:
    """Library state_dict -> one (H*D, E) matrix per q/k/v plus the output projection."""
    return _split_state(state)


def from_per_head(w: PerHeadWeights) -> dict[str, Tensor]:
    """Seed 001 weights (H Linear(E -> D) per q/k/v) -> library state_dict: heads stacked in order."""

    def cat(parts: Sequence[Tensor] | None) -> Tensor | None:
        return None if parts is None else torch.cat(list(parts))  # (H*D, ...)

    wq, wk, wv = cat(w.w_q), cat(w.w_k), cat(w.w_v)
    assert wq is not None and wk is not None and wv is not None
    return _state(wq, wk, wv, w.w_o, cat(w.b_q), cat(w.b_k), cat(w.b_v), w.b_o)


def to_per_head(state: Mapping[str, Tensor], num_heads: int) -> PerHeadWeights:
    """Library state_dict -> per-head lists of (D, E) weights (and (D,) biases)."""
    s = _split_state(state)

    def chunks(t: Tensor | None) -> list[Tensor] | None:
        return None if t is None else list(t.chunk(num_heads))  # H x (D, ...)

    wq, wk, wv = chunks(s.w_q), chunks(s.w_k), chunks(s.w_v)
    assert wq is not None and wk is not None and wv is not None
    return PerHeadWeights(wq, wk, wv, s.w_o, chunks(s.b_q), chunks(s.b_k), chunks(s.b_v), s.b_o)


def _deinterleave(t: Tensor, num_heads: int) -> Tensor:
    """Fused rows (H, 3, D, ...) -> library rows (3, H, D, ...)."""
    rest = t.shape[1:]
    return t.reshape(num_heads, 3, -1, *rest).transpose(0, 1).reshape(t.shape)  # (3*H*D, ...)


def _interleave(t: Tensor, num_heads: int) -> Tensor:
    """Library rows (3, H, D, ...) -> fused rows (H, 3, D, ...)."""
    rest = t.shape[1:]
    return t.reshape(3, num_heads, -1, *rest).transpose(0, 1).reshape(t.shape)  # (3*H*D, ...)


def from_fused(w: FusedWeights, num_heads: int) -> dict[str, Tensor]:
    """Seed 002 weights (one Linear(E -> 3*H*D), per-head [q k v] interleaving) -> library state_dict."""
    if w.w_qkv.shape[0] % (3 * num_heads):
        raise ValueError(
            f"w_qkv has {w.w_qkv.shape[0]} rows, not a multiple of 3 * num_heads = {3 * num_heads}"
        )
    wq, wk, wv = _deinterleave(w.w_qkv, num_heads).chunk(3)
    bq = bk = bv = None
    if w.b_qkv is not None:
        bq, bk, bv = _deinterleave(w.b_qkv, num_heads).chunk(3)
    return _state(wq, wk, wv, w.w_o, bq, bk, bv, w.b_o)


def to_fused(state: Mapping[str, Tensor], num_heads: int) -> FusedWeights:
    """Library state_dict -> seed 002's fused, per-head interleaved (3*H*D, E) weight."""
    s = _split_state(state)
    w = _interleave(torch.cat([s.w_q, s.w_k, s.w_v]), num_heads)  # (3*H*D, E)
    b = None if s.b_q is None else _interleave(torch.cat([s.b_q, s.b_k, s.b_v]), num_heads)  # type: ignore[list-item]
    return FusedWeights(w, s.w_o, b, s.b_o)


def module_from_state(state: Mapping[str, Tensor], num_heads: int) -> MultiHeadAttention:
    """A :class:`MultiHeadAttention` sized for ``state`` (from any ``from_*``) with those weights loaded."""
    s = _split_state(state)
    hd, e = s.w_q.shape
    if hd % num_heads or s.w_v.shape[0] % num_heads:
        raise ValueError(
            f"projection sizes {hd} and {s.w_v.shape[0]} must be divisible by num_heads={num_heads}"
        )
    ref = s.w_o
    m = MultiHeadAttention(
        e,
        num_heads,
        kdim=s.w_k.shape[1],
        vdim=s.w_v.shape[1],
        head_dim=hd // num_heads,
        v_head_dim=s.w_v.shape[0] // num_heads,
        out_dim=s.w_o.shape[0],
        bias=s.b_q is not None,
        device=ref.device,
        dtype=ref.dtype,
    )
    m.load_state_dict(dict(state), strict=True)
    return m
