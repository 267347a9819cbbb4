"""multihead.compat.keras.MultiHeadAttention against keras.layers.MultiHeadAttention, on one Keras backend.

The backend is fixed per process: this file runs on the one ``KERAS_BACKEND`` names (torch when unset, the
main test run); ``test_compat_keras_env.py`` runs it again in a fresh process per other backend.
"""

import os

os.environ.setdefault("KERAS_BACKEND", "torch")  # before keras is imported anywhere in this process

import numpy as np
import pytest

keras = pytest.importorskip("keras")  # the optional extra multihead[keras]; installed by requirements-dev
from keras import ops  # noqa: E402

import multihead.compat.keras as mk  # noqa: E402

BACKEND = keras.backend.backend()
B, T, S, E = 2, 3, 4, 6
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning")
#: the routes to compare: on torch, multihead.attention ("auto") and Keras's einsum math; elsewhere one route
IMPLS = ["auto", "einsum"] if BACKEND == "torch" else ["auto"]
#: for checks that are plain Python (argument and shape checks) or Keras's own machinery: the main run only
once = pytest.mark.skipif(BACKEND != "torch", reason="backend-independent: checked in the torch-backend run")


@pytest.fixture(params=IMPLS)
def impl(request):
    return request.param


def _np(x):
    return ops.convert_to_numpy(x)


def _pair(q, v, k=None, impl="auto", **kwargs):
    """Keras's layer and ours, built on the same inputs, ours holding Keras's weights."""
    ref = keras.layers.MultiHeadAttention(**kwargs)
    ours = mk.MultiHeadAttention(implementation=impl, **kwargs)
    for layer in (ref, ours):
        layer.build(q.shape, v.shape, None if k is None else k.shape)
    ours.set_weights(ref.get_weights())
    return ref, ours


def _close(a, b, atol=1e-5):
    np.testing.assert_allclose(_np(a), _np(b), atol=atol, rtol=1e-5)


def _data(*shapes, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(s).astype("float32") for s in shapes]


def _both(ref, ours, *args, **kwargs):
    """Outputs and scores of both layers for one call; the pairs are compared by the caller."""
    return ref(*args, return_attention_scores=True, **kwargs), ours(
        *args, return_attention_scores=True, **kwargs
    )


# ---- the differential grid ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(num_heads=2, key_dim=3),
        dict(num_heads=3, key_dim=2, value_dim=5, output_shape=7),
        dict(num_heads=2, key_dim=4, use_bias=False, output_shape=(2, 3)),
        dict(num_heads=2, key_dim=3, use_gate=True, dropout=0.5, seed=1),
    ],
    ids=["plain", "value_dim+output_shape", "no_bias+output_shape_tuple", "gate+dropout_in_inference"],
)
def test_same_weights_same_outputs_and_scores(kwargs, impl):
    q, v, k = _data((B, T, E), (B, S, 5), (B, S, 4))
    ref, ours = _pair(q, v, k, impl=impl, **kwargs)
    assert isinstance(ours, keras.layers.MultiHeadAttention)
    assert [w.path.split("/", 1)[1] for w in ours.weights] == [w.path.split("/", 1)[1] for w in ref.weights]
    for name, layer_name in [
        ("query", "query"),
        ("key", "key"),
        ("value", "value"),
        ("output", "attention_output"),
    ]:
        dense = getattr(ours, f"{name}_dense")
        assert isinstance(dense, keras.layers.EinsumDense) and dense.name == layer_name
        assert dense is getattr(ours, f"_{name}_dense")
    (r_out, r_sc), (o_out, o_sc) = _both(ref, ours, q, v, k, training=False)
    _close(o_out, r_out)
    _close(o_sc, r_sc)
    if BACKEND == "jax" and ours.value_dim != ours.key_dim:
        with pytest.raises(Exception, match="reshape"):  # Keras's fused path on JAX needs Dv == Dk
            ref(q, v, k)
        _close(ours(q, v, k), r_out)
    else:
        _close(ours(q, v, k), ref(q, v, k))  # no scores: Keras's fused path


