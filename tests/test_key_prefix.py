"""Right-padded keys on the CPU: the sdpa backend runs each batch row against its real keys only.

``multihead.masks.key_prefix`` recognises a bool mask that lets every query of row b see exactly the keys
0..n[b]-1 (valid_lens, key padding, transformers' encoder padding); the sdpa backend then cuts each row's
keys (``_by_rows``). Checked against the float64 reference (outputs and gradients, the 2x rule), with
grouped heads and rows that see no key, and the recogniser against masks it must refuse."""

from __future__ import annotations

import pytest
import torch

import multihead as mh
from multihead.core.backends import sdpa
from multihead.testing import allowed_error, compare_to_reference

key_prefix = mh.masks.key_prefix

pytestmark = pytest.mark.numerics  # compares with float64: tests/cpu_kernels.py


def _keep(lengths, lq, lk):
    keys = torch.arange(lk) < torch.tensor(lengths)[:, None]  # (B, Lk)
    return keys[:, None, None, :].expand(-1, 1, lq, lk)  # (B, 1, Lq, Lk)


def test_key_prefix_recognises_right_padding_only():
    assert key_prefix(_keep([5, 0, 3], 4, 5)).tolist() == [5, 0, 3]
    assert key_prefix(_keep([2], 1, 5)).tolist() == [2]
    left = _keep([3, 5], 4, 5).flip(-1)  # left padding: the real keys are the last ones
    assert key_prefix(left) is None
    per_query = _keep([3, 5], 4, 5).clone()
    per_query[0, 0, 1, 0] = False  # one query sees less than the others
    assert key_prefix(per_query) is None
    per_head = _keep([3, 5], 4, 5).expand(2, 2, 4, 5)
    assert key_prefix(per_head) is None
    assert key_prefix(_keep([3, 5], 4, 5).float()) is None


@pytest.fixture
def every_row(monkeypatch):
    """The row-by-row path for every padded call, however small; records the lengths it ran."""
    seen = []
    run = sdpa._by_rows
    monkeypatch.setattr(sdpa, "ROW_CALL_FLOPS", 0)
    monkeypatch.setattr(sdpa, "_by_rows", lambda call, n: (seen.append(n.tolist()), run(call, n))[1])
    return seen


@pytest.mark.parametrize("hkv", [4, 2])
@pytest.mark.parametrize("form", ["valid_lens", "mask"])
def test_rows_against_their_real_keys_match_the_reference(every_row, hkv, form):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(5, 4, 9, 8, generator=g)
    k, v = (torch.randn(5, hkv, 12, 8, generator=g) for _ in range(2))
    lengths = [12, 3, 0, 7, 1]  # a full row, short rows and a row with no key (output 0)
    kw = {"valid_lens": torch.tensor(lengths)} if form == "valid_lens" else {"mask": _keep(lengths, 9, 12)}
    for dtype in (torch.float64, torch.float32):
        rep = compare_to_reference(mh.attention, *(t.to(dtype) for t in (q, k, v)), **kw)
        assert rep.ok, rep
    assert every_row and every_row[-1][:2] == [12, 3]  # the path ran (a dead row is re-opened, then zeroed)
    assert mh.attention(q, k, v, **kw)[2].abs().max() == 0

    def grads(dtype, fn):
        ins = [t.detach().to(dtype).clone().requires_grad_() for t in (q, k, v)]
        fn(*ins, **kw).square().sum().backward()
        return [t.grad.double() for t in ins]

    gold = grads(torch.float64, mh.attention_reference)
    ref = grads(torch.float32, mh.attention_reference)
    fast = grads(torch.float32, mh.attention)
    for name, f, r, g64 in zip("qkv", fast, ref, gold, strict=True):
        own = (r - g64).abs().max().item()
        err = (f - g64).abs().max().item()
        assert err <= allowed_error(own, torch.float32), f"d{name}: {err:.3g} > 2x {own:.3g}"


def test_small_calls_and_unpadded_rows_keep_one_kernel_call():
    q, k, v = (torch.randn(2, 2, 5, 8) for _ in range(3))
    call_rows = []
    original = sdpa._by_rows
    try:
        sdpa._by_rows = lambda call, n: (call_rows.append(n), original(call, n))[1]
        mh.attention(q, k, v, valid_lens=torch.tensor([5, 2]))  # a few pairs saved: not worth 2 calls
        mh.attention(q, k, v, valid_lens=torch.tensor([5, 5]))  # nothing to cut
    finally:
        sdpa._by_rows = original
    assert call_rows == []
