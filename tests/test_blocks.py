"""The blocks: the feed-forward network by its formula, LayerNorm and `rowwise` against Keras's
layer, and the residual wiring of the encoder and decoder layers against the paper's formulas."""

import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

from keras_transformer.blocks import DecoderLayer, EncoderLayer, FeedForward, LayerNormalization, rowwise
from keras_transformer.model import Decoder, Encoder

SHAPE = (3, 5, 8)


def _outputs_and_gradients(layer, apply, inputs, upstream, jit_compile):
    """`apply(*inputs)` and the gradients of sum(output * upstream) for the inputs and `layer`'s weights."""

    @tf.function(jit_compile=jit_compile)
    def run():
        with tf.GradientTape() as tape:
            tape.watch(inputs)
            y = apply(*inputs)
            loss = tf.reduce_sum(tf.cast(y, tf.float32) * upstream)
        return [y] + tape.gradient(loss, list(inputs) + layer.trainable_weights)

    return run()


def test_feed_forward_is_the_paper_formula():
    x = np.random.default_rng(0).normal(size=SHAPE).astype("float32")
    layer = FeedForward(8, 32)
    layer(x)
    w1, b1, w2, b2 = (w.numpy() for w in layer.weights)
    expected = np.maximum(0.0, x @ w1 + b1) @ w2 + b2
    np.testing.assert_allclose(layer(x), expected, atol=1e-5)


@pytest.mark.parametrize("jit_compile", [False, True])
def test_rowwise_layer_norm_equals_keras_layer_norm_forward_and_backward(jit_compile):
    rng = np.random.default_rng(1)
    x = tf.constant(rng.normal(size=SHAPE).astype("float32"))
    upstream = rng.normal(size=SHAPE).astype("float32")
    norm = keras.layers.LayerNormalization(epsilon=1e-6)
    norm.build(SHAPE)
    norm.set_weights([rng.normal(size=w.shape).astype("float32") for w in norm.get_weights()])

    got = _outputs_and_gradients(norm, lambda t: rowwise(norm, t), (x,), upstream, jit_compile)
    expected = _outputs_and_gradients(norm, norm, (x,), upstream, jit_compile)
    assert got[0].shape == SHAPE
    for g, e in zip(got, expected, strict=True):
        np.testing.assert_allclose(g, e, atol=1e-5)


def _norms_with_the_same_weights(rng, shape, **kwargs):
    ours = LayerNormalization(**kwargs)
    reference = keras.layers.LayerNormalization(**kwargs)
    for layer in (ours, reference):
        layer.build(shape)
    weights = [rng.normal(size=w.shape).astype("float32") for w in reference.get_weights()]
    ours.set_weights(weights)
    reference.set_weights(weights)
    return ours, reference


@pytest.mark.parametrize("jit_compile", [False, True])
@pytest.mark.parametrize("shape", [(24, 8), SHAPE])
def test_layer_norm_equals_keras_layer_norm_forward_and_backward(shape, jit_compile):
    rng = np.random.default_rng(4)
    x = tf.constant(rng.normal(loc=3.0, scale=2.0, size=shape).astype("float32"))
    upstream = rng.normal(size=shape).astype("float32")
    ours, reference = _norms_with_the_same_weights(rng, shape, epsilon=1e-6)
    got = _outputs_and_gradients(ours, ours, (x,), upstream, jit_compile)
    expected = _outputs_and_gradients(reference, reference, (x,), upstream, jit_compile)
    for g, e in zip(got, expected, strict=True):
        np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-5)


def test_layer_norm_under_mixed_precision_computes_in_float32_like_keras():
    rng = np.random.default_rng(5)
    x = tf.constant(rng.normal(size=SHAPE).astype("float32"))
    upstream = rng.normal(size=SHAPE).astype("float32")
    ours, reference = _norms_with_the_same_weights(rng, SHAPE, dtype="mixed_bfloat16")
    got = _outputs_and_gradients(ours, ours, (tf.cast(x, tf.bfloat16),), upstream, jit_compile=False)
    expected = _outputs_and_gradients(reference, reference, (tf.cast(x, tf.bfloat16),), upstream, jit_compile=False)
    assert got[0].dtype == expected[0].dtype == tf.bfloat16
    assert [g.dtype for g in got] == [e.dtype for e in expected]
    for g, e in zip(got, expected, strict=True):
        np.testing.assert_allclose(tf.cast(g, tf.float32), tf.cast(e, tf.float32), rtol=1e-2, atol=1e-2)


