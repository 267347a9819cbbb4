"""Packed sequences: many variable-length sequences in a few rows, kept apart by segment ids.

Dimensions: N sequences, L_i the length of sequence i, B packed rows, L a row's length (capacity),
``*`` any trailing feature dims (E for embeddings, none for token ids).

Packing instead of padding: the sequences sit one after another in a row and ``segment_ids`` (B, L)
says which sequence each position belongs to (``-1`` = padding after the last one). Attention with
``segment_ids=`` lets a query see only keys of its own sequence (with ``causal=True``: causally within
it), so a packed row computes exactly what each sequence computes alone. Ids 0 0 0 1 1 -1, causal::

    1 0 0 0 0 0
    1 1 0 0 0 0
    1 1 1 0 0 0
    0 0 0 1 0 0
    0 0 0 1 1 0
    0 0 0 0 0 0

Positions that depend on the index in the row (rotary angles, learned or sinusoidal position tables)
should restart at 0 in each sequence: :func:`segment_positions` gives those positions.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from .checks import is_int

__all__ = [
    "Packed",
    "Run",
    "Place",
    "Runs",
    "ids_from_lengths",
    "pack",
    "packed_runs",
    "segment_positions",
    "segment_runs",
    "unpack",
]


class Place(NamedTuple):
    """Where one sequence sits in a packed batch: ``row``, first position ``start``, ``length``."""

    row: int
    start: int
    length: int


class Packed(NamedTuple):
    """:func:`pack`'s result: ``data`` (B, L, *), ``segment_ids`` (B, L) int64 (sequence i has id i,
    padding -1) and ``places`` (one :class:`Place` per sequence, in input order, for :func:`unpack`)."""

    data: Tensor
    segment_ids: Tensor
    places: list[Place]


class Runs(NamedTuple):
    """Contiguous runs of equal non-negative ids, one entry per run, in row-major order (int64, (R,) each):
    ``row``, ``start`` (first position in the row), ``length`` and ``id``."""

    row: Tensor
    start: Tensor
    length: Tensor
    id: Tensor


def _check_lengths(lengths: Sequence[int] | Tensor) -> list[int]:
    if isinstance(lengths, Tensor):
        if lengths.dim() != 1 or lengths.is_floating_point() or lengths.dtype == torch.bool:
            raise ValueError(
                f"lengths must be a 1-D int tensor or a list of ints, got dtype {lengths.dtype} shape "
                f"{tuple(lengths.shape)}"
            )
        lengths = lengths.tolist()
    out = list(lengths)
    if not all(is_int(n, 0) for n in out):
        raise ValueError(f"lengths must be non-negative ints, got {out!r}")
    return out


def ids_from_lengths(
    lengths: Sequence[int] | Tensor, capacity: int | None = None, *, device: torch.device | str | None = None
) -> Tensor:
    """Segment ids (L,) int64 for sequences of ``lengths`` laid end to end: positions of sequence i get
    id i; with ``capacity`` the row is filled up to it with -1 (padding). lengths [3, 2], capacity 6::

        0 0 0 1 1 -1

    For attention, a batch of one row is ``ids[None]`` (1, L).
    """
    ns = _check_lengths(lengths)
    total = sum(ns)
    if capacity is not None and (not is_int(capacity, 0) or capacity < total):
        raise ValueError(f"capacity must be an int >= sum(lengths) = {total}, got {capacity!r}")
    ids = torch.repeat_interleave(torch.arange(len(ns), device=device), torch.tensor(ns, device=device))
    if capacity is not None and capacity > total:
        ids = torch.cat([ids, ids.new_full((capacity - total,), -1)])
    return ids  # (L,)


def pack(seqs: Sequence[Tensor], *, capacity: int | None = None, pad_value: float = 0.0) -> Packed:
    """Pack sequences (L_i, *) into rows with segment ids.

    Without ``capacity``: one row (1, sum L_i, *). With ``capacity``: rows of that length, filled in
    order (a sequence that does not fit in the current row starts the next one), the rest of each row
    ``pad_value`` with id -1. The sequences must share their trailing dims, dtype and device.
    Returns :class:`Packed` ``(data (B, L, *), segment_ids (B, L), places)``.
    """
    if not isinstance(seqs, (list, tuple)) or not seqs or not all(isinstance(s, Tensor) for s in seqs):
        raise TypeError("pack takes a non-empty list of tensors (L_i, *)")
    first = seqs[0]
    for i, s in enumerate(seqs):
        if (
            s.dim() < 1
            or s.shape[1:] != first.shape[1:]
            or s.dtype != first.dtype
            or s.device != first.device
        ):
            raise ValueError(
                f"sequence {i} has shape {tuple(s.shape)}, dtype {s.dtype}, device {s.device}; every sequence "
                f"must be (L_i, *{tuple(first.shape[1:])}) with dtype {first.dtype} on {first.device}"
            )
    lengths = [s.shape[0] for s in seqs]
    if capacity is None:
        capacity = sum(lengths)
    elif not is_int(capacity, 1) or max(lengths) > capacity:
        raise ValueError(
            f"capacity must be an int >= the longest sequence ({max(lengths)}), got {capacity!r}"
        )
    places: list[Place] = []
    row, used = 0, 0
    for n in lengths:
        if used + n > capacity:
            row, used = row + 1, 0
        places.append(Place(row, used, n))
        used += n
    data = first.new_full((row + 1, capacity, *first.shape[1:]), pad_value)  # (B, L, *)
    ids = torch.full((row + 1, capacity), -1, dtype=torch.int64, device=first.device)  # (B, L)
    for i, (s, p) in enumerate(zip(seqs, places)):
        data[p.row, p.start : p.start + p.length] = s
        ids[p.row, p.start : p.start + p.length] = i
    return Packed(data, ids, places)


def unpack(x: Tensor, places: Sequence[Place] | Packed) -> list[Tensor]:
    """The sequences back from a packed tensor ``x`` (B, L, *) (e.g. a model's output on
    :func:`pack`'s data): ``[x[row, start:start + length] for each place]``, each (L_i, *), views."""
    if isinstance(places, Packed):
        places = places.places
    if not isinstance(x, Tensor) or x.dim() < 2:
        raise ValueError(
            f"unpack takes a packed tensor (B, L, *), got {getattr(x, 'shape', type(x).__name__)}"
        )
    for p in places:
        if p.row >= x.shape[0] or p.start + p.length > x.shape[1]:
            raise ValueError(f"{p} lies outside the packed tensor of shape {tuple(x.shape)}")
    return [x[p.row, p.start : p.start + p.length] for p in places]


def _check_ids(ids: Tensor) -> None:
    if not isinstance(ids, Tensor) or ids.dim() != 2 or ids.is_floating_point() or ids.dtype == torch.bool:
        got = f"dtype {ids.dtype} shape {tuple(ids.shape)}" if isinstance(ids, Tensor) else type(ids).__name__
        raise ValueError(f"segment ids must be an int tensor (B, L), got {got}")


def _run_starts(ids: Tensor) -> Tensor:
    """(B, L) bool: True where a run of equal ids begins (every row's position 0 included)."""
    starts = torch.ones_like(ids, dtype=torch.bool)  # (B, L)
    starts[:, 1:] = ids[:, 1:] != ids[:, :-1]
    return starts


def segment_runs(ids: Tensor) -> Runs:
    """Each row's contiguous runs of equal non-negative ids (padding runs, id < 0, are left out).

    ``ids`` (B, L) int. ids [[0, 0, 1, 1, 1, -1]] gives row [0, 0], start [0, 2], length [2, 3], id
    [0, 1]. A varlen kernel serves a packed row as these separate sequences when every id of a row
    forms one run (what :func:`pack` makes); an id that appears in two runs of a row (0 0 1 0) makes
    its runs parts of one sequence: compare ``len(runs.id)`` with the number of distinct (row, id) pairs.
    """
    _check_ids(ids)
    b, length = ids.shape
    if ids.numel() == 0:
        empty = ids.new_zeros(0, dtype=torch.int64)
        return Runs(empty, empty, empty, empty)
    flat_start = _run_starts(ids).flatten().nonzero().squeeze(1)  # (R,) row * L + start
    flat_end = torch.cat([flat_start[1:], flat_start.new_tensor([b * length])])  # a row's last run ends at L
    run_id = ids.flatten()[flat_start].long()
    keep = run_id >= 0
    flat_start, flat_end, run_id = flat_start[keep], flat_end[keep], run_id[keep]
    return Runs(flat_start // length, flat_start % length, flat_end - flat_start, run_id)


def segment_positions(ids: Tensor) -> Tensor:
    """(B, L) int64: each position's index within its run of equal ids (0 at each run's start).

    ids [[0, 0, 0, 1, 1, -1]] -> [[0, 1, 2, 0, 1, 0]]: the positions each packed sequence would have
    alone (for rotary angles or position tables).
    """
    _check_ids(ids)
    idx = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)  # (B, L)
    run_start = torch.where(_run_starts(ids), idx, 0).cummax(dim=1).values  # (B, L)
    return idx - run_start


Run = tuple[int, int, int, int]
"""(q start, q end, k start, k end) of one packed sequence in a row."""


def _runs(ids: Tensor) -> list[dict[int, tuple[int, int]]] | None:
    """Per row of ids (B, L): {id: (start, end)} of the runs of equal non-negative ids
    (:func:`segment_runs`), or ``None`` if some id has two runs in a row (not the
    packed layout)."""
    rows: list[dict[int, tuple[int, int]]] = [{} for _ in range(ids.shape[0])]
    runs = segment_runs(ids)
    for row, start, length, value in torch.stack(tuple(runs)).T.tolist():  # one host sync
        if value in rows[row]:
            return None
        rows[row][value] = (start, start + length)
    return rows


def packed_runs(q_ids: Tensor, kv_ids: Tensor) -> list[list[Run]] | None:
    """For segment ids q_ids (B, Lq), kv_ids (B, Lk): per batch row, the (q start, q end, k start, k end)
    of every id present on both sides, in query order; ``None`` unless every id forms one contiguous run
    on each side (the packed layout). Negative ids (padding) form no run."""
    qr = _runs(q_ids)
    kr = qr if kv_ids is q_ids else _runs(kv_ids)  # self-attention: one pass over the ids (a host sync)
    if qr is None or kr is None:
        return None
    return [
        sorted((qs, qe, *krow[i]) for i, (qs, qe) in qrow.items() if i in krow)
        for qrow, krow in zip(qr, kr, strict=True)
    ]
