"""Block structure: tile classification of any mask function (sound: it never drops an allowed pair nor
calls a tile with a forbidden pair full), FlexAttention BlockMasks passed as ``mask=``, masks built once
with ``mh.masks.block_mask``, and a 16k lambda window that never forms an (Lq, Lk) tensor."""

from __future__ import annotations

import pytest
import torch
from attention_cases import LargestTensor
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import multihead as mh
from multihead.core.attention import prepare
from multihead.core.backends.blocked import BlockedBackend
from multihead.core.masks.blocks import structure
from multihead.testing import compare_to_reference

flex = pytest.importorskip("torch.nn.attention.flex_attention")

_TORCH = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])


def _ids(n: int, seed: int) -> torch.Tensor:
    """(n,) non-decreasing document ids with random lengths."""
    gen = torch.Generator().manual_seed(seed)
    return torch.cumsum((torch.rand(n, generator=gen) < 0.1).long(), 0)


# mask functions as users write them: plain lambdas of (b, h, q_idx, kv_idx), random parameters
def _make(kind: str, a: int, c: int, seed: int, n: int):
    ids = _ids(n, seed)
    glob = torch.rand(n, generator=torch.Generator().manual_seed(seed)) < 0.05
    return {
        "window": lambda b, h, q, kv: (q - kv < a) & (kv - q < a),
        "causal_window": lambda b, h, q, kv: (q >= kv) & (q - kv <= a),
        "abs_window": lambda b, h, q, kv: (q - kv).abs() <= a,
        "chunked": lambda b, h, q, kv: q // (a + 1) == kv // (a + 1),
        "prefix_lm": lambda b, h, q, kv: (kv <= q) | (kv < a),
        "documents": lambda b, h, q, kv: ids[q] == ids[kv],
        "causal_documents": lambda b, h, q, kv: (ids[q] == ids[kv]) & (kv <= q),
        "global_window": lambda b, h, q, kv: ((q - kv).abs() <= a) | glob[q] | glob[kv],
        "dilated": lambda b, h, q, kv: ((q - kv).abs() < a) & ((q - kv) % (c + 1) == 0),
        "not_diagonal": lambda b, h, q, kv: ~(q == kv),
        "where": lambda b, h, q, kv: torch.where(q > a, kv <= q, kv < c),
        "per_head": lambda b, h, q, kv: (q - kv).abs() <= a * (h + 1),
        "per_batch": lambda b, h, q, kv: kv <= q + b * c - 3,
        "clamped": lambda b, h, q, kv: kv.clamp(max=a) <= q * 2 - c,
        "scaled": lambda b, h, q, kv: 3 * q - 2 * kv > -a,
        "xor": lambda b, h, q, kv: (q < a) ^ (kv < c),
    }[kind]


KINDS = [
    "window", "causal_window", "abs_window", "chunked", "prefix_lm", "documents", "causal_documents",
    "global_window", "dilated", "not_diagonal", "where", "per_head", "per_batch", "clamped", "scaled", "xor",
]  # fmt: skip


@settings(max_examples=150, deadline=None)
@given(
    kinds=st.lists(st.sampled_from(KINDS), min_size=1, max_size=3),
    ops=st.lists(st.sampled_from(["and", "or"]), min_size=2, max_size=2),
    a=st.integers(0, 40),
    c=st.integers(0, 12),
    seed=st.integers(0, 9),
    lq=st.integers(1, 70),
    lk=st.integers(1, 70),
    bq=st.integers(1, 17),
    bk=st.integers(1, 17),
    b=st.integers(1, 2),
    h=st.integers(1, 3),
)
def test_tile_classification_never_drops_an_allowed_pair(kinds, ops, a, c, seed, lq, lk, bq, bk, b, h):
    n = max(lq, lk)
    parts = [_make(k, a, c, seed, n) for k in kinds]

    def fn(bi, hi, q, kv):
        out = parts[0](bi, hi, q, kv)
        for op, part in zip(ops, parts[1:], strict=False):
            out = (out & part(bi, hi, q, kv)) if op == "and" else (out | part(bi, hi, q, kv))
        return out

    tiles = structure(fn, (b, h, lq, lk), bq, bk)
    assume(tiles is not None)
    dense = mh.masks.evaluate_fn(fn, (b, h, lq, lk), "mask").expand(b, h, lq, lk)  # the exact mask
    for r in range(tiles.allowed.shape[0]):
        for col in range(tiles.allowed.shape[1]):
            tile = dense[:, :, r * bq : (r + 1) * bq, col * bk : (col + 1) * bk]
            if bool(tile.any()):
                assert tiles.allowed[r, col], (kinds, r, col)  # an allowed pair: the tile is computed
            if tiles.full[r, col]:
                assert bool(tile.all()), (kinds, r, col)  # called full: no forbidden pair in it


