"""Positional encoding, feed-forward, encoder/decoder layers and stacks, the Transformer and generate()."""

import itertools
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import multihead as mh

PAD, BOS, EOS = 0, 1, 2


def _model(seed=0, rotary=False, norm_first=False, tie=False, vocab=11, kv_heads=None, layers=2, dtype=None):
    torch.manual_seed(seed)
    return mh.Transformer(
        vocab,
        vocab,
        d_model=32,
        num_heads=4,
        num_encoder_layers=layers,
        num_decoder_layers=layers,
        d_ff=64,
        dropout=0.1,
        norm_first=norm_first,
        rotary=rotary,
        kv_heads=kv_heads,
        tie_embeddings=tie,
        max_len=64,
        dtype=dtype,
    ).eval()


def _tokens(b, n, vocab=11, low=3, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(low, vocab, (b, n), generator=g)


pytestmark = pytest.mark.usefixtures("one_thread")  # many tiny ops: see conftest.py


# ----------------------------------------------------------------------------------------------
# Positional encoding and feed-forward
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("d_model", [6, 7])
def test_positional_encoding_is_the_papers_formula(d_model):
    pe = mh.PositionalEncoding(d_model, max_len=10)
    got = pe(torch.zeros(1, 10, d_model))[0]
    for p in range(10):
        for i in range(d_model):
            angle = p / 10000 ** ((i - i % 2) / d_model)
            expect = math.sin(angle) if i % 2 == 0 else math.cos(angle)
            assert abs(got[p, i].item() - expect) < 1e-6


def test_positional_encoding_offset_and_limits():
    pe = mh.PositionalEncoding(8, max_len=6)
    x = torch.randn(2, 6, 8)
    torch.testing.assert_close(pe(x[:, 2:4], offset=2), pe(x)[:, 2:4], rtol=0, atol=0)
    with pytest.raises(ValueError, match="max_len"):
        pe(x, offset=1)
    with pytest.raises(ValueError, match=r"\(B, L, 8\)"):
        pe(torch.randn(2, 3, 5))
    assert not pe.state_dict()  # the table is not a parameter


@pytest.mark.parametrize("activation, fn", [("relu", torch.relu), ("gelu", F.gelu)])
def test_feed_forward(activation, fn):
    ff = mh.FeedForward(8, 16, activation=activation)
    x = torch.randn(2, 3, 8)
    expect = fn(x @ ff.linear1.weight.T + ff.linear1.bias) @ ff.linear2.weight.T + ff.linear2.bias
    torch.testing.assert_close(ff(x), expect)
    with pytest.raises(ValueError, match="activation"):
        mh.FeedForward(8, 16, activation="swish")


# ----------------------------------------------------------------------------------------------
# Parity with torch.nn
# ----------------------------------------------------------------------------------------------


def _torch_layer(cls, norm_first, activation, seed=0):
    torch.manual_seed(seed)
    layer = cls(16, 4, 32, dropout=0.1, activation=activation, norm_first=norm_first, batch_first=True)
    with torch.no_grad():  # non-trivial LayerNorm affine parameters
        for name, p in layer.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return layer.eval()


@pytest.mark.parametrize("norm_first", [False, True])
@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_encoder_layer_matches_torch(norm_first, activation):
    ref = _torch_layer(nn.TransformerEncoderLayer, norm_first, activation)
    ours = mh.TransformerEncoderLayer.from_torch(ref)
    assert not ours.training and ours.norm_first == norm_first
    x = torch.randn(3, 7, 16)
    lens = torch.tensor([7, 4, 1])
    keep = torch.arange(7)[None] < lens[:, None]  # (B, S) True = real token
    expect = ref(x, src_key_padding_mask=~keep)
    got = ours(x, valid_lens=lens)
    torch.testing.assert_close(got[keep], expect[keep], rtol=0, atol=1e-5)
    causal_ref = ref(x, src_mask=nn.Transformer.generate_square_subsequent_mask(7), is_causal=True)
    torch.testing.assert_close(ours(x, causal=True), causal_ref, rtol=0, atol=1e-5)
    back = ours.to_torch()
    torch.testing.assert_close(back(x, src_key_padding_mask=~keep)[keep], expect[keep], rtol=0, atol=1e-6)


@pytest.mark.parametrize("norm_first", [False, True])
@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_decoder_layer_matches_torch(norm_first, activation):
    ref = _torch_layer(nn.TransformerDecoderLayer, norm_first, activation)
    ours = mh.TransformerDecoderLayer.from_torch(ref)
    x, memory = torch.randn(3, 6, 16), torch.randn(3, 5, 16)
    mem_lens, tgt_lens = torch.tensor([5, 2, 3]), torch.tensor([6, 6, 3])
    mem_keep = torch.arange(5)[None] < mem_lens[:, None]  # (B, S)
    tgt_keep = torch.arange(6)[None] < tgt_lens[:, None]  # (B, T)
    expect = ref(
        x,
        memory,
        tgt_mask=torch.ones(6, 6, dtype=torch.bool).triu(1),  # torch: True = masked out
        tgt_is_causal=True,
        tgt_key_padding_mask=~tgt_keep,
        memory_key_padding_mask=~mem_keep,
    )
    got = ours(x, memory, valid_lens=tgt_lens, memory_valid_lens=mem_lens)
    torch.testing.assert_close(got[tgt_keep], expect[tgt_keep], rtol=0, atol=1e-5)
    back = ours.to_torch()
    assert isinstance(back, nn.TransformerDecoderLayer) and back.self_attn.batch_first
    torch.testing.assert_close(back(x, memory), ref(x, memory), rtol=0, atol=1e-6)


@pytest.mark.parametrize("norm_first", [False, True])
def test_stacks_match_torch(norm_first):
    enc_layer = _torch_layer(nn.TransformerEncoderLayer, norm_first, "relu")
    dec_layer = _torch_layer(nn.TransformerDecoderLayer, norm_first, "relu", seed=1)
    ref_enc = nn.TransformerEncoder(enc_layer, 2, norm=nn.LayerNorm(16), enable_nested_tensor=False).eval()
    ref_dec = nn.TransformerDecoder(dec_layer, 2, norm=nn.LayerNorm(16) if norm_first else None).eval()
    enc, dec = mh.TransformerEncoder.from_torch(ref_enc), mh.TransformerDecoder.from_torch(ref_dec)
    assert len(enc.layers) == 2 and enc.norm is not None and (dec.norm is not None) == norm_first
    src, tgt = torch.randn(2, 5, 16), torch.randn(2, 4, 16)
    memory = enc(src)
    torch.testing.assert_close(memory, ref_enc(src), rtol=0, atol=1e-5)
    causal = nn.Transformer.generate_square_subsequent_mask(4)
    torch.testing.assert_close(dec(tgt, memory), ref_dec(tgt, memory, tgt_mask=causal), rtol=0, atol=1e-5)


def test_from_torch_rejects_what_it_cannot_load():
    with pytest.raises(TypeError, match="TransformerEncoderLayer"):
        mh.TransformerEncoderLayer.from_torch(nn.Linear(2, 2))
    odd = nn.TransformerEncoderLayer(8, 2, 16, activation=nn.SiLU(), batch_first=True)
    with pytest.raises(ValueError, match="activation"):
        mh.TransformerEncoderLayer.from_torch(odd)
    with pytest.raises(ValueError, match="grouped-query"):
        mh.TransformerEncoderLayer(8, 2, 16, kv_heads=1).to_torch()


def test_stack_construction():
    layer = mh.TransformerEncoderLayer(16, 2, 32)
    stack = mh.TransformerEncoder(layer, num_layers=3)
    assert len(stack.layers) == 3 and stack.layers[0] is layer and stack.norm is None
    torch.testing.assert_close(stack.layers[1].ff.linear1.weight, layer.ff.linear1.weight)  # torch's copies
    fresh = mh.TransformerDecoder(16, 2, 32, norm_first=True, num_layers=2)
    assert fresh.norm is not None
    assert not torch.equal(fresh.layers[0].ff.linear1.weight, fresh.layers[1].ff.linear1.weight)
    with pytest.raises(TypeError, match="not both"):
        mh.TransformerEncoder(layer, 2, num_layers=2)
    with pytest.raises(TypeError, match="stacks"):
        mh.TransformerDecoder(layer)


# ----------------------------------------------------------------------------------------------
# Incremental decoding, causality, padding and batch invariance
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("rotary", [False, True])
@pytest.mark.parametrize("norm_first", [False, True])
def test_cached_decoder_steps_equal_full_forward(rotary, norm_first):
    torch.manual_seed(0)
    dec = mh.TransformerDecoder(16, 2, 32, norm_first=norm_first, rotary=rotary, num_layers=2).eval()
    x, memory = torch.randn(2, 7, 16), torch.randn(2, 5, 16)
    mem_lens = torch.tensor([5, 3])
    full = dec(x, memory, memory_valid_lens=mem_lens)
    cache = mh.KVCache()
    for t in range(7):
        step = dec(x[:, t : t + 1], memory, memory_valid_lens=mem_lens, cache=cache)
        torch.testing.assert_close(step, full[:, t : t + 1], rtol=0, atol=1e-5)
    assert len(cache) == 7


@pytest.mark.parametrize("rotary", [False, True])
def test_cached_model_decode_equals_full_decode(rotary):
    model = _model(rotary=rotary)
    src, tgt = _tokens(2, 6), _tokens(2, 5, seed=2)
    memory = model.encode(src)
    full = model(src, tgt)
    cache = mh.KVCache()
    steps = [model.decode(tgt[:, t : t + 1], memory, src=src, cache=cache) for t in range(5)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=0, atol=1e-5)


@pytest.mark.parametrize("rotary", [False, True])
def test_decoder_is_causal_by_gradients(rotary):
    model = _model(rotary=rotary)
    src, tgt = _tokens(1, 5), _tokens(1, 6, seed=3)
    seen = {}

    def keep_grad(module, inputs, out):
        out.retain_grad()
        seen["emb"] = out

    handle = model.tgt_embed.register_forward_hook(keep_grad)
    for t in range(6):
        model.zero_grad()
        model(src, tgt)[0, t].sum().backward()
        grad = seen["emb"].grad[0].abs().sum(-1)  # (T,) how much each target position influenced step t
        assert torch.all(grad[t + 1 :] == 0), f"position {t} depends on the future: {grad}"
        assert torch.all(grad[: t + 1] > 0)
    handle.remove()


@pytest.mark.parametrize("use_lens", [True, False])
def test_padding_does_not_change_real_tokens(use_lens):
    model = _model()
    src, tgt = _tokens(2, 6), _tokens(2, 5, seed=2)
    src_lens, tgt_lens = torch.tensor([6, 3]), torch.tensor([5, 2])
    src_real = torch.arange(6)[None] < src_lens[:, None]
    tgt_real = torch.arange(5)[None] < tgt_lens[:, None]
    a_src, a_tgt = src.masked_fill(~src_real, PAD), tgt.masked_fill(~tgt_real, PAD)
    kw = {"src_valid_lens": src_lens, "tgt_valid_lens": tgt_lens} if use_lens else {}
    base = model(a_src, a_tgt, **kw)
    if use_lens:  # any token may sit in a padded slot
        b_src = torch.where(src_real, src, _tokens(2, 6, seed=9))
        b_tgt = torch.where(tgt_real, tgt, _tokens(2, 5, seed=8))
        other = model(b_src, b_tgt, **kw)
    else:  # padding found from pad_id must give the same answer as explicit lengths
        other = model(a_src, a_tgt, src_valid_lens=src_lens, tgt_valid_lens=tgt_lens)
    torch.testing.assert_close(other[tgt_real], base[tgt_real], rtol=0, atol=1e-6)


def test_batch_invariance():
    model = _model()
    short_src, short_tgt = _tokens(1, 4), _tokens(1, 3, seed=2)
    alone = model(short_src, short_tgt)
    long_src, long_tgt = _tokens(1, 7, seed=5), _tokens(1, 6, seed=6)
    batch_src = torch.cat([long_src, F.pad(short_src, (0, 3), value=PAD)])
    batch_tgt = torch.cat([long_tgt, F.pad(short_tgt, (0, 3), value=PAD)])
    together = model(
        batch_src, batch_tgt, src_valid_lens=torch.tensor([7, 4]), tgt_valid_lens=torch.tensor([6, 3])
    )
    torch.testing.assert_close(together[1:, :3], alone, rtol=0, atol=1e-5)
    gen_alone = model.generate(short_src, bos_id=BOS, eos_id=EOS, max_len=8, beam_size=3)
    gen_batch = model.generate(batch_src, bos_id=BOS, eos_id=EOS, max_len=8, beam_size=3)
    assert torch.equal(gen_batch[1, : gen_alone.shape[1]], gen_alone[0])


def test_weight_tying_and_input_errors():
    model = _model(tie=True)
    assert model.out_proj.weight is model.tgt_embed.weight
    with pytest.raises(ValueError, match="integer tensor"):
        model(torch.randn(2, 3), _tokens(2, 3))
    with pytest.raises(ValueError, match="pad_id"):
        mh.Transformer(5, 5, pad_id=7)
    with pytest.raises(ValueError, match="eos_id"):
        model.generate(_tokens(1, 3), bos_id=BOS, eos_id=99)


# ----------------------------------------------------------------------------------------------
# generate()
# ----------------------------------------------------------------------------------------------


def _greedy_without_cache(model, src, max_len):
    """Oracle: recompute the whole target prefix every step (no cache), argmax of the last position."""
    b = src.shape[0]
    prefix = torch.full((b, 1), BOS)
    done = torch.zeros(b, dtype=torch.bool)
    out = []
    with torch.no_grad():
        for _ in range(max_len):
            logp = model(src, prefix)[:, -1].log_softmax(-1)
            logp[:, PAD] = float("-inf")  # padding is never generated
            nxt = torch.where(done, PAD, logp.argmax(-1))
            out.append(nxt)
            done |= nxt == EOS
            if done.all():
                break
            prefix = torch.cat([prefix, nxt[:, None]], dim=1)
    return torch.stack(out, dim=1)


def _scores(model, src, hyps, alpha):
    """Oracle: length-normalised log-probabilities of ``hyps`` (lists of ids, eos included) for one source
    (1, S), by teacher forcing all of them in one padded batch (causal: padding after a hypothesis
    cannot change its positions)."""
    n, width = len(hyps), max(map(len, hyps))
    dec_in = torch.full((n, width), PAD)
    for i, h in enumerate(hyps):
        dec_in[i, : len(h)] = torch.tensor([BOS] + h[:-1])
    with torch.no_grad():
        logp = model(src.expand(n, -1), dec_in).log_softmax(-1)  # (n, width, V)
    return [
        sum(logp[i, j, tok].item() for j, tok in enumerate(h)) / len(h) ** alpha for i, h in enumerate(hyps)
    ]


@pytest.mark.parametrize("rotary", [False, True])
def test_greedy_equals_decoding_without_cache(rotary):
    model = _model(rotary=rotary, seed=3)
    src = _tokens(4, 6, seed=4)
    got = model.generate(src, bos_id=BOS, eos_id=EOS, max_len=12)
    torch.testing.assert_close(got, _greedy_without_cache(model, src, 12), rtol=0, atol=0)


@pytest.mark.parametrize("length_penalty", [0.0, 1.0, 0.6])
def test_beam_one_equals_greedy(length_penalty):
    model = _model(seed=4)
    src = _tokens(5, 6, seed=4)
    beam = model.generate(src, bos_id=BOS, eos_id=EOS, max_len=10, beam_size=1, length_penalty=length_penalty)
    torch.testing.assert_close(beam, _greedy_without_cache(model, src, 10), rtol=0, atol=0)


@pytest.mark.parametrize("alpha", [0.0, 1.0])
def test_wide_beam_finds_the_best_sequence(alpha):
    """With K >= every prefix, beam search is exhaustive: it must return the oracle's argmax."""
    vocab, max_len = 5, 3
    model = _model(seed=5, vocab=vocab)
    src = _tokens(1, 4, vocab=vocab, seed=3)
    words = [t for t in range(vocab) if t != PAD]
    hyps = []
    for n in range(1, max_len + 1):
        for body in itertools.product([t for t in words if t != EOS], repeat=n - 1):
            hyps.append([*body, EOS])
        if n == max_len:
            hyps += [list(h) for h in itertools.product([t for t in words if t != EOS], repeat=n)]
    scores = _scores(model, src, hyps, alpha)
    best_score = max(scores)
    best = hyps[scores.index(best_score)]
    got, score = model.generate(
        src, bos_id=BOS, eos_id=EOS, max_len=max_len, beam_size=16, length_penalty=alpha, return_scores=True
    )
    assert got[0].tolist() == best
    assert abs(score.item() - best_score) < 1e-5


def test_beam_scores_match_teacher_forcing():
    model = _model(seed=6, rotary=True)
    src = torch.cat([_tokens(1, 6, seed=7), F.pad(_tokens(1, 3, seed=8), (0, 3), value=PAD)])
    tokens, scores = model.generate(src, bos_id=BOS, eos_id=EOS, max_len=9, beam_size=4, return_scores=True)
    for i in range(2):
        hyp = tokens[i].tolist()
        if EOS in hyp:
            hyp = hyp[: hyp.index(EOS) + 1]
            assert all(t == PAD for t in tokens[i, len(hyp) :].tolist())
        assert abs(scores[i].item() - _scores(model, src[i : i + 1, : 6 - 3 * i], [hyp], 1.0)[0]) < 1e-5


def test_generate_keeps_training_mode_and_stops_at_max_len():
    model = _model(seed=7).train()
    out = model.generate(_tokens(2, 4), bos_id=BOS, eos_id=None, max_len=5, beam_size=2)
    assert out.shape == (2, 5) and model.training
    assert not (out == PAD).any()


# ----------------------------------------------------------------------------------------------
# The decoding functions on their own: a Markov-chain step, no model
# ----------------------------------------------------------------------------------------------


def _markov_step(table):
    """A step whose next-token log-probs depend on the last token only: ``table`` (V, V) log-probs."""

    def step(tokens, cache):
        if cache is not None:
            cache.seen.append(tokens.clone())
        return table[tokens[:, -1]]  # (N, V)

    return step


class _Recorder:
    """A stand-in cache: records what beam search asks it to reorder and what the step saw."""

    def __init__(self):
        self.seen, self.rows = [], []

    def reorder(self, indices, *, include_static=True):
        assert not include_static
        self.rows.append(indices.clone())


def _markov_table(vocab, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(vocab, vocab, generator=g, dtype=torch.float64).log_softmax(-1)


def _best_by_enumeration(table, start, max_len, eos, alpha):
    """Oracle: every sequence of 1..max_len tokens (ending at the first eos, or at max_len)."""
    vocab = table.shape[0]
    best, best_score = None, -math.inf
    for n in range(1, max_len + 1):
        for seq in itertools.product(range(vocab), repeat=n):
            if eos in seq[:-1] or (n < max_len and seq[-1] != eos):
                continue
            prev, total = start, 0.0
            for tok in seq:
                total += table[prev, tok].item()
                prev = tok
            if total / n**alpha > best_score:
                best, best_score = list(seq), total / n**alpha
    return best, best_score


@pytest.mark.parametrize("alpha", [0.0, 1.0])
def test_beam_search_function_is_exhaustive_when_wide(alpha):
    vocab, max_len, eos = 4, 3, 1
    table = _markov_table(vocab, seed=int(alpha))
    start = torch.tensor([0, 2, 3])
    got = mh.transformer.beam_search(
        _markov_step(table),
        start,
        beams=vocab**max_len,
        max_len=max_len,
        eos_id=eos,
        fill=eos,
        length_penalty=alpha,
    )
    for b in range(3):
        best, score = _best_by_enumeration(table, start[b].item(), max_len, eos, alpha)
        n = int(got.lengths[b])
        assert got.tokens[b, :n].tolist() == best and n == len(best)
        assert abs(got.scores[b].item() - score) < 1e-6


def test_greedy_function_and_one_beam_agree_and_pass_the_history():
    table = _markov_table(6, seed=3)
    start = torch.tensor([0, 4, 5, 2])
    cache_g, cache_b = _Recorder(), _Recorder()
    g = mh.transformer.greedy(_markov_step(table), start, max_len=7, eos_id=1, fill=0, cache=cache_g)
    b = mh.transformer.beam_search(
        _markov_step(table), start, beams=1, max_len=7, eos_id=1, fill=0, cache=cache_b
    )
    assert torch.equal(g.tokens, b.tokens) and torch.equal(g.lengths, b.lengths)
    torch.testing.assert_close(g.scores, b.scores, rtol=0, atol=1e-12)
    # the step sees every token so far, start first; rows already finished continue with `fill`
    for t, tokens in enumerate(cache_g.seen):
        assert torch.equal(tokens[:, 0], start) and tokens.shape == (4, t + 1)
        assert torch.equal(tokens[:, 1:], g.tokens[:, :t])
    assert cache_b.rows == []  # one beam: nothing to reorder


def test_beam_search_reorders_the_cache_by_parent_rows():
    table = _markov_table(5, seed=4)
    rec = _Recorder()
    mh.transformer.beam_search(
        _markov_step(table), torch.tensor([0, 3]), beams=3, max_len=4, eos_id=None, fill=0, cache=rec
    )
    assert len(rec.rows) == 4
    for rows in rec.rows:  # (B*K,) parents stay within their source's rows
        assert rows.shape == (6,) and bool((rows[:3] < 3).all()) and bool((rows[3:] >= 3).all())


def test_decoding_functions_reject_bad_start():
    with pytest.raises(ValueError, match="start must be a 1-D integer tensor"):
        mh.transformer.greedy(lambda t, c: t, torch.zeros(2, 1), max_len=3, eos_id=None, fill=0)
    with pytest.raises(ValueError, match="beams must be a positive int"):
        mh.transformer.beam_search(
            lambda t, c: t, torch.zeros(2).long(), beams=0, max_len=3, eos_id=None, fill=0
        )


def test_greedy_with_a_step_without_cache_equals_generate():
    """A step that recomputes the whole prefix (no cache) through the model equals the cached generate()."""
    model = _model(seed=3)
    src = _tokens(4, 6, seed=4)

    def recompute(tokens, cache):
        assert cache is None
        logp = model(src, tokens)[:, -1].float().log_softmax(-1)
        logp[:, PAD] = float("-inf")
        return logp

    with torch.no_grad():
        res = mh.transformer.greedy(recompute, torch.full((4,), BOS), max_len=12, eos_id=EOS, fill=PAD)
    torch.testing.assert_close(
        res.tokens, model.generate(src, bos_id=BOS, eos_id=EOS, max_len=12), rtol=0, atol=0
    )


# ----------------------------------------------------------------------------------------------
# Training
# ----------------------------------------------------------------------------------------------


def test_copy_task_loss_drops():
    torch.manual_seed(0)
    model = mh.Transformer(
        8, 8, d_model=32, num_heads=4, num_encoder_layers=1, num_decoder_layers=1, d_ff=64, dropout=0.0
    )
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(40):
        src = torch.randint(3, 8, (32, 6))
        lens = torch.randint(2, 7, (32,))
        src = src.masked_fill(torch.arange(6)[None] >= lens[:, None], PAD)
        target = torch.cat([src, torch.zeros(32, 1, dtype=torch.long)], dim=1)  # (B, 7) copy then eos
        target[torch.arange(32), lens] = EOS
        dec_in = torch.cat([torch.full((32, 1), BOS), target[:, :-1]], dim=1)  # shifted right
        logits = model(src, dec_in, src_valid_lens=lens, tgt_valid_lens=lens + 1)
        loss = F.cross_entropy(logits.transpose(1, 2), target, ignore_index=PAD)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert sum(losses[-5:]) / 5 < 0.5 * sum(losses[:5]) / 5, losses
