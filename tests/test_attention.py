"""MultiHeadAttention against Keras's own layer, and its cache against full attention."""

import numpy as np
import pytest
import keras
import tensorflow as tf

from keras_transformer import MultiHeadAttention, causal_mask, padding_mask

D_MODEL, HEADS = 16, 4


def copied_pair(seed=0):
    """Our layer and `keras.layers.MultiHeadAttention` with the same weights."""
    rng = np.random.default_rng(seed)
    query = rng.normal(size=(2, 5, D_MODEL)).astype("float32")
    value = rng.normal(size=(2, 7, D_MODEL)).astype("float32")
    ours = MultiHeadAttention(HEADS)
    ours(query, value)
    theirs = keras.layers.MultiHeadAttention(HEADS, key_dim=D_MODEL // HEADS)
    theirs(query, value)
    # Random biases too, so a mix-up of bias and kernel order would show.
    weights = [rng.normal(size=w.shape).astype("float32") * 0.3 for w in ours.get_weights()]
    ours.set_weights(weights)
    theirs.set_weights(weights)
    return ours, theirs, query, value


def test_matches_keras_multi_head_attention_without_mask():
    ours, theirs, query, value = copied_pair()
    out, scores = ours(query, value, return_attention_scores=True)
    expected, expected_scores = theirs(query, value, return_attention_scores=True)
    np.testing.assert_allclose(out, expected, atol=1e-5)
    np.testing.assert_allclose(scores, expected_scores, atol=1e-6)


def test_self_attention_matches_keras_multi_head_attention():
    # query is value: ours projects Q, K and V in one matmul, Keras in three.
    ours, theirs, query, _ = copied_pair(seed=6)
    out, scores = ours(query, query, use_causal_mask=True, return_attention_scores=True)
    expected, expected_scores = theirs(query, query, use_causal_mask=True, return_attention_scores=True)
    np.testing.assert_allclose(out, expected, atol=1e-5)
    np.testing.assert_allclose(scores, expected_scores, atol=1e-6)
    np.testing.assert_allclose(out, ours(query, np.array(query), use_causal_mask=True), atol=1e-5)


@pytest.mark.parametrize("self_attention", [True, False])
@pytest.mark.parametrize("jit_compile", [False, True])
def test_gradients_match_keras_multi_head_attention(self_attention, jit_compile):
    """Backward too: ours joins the projections (and their biases), Keras keeps them apart."""
    ours, theirs, query, value = copied_pair(seed=7)
    if self_attention:
        value = query
    upstream = np.random.default_rng(7).normal(size=query.shape).astype("float32")

    def gradients(layer):
        @tf.function(jit_compile=jit_compile)
        def run(query, value):
            with tf.GradientTape() as tape:
                tape.watch([query, value])
                value_in = query if self_attention else value  # self-attention: the same tensor
                loss = tf.reduce_sum(layer(query, value_in, use_causal_mask=self_attention) * upstream)
            return tape.gradient(loss, [query, value] + layer.trainable_weights)

        return run(tf.constant(query), tf.constant(value))

    expected = gradients(theirs)
    assert len(expected) == 2 + 8
    for got, want in zip(gradients(ours), expected, strict=True):
        if want is None:  # the unused `value` input of self-attention
            continue
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)


def test_a_key_sequence_other_than_the_values_matches_keras_multi_head_attention():
    """Keys projected from `key`, values from `value`; called, and as a projected fixed memory."""
    ours, theirs, query, value = copied_pair(seed=11)
    key = np.random.default_rng(11).normal(size=value.shape).astype("float32")
    out, scores = ours(query, value, key=key, return_attention_scores=True)
    expected, expected_scores = theirs(query, value, key=key, return_attention_scores=True)
    np.testing.assert_allclose(out, expected, atol=1e-5)
    np.testing.assert_allclose(scores, expected_scores, atol=1e-6)
    from_memory, _ = ours(query, value, cache=ours.project_key_value(value, key))
    np.testing.assert_allclose(from_memory, expected, atol=1e-5)
    assert not np.allclose(out, ours(query, value), atol=1e-3)  # the key matters here


def test_matches_keras_multi_head_attention_with_attention_mask():
    ours, theirs, query, value = copied_pair(seed=1)
    rng = np.random.default_rng(1)
    mask = rng.random((2, 5, 7)) > 0.4
    mask[..., 0] = True  # every query keeps at least one key
    out = ours(query, value, attention_mask=mask)
    expected = theirs(query, value, attention_mask=mask)
    np.testing.assert_allclose(out, expected, atol=1e-5)


def test_matches_keras_multi_head_attention_with_causal_mask():
    ours, theirs, query, _ = copied_pair(seed=2)
    out = ours(query, query, use_causal_mask=True)
    expected = theirs(query, query, use_causal_mask=True)
    np.testing.assert_allclose(out, expected, atol=1e-5)