def test_layer_norm_in_float64_keeps_float64_precision_like_keras():
    """Inputs around 1e4 with a spread of 1: float32 statistics lose about 1e-6 of the normalized values."""
    rng = np.random.default_rng(7)
    x = tf.constant(rng.normal(loc=1e4, size=SHAPE))
    upstream = rng.normal(size=SHAPE)
    ours, reference = LayerNormalization(dtype="float64"), keras.layers.LayerNormalization(dtype="float64")
    for layer in (ours, reference):
        layer.build(SHAPE)
    weights = [rng.normal(size=w.shape) for w in reference.get_weights()]
    ours.set_weights(weights)
    reference.set_weights(weights)
    got = _outputs_and_gradients(ours, ours, (x,), upstream, jit_compile=False)
    expected = _outputs_and_gradients(reference, reference, (x,), upstream, jit_compile=False)
    assert got[0].dtype == tf.float64
    for g, e in zip(got, expected, strict=True):
        np.testing.assert_allclose(g, e, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("kwargs", [{"axis": 1}, {"center": False}, {"scale": False}])
def test_layer_norm_other_configurations_are_keras_layer_norm(kwargs):
    rng = np.random.default_rng(6)
    x = tf.constant(rng.normal(size=SHAPE).astype("float32"))
    upstream = rng.normal(size=SHAPE).astype("float32")
    ours, reference = _norms_with_the_same_weights(rng, SHAPE, **kwargs)
    got = _outputs_and_gradients(ours, ours, (x,), upstream, jit_compile=False)
    expected = _outputs_and_gradients(reference, reference, (x,), upstream, jit_compile=False)
    for g, e in zip(got, expected, strict=True):
        np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-5)


def _residual_formula(norm_first):
    """Sub-layer `f` with its norm: post-LN norm(x + f(x)) (paper, section 3.1), or pre-LN x + f(norm(x))."""
    if norm_first:
        return lambda x, f, norm: x + f(norm(x))
    return lambda x, f, norm: norm(x + f(x))


def _with_random_weights(layer, rng, *inputs):
    """`layer`, built on `inputs`, with every weight drawn from N(0, 1) (biases and gains included)."""
    layer(*inputs)
    layer.set_weights([rng.normal(size=w.shape).astype("float32") for w in layer.get_weights()])
    return layer


def _assert_all_close(got, expected):
    # Weights drawn from N(0, 1) make large activations and gradients: tolerances
    # relative to each tensor's scale (XLA's fused gradients round differently).
    for g, e in zip(got, expected, strict=True):
        np.testing.assert_allclose(g, e, rtol=1e-4, atol=1e-4 * max(1.0, float(np.abs(e).max())))


@pytest.mark.parametrize("training", [False, True])
@pytest.mark.parametrize("jit_compile", [False, True])
@pytest.mark.parametrize("norm_first", [False, True])
def test_encoder_layer_is_the_residual_formula_over_its_sublayers(norm_first, jit_compile, training):
    rng = np.random.default_rng(2)
    x = tf.constant(rng.normal(size=SHAPE).astype("float32"))
    upstream = rng.normal(size=SHAPE).astype("float32")
    # No dropout, so the training path must give the formula's result too.
    layer = _with_random_weights(EncoderLayer(8, 2, 16, dropout_rate=0.0, norm_first=norm_first), rng, x)
    residual = _residual_formula(norm_first)

    def by_formula(x):
        h = residual(x, lambda t: layer.self_attention(t, t), layer.self_attention_norm)
        return residual(h, layer.feed_forward, layer.feed_forward_norm)

    got = _outputs_and_gradients(layer, lambda x: layer(x, training=training), (x,), upstream, jit_compile)
    expected = _outputs_and_gradients(layer, by_formula, (x,), upstream, jit_compile)
    _assert_all_close(got, expected)