def test_library_and_plain_lambdas_get_a_structure_and_unboundable_ones_none():
    target = (1, 1, 1000, 1000)
    assert structure(lambda b, h, q, kv: (q - kv < 64) & (kv - q < 64), target, 128, 128) is not None
    assert structure(mh.masks.sliding_window_fn(64), target, 128, 128) is not None
    assert structure(lambda b, h, q, kv: (q * kv).bitwise_and(1) == 0, target, 128, 128) is None


def test_a_changed_captured_tensor_rebuilds_the_cached_structure():
    ids = torch.zeros(64, dtype=torch.long)

    def docs(b, h, q, kv):
        return ids[q] == ids[kv]

    target = (1, 1, 64, 64)
    assert bool(structure(docs, target, 16, 16).full.all())
    ids[32:] = 1  # in place: the cache must notice
    tiles = structure(docs, target, 16, 16)
    assert not bool(tiles.allowed[0, 3]) and bool(tiles.full[0, 0])


# ----------------------------------------------------------------------------------------------
# BlockMask as FlexAttention users hold it
# ----------------------------------------------------------------------------------------------


def _block_semantics(bm, b, h, lq, lk):
    """What a BlockMask means, from its tables (compiled flex_attention's meaning; eager flex_attention
    evaluates mask_mod everywhere and agrees only when the blocks are consistent with it): a pair is
    allowed in a full block, or in a partial block where mask_mod allows it; never elsewhere. (B, H, Lq, Lk)"""
    bq, bk = bm.BLOCK_SIZE
    out = torch.zeros(b, h, lq, lk, dtype=torch.bool)
    mod = mh.masks.evaluate_fn(bm.mask_mod, (b, h, lq, lk), "mask").expand(b, h, lq, lk)
    tables = [(bm.kv_num_blocks, bm.kv_indices, False), (bm.full_kv_num_blocks, bm.full_kv_indices, True)]
    for bi in range(b):
        for hi in range(h):
            for num, idx, full in tables:
                nb, nh = num.shape[:2]
                for r in range(num.shape[2]):
                    for c in idx[bi % nb, hi % nh, r, : num[bi % nb, hi % nh, r]].tolist():
                        rows, cols = slice(r * bq, (r + 1) * bq), slice(c * bk, (c + 1) * bk)
                        out[bi, hi, rows, cols] = True if full else mod[bi, hi, rows, cols]
    return out


@pytest.mark.parametrize(
    "lq, lk, batch, heads",
    [(300, 300, None, None), (200, 333, 2, None), (257, 129, None, 2), (130, 130, 2, 2)],
)
def test_a_block_mask_passed_as_mask_means_what_flex_attention_computes(lq, lk, batch, heads):
    """Built with B or H None while mask_mod reads b and h, the blocks are those of b = 0 / h = 0 (the
    BlockMask's own meaning, checked against torch.compile(flex_attention) when this was written)."""

    def mod(b, h, q, kv):
        return ((q - kv).abs() < 40 + 20 * h) | (kv < 5 + b)

    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 2, n, 16, generator=gen, dtype=torch.float64) for n in (lq, lk, lk))
    bm = flex.create_block_mask(mod, batch, heads, lq, lk, device="cpu", BLOCK_SIZE=64)
    want = mh.attention_reference(q, k, v, mask=_block_semantics(bm, 2, 2, lq, lk))
    for backend in ("auto", "blocked", "math"):
        torch.testing.assert_close(mh.attention(q, k, v, mask=bm, backend=backend), want)
    if batch and heads:  # blocks consistent with mask_mod: torch's eager flex_attention agrees
        eager = flex.flex_attention(q.float(), k.float(), v.float(), block_mask=bm)
        torch.testing.assert_close(eager.double(), want, atol=2e-6, rtol=2e-5)


