"""multihead.compat.keras.MultiHeadAttention against keras.layers.MultiHeadAttention (torch backend)."""

import os

os.environ["KERAS_BACKEND"] = "torch"  # before keras is imported anywhere in this process

import subprocess
import sys

import numpy as np
import pytest

keras = pytest.importorskip("keras")  # the optional extra multihead[keras]; installed by requirements-dev
from keras import ops  # noqa: E402
from keras.src.backend import set_keras_mask  # noqa: E402

import multihead.compat.keras as mk  # noqa: E402

B, T, S, E = 2, 3, 4, 6
pytestmark = pytest.mark.filterwarnings("ignore:__array__ implementation:DeprecationWarning")  # keras+numpy 2


@pytest.fixture(params=["multihead", "keras.ops"])
def route(request, monkeypatch):
    """Both implementations of the attention: multihead.attention and the portable keras.ops path."""
    monkeypatch.setattr(mk, "USE_MULTIHEAD_ON_TORCH", request.param == "multihead")
    return request.param


def _np(x):
    return ops.convert_to_numpy(x)


def _pair(q, v, k=None, **kwargs):
    ref = keras.layers.MultiHeadAttention(**kwargs)
    ours = mk.MultiHeadAttention(**kwargs)
    ref(q, v, k)
    ours(q, v, k)
    ours.set_weights(ref.get_weights())
    return ref, ours


def _close(a, b, atol=1e-5):
    np.testing.assert_allclose(_np(a), _np(b), atol=atol, rtol=1e-5)


def _data(*shapes, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(s).astype("float32") for s in shapes]


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(num_heads=2, key_dim=3),
        dict(num_heads=3, key_dim=2, value_dim=5, output_shape=7),
        dict(num_heads=2, key_dim=4, use_bias=False, output_shape=(2, 3)),
        dict(num_heads=2, key_dim=3, use_gate=True),
    ],
    ids=["plain", "value_dim+output_shape", "no_bias+output_shape_tuple", "gate"],
)
def test_same_weights_same_outputs_and_scores(kwargs, route):
    q, v, k = _data((B, T, E), (B, S, 5), (B, S, 4))
    ref, ours = _pair(q, v, k, **kwargs)
    assert [w.path.split("/", 1)[1] for w in ours.weights] == [w.path.split("/", 1)[1] for w in ref.weights]
    assert [w.shape for w in ours.get_weights()] == [w.shape for w in ref.get_weights()]
    r_out, r_sc = ref(q, v, k, return_attention_scores=True)
    o_out, o_sc = ours(q, v, k, return_attention_scores=True)
    _close(o_out, r_out)
    _close(o_sc, r_sc)
    _close(ours(q, v, k), ref(q, v, k))


@pytest.mark.parametrize(
    "shape, axes",
    [((B, 2, T, E), (2,)), ((B, 2, T, E), None), ((B, 2, T, E), (1,)), ((B, 2, 2, T, E), (1, 3))],
)
def test_attention_axes(shape, axes, route):
    (x,) = _data(shape)
    ref, ours = _pair(x, x, num_heads=2, key_dim=3, attention_axes=axes)
    mask = np.random.default_rng(1).random(ref(x, x, return_attention_scores=True)[1].shape) > 0.3
    mask[..., 0] = True  # every query keeps a key  (a per-head mask of the scores' own shape)
    r_out, r_sc = ref(x, x, attention_mask=mask, return_attention_scores=True)
    o_out, o_sc = ours(x, x, attention_mask=mask, return_attention_scores=True)
    assert tuple(o_sc.shape) == tuple(r_sc.shape)
    _close(o_out, r_out)
    _close(o_sc, r_sc)
    _close(ours(x, x), ref(x, x))


@pytest.mark.parametrize(
    "mask_shape, causal", [((B, T, S), False), ((1, T, S), True), ((B, 1, S), False), ((B, 2, T, S), True)]
)
def test_masks_and_causal(mask_shape, causal, route):
    q, v = _data((B, T, E), (B, S, E))
    ref, ours = _pair(q, v, num_heads=2, key_dim=3)
    rng = np.random.default_rng(2)
    mask = rng.random(mask_shape) > 0.4
    mask[..., 0] = True
    vmask = np.array([[1, 1, 0, 1], [1, 1, 1, 0]], bool)
    kmask = np.array([[1, 0, 1, 1], [1, 1, 1, 1]], bool)
    kw = dict(attention_mask=mask, value_mask=vmask, key_mask=kmask, use_causal_mask=causal)
    r_out, r_sc = ref(q, v, return_attention_scores=True, **kw)
    o_out, o_sc = ours(q, v, return_attention_scores=True, **kw)
    _close(o_out, r_out)
    _close(o_sc, r_sc)