@pytest.mark.parametrize("training", [False, True])
@pytest.mark.parametrize("jit_compile", [False, True])
@pytest.mark.parametrize("norm_first", [False, True])
def test_decoder_layer_is_the_residual_formula_over_its_sublayers(norm_first, jit_compile, training):
    rng = np.random.default_rng(3)
    y = tf.constant(rng.normal(size=SHAPE).astype("float32"))
    memory = tf.constant(rng.normal(size=(3, 7, 8)).astype("float32"))
    upstream = rng.normal(size=SHAPE).astype("float32")
    layer = _with_random_weights(DecoderLayer(8, 2, 16, dropout_rate=0.0, norm_first=norm_first), rng, y, memory)
    residual = _residual_formula(norm_first)

    def by_formula(y, memory):
        h = residual(y, lambda t: layer.self_attention(t, t, use_causal_mask=True), layer.self_attention_norm)
        h = residual(h, lambda t: layer.cross_attention(t, memory), layer.cross_attention_norm)
        return residual(h, layer.feed_forward, layer.feed_forward_norm)

    inputs = (y, memory)
    got = _outputs_and_gradients(layer, lambda y, m: layer(y, m, training=training), inputs, upstream, jit_compile)
    expected = _outputs_and_gradients(layer, by_formula, inputs, upstream, jit_compile)
    _assert_all_close(got, expected)


def test_attention_scores_are_outputs_of_keras_functional_models():
    from keras_transformer import MultiHeadAttention

    rng = np.random.default_rng(9)
    target = rng.normal(size=(2, 5, 8)).astype("float32")
    source = rng.normal(size=(2, 7, 8)).astype("float32")
    attention, encoder, decoder = MultiHeadAttention(2), EncoderLayer(8, 2, 16), DecoderLayer(8, 2, 16)
    x, memory = keras.Input((None, 8)), keras.Input((7, 8))
    symbolic = [
        attention(x, memory, return_attention_scores=True),
        encoder(x, return_attention_scores=True),
        decoder(x, memory, return_attention_scores=True),
    ]
    model = keras.Model([x, memory], keras.tree.flatten(symbolic))
    functional = model([target, source])
    eager = keras.tree.flatten(
        [
            attention(target, source, return_attention_scores=True),
            encoder(target, return_attention_scores=True),
            decoder(target, source, return_attention_scores=True),
        ]
    )
    assert len(functional) == len(eager) == 7  # output and scores; output and scores; output and 2 scores
    for got, expected, spec in zip(functional, eager, keras.tree.flatten(symbolic), strict=True):
        assert spec.dtype == expected.dtype
        assert all(s is None or s == e for s, e in zip(spec.shape, expected.shape, strict=True))
        np.testing.assert_allclose(got, expected, atol=1e-6)


def _seq2seq_with_keras_masks(encoder, decoder, vocab=20, d_model=8):
    """Someone's functional encoder-decoder whose padding travels as Keras masks (`mask_zero=True`) only."""
    source_ids, target_ids = keras.Input((6,), dtype="int32"), keras.Input((5,), dtype="int32")
    embedding = keras.layers.Embedding(vocab, d_model, mask_zero=True)
    decoded = decoder(embedding(target_ids), encoder(embedding(source_ids)))
    return keras.Model([source_ids, target_ids], keras.layers.GlobalAveragePooling1D()(decoded)), embedding


