"""Context parallelism beyond the plain ring: Ulysses attention, packed sequences across ranks, agreement.

Every multi-process check runs inside ONE forked job per world size (as tests/test_distributed.py); the
job returns the errors it measured against single-process multihead.attention and a float64 oracle, and
the tests assert on them (the 2x rule of multihead.testing).
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
from test_distributed import _inputs as _ring_inputs

import multihead as mh
from multihead import distributed as mhd
from multihead.distributed import blocks, exchange, phased, ulysses
from multihead.distributed.hybrid import HybridGroups
from multihead.testing import allowed_error, merge_floor


def _case(name, **kw):
    spec = dict(strategy="ulysses", b=2, h=4, hkv=2, lq=12, lk=None, dk=8, dv=None, causal=False)
    spec.update(layout="contiguous", valid=None, key_mask=False, segments=False, sinks=False, softcap=None)
    spec.update(mask_fn=False, bias_fn=False, dtype=torch.float32, pieces=None, seed=sum(map(ord, name)))
    spec.update(chunks=None, usize=2)  # head_chunks; hybrid: ulysses_size (at most the world size)
    spec.update(windows=None)  # Ulysses/hybrid: exchange (and attend) the sequence in this many windows
    spec.update(kw, name=name)
    return spec


# every option Ulysses serves at once, in head chunks: padding, packing, softcap, sinks, per-row lengths
_EVERY_OPTION = dict(h=6, hkv=3, chunks=3, causal=True, key_mask=True, segments=True, softcap=2.0, sinks=True)
_EVERY_OPTION.update(valid="BL", lq=16)

CASES = [
    _case("u-plain"),
    _case("u-causal-zigzag", causal=True, layout="zigzag", lq=16),
    _case("u-mha-striped", hkv=4, causal=True, layout="striped", lq=16),
    _case("u-heads-not-multiple", h=6, hkv=2, causal=True, layout="zigzag", lq=16),  # H % 4 != 0
    _case("u-mqa", h=4, hkv=1, dk=5, dv=7),  # Hkv < P
    _case("u-fewer-heads-than-ranks", h=2, hkv=1, causal=True),  # H < P at 4 ranks: idle ranks
    _case("u-uneven", causal=True, lq=13, h=6, hkv=3),
    _case("u-cross", lq=8, lk=12, causal=True),
    _case("u-valid-lens", causal=True, layout="zigzag", valid="B", lq=16),
    _case("u-valid-lens-rows", valid="BL", lq=13),
    _case("u-key-mask", causal=True, layout="zigzag", key_mask=True, lq=16),
    _case("u-segments", causal=True, layout="zigzag", segments=True, lq=16),
    _case("u-softcap-sinks", causal=True, softcap=2.0, sinks=True, h=6, hkv=3),
    _case("u-mask-bias-fns", mask_fn=True, bias_fn=True, causal=True, layout="zigzag", lq=16),
    _case("u-float64", causal=True, layout="zigzag", dtype=torch.float64, lq=16),
    # heads in chunks: parts of a group sharing their K/V slot, a slot repeated per query head (H=10,
    # Hkv=2 over 4 ranks), idle ranks, and every option Ulysses serves
    _case("u-chunks-parts", h=8, hkv=2, chunks=8, causal=True, layout="zigzag", lq=16),
    _case("u-chunks-groups", h=6, hkv=3, chunks=2, causal=True, lq=13),
    _case("u-chunks-repeated", h=10, hkv=2, chunks=2, causal=True, layout="zigzag", lq=16),
    _case("u-chunks-idle", h=2, hkv=1, chunks=2, causal=True),
    _case("u-chunks-options", **_EVERY_OPTION, bias_fn=True),
    # the sequence in windows (what long sequences get): Ulysses attends each window of queries with the
    # ring's blocks (a rectangle and the causal triangle) or, with mask/bias functions, multihead.attention
    # on the keys the window sees; the hybrid exchanges its queries and output in windows
    _case("u-windows-causal", h=8, hkv=2, causal=True, layout="zigzag", lq=24, windows=3),
    _case("u-windows-striped", hkv=4, causal=True, layout="striped", lq=16, windows=5, chunks=2),
    _case("u-windows-cross", lq=8, lk=12, causal=True, windows=3),
    _case("u-windows-options", **(_EVERY_OPTION | {"softcap": None}), windows=3),
    _case(
        "u-windows-fns",
        mask_fn=True,
        bias_fn=True,
        softcap=2.0,
        causal=True,
        layout="zigzag",
        lq=16,
        windows=4,
    ),
    _case("u-windows-float64", causal=True, layout="zigzag", dtype=torch.float64, lq=16, windows=2),
    _case("u-windows-unsplit", h=4, hkv=1, dk=5, dv=7, causal=True, windows=3),  # no fused kernel: at once
    _case("u-windows-plain", valid="B", lq=13, windows=2),
    _case("u-windows-uneven", causal=True, lq=13, h=6, hkv=3, windows=3),  # uneven shards and head shares
    _case("h-windows", strategy="hybrid", h=8, hkv=2, causal=True, layout="zigzag", lq=24, windows=3),
    # hybrid: Ulysses groups of usize ranks (at 2 ranks: one group, no ring), the ring across them
    _case("h-plain", strategy="hybrid", h=4, hkv=2, causal=True, layout="zigzag", lq=16),
    _case("h-chunks-parts", strategy="hybrid", h=8, hkv=2, chunks=4, causal=True, layout="zigzag", lq=16),
    _case("h-padded-packed", strategy="hybrid", key_mask=True, segments=True, valid="BL", lq=13, chunks=2),
    _case("h-ring-only", strategy="hybrid", usize=1, causal=True, layout="zigzag", key_mask=True, lq=16),
    # softcap (every block) and sinks (merged once per row) in the ring and the hybrid
    _case("r-softcap-sinks", strategy="ring", softcap=2.0, sinks=True, causal=True, layout="zigzag", lq=16),
    _case(
        "r-softcap-sinks-padded",
        strategy="ring",
        softcap=1.5,
        sinks=True,
        key_mask=True,
        segments=True,
        valid="B",
        lq=21,
        pieces=2,
    ),
    _case("h-softcap-sinks", strategy="hybrid", softcap=2.0, sinks=True, causal=True, lq=16, h=8, chunks=2),
    # sinks of -inf (heads with none) where padding and packing leave rows with no key
    _case(
        "r-no-sink-heads",
        strategy="ring",
        sinks="some heads without",
        key_mask=True,
        segments=True,
        lq=21,
        pieces=2,
    ),
    _case("u-no-sink-heads", **(_EVERY_OPTION | {"sinks": "some heads without"})),
    _case(
        "h-no-sink-heads",
        strategy="hybrid",
        sinks="some heads without",
        segments=True,
        valid="BL",
        lq=13,
        chunks=2,
    ),
    _case("r-segments", strategy="ring", causal=True, layout="zigzag", segments=True, lq=16),
    _case("r-segments-uneven", strategy="ring", segments=True, key_mask=True, lq=13),
    _case("r-segments-cross", strategy="ring", segments=True, lq=8, lk=12),
    _case("r-pieces", strategy="ring", causal=True, layout="zigzag", lq=24, pieces=3),
    _case("r-pieces-uneven-padded", strategy="ring", key_mask=True, segments=True, lq=21, pieces=2),
]


def _inputs(c):
    """Full-sequence inputs of a case, identical on every rank (same seed): the ring tests' inputs, then
    packed sequences, softcap, mask and bias functions and sinks."""
    (q, k, v, gout), kw, keep = _ring_inputs(c)
    g = torch.Generator().manual_seed(c["seed"] + 1)
    b, h, lq, lk = c["b"], c["h"], c["lq"], c["lk"] or c["lq"]
    if c["segments"]:  # packed documents of random lengths, padding (-1) at the end of row 1
        ids = torch.randint(0, 3, (b, max(lq, lk)), generator=g).sort(dim=1).values
        ids[1, -3:] = -1
        kw["segment_ids"] = ids if lq == lk else (ids[:, :lq], ids[:, :lk])
    if c["softcap"]:
        kw["softcap"] = c["softcap"]
    if c["mask_fn"]:
        kw["mask"] = lambda b_, h_, qi, ki: (qi - ki).abs() <= 5 + h_  # depends on global head and position
    if c["bias_fn"]:
        kw["bias"] = lambda b_, h_, qi, ki: 0.1 * (h_ + 1) * (ki - qi).float() / 8
    sinks = torch.randn(h, generator=g, dtype=torch.float64) if c["sinks"] else None  # (H,)
    if c["sinks"] == "some heads without":
        sinks[::2] = float("-inf")  # a head with no sink: NaN in rows with no key before the fix
    return (q, k, v, gout, sinks), kw, keep


def _run(fn, q, k, v, gout, sinks, kw, keep, dtype):
    leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
    extra = {}
    if sinks is not None:
        extra["sinks"] = sinks.detach().to(dtype).requires_grad_()
    if keep is not None:
        extra["mask"] = mh.masks.key_padding(keep)
    kw = {
        n: (x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x)
        for n, x in kw.items()
    }
    out = fn(*leaves, **kw, **extra)
    (out * gout.to(dtype)).sum().backward()
    grads = [t.grad for t in leaves] + ([extra["sinks"].grad] if sinks is not None else [])
    return [out.detach()] + grads


def _local_kwargs(kw, cut, cut_k):
    lkw = dict(kw)
    if kw.get("valid_lens") is not None and kw["valid_lens"].dim() == 2:
        lkw["valid_lens"] = cut(kw["valid_lens"], 1)
    ids = kw.get("segment_ids")
    if isinstance(ids, tuple):
        lkw["segment_ids"] = (cut(ids[0], 1), cut_k(ids[1], 1))
    elif ids is not None:
        lkw["segment_ids"] = cut(ids, 1)
    return lkw


def _cp_case(c, rank, world):
    (q, k, v, gout, sinks), kw, keep = _inputs(c)
    dtype, layout = c["dtype"], c["layout"]
    inputs = (q, k, v, gout, sinks)
    want = _run(mh.attention, *inputs, kw, keep, dtype)
    exact = _run(mh.attention_reference, *inputs, kw, keep, torch.float64)
    own = _run(mh.attention_reference, *inputs, kw, keep, dtype)

    def cut(t, dim=2):
        return mhd.shard(t, dim, rank, world, layout)

    def cut_k(t, dim=2):  # keys of cross-attention: cut their own sequence
        return mhd.shard(t, dim, rank, world, layout)

    local = [cut(q).to(dtype).requires_grad_(), cut_k(k).to(dtype).requires_grad_()]
    local.append(cut_k(v).to(dtype).requires_grad_())
    lkw = _local_kwargs(kw, cut, cut_k)
    extra = {}
    if keep is not None:
        extra["key_mask"] = cut_k(keep, 1)
    if sinks is not None:
        extra["sinks"] = sinks.to(dtype).requires_grad_()
    if c["strategy"] == "ring":
        out = mhd.ring_attention(*local, layout=layout, kv_pieces=c["pieces"], **lkw, **extra)
    elif c["strategy"] == "hybrid":
        groups = HybridGroups.create(dist.group.WORLD, min(c["usize"], world))
        out = mhd.hybrid_attention(
            *local, groups=groups, layout=layout, head_chunks=c["chunks"], **lkw, **extra
        )
    else:
        out = mhd.ulysses_attention(*local, layout=layout, head_chunks=c["chunks"], **lkw, **extra)
    (out * cut(gout).to(dtype)).sum().backward()
    got = [out.detach()] + [t.grad for t in local]
    if sinks is not None:  # each rank holds its heads' share: summed over the group, as a training loop does
        dist.all_reduce(extra["sinks"].grad)
        got.append(extra["sinks"].grad)
    names = ("out", "dq", "dk", "dv", "dsinks")
    cuts = (cut, cut, cut_k, cut_k, lambda t: t)
    res = {}
    for n, g, w, e, o, f in zip(names, got, want, exact, own, cuts):
        res[n] = float((g - f(w)).abs().max())
        res[f"{n}_vs64"] = float((g.double() - f(e)).abs().max())
        res[f"{n}_ref64"] = float((o.double() - e).abs().max())
        res[f"{n}_one64"] = float((w.double() - e).abs().max())  # one process's multihead.attention
        res[f"{n}_mag"] = float(e.abs().max())
    res["finite"] = all(bool(torch.isfinite(t).all()) for t in got)
    return res


def _skipped_steps(rank, world):
    """Two documents, one per rank (contiguous): each rank computes its own block only."""
    calls = []
    real = mhd.ring.block_forward
    mhd.ring.block_forward = lambda *a, **k: calls.append(1) or real(*a, **k)
    try:
        x = torch.randn(1, 2, 4, 8)
        ids = torch.full((1, 4), rank)
        mhd.ring_attention(x, x, x, segment_ids=ids)
    finally:
        mhd.ring.block_forward = real
    return len(calls)


def _windowed(c, run):
    """``run()`` with a case's ``windows``: every exchange in that many windows per rank (as for a long
    sequence)."""
    if c["windows"] is None:
        return run()
    saved = exchange.WINDOW_ELEMENTS, exchange.WINDOWS
    exchange.WINDOW_ELEMENTS, exchange.WINDOWS = 0, c["windows"]
    try:
        return run()
    finally:
        exchange.WINDOW_ELEMENTS, exchange.WINDOWS = saved


def _job(cases):
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    return {
        "cases": {c["name"]: _windowed(c, lambda c=c: _cp_case(c, rank, world)) for c in cases},
        "skipped": _skipped_steps(rank, world),
    }


def _failures(per_rank, cases):
    world = len(per_rank)
    failures = []
    for c in cases:
        res = [r["cases"][c["name"]] for r in per_rank]
        dtype = c["dtype"]
        keys = [n for n in ("out", "dq", "dk", "dv", "dsinks") if n in res[0]]
        for key in keys:
            fast = max(r[f"{key}_vs64"] for r in res)
            ref = max(r[f"{key}_ref64"] for r in res)
            mag = max(r[f"{key}_mag"] for r in res)
            # the 2x rule against the float64 oracle plus the rounding of the merges (testing.merge_floor:
            # the ring merges one partial result per rank and K/V piece); or no farther from it than one
            # process's multihead.attention (Ulysses runs that very kernel on whole sequences)
            parts = world * (c["pieces"] or 1) if c["strategy"] in ("ring", "hybrid") else 1
            parts = 2 if c["windows"] and c["strategy"] == "ulysses" else parts  # rectangle + triangle
            bound = allowed_error(ref, dtype, factor=2.0, floor=merge_floor(dtype, mag, parts))
            bound = max(bound, max(r[f"{key}_one64"] for r in res))
            if fast > bound:
                failures.append(
                    f"{c['name']}: {key} error vs fp64 {fast:.3g} > {bound:.3g} (reference {ref:.3g})"
                )
        if not all(r["finite"] for r in res):
            failures.append(f"{c['name']}: non-finite output or gradient")
    return failures


@pytest.mark.numerics
@pytest.mark.parametrize("world", [2, 4])
def test_ulysses_and_packed_ring_equal_one_process(world):
    per_rank = mhd.launch(_job, world, (CASES,), timeout=150, start_method="fork")
    failures = _failures(per_rank, CASES)
    assert not failures, "\n".join(failures)
    assert [r["skipped"] for r in per_rank] == [1] * world  # the other ranks' documents: steps skipped


# Forward without autograd (inference): Ulysses in windows streams K/V in phases (.phased) where the ring's
# blocks serve; with functions, dropout or no fused kernel it keeps the whole-head schedule
_INFERENCE = [c for c in CASES if c["strategy"] == "ulysses" and c["windows"]]
_PHASED = {"u-windows-causal", "u-windows-striped", "u-windows-cross", "u-windows-options"}
_PHASED |= {"u-windows-float64", "u-windows-plain", "u-windows-uneven"}


def _inference_case(c, rank, world):
    (q, k, v, _, sinks), kw, keep = _inputs(c)
    dtype, layout = c["dtype"], c["layout"]
    if sinks is not None:
        kw = kw | {"sinks": sinks}
    extra = {} if keep is None else {"mask": mh.masks.key_padding(keep)}
    exact = mh.attention_reference(
        *(t.double() for t in (q, k, v)),
        **{
            n: (x.double() if isinstance(x, torch.Tensor) and x.is_floating_point() else x)
            for n, x in kw.items()
        },
        **extra,
    )
    wide = {
        n: (x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x)
        for n, x in kw.items()
    }
    own = mh.attention_reference(*(t.to(dtype) for t in (q, k, v)), **wide, **extra)
    one = mh.attention(*(t.to(dtype) for t in (q, k, v)), **wide, **extra)

    def cut(t, dim=2):
        return mhd.shard(t, dim, rank, world, layout)

    lkw = _local_kwargs(wide, cut, cut)
    if keep is not None:
        lkw["key_mask"] = cut(keep, 1)
    calls = []
    real = ulysses.attend_in_phases
    ulysses.attend_in_phases = lambda *a, **k: calls.append(1) or real(*a, **k)
    try:
        with torch.no_grad():
            out = mhd.ulysses_attention(
                *(cut(t).to(dtype) for t in (q, k, v)), layout=layout, head_chunks=c["chunks"], **lkw
            )
    finally:
        ulysses.attend_in_phases = real
    return {
        "vs64": float((out.double() - cut(exact)).abs().max()),
        "ref64": float((own.double() - exact).abs().max()),
        "one64": float((one.double() - exact).abs().max()),
        "mag": float(exact.abs().max()),
        "phased": len(calls),
    }


def _inference_job(cases, phases=phased.KV_PHASES):
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    phased.KV_PHASES = phases  # (a forked rank: the test process keeps its own)
    return {c["name"]: _windowed(c, lambda c=c: _inference_case(c, rank, world)) for c in cases}


@pytest.mark.numerics
@pytest.mark.parametrize(("world", "phases"), [(2, 2), (4, 2), (4, 3), (2, 1)])
def test_ulysses_inference_in_phases_equals_one_process(world, phases):
    """No rank records a backward: K/V of each chunk in ``phases`` phases, every window's partial results
    merged at home by log-sum-exp (phases x rectangle + triangle merged parts); ``KV_PHASES = 1`` keeps the
    whole-head schedule."""
    cases = (
        _INFERENCE
        if phases == 2
        else [c for c in _INFERENCE if c["name"] in ("u-windows-causal", "u-windows-options")]
    )
    per_rank = mhd.launch(_inference_job, world, (cases, phases), timeout=150, start_method="fork")
    failures = []
    for c in cases:
        res = [r[c["name"]] for r in per_rank]
        ref, mag = max(r["ref64"] for r in res), max(r["mag"] for r in res)
        bound = allowed_error(ref, c["dtype"], factor=2.0, floor=merge_floor(c["dtype"], mag, 2 * phases))
        bound = max(bound, max(r["one64"] for r in res))
        got = max(r["vs64"] for r in res)
        if got > bound:
            failures.append(f"{c['name']}: error vs fp64 {got:.3g} > {bound:.3g}")
        if [r["phased"] for r in res] != [int(c["name"] in _PHASED and phases > 1)] * world:
            failures.append(f"{c['name']}: phased calls {[r['phased'] for r in res]}")
    assert not failures, "\n".join(failures)


def test_phases_send_each_window_where_it_sees_keys():
    edges = exchange.window_edges(12, 4)  # windows of 3 positions
    assert [list(p) for p in phased.phase_keys(edges, 2)] == [[0, 1], [2, 3]]
    assert phased.sends(edges, edges, 2, 0) == [[0], [0], [0, 1], [0, 1]]  # causal: the first half once
    assert phased.sends(edges, edges, 2, None) == [[0, 1]] * 4  # full attention: every window twice
    assert phased.sends(edges, edges, 2, -6) == [[], [], [0], [0]]  # 6 fewer keys than queries
    whole = [exchange.Chunk(range(2), range(1), True)] * 4
    parts = [
        [exchange.Chunk(range(1), range(1), True)] * 4,
        [exchange.Chunk(range(1, 2), range(1), False)] * 4,
    ]
    assert phased.aligned(parts) and [list(r) for r in phased.runs(parts)] == [[0, 1]]
    assert [list(r) for r in phased.runs([whole, whole])] == [[0], [1]]
    mixed = [[exchange.Chunk(range(1), range(1), True), exchange.Chunk(range(1), range(1), False)]]
    assert not phased.aligned(mixed)  # one rank would need its slot again: the whole-head schedule runs


def test_head_split_covers_every_head_once():
    for h, hkv, world in [(8, 2, 4), (6, 2, 4), (2, 1, 4), (12, 4, 8), (5, 5, 3), (6, 3, 4), (8, 2, 3)]:
        shares = mhd.head_split(h, hkv, world)
        assert [i for s in shares for i in s.q] == list(range(h))
        g = h // hkv
        for s in shares:  # every query head reads its own kv head, through the local GQA mapping
            if s.heads:
                local_g = s.heads // len(s.kv)
                assert [s.kv[j // local_g] for j in range(s.heads)] == [i // g for i in s.q]
    assert [s.kv for s in mhd.head_split(8, 2, 4)] == [(0,), (0,), (1,), (1,)]  # Hkv < P: kv sent twice
    assert [s.kv for s in mhd.head_split(6, 2, 4)] == [(0,), (0, 1), (1,), (1,)]
    # a rank holding unequal parts of two groups: its K/V repeated per query head
    assert [s.kv for s in mhd.head_split(8, 2, 3)] == [(0,), (0, 1, 1), (1,)]


def test_shares_ids_is_the_block_test():
    q = torch.tensor([[0, 0, 1], [2, 2, -1]])
    assert blocks.shares_ids(q, torch.tensor([[1, 3], [5, 5]]))
    assert not blocks.shares_ids(q, torch.tensor([[2, 2], [0, 1]]))  # ids of the other row do not count
    assert not blocks.shares_ids(q, torch.tensor([[-1, 3], [-1, -1]]))  # padding meets nothing


def test_chunks_cover_every_head_once_and_send_each_slot_once():
    for h, hkv, world in [(8, 2, 4), (6, 2, 4), (10, 2, 4), (8, 2, 3), (12, 4, 2), (5, 5, 3), (2, 1, 4)]:
        for count in (1, 2, 3, 4, 8, 100):
            for share in mhd.head_split(h, hkv, world):
                chunks = exchange.chunk_heads(share, count)
                assert [i for c in chunks for i in c.q] == list(range(share.heads))
                sent = [j for c in chunks if c.new_kv for j in c.kv]
                assert sent == list(range(len(share.kv)))  # each slot once, in order
                g = share.heads // len(share.kv) if share.heads else 1
                for c in chunks:  # the chunk's GQA mapping is the share's
                    per = len(c.q) // len(c.kv)
                    assert len(c.q) % len(c.kv) == 0
                    assert [c.kv.start + j // per for j in range(len(c.q))] == [i // g for i in c.q]
    share = mhd.head_split(8, 4, 2)[0]  # heads 0-3 reading slots 0 0 1 1, as the docstring pictures
    assert [(list(c.q), list(c.kv), c.new_kv) for c in exchange.chunk_heads(share, 4)] == [
        ([0], [0], True),
        ([1], [0], False),
        ([2], [1], True),
        ([3], [1], False),
    ]
    assert [list(c.q) for c in exchange.chunk_heads(share, 2)] == [[0, 1], [2, 3]]
    assert exchange.auto_head_chunks(1, 16384, 2, 64) == 2  # 16k tokens: one head a chunk
    assert exchange.auto_head_chunks(1, 2048, 2, 64) == 1  # short: one exchange of everything


class _Bytes:
    """Counts the bytes this rank sends to other ranks through all_to_all_single."""

    def __init__(self):
        self.sent = self.calls = 0

    def __enter__(self):
        self.real = real = dist.all_to_all_single

        def counted(out, inp, out_splits=None, in_splits=None, group=None, **kw):
            self.calls += 1
            self.sent += (inp.numel() - in_splits[dist.get_rank(group)]) * inp.element_size()
            return real(out, inp, out_splits, in_splits, group=group, **kw)

        dist.all_to_all_single = counted
        return self

    def __exit__(self, *exc):
        dist.all_to_all_single = self.real


def _bytes_job():
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(1, h, 16, 8, generator=g) for h in (6, 2, 2))
    res = {}
    for chunks, windows in ((1, None), (2, None), (6, None), (1, 3)):
        leaves = [mhd.shard(t, 2, rank, world, "zigzag").requires_grad_() for t in (q, k, v)]
        with _Bytes() as fwd:
            out = _windowed(
                {"windows": windows},
                functools.partial(
                    mhd.ulysses_attention, *leaves, causal=True, layout="zigzag", head_chunks=chunks
                ),
            )
        with _Bytes() as bwd:
            out.sum().backward()
        res[chunks if windows is None else "windows"] = (fwd.sent, bwd.sent, fwd.calls, bwd.calls)
    if world == 1:  # one rank: plain attention, bit for bit, and no exchange at all
        with _Bytes() as none:
            got = mhd.ulysses_attention(q, k, v, causal=True, layout="zigzag")
            groups = HybridGroups.create(dist.group.WORLD, 1)
            got_h = mhd.hybrid_attention(q, k, v, groups=groups, causal=True, layout="zigzag")
        want = mh.attention(q, k, v, causal=True)
        res["alone"] = (torch.equal(got, want), torch.equal(got_h, want), none.calls)
        try:
            mhd.ulysses_attention(q, k, v, head_chunks=0)
        except ValueError as exc:
            res["error"] = str(exc)
    return res


@pytest.mark.parametrize("world", [1, 2])
def test_chunks_change_the_messages_not_the_bytes(world):
    res = mhd.launch(_bytes_job, world, timeout=120, start_method="fork")[0]
    one, two, six, windows = res[1], res[2], res[6], res["windows"]
    assert one[:2] == two[:2] == six[:2] == windows[:2]  # bytes forward and backward
    if world > 1:
        assert one[2] < two[2] < six[2]  # more, smaller exchanges
        assert windows[2:] == (3 * world * one[2], 3 * world * one[3])  # an all-to-all per window (3 a rank)
        assert one[0] > 0
    else:
        assert res["alone"] == (True, True, 0)
        assert "head_chunks must be a positive int" in res["error"] and "got 0" in res["error"]
