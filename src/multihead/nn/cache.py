"""``KVCache``: keys and values kept between decoding steps, appended in place.

Dimensions: B batch (beams included), Hkv key/value heads, L cached positions, C capacity (L <= C),
Lnew positions added by one call, Dk/Dv head dims.

One class serves every level of a model:

* a **dynamic** cache (the default) belongs to a self-attention: each call writes the step's keys and
  values, (B, Hkv, Lnew, D), into preallocated storage (B, Hkv, C, D) and the attention then sees the
  first L positions, a view. The storage grows geometrically (capacity doubles when full), so a token
  costs amortised O(1) copies instead of a copy of the whole cache; with ``max_len`` it is allocated once
  at that size (static shapes for ``torch.compile`` and export) and a step past it raises;
* a **fixed-shape** cache (``fixed_shape=True``, with ``max_len``) is a dynamic cache whose every step has
  the same shapes: an update writes at positions kept in a device tensor and returns the whole storage
  (B, Hkv, max_len, D), and the attention hides the positions not yet written. Nothing is read on the
  host, so a decoding step can be captured once in a CUDA graph (``torch.compile(mode="reduce-overhead")``)
  and replayed for every token;
* a **static** cache (``static=True``) belongs to a cross-attention: the keys/values of the source are
  computed on the first call and reused unchanged on every later step;
* a cache may also hold named **children** (:meth:`~KVCache.child`): a decoder stack keeps one child per layer,
  a decoder layer one child per attention (``"self_attn"``, ``"cross_attn"``), so a single
  ``KVCache()`` passed to ``decoder(x_t, memory, cache=cache)`` serves the whole stack. Dynamic children
  inherit ``max_len``.

Beam search reorders every cached row with :meth:`~KVCache.reorder`; :meth:`~KVCache.reset` forgets the positions and keeps
the storage for the next batch. The cache holds tensors only; it never imports the attention modules
(data flows one way: attention -> cache).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor

from ..core.checks import is_tracing, positive_int

__all__ = ["KVCache"]

#: The smallest storage a dynamic cache without ``max_len`` allocates, in positions.
MIN_CAPACITY = 16


class KVCache:
    """Keys (B, Hkv, L, Dk) and values (B, Hkv, L, Dv) of one attention, or named child caches.

    Args:
        static: ``False`` (self-attention): every :meth:`update` appends. ``True`` (cross-attention):
            the first :meth:`update` stores the keys/values and later calls must not change them; a
            :class:`~multihead.MultiHeadAttention` given a filled static cache skips the key/value
            projection altogether.
        max_len: for a dynamic cache, the most positions it will ever hold: the storage
            (B, Hkv, max_len, D) is allocated once, at the first :meth:`update`, and an update past it
            raises a ``ValueError``. ``None`` (default): the storage starts at max(Lnew, 16) positions
            and doubles whenever it is full. Dynamic children (:meth:`~KVCache.child`) inherit it.
        fixed_shape: with ``max_len``, every :meth:`update` returns the whole storage (B, Hkv, max_len, D)
            and the filled length stays on the storage's device (:meth:`next_positions`); a
            :class:`~multihead.MultiHeadAttention` then masks the positions not yet written itself. Every
            step has the same shapes and reads nothing on the host: it can be captured in a CUDA graph.
            For decoding (no gradients). ``len(cache)`` reads the length on the host (a synchronisation on
            a GPU), and on a GPU a step past ``max_len`` is not checked (the check would read it too).
            Dynamic children inherit it.

    Use::

        cache = KVCache()
        for t in range(T):
            y_t = mha(x[:, t : t + 1], cache=cache, causal=True)   # (B, 1, E); len(cache) == t + 1

    With ``causal=True`` the bottom-right rule makes the new query see every cached key and itself.
    Call :meth:`~KVCache.reset` (or make a new cache) before decoding another batch.
    """

    def __init__(
        self, *, static: bool = False, max_len: int | None = None, fixed_shape: bool = False
    ) -> None:
        self.static = bool(static)
        self.max_len = None if max_len is None else positive_int("max_len", max_len)
        self.fixed_shape = bool(fixed_shape)
        if self.fixed_shape and (self.static or self.max_len is None):
            raise ValueError(
                f"fixed_shape=True needs max_len (the positions every step attends over) and static=False; "
                f"got max_len={max_len!r}, static={static!r}: build KVCache(max_len=N, fixed_shape=True)"
            )
        self._pos: Tensor | None = None  # fixed shape: (1,) int64, positions written, on the storage's device
        self._fresh = True  # fixed shape: no step since construction or reset() (the storage may change)
        # Dynamic: storage (B, Hkv, C, Dk) / (B, Hkv, C, Dv), positions [0, _len) are cached.
        # Static: the source's keys/values themselves, _len = their length.
        self._k: Tensor | None = None
        self._v: Tensor | None = None
        self._len = 0
        self._children: dict[str, KVCache] = {}

    # -- inspection ---------------------------------------------------------------------------

    @property
    def keys(self) -> Tensor | None:
        """Cached keys (B, Hkv, L, Dk) -- a view of the storage --, or ``None`` while empty."""
        if self._k is None or (not self.static and len(self) == 0):
            return None
        return self._k if self.static else self._k.narrow(2, 0, len(self))  # (B, Hkv, L, Dk)

    @property
    def values(self) -> Tensor | None:
        """Cached values (B, Hkv, L, Dv) -- a view of the storage --, or ``None`` while empty."""
        if self._v is None or (not self.static and len(self) == 0):
            return None
        return self._v if self.static else self._v.narrow(2, 0, len(self))  # (B, Hkv, L, Dv)

    @property
    def capacity(self) -> int:
        """C, the positions the current storage holds (0 before the first update); L <= C."""
        return 0 if self._k is None else self._k.shape[2]

    @property
    def is_empty(self) -> bool:
        """True when neither this cache nor any child holds positions."""
        return self.keys is None and all(c.is_empty for c in self._children.values())

    def __len__(self) -> int:
        """Positions decoded so far: L of this cache, else of its first non-empty dynamic descendant.

        For a decoder's cache this is the offset of the next step's position (what a positional encoding
        needs); 0 while empty.
        """
        if self._k is not None:
            return int(self._pos) if self._pos is not None else self._len  # fixed shape: read on the host
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
        keys, values = self.keys, self.values
        if keys is not None and values is not None:
            room = "" if self.static else f", capacity={self.capacity}"
            return f"KVCache({kind}, keys={tuple(keys.shape)}, values={tuple(values.shape)}{room})"
        if self._children:
            return f"KVCache(children={list(self._children)}, len={len(self)})"
        return f"KVCache({kind}, empty)"

    # -- mutation -----------------------------------------------------------------------------

    def child(self, name: str, *, static: bool = False) -> KVCache:
        """The child cache ``name``, created (with ``static``, and this cache's ``max_len``) on first use."""
        c = self._children.get(name)
        if c is None:
            if self._k is not None:
                raise ValueError("this KVCache holds keys/values itself; it cannot also hold child caches")
            fixed = {"fixed_shape": True} if self.fixed_shape and not static else {}
            c = self._children[name] = type(self)(
                static=static, max_len=None if static else self.max_len, **fixed
            )
        elif c.static != bool(static):
            raise ValueError(
                f"child cache {name!r} was created with static={c.static}, now requested with "
                f"static={bool(static)}; use one cache per attention kind"
            )
        return c

    def update(self, k: Tensor, v: Tensor, *, positions: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """Add this step's ``k`` (B, Hkv, Lnew, Dk) and ``v`` (B, Hkv, Lnew, Dv); return all keys/values.

        A dynamic cache copies ``k``/``v`` into its storage at positions [L, L + Lnew) and returns views
        (B, Hkv, L + Lnew, Dk) and (B, Hkv, L + Lnew, Dv) -- equal to ``torch.cat`` of everything
        appended so far, without copying what is already cached. A static cache stores ``k``/``v`` once
        and returns them; updating a filled static cache is an error. A fixed-shape cache writes at
        ``positions`` (Lnew,), what :meth:`next_positions` gave for this step when the caller already has
        them (else it computes them), and returns the whole storage.
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
        if self.static:
            if self._k is not None:
                raise ValueError(
                    "this static (cross-attention) KVCache is already filled; it is reused as is. Call "
                    "cache.reset() before attending to a new source"
                )
            self._k, self._v, self._len = k, v, k.shape[2]
            return k, v
        if self.fixed_shape:
            return self._write_fixed(k, v, positions)
        start, new = self._len, k.shape[2]
        if start == 0:
            self._allocate_for(k, v)
        else:
            self._check_step(k, v)
        end = start + new
        if self.max_len is not None and end > self.max_len:
            raise ValueError(
                f"this KVCache is full: it holds {start} of max_len={self.max_len} positions and this "
                f"step adds {new}; build it with KVCache(max_len=...) >= {end}, or call cache.reset() "
                f"before decoding a new sequence"
            )
        if torch.is_grad_enabled() and (k.requires_grad or v.requires_grad):
            return self._append_differentiable(k, v)
        if end > self.capacity:
            self._grow(end)
        ok, ov = self._k, self._v
        assert ok is not None and ov is not None
        ok.narrow(2, start, new).copy_(k)  # in place: only the new positions are written
        ov.narrow(2, start, new).copy_(v)
        self._len = end
        return ok.narrow(2, 0, end), ov.narrow(2, 0, end)  # (B, Hkv, L + Lnew, Dk), (B, Hkv, L + Lnew, Dv)

    def next_positions(self, new: int, device: torch.device) -> Tensor:
        """Fixed shape: the absolute positions (Lnew,) int64, on ``device``, that the next :meth:`update` of
        ``new`` positions writes -- computed on the device, never read on the host."""
        if not self.fixed_shape:
            raise ValueError("next_positions belongs to a KVCache(max_len=N, fixed_shape=True)")
        if self._pos is None or self._pos.device != torch.device(device):
            self._pos = torch.zeros(1, dtype=torch.int64, device=device)  # (1,)
            _static_address(self._pos)
        return self._pos + torch.arange(new, device=device)  # (Lnew,)

    def _write_fixed(self, k: Tensor, v: Tensor, at: Tensor | None) -> tuple[Tensor, Tensor]:
        """Fixed shape: write k/v (B, Hkv, Lnew, D) in place at ``at`` (Lnew,), :meth:`next_positions` unless
        given; return the whole storage (B, Hkv, max_len, Dk), (B, Hkv, max_len, Dv)."""
        if torch.is_grad_enabled() and (k.requires_grad or v.requires_grad):
            raise ValueError(
                "a fixed_shape KVCache is for decoding and keeps no gradients; run the steps under "
                "torch.no_grad(), or use KVCache(max_len=N) for differentiable steps"
            )
        new, cap = k.shape[2], self.max_len
        assert cap is not None
        at = self.next_positions(new, k.device) if at is None else at  # (Lnew,)
        if self._k is None or self._fresh:  # the first step since construction or reset()
            self._allocate_for(k, v)
            self._fresh = False
        else:
            self._check_step(k, v)
        if new > cap or (new and k.device.type == "cpu" and not is_tracing() and int(at[-1]) >= cap):
            raise ValueError(
                f"this KVCache is full: max_len={cap} positions and this step would write position "
                f"{int(at[-1]) if new else 0}; build it with a larger max_len, or call cache.reset()"
            )
        ok, ov = self._k, self._v
        assert ok is not None and ov is not None and self._pos is not None
        ok.index_copy_(2, at, k)
        ov.index_copy_(2, at, v)
        self._pos.add_(new)
        return ok, ov  # (B, Hkv, max_len, Dk), (B, Hkv, max_len, Dv)

    def _check_step(self, k: Tensor, v: Tensor) -> None:
        """New keys/values must continue the cached ones: same B, Hkv, head dims, dtype and device."""
        ok, ov = self._k, self._v
        assert ok is not None and ov is not None
        if k.shape[:2] != ok.shape[:2] or k.shape[3] != ok.shape[3] or v.shape[3] != ov.shape[3]:
            raise ValueError(
                f"new keys/values must match the cached (B, Hkv, *, D): cached keys "
                f"{tuple(ok.shape[:2]) + (self._len, ok.shape[3])}, values "
                f"{tuple(ov.shape[:2]) + (self._len, ov.shape[3])}; got k {tuple(k.shape)}, v "
                f"{tuple(v.shape)}. Did the batch change? Call cache.reset() first"
            )
        if k.dtype != ok.dtype or k.device != ok.device:
            raise TypeError(
                f"new keys are {k.dtype} on {k.device} but the cache holds {ok.dtype} on {ok.device}; "
                f"keep one dtype/device per cache or call cache.reset()"
            )

    def _allocate_for(self, k: Tensor, v: Tensor) -> None:
        """First update (or the first after :meth:`~KVCache.reset`): reuse the storage if it fits, else allocate."""
        ok, ov = self._k, self._v
        if (
            ok is not None
            and ov is not None
            and ok.shape[:2] == k.shape[:2]
            and ok.shape[3] == k.shape[3]
            and ov.shape[3] == v.shape[3]
            and ok.dtype == k.dtype
            and ok.device == k.device
        ):
            return
        cap = self.max_len if self.max_len is not None else max(k.shape[2], MIN_CAPACITY)
        b, hkv = k.shape[:2]
        if self.fixed_shape:  # the attention reads every position: zeros, never garbage (0 * NaN = NaN)
            self._k = k.new_zeros(b, hkv, cap, k.shape[3])  # (B, Hkv, max_len, Dk)
            self._v = v.new_zeros(b, hkv, cap, v.shape[3])  # (B, Hkv, max_len, Dv)
            _static_address(self._k)
            _static_address(self._v)
            return
        self._k = k.new_empty(b, hkv, cap, k.shape[3])  # (B, Hkv, C, Dk)
        self._v = v.new_empty(b, hkv, cap, v.shape[3])  # (B, Hkv, C, Dv)

    def _append_differentiable(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Keys/values that need gradients: new tensors (``torch.cat``), never writes into saved ones.

        Writing in place would change tensors that autograd saved for an earlier step's backward; the
        storage is then exactly L positions, and the next update without gradients grows it again.
        """
        n = self._len
        keys = k if n == 0 else torch.cat([self._k[:, :, :n], k], dim=2)  # type: ignore[index]
        values = v if n == 0 else torch.cat([self._v[:, :, :n], v], dim=2)  # type: ignore[index]
        self._k, self._v, self._len = keys, values, keys.shape[2]  # (B, Hkv, L + Lnew, D)
        return keys, values

    def _grow(self, needed: int) -> None:
        """Storage for at least ``needed`` positions: twice the capacity, or ``max_len`` if set."""
        ok, ov = self._k, self._v
        assert ok is not None and ov is not None
        cap = self.max_len if self.max_len is not None else max(needed, 2 * ok.shape[2])
        self._k = ok.new_empty(*ok.shape[:2], cap, ok.shape[3])  # (B, Hkv, C', Dk)
        self._v = ov.new_empty(*ov.shape[:2], cap, ov.shape[3])  # (B, Hkv, C', Dv)
        self._k[:, :, : self._len] = ok[:, :, : self._len]
        self._v[:, :, : self._len] = ov[:, :, : self._len]

    def reorder(self, indices: Tensor, *, include_static: bool = True) -> None:
        """Keep batch rows ``indices`` (B',) long, in that order, in this cache and every child.

        Beam search calls it after each step with the parent beam of every surviving beam. Only the L
        cached positions are gathered; when B' == B they are written back into the same storage.
        Static caches can be skipped (``include_static=False``) when every index stays within rows that
        hold the same source, as in beam search where the beams of one source share its keys/values.
        """
        if not isinstance(indices, Tensor) or indices.dim() != 1 or indices.is_floating_point():
            raise ValueError(
                f"indices must be a 1-D integer tensor (B',) of batch rows, got "
                f"{getattr(indices, 'shape', type(indices).__name__)}"
            )
        ok, ov = self._k, self._v
        if ok is not None and ov is not None and (include_static or not self.static):
            idx = indices.to(ok.device)
            if self.fixed_shape:  # the same storage, rows gathered in place: its address stays
                if idx.shape[0] != ok.shape[0]:
                    raise ValueError(
                        f"a fixed_shape KVCache keeps its batch size {ok.shape[0]}; got {idx.shape[0]} "
                        f"indices: reorder within the batch, or build a new cache"
                    )
                ok.copy_(ok.index_select(0, idx))
                ov.copy_(ov.index_select(0, idx))
            elif self.static or ok.requires_grad:  # new tensors: never rewrite what autograd may have saved
                n = ok.shape[2] if self.static else self._len
                self._k = ok[:, :, :n].index_select(0, idx)  # (B', Hkv, L, Dk)
                self._v = ov[:, :, :n].index_select(0, idx)  # (B', Hkv, L, Dv)
            elif idx.shape[0] != ok.shape[0]:  # a new batch size: new storage
                self._k = ok.new_empty(idx.shape[0], *ok.shape[1:])  # (B', Hkv, C, Dk)
                self._v = ov.new_empty(idx.shape[0], *ov.shape[1:])  # (B', Hkv, C, Dv)
                self._k[:, :, : self._len] = ok[:, :, : self._len].index_select(0, idx)
                self._v[:, :, : self._len] = ov[:, :, : self._len].index_select(0, idx)
            elif self._len:
                kept_k, kept_v = ok.narrow(2, 0, self._len), ov.narrow(2, 0, self._len)  # (B, Hkv, L, D)
                kept_k.copy_(kept_k.index_select(0, idx))  # gathered, then written back in place
                kept_v.copy_(kept_v.index_select(0, idx))
        for c in self._children.values():
            c.reorder(indices, include_static=include_static)

    def reset(self) -> None:
        """Forget every cached position (children are emptied, not removed).

        A dynamic cache keeps its storage: the next batch of the same (B, Hkv, D, dtype, device) reuses
        it without allocating. A static cache drops its source's keys/values.
        """
        self._len, self._fresh = 0, True
        if self._pos is not None:
            self._pos.zero_()  # in place: a captured graph keeps reading the same tensor
        if self.static:
            self._k = self._v = None
        for c in self._children.values():
            c.reset()


def _static_address(t: Tensor) -> None:
    """Tell ``torch.compile`` that ``t`` keeps its address across calls, so that a CUDA graph may write it
    in place (mode="reduce-overhead"), as it does a module's buffers."""
    mark = getattr(getattr(torch, "_dynamo", None), "mark_static_address", None)
    if mark is not None:
        mark(t)