@pytest.mark.parametrize(
    "shape, axes",
    [((B, 2, T, E), (2,)), ((B, 2, T, E), None), ((B, 2, T, E), (-3,)), ((B, 2, 2, T, E), (1, 3))],
    ids=["1d_inner", "2d_all", "1d_outer_negative", "2d_of_3"],
)
def test_attention_axes(shape, axes, impl):
    (x,) = _data(shape)
    ref, ours = _pair(x, x, impl=impl, num_heads=2, key_dim=3, attention_axes=axes)
    mask = np.random.default_rng(1).random(_np(ref(x, x, return_attention_scores=True)[1]).shape) > 0.3
    mask[..., 0] = True  # every query keeps a key  (a per-head mask of the scores' own shape)
    (r_out, r_sc), (o_out, o_sc) = _both(ref, ours, x, x, attention_mask=mask)
    assert tuple(o_sc.shape) == tuple(r_sc.shape)
    _close(o_out, r_out)
    _close(o_sc, r_sc)
    _close(ours(x, x), ref(x, x))


@pytest.mark.parametrize(
    "mask_shape, causal, t",
    [
        ((B, T, S), False, T),
        ((1, T, S), True, T),
        ((B, 1, S), False, T),
        ((B, 2, T, S), True, T),
        (None, True, S),
    ],
    ids=["BTS", "1TS+causal", "B1S", "per_head+causal", "causal_only_self"],
)
def test_masks_and_causal(mask_shape, causal, t, impl):
    q, v = _data((B, t, E), (B, S, E))
    ref, ours = _pair(q, v, impl=impl, num_heads=2, key_dim=3)
    kw = dict(use_causal_mask=causal)
    if mask_shape is not None:
        mask = np.random.default_rng(2).random(mask_shape) > 0.4
        mask[..., 0] = True
        kw.update(
            attention_mask=mask,
            value_mask=np.array([[1, 1, 0, 1], [1, 1, 1, 0]], bool),
            key_mask=np.array([[1, 0, 1, 1], [1, 1, 1, 1]], bool),
        )
    (r_out, r_sc), (o_out, o_sc) = _both(ref, ours, q, v, **kw)
    _close(o_out, r_out)
    _close(o_sc, r_sc)
    _close(ours(q, v, **kw), ref(q, v, **kw))


def test_causal_with_fewer_queries_is_top_left(impl):
    q, v = _data((B, 2, E), (B, 5, E))
    ref, ours = _pair(q, v, impl=impl, num_heads=2, key_dim=3)
    (r_out, r_sc), (o_out, o_sc) = _both(ref, ours, q, v, use_causal_mask=True)
    _close(o_out, r_out)
    _close(o_sc, r_sc)
    np.testing.assert_array_equal(_np(o_sc)[0, 0] > 0, [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0]])
    _close(ours(q, v, use_causal_mask=True), ref(q, v, use_causal_mask=True))


def test_keras_masks_from_embedding(impl):
    """Padding masks made by Embedding(mask_zero=True) flow into both layers in a functional model."""
    tokens = np.array([[3, 1, 4, 0, 0], [2, 7, 1, 8, 0]])  # 0 = padding
    valid = tokens != 0

    def model(layer):
        inp = keras.Input((5,), dtype="int32")
        x = keras.layers.Embedding(10, E, mask_zero=True, embeddings_initializer="ones", name="emb")(inp)
        out, scores = layer(x, x, return_attention_scores=True)
        return keras.Model(inp, [out, scores])

    x = np.random.default_rng(3).standard_normal((2, 5, E)).astype("float32")
    ref, ours = _pair(x, x, impl=impl, num_heads=2, key_dim=3)
    m_ref, m_ours = model(ref), model(ours)
    m_ref.get_layer("emb").set_weights([np.random.default_rng(4).standard_normal((10, E)).astype("float32")])
    m_ours.get_layer("emb").set_weights(m_ref.get_layer("emb").get_weights())
    (r_out, r_sc), (o_out, o_sc) = m_ref(tokens), m_ours(tokens)
    _close(_np(o_out)[valid], _np(r_out)[valid])  # padded query rows: Keras's own paths disagree, see docs
    _close(o_sc, r_sc)
    assert (
        not _np(o_sc).transpose(0, 2, 1, 3)[~valid].any()
    )  # a padded query attends to nothing: scores 0 ...
    dense_bias = _np(ours.output_dense.bias)
    _close(_np(o_out)[~valid], np.broadcast_to(dense_bias, _np(o_out)[~valid].shape))  # ... output = bias