@pytest.mark.parametrize("stack", [False, True], ids=["layers", "stacks"])
@pytest.mark.parametrize("norm_first", [False, True], ids=["post-LN", "pre-LN"])
def test_keras_masks_flow_through_encoder_and_decoder_layers_without_warnings(norm_first, stack):
    """The decoder's cross-attention hides the source padding that the encoder output's Keras mask marks.

    Reference: the same layers called eagerly with the masks passed explicitly, and a
    numpy mean over the real target positions for the masked pooling.
    """
    if stack:
        encoder = Encoder(2, 8, 2, 16, dropout_rate=0.0, norm_first=norm_first)
        decoder = Decoder(2, 8, 2, 16, dropout_rate=0.0, norm_first=norm_first)
    else:
        encoder = EncoderLayer(8, 2, 16, dropout_rate=0.0, norm_first=norm_first)
        decoder = DecoderLayer(8, 2, 16, dropout_rate=0.0, norm_first=norm_first)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, embedding = _seq2seq_with_keras_masks(encoder, decoder)
    assert not [str(w.message) for w in caught if "mask" in str(w.message)]

    rng = np.random.default_rng(11)
    source = rng.integers(1, 20, size=(2, 6))
    source[0, 3:] = 0
    target = rng.integers(1, 20, size=(2, 5))
    target[1, 2:] = 0
    source_real, target_real = source != 0, target != 0
    # numpy arrays carry no Keras masks: only the explicit ones apply.
    source_embedded, target_embedded = np.asarray(embedding(source)), np.asarray(embedding(target))
    memory = np.asarray(encoder(source_embedded, padding_mask=source_real))
    decoded = np.asarray(decoder(target_embedded, memory, encoder_padding_mask=source_real))
    expected = np.stack([decoded[i][target_real[i]].mean(axis=0) for i in range(2)])
    np.testing.assert_allclose(model([source, target]), expected, atol=1e-5)
    attending_to_padding = np.asarray(decoder(target_embedded, memory))
    assert not np.allclose(decoded[0], attending_to_padding[0], atol=1e-4)  # the source padding matters


def test_a_padding_mask_given_by_position_works_in_a_functional_model():
    layer = EncoderLayer(8, 2, 16, dropout_rate=0.0)
    rng = np.random.default_rng(21)
    x = rng.normal(size=(2, 5, 8)).astype("float32")
    padding = np.arange(5)[None, :] < np.array([5, 3])[:, None]
    inputs = [keras.Input((5, 8)), keras.Input((5,), dtype="bool")]
    model = keras.Model(inputs, layer(inputs[0], inputs[1]))
    np.testing.assert_allclose(model([x, padding]), layer(x, padding), atol=1e-6)


def _masked_embedding_model(layer_call, vocab=20, d_model=8):
    """`layer_call(embedded_target_with_keras_mask)` in a functional model, and its embedding."""
    ids = keras.Input((None,), dtype="int32")
    embedding = keras.layers.Embedding(vocab, d_model, mask_zero=True)
    return keras.Model(ids, layer_call(embedding(ids))), embedding


@pytest.mark.parametrize("norm_first", [False, True], ids=["post-LN", "pre-LN"])
def test_the_decoders_self_attention_hides_the_targets_keras_padding_in_both_norm_orders(norm_first):
    """Left padding marked by the Keras mask changes no real position: they equal the unpadded sequence's."""
    decoder = DecoderLayer(8, 2, 16, dropout_rate=0.0, norm_first=norm_first)
    memory = np.random.default_rng(22).normal(size=(1, 4, 8)).astype("float32")
    model, embedding = _masked_embedding_model(lambda x: decoder(x, memory))
    real = np.array([[5, 7, 3]])
    padded = np.concatenate([np.zeros((1, 2), int), real], axis=1)
    unpadded = np.asarray(decoder(np.asarray(embedding(real)), memory))  # a numpy input: no Keras mask
    np.testing.assert_allclose(np.asarray(model(padded))[:, 2:], unpadded, atol=1e-5)
    seeing_padding = np.asarray(decoder(np.asarray(embedding(padded)), memory))[:, 2:]
    assert not np.allclose(seeing_padding, unpadded, atol=1e-4)  # the padding would matter


@pytest.mark.parametrize("norm_first", [False, True], ids=["post-LN", "pre-LN"])
def test_an_explicit_padding_mask_and_the_keras_mask_both_apply_in_both_norm_orders(norm_first):
    encoder = EncoderLayer(8, 2, 16, dropout_rate=0.0, norm_first=norm_first)
    explicit = np.array([[True, False, True, True, True]])
    model, embedding = _masked_embedding_model(lambda x: encoder(x, padding_mask=explicit))
    ids = np.array([[4, 6, 9, 0, 0]])  # the Keras mask hides the last two
    expected = encoder(np.asarray(embedding(ids)), padding_mask=explicit & (ids != 0))
    np.testing.assert_allclose(model(ids), expected, atol=1e-5)


