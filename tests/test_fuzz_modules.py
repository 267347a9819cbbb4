"""The fuzzed contract of the modules over the core (issue 46): :class:`multihead.MultiHeadAttention` (every
constructor and forward argument, the KV cache, rotary) against the same module on the float64 reference,
:class:`multihead.KVCache` decoding against one full pass, and the torch drop-in
(:class:`multihead.compat.torch.MultiheadAttention`) against ``torch.nn.MultiheadAttention``; bad arguments
raise a ValueError or TypeError naming them.

Dimensions: B batch, Lq/Lk lengths, E embedding, H heads, Hkv kv heads.
"""

from __future__ import annotations

import pytest
import torch
from fuzz_cases import BACKENDS, close, fuzz, names_the_argument, no_hang
from hypothesis import given
from hypothesis import strategies as st

import multihead as mh
from multihead.compat.torch import MultiheadAttention as DropIn
from multihead.core.options import output_and_weights

pytestmark = pytest.mark.numerics


def reference_fn(q, k, v, *, backend="auto", **options):
    """The reference as a module's attention_fn (it takes no backend)."""
    return mh.attention_reference(q, k, v, **options)


@st.composite
def module_configs(draw):
    hkv = draw(st.integers(1, 3))
    h = hkv * draw(st.integers(1, 3))
    head_dim = draw(st.sampled_from([None, 2, 4]))
    embed = h * draw(st.integers(1, 3)) * 2 if head_dim is None else draw(st.integers(1, 9))
    return {
        "embed_dim": embed,
        "num_heads": h,
        "kv_heads": draw(st.sampled_from([None, hkv])),
        "kdim": draw(st.sampled_from([None, 3])),
        "vdim": draw(st.sampled_from([None, 5])),
        "head_dim": head_dim,
        "v_head_dim": draw(st.sampled_from([None, 2, 6])),
        "out_dim": draw(st.sampled_from([None, 7])),
        "bias": draw(st.booleans()),
        "rotary": draw(st.booleans()) and (head_dim or embed // h) % 2 == 0,
        "softcap": draw(st.sampled_from([None, None, 2.0])),
        "sinks": draw(st.booleans()),
        "dtype": torch.float64,
    }


def _module(config: dict, seed: int, **extra) -> mh.MultiHeadAttention:
    torch.manual_seed(seed)
    m = mh.MultiHeadAttention(**config, **extra)
    if getattr(m, "sinks", None) is not None:  # as learned: any value, and some heads without a sink (-inf)
        with torch.no_grad():
            s = torch.randn(m.sinks.shape, dtype=m.sinks.dtype)  # (H,)
            m.sinks.copy_(s.masked_fill(torch.rand(s.shape) < 0.3, float("-inf")))
    return m


@st.composite
def module_calls(draw):
    config = draw(module_configs())
    b, lq = draw(st.integers(0, 3)), draw(st.integers(0, 6))
    cross = config["kdim"] is not None or config["vdim"] is not None or draw(st.booleans())
    lk = draw(st.integers(0, 6)) if cross else lq
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    kw = {}
    if draw(st.booleans()):
        kw["mask"] = torch.rand(b, 1, lq, lk, generator=g) > 0.3
    if draw(st.booleans()):
        kw["bias"] = torch.randn(lq, lk, generator=g, dtype=torch.float64)
    if draw(st.booleans()):
        kw["valid_lens"] = torch.randint(0, lk + 1, draw(st.sampled_from([(b,), (b, lq)])), generator=g)
    if draw(st.booleans()):
        kw["causal"] = True
    if not config["rotary"] and draw(st.integers(0, 3)) == 0:
        ids = torch.randint(-1, 2, (b, max(lq, lk)), generator=g).sort(dim=1).values
        kw["segment_ids"] = (ids[:, ids.shape[1] - lq :], ids[:, ids.shape[1] - lk :])
    if draw(st.booleans()):
        kw["return_weights"] = True
    x = torch.randn(b, lq, config["embed_dim"], generator=g, dtype=torch.float64)
    key = torch.randn(b, lk, config["kdim"] or config["embed_dim"], generator=g, dtype=torch.float64)
    value = torch.randn(b, lk, config["vdim"] or config["embed_dim"], generator=g, dtype=torch.float64)
    inputs = (x, key, value) if cross else (x,)
    return config, draw(st.integers(0, 100)), inputs, kw, draw(st.sampled_from(BACKENDS))


@fuzz(40)
@given(module_calls())
def test_module_on_every_backend_equals_the_module_on_the_reference(call):
    config, seed, inputs, kw, backend = call
    ours, ref = _module(config, seed, backend=backend), _module(config, seed, attention_fn=reference_fn)
    xs = [t.clone().requires_grad_(True) for t in inputs]
    with no_hang():
        want = ref(*[t.detach().requires_grad_(True) for t in inputs], **kw)
        try:
            got = ours(*xs, **kw)
        except ValueError as e:
            assert backend != "auto" and f"backend {backend!r} cannot serve" in str(e)
            return
    (out, weights), (want_out, want_weights) = output_and_weights(got), output_and_weights(want)
    close(out, want_out, f"module output {config} {kw}")
    if want_weights is not None:
        close(weights, want_weights, "module weights")
    if out.numel():
        grads = torch.autograd.grad(out.sum(), [*ours.parameters()], allow_unused=True)
        want_grads = torch.autograd.grad(want_out.sum(), [*ref.parameters()], allow_unused=True)
        for (name, _), a, b_ in zip(ours.named_parameters(), grads, want_grads, strict=True):
            if a is not None and b_ is not None:
                close(a, b_, f"gradient of {name}")


@fuzz(25)
@given(module_configs(), st.lists(st.integers(1, 3), min_size=1, max_size=4), st.integers(1, 2), st.data())
def test_decoding_with_a_cache_equals_one_causal_pass(config, steps, b, data):
    config = {**config, "kdim": None, "vdim": None}
    m = _module(config, 0).eval()
    x = torch.randn(b, sum(steps), config["embed_dim"], dtype=torch.float64)
    kind = data.draw(st.sampled_from(["grow", "max_len", "fixed_shape"]))
    cache = {
        "grow": mh.KVCache(),
        "max_len": mh.KVCache(max_len=sum(steps) + 1),
        "fixed_shape": mh.KVCache(max_len=sum(steps) + 2, fixed_shape=True),
    }[kind]
    with torch.no_grad(), no_hang():
        full = m(x, causal=True)
        start, parts = 0, []
        for n in steps:
            parts.append(m(x[:, start : start + n], cache=cache, causal=True))
            start += n
    close(torch.cat(parts, dim=1), full, f"decoding {steps} with a {kind} cache, {config}")


MODULE_SPOILS = [
    ("embed_dim", {"embed_dim": 0}),
    ("embed_dim", {"embed_dim": 2.5}),
    ("num_heads", {"num_heads": 0}),
    ("num_heads", {"num_heads": True}),
    ("kv_heads", {"kv_heads": 5}),
    ("kv_heads", {"kv_heads": "2"}),
    ("head_dim", {"head_dim": -1}),
    ("v_head_dim", {"v_head_dim": 0}),
    ("kdim", {"kdim": 0}),
    ("vdim", {"vdim": 1.5}),
    ("out_dim", {"out_dim": 0}),
    ("dropout", {"dropout": 1.5}),
    ("dropout", {"dropout": "0.1"}),
    ("backend", {"backend": "nope"}),
    ("attention_fn", {"attention_fn": 3}),
]


@fuzz(30)
@given(st.sampled_from(MODULE_SPOILS))
def test_a_spoiled_module_argument_is_named(spoil):
    name, bad = spoil
    x = torch.randn(1, 2, 4)
    with no_hang(), pytest.raises((ValueError, TypeError)) as info:
        mh.MultiHeadAttention(**{"embed_dim": 4, "num_heads": 2, **bad})(x)
    assert names_the_argument(info.value, name), repr(info.value)


FORWARD_SPOILS = [
    ("query", lambda x: {"query": x.long()}),
    ("query", lambda x: {"query": x[..., :-1]}),
    ("query", lambda x: {"query": x[None]}),
    ("key", lambda x: {"key": x[:, :, :-1]}),
    ("value", lambda x: {"key": x, "value": x[:, :1]}),
    ("mask", lambda x: {"mask": torch.ones(3, 3, dtype=torch.int32)}),
    ("bias", lambda x: {"bias": torch.ones(5, 5)}),
    ("valid_lens", lambda x: {"valid_lens": torch.ones(2)}),
    ("causal", lambda x: {"causal": "yes"}),
    ("return_weights", lambda x: {"return_weights": 0.5}),
    ("segment_ids", lambda x: {"segment_ids": torch.zeros(1, 3)}),
    ("cache", lambda x: {"cache": {}}),
]


@fuzz(30)
@given(st.sampled_from(FORWARD_SPOILS), st.sampled_from(BACKENDS))
def test_a_spoiled_forward_argument_is_named(spoil, backend):
    name, make = spoil
    x = torch.randn(1, 3, 4)
    m = mh.MultiHeadAttention(4, 2, backend=backend)
    kw = {"query": x, **make(x)}
    with no_hang(), pytest.raises((ValueError, TypeError)) as info:
        m(kw.pop("query"), **kw)
    assert names_the_argument(info.value, name), repr(info.value)


# ------------------------------------------------------------------------------------------------
# The torch drop-in against torch.nn.MultiheadAttention
# ------------------------------------------------------------------------------------------------


@st.composite
def torch_calls(draw):
    h = draw(st.integers(1, 3))
    e = h * draw(st.integers(1, 3))
    kdim, vdim = draw(st.sampled_from([None, 3])), draw(st.sampled_from([None, 5]))
    flags = {
        "bias": draw(st.booleans()),
        "add_bias_kv": draw(st.booleans()),
        "add_zero_attn": draw(st.booleans()),
        "kdim": kdim,
        "vdim": vdim,
        "batch_first": draw(st.booleans()),
        "dtype": torch.float64,
    }
    n, lq = draw(st.integers(1, 3)), draw(st.integers(1, 5))
    lk = draw(st.integers(1, 5))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    kw = {"need_weights": draw(st.booleans()), "average_attn_weights": draw(st.booleans())}
    if draw(st.booleans()):
        kpm = torch.rand(n, lk, generator=g) > 0.7
        kw["key_padding_mask"] = (
            kpm
            if draw(st.booleans())
            else torch.zeros(n, lk, dtype=torch.float64).masked_fill(kpm, float("-inf"))
        )
    mask_kind = draw(st.sampled_from(["none", "bool2", "float2", "bool3", "causal"]))
    if mask_kind == "bool2":
        kw["attn_mask"] = torch.rand(lq, lk, generator=g) > 0.7
    elif mask_kind == "float2":
        kw["attn_mask"] = torch.randn(lq, lk, generator=g, dtype=torch.float64)
    elif mask_kind == "bool3":
        kw["attn_mask"] = torch.rand(n * h, lq, lk, generator=g) > 0.7
    elif mask_kind == "causal" and lq == lk:
        kw["attn_mask"] = torch.nn.Transformer.generate_square_subsequent_mask(lq, dtype=torch.float64)
        kw["is_causal"] = draw(st.booleans())
    shape = (lambda length, d: (n, length, d)) if flags["batch_first"] else (lambda length, d: (length, n, d))
    q = torch.randn(shape(lq, e), generator=g, dtype=torch.float64)
    k = torch.randn(shape(lk, kdim or e), generator=g, dtype=torch.float64)
    v = torch.randn(shape(lk, vdim or e), generator=g, dtype=torch.float64)
    unbatched = draw(st.booleans()) and n == 1 and not (mask_kind == "bool3")
    if unbatched:
        q, k, v = (t.squeeze(0 if flags["batch_first"] else 1) for t in (q, k, v))
        if "key_padding_mask" in kw:
            kw["key_padding_mask"] = kw["key_padding_mask"][0]
    return e, h, flags, (q, k, v), kw, draw(st.integers(0, 100))


@fuzz(50)
@given(torch_calls())
def test_the_drop_in_equals_torch(call):
    e, h, flags, (q, k, v), kw, seed = call
    torch.manual_seed(seed)
    theirs = torch.nn.MultiheadAttention(e, h, **flags)
    ours = DropIn.from_torch(theirs)
    with no_hang():
        want, want_w = theirs(q, k, v, **kw)
        got, got_w = ours(q, k, v, **kw)
    # a head's row with no allowed key: torch NaN (through the output projection, the whole row), ours 0
    dead = want.isnan()
    close(got.masked_fill(dead, 0.0), want.masked_fill(dead, 0.0), f"drop-in output {flags} {kw}")
    assert got.isfinite().all()
    if want_w is not None:
        dead_w = want_w.isnan()
        close(got_w.masked_fill(dead_w, 0.0), want_w.masked_fill(dead_w, 0.0), "drop-in weights")
        assert kw["average_attn_weights"] or not got_w[dead_w].any()


CACHE_SPOILS = [
    ("static", {"static": "no"}),
    ("static", {"static": 0.5}),
    ("fixed_shape", {"fixed_shape": [1]}),
    ("max_len", {"max_len": 0}),
    ("max_len", {"max_len": 2.5}),
    ("max_len", {"fixed_shape": True}),
]


@fuzz(12)
@given(st.sampled_from(CACHE_SPOILS))
def test_a_spoiled_cache_argument_is_named(spoil):
    name, bad = spoil
    with no_hang(), pytest.raises((ValueError, TypeError)) as info:
        mh.KVCache(**bad)
    assert names_the_argument(info.value, name), repr(info.value)


DROP_IN_SPOILS = [
    ("query", lambda q, k, v: {"query": q[0, 0]}),  # 1-D
    ("key", lambda q, k, v: {"key": k[..., :-1]}),
    ("value", lambda q, k, v: {"value": v[:, :-1]}),
    ("value", lambda q, k, v: {"value": v[..., :-1]}),
    ("key_padding_mask", lambda q, k, v: {"key_padding_mask": torch.zeros(2, 9, dtype=torch.bool)}),
    ("key_padding_mask", lambda q, k, v: {"key_padding_mask": torch.zeros(2, 4, 4, dtype=torch.bool)}),
    ("attn_mask", lambda q, k, v: {"attn_mask": torch.zeros(5, 5, dtype=torch.bool)}),
    ("attn_mask", lambda q, k, v: {"attn_mask": torch.zeros(1, 1, 3, 4, dtype=torch.bool)}),
    ("attn_mask", lambda q, k, v: {"attn_mask": torch.zeros(3, 4, dtype=torch.float16)}),
    ("is_causal", lambda q, k, v: {"is_causal": True}),
]


@fuzz(30)
@given(st.sampled_from(DROP_IN_SPOILS), st.booleans())
def test_a_spoiled_drop_in_argument_is_named(spoil, batch_first):
    name, make = spoil
    q, k, v = torch.randn(2, 3, 4), torch.randn(2, 4, 4), torch.randn(2, 4, 4)  # (N, L, E), batch first
    if not batch_first:
        q, k, v = (t.transpose(0, 1) for t in (q, k, v))  # (L, N, E)
    m = DropIn(4, 2, batch_first=batch_first)
    kw = {"query": q, "key": k, "value": v, **make(q, k, v)}
    with no_hang(), pytest.raises((ValueError, TypeError)) as info:
        m(**kw)
    assert names_the_argument(info.value, name), repr(info.value)