def test_explicit_query_mask_is_honoured(impl):
    q, v = _data((B, T, E), (B, S, E))
    ref, ours = _pair(q, v, impl=impl, num_heads=2, key_dim=3)
    qmask = np.array([[1, 1, 0], [1, 0, 1]], bool)
    qt = ops.convert_to_tensor(q)
    mk.set_keras_mask(qt, ops.convert_to_tensor(qmask))
    via_keras_mask = ours(qt, v, return_attention_scores=True)
    explicit = ours(q, v, query_mask=qmask, return_attention_scores=True)
    _close(explicit[0], via_keras_mask[0])
    _close(explicit[1], via_keras_mask[1])
    # Keras 3 drops an explicit query_mask= (it reads only the tensor's Keras mask): every row attends.
    ref_scores = _np(ref(q, v, query_mask=qmask, return_attention_scores=True)[1])  # (B, H, T, S)
    assert ref_scores.transpose(0, 2, 1, 3)[~qmask].any()


def test_fully_masked_rows_are_zero_with_finite_grads(impl):
    q, v = _data((B, T, E), (B, S, E))
    ref, ours = _pair(q, v, impl=impl, num_heads=2, key_dim=3, use_bias=False)
    mask = np.ones((B, T, S), bool)
    mask[0, 1] = False
    out, sc = ours(q, v, attention_mask=mask, return_attention_scores=True)
    assert not _np(sc)[0, :, 1].any() and not _np(out)[0, 1].any()
    assert not _np(ours(q, v, attention_mask=mask))[0, 1].any()  # the fused path too
    # Keras: zeros where it returns scores, a uniform average of the values on its fused path.
    assert not _np(ref(q, v, attention_mask=mask, return_attention_scores=True)[0])[0, 1].any()
    assert _np(ref(q, v, attention_mask=mask))[0, 1].any()
    grad = _grad_of_sum(lambda x: ours(x, v, attention_mask=mask), q)
    assert np.isfinite(grad).all() and np.abs(grad).sum() > 0


def _grad_of_sum(fn, x):
    """d sum(fn(x)) / dx on the current backend, as numpy."""
    if BACKEND == "torch":
        import torch

        xt = torch.tensor(x, requires_grad=True)
        fn(xt).sum().backward()
        return xt.grad.numpy()
    if BACKEND == "jax":
        import jax

        return np.asarray(jax.grad(lambda a: fn(a).sum())(x))
    import tensorflow as tf

    xt = tf.constant(x)
    with tf.GradientTape() as tape:
        tape.watch(xt)
        y = tf.reduce_sum(fn(xt))
    return tape.gradient(y, xt).numpy()


def test_dropout_in_training_matches_keras_with_the_same_seed():
    (x,) = _data((B, T, E))
    ref, ours = _pair(x, x, num_heads=2, key_dim=3, dropout=0.5, seed=3)
    _close(ours(x, x, training=False), ref(x, x, training=False))
    a, b = ours(x, x, training=True), ref(x, x, training=True)
    _close(a, b)  # the same Dropout(seed=3) on the same (B, H, T, S) weights draws the same mask
    assert not np.allclose(_np(a), _np(ours(x, x, training=False)))


# ---- symbolic calls, fit, saving --------------------------------------------------------------------------


