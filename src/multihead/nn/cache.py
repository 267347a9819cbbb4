"""``KVCache``: keys and values kept between decoding steps.

Dimensions: B batch (beams included), Hkv key/value heads, L cached positions, Dk/Dv head dims.

One class serves every level of a model:

* a **dynamic** cache (the default) belongs to a self-attention: each call appends the step's keys and
  values, (B, Hkv, Lnew, D), and the attention then sees all L positions so far;
* a **static** cache (``static=True``) belongs to a cross-attention: the keys/values of the source are
  computed on the first call and reused unchanged on every later step;
* a cache may also hold named **children** (:meth:`child`): a decoder stack keeps one child per layer,
  a decoder layer one child per attention (``"self_attn"``, ``"cross_attn"``), so a single
  ``KVCache()`` passed to ``decoder(x_t, memory, cache=cache)`` serves the whole stack.

Beam search reorders every cached row with :meth:`reorder`. The cache holds tensors only; it never
imports the attention modules (data flows one way: attention -> cache).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor

__all__ = ["KVCache"]


class KVCache:
    """Keys (B, Hkv, L, Dk) and values (B, Hkv, L, Dv) of one attention, or named child caches.

    Args:
        static: ``False`` (self-attention): every :meth:`update` appends. ``True`` (cross-attention):
            the first :meth:`update` stores the keys/values and later calls must not change them; a
            :class:`~multihead.MultiHeadAttention` given a filled static cache skips the key/value
            projection altogether.

    Use::

        cache = KVCache()
        for t in range(T):
            y_t = mha(x[:, t : t + 1], cache=cache, causal=True)   # (B, 1, E); len(cache) == t + 1

    With ``causal=True`` the bottom-right rule makes the new query see every cached key and itself.
    Call :meth:`reset` (or make a new cache) before decoding another batch.
    """

    def __init__(self, *, static: bool = False) -> None:
        self.static = bool(static)
        self._k: Tensor | None = None  # (B, Hkv, L, Dk)
        self._v: Tensor | None = None  # (B, Hkv, L, Dv)
        self._children: dict[str, KVCache] = {}

    # -- inspection ---------------------------------------------------------------------------

    @property
    def keys(self) -> Tensor | None:
        """Cached keys (B, Hkv, L, Dk), or ``None`` while empty."""
        return self._k

    @property
    def values(self) -> Tensor | None:
        """Cached values (B, Hkv, L, Dv), or ``None`` while empty."""
        return self._v

    @property
    def is_empty(self) -> bool:
        """True when neither this cache nor any child holds tensors."""
        return self._k is None and all(c.is_empty for c in self._children.values())

    def __len__(self) -> int:
        """Positions decoded so far: L of this cache, else of its first non-empty dynamic descendant.

        For a decoder's cache this is the offset of the next step's position (what a positional encoding
        needs); 0 while empty.
        """
        if self._k is not None:
            return self._k.shape[2]
        for c in self._children.values():
            if not c.static and not c.is_empty:
                return len(c)
        return 0

    def __bool__(self) -> bool:  # an empty cache is still a cache: `if cache:` must not test emptiness
        return True

    def children(self) -> Iterator[tuple[str, KVCache]]:
        """The (name, child) pairs, in creation order."""
        return iter(self._children.items())

    def __repr__(self) -> str:
        kind = "static" if self.static else "dynamic"
        if self._k is not None:
            return f"KVCache({kind}, keys={tuple(self._k.shape)}, values={tuple(self._v.shape)})"  # type: ignore[union-attr]
        if self._children:
            return f"KVCache(children={list(self._children)}, len={len(self)})"
        return f"KVCache({kind}, empty)"

    # -- mutation -----------------------------------------------------------------------------

    def child(self, name: str, *, static: bool = False) -> KVCache:
        """The child cache ``name``, created (with ``static``) on first use."""
        c = self._children.get(name)
        if c is None:
            if self._k is not None:
                raise ValueError("this KVCache holds keys/values itself; it cannot also hold child caches")
            c = self._children[name] = KVCache(static=static)
        elif c.static != bool(static):
            raise ValueError(
                f"child cache {name!r} was created with static={c.static}, now requested with "
                f"static={bool(static)}; use one cache per attention kind"
            )
        return c

    def update(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Add this step's ``k`` (B, Hkv, Lnew, Dk) and ``v`` (B, Hkv, Lnew, Dv); return all keys/values.

        A dynamic cache returns (B, Hkv, L + Lnew, Dk) and (B, Hkv, L + Lnew, Dv). A static cache stores
        ``k``/``v`` once and returns them; updating a filled static cache is an error.
        """
        if self._children:
            raise ValueError(
                "this KVCache is a container of child caches (one per layer/attention); pass "
                "cache.child(name) to a single attention module"
            )
        if k.dim() != 4 or v.dim() != 4 or k.shape[:3] != v.shape[:3]:
            raise ValueError(
                f"k must be (B, Hkv, Lnew, Dk) and v (B, Hkv, Lnew, Dv) with shared B, Hkv, Lnew; got k "
                f"{tuple(k.shape)}, v {tuple(v.shape)}"
            )
        if self._k is None or self._v is None:
            self._k, self._v = k, v
            return k, v
        if self.static:
            raise ValueError(
                "this static (cross-attention) KVCache is already filled; it is reused as is. Call "
                "cache.reset() before attending to a new source"
            )
        ok, ov = self._k, self._v
        if k.shape[:2] != ok.shape[:2] or k.shape[3] != ok.shape[3] or v.shape[3] != ov.shape[3]:
            raise ValueError(
                f"new keys/values must match the cached (B, Hkv, *, D): cached keys {tuple(ok.shape)}, "
                f"values {tuple(ov.shape)}; got k {tuple(k.shape)}, v {tuple(v.shape)}. Did the batch "
                f"change? Call cache.reset() first"
            )
        if k.dtype != ok.dtype or k.device != ok.device:
            raise TypeError(
                f"new keys are {k.dtype} on {k.device} but the cache holds {ok.dtype} on {ok.device}; "
                f"keep one dtype/device per cache or call cache.reset()"
            )
        self._k = torch.cat([ok, k], dim=2)  # (B, Hkv, L + Lnew, Dk)
        self._v = torch.cat([ov, v], dim=2)  # (B, Hkv, L + Lnew, Dv)
        return self._k, self._v

    def reorder(self, indices: Tensor, *, include_static: bool = True) -> None:
        """Keep batch rows ``indices`` (B',) long, in that order, in this cache and every child.

        Beam search calls it after each step with the parent beam of every surviving beam. Static
        caches can be skipped (``include_static=False``) when every index stays within rows that hold
        the same source, as in beam search where the beams of one source share its keys/values.
        """
        if not isinstance(indices, Tensor) or indices.dim() != 1 or indices.is_floating_point():
            raise ValueError(
                f"indices must be a 1-D integer tensor (B',) of batch rows, got "
                f"{getattr(indices, 'shape', type(indices).__name__)}"
            )
        if self._k is not None and self._v is not None and (include_static or not self.static):
            idx = indices.to(self._k.device)
            self._k = self._k.index_select(0, idx)  # (B', Hkv, L, Dk)
            self._v = self._v.index_select(0, idx)  # (B', Hkv, L, Dv)
        for c in self._children.values():
            c.reorder(indices, include_static=include_static)

    def reset(self) -> None:
        """Forget every cached tensor (children are emptied, not removed)."""
        self._k = self._v = None
        for c in self._children.values():
            c.reset()
