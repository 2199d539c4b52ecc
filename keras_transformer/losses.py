"""Masked, label-smoothed cross entropy and token accuracy, as sums and token counts.

Why sums: batches are built to a token budget, so their number of real (non-pad)
tokens varies, and under a distribution strategy each replica sees a different
share of the global batch. The mean over the global batch is

    sum of every replica's token losses / number of real tokens in the global batch,

so each replica returns its sum and its count, and divides the sum by the count
all-reduced with `sum_over_replicas`. Gradients of that, summed over the
replicas (which the optimizer does), are exactly the gradients of the global mean,
whatever the number of replicas.

Label smoothing (section 5.4, eps = 0.1) uses the convention of the paper's code
(tensor2tensor) and fairseq: the true class gets probability `1 - eps`, and each of
the other `V - 1` classes gets `eps / (V - 1)`. (Keras's `label_smoothing` puts
`1 - eps + eps / V` on the true class and `eps / V` on every class instead.)

Padding is label `PAD_ID` (0): its positions count for nothing.

`LabelSmoothedCrossEntropy` is the same loss as a `keras.losses.Loss`, for
`model.compile(loss=...)`: Keras's reduction then gives the mean over the real
tokens of each batch.
"""

import keras
import tensorflow as tf
from keras.src.backend import set_keras_mask  # how Keras's own losses mark ignored positions; no public API

from keras_transformer.tokenizer import PAD_ID


def _real_token_mask(labels, pad_id):
    return tf.cast(tf.not_equal(labels, pad_id), tf.float32)


def label_smoothed_cross_entropy(labels, logits, label_smoothing=0.1, pad_id=PAD_ID):
    """Sum of the label-smoothed cross entropy over the non-pad tokens.

    Args:
        labels: int `[batch, length]` target ids, `pad_id` where there is no token.
        logits: `[batch, length, vocab_size]` unnormalized scores (any float dtype;
            computed in float32).
        label_smoothing: `eps`; 0 gives the plain negative log-likelihood.
        pad_id: The label that marks padding.

    Returns:
        `(loss_sum, num_tokens)`, float32 scalars.
    """
    token_losses, mask = _masked_token_losses(labels, logits, label_smoothing, pad_id)
    return tf.reduce_sum(token_losses), tf.reduce_sum(mask)


def _masked_token_losses(labels, logits, label_smoothing, pad_id):
    """Per-token losses `[batch, length]` in float32, 0 on padding, and the float32 mask of real tokens."""
    logits = tf.cast(logits, tf.float32)
    labels = tf.cast(labels, tf.int32)
    mask = _real_token_mask(labels, pad_id)
    return _smoothed_token_losses(labels, logits, label_smoothing) * mask, mask


def _smoothed_token_losses(labels, logits, label_smoothing):
    """Per-token `-sum_v q_v log p_v`, with its gradient `p - q` written out by hand.

    With `q` the smoothed target (`1 - eps` on the label, `eps / (V - 1)` elsewhere)
    and `log p = logits - logsumexp(logits)`, the loss is

        logsumexp(logits) - eps / (V - 1) * sum(logits) - (1 - eps - eps / (V - 1)) * logits[label]

    (`q` sums to one). Why by hand: left to autodiff, each term's gradient is a pass
    of its own over the `[batch, length, vocab]` logits (the softmax of the
    logsumexp, a broadcast for the sum, a scatter for the gather), added up
    afterwards. Here the backward pass is one expression, `(exp(logits - max) / sum - q) * g`,
    reusing the forward pass's exponentials: far fewer passes over the logits, in graph
    mode and under XLA alike (see docs/performance.md).
    """
    vocab_size = tf.shape(logits)[-1]
    other_mass = label_smoothing / (tf.cast(vocab_size, tf.float32) - 1.0)
    label_mass = 1.0 - label_smoothing

    @tf.custom_gradient
    def token_losses(logits):
        row_max = tf.reduce_max(logits, axis=-1, keepdims=True)
        exp_shifted = tf.exp(logits - row_max)  # max first: no overflow
        exp_sum = tf.reduce_sum(exp_shifted, axis=-1, keepdims=True)
        logsumexp = tf.squeeze(row_max + tf.math.log(exp_sum), axis=-1)
        label_logits = tf.gather(logits, labels, batch_dims=labels.shape.rank)
        losses = (
            logsumexp
            - other_mass * tf.reduce_sum(logits, axis=-1)
            - (label_mass - other_mass) * label_logits
        )

        def gradient(upstream):
            targets = tf.one_hot(labels, vocab_size, on_value=label_mass, off_value=other_mass)
            return (exp_shifted / exp_sum - targets) * upstream[..., None]

        return losses, gradient

    return token_losses(logits)