def test_padding_mask_hides_masked_keys():
    ours, _, query, value = copied_pair(seed=3)
    mask = np.ones((2, 1, 7), bool)
    mask[:, :, 4:] = False
    changed = value.copy()
    changed[:, 4:] = np.random.default_rng(3).normal(size=changed[:, 4:].shape)
    np.testing.assert_allclose(
        ours(query, value, attention_mask=mask), ours(query, changed, attention_mask=mask), atol=1e-6
    )
    _, scores = ours(query, value, attention_mask=mask, return_attention_scores=True)
    assert np.all(np.asarray(scores)[..., 4:] < 1e-6)


def _padded_value(value, real_lengths=(7, 4)):
    """`value` with zero rows after each sentence's real length, which `keras.layers.Masking` marks as padding."""
    padded = value.copy()
    for row, length in enumerate(real_lengths):
        padded[row, length:] = 0.0
    return padded


def test_keras_masks_of_the_values_hide_padded_keys_as_in_keras_multi_head_attention():
    """In someone's functional model, a Keras mask (here from `Masking`) hides padded keys, as in Keras's layer."""
    ours, theirs, query, value = copied_pair(seed=8)
    value = _padded_value(value)
    query_input, value_input = keras.Input((5, D_MODEL)), keras.Input((7, D_MODEL))
    masked_value = keras.layers.Masking(0.0)(value_input)
    ours_model, theirs_model = (
        keras.Model([query_input, value_input], layer(query_input, masked_value)) for layer in (ours, theirs)
    )
    out = ours_model([query, value])
    np.testing.assert_allclose(out, theirs_model([query, value]), atol=1e-5)
    key_padding = (np.arange(7)[None, :] < np.array([7, 4])[:, None])[:, None, :]
    np.testing.assert_allclose(out, ours(query, value, attention_mask=key_padding), atol=1e-6)
    assert not np.allclose(out, ours(query, value), atol=1e-3)  # the mask matters here


def test_keras_masks_of_a_separate_key_hide_padded_keys_as_in_keras_multi_head_attention():
    """The `key` input's Keras mask hides keys as the values' does (here the values carry none)."""
    ours, theirs, query, value = copied_pair(seed=14)
    key = _padded_value(np.random.default_rng(14).normal(size=value.shape).astype("float32"))
    inputs = [keras.Input((5, D_MODEL)), keras.Input((7, D_MODEL)), keras.Input((7, D_MODEL))]
    masked_key = keras.layers.Masking(0.0)(inputs[2])
    ours_model, theirs_model = (
        keras.Model(inputs, layer(inputs[0], inputs[1], key=masked_key)) for layer in (ours, theirs)
    )
    out = ours_model([query, value, key])
    np.testing.assert_allclose(out, theirs_model([query, value, key]), atol=1e-5)
    key_padding = (np.arange(7)[None, :] < np.array([7, 4])[:, None])[:, None, :]
    np.testing.assert_allclose(out, ours(query, value, key=key, attention_mask=key_padding), atol=1e-6)
    assert not np.allclose(out, ours(query, value, key=key), atol=1e-3)  # the mask matters here


def test_the_output_keeps_the_keras_mask_of_the_query():
    """A masked pooling after the attention averages the real query positions only."""
    ours, _, query, value = copied_pair(seed=9)
    query = _padded_value(query, real_lengths=(5, 2))
    query_input, value_input = keras.Input((5, D_MODEL)), keras.Input((7, D_MODEL))
    attended = ours(keras.layers.Masking(0.0)(query_input), value_input)
    pooled = keras.Model([query_input, value_input], keras.layers.GlobalAveragePooling1D()(attended))
    out = np.asarray(ours(query, value))
    expected = np.stack([out[0].mean(axis=0), out[1, :2].mean(axis=0)])
    np.testing.assert_allclose(pooled([query, value]), expected, atol=1e-5)


def test_keras_masks_with_a_growing_cache_are_a_clear_error():
    ours, _, query, _ = copied_pair(seed=10)
    cache = ours.empty_cache(2, 8)
    masked = keras.layers.Masking(0.0)(query[:, :1])
    with pytest.raises(ValueError, match="Keras masks of value/key cover the new tokens only"):
        ours(masked, masked, use_causal_mask=True, cache=cache, cache_index=0)


