"""Dropout (Srivastava et al., 2014) with a cheap random mask, in graph mode and under XLA.

The paper applies dropout to every sub-layer's output and to the sums of embeddings and
positional encodings (section 5.4): 17 masks per `small` training step, 32 for `base`.
`keras.layers.Dropout` draws one 32-bit float per element with TensorFlow's stateless
Philox generator. Two things make that mask expensive, and `Dropout` avoids both:

* **Half the random bits.** One random 32-bit word gives two 16-bit uniform integers,
  and an element is kept when its integer is at least `round(rate * 2**16)`, so the
  generator runs for half the elements. The rate is thereby quantised to multiples of
  2**-16 (0.1 becomes 0.100006); the kept elements are scaled by the inverse of the
  quantised keep probability, so the expectation of the output is still exactly the
  input. The masks of a step cost markedly less, in graph mode and under XLA (see
  docs/performance.md).
* **Threefry under XLA.** XLA expands Philox into integer arithmetic that is slow on
  CPUs, several times slower than Threefry (JAX's default generator) under XLA or
  TensorFlow's own Philox kernel outside it (see docs/performance.md). So
  inside XLA computations the generator is Threefry; elsewhere it is Philox (TensorFlow's
  CPU kernels implement only Philox). XLA runs Threefry on GPUs as well.

Only the random stream differs from Keras's layer: `Dropout` is a `keras.layers.Dropout`
with the same arguments, seed generator and checkpoint layout. Under a distribution
strategy, each replica folds its id into the seed (Keras's layer draws the same mask on
every replica).
"""

import keras
import tensorflow as tf

try:  # No public API tells whether ops are being built for XLA.
    from tensorflow.python.ops.control_flow_util import GraphOrParentsInXlaContext as _in_xla
except ImportError:  # pragma: no cover - a TensorFlow without it keeps Keras's path
    _in_xla = None

# The stateless generator used inside XLA computations (see the module docstring).
XLA_RNG_ALGORITHM = "threefry"


def building_for_xla():
    """Whether the ops being created will be compiled by XLA (`jit_compile=True`)."""
    if _in_xla is None or tf.executing_eagerly():
        return False
    return bool(_in_xla(tf.compat.v1.get_default_graph()))


@keras.saving.register_keras_serializable(package="keras_transformer")
class Dropout(keras.layers.Dropout):
    """`keras.layers.Dropout` drawing its mask from 16-bit random integers (see the module docstring).

    Args:
        rate: Fraction of the inputs to drop, in `[0, 1]`; in training, rates
            strictly between 0 and 1 are rounded to a multiple of 2**-16.
        noise_shape: Shape of the binary mask, broadcast against the inputs.
        seed: Integer seed of the layer's seed generator.
        **kwargs: Base `keras.layers.Layer` arguments.

    Call arguments:
        inputs: A tensor of any shape.
        training: Whether to drop (otherwise the inputs are returned unchanged).

    Returns:
        A tensor of the inputs' shape and dtype.
    """

    def call(self, inputs, training=False):
        if not (training and 0 < self.rate < 1):
            return super().call(inputs, training=training)  # rate 1 included: all zeros
        # The seed as Keras's TensorFlow backend makes it: the generator's next
        # state, folded into int32 (XLA's stateless ops take int32 seeds).
        seed = self.seed_generator.next()
        seed = tf.cast(tf.math.floormod(tf.cast(seed, tf.int64), tf.int32.max - 1), tf.int32)
        seed = _per_replica(seed)
        shape = tf.shape(inputs)
        if self.noise_shape is not None:
            shape = tf.stack([shape[i] if d is None else d for i, d in enumerate(self.noise_shape)])
        drop_threshold = round(self.rate * _HALF_WORD_VALUES)
        if drop_threshold == _HALF_WORD_VALUES:  # a rate within 2**-17 of 1 drops everything
            return tf.zeros_like(inputs)
        keep = _uniform_half_words(shape, seed) >= tf.constant(drop_threshold, tf.uint16)
        scale = _HALF_WORD_VALUES / (_HALF_WORD_VALUES - drop_threshold)  # 1 / P(keep)
        return tf.where(keep, inputs * tf.cast(scale, inputs.dtype), tf.zeros((), inputs.dtype))


_HALF_WORD_VALUES = 2**16


def _per_replica(seed):
    """`seed` made distinct for each replica of a distributed step (unchanged on one replica).

    Every replica holds the same seed generator state, so without this all replicas, on
    every worker, would draw the same mask: with N replicas, dropout over the global
    batch would be N copies of one pattern. The id is global across workers under
    `MultiWorkerMirroredStrategy`.
    """
    context = tf.distribute.get_replica_context()
    if context is None or context.num_replicas_in_sync == 1:
        return seed
    return tf.random.experimental.stateless_fold_in(seed, context.replica_id_in_sync_group)


def _uniform_half_words(shape, seed):
    """Independent uniform `uint16`s of `shape`, two per random 32-bit word."""
    size = tf.reduce_prod(shape)
    words = tf.random.stateless_uniform(
        [(size + 1) // 2],
        seed=seed,
        minval=None,  # None and None: the full range of the integer type
        maxval=None,
        dtype=tf.uint32,
        alg=XLA_RNG_ALGORITHM if building_for_xla() else "philox",
    )
    half_words = tf.reshape(tf.bitcast(words, tf.uint16), [-1])[:size]  # an odd size drops one
    return tf.reshape(half_words, shape)