@keras.saving.register_keras_serializable(package="keras_transformer")
class LabelSmoothedCrossEntropy(keras.losses.Loss):
    """`label_smoothed_cross_entropy` as a Keras loss, for `compile()` and `fit()`.

    Padding is not a token: `call` marks it with a Keras mask on the per-token
    losses, as `keras.losses.SparseCategoricalCrossentropy(ignore_class=...)` does,
    so Keras's reductions leave it out of the sum and out of the count. With the
    default reduction the loss is the sum of the token losses over the number of
    real tokens in the batch: sentences weigh by their length, and a batch's
    padding does not shrink it. Under a distribution strategy Keras divides each
    replica's value by the number of replicas (a mean of replica means; the
    trainer's `sum_over_replicas` gives the exact global mean instead).

    Args:
        label_smoothing: `eps` (paper: 0.1); 0 gives the plain negative log-likelihood.
        pad_id: The label that marks padding.
        reduction: Keras's reduction, over real tokens only:
            `"sum_over_batch_size"` (default) and `"mean"` divide the weighted sum
            by the number of real tokens, `"mean_with_sample_weight"` by the sum
            of their weights, `"sum"` does not divide, and None gives the
            `[batch, length]` token losses (0 on padding).
        name: Name of the loss.
        dtype: Keras's dtype for the inputs and the reduction (default: floatx);
            the token losses are computed in float32.

    Call arguments:
        y_true: int `[batch, length]` target ids, `pad_id` where there is no token.
        y_pred: `[batch, length, vocab_size]` logits. A Keras mask on them (e.g.
            the one `SharedEmbedding(reverse=True)` passes on) hides positions too.
        sample_weight: Optional weights broadcastable to `[batch, length]` (per
            sentence: `[batch, 1]`).

    Returns:
        A float scalar, or the token losses with `reduction=None`.
    """

    def __init__(
        self,
        label_smoothing=0.1,
        pad_id=PAD_ID,
        reduction="sum_over_batch_size",
        name="label_smoothed_cross_entropy",
        dtype=None,
    ):
        super().__init__(name=name, reduction=reduction, dtype=dtype)
        if not 0.0 <= label_smoothing < 1.0:
            raise ValueError(f"label_smoothing must be in [0, 1), got {label_smoothing!r}.")
        self.label_smoothing = label_smoothing
        self.pad_id = pad_id

    def call(self, y_true, y_pred):
        token_losses, mask = _masked_token_losses(y_true, y_pred, self.label_smoothing, self.pad_id)
        set_keras_mask(token_losses, tf.cast(mask, tf.bool))
        return token_losses

    def get_config(self):
        config = super().get_config()
        config.update({"label_smoothing": self.label_smoothing, "pad_id": self.pad_id})
        return config


def token_accuracy(labels, logits, pad_id=PAD_ID):
    """Number of non-pad tokens whose label scores highest (a tie for the highest counts).

    Compares the label's logit with the row's maximum rather than taking an argmax:
    same count but for exact ties, and a max is cheaper than an argmax over the
    vocabulary under XLA (see docs/performance.md).

    Args:
        labels: int `[batch, length]` target ids.
        logits: `[batch, length, vocab_size]`.
        pad_id: The label that marks padding.

    Returns:
        `(num_correct, num_tokens)`, float32 scalars.
    """
    labels = tf.cast(labels, tf.int32)
    label_logits = tf.gather(logits, labels, batch_dims=labels.shape.rank)
    mask = _real_token_mask(labels, pad_id)
    correct = tf.cast(label_logits >= tf.reduce_max(logits, axis=-1), tf.float32) * mask
    return tf.reduce_sum(correct), tf.reduce_sum(mask)


def sum_over_replicas(value):
    """Sum of `value` over all replicas, for use inside `strategy.run` (`value` itself outside).

    The loss of a replica is its `loss_sum / sum_over_replicas(num_tokens)`: summed over the
    replicas, as the optimizer sums their gradients, that is the mean over the global batch.

    Args:
        value: A tensor, e.g. this replica's number of real tokens.

    Returns:
        The all-reduced sum, the same on every replica.
    """
    return tf.distribute.get_replica_context().all_reduce(tf.distribute.ReduceOp.SUM, value)