def _functional(layer, t=T, s=S, scores=True):
    qi, vi = keras.Input((t, E), name="q"), keras.Input((s, E), name="v")
    res = layer(qi, vi, return_attention_scores=scores)
    return keras.Model([qi, vi], list(res) if scores else res), res


def test_symbolic_call_with_scores_builds_a_functional_model(impl):
    q, v = _data((B, T, E), (B, S, E))
    ref, ours = _pair(q, v, impl=impl, num_heads=2, key_dim=3)
    m_ours, (out_t, sc_t) = _functional(ours)
    m_ref, _ = _functional(ref)
    assert tuple(out_t.shape) == (None, T, E) and tuple(sc_t.shape) == (
        None,
        2,
        T,
        S,
    )  # Keras says (.., T, T)
    (o_out, o_sc), (r_out, r_sc) = m_ours([q, v]), m_ref([q, v])
    _close(o_out, r_out)
    _close(o_sc, r_sc)
    assert tuple(_np(o_sc).shape) == (B, 2, T, S)


def test_fit_moves_both_layers_alike():
    q, v = _data((B, T, E), (B, S, E))
    (y,) = _data((B, T, E), seed=5)
    ref, ours = _pair(q, v, num_heads=2, key_dim=3)
    models = []
    for layer in (ref, ours):
        model, _ = _functional(layer, scores=False)
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
        model.fit([q, v], y, epochs=3, batch_size=B, shuffle=False, verbose=0)
        models.append(model)
    for w_ref, w_ours in zip(ref.get_weights(), ours.get_weights()):
        np.testing.assert_allclose(w_ours, w_ref, atol=1e-5, rtol=1e-5)
    assert not np.allclose(ours.get_weights()[0], _pair(q, v, num_heads=2, key_dim=3)[0].get_weights()[0])


def test_save_and_load_keras_file_and_config(tmp_path, impl):
    q, v = _data((B, T, E), (B, S, E))
    layer = mk.MultiHeadAttention(
        num_heads=2, key_dim=3, value_dim=4, output_shape=5, attention_axes=(1,), dropout=0.1,
        kernel_regularizer="l2", seed=4, name="mha", implementation=impl,
    )  # fmt: skip
    model, _ = _functional(layer)
    ref_cfg = keras.layers.MultiHeadAttention(
        num_heads=2, key_dim=3, value_dim=4, output_shape=5, attention_axes=(1,), dropout=0.1,
        kernel_regularizer="l2", seed=4, name="mha",
    ).get_config()  # fmt: skip
    cfg = layer.get_config()
    assert set(cfg) - set(ref_cfg) == {"implementation"} and set(ref_cfg) <= set(cfg)
    assert mk.MultiHeadAttention.from_config(cfg).get_config() == cfg
    assert len(layer.losses) == 4  # the l2 kernel regularizer on the four kernels, as in Keras
    path = tmp_path / "model.keras"
    model.save(path)
    loaded = keras.saving.load_model(path)
    assert isinstance(loaded.get_layer("mha"), mk.MultiHeadAttention)
    assert loaded.get_layer("mha").implementation == impl
    for a, b in zip(loaded([q, v]), model([q, v])):
        _close(a, b)


# ---- extension points, LoRA, quantization -----------------------------------------------------------------


def _biased_subclass(base):
    """A subclass in the style of KerasHub's: its own ``_compute_attention`` from Keras's building blocks."""

    class Biased(base):
        def _compute_attention(self, query, key, value, attention_mask=None, training=None, *args, **kwargs):
            query = ops.multiply(query, ops.cast(self._inverse_sqrt_key_dim, query.dtype))
            scores = ops.einsum(self._dot_product_equation, key, query)  # (B, H, T, S)
            scores = scores + 0.5 * ops.cast(
                ops.arange(ops.shape(scores)[-1]), scores.dtype
            )  # favour late keys
            scores = self._masked_softmax(scores, attention_mask)
            scores_dropout = self._dropout_layer(scores, training=training)
            return ops.einsum(self._combine_equation, scores_dropout, value), scores

    return Biased


