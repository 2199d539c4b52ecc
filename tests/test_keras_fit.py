"""`LabelSmoothedCrossEntropy` in Keras's `compile()`, `fit()` and `evaluate()`, and in a saved `.keras` model."""

import keras
import numpy as np
import pytest

from keras_transformer import LabelSmoothedCrossEntropy, Transformer, data, label_smoothed_cross_entropy
from keras_transformer.corpora import load_multi30k
from keras_transformer.tokenizer import SubwordTokenizer


def _mean_over_real_tokens(model, inputs, labels, label_smoothing):
    """The loss by `label_smoothed_cross_entropy` (checked against numpy in test_losses.py)."""
    loss_sum, num_tokens = label_smoothed_cross_entropy(labels, model(inputs), label_smoothing)
    return float(loss_sum) / float(num_tokens)


@pytest.mark.slow
def test_fit_with_the_label_smoothed_loss_lowers_it_on_multi30k(multi30k_dir, multi30k_tokenizer):
    # Seeding clears TensorFlow's kernel cache, which owns SentencePiece resources:
    # seed first, then make a fresh tokenizer.
    keras.utils.set_random_seed(0)
    tokenizer = SubwordTokenizer(multi30k_tokenizer.model_proto)
    pairs = load_multi30k(multi30k_dir).train[:600]
    batches = data.make_training_dataset(pairs, tokenizer, token_budget=512, max_length=24, seed=0).take(8).cache()
    model = Transformer.from_preset("tiny", vocab_size=tokenizer.vocab_size, dropout_rate=0.0)
    model.compile(optimizer=keras.optimizers.Adam(3e-3), loss=LabelSmoothedCrossEntropy(0.1))

    losses = model.fit(batches, epochs=5, verbose=0).history["loss"]
    assert losses[-1] < 0.8 * losses[0], losses

    # On one padded batch, Keras's loss is the mean over its real tokens.
    inputs, labels = next(iter(batches.as_numpy_iterator()))
    assert np.any(labels == 0)
    evaluated = model.evaluate(inputs, labels, batch_size=len(labels), verbose=0)
    assert evaluated == pytest.approx(_mean_over_real_tokens(model, inputs, labels, 0.1), rel=1e-5)


def test_a_compiled_model_saved_to_a_keras_file_reloads_with_its_loss(tmp_path):
    rng = np.random.default_rng(1)
    source = rng.integers(3, 40, size=(6, 7)).astype("int32")
    labels = rng.integers(3, 40, size=(6, 5)).astype("int32")
    labels[np.arange(5)[None, :] >= rng.integers(1, 6, size=(6, 1))] = 0  # 1 to 5 real tokens a row
    decoder_inputs = np.concatenate([np.full((6, 1), 2, "int32"), labels[:, :-1]], axis=1)
    loss = LabelSmoothedCrossEntropy(0.2, name="smoothed")
    model = Transformer.from_preset("tiny", vocab_size=40, dropout_rate=0.0)
    model.build()
    # Eager steps: the graph-mode loss is fit()'s test above; tracing here would only add time.
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss=loss, run_eagerly=True)

    model.save(tmp_path / "model.keras")
    restored = keras.saving.load_model(tmp_path / "model.keras")
    assert type(restored.loss) is LabelSmoothedCrossEntropy
    assert restored.loss.get_config() == loss.get_config()
    evaluated = restored.evaluate((source, decoder_inputs), labels, batch_size=6, verbose=0)
    expected = _mean_over_real_tokens(model, (source, decoder_inputs), labels, 0.2)
    assert evaluated == pytest.approx(expected, rel=1e-5)
