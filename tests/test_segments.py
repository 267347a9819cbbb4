"""Packed sequences: a packed row computes exactly what each sequence computes alone.

Dimensions: B rows, H heads, Hkv kv heads, L packed length, L_i a sequence's length, D head dim, E features.
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import multihead as mh
from multihead import segments

# one thread: see conftest.py; compares with float64: tests/cpu_kernels.py
pytestmark = [pytest.mark.numerics, pytest.mark.usefixtures("one_thread")]

LENGTHS = [3, 1, 5, 2]
TOL = {torch.float64: 1e-12, torch.float32: 2e-6}


def _seqs(lengths, h, d, dtype, seed=0):
    """Per sequence: q (1, H, L_i, D), k/v (1, Hkv, L_i, D) with Hkv = H // 2, requiring grad."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        q = torch.randn(1, h, n, d, generator=g, dtype=torch.float64).to(dtype)
        k = torch.randn(1, h // 2, n, d, generator=g, dtype=torch.float64).to(dtype)
        v = torch.randn(1, h // 2, n, d, generator=g, dtype=torch.float64).to(dtype)
        out.append(tuple(t.requires_grad_(True) for t in (q, k, v)))
    return out


def _packed_heads(seqs, capacity=None):
    """Pack per-sequence (1, H, L_i, D) heads into (B, H, L, D) leaves, with their Packed record."""
    packed = [segments.pack([s[i][0].transpose(0, 1) for s in seqs], capacity=capacity) for i in range(3)]
    q, k, v = (p.data.transpose(1, 2).detach().requires_grad_(True) for p in packed)  # (B, H, L, D)
    return q, k, v, packed[0]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("backend", ["math", "sdpa"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("capacity", [None, 6])
def test_packed_equals_each_sequence_alone(dtype, backend, causal, capacity):
    seqs = _seqs(LENGTHS, 4, 8, dtype)
    q, k, v, packed = _packed_heads(seqs, capacity)
    out = mh.attention(
        q, k, v, segment_ids=packed.segment_ids, causal=causal, backend=backend
    )  # (B, H, L, D)
    grad_out = torch.randn_like(out)
    out.backward(grad_out)
    pieces = segments.unpack(out.transpose(1, 2), packed)  # each (L_i, H, D)
    gq, gk, gv = (segments.unpack(t.grad.transpose(1, 2), packed) for t in (q, k, v))
    go = segments.unpack(grad_out.transpose(1, 2), packed)
    for i, (qi, ki, vi) in enumerate(seqs):
        alone = mh.attention_reference(qi, ki, vi, causal=causal)  # (1, H, L_i, D)
        alone.backward(go[i].transpose(0, 1)[None])
        tol = TOL[dtype]
        torch.testing.assert_close(pieces[i], alone[0].transpose(0, 1), atol=tol, rtol=tol)
        for got, leaf in zip((gq, gk, gv), (qi, ki, vi)):
            torch.testing.assert_close(got[i], leaf.grad[0].transpose(0, 1), atol=tol, rtol=tol)
    if capacity is not None:  # the padding queries output 0 and get no gradient
        pad = packed.segment_ids < 0  # (B, L)
        assert pad.any()
        assert out.transpose(1, 2)[pad].abs().max() == 0
        assert q.grad.transpose(1, 2)[pad].abs().max() == 0 and k.grad.transpose(1, 2)[pad].abs().max() == 0


def test_pack_layout_and_ids():
    seqs = [torch.full((n, 2), float(i)) for i, n in enumerate([3, 2, 4])]
    p = segments.pack(seqs, capacity=5)
    assert p.segment_ids.tolist() == [[0, 0, 0, 1, 1], [2, 2, 2, 2, -1]]
    assert p.places == [segments.Place(0, 0, 3), segments.Place(0, 3, 2), segments.Place(1, 0, 4)]
    assert p.data[1, 4].tolist() == [0.0, 0.0]
    back = segments.unpack(p.data, p)
    assert all(torch.equal(a, b) for a, b in zip(back, seqs))
    one_row = segments.pack(seqs)
    assert one_row.data.shape == (1, 9, 2) and one_row.segment_ids.tolist() == [[0, 0, 0, 1, 1, 2, 2, 2, 2]]
    assert segments.ids_from_lengths([3, 2], 6).tolist() == [0, 0, 0, 1, 1, -1]


def test_runs_and_positions():
    ids = torch.tensor([[0, 0, 1, 1, 1, -1], [5, 5, 5, 5, 5, 5], [-1, 2, 2, -1, 3, 2]])
    runs = segments.segment_runs(ids)
    assert runs.row.tolist() == [0, 0, 1, 2, 2, 2]
    assert runs.start.tolist() == [0, 2, 0, 1, 4, 5]
    assert runs.length.tolist() == [2, 3, 6, 2, 1, 1]
    assert runs.id.tolist() == [0, 1, 5, 2, 3, 2]
    assert segments.segment_positions(ids).tolist() == [
        [0, 1, 0, 1, 2, 0],
        [0, 1, 2, 3, 4, 5],
        [0, 0, 1, 0, 0, 0],
    ]


@settings(max_examples=40, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 6), min_size=1, max_size=4),
    pad=st.integers(0, 3),
    causal=st.booleans(),
)
def test_random_packing_equals_separate_runs(lengths, pad, causal):
    """Hypothesis: any lengths, any trailing padding, the packed row = each sequence alone (float64)."""
    seqs = _seqs(lengths, 2, 4, torch.float64, seed=len(lengths) * 7 + pad)
    q, k, v, packed = _packed_heads(seqs, sum(lengths) + pad)
    out = mh.attention(q, k, v, segment_ids=packed.segment_ids, causal=causal)
    pieces = segments.unpack(out.transpose(1, 2), packed)
    for i, (qi, ki, vi) in enumerate(seqs):
        alone = mh.attention_reference(qi, ki, vi, causal=causal)
        torch.testing.assert_close(pieces[i], alone[0].transpose(0, 1), atol=1e-12, rtol=1e-12)
    runs = segments.segment_runs(packed.segment_ids)
    assert runs.length.tolist() == lengths and runs.id.tolist() == list(range(len(lengths)))


@settings(max_examples=40, deadline=None)
@given(ids=st.lists(st.integers(-1, 2), min_size=1, max_size=9), causal=st.booleans())
def test_random_ids_match_the_dense_mask(ids, causal):
    """Any ids (runs or not, padding anywhere): segment_ids = the dense mask it stands for, on every backend."""
    t = torch.tensor([ids])
    lq = len(ids)
    g = torch.Generator().manual_seed(lq)
    q, k, v = (torch.randn(1, 2, lq, 4, generator=g, dtype=torch.float64) for _ in range(3))
    dense = (t[0][:, None] == t[0][None, :]) & (t[0][:, None] >= 0) & (t[0][None, :] >= 0)  # (L, L)
    want = mh.attention_reference(q, k, v, mask=dense, causal=causal)
    for backend in ("math", "sdpa"):
        got = mh.attention(q, k, v, segment_ids=t, causal=causal, backend=backend)
        torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)


def test_cross_attention_pair_of_ids():
    """(q_ids, kv_ids): each query sees the keys of its own id; bottom-right causal inside the call."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, 2, 3, 4, generator=g, dtype=torch.float64)
    k, v = (torch.randn(1, 2, 5, 4, generator=g, dtype=torch.float64) for _ in range(2))
    q_ids, kv_ids = torch.tensor([[0, 1, 1]]), torch.tensor([[0, 0, 1, 1, 1]])
    dense = q_ids[0][:, None] == kv_ids[0][None, :]  # (3, 5)
    got = mh.attention(q, k, v, segment_ids=(q_ids, kv_ids))
    torch.testing.assert_close(got, mh.attention_reference(q, k, v, mask=dense))


@pytest.mark.parametrize("rotary", [False, True])
def test_module_and_encoder_pack_exactly(rotary):
    """MultiHeadAttention (rotary positions restart per sequence) and an encoder layer on a packed row."""
    torch.manual_seed(0)
    mha = mh.MultiHeadAttention(16, 4, kv_heads=2, rotary=rotary, dtype=torch.float64)
    layer = mh.TransformerEncoderLayer(16, 4, 32, dropout=0.0, rotary=rotary, dtype=torch.float64)
    xs = [torch.randn(n, 16, dtype=torch.float64) for n in LENGTHS]
    packed = segments.pack(xs, capacity=6)
    for fn in (lambda x, **kw: mha(x, causal=True, **kw), lambda x, **kw: layer(x, **kw)):
        out = segments.unpack(fn(packed.data, segment_ids=packed.segment_ids), packed)
        for x, got in zip(xs, out):
            torch.testing.assert_close(got, fn(x[None])[0], atol=1e-12, rtol=1e-12)


def test_transformer_packs_source_and_target_pairs():
    """The seq2seq model on packed (source, target) pairs = each pair alone (positions restart too)."""
    torch.manual_seed(0)
    model = mh.Transformer(
        11, 13, d_model=16, num_heads=2, d_ff=32, num_encoder_layers=1, num_decoder_layers=1, dropout=0.0
    )
    model = model.double().eval()
    srcs = [torch.randint(1, 11, (n,)) for n in (3, 4)]
    tgts = [torch.randint(1, 13, (n,)) for n in (2, 5)]
    ps, pt = segments.pack(srcs), segments.pack(tgts)
    logits = model(ps.data, pt.data, src_segment_ids=ps.segment_ids, tgt_segment_ids=pt.segment_ids)
    for s, t, got in zip(srcs, tgts, segments.unpack(logits, pt)):
        torch.testing.assert_close(got, model(s[None], t[None])[0], atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize(
    "bad, match",
    [
        (torch.zeros(2, 6), "integer tensor"),
        (torch.zeros(2, 5, dtype=torch.long), r"shape \(B, Lq\) = \(2, 6\)"),
        (torch.zeros(6, dtype=torch.long), r"shape \(B, Lq\) = \(2, 6\)"),
        ((torch.zeros(2, 6, dtype=torch.long),), "pair"),
        ([1, 2], "integer torch.Tensor"),
    ],
)
def test_bad_segment_ids_are_refused_clearly(bad, match):
    q = torch.randn(2, 2, 6, 4)
    with pytest.raises((TypeError, ValueError), match=match):
        mh.attention(q, q, q, segment_ids=bad)


def test_one_ids_tensor_needs_equal_lengths():
    q, k = torch.randn(1, 2, 3, 4), torch.randn(1, 2, 5, 4)
    with pytest.raises(ValueError, match="pass a pair"):
        mh.attention(q, k, k, segment_ids=torch.zeros(1, 3, dtype=torch.long))


def test_pack_refuses_what_does_not_fit():
    with pytest.raises(ValueError, match="longest sequence"):
        segments.pack([torch.zeros(4, 2)], capacity=3)
    with pytest.raises(ValueError, match="every sequence"):
        segments.pack([torch.zeros(2, 2), torch.zeros(2, 3)])


def test_module_refusals_name_the_fix():
    mha = mh.MultiHeadAttention(8, 2, rotary=True)
    ids = torch.zeros(1, 3, dtype=torch.long)
    with pytest.raises(ValueError, match="KV cache and segment_ids"):
        mha(torch.randn(1, 3, 8), causal=True, segment_ids=ids, cache=mh.KVCache())
    dec = mh.TransformerDecoderLayer(8, 2, 16)
    with pytest.raises(ValueError, match="memory_segment_ids needs segment_ids"):
        dec(
            torch.randn(1, 3, 8), torch.randn(1, 4, 8), memory_segment_ids=torch.zeros(1, 4, dtype=torch.long)
        )