def _cached_subclass(base):
    """KerasHub's cached attention: ``call`` over the projections with a key/value cache (B, 2, S, H, D)."""

    class Cached(base):
        def call(self, query, value, key=None, attention_mask=None, cache=None, cache_update_index=None):
            key = value if key is None else key
            query = self._query_dense(query)
            k_new, v_new = self._key_dense(key), self._value_dense(value)
            if cache is not None:
                start = [0, cache_update_index, 0, 0]
                k_new = ops.slice_update(cache[:, 0], start, k_new)
                v_new = ops.slice_update(cache[:, 1], start, v_new)
                cache = ops.stack((k_new, v_new), axis=1)
            out, _ = self._compute_attention(query, k_new, v_new, attention_mask=attention_mask)
            return self._output_dense(out), cache

    return Cached


def test_subclass_overriding_compute_attention_works_unchanged(impl):
    q, v = _data((B, T, E), (B, S, E))
    mask = np.random.default_rng(6).random((B, T, S)) > 0.3
    mask[..., 0] = True
    ref = _biased_subclass(keras.layers.MultiHeadAttention)(num_heads=2, key_dim=3)
    ours = _biased_subclass(mk.MultiHeadAttention)(num_heads=2, key_dim=3, implementation=impl)
    ref(q, v)
    ours(q, v)
    ours.set_weights(ref.get_weights())
    for causal in (False, True):  # causal: the subclass gets the mask (no native-causal shortcut)
        (r_out, r_sc), (o_out, o_sc) = _both(ref, ours, q, v, attention_mask=mask, use_causal_mask=causal)
        _close(o_out, r_out)
        _close(o_sc, r_sc)
    plain = mk.MultiHeadAttention(num_heads=2, key_dim=3)
    plain(q, v)
    plain.set_weights(ref.get_weights())
    assert not np.allclose(_np(ours(q, v)), _np(plain(q, v)))  # the override is really used

    x = _data((B, S, E), seed=7)[0]
    c_ref = _cached_subclass(keras.layers.MultiHeadAttention)(num_heads=2, key_dim=3)
    c_ours = _cached_subclass(mk.MultiHeadAttention)(num_heads=2, key_dim=3, implementation=impl)
    for layer in (c_ref, c_ours):
        layer.build(x.shape, x.shape)
    c_ours.set_weights(c_ref.get_weights())
    cache = np.zeros((B, 2, S, 2, 3), "float32")
    step = ops.convert_to_tensor(np.tril(np.ones((S, S), bool))[None, 1:2])  # query 1 sees keys 0..1
    (r_out, r_cache), (o_out, o_cache) = (
        layer(x[:, 1:2], x[:, 1:2], attention_mask=step, cache=cache, cache_update_index=1)
        for layer in (c_ref, c_ours)
    )
    _close(o_out, r_out)
    _close(o_cache, r_cache)


def test_enable_lora_trains_only_adapters_and_reloads(tmp_path):
    q, v = _data((B, T, E), (B, S, E))
    (y,) = _data((B, T, E), seed=8)
    layer = mk.MultiHeadAttention(num_heads=2, key_dim=3, name="mha")
    model, _ = _functional(layer, scores=False)
    base = [np.array(_np(w)) for w in layer.weights]
    layer.enable_lora(4)
    names = sorted(w.path.split("/", 1)[1] for w in layer.trainable_weights)
    assert names == sorted(
        f"{d}/lora_kernel_{ab}" for d in ("query", "key", "value", "attention_output") for ab in "ab"
    )
    model.compile(optimizer=keras.optimizers.SGD(0.5), loss="mse")
    before = _np(model([q, v]))
    model.fit([q, v], y, epochs=3, batch_size=B, verbose=0)
    after = _np(model([q, v]))
    assert not np.allclose(after, before)  # the adapters learnt something ...
    for w, b in zip([w for w in layer.weights if "lora" not in w.path], base):
        np.testing.assert_array_equal(_np(w), b)  # ... and no base weight moved
    path = tmp_path / "lora.keras"
    model.save(path)
    loaded = keras.saving.load_model(path)
    _close(loaded([q, v]), after)  # Keras saves the LoRA-merged kernels


