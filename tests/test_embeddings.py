"""Positional encodings against the paper's formula and stated property; the tied embedding."""

import math

import numpy as np
import pytest
import tensorflow as tf

from keras_transformer import PositionalEncoding, SharedEmbedding


def paper_formula(length, d_model, start=0):
    """PE(pos, 2i) = sin(pos / 10000^(2i/d)), PE(pos, 2i+1) = cos(pos / 10000^(2i/d)), entry by entry."""
    table = np.zeros((length, d_model))
    for row, pos in enumerate(range(start, start + length)):
        for i in range(0, d_model, 2):
            angle = pos / 10000 ** (i / d_model)
            table[row, i] = math.sin(angle)
            if i + 1 < d_model:
                table[row, i + 1] = math.cos(angle)
    return table


def encode(layer, length, d_model, start=0):
    return np.asarray(layer(np.zeros((1, length, d_model), "float32"), start_index=start))[0]


@pytest.mark.parametrize("d_model", [8, 64, 7])
def test_sinusoids_equal_the_formula(d_model):
    layer = PositionalEncoding()
    np.testing.assert_allclose(encode(layer, 50, d_model), paper_formula(50, d_model), atol=2e-5)


def test_float64_sinusoids_equal_the_formula_to_float64_precision():
    """Far positions too, whose angles a float32 computation rounds."""
    layer = PositionalEncoding(dtype="float64")
    encoding = np.asarray(layer(np.zeros((1, 50, 64)), start_index=950))[0]
    assert encoding.dtype == np.float64
    np.testing.assert_allclose(encoding, paper_formula(50, 64, start=950), rtol=0, atol=1e-12)


@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float16"])
def test_mixed_precision_sinusoids_are_the_formula_rounded_once_to_the_compute_dtype(policy):
    """Far positions too: angles computed in bfloat16 (8 bits of mantissa) would be off by whole periods."""
    import tensorflow as tf

    layer = PositionalEncoding(dtype=policy)
    encoding = np.asarray(tf.cast(layer(np.zeros((1, 50, 64), "float32"), start_index=950)[0], tf.float32))
    expected = np.asarray(tf.cast(tf.cast(paper_formula(50, 64, start=950), layer.compute_dtype), tf.float32))
    # One rounding step of the compute dtype apart at most (float32 angles of positions near 1000).
    np.testing.assert_allclose(encoding, expected, rtol=0, atol=2**-8)


def test_the_output_shape_is_the_inputs_shape_as_called():
    layer = PositionalEncoding()
    for shape in ((2, 5, 8), (None, None, 8)):
        assert layer.compute_output_shape(shape) == shape
    assert tuple(layer(np.zeros((2, 5, 8), "float32")).shape) == layer.compute_output_shape((2, 5, 8))


def test_start_index_continues_the_sequence():
    layer = PositionalEncoding()
    np.testing.assert_allclose(encode(layer, 4, 16, start=37), paper_formula(4, 16, start=37), atol=2e-5)


def test_encoding_is_added_to_the_inputs():
    x = np.random.default_rng(0).normal(size=(2, 6, 8)).astype("float32")
    out = np.asarray(PositionalEncoding()(x))
    np.testing.assert_allclose(out - x, np.broadcast_to(paper_formula(6, 8), x.shape), atol=2e-5)


@pytest.mark.parametrize("k", [1, 5, 17])
def test_pe_of_pos_plus_k_is_a_fixed_linear_map_of_pe_of_pos(k):
    """The paper's reason for sinusoids: PE(pos + k) = M_k PE(pos), M_k independent of pos.

    M_k is a block-diagonal rotation by k * w_i in each (sin, cos) pair; build it
    from the angle-addition formulas and check it maps every position.
    """
    d_model = 16
    table = encode(PositionalEncoding(), 80 + k, d_model)
    rotation = np.zeros((d_model, d_model))
    for i in range(0, d_model, 2):
        w = 1.0 / 10000 ** (i / d_model)
        c, s = math.cos(k * w), math.sin(k * w)
        # Row vector [sin a, cos a] times this block gives [sin(a + b), cos(a + b)]:
        # sin(a + b) = sin a cos b + cos a sin b; cos(a + b) = cos a cos b - sin a sin b
        rotation[i : i + 2, i : i + 2] = [[c, -s], [s, c]]
    np.testing.assert_allclose(table[:80] @ rotation, table[k : 80 + k], atol=1e-4)