def test_full_blocks_take_no_mask_and_unlisted_blocks_are_never_attended():
    """A BlockMask whose mask_mod disagrees with its blocks: full blocks attend every pair, blocks not
    listed attend none, partial blocks follow mask_mod (what torch.compile(flex_attention) computes)."""
    n, blk = 256, 64
    nb = n // blk
    kv_num = torch.tensor([[[1, 1, 1, 1]]], dtype=torch.int32)  # partial: the diagonal block
    kv_idx = torch.arange(nb, dtype=torch.int32).view(1, 1, nb, 1).expand(1, 1, nb, nb).contiguous()
    full_num = torch.tensor([[[0, 1, 1, 0]]], dtype=torch.int32)  # full: the block just left of it
    full_idx = torch.tensor([[[[0] * nb, [0] * nb, [1] * nb, [0] * nb]]], dtype=torch.int32)

    def never(b, h, q, kv):  # would forbid everything, but full blocks ignore it
        return q < 0

    def even(b, h, q, kv):
        return (q + kv) % 2 == 0

    gen = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 2, n, 8, generator=gen, dtype=torch.float64) for _ in range(3))
    for mod in (never, even):
        bm = flex.BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=blk, mask_mod=mod,
                                           seq_lengths=(n, n))  # fmt: skip
        want = mh.attention_reference(q, k, v, mask=_block_semantics(bm, 1, 2, n, n))
        assert bool(want[0, 0, 64:192].abs().sum(-1).gt(0).all())  # rows with a full block see it
        for backend in ("blocked", "math"):
            torch.testing.assert_close(mh.attention(q, k, v, mask=bm, backend=backend), want)


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("batch, heads", [(None, None), (2, None), (2, 2)])
def test_flex_takes_the_users_block_mask_as_it_is(batch, heads, monkeypatch):
    """The flex backend hands the BlockMask given as mask= straight to flex_attention (no second
    create_block_mask over its function), and the result is the BlockMask's meaning; with more to mask
    (causal) it builds its own. Eager FlexAttention on the CPU runs the non-CPU code path."""
    from multihead.core.backends.flex import FlexBackend

    def mod(b, h, q, kv):  # reads neither b nor h: torch 2.8's eager flex cannot broadcast one that does
        return ((q - kv).abs() < 40) | (kv < 5)

    n, gen = 200, torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 2, n, 16, generator=gen) for _ in range(3))
    bm = flex.create_block_mask(mod, batch, heads, n, n, device="cpu", BLOCK_SIZE=64)
    built = []
    real = flex.create_block_mask
    monkeypatch.setattr(flex, "create_block_mask", lambda *a, **kw: built.append(a) or real(*a, **kw))
    backend = FlexBackend(compiled=False)
    with torch.no_grad():
        got, _ = backend(prepare(q, k, v, mask=bm))
    assert built == []  # the user's own BlockMask served the call
    keep = _block_semantics(bm, 2, 2, n, n)
    want = mh.attention_reference(q.double(), k.double(), v.double(), mask=keep)
    torch.testing.assert_close(got.double(), want, atol=2e-6, rtol=2e-5)
    if (batch is None or heads is None) and _TORCH < (2, 9):  # the pass-through above was checked
        pytest.skip("causal on top: torch < 2.9's vmap cannot index a broadcast BlockMask's tables")
    with torch.no_grad():
        causal, _ = backend(prepare(q, k, v, mask=bm, causal=True))
    assert len(built) == 1  # causal on top: a block mask of its own
    want_causal = mh.attention_reference(q.double(), k.double(), v.double(), mask=keep, causal=True)
    torch.testing.assert_close(causal.double(), want_causal, atol=2e-6, rtol=2e-5)


