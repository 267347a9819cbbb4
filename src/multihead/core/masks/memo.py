"""A mask function's values on partial tiles, kept with the tile structure across layers and calls.

Dimensions: B batch, H heads, n queries and w keys of a tile.

A block-skipping backend evaluates the mask function only on the tiles its structure calls partial
(:mod:`.blocks`). Those values are the same in every layer and call that uses the function on the same
grid, and for the masks people write -- sliding windows, chunks, a causal diagonal -- most partial tiles
even hold the same values as one another: a two-sided window of 512 at L = 16,384 has 128 partial spans
and two distinct ones. :class:`TileMemo` keeps them: per tile (by its place), the bool values, stored once
per distinct content, within a byte budget (a function whose tiles are all different keeps the first ones
and is evaluated on the rest as before).

Why: the function's own temporaries (``q_idx - kv_idx`` in int64, its ``abs``), allocated and freed on
every partial tile of every call, were the largest thing a sliding window's call held beside its output
(1 MiB at 256 x 256 tiles; the unmasked call holds 1.06 MiB in all at L = 16,384), and evaluating them
took 7-15% of the window's time. Served from the memo, a call evaluates nothing (docs/performance.md).

Validity: the memo belongs to one :class:`~.blocks.Blocks`, which is rebuilt when a tensor the function
closes over or reads as a global changes in place (:func:`~.blocks.captured_versions`); the memo also checks those versions of
the function it serves on every call (:meth:`TileMemo.serve`), since a user-built block mask outlives them.
Values are shared between tiles and calls: callers never write into what :meth:`TileMemo.keep` returns.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Hashable

import torch
from torch import Tensor

__all__ = ["MEMO_BYTES", "TOTAL_BYTES", "TileMemo"]

MEMO_BYTES = 1 << 20
"""Bytes of distinct tile values one structure keeps (a 256 x 256 bool tile: 64 KiB; a sliding window's two
distinct edges, at any length: 128 KiB)."""

TOTAL_BYTES = 16 << 20
"""Bytes of tile values all live memos together keep: past it, new tiles are evaluated and not kept."""


class _Total:
    """The bytes held by every live memo (released when a memo is collected)."""

    def __init__(self) -> None:
        self.nbytes = 0
        self.lock = threading.Lock()

    def take(self, n: int) -> bool:
        with self.lock:
            if self.nbytes + n > TOTAL_BYTES:
                return False
            self.nbytes += n
            return True

    def give(self, n: int) -> None:
        with self.lock:
            self.nbytes -= n


_TOTAL = _Total()


def _fingerprint(value: Tensor) -> tuple:
    """A cheap content key of a bool tensor: its shape and the count of True in each row (equal contents,
    equal keys; values with equal keys are compared whole)."""
    rows = value.reshape(-1, value.shape[-1]).sum(-1, dtype=torch.int32)  # (B*H*n,) or fewer
    return tuple(value.shape), value.device, tuple(rows.tolist())


class TileMemo:
    """Values of a mask function on tiles, by the tile's place, each distinct value stored once."""

    def __init__(self, budget: int | None = None) -> None:
        self.budget = MEMO_BYTES if budget is None else budget
        self.nbytes = 0
        self.full = False
        self._at: dict[Hashable, Tensor] = {}
        self._distinct: dict[tuple, list[Tensor]] = {}
        self._versions: dict[int, tuple] = {}
        self._lock = threading.Lock()
        self._held = [0]  # bytes taken from the process-wide total, given back when the memo is collected
        weakref.finalize(self, _release, self._held)

    def __reduce__(self) -> tuple:
        """Copied or pickled (a module holding a block mask, ``copy.deepcopy(model)``): a new, empty memo."""
        return TileMemo, (self.budget,)

    def serve(self, fn: object, versions: tuple) -> None:
        """Forget the tiles of ``fn`` if the tensors it closes over changed since they were kept."""
        with self._lock:
            if self._versions.get(id(fn), versions) != versions:
                self._at = {k: t for k, t in self._at.items() if k[0] != id(fn)}
            self._versions[id(fn)] = versions

    def keep(self, fn: object, place: Hashable, evaluate: Callable[[], Tensor]) -> Tensor:
        """``fn``'s bool values on the tile at ``place``: kept ones, or ``evaluate()`` (kept if it fits)."""
        key = (id(fn), place)
        hit = self._at.get(key)
        if hit is not None:
            return hit
        value = evaluate()
        if self.full or value.dtype != torch.bool or value.requires_grad:
            return value
        with self._lock:
            stored = self._intern(value)
            if stored is not None:
                self._at[key] = stored
        return value if stored is None else stored

    def _take(self, n: int) -> bool:
        if self.nbytes + n > self.budget or not _TOTAL.take(n):
            self.full = True  # from now on every miss is evaluated and nothing more is looked at
            return False
        self.nbytes += n
        self._held[0] += n
        return True

    def _intern(self, value: Tensor) -> Tensor | None:
        """The stored tensor equal to ``value`` (storing it if the budgets allow), or ``None``."""
        fp = _fingerprint(value)
        same = self._distinct.setdefault(fp, [])
        for t in same:
            if torch.equal(t, value):
                return t
        if not self._take(value.numel() * value.element_size()):
            return None
        same.append(value)
        return value

    def __len__(self) -> int:
        return len(self._at)

    @property
    def distinct(self) -> int:
        """How many distinct tile values are stored."""
        return sum(len(v) for v in self._distinct.values())


def _release(held: list[int]) -> None:
    _TOTAL.give(held[0])
