"""Configs and `.keras` files round-trip; the layers work inside someone else's Keras model."""

import subprocess
import sys
import textwrap

import numpy as np
import pytest
import keras

from keras_transformer import (
    Decoder,
    DecoderLayer,
    Encoder,
    EncoderLayer,
    FeedForward,
    FusedAdam,
    LabelSmoothedCrossEntropy,
    LayerNormalization,
    MultiHeadAttention,
    PositionalEncoding,
    SharedEmbedding,
    Transformer,
    TransformerSchedule,
)


_RNG = np.random.default_rng(0)
_SEQUENCE = _RNG.normal(size=(2, 5, 16)).astype("float32")
_MEMORY = _RNG.normal(size=(2, 7, 16)).astype("float32")
_IDS = np.array([[5, 9, 3, 3, 3], [7, 3, 3, 3, 3]], "int32")  # 3 pads them for SharedEmbedding(pad_id=3)
_PAIR = (_RNG.integers(1, 50, size=(2, 6)).astype("int32"), _RNG.integers(1, 50, size=(2, 4)).astype("int32"))


@pytest.mark.parametrize(
    "make_layer, inputs",
    [
        (lambda: MultiHeadAttention(4, key_dim=8, dropout_rate=0.1, use_bias=False), (_SEQUENCE, _MEMORY)),
        (  # Keras's argument names
            lambda: MultiHeadAttention(2, key_dim=8, value_dim=4, dropout=0.1, output_shape=(24,), seed=3),
            (_SEQUENCE, _MEMORY),
        ),
        (lambda: PositionalEncoding(learned=True, max_positions=64), (_SEQUENCE,)),
        (lambda: PositionalEncoding(learned=True, max_length=32), (_SEQUENCE,)),  # its name in old configs
        (lambda: SharedEmbedding(100, 16, pad_id=3), (_IDS,)),
        (lambda: FeedForward(16, 32, activation="gelu", dropout_rate=0.3), (_SEQUENCE,)),
        (lambda: LayerNormalization(epsilon=1e-2), (_SEQUENCE * 0.1,)),  # small variance: epsilon shows
        (lambda: EncoderLayer(16, 4, 32, dropout_rate=0.2, norm_first=True), (_SEQUENCE,)),
        (lambda: EncoderLayer(16, 4, 32, activation="gelu", dtype="mixed_bfloat16"), (_SEQUENCE,)),
        (
            lambda: DecoderLayer(16, 4, 32, layer_norm_epsilon=1e-1, attention_dropout_rate=0.1,
                                 activation_dropout_rate=0.2),
            (_SEQUENCE, _MEMORY),
        ),
        (lambda: Encoder(num_layers=2, d_model=16, num_heads=4, d_ff=32, norm_first=True), (_SEQUENCE,)),
        (lambda: Decoder(num_layers=3, d_model=16, num_heads=2, d_ff=32), (_SEQUENCE, _MEMORY)),
        (
            lambda: Transformer(vocab_size=50, num_layers=1, d_model=16, num_heads=2, d_ff=32, learned_positions=True),
            (_PAIR,),
        ),
        (  # A config.json written before max_positions had its name.
            lambda: Transformer(
                vocab_size=50, num_layers=1, d_model=16, num_heads=2, d_ff=32, learned_positions=True, max_length=20
            ),
            (_PAIR,),
        ),
    ],
    ids=[
        "MultiHeadAttention",
        "MultiHeadAttention-keras-names",
        "PositionalEncoding",
        "PositionalEncoding-old-max_length",
        "SharedEmbedding",
        "FeedForward",
        "LayerNormalization",
        "EncoderLayer",
        "EncoderLayer-mixed-bfloat16",
        "DecoderLayer",
        "Encoder",
        "Decoder",
        "Transformer",
        "Transformer-old-max_length",
    ],
)
def test_config_round_trips(make_layer, inputs):
    """Rebuilt from its serialised config, with the weights copied, a layer computes what the original does
    (Keras mask included), and serialises to the same config again."""
    layer = make_layer()
    config = layer.get_config()
    restored = keras.saving.deserialize_keras_object(keras.saving.serialize_keras_object(layer))
    assert type(restored) is type(layer)
    assert restored.get_config() == config

    expected = layer(*inputs)
    restored(*inputs)  # builds it
    restored.set_weights(layer.get_weights())
    got = restored(*inputs)
    assert got.dtype == expected.dtype
    np.testing.assert_allclose(keras.ops.cast(got, "float32"), keras.ops.cast(expected, "float32"), atol=1e-6)
    expected_mask, got_mask = getattr(expected, "_keras_mask", None), getattr(got, "_keras_mask", None)
    assert (got_mask is None) == (expected_mask is None)
    if expected_mask is not None:
        np.testing.assert_array_equal(got_mask, expected_mask)