def test_query_mask_from_keras_mask_and_explicit(route):
    q, v = _data((B, T, E), (B, S, E))
    ref, ours = _pair(q, v, num_heads=2, key_dim=3)
    qmask = np.array([[1, 1, 0], [1, 0, 1]], bool)
    qt, qt2 = ops.convert_to_tensor(q), ops.convert_to_tensor(q)
    set_keras_mask(qt, ops.convert_to_tensor(qmask))
    set_keras_mask(qt2, ops.convert_to_tensor(qmask))
    r_out, r_sc = ref(qt, v, return_attention_scores=True)
    o_out, o_sc = ours(qt2, v, return_attention_scores=True)
    # Keras masks whole query rows; where Keras averages the values (-1e9 everywhere) ours gives 0.
    keep = qmask[:, None, :, None]
    _close(np.where(keep, _np(o_sc), 0), np.where(keep, _np(r_sc), 0))
    assert not _np(o_sc)[np.broadcast_to(~keep, o_sc.shape)].any()
    _close(_np(o_out)[qmask], _np(r_out)[qmask])
    # An explicit query_mask= means the same thing here (Keras 3 would drop it silently).
    o_out2 = ours(q, v, query_mask=qmask)
    _close(o_out2, o_out)
    assert not np.allclose(_np(ref(q, v, query_mask=qmask))[~qmask], _np(o_out2)[~qmask])


@pytest.mark.parametrize("scores", [False, True])
def test_causal_never_dropped_with_dropout(scores):
    (x,) = _data((B, T, E))
    layer = mk.MultiHeadAttention(num_heads=2, key_dim=3, dropout=0.5, seed=1)
    x2 = x.copy()
    x2[:, -1] += 10.0  # change only the last position: with causality, earlier outputs cannot move
    a = layer(x, x, use_causal_mask=True, training=True, return_attention_scores=scores)
    b = layer(x2, x2, use_causal_mask=True, training=True, return_attention_scores=scores)
    if scores:
        (a, sa), (b, sb) = a, b
        upper = np.triu_indices(T, 1)
        assert not _np(sa)[..., upper[0], upper[1]].any() and not _np(sb)[..., upper[0], upper[1]].any()
    layer2 = mk.MultiHeadAttention.from_config(layer.get_config())
    layer2(x, x)
    layer2.set_weights(layer.get_weights())
    e1 = layer2(x, x, use_causal_mask=True)
    e2 = layer2(x2, x2, use_causal_mask=True)
    _close(_np(e1)[:, :-1], _np(e2)[:, :-1])
    assert _np(a).shape == _np(b).shape == (B, T, E)


def test_dropout_is_seeded_and_only_in_training():
    (x,) = _data((B, T, E))
    layer = mk.MultiHeadAttention(num_heads=2, key_dim=3, dropout=0.5, seed=3)
    ref = keras.layers.MultiHeadAttention(num_heads=2, key_dim=3, dropout=0.5, seed=3)
    ref(x, x)
    layer(x, x)
    layer.set_weights(ref.get_weights())
    _close(layer(x, x, training=False), ref(x, x, training=False))
    assert not np.allclose(_np(layer(x, x, training=True)), _np(layer(x, x, training=False)))


def test_fully_masked_rows_are_zero_with_finite_grads(route):
    import torch

    q, v = _data((B, T, E), (B, S, E))
    layer = mk.MultiHeadAttention(num_heads=2, key_dim=3, use_bias=False)
    mask = np.ones((B, T, S), bool)
    mask[0, 1] = False
    qt = torch.tensor(q, requires_grad=True)
    out, sc = layer(qt, v, attention_mask=mask, return_attention_scores=True)
    assert not _np(sc)[0, :, 1].any()
    assert not _np(out)[0, 1].any()
    out.sum().backward()
    assert torch.isfinite(qt.grad).all()


def test_config_round_trip_and_serialization(route):
    q, v = _data((B, T, E), (B, S, E))
    layer = mk.MultiHeadAttention(
        num_heads=2, key_dim=3, value_dim=4, output_shape=5, attention_axes=(1,), dropout=0.1,
        kernel_regularizer="l2", seed=4, name="mha",
    )  # fmt: skip
    out = layer(q, v)
    ref_cfg = keras.layers.MultiHeadAttention(
        num_heads=2, key_dim=3, value_dim=4, output_shape=5, attention_axes=(1,), dropout=0.1,
        kernel_regularizer="l2", seed=4, name="mha",
    ).get_config()  # fmt: skip
    assert set(layer.get_config()) == set(ref_cfg)
    clone = keras.saving.deserialize_keras_object(keras.saving.serialize_keras_object(layer))
    assert isinstance(clone, mk.MultiHeadAttention)
    clone(q, v)
    clone.set_weights(layer.get_weights())
    _close(clone(q, v), out)
    assert clone.get_config() == layer.get_config()
    assert len(layer.losses) == 4  # the l2 kernel regularizer on the four kernels, as in Keras


def test_import_multihead_does_not_import_keras():
    code = "import sys, multihead, multihead.compat; assert 'keras' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