def test_learned_positions_are_weights_indexed_by_position():
    layer = PositionalEncoding(learned=True, max_length=20)
    out = encode(layer, 5, 8, start=3)
    assert len(layer.trainable_weights) == 1
    np.testing.assert_allclose(out, np.asarray(layer.position_embeddings)[3:8], atol=1e-6)


def test_positions_past_the_learned_table_are_a_clear_error():
    layer = PositionalEncoding(learned=True, max_length=6)
    encode(layer, 6, 8)  # exactly the table
    with pytest.raises(ValueError, match="Positions 3..6 exceed .* max_length \\(6\\)"):
        encode(layer, 4, 8, start=3)
    # A NumPy integer or an eager tensor passed unchecked (and a NumPy int64 failed to add to the positions).
    for start in (np.int64(3), tf.constant(3)):
        with pytest.raises(ValueError, match="Positions 3..6 exceed"):
            encode(layer, 4, 8, start=start)


@pytest.mark.parametrize("learned", [False, True])
def test_a_start_index_of_any_integer_type_encodes_as_a_python_int(learned):
    layer = PositionalEncoding(learned=learned, max_positions=20)
    expected = encode(layer, 5, 8, start=3)
    for start in (np.int64(3), np.int32(3), tf.constant(3), tf.constant(3, tf.int64)):
        np.testing.assert_allclose(encode(layer, 5, 8, start=start), expected, atol=1e-6)


def test_shared_embedding_scales_lookups_and_ties_the_projection():
    layer = SharedEmbedding(vocab_size=11, d_model=4)
    ids = np.array([[1, 5, 10]])
    embedded = np.asarray(layer(ids))
    matrix = np.asarray(layer.embeddings)
    np.testing.assert_allclose(embedded[0], matrix[[1, 5, 10]] * 2.0, atol=1e-6)  # sqrt(4) = 2
    hidden = np.random.default_rng(0).normal(size=(1, 3, 4)).astype("float32")
    logits = np.asarray(layer(hidden, reverse=True))
    np.testing.assert_allclose(logits, hidden @ matrix.T, atol=1e-5)
    assert len(layer.trainable_weights) == 1