def encoder_classifier(vocab=30, length=12, d_model=16):
    """Someone's functional model: embeddings, two of our encoder layers, pooling, a classifier."""
    ids = keras.Input((length,), dtype="int32")
    x = keras.layers.Embedding(vocab, d_model, mask_zero=True)(ids)
    x = PositionalEncoding()(x)
    x = EncoderLayer(d_model, 4, 32, dropout_rate=0.0)(x)
    x = EncoderLayer(d_model, 4, 32, dropout_rate=0.0)(x)
    x = keras.layers.GlobalAveragePooling1D()(x)
    return keras.Model(ids, keras.layers.Dense(2)(x))


def parity_task(n=256, vocab=30, length=12, seed=0):
    """Label: whether token 7 occurs in the (padded) sequence."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(8, vocab, size=(n, length))
    lengths = rng.integers(4, length + 1, size=n)
    ids[np.arange(length)[None, :] >= lengths[:, None]] = 0
    labels = rng.integers(0, 2, size=n)
    positions = (rng.random(n) * (lengths - 1)).astype(int)
    ids[labels == 1, positions[labels == 1]] = 7
    return ids.astype("int32"), labels


def test_layers_train_inside_a_functional_model_and_save(tmp_path):
    keras.utils.set_random_seed(0)
    model = encoder_classifier()
    model.compile(keras.optimizers.Adam(3e-3), keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    ids, labels = parity_task()
    losses = model.fit(ids, labels, epochs=8, batch_size=32, verbose=0).history["loss"]
    assert losses[-1] < 0.8 * losses[0], losses

    path = tmp_path / "classifier.keras"
    model.save(path)
    restored = keras.saving.load_model(path)
    np.testing.assert_allclose(restored.predict(ids, verbose=0), model.predict(ids, verbose=0), atol=1e-5)


def test_a_compiled_transformer_round_trips_through_a_keras_file_in_a_new_process(tmp_path):
    """As README says: after `from keras_transformer import Transformer`, a `.keras` file of a model
    compiled with the package's loss, optimizer and schedule loads, compiled, with the same outputs
    (the loss and schedule were not registered by that import, so loading failed)."""
    keras.utils.set_random_seed(0)
    model = Transformer.from_preset("tiny", vocab_size=60, norm_first=True)
    model.compile(
        optimizer=FusedAdam(TransformerSchedule(d_model=64, warmup_steps=10)),
        loss=LabelSmoothedCrossEntropy(label_smoothing=0.2),
    )
    rng = np.random.default_rng(0)
    source = rng.integers(1, 60, size=(3, 7)).astype("int32")
    target = rng.integers(1, 60, size=(3, 5)).astype("int32")
    expected = np.asarray(model((source, target)))
    model.save(tmp_path / "model.keras")
    np.savez(tmp_path / "inputs.npz", source=source, target=target, expected=expected)

    script = textwrap.dedent(
        f"""
        import numpy as np, keras
        from keras_transformer import Transformer  # what README says to import first
        data = np.load({str(tmp_path / 'inputs.npz')!r})
        model = keras.saving.load_model({str(tmp_path / 'model.keras')!r})
        assert type(model).__name__ == "Transformer", type(model)
        assert type(model.loss).__name__ == "LabelSmoothedCrossEntropy", model.loss
        assert model.loss.label_smoothing == 0.2, model.loss.label_smoothing
        assert type(model.optimizer._learning_rate).__name__ == "TransformerSchedule", model.optimizer
        got = np.asarray(model((data["source"], data["target"])))
        np.testing.assert_allclose(got, data["expected"], atol=1e-5)  # another process may round otherwise
        print("same outputs")
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "same outputs" in result.stdout
