"""The fuzzed contract of the Keras drop-in (issue 46): :class:`multihead.compat.keras.MultiHeadAttention`
against ``keras.layers.MultiHeadAttention`` with the same weights, on random layers and calls (the torch
backend only: the other backends run the suite's Keras tests in their own processes).

Dimensions: B batch, T query length, S key length, E features.
"""

import os

os.environ.setdefault("KERAS_BACKEND", "torch")  # before keras is imported anywhere in this process

import numpy as np
import pytest
from fuzz_cases import fuzz, no_hang
from hypothesis import given
from hypothesis import strategies as st

keras = pytest.importorskip("keras")
import multihead.compat.keras as mk  # noqa: E402

pytestmark = [
    pytest.mark.skipif(keras.backend.backend() != "torch", reason="the torch backend's run"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning"),
]


@st.composite
def keras_calls(draw):
    layer = {
        "num_heads": draw(st.integers(1, 3)),
        "key_dim": draw(st.integers(1, 4)),
        "value_dim": draw(st.sampled_from([None, 1, 3])),
        "use_bias": draw(st.booleans()),
        "output_shape": draw(st.sampled_from([None, 2, 5])),
    }
    b, t, s = draw(st.integers(1, 2)), draw(st.integers(1, 4)), draw(st.integers(1, 4))
    e_q, e_v = draw(st.integers(1, 5)), draw(st.integers(1, 5))
    rng = np.random.default_rng(draw(st.integers(0, 2**31 - 1)))
    query = rng.standard_normal((b, t, e_q)).astype("float32")
    value = rng.standard_normal((b, s, e_v)).astype("float32")
    key = (
        rng.standard_normal((b, s, draw(st.integers(1, 5)))).astype("float32")
        if draw(st.booleans())
        else None
    )
    call = {"use_causal_mask": draw(st.booleans()), "return_attention_scores": draw(st.booleans())}
    if draw(st.booleans()):
        mask = rng.random((b, t, s)) > 0.5
        mask[:, :, 0] = True  # every query sees a key (Keras spreads a row with none evenly; ours is 0)
        call["attention_mask"] = mask
    return layer, query, value, key, call


@fuzz(10)
@given(keras_calls())
def test_the_keras_layer_equals_keras(case):
    layer, query, value, key, call = case
    theirs, ours = keras.layers.MultiHeadAttention(**layer), mk.MultiHeadAttention(**layer)
    for m in (theirs, ours):
        m.build(query.shape, value.shape, None if key is None else key.shape)
    ours.set_weights(theirs.get_weights())
    with no_hang():
        want = theirs(query, value, key, **call)
        got = ours(query, value, key, **call)
    for a, b in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
        np.testing.assert_allclose(
            keras.ops.convert_to_numpy(a), keras.ops.convert_to_numpy(b), atol=1e-5, rtol=1e-5
        )