def test_a_keras_mask_with_a_decoding_cache_is_a_clear_error():
    decoder = DecoderLayer(8, 2, 16, dropout_rate=0.0, norm_first=True)
    memory = np.zeros((1, 4, 8), "float32")
    decoder(np.zeros((1, 1, 8), "float32"), memory)  # builds it
    cache = decoder.init_cache(memory, 6)
    embedded = keras.layers.Embedding(20, 8, mask_zero=True)(np.array([[3]]))
    with pytest.raises(ValueError, match="Keras mask of inputs covers the new tokens only"):
        decoder(embedded, cache=cache, cache_index=0)


def test_a_feed_forward_network_on_inputs_of_another_width_is_a_clear_error():
    with pytest.raises(ValueError, match=r"expects inputs of width d_model=8.*\(2, 5, 6\)"):
        FeedForward(8, 16)(np.zeros((2, 5, 6), "float32"))


def test_the_feed_forward_network_passes_the_keras_mask_on_without_a_warning():
    """Position-wise, so padding stays padding: masked pooling after it averages the real positions only."""
    feed_forward = FeedForward(8, 16)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, embedding = _masked_embedding_model(
            lambda x: keras.layers.GlobalAveragePooling1D()(feed_forward(x))
        )
    assert not [str(w.message) for w in caught if "mask" in str(w.message)]
    ids = np.array([[4, 6, 9, 0, 0], [3, 0, 0, 0, 0]])
    transformed = np.asarray(feed_forward(np.asarray(embedding(ids))))  # a numpy input: no Keras mask
    expected = np.stack([transformed[i][ids[i] != 0].mean(axis=0) for i in range(2)])
    np.testing.assert_allclose(model(ids), expected, atol=1e-6)
    assert not np.allclose(expected, transformed.mean(axis=1), atol=1e-3)  # the mask matters


@pytest.mark.parametrize("norm_first", [False, True], ids=["post-LN", "pre-LN"])
def test_cached_decoding_hides_the_source_padding_that_the_encoder_outputs_keras_mask_marks(norm_first):
    """`init_cache` keeps the memory's Keras mask: step by step, the decoder gives its uncached outputs."""
    rng = np.random.default_rng(23)
    embedding = keras.layers.Embedding(20, 8, mask_zero=True)
    encoder = EncoderLayer(8, 2, 16, dropout_rate=0.0, norm_first=norm_first)
    decoder = DecoderLayer(8, 2, 16, dropout_rate=0.0, norm_first=norm_first)
    source = np.array([[5, 7, 3, 0, 0, 0], [4, 9, 2, 8, 6, 0]])
    memory = encoder(embedding(source))  # carries the Keras mask source != 0
    target = rng.normal(size=(2, 4, 8)).astype("float32")
    explicit = np.asarray(decoder(target, np.asarray(memory), encoder_padding_mask=source != 0))
    np.testing.assert_allclose(decoder(target, memory), explicit, atol=1e-5)

    cache = decoder.init_cache(memory, max_decode_length=4)
    steps = []
    for i in range(4):
        output, cache = decoder(target[:, i : i + 1], cache=cache, cache_index=i)
        steps.append(np.asarray(output))
    np.testing.assert_allclose(np.concatenate(steps, axis=1), explicit, atol=1e-5)
    attending_to_padding = np.asarray(decoder(target, np.asarray(memory)))
    assert not np.allclose(attending_to_padding, explicit, atol=1e-4)  # the source padding matters


def test_a_new_decoder_layer_or_stack_decodes_from_init_cache_as_its_full_call():
    """`init_cache` builds a new layer from the memory's shape; then its steps are its uncached call."""
    rng = np.random.default_rng(29)
    memory = rng.normal(size=(2, 6, 8)).astype("float32")
    target = rng.normal(size=(2, 4, 8)).astype("float32")
    for decoder in (DecoderLayer(8, 2, 16), Decoder(num_layers=2, d_model=8, num_heads=2, d_ff=16)):
        cache = decoder.init_cache(memory, max_decode_length=4)
        steps = []
        for i in range(4):
            output, cache = decoder(target[:, i : i + 1], cache=cache, cache_index=i)
            steps.append(np.asarray(output))
        np.testing.assert_allclose(np.concatenate(steps, axis=1), decoder(target, memory), atol=1e-5)


