"""Dropout: the XLA path (Threefry) against the definition of dropout and Keras's own layer."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from keras_transformer.dropout import Dropout, building_for_xla

RATE = 0.1
SHAPE = (256, 1024)


def _run(layer, inputs, jit_compile, training=True):
    return tf.function(lambda x: layer(x, training=training), jit_compile=jit_compile)(inputs).numpy()


@pytest.mark.parametrize("jit_compile", [True, False])
def test_drops_the_rate_and_scales_the_rest(jit_compile):
    outputs = _run(Dropout(RATE, seed=1), tf.ones(SHAPE), jit_compile)
    dropped = (outputs == 0).mean()
    # Binomial(n, 0.1): the standard deviation of the fraction is 0.0006; allow 6 of them.
    assert abs(dropped - RATE) < 6 * np.sqrt(RATE * (1 - RATE) / outputs.size)
    np.testing.assert_allclose(np.unique(outputs[outputs != 0]), [1.0 / (1.0 - RATE)], rtol=1e-6)


def test_the_mask_changes_between_calls_under_xla():
    layer = Dropout(RATE, seed=2)
    step = tf.function(lambda x: layer(x, training=True), jit_compile=True)
    first, second = step(tf.ones(SHAPE)).numpy(), step(tf.ones(SHAPE)).numpy()
    assert (first == 0).any() and ((first == 0) != (second == 0)).mean() > 0.1


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_inputs_under_xla(dtype):
    outputs = _run(Dropout(RATE, seed=6, dtype=dtype), tf.ones(SHAPE, dtype), True)
    assert outputs.dtype == np.dtype(tf.as_dtype(dtype).as_numpy_dtype)
    assert abs((outputs == 0).mean() - RATE) < 0.01


def test_inference_and_rates_zero_and_one():
    inputs = tf.random.normal(SHAPE)
    np.testing.assert_array_equal(_run(Dropout(RATE), inputs, True, training=False), inputs.numpy())
    np.testing.assert_array_equal(_run(Dropout(0.0), inputs, True), inputs.numpy())
    np.testing.assert_array_equal(_run(Dropout(1.0), inputs, True), np.zeros(SHAPE))


def test_noise_shape_broadcasts_the_mask_under_xla():
    outputs = _run(Dropout(0.5, noise_shape=(None, 1), seed=3), tf.ones(SHAPE), True)
    rows_dropped = (outputs == 0).all(axis=1)
    assert ((outputs == 0).any(axis=1) == rows_dropped).all()  # whole rows or nothing
    assert 0 < rows_dropped.sum() < SHAPE[0]


def test_gradient_is_the_mask_over_keep_probability():
    layer = Dropout(RATE, seed=4)
    inputs = tf.random.normal(SHAPE)

    @tf.function(jit_compile=True)
    def outputs_and_gradient(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = layer(x, training=True)
            total = tf.reduce_sum(y)
        return y, tape.gradient(total, x)

    outputs, gradient = (t.numpy() for t in outputs_and_gradient(inputs))
    np.testing.assert_allclose(gradient, (outputs != 0) / (1.0 - RATE), rtol=1e-6)


def test_building_for_xla_is_true_only_inside_compiled_functions():
    assert not building_for_xla()
    assert not tf.function(building_for_xla)()
    assert tf.function(building_for_xla, jit_compile=True)()


def test_is_a_keras_dropout_that_round_trips():
    layer = Dropout(RATE, noise_shape=(None, 1), seed=5, name="drop")
    assert isinstance(layer, keras.layers.Dropout)
    restored = keras.saving.deserialize_keras_object(keras.saving.serialize_keras_object(layer))
    assert type(restored) is Dropout
    assert restored.get_config() == layer.get_config()
