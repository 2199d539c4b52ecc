"""Masked label-smoothed cross entropy and token accuracy against hand computations in NumPy."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from keras_transformer import LabelSmoothedCrossEntropy
from keras_transformer.losses import label_smoothed_cross_entropy, sum_over_replicas, token_accuracy

VOCAB = 5
EPS = 0.1

# Two sentences of three positions; label 0 is padding.
LABELS = np.array([[1, 4, 0], [2, 2, 3]], dtype="int32")
LOGITS = np.random.default_rng(0).normal(size=(2, 3, VOCAB)).astype("float32")


def log_softmax(x):
    x = x.astype("float64")
    shifted = x - x.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def smoothed_targets(label, vocab_size, eps):
    """The convention under test: 1 - eps on the label, eps / (V - 1) on each other class."""
    target = np.full(vocab_size, eps / (vocab_size - 1))
    target[label] = 1.0 - eps
    return target


def hand_loss(labels, logits, eps):
    total, count = 0.0, 0
    log_probs = log_softmax(logits)
    for b in range(labels.shape[0]):
        for t in range(labels.shape[1]):
            if labels[b, t] == 0:
                continue
            total -= np.dot(smoothed_targets(labels[b, t], logits.shape[-1], eps), log_probs[b, t])
            count += 1
    return total, count


def hand_gradient(labels, logits, eps):
    """d/dlogits of the summed loss: softmax minus the smoothed targets on real tokens, 0 on padding."""
    probs = np.exp(log_softmax(logits))
    gradient = np.zeros_like(probs)
    for b, t in np.ndindex(labels.shape):
        if labels[b, t] != 0:
            gradient[b, t] = probs[b, t] - smoothed_targets(labels[b, t], logits.shape[-1], eps)
    return gradient


def test_label_smoothed_loss_equals_hand_computation():
    loss_sum, num_tokens = label_smoothed_cross_entropy(LABELS, LOGITS, label_smoothing=EPS)
    expected_sum, expected_count = hand_loss(LABELS, LOGITS, EPS)
    assert float(num_tokens) == expected_count == 5
    np.testing.assert_allclose(float(loss_sum), expected_sum, rtol=1e-5)


def test_gradient_is_softmax_minus_smoothed_targets_on_real_tokens():
    # d/dlogits of -sum_v q_v log p_v is p - q (q sums to one); padding gets no gradient.
    logits = tf.constant(LOGITS)
    with tf.GradientTape() as tape:
        tape.watch(logits)
        loss_sum, _ = label_smoothed_cross_entropy(LABELS, logits, label_smoothing=EPS)
    gradient = tape.gradient(loss_sum, logits).numpy()
    np.testing.assert_allclose(gradient, hand_gradient(LABELS, LOGITS, EPS), atol=1e-6)


def test_large_vocabulary_loss_keeps_float32_precision():
    # The smoothing term is computed from sum(logits) and logsumexp(logits): check it
    # against the float64 hand computation where V is a real vocabulary's size.
    vocab = 8000
    rng = np.random.default_rng(1)
    labels = rng.integers(1, vocab, size=(3, 7)).astype("int32")
    logits = (5.0 * rng.normal(size=(3, 7, vocab))).astype("float32")
    loss_sum, _ = label_smoothed_cross_entropy(labels, logits, label_smoothing=EPS)
    expected_sum, _ = hand_loss(labels, logits, EPS)
    np.testing.assert_allclose(float(loss_sum), expected_sum, rtol=1e-5)


@pytest.mark.parametrize("jit_compile", [False, True])
def test_gradient_of_large_logits_matches_float64_softmax_minus_targets(jit_compile):
    # The gradient is written by hand (a custom gradient): check it where exp(logits)
    # would overflow without the max subtracted, in graph mode and under XLA.
    vocab = 8000
    rng = np.random.default_rng(2)
    labels = rng.integers(0, vocab, size=(2, 5)).astype("int32")
    labels[1, 3:] = 0
    logits = tf.constant((40.0 * rng.normal(size=(2, 5, vocab))).astype("float32"))

    @tf.function(jit_compile=jit_compile)
    def loss_and_gradient(logits):
        with tf.GradientTape() as tape:
            tape.watch(logits)
            loss_sum, _ = label_smoothed_cross_entropy(labels, logits, label_smoothing=EPS)
        return loss_sum, tape.gradient(loss_sum, logits)

    loss_sum, gradient = loss_and_gradient(logits)
    np.testing.assert_allclose(float(loss_sum), hand_loss(labels, logits.numpy(), EPS)[0], rtol=1e-5)
    np.testing.assert_allclose(gradient, hand_gradient(labels, logits.numpy(), EPS), atol=1e-6)


def test_smoothing_distribution_sums_to_one_and_differs_from_keras_convention():
    target = smoothed_targets(2, VOCAB, EPS)
    np.testing.assert_allclose(target.sum(), 1.0)
    # Keras puts (1 - eps) + eps / V on the label: a different loss for the same logits.
    keras_loss = keras.losses.CategoricalCrossentropy(from_logits=True, label_smoothing=EPS, reduction=None)
    one_hot = np.eye(VOCAB)[LABELS]
    keras_sum = float(tf.reduce_sum(keras_loss(one_hot, LOGITS) * tf.cast(LABELS != 0, tf.float32)))
    ours, _ = label_smoothed_cross_entropy(LABELS, LOGITS, label_smoothing=EPS)
    assert abs(float(ours) - keras_sum) > 1e-3


def test_without_smoothing_it_is_keras_sparse_cross_entropy_ignoring_padding():
    loss_sum, num_tokens = label_smoothed_cross_entropy(LABELS, LOGITS, label_smoothing=0.0)
    keras_mean = keras.losses.SparseCategoricalCrossentropy(from_logits=True, ignore_class=0)(LABELS, LOGITS)
    np.testing.assert_allclose(float(loss_sum) / float(num_tokens), float(keras_mean), rtol=1e-5)


def test_padding_positions_count_nothing():
    changed = LOGITS.copy()
    changed[0, 2] = 100.0 * np.arange(VOCAB)  # position with label 0
    for smoothing in (0.0, EPS):
        original = label_smoothed_cross_entropy(LABELS, LOGITS, smoothing)
        assert [float(x) for x in label_smoothed_cross_entropy(LABELS, changed, smoothing)] == pytest.approx(
            [float(x) for x in original], rel=1e-6
        )
    assert [float(x) for x in token_accuracy(LABELS, changed)] == [float(x) for x in token_accuracy(LABELS, LOGITS)]


def test_all_padding_gives_zero_sum_and_count():
    loss_sum, num_tokens = label_smoothed_cross_entropy(np.zeros((2, 3), "int32"), LOGITS)
    assert (float(loss_sum), float(num_tokens)) == (0.0, 0.0)


def test_bfloat16_logits_are_computed_in_float32():
    loss_sum, _ = label_smoothed_cross_entropy(LABELS, tf.cast(LOGITS, tf.bfloat16), EPS)
    assert loss_sum.dtype == tf.float32
    np.testing.assert_allclose(float(loss_sum), hand_loss(LABELS, LOGITS, EPS)[0], rtol=2e-2)


def test_token_accuracy_counts_correct_non_pad_tokens():
    logits = np.zeros((2, 3, VOCAB), "float32")
    predictions = np.array([[1, 3, 4], [2, 0, 3]])  # right, wrong, (pad) / right, wrong, right
    np.put_along_axis(logits, predictions[..., None], 1.0, axis=-1)
    correct, num_tokens = token_accuracy(LABELS, logits)
    assert (float(correct), float(num_tokens)) == (3.0, 5.0)


@pytest.mark.parametrize("pad_id", [0, 3])
def test_token_accuracy_leaves_out_padding_even_where_padding_is_predicted(pad_id):
    labels = np.array([[1, 4, pad_id, pad_id], [pad_id, 1, 2, pad_id]], "int32")
    logits = np.eye(VOCAB, dtype="float32")[labels]  # every position predicted right, padding included
    correct, num_tokens = token_accuracy(labels, logits, pad_id=pad_id)
    assert (float(correct), float(num_tokens)) == (4.0, 4.0)


def test_token_accuracy_matches_argmax_on_random_logits_and_counts_ties():
    rng = np.random.default_rng(1)
    labels = rng.integers(0, 50, size=(8, 7)).astype("int32")
    logits = rng.normal(size=(8, 7, 50)).astype("float32")
    logits[:4] += 3.0 * np.eye(50, dtype="float32")[labels[:4]]  # the first 4 sentences mostly right
    expected = ((logits.argmax(-1) == labels) & (labels != 0)).sum()
    assert 0 < expected < (labels != 0).sum()
    assert float(token_accuracy(labels, logits)[0]) == expected
    tied = np.zeros((1, 2, VOCAB), "float32")  # every class ties for the highest score
    assert float(token_accuracy(np.array([[3, 4]], "int32"), tied)[0]) == 2.0


def test_sum_over_replicas_is_the_value_outside_a_strategy():
    assert float(sum_over_replicas(tf.constant(7.0))) == 7.0


# ---------------------------------------------------------------------------
# LabelSmoothedCrossEntropy, the keras.losses.Loss
# ---------------------------------------------------------------------------


def hand_token_losses(labels, logits, eps, pad_id=0):
    """`[batch, length]` label-smoothed cross entropy of every position, NaN on padding."""
    log_probs = log_softmax(logits)
    losses = np.full(labels.shape, np.nan)
    for b, t in np.ndindex(labels.shape):
        if labels[b, t] != pad_id:
            losses[b, t] = -np.dot(smoothed_targets(labels[b, t], logits.shape[-1], eps), log_probs[b, t])
    return losses


def padded_batch(seed=3, vocab=7):
    """Labels `[4, 6]` with 0, 2, 5 and 3 pads in its rows, and logits."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(1, vocab, size=(4, 6)).astype("int32")
    for row, pads in enumerate([0, 2, 5, 3]):
        labels[row, 6 - pads :] = 0
    return labels, rng.normal(size=(4, 6, vocab)).astype("float32")