def test_a_block_whose_sublayer_ran_first_builds_the_rest_and_keeps_that_sublayers_weights():
    """Calling a sub-layer first (to look at its attention, say) builds it; the block then builds the rest."""
    rng = np.random.default_rng(31)
    x = rng.normal(size=SHAPE).astype("float32")
    layer = EncoderLayer(8, 2, 16)
    layer.self_attention(x, x)
    attention_weights = [np.asarray(w) for w in layer.self_attention.weights]
    output = layer(x)
    for before, after in zip(attention_weights, layer.self_attention.weights, strict=True):
        np.testing.assert_array_equal(before, after)
    twin = EncoderLayer(8, 2, 16)
    twin(x)
    twin.set_weights(layer.get_weights())  # The same weights, none twice.
    np.testing.assert_allclose(output, twin(x), atol=1e-6)


# ---------------------------------------------------------------------------
# Where dropout sits, computed in numpy from the layers' weights
# ---------------------------------------------------------------------------


def _np_layer_norm(norm, x):
    x = x.astype("float64")
    mean, var = x.mean(axis=-1, keepdims=True), x.var(axis=-1, keepdims=True)
    return (x - mean) / np.sqrt(var + norm.epsilon) * np.asarray(norm.gamma) + np.asarray(norm.beta)


def _np_attention(attention, query, memory, causal=False, weights_mask=1.0):
    """softmax(Q K^T / sqrt(d_k)) V per head, then the output projection (section 3.2.2).

    `weights_mask` multiplies the attention weights: the attention dropout's mask.
    """
    w = {v.path.split("/")[-1]: np.asarray(v, "float64") for v in attention.weights}
    q = np.einsum("btd,dhk->bhtk", query, w["query_kernel"]) + w["query_bias"][None, :, None, :]
    k = np.einsum("bsd,dhk->bhsk", memory, w["key_kernel"]) + w["key_bias"][None, :, None, :]
    v = np.einsum("bsd,dhk->bhsk", memory, w["value_kernel"]) + w["value_bias"][None, :, None, :]
    logits = q @ np.swapaxes(k, -1, -2) / np.sqrt(q.shape[-1])
    if causal:
        logits = np.where(np.tril(np.ones(logits.shape[-2:], bool)), logits, -np.inf)
    weights = np.exp(logits - logits.max(axis=-1, keepdims=True))
    weights /= weights.sum(axis=-1, keepdims=True)
    weights = weights * weights_mask
    return np.einsum("bhtv,hvo->bto", weights @ v, w["output_kernel"]) + w["output_bias"]


def _np_feed_forward(feed_forward, x, hidden_mask=1.0):
    """max(0, x W1 + b1) W2 + b2; `hidden_mask` multiplies the inner activations (the activation dropout's mask)."""
    inner, outer = feed_forward.inner, feed_forward.outer
    hidden = np.maximum(0.0, x @ np.asarray(inner.kernel, "float64") + np.asarray(inner.bias))
    hidden = hidden * np.reshape(hidden_mask, hidden.shape) if np.ndim(hidden_mask) else hidden
    return hidden @ np.asarray(outer.kernel, "float64") + np.asarray(outer.bias)


def _np_residual(x, sublayer, norm, mask, norm_first):
    """The paper's LayerNorm(x + Dropout(Sublayer(x))), or pre-LN x + Dropout(Sublayer(LayerNorm(x)))."""
    if norm_first:
        return x + mask * sublayer(_np_layer_norm(norm, x))
    return _np_layer_norm(norm, x + mask * sublayer(x))


def _np_block(x, sublayers, masks, norm_first):
    """`x` through `(sublayer, norm)` pairs in turn, each wrapped by `_np_residual` with its dropout mask."""
    h = x.astype("float64")
    for (sublayer, norm), mask in zip(sublayers, masks, strict=True):
        h = _np_residual(h, sublayer, norm, mask, norm_first)
    return h


