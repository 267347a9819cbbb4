"""Block structure of a mask: which tiles of queries x keys are empty, partial or full.

Dimensions: B batch, H heads, Lq/Lk lengths, bq/bk a tile's queries/keys, nq = ceil(Lq / bq) and
nk = ceil(Lk / bk) tiles.

A block-skipping backend computes only the tiles a mask allows something in, runs the tiles it allows
everything in with no mask at all, and evaluates the mask function only inside the others. Three sources:

* a FlexAttention ``BlockMask`` passed as ``mask=`` (:func:`from_flex`): its block structure is part of
  its meaning -- blocks it lists as full take no mask, blocks it does not list are never attended, and
  its ``mask_mod`` decides inside the partial ones -- exactly what ``flex_attention`` computes;
* :func:`block_mask` ``(fn, lq, lk)``: built once by the user and passed to every layer;
* any mask function, plain lambdas included (:func:`structure`): bounded over whole tiles by interval
  arithmetic (:mod:`.ranges`; a few operations on (nq, nk) tensors) and cached per function object and
  shape, so the layers and calls of a forward pass reuse it.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..checks import is_int, is_tracing
from .dense import index_grid
from .evaluate import call_fn, how_to_call
from .functions import MaskFn, MaskFunction, check_callable, fn_name
from .memo import TileMemo
from .ranges import tile_bounds

__all__ = [
    "BlockMaskFunction",
    "Blocks",
    "block_mask",
    "Recent",
    "captured_versions",
    "from_flex",
    "is_flex_block_mask",
    "refine",
    "segment_tiles",
    "structure",
]


@dataclass(frozen=True)
class Blocks:
    """Tiles of ``block_q`` queries x ``block_k`` keys over an (Lq, Lk) grid, for every batch row and head:
    ``allowed`` (nq, nk) bool -- some pair of the tile may be allowed (the tile is computed); ``full``
    (nq, nk) bool -- every pair is allowed (the tile is computed with no mask). A tile that is neither is
    empty; one that is allowed and not full is partial (the mask function decides inside it). ``memo``:
    the function's values on the partial tiles, kept across layers and calls (:mod:`.memo`)."""

    block_q: int
    block_k: int
    lq: int
    lk: int
    allowed: Tensor
    full: Tensor
    batch: int = 1  # the B and H it was built for: 1 = the same for every batch row / head
    heads: int = 1
    memo: TileMemo = field(default_factory=TileMemo, compare=False, repr=False)  # partial tiles' values

    def check(self, target: tuple[int, int, int, int]) -> None:
        """A ``ValueError`` unless this structure was built for the call ``target`` (B, H, Lq, Lk)."""
        b, h, lq, lk = target
        if (self.lq, self.lk) != (lq, lk) or self.batch not in (1, b) or self.heads not in (1, h):
            raise ValueError(
                f"mask: the block mask was built for (B, H, Lq, Lk) = ({self.batch}, {self.heads}, {self.lq}, "
                f"{self.lk}) but the call has {target}; build it for this call's lengths "
                f"(multihead.masks.block_mask(fn, {lq}, {lk}) or create_block_mask(mask_mod, B, H, {lq}, {lk}))"
            )

    def key_range(self, q0: int, q1: int) -> tuple[int, int]:
        """Keys [k0, k1) outside which the queries q0:q1 see nothing (their rows' first and last allowed
        tiles)."""
        rows = self.allowed[q0 // self.block_q : (q1 - 1) // self.block_q + 1].any(0)  # (nk,)
        cols = rows.nonzero()
        if cols.numel() == 0:
            return 0, 0
        return int(cols[0]) * self.block_k, min(self.lk, (int(cols[-1]) + 1) * self.block_k)


class BlockMaskFunction(MaskFunction):
    """A mask function with its block structure: ``fn(b, h, q_idx, kv_idx)`` is what it allows everywhere;
    ``blocks`` the structure a block-skipping backend follows; ``inner`` the function that decides inside a
    tile the structure calls partial (for a FlexAttention ``BlockMask``: its ``mask_mod``; else ``fn``);
    ``source``: the FlexAttention ``BlockMask`` it was made from, or ``None``."""

    def __init__(
        self,
        fn: MaskFn,
        blocks: Blocks,
        inner: MaskFn | None = None,
        name: str | None = None,
        source: object | None = None,
    ) -> None:
        super().__init__(fn, name, blocks.key_range)
        self.blocks = blocks
        self.inner = fn if inner is None else inner
        self.source = source


def _table(num: Tensor, idx: Tensor, nk: int) -> Tensor:
    """A BlockMask's (B, H, nq) counts and (B, H, nq, K) block indices -> (B, H, nq, nk) bool."""
    listed = torch.arange(idx.shape[-1], device=idx.device) < num[..., None].long()  # (B, H, nq, K)
    out = torch.zeros(*idx.shape[:-1], nk + 1, dtype=torch.bool, device=idx.device)  # a spare column
    return out.scatter_(-1, torch.where(listed, idx.long(), nk), True)[..., :nk]  # (B, H, nq, nk)


def is_flex_block_mask(x: object) -> bool:
    """Whether ``x`` is a ``torch.nn.attention.flex_attention.BlockMask`` (without importing it needlessly)."""
    cls = type(x)
    return cls.__name__ == "BlockMask" and cls.__module__.startswith("torch.nn.attention.flex_attention")


class Recent:
    """The last ``size`` values built, by key, the most recently used kept. Each entry also holds the
    objects its key names by ``id`` (``alive``), so that no id in a kept key can be reused by another object."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._entries: dict[Hashable, tuple[object, object]] = {}

    def get(self, key: Hashable, build: Callable[[], object], alive: object) -> object:
        """The value kept for ``key``, or ``build()`` kept for it (evicting the least recently used)."""
        hit = self._entries.pop(key, None)  # popped and put back: the most recent last
        value = build() if hit is None else hit[1]
        self._entries[key] = (alive, value)
        while len(self._entries) > self.size:
            del self._entries[next(iter(self._entries))]
        return value


#: The last BlockMasks converted, by (id, target, and what it holds: its mask_mod and its tables, with
#: their versions): a BlockMask is built once and passed to every layer of every call, so converting it
#: once spares each later call the host copies (a synchronisation on a GPU) and the probe of a new
#: function. Bounded: it keeps 8 BlockMasks alive.
_FROM_FLEX = Recent(8)


def from_flex(block_mask: object, target: tuple[int, int, int, int]) -> BlockMaskFunction:
    """A FlexAttention ``BlockMask`` as a mask function with its block structure, for the call ``target``
    (B, H, Lq, Lk): query ``i`` of row ``b``, head ``h`` sees key ``j`` when ``(i, j)`` lies in a block the
    mask lists as full, or in one it lists as partial and ``mask_mod(b, h, i, j)`` is true -- what
    ``flex_attention(..., block_mask=block_mask)`` computes. Converted once per BlockMask and call shape
    (the last few are kept), outside tracing."""
    if is_tracing():
        return _from_flex(block_mask, target)
    bm = block_mask
    tables = (bm.kv_num_blocks, bm.kv_indices, bm.full_kv_num_blocks, bm.full_kv_indices)  # type: ignore[attr-defined]
    mask_mod = bm.mask_mod  # type: ignore[attr-defined]
    key = (
        id(bm),
        target,
        id(mask_mod),  # a mask_mod set on the BlockMask later (as torch's slicing asks) is a new one
        tuple(None if t is None else (id(t), t._version) for t in tables),  # tables changed or replaced
    )  # (the mask_mod itself runs live: what it reads may change)
    return _FROM_FLEX.get(key, lambda: _from_flex(bm, target), (bm, mask_mod, tables))  # type: ignore[return-value]


def _from_flex(block_mask: object, target: tuple[int, int, int, int]) -> BlockMaskFunction:
    bm = block_mask
    b, h, lq, lk = target
    bq, bk = (int(s) for s in bm.BLOCK_SIZE)  # type: ignore[attr-defined]
    nk = -(-lk // bk)
    partial = _table(bm.kv_num_blocks, bm.kv_indices, nk)  # type: ignore[attr-defined]
    full = (
        torch.zeros_like(partial)
        if bm.full_kv_num_blocks is None  # type: ignore[attr-defined]
        else _table(bm.full_kv_num_blocks, bm.full_kv_indices, nk)  # type: ignore[attr-defined]
    )
    mb, mh = partial.shape[:2]
    Blocks(bq, bk, *(int(n) for n in bm.seq_lengths), partial, full, mb, mh).check(target)  # type: ignore[attr-defined]
    mask_mod = bm.mask_mod  # type: ignore[attr-defined]
    partial, full = partial.cpu(), full.cpu()

    def block_mask(bi: Tensor, hi: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        at = (
            bi if mb != 1 else 0,
            hi if mh != 1 else 0,
            q_idx // bq,
            kv_idx // bk,
        )  # (B = 0: indexed as given)
        p, f = partial.to(q_idx.device)[at], full.to(q_idx.device)[at]
        return f | (p & mask_mod(bi, hi, q_idx, kv_idx))

    allowed_any = (partial | full).flatten(0, 1).any(0)  # (nq, nk)
    full_all = full.flatten(0, 1).all(0) & ~(partial.flatten(0, 1).any(0))  # full for every (b, h)
    blocks = Blocks(bq, bk, lq, lk, allowed_any, full_all, mb, mh)
    uniform = mb == 1 and mh == 1  # then a tile the structure calls partial is partial for every (b, h)
    return BlockMaskFunction(
        block_mask, blocks, mask_mod if uniform else None, f"BlockMask({fn_name(mask_mod)})", bm
    )


def _id_ranges(ids: Tensor, size: int) -> tuple[Tensor, Tensor, Tensor]:
    """Per tile of ``size`` positions of ``ids`` (B, L): the smallest and largest id >= 0 (B, n) (``lo >
    hi`` where the tile has none), and whether every position of the tile holds the one same id >= 0."""
    b, length = ids.shape
    n = -(-length // size)
    pad = n * size - length
    padded = torch.nn.functional.pad(ids, (0, pad), value=-1).view(b, n, size)  # (B, n, size)
    valid = padded >= 0
    big = torch.iinfo(ids.dtype).max
    lo = torch.where(valid, padded, big).amin(-1)  # (B, n)
    hi = torch.where(valid, padded, -1).amax(-1)  # (B, n)
    return lo, hi, valid.all(-1) & (lo == hi)


def segment_tiles(
    q_ids: Tensor, kv_ids: Tensor, causal_offset: int | None, block_q: int, block_k: int
) -> tuple[Tensor, Tensor]:
    """``(partial, full)`` (B, nq, nk) bool tiles of packed documents, straight from the ids with no
    (Lq, Lk) pass: query ``i`` of row ``b`` sees key ``j`` when ``q_ids[b, i] == kv_ids[b, j] >= 0`` (and
    ``j <= i + causal_offset`` unless that is None). A tile is full when its queries and keys all hold the
    one same id (and causality allows every pair); it is listed partial when the id ranges of its queries
    and keys overlap and it is not full -- exact for ids that never decrease along a row (packing), a
    superset otherwise (the mask function then decides inside). A tile past the end of a sequence is never
    full, as ``create_block_mask`` pads with forbidden pairs. A few (B, nq, nk) operations, on the ids'
    device, with no synchronisation."""
    qlo, qhi, qone = _id_ranges(q_ids, block_q)  # (B, nq)
    klo, khi, kone = _id_ranges(kv_ids, block_k)  # (B, nk)
    meet = (qlo[:, :, None] <= khi[:, None, :]) & (klo[:, None, :] <= qhi[:, :, None])  # (B, nq, nk)
    full = qone[:, :, None] & kone[:, None, :] & (qlo[:, :, None] == klo[:, None, :])
    if causal_offset is not None:
        lq, lk = q_ids.shape[1], kv_ids.shape[1]
        q0 = torch.arange(0, lq, block_q, device=q_ids.device)  # (nq,) first query of each tile
        k0 = torch.arange(0, lk, block_k, device=q_ids.device)  # (nk,)
        q_last = torch.clamp(q0 + block_q, max=lq) - 1
        k_last = torch.clamp(k0 + block_k, max=lk) - 1
        meet = meet & (k0[None, :] <= q_last[:, None] + causal_offset)  # some pair causal
        full = full & (k_last[None, :] <= q0[:, None] + causal_offset)  # every pair causal
    return meet & ~full, full


def refine(coarse: Blocks, fine: Blocks) -> Blocks:
    """The structure that ``coarse`` gives with ``fine``'s smaller tiles, where ``fine`` bounds the function
    that decides inside ``coarse``'s partial tiles (a BlockMask's ``mask_mod``): a fine tile is empty where
    its coarse tile is, full where its coarse tile is full (there the function is never asked) or where
    ``fine`` finds it full, partial else. Tile sizes must divide: ``coarse.block_q % fine.block_q == 0``
    (and the same for keys); one structure per call ``(Lq, Lk)``."""
    rq, rk = coarse.block_q // fine.block_q, coarse.block_k // fine.block_k
    if (
        coarse.block_q % fine.block_q
        or coarse.block_k % fine.block_k
        or (coarse.lq, coarse.lk) != (fine.lq, fine.lk)
    ):
        raise ValueError(
            f"refine: the fine tiles {fine.block_q}x{fine.block_k} over ({fine.lq}, {fine.lk}) must divide the "
            f"coarse tiles {coarse.block_q}x{coarse.block_k} over ({coarse.lq}, {coarse.lk})"
        )
    nq, nk = fine.allowed.shape

    def up(t: Tensor) -> Tensor:  # (nq', nk') of coarse tiles -> (nq, nk) of fine ones
        return t.repeat_interleave(rq, 0).repeat_interleave(rk, 1)[:nq, :nk]

    allowed, full = up(coarse.allowed), up(coarse.full)
    return Blocks(
        fine.block_q, fine.block_k, fine.lq, fine.lk, allowed & (full | fine.allowed),
        full | (allowed & fine.full), coarse.batch, coarse.heads,
    )  # fmt: skip


def _exact(
    fn: MaskFn, target: tuple[int, int, int, int], bq: int, bk: int, device: object
) -> tuple[Tensor, Tensor]:
    """``(allowed, full)`` (nq, nk) by evaluating ``fn`` on every tile (the fallback of :func:`block_mask`)."""
    b, h, lq, lk = target
    nq, nk = -(-lq // bq), -(-lk // bk)
    allowed = torch.zeros(nq, nk, dtype=torch.bool)
    full = torch.zeros(nq, nk, dtype=torch.bool)
    broadcast = how_to_call(fn, "mask", target, device)  # type: ignore[arg-type]
    for r in range(nq):
        rows = range(r * bq, min(lq, (r + 1) * bq))
        keep = call_fn(fn, "mask", index_grid(target, device, queries=rows), broadcast)  # type: ignore[arg-type]
        keep = keep.expand(b, h, len(rows), lk).permute(3, 0, 1, 2).reshape(lk, -1)  # (Lk, B*H*n)
        for c in range(nk):
            piece = keep[c * bk : (c + 1) * bk]
            allowed[r, c], full[r, c] = bool(piece.any()), bool(piece.all())
    return allowed, full


def _spans(length: int, size: int) -> Tensor:
    starts = torch.arange(0, length, size)
    return torch.stack([starts, torch.clamp(starts + size - 1, max=length - 1)], dim=1)  # (n, 2)


def _bounded(fn: MaskFn, target: tuple[int, int, int, int], bq: int, bk: int) -> Blocks | None:
    b, h, lq, lk = target
    try:
        can_true, can_false = tile_bounds(fn, b, h, _spans(lq, bq), _spans(lk, bk))
    except Exception:  # Unsupported, or the function's own error on spans: no structure from bounds
        return None
    return Blocks(bq, bk, lq, lk, can_true.clone(), ~can_false)


_CACHE: weakref.WeakKeyDictionary[object, dict[tuple, tuple[tuple, Blocks | None]]] = (
    weakref.WeakKeyDictionary()
)


def captured_versions(fn: object, depth: int = 2) -> tuple:
    """Versions of the tensors ``fn`` closes over or reads as globals (and those of the functions it closes
    over): a cached structure, and the tile values kept with it, are rebuilt when one changed in place."""
    out: list[tuple[int, int]] = []
    inner = getattr(fn, "fn", fn)
    names = getattr(getattr(inner, "__code__", None), "co_names", ())
    scope = getattr(inner, "__globals__", None) or {}
    for name in names:
        value = scope.get(name)
        if isinstance(value, Tensor):
            out.append((id(value), value._version))
    cells = getattr(inner, "__closure__", None) or ()
    for cell in cells:
        try:
            value = cell.cell_contents
        except ValueError:
            continue
        if isinstance(value, Tensor):
            out.append((id(value), value._version))
        elif callable(value) and depth:
            out.extend(captured_versions(value, depth - 1))
        elif isinstance(value, (tuple, list)) and depth:
            for v in value:
                if isinstance(v, Tensor):
                    out.append((id(v), v._version))
                elif callable(v):
                    out.extend(captured_versions(v, depth - 1))
    return tuple(out)


def structure(fn: MaskFn, target: tuple[int, int, int, int], block_q: int, block_k: int) -> Blocks | None:
    """The block structure of any mask function over ``target`` (B, H, Lq, Lk) in tiles of
    ``block_q`` x ``block_k``, from interval bounds (:mod:`.ranges`), cached per function object; ``None``
    when the function cannot be bounded that way (the backend then probes it tile by tile)."""
    if isinstance(fn, BlockMaskFunction):
        return fn.blocks
    key = (target, block_q, block_k)
    versions = captured_versions(fn)
    try:
        seen = _CACHE.setdefault(fn, {})
    except TypeError:  # not weak-referenceable: built every call
        seen = {}
    hit = seen.get(key)
    if hit is not None and hit[0] == versions:
        return hit[1]
    blocks = _bounded(fn, target, block_q, block_k)
    seen[key] = (versions, blocks)
    return blocks


def block_mask(
    fn: MaskFn,
    lq: int,
    lk: int | None = None,
    *,
    batch: int = 1,
    heads: int = 1,
    block_size: int | tuple[int, int] = 128,
) -> BlockMaskFunction:
    """``fn`` with its block structure, built once: pass the result as ``mask=`` to every layer and call
    (the analogue of FlexAttention's ``create_block_mask(fn, B, H, Lq, Lk)``). ``batch``/``heads``: the
    B and H the function is evaluated for; 1 (the default, FlexAttention's ``None``) promises that it
    does not depend on ``b``/``h``, and serves calls of any B/H; ``block_size``: the tile
    (block_q, block_k). Tiles are bounded by interval arithmetic, or, for a function that cannot be
    bounded that way, by evaluating it once on every tile (an (Lq, Lk) pass, never kept)."""
    check_callable(fn, "mask")
    lk = lq if lk is None else lk
    bq, bk = (block_size, block_size) if isinstance(block_size, int) else block_size
    for name, value in (
        ("lq", lq),
        ("lk", lk),
        ("block_q", bq),
        ("block_k", bk),
        ("batch", batch),
        ("heads", heads),
    ):
        if not is_int(value, 1):
            raise ValueError(f"block_mask: {name} must be a positive int, got {value!r}")
    target = (batch, heads, lq, lk)
    blocks = _bounded(fn, target, bq, bk)
    if blocks is None:
        allowed, full = _exact(fn, target, bq, bk, None)
        blocks = Blocks(bq, bk, lq, lk, allowed, full)
    blocks = Blocks(bq, bk, lq, lk, blocks.allowed, blocks.full, batch, heads)
    inner = fn.inner if isinstance(fn, BlockMaskFunction) else fn
    return BlockMaskFunction(inner, blocks, None, fn_name(fn))