def test_the_keras_loss_is_the_mean_over_the_real_tokens_of_the_batch():
    """Sum of the token losses / number of real tokens: neither a mean over all positions nor over sentences."""
    labels, logits = padded_batch()
    token_losses = hand_token_losses(labels, logits, EPS)
    expected = np.nansum(token_losses) / np.sum(labels != 0)
    np.testing.assert_allclose(float(LabelSmoothedCrossEntropy(EPS)(labels, logits)), expected, rtol=1e-6)
    # What the other readings would give, so the check above tells them apart.
    assert abs(np.nansum(token_losses) / labels.size - expected) > 0.1
    assert abs(np.nanmean(np.nanmean(token_losses, axis=1)) - expected) > 0.01


def test_the_keras_loss_leaves_padding_out_of_its_other_reductions_and_with_sample_weights():
    labels, logits = padded_batch(seed=4)
    token_losses = hand_token_losses(labels, logits, EPS)
    real = labels != 0
    per_token = LabelSmoothedCrossEntropy(EPS, reduction=None)(labels, logits)
    np.testing.assert_allclose(per_token, np.where(real, token_losses, 0.0), rtol=1e-6, atol=1e-7)
    summed = LabelSmoothedCrossEntropy(EPS, reduction="sum")(labels, logits)
    np.testing.assert_allclose(float(summed), np.nansum(token_losses), rtol=1e-6)

    sentence_weights = np.array([[1.0], [2.0], [0.5], [0.0]], "float32")
    weighted = np.nansum(token_losses * sentence_weights)
    mean = LabelSmoothedCrossEntropy(EPS)(labels, logits, sample_weight=sentence_weights)
    np.testing.assert_allclose(float(mean), weighted / real.sum(), rtol=1e-6)
    weighted_mean = LabelSmoothedCrossEntropy(EPS, reduction="mean_with_sample_weight")
    np.testing.assert_allclose(
        float(weighted_mean(labels, logits, sample_weight=sentence_weights)),
        weighted / np.sum(real * sentence_weights),
        rtol=1e-6,
    )


def test_the_keras_loss_has_the_functions_gradient_over_the_number_of_real_tokens():
    labels, logits = padded_batch(seed=5)
    logits = tf.constant(logits)
    with tf.GradientTape() as tape:
        tape.watch(logits)
        loss = LabelSmoothedCrossEntropy(EPS)(labels, logits)
    expected = hand_gradient(labels, logits.numpy(), EPS) / np.sum(labels != 0)
    np.testing.assert_allclose(tape.gradient(loss, logits), expected, atol=1e-6)


def test_the_keras_loss_round_trips_through_keras_serialization():
    loss = LabelSmoothedCrossEntropy(0.2, pad_id=3, reduction="sum", name="smoothed")
    restored = keras.losses.deserialize(keras.losses.serialize(loss))
    assert type(restored) is LabelSmoothedCrossEntropy
    assert restored.get_config() == loss.get_config()
    labels, logits = padded_batch(seed=6)
    labels[labels == 0] = 3  # the pad id of this loss
    assert float(restored(labels, logits)) == pytest.approx(float(loss(labels, logits)), rel=1e-7)
    np.testing.assert_allclose(
        float(loss(labels, logits)), np.nansum(hand_token_losses(labels, logits, 0.2, pad_id=3)), rtol=1e-6
    )
