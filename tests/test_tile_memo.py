"""A mask function's values on partial tiles are kept across calls, and large tiles are evaluated in chunks
(issue 55, item 4: what a sliding window holds beside its output).

Dimensions: B batch, H query heads, Hkv kv heads, L length, D head dim, n queries and w keys of a tile.

The blocked backend evaluates a mask function only on the tiles its structure calls partial. Those values
are now kept with the structure (:class:`multihead.core.masks.memo.TileMemo`), each distinct one once, so a
second call -- the next layer, the next step -- evaluates nothing; and a tile larger than
:data:`multihead.core.masks.evaluate.CHUNK` points is evaluated in chunks of query rows, so the function's
own int64 temporaries never grow with the tile or the grid.
"""

from __future__ import annotations

import pytest
import torch

import multihead as mh
from multihead.bench.measure import live_tensor_peak
from multihead.core.masks import evaluate
from multihead.core.masks.blocks import _CACHE
from multihead.core.masks.memo import TileMemo
from multihead.testing import compare_to_reference

pytestmark = pytest.mark.usefixtures("one_thread")


def _qkv(b, h, hkv, n, d=16, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, n, d, generator=g, dtype=dtype)  # (B, H, L, D)
    k, v = (torch.randn(b, hkv, n, d, generator=g, dtype=dtype) for _ in range(2))  # (B, Hkv, L, D)
    return q, k, v


class Counted:
    """A mask function that counts the (query, key) points it is called on, broadcast or not."""

    def __init__(self, fn):
        self.fn, self.points, self.calls = fn, 0, 0

    def __call__(self, b, h, q_idx, kv_idx):
        if isinstance(q_idx, torch.Tensor):  # not the interval bounds the structure is built from
            self.calls += 1
            self.points += q_idx.numel() * kv_idx.numel()
        return self.fn(b, h, q_idx, kv_idx)


def _memos(fn):
    return [blocks.memo for _, blocks in _CACHE.get(fn, {}).values() if blocks is not None]


def _blocked(q, k, v, mask):
    with torch.no_grad():
        return mh.attention(q, k, v, mask=mask, backend="blocked" if mask is not None else "auto")


# ------------------------------------------------------------------------------------------------
# the memo, through the blocked backend
# ------------------------------------------------------------------------------------------------


@pytest.mark.numerics
def test_a_second_call_evaluates_the_function_on_no_tile():
    q, k, v = _qkv(1, 2, 2, 1024)
    window = Counted(lambda b, h, i, j: (i - j).abs() <= 100)
    first = _blocked(q, k, v, window)
    points = window.points
    assert points > 0  # the first call evaluates the partial tiles (and the probes)
    second = _blocked(q, k, v, window)
    assert window.points == points, "the second call evaluated the function again"
    assert torch.equal(first, second)
    assert compare_to_reference(_blocked, q, k, v, mask=window).ok


def test_a_window_keeps_its_two_distinct_edges_once():
    """A two-sided window's partial spans are translates of two tiles (the left and the right edge): the
    memo holds one tile per place and two distinct values, whatever the length."""
    q, k, v = _qkv(1, 1, 1, 4096)
    window = lambda b, h, i, j: (i - j).abs() <= 512  # noqa: E731
    _blocked(q, k, v, window)
    (memo,) = _memos(window)
    assert len(memo) >= 20  # 16 blocks of 256 queries, about two partial spans each
    assert memo.distinct <= 4  # the two edges, and the clipped ones at either end of the sequence
    assert memo.nbytes <= 4 * 256 * 256  # bool


