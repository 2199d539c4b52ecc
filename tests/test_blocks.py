"""The position-wise pieces of the blocks: the feed-forward network by its formula, `rowwise` against Keras's layer."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from keras_transformer.blocks import FeedForward, rowwise

SHAPE = (3, 5, 8)


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

    @tf.function(jit_compile=jit_compile)
    def outputs_and_gradients(apply):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = apply(x)
            loss = tf.reduce_sum(y * upstream)
        return [y] + tape.gradient(loss, [x] + norm.trainable_weights)

    got = outputs_and_gradients(lambda t: rowwise(norm, t))
    expected = outputs_and_gradients(norm)
    assert got[0].shape == SHAPE
    for g, e in zip(got, expected, strict=True):
        np.testing.assert_allclose(g, e, atol=1e-5)