@once
def test_quantize_int8_like_keras():
    q, v = _data((B, T, E), (B, S, E))
    ref, ours = _pair(q, v, num_heads=2, key_dim=3)
    m_ref, _ = _functional(ref, scores=False)
    m_ours, _ = _functional(ours, scores=False)
    for m in (m_ref, m_ours):
        m.quantize("int8")
    assert ours.query_dense.quantization_mode == "int8"
    _close(m_ours([q, v]), m_ref([q, v]))


# ---- bad input: errors at construction or build time, naming the argument ---------------------------------


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(num_heads=0, key_dim=2), "num_heads"),
        (dict(num_heads=True, key_dim=2), "num_heads"),
        (dict(num_heads=2, key_dim=-1), "key_dim"),
        (dict(num_heads=2, key_dim=2.0), "key_dim"),
        (dict(num_heads=2, key_dim=2, value_dim=0), "value_dim"),
        (dict(num_heads=2, key_dim=2, dropout=1.0), "dropout"),
        (dict(num_heads=2, key_dim=2, dropout=-0.1), "dropout"),
        (dict(num_heads=2, key_dim=2, output_shape=(3, 0)), "output_shape"),
        (dict(num_heads=2, key_dim=2, output_shape=-4), "output_shape"),
        (dict(num_heads=2, key_dim=2, output_shape="7"), "output_shape"),
        (dict(num_heads=2, key_dim=2, attention_axes="1"), "attention_axes"),
        (dict(num_heads=2, key_dim=2, sliding_window=0), "sliding_window"),
        (dict(num_heads=2, key_dim=2, implementation="fast"), "implementation"),
        (dict(num_heads=2, key_dim=2, dropout=0.1, flash_attention=True), "dropout"),
    ],
)
@once
def test_bad_arguments_raise_at_construction_in_keras_form(kwargs, name):
    with pytest.raises(ValueError, match=name):
        mk.MultiHeadAttention(**kwargs)
    keras_text_then_ours = {  # Keras's own words for these three, then the library's guidance
        "output_shape": r"^Invalid `output_shape`: .* should be of type tuple, list, or int\. It must be",
        "attention_axes": r"^`attention_axes` must be an int, list, or tuple\.Received: .* Pass `None`",
        "sliding_window": r"^`sliding_window` must be `None` or a positive integer\. Received: .* at least 1",
    }
    if name in keras_text_then_ours:
        with pytest.raises(ValueError, match=keras_text_then_ours[name]):
            mk.MultiHeadAttention(**kwargs)
    elif "flash_attention" not in kwargs:  # that one is Keras's own check and message
        with pytest.raises(
            ValueError, match=rf"Received an invalid value for argument `{name}`.*Received: {name}="
        ):
            mk.MultiHeadAttention(**kwargs)


@pytest.mark.parametrize(
    "q_shape, v_shape, k_shape, axes, words",
    [
        (
            (B, T, E),
            (B, S, E),
            (B, S + 1, E),
            None,
            "dimensions of `value` and `key`, except the last one, must be",
        ),
        ((B, T, E), (B + 1, S, E), None, None, "query and value"),
        ((B, 2, T, E), (B, 3, S, E), None, (2,), "query and value"),
        ((B, T, E), (B, 2, S, E), None, None, "value must have the query's rank"),
        ((B, T, E), (B, S, E), (B, 2, S, E), None, "`value` and `key`.*must be equal.*key defaults to value"),
        ((B, T, E), (B, S, E), None, (2,), "attention_axes"),
        ((B, T, E), (B, S, E), None, (0,), "attention_axes"),
        ((B, 2, T, E), (B, 2, S, E), None, (1, -3), "attention_axes"),
        ((B, E), (B, E), None, None, "query must be at least"),
    ],
)
@once
def test_bad_shapes_raise_at_build_time(q_shape, v_shape, k_shape, axes, words):
    layer = mk.MultiHeadAttention(num_heads=2, key_dim=3, attention_axes=axes)
    with pytest.raises(ValueError, match=words):
        layer.build(q_shape, v_shape, k_shape)
    assert not layer.built
    if q_shape[0] != v_shape[0]:
        return  # keras.Input has no batch size to disagree on
    with pytest.raises(ValueError, match=words):  # and when a functional model is wired up
        inputs = [keras.Input(s[1:]) for s in (q_shape, v_shape, k_shape) if s is not None]
        mk.MultiHeadAttention(num_heads=2, key_dim=3, attention_axes=axes)(*inputs)