def test_the_output_projection_and_its_gradients_match_the_formula_for_any_leading_shape():
    """Logits h E^T and their gradients dh = g E, dE = g^T h (g = dloss/dlogits), with the
    batch and length unknown when the function is traced, and for a single position."""
    import tensorflow as tf

    layer = SharedEmbedding(vocab_size=13, d_model=8)
    layer.build()
    matrix = np.asarray(layer.embeddings, dtype="float64")
    rng = np.random.default_rng(1)

    def logits_and_gradients(hidden, upstream):
        with tf.GradientTape() as tape:
            tape.watch(hidden)
            logits = layer(hidden, reverse=True)
            loss = tf.reduce_sum(logits * upstream)
        return (logits, *tape.gradient(loss, [hidden, layer.embeddings]))

    for leading in [(3, 5), (2,), (2, 1)]:
        unknown = [None] * len(leading)
        traced = tf.function(
            logits_and_gradients,
            input_signature=[tf.TensorSpec(unknown + [8], tf.float32), tf.TensorSpec(unknown + [13], tf.float32)],
        )
        hidden = rng.normal(size=leading + (8,)).astype("float32")
        upstream = rng.normal(size=leading + (13,)).astype("float32")
        logits, d_hidden, d_matrix = (np.asarray(t) for t in traced(hidden, upstream))
        rows_h, rows_g = hidden.reshape(-1, 8).astype("float64"), upstream.reshape(-1, 13).astype("float64")
        np.testing.assert_allclose(logits, (rows_h @ matrix.T).reshape(leading + (13,)), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(d_hidden, (rows_g @ matrix).reshape(leading + (8,)), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(d_matrix, rows_g.T @ rows_h, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match=r"projects hidden states \[..., d_model=8\], got shape \(2, 3, 4\)"):
        layer(np.zeros((2, 3, 4), "float32"), reverse=True)


@pytest.mark.parametrize("make_table", [
    lambda: SharedEmbedding(vocab_size=4000, d_model=64),
    lambda: PositionalEncoding(learned=True, max_positions=4000),
], ids=["shared_embedding", "learned_positions"])
def test_tables_start_with_standard_deviation_d_model_to_the_minus_half(make_table):
    """So that lookups scaled by sqrt(d_model) (and the sinusoids they replace) have unit variance."""
    layer = make_table()
    layer.build((None, None, 64))
    table = np.asarray(layer.weights[0])
    assert table.shape == (4000, 64)
    # 256,000 normal draws: the sample deviation is within 1% of the true one.
    np.testing.assert_allclose(table.std(), 64**-0.5, rtol=0.01)
    assert abs(table.mean()) < 0.1 * 64**-0.5  # centred: the standard error is 0.002 of it


@pytest.mark.parametrize("policy", ["float32", "mixed_bfloat16"])
def test_the_transposed_embeddings_are_the_matrix_transposed_in_the_compute_dtype_unless_told(policy):
    """What a decoding loop computes once and passes as `transposed_embeddings`: the same logits."""
    import keras

    layer = SharedEmbedding(11, 4, dtype=policy)
    layer.build()
    kernel = layer.transposed_embeddings()
    assert keras.backend.standardize_dtype(kernel.dtype) == layer.compute_dtype and tuple(kernel.shape) == (4, 11)
    np.testing.assert_array_equal(kernel, np.asarray(keras.ops.cast(layer.embeddings, layer.compute_dtype)).T)
    assert keras.backend.standardize_dtype(layer.transposed_embeddings("float16").dtype) == "float16"
    hidden = np.asarray(layer(np.array([[1, 5, 10]])))
    given_kernel = layer(hidden, reverse=True, transposed_embeddings=kernel)
    np.testing.assert_array_equal(given_kernel, layer(hidden, reverse=True))


def test_bad_sizes_are_clear_errors():
    with pytest.raises(ValueError, match="vocab_size"):
        SharedEmbedding(0, 4)
    with pytest.raises(ValueError, match="max_length"):
        PositionalEncoding(max_length=-1)


@pytest.mark.parametrize("policy", ["float32", "mixed_bfloat16"])
def test_the_shared_embedding_in_a_functional_model_embeds_and_projects_as_called_eagerly(policy):
    """Both directions work on symbolic inputs; the logits are float32 as documented."""
    import keras

    embedding = SharedEmbedding(11, 4, dtype=policy)
    ids = keras.Input((None,), dtype="int32")
    embedded = embedding(ids)
    logits = embedding(embedded, reverse=True)
    assert embedded.dtype == embedding.compute_dtype and logits.dtype == "float32"
    assert tuple(embedded.shape) == (None, None, 4) and tuple(logits.shape) == (None, None, 11)
    model = keras.Model(ids, [embedded, logits])
    batch = np.array([[1, 5, 10], [3, 0, 2]])
    got_embedded, got_logits = model(batch)
    assert got_logits.dtype == "float32" and embedding(embedding(batch), reverse=True).dtype == "float32"
    np.testing.assert_array_equal(got_embedded, embedding(batch))
    np.testing.assert_array_equal(got_logits, embedding(embedding(batch), reverse=True))


def test_positional_encoding_of_inputs_that_are_not_embeddings_is_a_clear_error():
    with pytest.raises(ValueError, match=r"expects embeddings \[batch, length, d_model\].*\(2, 8\)"):
        PositionalEncoding()(np.zeros((2, 8), "float32"))


def _keras_mask(x):
    return getattr(x, "_keras_mask", None)  # where Keras keeps a tensor's mask


@pytest.mark.parametrize("options, pad_id", [({"mask_zero": True}, 0), ({"pad_id": 3}, 3)], ids=["mask_zero", "pad_id"])
def test_a_shared_embedding_with_a_pad_id_masks_padding_for_keras_attention(options, pad_id):
    """Embedded ids carry the mask `ids != pad_id`, and `keras.layers.MultiHeadAttention` then hides padded keys:
    the same output as with that mask given explicitly, symbolically and eagerly."""
    import keras

    embedding = SharedEmbedding(20, 8, **options)
    attention = keras.layers.MultiHeadAttention(2, key_dim=4)
    ids = np.array([[5, 7, 9, pad_id, pad_id], [4, 2, pad_id, pad_id, pad_id]])
    query = np.random.default_rng(2).normal(size=(2, 3, 8)).astype("float32")
    embedded = embedding(ids)
    np.testing.assert_array_equal(_keras_mask(embedded), ids != pad_id)

    key_padding = np.broadcast_to((ids != pad_id)[:, None, :], (2, 3, 5))
    expected = attention(query, np.asarray(embedded), attention_mask=key_padding)  # numpy: no Keras mask
    np.testing.assert_allclose(attention(query, embedded), expected, atol=1e-6)
    inputs = [keras.Input((3, 8)), keras.Input((5,), dtype="int32")]
    model = keras.Model(inputs, attention(inputs[0], embedding(inputs[1])))
    np.testing.assert_allclose(model([query, ids]), expected, atol=1e-6)
    assert not np.allclose(attention(query, np.asarray(embedded)), expected, atol=1e-4)  # the padding matters


def test_a_shared_embedding_without_a_pad_id_makes_no_mask_and_logits_keep_the_hidden_states_mask():
    import keras

    ids = np.array([[5, 7, 0]])
    assert _keras_mask(SharedEmbedding(20, 8)(ids)) is None
    hidden = keras.layers.Embedding(20, 8, mask_zero=True)(ids)
    logits = SharedEmbedding(20, 8)(hidden, reverse=True)
    np.testing.assert_array_equal(_keras_mask(logits), ids != 0)


def test_bad_padding_options_are_clear_errors():
    import keras

    with pytest.raises(ValueError, match="pad_id or mask_zero"):
        SharedEmbedding(20, 8, pad_id=0, mask_zero=True)
    with pytest.raises(ValueError, match=r"pad_id must be None or a token id in \[0, 20\)"):
        SharedEmbedding(20, 8, pad_id=20)
    with pytest.raises(ValueError, match=r"marks padding in integer ids, got float32 ids"):
        SharedEmbedding(20, 8, pad_id=0)(keras.Input((5,)))


def test_the_transformer_drops_out_the_sum_of_embeddings_and_positions(monkeypatch):
    """Section 5.4: dropout on "the sums of the embeddings and the positional encodings", with a fixed mask."""
    from keras_transformer import Transformer

    model = Transformer(vocab_size=30, num_layers=1, d_model=8, num_heads=2, d_ff=16, dropout_rate=0.25)
    source = np.array([[4, 9, 17, 0], [5, 3, 0, 0]])
    model.encode(source)  # builds it
    rng = np.random.default_rng(3)
    mask = ((rng.random((2, 4, 8)) >= 0.25) / 0.75).astype("float32")
    monkeypatch.setattr(model.embedding_dropout, "call", lambda x, training=False: x * mask if training else x)
    for block in model.encoder.blocks:  # the encoder's own dropout off, to compare its outputs
        for dropout in (block.self_attention_dropout, block.feed_forward_dropout):
            monkeypatch.setattr(dropout, "call", lambda x, training=False: x)

    table = np.asarray(model.embedding.embeddings)
    dropped_sum = mask * (table[source] * math.sqrt(8) + paper_formula(4, 8))
    expected = model.encoder(dropped_sum.astype("float32"), padding_mask=source != 0)
    encoded, _ = model.encode(source, training=True)
    np.testing.assert_allclose(encoded, expected, atol=1e-5)
