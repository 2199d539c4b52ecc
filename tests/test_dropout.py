"""Dropout: its 16-bit masks (Philox, Threefry under XLA) against the definition of dropout and Keras's layer."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from keras_transformer.dropout import Dropout, building_for_xla

RATE = 0.1
SHAPE = (256, 1024)


def keep_scale(rate):
    """1 / P(keep), with the drop probability rounded to a multiple of 2**-16 as documented."""
    return 1.0 / (1.0 - round(rate * 2**16) / 2**16)


def _run(layer, inputs, jit_compile, training=True):
    return tf.function(lambda x: layer(x, training=training), jit_compile=jit_compile)(inputs).numpy()


def _within_six_sigma(fraction, probability, count):
    return abs(fraction - probability) < 6 * np.sqrt(probability * (1 - probability) / count)


@pytest.mark.parametrize("jit_compile", [True, False])
@pytest.mark.parametrize("shape", [SHAPE, (257, 1023)])  # an odd size leaves half a word over
def test_drops_the_rate_and_scales_the_rest(jit_compile, shape):
    outputs = _run(Dropout(RATE, seed=1), tf.ones(shape), jit_compile)
    assert outputs.shape == shape
    # Binomial(n, 0.1): the standard deviation of the fraction is 0.0006.
    assert _within_six_sigma((outputs == 0).mean(), RATE, outputs.size)
    np.testing.assert_allclose(np.unique(outputs[outputs != 0]), [keep_scale(RATE)], rtol=1e-6)
    np.testing.assert_allclose(keep_scale(RATE), 1.0 / (1.0 - RATE), rtol=1e-5)  # quantisation is tiny


@pytest.mark.parametrize("rate", [RATE, 2**-16, 0.5])
def test_exactly_the_rounded_rate_of_all_16_bit_values_is_dropped(rate, monkeypatch):
    """Given every 16-bit value once as the random half-words, round(rate * 2**16) elements are dropped
    and the output sums to the input's sum: E[output] = input exactly, as documented. A statistical
    test cannot see a threshold off by one value (2**-16 of the rate)."""
    import keras_transformer.dropout as dropout_module

    every_value = tf.cast(tf.range(2**16), tf.uint16)
    monkeypatch.setattr(dropout_module, "_uniform_half_words", lambda shape, seed: tf.reshape(every_value, shape))
    outputs = _run(Dropout(rate, seed=1), tf.ones([2**16]), jit_compile=False).astype("float64")
    assert (outputs == 0).sum() == round(rate * 2**16)
    np.testing.assert_allclose(outputs.sum(), 2**16, rtol=1e-6)


@pytest.mark.parametrize("jit_compile, algorithm", [(True, 2), (False, 1)])  # RNG_ALG_THREEFRY, RNG_ALG_PHILOX
def test_the_mask_is_drawn_with_threefry_under_xla_and_philox_elsewhere(jit_compile, algorithm):
    layer = Dropout(RATE, seed=8)
    step = tf.function(lambda x: layer(x, training=True), jit_compile=jit_compile)
    graph = step.get_concrete_function(tf.TensorSpec(SHAPE)).graph
    draws = [op for op in graph.get_operations() if op.type == "StatelessRandomUniformFullIntV2"]
    assert {int(tf.get_static_value(op.inputs[3])) for op in draws} == {algorithm}


@pytest.mark.parametrize("jit_compile", [True, False])
def test_neighbours_are_dropped_independently(jit_compile):
    """The two 16-bit halves of one random word decide two neighbouring elements."""
    dropped = _run(Dropout(RATE, seed=7), tf.ones(SHAPE), jit_compile).reshape(-1, 2) == 0
    both = (dropped[:, 0] & dropped[:, 1]).mean()
    assert _within_six_sigma(both, RATE**2, len(dropped))  # 0.01; equal halves would give 0.1


@pytest.mark.parametrize("jit_compile", [True, False])
def test_a_rate_next_to_one_drops_everything_without_overflow(jit_compile):
    np.testing.assert_array_equal(_run(Dropout(1 - 2**-20), tf.ones(SHAPE), jit_compile), np.zeros(SHAPE))


@pytest.mark.parametrize("jit_compile", [True, False])
def test_the_mask_changes_between_calls(jit_compile):
    layer = Dropout(RATE, seed=2)
    step = tf.function(lambda x: layer(x, training=True), jit_compile=jit_compile)
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


@pytest.mark.parametrize("jit_compile", [True, False])
def test_noise_shape_broadcasts_the_mask(jit_compile):
    outputs = _run(Dropout(0.5, noise_shape=(None, 1), seed=3), tf.ones(SHAPE), jit_compile)
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
    np.testing.assert_allclose(gradient, (outputs != 0) * keep_scale(RATE), rtol=1e-6)


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