@pytest.mark.numerics
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(
    "name,fn,shape",
    [
        ("causal window", lambda b, h, i, j: (i >= j) & (i - j <= 300), (2, 4, 2, 1100)),
        ("two-sided window", lambda b, h, i, j: (i - j).abs() <= 257, (1, 4, 4, 900)),
        ("per-head window", lambda b, h, i, j: (i - j).abs() <= 64 * (h + 1), (2, 4, 2, 700)),
        ("per-row prefix", lambda b, h, i, j: (j <= i) | (j < 100 * (b + 1)), (2, 2, 1, 800)),
        ("chunks of 300", lambda b, h, i, j: i // 300 == j // 300, (1, 2, 2, 1000)),
    ],
)
def test_kept_tiles_give_the_references_values(name, fn, shape, dtype):
    """Two calls (the second served from the memo), GQA, per-head and per-batch-row functions: both equal
    the reference under the 2x rule in the working dtype."""
    b, h, hkv, n = shape
    q, k, v = _qkv(b, h, hkv, n, dtype=dtype)
    for _ in range(2):
        report = compare_to_reference(_blocked, q, k, v, mask=fn)
        assert report.ok, (name, report)


@pytest.mark.numerics
def test_a_captured_tensor_changed_in_place_is_seen():
    q, k, v = _qkv(1, 2, 2, 800)
    width = torch.tensor(200)
    window = lambda b, h, i, j: (i - j).abs() <= width  # noqa: E731
    assert compare_to_reference(_blocked, q, k, v, mask=window).ok
    width.fill_(90)  # the function now means a narrower window
    report = compare_to_reference(_blocked, q, k, v, mask=window)
    assert report.ok, report


@pytest.mark.numerics
def test_a_block_mask_outliving_its_captured_tensor_re_evaluates_its_partial_tiles():
    """A user-built block mask keeps its structure (FlexAttention's meaning: its full tiles take no mask)
    but its partial tiles follow the function: a memo of them is dropped when the tensor changes."""
    n = 768
    q, k, v = _qkv(1, 1, 1, n)
    shift = torch.tensor(0)
    fn = lambda b, h, i, j: (i - j - shift).abs() <= 128  # noqa: E731
    bm = mh.masks.block_mask(fn, n, block_size=128)
    before = _blocked(q, k, v, bm)
    shift.fill_(1)  # inside the same partial tiles: the band moves by one key
    after = _blocked(q, k, v, bm)
    keep = (torch.arange(n)[:, None] - torch.arange(n)[None, :] - 1).abs() <= 128
    allowed, full = bm.blocks.allowed, bm.blocks.full
    tiles = allowed.repeat_interleave(128, 0).repeat_interleave(128, 1)
    whole = full.repeat_interleave(128, 0).repeat_interleave(128, 1)
    meaning = (keep & tiles) | whole  # the partial tiles by the function, the full ones whole
    gold = mh.attention_reference(q.double(), k.double(), v.double(), mask=meaning)
    assert not torch.equal(before, after)
    assert (after.double() - gold).abs().max() < 1e-5


# ------------------------------------------------------------------------------------------------
# the memo itself
# ------------------------------------------------------------------------------------------------


def test_the_memo_stores_each_distinct_value_once_and_stops_at_its_budget():
    memo = TileMemo(budget=2 * 64)
    a = torch.arange(64).view(8, 8) % 3 == 0
    evals = []

    def ev(x):
        return lambda: (evals.append(1), x.clone())[1]

    first = memo.keep("f", (0,), ev(a))
    again = memo.keep("f", (1,), ev(a))  # the same content at another place: stored once
    assert again is first and memo.distinct == 1 and memo.nbytes == 64
    assert memo.keep("f", (0,), ev(a)) is first and len(evals) == 2  # a hit evaluates nothing
    b = ~a
    memo.keep("f", (2,), ev(b))
    assert memo.distinct == 2 and not memo.full
    c = torch.eye(8, dtype=torch.bool)
    out = memo.keep("f", (3,), ev(c))  # over the budget: returned, not kept
    assert torch.equal(out, c) and memo.full and memo.distinct == 2
    memo.keep("f", (3,), ev(c))
    assert len(evals) == 5  # a place that did not fit is evaluated every time


def test_the_memo_forgets_a_function_whose_captured_tensors_changed():
    memo = TileMemo()
    value = torch.ones(4, 4, dtype=torch.bool)
    memo.serve("f", ((1, 0),))
    memo.keep("f", (0,), lambda: value)
    memo.serve("f", ((1, 0),))
    assert len(memo) == 1
    memo.serve("f", ((1, 1),))  # a version moved
    assert len(memo) == 0


def test_a_float_or_grad_value_is_never_kept():
    memo = TileMemo()
    memo.keep("f", (0,), lambda: torch.zeros(4, 4))
    memo.keep("f", (1,), lambda: torch.zeros(4, 4, requires_grad=True) > 0)  # bool: kept
    assert len(memo) == 1


# ------------------------------------------------------------------------------------------------
# chunked evaluation
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name,fn,kind",
    [
        ("window", lambda b, h, i, j: (i - j).abs() <= 37, "mask"),
        ("per head and row", lambda b, h, i, j: (i + h * 3 + b) % 5 != (j % 7), "mask"),
        ("keys only", lambda b, h, i, j: j % 3 == 0, "mask"),
        ("queries only", lambda b, h, i, j: i % 4 == 1, "mask"),
        ("alibi-like bias", lambda b, h, i, j: -(i - j).abs().float() * (h + 1) / 8, "bias"),
    ],
)
def test_a_large_grid_is_evaluated_in_chunks_with_the_same_values(name, fn, kind):
    target = (2, 3, 700, 300)  # 210,000 points a batch row and head, more than CHUNK
    counted = Counted(fn)
    chunked = evaluate.evaluate_fn(counted, target, kind)
    b, h, lq, lk = target
    idx = (torch.arange(b).view(-1, 1, 1, 1), torch.arange(h).view(1, -1, 1, 1),
           torch.arange(lq).view(1, 1, -1, 1), torch.arange(lk).view(1, 1, 1, -1))  # fmt: skip
    whole = fn(*idx)
    assert chunked.shape == whole.shape and chunked.dtype == whole.dtype, name
    assert torch.equal(chunked, whole), name
    assert counted.calls > 2  # the probe, and more than one chunk