def _fix_dropout_masks(monkeypatch, rng, dropouts, shape):
    """Each of `dropouts` multiplies by its own fixed mask (0, or 1 / keep probability) in training.

    `shape`: the masks' shape, or a list of one shape per dropout.
    Returns the masks, in the order of `dropouts`.
    """
    masks = []
    shapes = shape if isinstance(shape, list) else [shape] * len(dropouts)
    for dropout, shape in zip(dropouts, shapes, strict=True):
        keep = rng.random(shape) >= dropout.rate
        mask = keep / (1.0 - dropout.rate)
        masks.append(mask)

        def call(inputs, training=False, mask=mask):
            return inputs * np.reshape(mask, inputs.shape).astype("float32") if training else inputs

        monkeypatch.setattr(dropout, "call", call)
    return masks


@pytest.mark.parametrize("norm_first", [False, True], ids=["post-LN", "pre-LN"])
def test_dropout_sits_on_each_encoder_sublayer_output_before_the_residual_add(norm_first, monkeypatch):
    rng = np.random.default_rng(31)
    x = rng.normal(size=SHAPE).astype("float32")
    layer = _with_random_weights(EncoderLayer(8, 2, 16, dropout_rate=0.3, norm_first=norm_first), rng, x)
    dropouts = [layer.self_attention_dropout, layer.feed_forward_dropout]
    masks = _fix_dropout_masks(monkeypatch, rng, dropouts, SHAPE)
    sublayers = [
        (lambda t: _np_attention(layer.self_attention, t, t), layer.self_attention_norm),
        (lambda t: _np_feed_forward(layer.feed_forward, t), layer.feed_forward_norm),
    ]

    _assert_all_close([layer(x, training=True)], [_np_block(x, sublayers, masks, norm_first)])
    _assert_all_close([layer(x, training=False)], [_np_block(x, sublayers, [1.0, 1.0], norm_first)])


@pytest.mark.parametrize("norm_first", [False, True], ids=["post-LN", "pre-LN"])
def test_dropout_sits_on_each_decoder_sublayer_output_before_the_residual_add(norm_first, monkeypatch):
    rng = np.random.default_rng(32)
    y = rng.normal(size=SHAPE).astype("float32")
    memory = rng.normal(size=(3, 7, 8)).astype("float32")
    layer = _with_random_weights(DecoderLayer(8, 2, 16, dropout_rate=0.3, norm_first=norm_first), rng, y, memory)
    dropouts = [layer.self_attention_dropout, layer.cross_attention_dropout, layer.feed_forward_dropout]
    masks = _fix_dropout_masks(monkeypatch, rng, dropouts, SHAPE)
    sublayers = [
        (lambda t: _np_attention(layer.self_attention, t, t, causal=True), layer.self_attention_norm),
        (lambda t: _np_attention(layer.cross_attention, t, memory.astype("float64")), layer.cross_attention_norm),
        (lambda t: _np_feed_forward(layer.feed_forward, t), layer.feed_forward_norm),
    ]

    _assert_all_close([layer(y, memory, training=True)], [_np_block(y, sublayers, masks, norm_first)])
    _assert_all_close([layer(y, memory, training=False)], [_np_block(y, sublayers, [1.0] * 3, norm_first)])


