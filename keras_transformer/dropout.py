"""Dropout (Srivastava et al., 2014) whose random mask is cheap inside XLA computations.

The paper applies dropout to every sub-layer's output and to the sums of embeddings and
positional encodings (section 5.4). `keras.layers.Dropout` draws its mask with
TensorFlow's default stateless generator, Philox. XLA expands Philox into integer
arithmetic that is slow on CPUs: on the 2-core benchmark machine a `[3072, 256]` mask
took 7.1 ms under XLA, against 2.1 ms with Threefry (JAX's default generator) and 2.1
ms for TensorFlow's own Philox kernel outside XLA. The 17 masks of a `small` training
step with `--jit-compile` were 188 ms of op time in a 1.13 s step, the largest cost
after the matmuls (`bench/profile_trace.py train --jit on`, operations of the
`concatenate_bitcast_fusion` kind).

`Dropout` therefore uses Threefry inside XLA computations and Keras's own path
elsewhere (TensorFlow's CPU kernels implement only Philox). Both drop each element with
probability `rate` and scale the others by `1 / (1 - rate)`; only the random stream
differs. The layer is a `keras.layers.Dropout`, with the same arguments, seed generator
and checkpoint layout. Only CPUs were measured; XLA runs Threefry on GPUs as well (it
is JAX's default there too).
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
    """`keras.layers.Dropout` drawing its mask with Threefry when compiled by XLA.

    Args:
        rate: Fraction of the inputs to drop, in `[0, 1]`.
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
        if not (training and 0 < self.rate < 1) or not building_for_xla():
            return super().call(inputs, training=training)  # rate 1 included: all zeros
        # The seed as Keras's TensorFlow backend makes it: the generator's next
        # state, folded into int32 (XLA's stateless ops take int32 seeds).
        seed = self.seed_generator.next()
        seed = tf.cast(tf.math.floormod(tf.cast(seed, tf.int64), tf.int32.max - 1), tf.int32)
        noise_shape = self.noise_shape
        if noise_shape is not None:
            shape = tf.shape(inputs)
            noise_shape = tf.stack([shape[i] if d is None else d for i, d in enumerate(noise_shape)])
        return tf.nn.experimental.stateless_dropout(
            inputs, rate=self.rate, seed=seed, rng_alg=XLA_RNG_ALGORITHM, noise_shape=noise_shape
        )
