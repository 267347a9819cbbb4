"""The call contract: one frozen options record, passed along by every layer, and the AttentionFn protocol."""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch

import multihead as mh
from multihead.core.attention import prepare
from multihead.core.options import OPTION_NAMES, AttentionOptions, OptionsAttention, call_attention_fn
from multihead.nn import seam


def test_the_record_holds_exactly_the_keywords_of_attention():
    params = inspect.signature(mh.attention).parameters
    assert OPTION_NAMES == tuple(n for n in params if n not in ("q", "k", "v", "backend"))
    for name in OPTION_NAMES:  # the same defaults as the public signature
        assert getattr(AttentionOptions(), name) == params[name].default
    assert list(inspect.signature(mh.attention_reference).parameters) == ["q", "k", "v", *OPTION_NAMES]


def test_the_record_is_frozen_and_says_what_a_call_asks_for():
    opts = AttentionOptions(causal=True, softcap=None, scale=0.5)
    with pytest.raises(dataclasses.FrozenInstanceError):
        opts.causal = False  # type: ignore[misc]
    assert opts.given() == ("causal", "scale")
    assert opts.replace(causal=False).given() == ("scale",) and opts.causal
    assert set(opts.as_kwargs()) == set(OPTION_NAMES)
    with pytest.raises(TypeError, match=r"unknown attention keyword\(s\) \['casual'\]"):
        AttentionOptions.of(casual=True)


def test_prepare_takes_a_record_or_keywords_not_both():
    q = torch.randn(1, 2, 3, 4)
    a = prepare(q, q, q, AttentionOptions(causal=True, scale=0.3))
    b = prepare(q, q, q, causal=True, scale=0.3)
    assert (a.scale, a.masks.causal) == (b.scale, b.masks.causal) == (0.3, True)
    with pytest.raises(TypeError, match="not both"):
        prepare(q, q, q, AttentionOptions(), causal=True)
    with pytest.raises(TypeError, match="must be a multihead AttentionOptions record"):
        prepare(q, q, q, {"causal": True})


class _Halves(OptionsAttention):
    """Serves only plain calls: attention with the values halved (a visible, checkable change)."""

    name = "halving attention"

    def __init__(self):
        self.seen = []

    def why_not(self, q, k, v, options):
        if options.bias is not None:
            yield "bias= is not supported"
        if options.return_weights:
            yield "return_weights=True is not supported"

    def serve(self, q, k, v, options, backend):
        self.seen.append(options)
        return mh.attention(q, k, v / 2, backend=backend, **options.as_kwargs())


def test_an_options_attention_gets_the_record_and_refuses_by_name():
    torch.manual_seed(0)
    fn = _Halves()
    m = mh.MultiHeadAttention(8, 2, attention_fn=fn, bias=False)
    plain = mh.MultiHeadAttention(8, 2, bias=False)
    plain.load_state_dict(m.state_dict())
    x = torch.randn(2, 5, 8)
    torch.testing.assert_close(m(x, causal=True), plain(x, causal=True) / 2)
    (opts,) = fn.seen
    assert opts.causal is True and opts.segment_ids is None and opts.sinks is None  # nothing dropped
    with pytest.raises(ValueError, match=r"halving attention cannot serve this call: bias= is not supported"):
        m(x, bias=torch.zeros(5, 5))
    with pytest.raises(ValueError, match="return_weights=True is not supported"):
        m(x, return_weights=True)
    # called with keywords, as any attention function is
    q = torch.randn(1, 2, 3, 4)
    torch.testing.assert_close(fn(q, q, q, causal=True), mh.attention(q, q, q / 2, causal=True))


def test_a_keyword_function_gets_every_option_none_included():
    got = {}

    def spy(q, k, v, **kw):
        got.update(kw)
        return mh.attention(q, k, v, **kw)

    q = torch.randn(1, 2, 3, 4)
    call_attention_fn(spy, q, q, q, AttentionOptions(sinks=None), "math")
    assert set(got) == {*OPTION_NAMES, "backend"} and got["sinks"] is None and got["backend"] == "math"


def test_the_seam_takes_a_record_or_keywords():
    q = torch.randn(1, 2, 3, 4)
    m = mh.MultiHeadAttention(8, 2)
    a, _ = seam.attend(m, q, q, q, AttentionOptions(causal=True))
    b, _ = seam.attend(m, q, q, q, causal=True)
    torch.testing.assert_close(a, b)
    with pytest.raises(TypeError, match="not both"):
        seam.attend(m, q, q, q, AttentionOptions(), causal=True)