@pytest.mark.parametrize("norm_first", [False, True], ids=["post-LN", "pre-LN"])
def test_attention_and_activation_dropout_sit_on_the_attention_weights_and_the_inner_activations(
    norm_first, monkeypatch
):
    """Each attention's weights `[batch, heads, target, source]` and the FFN's `[tokens, d_ff]` get their own mask."""
    rng = np.random.default_rng(34)
    y = rng.normal(size=SHAPE).astype("float32")
    memory = rng.normal(size=(3, 7, 8)).astype("float32")
    layer = DecoderLayer(
        8, 2, 16, dropout_rate=0.3, attention_dropout_rate=0.2, activation_dropout_rate=0.4, norm_first=norm_first
    )
    layer = _with_random_weights(layer, rng, y, memory)
    dropouts = [
        layer.self_attention_dropout, layer.cross_attention_dropout, layer.feed_forward_dropout,
        layer.self_attention.dropout, layer.cross_attention.dropout, layer.feed_forward.dropout,
    ]
    assert [d.rate for d in dropouts] == [0.3, 0.3, 0.3, 0.2, 0.2, 0.4]
    shapes = [SHAPE] * 3 + [(3, 2, 5, 5), (3, 2, 5, 7), (15, 16)]
    *residual, self_weights, cross_weights, hidden = _fix_dropout_masks(monkeypatch, rng, dropouts, shapes)
    sublayers = [
        (lambda t: _np_attention(layer.self_attention, t, t, causal=True, weights_mask=self_weights),
         layer.self_attention_norm),
        (lambda t: _np_attention(layer.cross_attention, t, memory.astype("float64"), weights_mask=cross_weights),
         layer.cross_attention_norm),
        (lambda t: _np_feed_forward(layer.feed_forward, t, hidden_mask=hidden), layer.feed_forward_norm),
    ]

    _assert_all_close([layer(y, memory, training=True)], [_np_block(y, sublayers, residual, norm_first)])
    inference = [
        (lambda t: _np_attention(layer.self_attention, t, t, causal=True), layer.self_attention_norm),
        (lambda t: _np_attention(layer.cross_attention, t, memory.astype("float64")), layer.cross_attention_norm),
        (lambda t: _np_feed_forward(layer.feed_forward, t), layer.feed_forward_norm),
    ]
    _assert_all_close([layer(y, memory, training=False)], [_np_block(y, inference, [1.0] * 3, norm_first)])


# bfloat16 keeps 8 significant bits, float16 11: relative tolerances of a few of their roundings.
_HALF_PRECISION_TOLERANCES = {"mixed_bfloat16": 2e-2, "mixed_float16": 3e-3}


def _float32_and_mixed(make_layer, policy, *inputs):
    """`make_layer(dtype)` in float32 and under `policy`, with the same (float32) weights."""
    reference, mixed = make_layer("float32"), make_layer(policy)
    reference(*inputs)
    mixed(*inputs)
    mixed.set_weights(reference.get_weights())
    return reference, mixed


@pytest.mark.parametrize("policy", sorted(_HALF_PRECISION_TOLERANCES))
@pytest.mark.parametrize("norm_first", [False, True], ids=["post-LN", "pre-LN"])
@pytest.mark.parametrize("layer_class", [EncoderLayer, DecoderLayer])
def test_mixed_precision_blocks_compute_what_float32_computes_on_the_same_weights(layer_class, norm_first, policy):
    """Outputs in the half-precision compute dtype, attention weights in float32, both close to float32's."""
    rng = np.random.default_rng(33)
    x = rng.normal(size=(3, 5, 32)).astype("float32")
    inputs = (x,) if layer_class is EncoderLayer else (x, rng.normal(size=(3, 7, 32)).astype("float32"))
    reference, mixed = _float32_and_mixed(
        lambda dtype: layer_class(32, 4, 64, dropout_rate=0.0, norm_first=norm_first, dtype=dtype), policy, *inputs
    )
    expected, expected_scores = reference(*inputs, return_attention_scores=True)
    got, got_scores = mixed(*inputs, return_attention_scores=True)
    assert got.dtype == policy.split("_")[1]
    tolerance = _HALF_PRECISION_TOLERANCES[policy]
    np.testing.assert_allclose(
        keras.ops.cast(got, "float32"), expected, atol=tolerance * float(np.abs(expected).max())
    )
    for got_weights, expected_weights in zip(keras.tree.flatten(got_scores), keras.tree.flatten(expected_scores)):
        assert got_weights.dtype == "float32"
        np.testing.assert_allclose(got_weights, expected_weights, atol=tolerance)


@pytest.mark.parametrize("policy", sorted(_HALF_PRECISION_TOLERANCES))
def test_the_mixed_precision_feed_forward_network_computes_what_float32_computes(policy):
    x = np.random.default_rng(34).normal(size=(3, 5, 32)).astype("float32")
    reference, mixed = _float32_and_mixed(lambda dtype: FeedForward(32, 64, dtype=dtype), policy, x)
    expected = np.asarray(reference(x))
    got = mixed(x)
    assert got.dtype == policy.split("_")[1]
    tolerance = _HALF_PRECISION_TOLERANCES[policy]
    np.testing.assert_allclose(keras.ops.cast(got, "float32"), expected, atol=tolerance * np.abs(expected).max())