def test_cache_gives_the_same_outputs_as_full_causal_attention():
    ours, _, query, _ = copied_pair(seed=4)
    full = np.asarray(ours(query, query, use_causal_mask=True))
    length = query.shape[1]
    cache = ours.empty_cache(2, length)
    assert tuple(cache["key"].shape) == (2, HEADS, length, D_MODEL // HEADS)  # head-major
    for i in range(length):
        step = query[:, i : i + 1]
        out, cache = ours(step, step, use_causal_mask=True, cache=cache, cache_index=i)
        np.testing.assert_allclose(out[:, 0], full[:, i], atol=1e-5)


@pytest.mark.parametrize("use_causal_mask", [True, False])
def test_a_cache_extended_midway_keeps_its_positions_and_decodes_as_full_causal_attention(use_causal_mask):
    ours, _, query, _ = copied_pair(seed=12)
    full = np.asarray(ours(query, query, use_causal_mask=True))
    cache = ours.empty_cache(2, 2)
    out, cache = ours(query[:, :2], query[:, :2], use_causal_mask=True, cache=cache, cache_index=0)
    np.testing.assert_allclose(out, full[:, :2], atol=1e-5)
    longer = MultiHeadAttention.extend_cache(cache, query.shape[1])
    for name in ("key", "value"):
        assert longer[name].shape[2] == query.shape[1]
        np.testing.assert_array_equal(np.asarray(longer[name])[:, :, :2], np.asarray(cache[name]))
        np.testing.assert_array_equal(np.asarray(longer[name])[:, :, 2:], 0.0)
    for i in range(2, query.shape[1]):
        step = query[:, i : i + 1]
        out, longer = ours(step, step, use_causal_mask=use_causal_mask, cache=longer, cache_index=i)
        np.testing.assert_allclose(out[:, 0], full[:, i], atol=1e-5)


def test_fixed_memory_cache_equals_projecting_the_memory():
    ours, _, query, value = copied_pair(seed=5)
    memory = ours.project_key_value(value)
    out, _ = ours(query, None, cache=memory)
    np.testing.assert_allclose(out, ours(query, value), atol=1e-6)


@pytest.mark.parametrize("jit_compile", [False, True])
def test_queries_sharing_a_memory_row_match_keras_with_the_memory_repeated_per_query(jit_compile):
    """Beams share their sentence's memory: query rows `i * g ..` read memory row `i`."""
    ours, theirs, _, value = copied_pair(seed=6)
    group = 3
    rng = np.random.default_rng(6)
    query = rng.normal(size=(2 * group, 1, D_MODEL)).astype("float32")  # one step of 3 beams per row
    padding = np.array([[True] * 7, [True] * 4 + [False] * 3])  # row 1's memory is padded
    memory = ours.project_key_value(value)

    @tf.function(jit_compile=jit_compile)
    def shared(query, memory, padding):
        return ours(query, None, attention_mask=padding[:, None, :], cache=memory, return_attention_scores=True)

    out, scores, _ = shared(query, memory, padding)
    repeated = np.repeat(value, group, axis=0)
    expected, expected_scores = theirs(
        query, repeated, attention_mask=np.repeat(padding, group, axis=0)[:, None, :], return_attention_scores=True
    )
    np.testing.assert_allclose(out, expected, atol=1e-5)
    np.testing.assert_allclose(scores, expected_scores, atol=1e-6)


def test_cache_without_the_causal_mask_attends_to_every_written_key_and_no_empty_slot():
    ours, _, query, _ = copied_pair(seed=6)
    written = 3
    # Non-causal attention among the first 3 positions, then the same block written
    # into a longer (8-slot) cache at once: the 5 empty slots must not take weight.
    full = ours(query[:, :written], query[:, :written])
    cache = ours.empty_cache(2, 8)
    block = query[:, :written]
    out, scores, _ = ours(block, block, cache=cache, cache_index=0, return_attention_scores=True)
    np.testing.assert_allclose(out, full, atol=1e-5)
    assert np.all(np.asarray(scores)[..., written:] == 0.0)


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_projected_memory_is_in_the_compute_dtype_and_gives_the_uncached_output(policy):
    rng = np.random.default_rng(7)
    query = rng.normal(size=(2, 5, D_MODEL)).astype("float32")
    value = rng.normal(size=(2, 7, D_MODEL)).astype("float32")
    layer = MultiHeadAttention(HEADS, dtype=policy)
    uncached = layer(query, value)
    memory = layer.project_key_value(value)
    assert memory["transposed_key"].dtype == memory["value"].dtype == layer.compute_dtype
    cached, _ = layer(query, None, cache=memory)
    assert cached.dtype == uncached.dtype == layer.compute_dtype
    np.testing.assert_array_equal(np.asarray(cached, "float32"), np.asarray(uncached, "float32"))


def test_causal_mask_formula():
    mask = np.asarray(causal_mask(3, 5, query_offset=2))[0]
    expected = np.array([[j <= i + 2 for j in range(5)] for i in range(3)])
    np.testing.assert_array_equal(mask, expected)


@pytest.mark.parametrize("pad_id", [0, 3])
def test_padding_mask_hides_the_given_pad_id_from_every_query(pad_id):
    """`[batch, 1, length]`, True where the id is not `pad_id` (padding anywhere, not only at the end)."""
    ids = np.array([[5, 0, 3, 3], [3, 7, 0, 1]])
    mask = np.asarray(padding_mask(ids, pad_id=pad_id))
    np.testing.assert_array_equal(mask, (ids != pad_id)[:, None, :])
    ours, _, query, _ = copied_pair(seed=10)
    _, scores = ours(query, query[:, :4], attention_mask=mask, return_attention_scores=True)
    hidden = np.broadcast_to((ids == pad_id)[:, None, None, :], np.shape(scores))
    assert np.all(np.asarray(scores)[hidden] < 1e-6) and np.all(np.asarray(scores)[~hidden] > 0)


def test_d_model_not_divisible_by_heads_is_a_clear_error():
    with pytest.raises(ValueError, match=r"d_model \(10.*divisible by num_heads \(4\)"):
        MultiHeadAttention(4)(np.zeros((1, 3, 10), "float32"), np.zeros((1, 3, 10), "float32"))


def test_mask_of_the_wrong_rank_is_a_clear_error():
    layer = MultiHeadAttention(2)
    x = np.zeros((1, 3, 8), "float32")
    with pytest.raises(ValueError, match="attention_mask must have rank 3.*got rank 2"):
        layer(x, x, attention_mask=np.ones((1, 3), bool))


def test_bad_constructor_arguments_are_clear_errors():
    with pytest.raises(ValueError, match="num_heads"):
        MultiHeadAttention(0)
    with pytest.raises(ValueError, match="dropout_rate"):
        MultiHeadAttention(2, dropout_rate=1.5)


def test_an_attention_mask_given_by_position_works_in_a_functional_model():
    """`layer(query, value, key, attention_mask)` symbolically, as eagerly."""
    ours, _, query, value = copied_pair(seed=12)
    mask = np.random.default_rng(12).random((2, 5, 7)) > 0.3
    inputs = [keras.Input((5, D_MODEL)), keras.Input((7, D_MODEL)), keras.Input((5, 7), dtype="bool")]
    model = keras.Model(inputs, ours(inputs[0], inputs[1], inputs[1], inputs[2]))
    np.testing.assert_allclose(model([query, value, mask]), ours(query, value, value, mask), atol=1e-6)


def test_a_single_key_gets_all_the_weight_without_a_warning_as_in_keras():
    """A one-token memory: no softmax warning (Keras's own layer gives none either), the same output as Keras's."""
    import warnings

    ours, theirs, query, value = copied_pair(seed=13)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out, scores = ours(query, value[:, :1], return_attention_scores=True)
    assert not [str(w.message) for w in caught if "softmax" in str(w.message)]
    np.testing.assert_array_equal(scores, np.ones((2, HEADS, 5, 1)))
    np.testing.assert_allclose(out, theirs(query, value[:, :1]), atol=1e-5)


def test_a_per_head_mask_combines_with_the_keras_mask_of_the_values():
    """A rank-4 attention_mask and the values' Keras mask (rank 3 once expanded) both apply, to every head."""
    ours, _, query, value = copied_pair(seed=14)
    value = _padded_value(value)
    per_head = np.random.default_rng(14).random((2, HEADS, 5, 7)) > 0.3
    per_head[..., 0] = True  # every query keeps a real key
    inputs = [keras.Input((5, D_MODEL)), keras.Input((7, D_MODEL)), keras.Input((HEADS, 5, 7), dtype="bool")]
    masked_value = keras.layers.Masking(0.0)(inputs[1])
    model = keras.Model(inputs, ours(inputs[0], masked_value, attention_mask=inputs[2]))
    key_padding = np.arange(7)[None, :] < np.array([7, 4])[:, None]
    both = per_head & key_padding[:, None, None, :]
    np.testing.assert_allclose(model([query, value, per_head]), ours(query, value, attention_mask=both), atol=1e-6)


@pytest.mark.parametrize("shape", [(2, 16), (2, 3, 5, 16)])
def test_inputs_that_are_not_sequences_of_vectors_are_a_clear_error(shape):
    with pytest.raises(ValueError, match=r"expects query of shape \[batch, length, features\]"):
        MultiHeadAttention(HEADS)(np.zeros(shape, "float32"), np.zeros(shape, "float32"))


@pytest.mark.parametrize("d_model, heads", [(512, 8), (64, 16)])
def test_initial_kernels_have_the_scale_of_keras_multi_head_attention(d_model, heads):
    """Glorot over the 2-D matrices `[d_model, heads * head_dim]` and `[heads * head_dim, d_model]`
    (std sqrt(2 / (fan_in + fan_out))), as Keras's layer draws them, not over 3-D 'conv' fans."""
    x = np.zeros((1, 3, d_model), "float32")
    ours = MultiHeadAttention(heads)
    ours(x, x)
    theirs = keras.layers.MultiHeadAttention(heads, key_dim=d_model // heads)
    theirs(x, x)
    ours_by_name = {w.path.split("/")[-1]: np.asarray(w) for w in ours.weights}
    theirs_kernels = [np.asarray(w) for w in theirs.weights if w.path.endswith("kernel")]
    names = ["query_kernel", "key_kernel", "value_kernel", "output_kernel"]
    glorot_std = np.sqrt(2.0 / (d_model + d_model))
    for name, their_kernel in zip(names, theirs_kernels, strict=True):
        ours_std, theirs_std = ours_by_name[name].std(), their_kernel.std()
        assert ours_std == pytest.approx(glorot_std, rel=0.05), name
        assert ours_std == pytest.approx(theirs_std, rel=0.05), name


def test_a_user_initializer_draws_each_kernel_as_its_matrix():
    """An orthogonal initializer gives orthogonal `[d_model, heads * head_dim]` matrices."""
    x = np.zeros((1, 3, 32), "float32")
    layer = MultiHeadAttention(4, kernel_initializer=keras.initializers.Orthogonal(seed=1))
    layer(x, x)
    for kernel in (layer.query_kernel, layer.output_kernel):
        matrix = np.asarray(kernel).reshape(32, 32)
        np.testing.assert_allclose(matrix.T @ matrix, np.eye(32), atol=1e-5)


def _largest_correlation(kernels):
    """The largest |correlation| between two of `kernels`, flattened (0 for independent draws)."""
    flat = [np.asarray(k).ravel() for k in kernels]
    return max(abs(np.corrcoef(a, b)[0, 1]) for i, a in enumerate(flat) for b in flat[i + 1 :])


def _own_position_attention(layer, x):
    """The mean attention weight each query gives its own position."""
    _, scores = layer(x, x, return_attention_scores=True)
    return np.diagonal(np.asarray(scores), axis1=-2, axis2=-1).mean()


@pytest.mark.parametrize(
    "initializer",
    [
        "glorot_uniform",
        keras.initializers.GlorotUniform(),
        keras.initializers.Orthogonal(seed=1),
        keras.initializers.GlorotUniform(seed=keras.random.SeedGenerator(3)),
    ],
    ids=["by-name", "unseeded-instance", "seeded", "seed-generator"],
)
def test_each_kernel_starts_from_a_draw_of_its_own(initializer):
    """Query, key, value and output kernels are independent draws: a fresh layer attends to its
    inputs about as evenly as Keras's layer with an unseeded initializer of the kind. One unseeded
    Keras 3 initializer gave all four the same values, and each query about 80% attention to its
    own position."""
    x = np.random.default_rng(0).normal(size=(8, 20, 128)).astype("float32")
    ours = MultiHeadAttention(4, kernel_initializer=initializer)
    kind = keras.initializers.get(initializer).__class__
    theirs = keras.layers.MultiHeadAttention(4, key_dim=32, kernel_initializer=kind())
    ours_focus, theirs_focus = _own_position_attention(ours, x), _own_position_attention(theirs, x)
    kernels = [ours.query_kernel, ours.key_kernel, ours.value_kernel, ours.output_kernel]
    assert _largest_correlation(kernels) < 0.05
    assert ours_focus == pytest.approx(theirs_focus, abs=0.02)


def test_tied_attention_init_starts_the_four_kernels_equal_and_round_trips():
    """One draw for all four kernels, so each query first attends mostly to itself; the config keeps
    the choice, and a config saved when it was `tied_attention_init=True` still means it."""
    x = np.random.default_rng(0).normal(size=(8, 20, 128)).astype("float32")
    tied = MultiHeadAttention(4, attention_init="tied")
    focus = _own_position_attention(tied, x)
    matrices = [np.reshape(k, (128, 128)) for k in (tied.query_kernel, tied.key_kernel, tied.value_kernel)]
    for matrix in matrices[1:] + [np.reshape(tied.output_kernel, (128, 128))]:
        np.testing.assert_array_equal(matrix, matrices[0])
    assert focus > 0.5  # uniform attention over 20 positions would give 0.05
    assert MultiHeadAttention.from_config(tied.get_config()).attention_init == "tied"
    old_config = {k: v for k, v in tied.get_config().items() if k != "attention_init"}
    for old, meant in ((True, "tied"), (False, "independent")):
        assert MultiHeadAttention.from_config({**old_config, "tied_attention_init": old}).attention_init == meant
    with pytest.raises(ValueError, match="not both"):
        MultiHeadAttention(4, attention_init="mimetic", tied_attention_init=True)
    with pytest.raises(ValueError, match="attention_init must be one of"):
        MultiHeadAttention(4, attention_init="identity")


def _head_products(layer, d_model):
    """Each head's query-key product `[heads, d_model, d_model]`, and the value-output product."""
    query, key = np.asarray(layer.query_kernel, "float64"), np.asarray(layer.key_kernel, "float64")
    value = np.asarray(layer.value_kernel, "float64").reshape(d_model, -1)
    output = np.asarray(layer.output_kernel, "float64").reshape(-1, d_model)
    return np.einsum("dhk,ehk->hde", query, key), value @ output


def test_mimetic_init_is_trockman_and_kolters_factorisation():
    """Each head's query and key kernels are the balanced factors (U√S, V√S) of the best rank-d_k
    approximation of 0.7 Z + 0.7 I, the value and output kernels those of 0.4 Z - 0.4 I (Z uniform,
    variance 1/d): checked against numpy's SVD of the products and the formula's moments."""
    d_model, heads, head_dim = 128, 4, 32
    layer = MultiHeadAttention(heads, attention_init="mimetic")
    x = np.random.default_rng(0).normal(size=(8, 20, d_model)).astype("float32")
    assert _own_position_attention(layer, x) > 0.8  # uniform attention over 20 positions: 0.05
    query_key, value_output = _head_products(layer, d_model)
    for head in range(heads):
        singular = np.linalg.svd(query_key[head], compute_uv=False)
        assert singular[head_dim] < 1e-5 * singular[0]  # rank d_k
        for kernel in (layer.query_kernel, layer.key_kernel):  # balanced: both factors carry √S
            factor = np.asarray(kernel, "float64")[:, head, :]
            np.testing.assert_allclose(factor.T @ factor, np.diag(singular[:head_dim]), atol=1e-4)
    # V O is the full-rank matrix itself: its diagonal is -0.4 + noise, the rest 0.4 Z.
    off_diagonal = value_output[~np.eye(d_model, dtype=bool)]
    assert np.diag(value_output).mean() == pytest.approx(-0.4, abs=0.03)
    assert off_diagonal.mean() == pytest.approx(0.0, abs=0.005)
    assert off_diagonal.std() == pytest.approx(0.4 / np.sqrt(d_model), rel=0.05)
    # The query-key product keeps the identity's share a rank-d_k subspace can hold, and more:
    # its top singular directions are those the identity lifts.
    assert np.trace(query_key, axis1=1, axis2=2).mean() > 0.7 * head_dim


def test_mimetic_init_draws_each_head_and_layer_apart_and_a_seed_repeats_it():
    layers = [MultiHeadAttention(4, attention_init="mimetic") for _ in range(2)]
    layers += [
        MultiHeadAttention(4, attention_init="mimetic", kernel_initializer=keras.initializers.GlorotUniform(seed=7))
        for _ in range(2)
    ]
    x = np.zeros((1, 3, 64), "float32")
    for layer in layers:
        layer(x, x)
    query_keys = [_head_products(layer, 64)[0] for layer in layers]
    off_diagonal = ~np.eye(64, dtype=bool)
    assert _largest_correlation([product[off_diagonal] for product in query_keys[0]]) < 0.1  # each head its Z
    assert not np.allclose(query_keys[0], query_keys[1])
    np.testing.assert_array_equal(layers[2].query_kernel, layers[3].query_kernel)
    np.testing.assert_array_equal(layers[2].output_kernel, layers[3].output_kernel)
    restored = MultiHeadAttention.from_config(layers[0].get_config())
    assert restored.attention_init == "mimetic"


def test_a_seeded_mimetic_layer_draws_its_query_key_and_value_output_noise_apart():
    """The two pairs take the seed plus their index: with one seed, the value-output product's noise
    would repeat the query-key products' (independent draws correlate by about 0.03)."""
    layer = MultiHeadAttention(4, attention_init="mimetic", kernel_initializer=keras.initializers.GlorotUniform(seed=7))
    x = np.zeros((1, 3, 32), "float32")
    layer(x, x)
    value_output = np.asarray(layer.value_kernel).reshape(32, 32) @ np.asarray(layer.output_kernel).reshape(32, 32)
    noise = (value_output + 0.4 * np.eye(32)) / 0.4  # full rank: exactly 0.4 Z - 0.4 I
    query_keys = np.einsum("dhk,ehk->hde", np.asarray(layer.query_kernel), np.asarray(layer.key_kernel))
    off_diagonal = ~np.eye(32, dtype=bool)
    assert _largest_correlation([noise[off_diagonal]] + [p[off_diagonal] for p in query_keys]) < 0.2


def test_mimetic_init_refuses_keys_or_values_of_another_width():
    layer = MultiHeadAttention(4, attention_init="mimetic")
    with pytest.raises(ValueError, match="keys as wide as queries"):
        layer(np.zeros((1, 3, 32), "float32"), np.zeros((1, 5, 48), "float32"))


def test_a_seeded_initializer_gives_the_same_kernels_again():
    """Drawn apart, but reproducible: seed + the kernel's index."""
    x = np.zeros((1, 3, 32), "float32")
    layers = [MultiHeadAttention(4, kernel_initializer=keras.initializers.GlorotUniform(seed=7)) for _ in range(2)]
    for layer in layers:
        layer(x, x)
    for first, second in zip(layers[0].weights, layers[1].weights, strict=True):
        np.testing.assert_array_equal(first, second)


# What code written for keras.layers.MultiHeadAttention typically passes.
KERAS_KWARGS = dict(
    num_heads=2,
    key_dim=8,
    value_dim=4,
    dropout=0.1,
    output_shape=16,
    use_bias=True,
    kernel_initializer="he_normal",
    bias_initializer="zeros",
    kernel_regularizer="l2",
    bias_regularizer=keras.regularizers.L1(0.05),
    kernel_constraint="max_norm",
    bias_constraint=None,
    seed=5,
    attention_axes=None,
    flash_attention=False,
)


@pytest.mark.parametrize("output_shape", [16, (16,), [16]])
def test_keras_argument_names_give_the_layer_keras_gives(output_shape):
    """`dropout`, `output_shape` and `seed` as Keras names them: the same weights give Keras's output at
    inference (`[batch, target_length, 16]`), the rate is the attention dropout's, and the config round-trips."""
    kwargs = dict(KERAS_KWARGS, output_shape=output_shape)
    ours, theirs = MultiHeadAttention(**kwargs), keras.layers.MultiHeadAttention(**kwargs)
    rng = np.random.default_rng(15)
    query = rng.normal(size=(2, 5, 12)).astype("float32")
    value = rng.normal(size=(2, 7, 10)).astype("float32")
    theirs(query, value)
    ours(query, value)
    weights = [rng.normal(size=w.shape).astype("float32") * 0.3 for w in theirs.get_weights()]
    theirs.set_weights(weights)
    ours.set_weights(weights)

    out = ours(query, value)
    assert out.shape == (2, 5, 16)
    np.testing.assert_allclose(out, theirs(query, value, training=False), atol=1e-5)
    assert (ours.dropout_rate, ours.dropout.rate, ours.output_dim, ours.seed) == (0.1, 0.1, 16, 5)
    assert not np.allclose(ours(query, value, training=True), out, atol=1e-4)  # the attention dropout is on
    np.testing.assert_allclose(sum(ours.losses), sum(theirs.losses), rtol=1e-6)  # the regularizers' penalty
    restored = MultiHeadAttention.from_config(ours.get_config())
    assert restored.get_config() == ours.get_config()
    # The seed is in the config: two layers made from it drop the same attention weights.
    copies = [MultiHeadAttention.from_config(ours.get_config()) for _ in range(2)]
    for copy in copies:
        copy(query, value)
        copy.set_weights(weights)
    np.testing.assert_array_equal(*(copy(query, value, training=True) for copy in copies))


def test_a_training_step_with_regularizers_and_constraints_is_keras_layers_step():
    """Regularizers add to the loss and constraints act after the update, as in Keras's layer: from
    the same weights, one SGD step of a model around each layer gives the same weights."""
    kwargs = dict(
        num_heads=2,
        key_dim=4,
        kernel_regularizer=keras.regularizers.L2(0.1),
        bias_regularizer="l1",
        kernel_constraint=keras.constraints.MaxNorm(0.4, axis=0),
        bias_constraint="non_neg",
    )
    rng = np.random.default_rng(3)
    query, value = rng.normal(size=(4, 5, 8)).astype("float32"), rng.normal(size=(4, 6, 8)).astype("float32")
    targets = rng.normal(size=(4, 5, 8)).astype("float32")
    weights = None
    trained = []
    for layer in (MultiHeadAttention(**kwargs), keras.layers.MultiHeadAttention(**kwargs)):
        inputs = [keras.Input((5, 8)), keras.Input((6, 8))]
        model = keras.Model(inputs, layer(*inputs))
        weights = weights or [rng.normal(size=w.shape).astype("float32") for w in layer.get_weights()]
        layer.set_weights(weights)
        model.compile(keras.optimizers.SGD(0.5), "mse")
        model.fit([query, value], targets, batch_size=4, epochs=1, verbose=0)
        trained.append(layer.get_weights())
    for ours, theirs, before in zip(*trained, weights, strict=True):
        assert not np.allclose(ours, before)
        np.testing.assert_allclose(ours, theirs, atol=1e-5)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"dropout": 0.1, "dropout_rate": 0.1}, "Give dropout_rate or dropout"),
        ({"output_shape": 16, "output_dim": 16}, "Give output_dim or output_shape"),
        ({"output_shape": (4, 4)}, r"output_shape must be an int or a 1-tuple.*\(4, 4\)"),
        ({"output_shape": ()}, r"output_shape must be an int or a 1-tuple"),
        ({"output_shape": (0,)}, "output_shape must be a positive integer"),
        ({"dropout": 1.5}, r"dropout must be in \[0, 1\)"),
        ({"attention_axes": (1,)}, r"attention_axes must be None.*\(1,\)"),
        ({"flash_attention": True}, "flash_attention must be None or False"),
    ],
)
def test_keras_argument_names_given_badly_are_clear_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        MultiHeadAttention(2, key_dim=8, **kwargs)