@pytest.mark.filterwarnings("ignore")
def test_flex_builds_a_block_mask_once_for_the_same_sources(monkeypatch):
    """The layers and calls that pass the same mask function (and segment ids) share one BlockMask; a
    tensor the function captures, changed in place, or other lengths build a new one, with its meaning."""
    from multihead.core.backends.flex import FlexBackend

    gen = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 2, 96, 16, generator=gen) for _ in range(3))
    width = torch.tensor(20)
    fn = mh.masks.sliding_window_fn(32)

    def captured(b, h, qi, ki):
        return (qi - ki).abs() < width

    built = []
    real = flex.create_block_mask
    monkeypatch.setattr(flex, "create_block_mask", lambda *a, **kw: built.append(a) or real(*a, **kw))
    backend = FlexBackend(compiled=False)
    with torch.no_grad():
        for _ in range(3):
            backend(prepare(q, k, v, mask=fn, causal=True))
        assert len(built) == 1
        first, _ = backend(prepare(q, k, v, mask=captured))
        width.fill_(5)  # in place: the cached BlockMask no longer holds
        second, _ = backend(prepare(q, k, v, mask=captured))
        backend(prepare(q[:, :, :64], k, v, mask=captured))
        assert len(built) == 4
    i = torch.arange(96)
    for out, w in ((first, 20), (second, 5)):
        keep = (i[:, None] - i[None, :]).abs() < w
        want = mh.attention_reference(q.double(), k.double(), v.double(), mask=keep)
        torch.testing.assert_close(out.double(), want, atol=2e-6, rtol=2e-5)


def _packed(length: int, seed: int, gen: torch.Generator, padded: bool = False) -> torch.Tensor:
    """(L,) ids of documents of 1..300 tokens packed in a row, the last up to 150 of them -1 when ``padded``."""
    sizes = torch.randint(1, 301, (length,), generator=gen)
    ids = torch.repeat_interleave(torch.arange(length), sizes)[:length]
    if padded:
        ids[length - int(torch.randint(0, 151, (1,), generator=gen)) :] = -1
    return ids


@pytest.mark.parametrize(
    "lq, lk, causal, padded",
    [(1000, 1000, True, False), (1000, 1000, False, True), (777, 1300, True, True), (128, 128, True, False),
     (300, 200, False, False), (1, 513, True, True)],
)  # fmt: skip
def test_segment_tiles_are_create_block_masks_tables(lq, lk, causal, padded):
    """Packed ids (never decreasing along a row): the tiles read off the ids' ranges are exactly the
    tables create_block_mask builds by evaluating the mask over every pair."""
    from multihead.core.backends.flex import _segments_block_mask

    gen = torch.Generator().manual_seed(lq + lk)
    q_ids = torch.stack([_packed(lq, s, gen, padded) for s in range(2)])
    kv_ids = q_ids if lq == lk else torch.stack([_packed(lk, s, gen, padded) for s in range(2)])
    rule = mh.masks.and_masks(
        mh.masks.segments_fn(q_ids, kv_ids), *([mh.masks.causal_fn(lq, lk)] if causal else [])
    )

    def mod(b, h, i, j):
        return rule(b, h, i, j)

    mine = _segments_block_mask(flex, (q_ids, kv_ids), causal, mod)
    theirs = flex.create_block_mask(mod, 2, None, lq, lk, device="cpu")
    for table in ("kv_num_blocks", "full_kv_num_blocks", "q_num_blocks", "full_q_num_blocks"):
        assert torch.equal(getattr(mine, table), getattr(theirs, table)), table
    assert torch.equal(mine.to_dense(), theirs.to_dense())


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 400), st.integers(1, 400), st.booleans(), st.integers(0, 2**31 - 1))
def test_segment_tiles_never_drop_an_allowed_pair_for_any_ids(lq, lk, causal, seed):
    """Any ids (shuffled, negative, repeated): every allowed pair lies in a listed tile, and a tile called
    full allows every one of its pairs."""
    from multihead.core.masks.blocks import segment_tiles

    gen = torch.Generator().manual_seed(seed)
    q_ids, kv_ids = torch.randint(-1, 4, (2, lq), generator=gen), torch.randint(-1, 4, (2, lk), generator=gen)
    partial, full = segment_tiles(q_ids, kv_ids, lk - lq if causal else None, 32, 48)
    keep = (q_ids[:, :, None] == kv_ids[:, None, :]) & (q_ids[:, :, None] >= 0)  # (B, Lq, Lk)
    if causal:
        keep &= torch.arange(lk)[None, :] <= torch.arange(lq)[:, None] + lk - lq
    tile = (partial | full).repeat_interleave(32, 1).repeat_interleave(48, 2)[:, :lq, :lk]
    assert not bool((keep & ~tile).any())
    whole = full.repeat_interleave(32, 1).repeat_interleave(48, 2)[:, :lq, :lk]
    assert not bool((whole & ~keep).any())
    assert not bool((partial & full).any())