def test_flash_attention_refuses_scores_like_keras():
    q, v = _data((B, T, E), (B, S, E))
    layer = mk.MultiHeadAttention(num_heads=2, key_dim=3, flash_attention=True)
    for args in ((q, v), (keras.Input((T, E)), keras.Input((S, E)))):  # eager and symbolic
        with pytest.raises(
            ValueError, match="Returning attention scores is not supported.*flash_attention=False"
        ):
            layer(*args, return_attention_scores=True)
    ref = keras.layers.MultiHeadAttention(num_heads=2, key_dim=3, flash_attention=True)
    ref.build(q.shape, v.shape)
    layer.set_weights(ref.get_weights())
    if (
        BACKEND == "torch"
    ):  # the fused kernel is multihead.attention's choice (Keras's torch path refuses on CPU)
        plain = mk.MultiHeadAttention(num_heads=2, key_dim=3)
        plain.build(q.shape, v.shape)
        plain.set_weights(ref.get_weights())
        _close(layer(q, v), plain(q, v))
        return
    try:  # elsewhere Keras's own flash kernel runs: ours works exactly where Keras's does
        expected = ref(q, v)
    except Exception as e:
        with pytest.raises(type(e)):
            layer(q, v)
    else:
        _close(layer(q, v), expected)


def test_causal_with_several_attention_axes_is_refused():
    (x,) = _data((B, 2, T, E))
    layer = mk.MultiHeadAttention(num_heads=2, key_dim=3, attention_axes=(1, 2))
    with pytest.raises(ValueError, match="use_causal_mask needs one attention axis"):
        layer(x, x, use_causal_mask=True, return_attention_scores=True)


def test_causal_follows_the_attention_axis(impl):
    """attention_axes=(2,) on (B, X, T, E): causal over T (Keras would lay it over X, axis 1)."""
    (x,) = _data((B, 2, T, E))
    layer = mk.MultiHeadAttention(num_heads=2, key_dim=3, attention_axes=(2,), implementation=impl)
    _, sc = layer(x, x, use_causal_mask=True, return_attention_scores=True)  # (B, X, H, T, T)
    upper = np.triu_indices(T, 1)
    assert not _np(sc)[..., upper[0], upper[1]].any()
    _close(layer(x, x, use_causal_mask=True), layer(x, x, attention_mask=np.tril(np.ones((T, T), bool))))


def test_keras_mask_adapter_reads_what_keras_attaches():
    """The one private Keras use (module docstring): if Keras moves it, this says which Keras broke it."""
    ids = np.array([[3, 1, 0, 0], [2, 0, 0, 0]])
    x = keras.layers.Embedding(5, 4, mask_zero=True)(ids)  # public API attaches a Keras mask
    got = mk.get_keras_mask(x)
    assert got is not None, f"Keras {keras.version()}: get_keras_mask no longer finds Embedding's mask"
    np.testing.assert_array_equal(ops.convert_to_numpy(got), ids != 0, err_msg=f"Keras {keras.version()}")
    mk.set_keras_mask(x, None)
    assert mk.get_keras_mask(x) is None, f"Keras {keras.version()}: set_keras_mask(x, None) left a mask"