def test_writing_past_the_end_of_a_cache_is_an_error_not_an_overwrite():
    ours, _, query, _ = copied_pair(seed=11)
    cache = ours.empty_cache(2, 4)
    for i in range(4):  # the last slot is writable
        step = query[:, i : i + 1]
        _, cache = ours(step, step, use_causal_mask=True, cache=cache, cache_index=i)
    written = np.asarray(cache["key"])
    step = query[:, 4:5]
    with pytest.raises(ValueError, match=r"1 token\(s\) at position 4 of a decoding cache of 4 positions"):
        ours(step, step, use_causal_mask=True, cache=cache, cache_index=4)
    with pytest.raises(ValueError, match="at position 3"):  # two tokens from the last slot
        ours(query[:, :2], query[:, :2], use_causal_mask=True, cache=cache, cache_index=3)
    np.testing.assert_array_equal(cache["key"], written)

    @tf.function(autograph=False)
    def write(step, cache, index):  # the index known only when the graph runs
        return ours(step, step, use_causal_mask=True, cache=cache, cache_index=index)[1]

    write(step, cache, tf.constant(3))
    with pytest.raises(tf.errors.InvalidArgumentError, match="decoding cache is too short"):
        write(step, cache, tf.constant(4))


def test_a_float64_layer_is_keras_float64_layer_to_float64_precision():
    rng = np.random.default_rng(37)
    query = rng.normal(size=(2, 5, D_MODEL))
    value = rng.normal(size=(2, 7, D_MODEL))
    ours = MultiHeadAttention(HEADS, dtype="float64")
    theirs = keras.layers.MultiHeadAttention(HEADS, key_dim=D_MODEL // HEADS, dtype="float64")
    ours(query, value)
    theirs(query, value)
    weights = [rng.normal(size=w.shape) * 0.3 for w in ours.get_weights()]
    ours.set_weights(weights)
    theirs.set_weights(weights)
    output, scores = ours(query, value, return_attention_scores=True)
    expected_output, expected_scores = theirs(query, value, return_attention_scores=True)
    assert output.dtype == scores.dtype == "float64"
    np.testing.assert_allclose(output, expected_output, rtol=0, atol=1e-12)
    np.testing.assert_allclose(scores, expected_scores, rtol=0, atol=1e-12)


@pytest.mark.parametrize("self_attention", [True, False])
def test_an_activity_regularizer_penalizes_the_projections_as_in_keras(self_attention):
    """The four projections' outputs, each over the batch, whether or not the scores are returned."""
    kwargs = dict(num_heads=HEADS, key_dim=D_MODEL // HEADS, activity_regularizer=keras.regularizers.L2(0.3))
    ours, theirs = MultiHeadAttention(**kwargs), keras.layers.MultiHeadAttention(**kwargs)
    rng = np.random.default_rng(41)
    query = rng.normal(size=(3, 5, D_MODEL)).astype("float32")
    value = query if self_attention else rng.normal(size=(3, 7, D_MODEL)).astype("float32")
    ours(query, value)
    theirs(query, value)
    weights = [rng.normal(size=w.shape).astype("float32") * 0.3 for w in ours.get_weights()]
    ours.set_weights(weights)
    theirs.set_weights(weights)
    theirs(query, value)
    expected = sorted(float(loss) for loss in theirs.losses)
    assert len(expected) == 4
    for return_attention_scores in (False, True):
        ours(query, value, return_attention_scores=return_attention_scores)
        np.testing.assert_allclose(sorted(float(loss) for loss in ours.losses), expected, rtol=1e-5)
    restored = MultiHeadAttention.from_config(ours.get_config())
    assert restored.get_config() == ours.get_config() and restored.get_config()["activity_regularizer"]


def test_a_query_whose_rows_a_fixed_memory_cannot_serve_is_a_clear_error():
    """3 query rows and a memory of 2: regrouping 6 positions in 2 rows would mix rows, not fail."""
    layer = MultiHeadAttention(HEADS)
    rng = np.random.default_rng(43)
    memory = rng.normal(size=(2, 5, D_MODEL)).astype("float32")
    layer(memory, memory)
    cache = layer.project_key_value(memory)
    with pytest.raises(ValueError, match="A query of 3 rows cannot attend to a fixed memory of 2 rows"):
        layer(rng.normal(size=(3, 2, D_MODEL)).astype("float32"), None, cache=cache)


def test_the_cache_methods_of_a_layer_not_yet_built_are_clear_errors():
    for call in (lambda layer: layer.empty_cache(2, 8), lambda layer: layer.project_key_value(np.zeros((2, 5, 16)))):
        with pytest.raises(ValueError, match=r"needs a built layer: call it, or build\(query_shape, value_shape\)"):
            call(MultiHeadAttention(HEADS))