def test_no_call_of_a_chunked_evaluation_covers_more_than_a_chunk():
    seen = []

    def fn(b, h, q_idx, kv_idx):
        seen.append(q_idx.numel() * kv_idx.numel())
        return (q_idx - kv_idx).abs() <= 3

    lq = lk = 2048  # 4M points: 256 chunks of 16,384
    evaluate.how_to_call(fn, "mask", (1, 1, lq, lk), "cpu")
    seen.clear()
    out = evaluate.evaluate_fn(fn, (1, 1, lq, lk), "mask")
    assert out.shape == (1, 1, lq, lk) and int(out.sum()) == 7 * lq - 12
    assert max(seen) <= max(evaluate.CHUNK, lq * lk >> 8), max(seen)
    assert len(seen) <= 257


# ------------------------------------------------------------------------------------------------
# what a window call holds beside its output
# ------------------------------------------------------------------------------------------------


def test_a_window_call_holds_less_than_the_unmasked_call():
    """A two-sided lambda window of 512 at L = 4,096 (H = 8, D = 64, float32, one thread), the call after a
    warm-up, against the unmasked call, in live tensors (the allocator's placement left out): beside its 8 MiB
    output the window held 1.19 MiB before -- the function's two int64 (256, 256) temporaries on a partial
    tile, on top of a whole block's kernel output -- and 0.46 now, 0.59 with the 128 KiB its memo keeps across
    calls; the unmasked call holds 0.69 (docs/performance.md)."""
    n = 4096
    q, k, v = (torch.randn(1, 8, n, 64) for _ in range(3))
    window = lambda b, h, i, j: (i - j).abs() <= 512  # noqa: E731
    _blocked(q, k, v, window)  # the warm-up: structure, probe, memo
    _blocked(q, k, v, None)
    masked = live_tensor_peak(lambda: _blocked(q, k, v, window))
    plain = live_tensor_peak(lambda: _blocked(q, k, v, None))
    output = 8 * n * 64 * 4 / 2**20
    assert plain >= output and masked >= output  # the profiler saw the outputs
    (memo,) = _memos(window)
    assert memo.nbytes <= 256 * 1024  # two 256 x 256 bool edges
    assert masked + memo.nbytes / 2**20 <= plain, (masked, memo.nbytes, plain)


WIDTH = torch.tensor(600)  # a global a mask function reads


def _global_window(b, h, i, j):
    return (i - j).abs() <= WIDTH


@pytest.mark.numerics
def test_a_global_tensor_changed_in_place_is_seen():
    """Before, only closures were looked at: the structure (and now the kept tiles) built for a width of 600
    served the width of 60 -- tiles once full ran unmasked."""
    q, k, v = _qkv(1, 2, 2, 1500)
    assert compare_to_reference(_blocked, q, k, v, mask=_global_window).ok
    WIDTH.fill_(60)
    try:
        report = compare_to_reference(_blocked, q, k, v, mask=_global_window)
    finally:
        WIDTH.fill_(600)
    assert report.ok, report


def test_a_block_mask_with_kept_tiles_copies_and_pickles():
    import copy
    import pickle

    n = 512
    q, k, v = _qkv(1, 1, 1, n)
    bm = mh.masks.block_mask(mh.masks.sliding_window_fn(64), n)
    out = _blocked(q, k, v, bm)
    assert len(bm.blocks.memo) > 0
    twin = copy.deepcopy(bm)
    assert len(twin.blocks.memo) == 0  # a copy starts empty and fills on its first call
    assert torch.equal(_blocked(q, k, v, twin), out)
    assert len(pickle.loads(pickle.dumps(bm.blocks)).memo) == 0