@pytest.mark.filterwarnings("ignore")
def test_flex_builds_packed_documents_block_mask_from_the_ids(monkeypatch):
    """segment_ids on the flex path: the BlockMask comes from the ids' tile ranges (no create_block_mask
    pass over every pair), new ids get a new one, and the result is the reference's."""
    from multihead.core.backends.flex import FlexBackend

    gen = torch.Generator().manual_seed(6)
    n = 300
    q, k, v = (torch.randn(2, 2, n, 16, generator=gen) for _ in range(3))
    built = []
    monkeypatch.setattr(flex, "create_block_mask", lambda *a, **kw: built.append(a))
    backend = FlexBackend(compiled=False)
    for padded in (False, True):
        ids = torch.stack([_packed(n, s, gen, padded) for s in range(2)])
        with torch.no_grad():
            got, _ = backend(prepare(q, k, v, segment_ids=ids, causal=True))
        want = mh.attention_reference(q.double(), k.double(), v.double(), segment_ids=ids, causal=True)
        torch.testing.assert_close(got.double(), want, atol=2e-6, rtol=2e-5)
    assert built == []


@pytest.mark.filterwarnings("ignore")
def test_flex_makes_the_mask_functions_only_when_it_builds_a_block_mask(monkeypatch):
    """Calls that reuse a BlockMask (same segment ids, every layer of a step) run nothing to make its mask
    functions again: the padding rewrite of the ids ran on every call before (small kernels and a copy per
    call on a GPU). New ids (or the same ids changed in place) make them again, with their meaning."""
    from multihead.core.backends import flex as flex_backend

    made = []
    real = flex_backend.segments_fn
    monkeypatch.setattr(flex_backend, "segments_fn", lambda *a: made.append(a) or real(*a))
    gen = torch.Generator().manual_seed(8)
    n = 200
    q, k, v = (torch.randn(2, 2, n, 16, generator=gen) for _ in range(3))
    ids = torch.stack([_packed(n, s, gen, True) for s in range(2)])
    backend = flex_backend.FlexBackend(compiled=False)
    with torch.no_grad():
        for _ in range(3):
            got, _ = backend(prepare(q, k, v, segment_ids=ids, causal=True))
        assert len(made) == 1
        ids[:, :50] = -1  # in place: a new version
        again, _ = backend(prepare(q, k, v, segment_ids=ids, causal=True))
        assert len(made) == 2
    want = mh.attention_reference(q.double(), k.double(), v.double(), segment_ids=ids, causal=True)
    torch.testing.assert_close(again.double(), want, atol=2e-6, rtol=2e-5)


def test_a_block_mask_is_converted_once_per_call_shape():
    """Every layer of every call passes the same BlockMask: it is read (host copies, a probe) once."""
    from multihead.core.masks.blocks import _FROM_FLEX, from_flex

    bm = flex.create_block_mask(lambda b, h, q, kv: q >= kv, None, None, 128, 128, device="cpu")
    first = from_flex(bm, (1, 2, 128, 128))
    assert from_flex(bm, (1, 2, 128, 128)) is first and from_flex(bm, (2, 2, 128, 128)) is not first
    others = [
        flex.create_block_mask(lambda b, h, q, kv: q >= kv, None, None, 64, 64, device="cpu")
        for _ in range(8)
    ]
    for o in others[: _FROM_FLEX.size]:
        from_flex(o, (1, 1, 64, 64))
    assert from_flex(bm, (1, 2, 128, 128)) is not first  # the oldest left the bounded cache


@pytest.mark.parametrize("change", ["mask_mod set", "captured tensor", "table"])
def test_a_block_mask_changed_after_use_means_its_new_content(change):
    """The conversion is reused only while the BlockMask holds the same mask_mod, tables and captured
    tensors: setting mask_mod on it (as torch's slicing asks), changing a tensor the mask_mod reads, or
    changing a table in place gives the new meaning, never the first call's."""
    gen = torch.Generator().manual_seed(7)
    n = 256
    q, k, v = (torch.randn(1, 2, n, 8, generator=gen, dtype=torch.float64) for _ in range(3))
    step = torch.tensor(1)

    def strided(b, h, qi, ki):
        return (qi >= ki) & (ki % step == 0)

    bm = flex.create_block_mask(strided, None, None, n, n, device="cpu", BLOCK_SIZE=64)
    mh.attention(q, k, v, mask=bm, backend="blocked")  # converted and kept
    if change == "mask_mod set":
        bm.mask_mod = lambda b, h, qi, ki: (qi >= ki) & (ki % 3 == 0)
    elif change == "captured tensor":
        step.fill_(2)
    else:
        bm.kv_num_blocks[0, 0, 2] -= 1  # one partial block of row 2 no longer listed
    want = mh.attention_reference(q, k, v, mask=_block_semantics(bm, 1, 2, n, n))
    for backend in ("blocked", "math"):
        torch.testing.assert_close(mh.attention(q, k, v, mask=bm, backend=backend), want)


def test_a_block_mask_for_other_lengths_is_refused_saying_how_to_build_it():
    bm = flex.create_block_mask(lambda b, h, q, kv: q >= kv, None, None, 128, 128, device="cpu")
    q = k = v = torch.randn(1, 1, 100, 8)
    with pytest.raises(ValueError, match=r"create_block_mask\(mask_mod, B, H, 100, 100\)"):
        mh.attention(q, k, v, mask=bm)


# ----------------------------------------------------------------------------------------------
# mh.masks.block_mask: built once, passed to every call
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("causal", [False, True])
def test_block_mask_built_once_matches_the_reference(causal):
    def window(b, h, q, kv):
        return (q - kv < 24) & (kv - q < 24)

    mask = mh.masks.block_mask(window, 150, 150, block_size=32)
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 4, 150, 16, generator=gen, dtype=torch.float64) for _ in range(3))
    for backend in ("blocked", "auto"):
        compare_to_reference(
            lambda *a, backend=backend, **kw: mh.attention(*a, backend=backend, **kw),
            q,
            k,
            v,
            mask=mask,
            causal=causal,
        )
    with pytest.raises(ValueError, match="block_mask"):
        mh.attention(q[:, :, :100], k, v, mask=mask)


def test_an_unboundable_function_still_gets_an_exact_block_mask():
    def odd(b, h, q, kv):
        return (q * kv).bitwise_and(1) == 0  # no interval bound: evaluated once, tile by tile

    mask = mh.masks.block_mask(odd, 64, 64, block_size=16)
    dense = mh.masks.evaluate_fn(odd, (1, 1, 64, 64), "mask")[0, 0]
    tiles = dense.view(4, 16, 4, 16)
    assert torch.equal(mask.blocks.allowed, tiles.any(3).any(1))
    assert torch.equal(mask.blocks.full, tiles.all(3).all(1))


# ----------------------------------------------------------------------------------------------
# Cost: full tiles unmasked, no (Lq, Lk) tensor at 16k
# ----------------------------------------------------------------------------------------------


def test_full_tiles_never_evaluate_the_mask_function():
    """Two-sided window: the lambda is evaluated on the partial tiles at the band's edges only."""
    n, w = 1024, 200
    evaluated = []

    def window(b, h, q, kv):
        if isinstance(q, torch.Tensor):  # not when bounded over tiles (then q and kv are spans)
            evaluated.append(q.numel() * kv.numel())
        return (q - kv < w) & (kv - q < w)

    q, k, v = (torch.randn(1, 1, n, 8) for _ in range(3))
    with torch.no_grad():
        out = BlockedBackend(block_q=32, block_k=16, full_min=16)(prepare(q, k, v, mask=window))[0]
    visible = sum(min(n, i + w) - max(0, i - w + 1) for i in range(n))
    probe = 36  # the probe grid of the first call (6 queries x 6 keys)
    assert sum(evaluated) - probe < 0.5 * visible  # well under the visible pairs: full tiles skip it
    ref = mh.attention_reference(q, k, v, mask=window)
    torch.testing.assert_close(out, ref, atol=2e-6, rtol=2e-5)


def test_a_16k_lambda_window_allocates_no_tensor_of_the_scores_size():
    n, d = 16384, 8
    q, k, v = (torch.randn(1, 1, n, d) for _ in range(3))

    def window(b, h, q_idx, kv_idx):
        return (q_idx - kv_idx < 512) & (kv_idx - q_idx < 512)

    with torch.no_grad(), LargestTensor() as seen:
        mh.attention(q, k, v, mask=window)
    assert seen.largest <= 256 * 2048 < n * n // 100  # one tile's scores at most
