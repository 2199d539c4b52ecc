"""Token embeddings and positional encodings (sections 3.4 and 3.5).

`SharedEmbedding` is the paper's single weight matrix shared by the source
embedding, the target embedding and the pre-softmax projection (weight tying);
embedding lookups are multiplied by sqrt(d_model).

`PositionalEncoding` adds the sinusoidal encoding

    PE(pos, 2i)   = sin(pos / 10000^(2i / d_model))
    PE(pos, 2i+1) = cos(pos / 10000^(2i / d_model))

or, as an option, a learned one (the paper's Table 3, row E).
"""

import math

import keras
import tensorflow as tf
from keras import ops


def sinusoidal_encoding(positions, d_model, dtype="float32"):
    """The paper's sinusoidal encoding of `positions` (`[length, d_model]` of `dtype`).

    Even channels carry sines and odd channels cosines of the same frequency,
    interleaved as in the formula.
    """
    positions = ops.cast(ops.expand_dims(positions, -1), dtype)
    pair_index = ops.arange(0, d_model, 2, dtype=dtype)  # the 2i of the formula
    inverse_frequencies = ops.exp(pair_index * (-math.log(10000.0) / d_model))
    angles = positions * inverse_frequencies  # [length, ceil(d_model / 2)]
    interleaved = ops.stack([ops.sin(angles), ops.cos(angles)], axis=-1)
    return ops.reshape(interleaved, (-1, 2 * angles.shape[-1]))[:, :d_model]


# Positions a learned positional encoding covers unless told.
DEFAULT_MAX_POSITIONS = 1024


def max_positions_argument(max_positions, kwargs):
    """`max_positions`, or its old name `max_length` taken out of `kwargs` (configs saved before the rename).

    Raises:
        ValueError: If both are given.
    """
    if "max_length" not in kwargs:
        return DEFAULT_MAX_POSITIONS if max_positions is None else max_positions
    if max_positions is not None:
        raise ValueError("Give max_positions or its old name max_length, not both.")
    return kwargs.pop("max_length")


@keras.saving.register_keras_serializable(package="keras_transformer")
class PositionalEncoding(keras.layers.Layer):
    """Adds position information to a sequence of embeddings.

    Args:
        learned: Use a learned `[max_positions, d_model]` table instead of the
            fixed sinusoids.
        max_positions: Longest sequence a learned table covers (`max_length`, its
            name in configs saved before, is taken too). The sinusoidal
            encoding has no such limit. Positions past it are an error when the
            length and `start_index` are known as the layer is called (and a
            gather error in graph mode on CPUs); under XLA and on GPUs, where a
            gather out of range reads the last row, they would pass silently.
        **kwargs: Base `keras.layers.Layer` arguments.

    Call arguments:
        inputs: Embeddings `[batch, length, d_model]`.
        start_index: Position of the first element (an int or scalar tensor),
            non-zero when decoding one token at a time.

    Returns:
        `inputs` plus the encoding of positions `start_index .. start_index + length - 1`.
    """

    def __init__(self, learned=False, max_positions=None, **kwargs):
        # Errors name the argument as it was given: configs saved before the rename say max_length.
        given_as = "max_length" if "max_length" in kwargs else "max_positions"
        max_positions = max_positions_argument(max_positions, kwargs)
        super().__init__(**kwargs)
        if not isinstance(max_positions, int) or max_positions <= 0:
            raise ValueError(f"{given_as} must be a positive integer, got {max_positions!r}.")
        self._max_positions_name = given_as
        self.learned = learned
        self.max_positions = max_positions
        self.supports_masking = True  # positions do not change which tokens are padding

    def build(self, inputs_shape):
        d_model = inputs_shape[-1]
        if len(inputs_shape) != 3 or d_model is None:
            raise ValueError(
                f"PositionalEncoding expects embeddings [batch, length, d_model] with a known d_model, "
                f"got shape {tuple(inputs_shape)}."
            )
        self.d_model = d_model
        if self.learned:
            self.position_embeddings = self.add_weight(
                name="position_embeddings",
                shape=(self.max_positions, d_model),
                initializer=keras.initializers.RandomNormal(stddev=d_model**-0.5),
            )
        self.built = True

    def call(self, inputs, start_index=0):
        length = inputs.shape[1]
        start = tf.get_static_value(start_index)  # Known now: a number, an eager or a constant tensor.
        if self.learned and start is not None and length is not None:
            if start + length > self.max_positions:
                # A gather past the table fails on CPUs but clamps silently on GPUs and in XLA.
                raise ValueError(
                    f"Positions {start}..{start + length - 1} exceed the learned positional "
                    f"encodings' {self._max_positions_name} ({self.max_positions})."
                )
        # Keras makes a NumPy integer an int64 tensor, which int32 positions cannot be added to.
        positions = ops.arange(ops.shape(inputs)[1]) + ops.cast(start_index, "int32")
        if self.learned:
            encoding = ops.take(self.position_embeddings, positions, axis=0)
        else:
            # float32 under mixed precision (bfloat16 angles of large positions are coarse); float64 for float64.
            wide = "float64" if self.compute_dtype == "float64" else "float32"
            encoding = sinusoidal_encoding(positions, self.d_model, wide)
        return inputs + ops.cast(encoding, inputs.dtype)

    def compute_output_shape(self, inputs_shape):
        return tuple(inputs_shape)

    def get_config(self):
        config = super().get_config()
        config.update({"learned": self.learned, "max_positions": self.max_positions})
        return config


@keras.saving.register_keras_serializable(package="keras_transformer")
class SharedEmbedding(keras.layers.Layer):
    """One `[vocab_size, d_model]` matrix for embedding tokens and projecting to logits.

    Initialised with standard deviation d_model^-0.5 so that embeddings scaled
    by sqrt(d_model) have unit variance, like the positional encodings.

    With a `pad_id`, embedded ids carry the Keras mask `ids != pad_id`, as with
    `keras.layers.Embedding(mask_zero=True)`: later layers read it (attention hides
    padded keys, pooling skips padded positions). Logits keep the Keras mask of the
    hidden states they are projected from, so a Keras loss leaves out what it marks.

    Args:
        vocab_size: Size of the shared source/target vocabulary.
        d_model: Model width.
        pad_id: Token id of padding, to be marked by a Keras mask; None (the
            default) gives no mask. Ids must then be integers.
        mask_zero: `keras.layers.Embedding`'s name for `pad_id=0`; not together
            with `pad_id`.
        **kwargs: Base `keras.layers.Layer` arguments.

    Call arguments:
        inputs: Token ids `[batch, length]`, or hidden states `[..., d_model]`
            (usually `[batch, length, d_model]`) when `reverse=True`.
        reverse: Project hidden states to vocabulary logits with the transposed
            embedding matrix instead of embedding ids.
        transposed_embeddings: With `reverse`, optionally the result of
            `transposed_embeddings()`, for callers that project many times with the
            same weights.

    Returns:
        `embedding[ids] * sqrt(d_model)` (with the Keras mask `ids != pad_id` if
        `pad_id` is set), or float32 logits `[..., vocab_size]`.
    """

    def __init__(self, vocab_size, d_model, *, pad_id=None, mask_zero=False, **kwargs):
        super().__init__(**kwargs)
        for name, value in (("vocab_size", vocab_size), ("d_model", d_model)):
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}.")
        if mask_zero:
            if pad_id is not None:
                raise ValueError(
                    f"Give pad_id or mask_zero (Keras's name for pad_id=0), not both; got pad_id={pad_id!r}."
                )
            pad_id = 0
        if pad_id is not None and (not isinstance(pad_id, int) or not 0 <= pad_id < vocab_size):
            raise ValueError(f"pad_id must be None or a token id in [0, {vocab_size}), got {pad_id!r}.")
        self.vocab_size = vocab_size
        self.d_model = d_model
        self.pad_id = pad_id

    def build(self, inputs_shape=None):
        self.embeddings = self.add_weight(
            name="embeddings",
            shape=(self.vocab_size, self.d_model),
            initializer=keras.initializers.RandomNormal(stddev=self.d_model**-0.5),
        )
        self.built = True

    def transposed_embeddings(self, dtype=None):
        """The output projection's kernel, `[d_model, vocab_size]`, in `dtype` (default: compute dtype).

        A decoding loop computes it once, before the loop: multiplying by a
        transposed operand costs each step a strided read of the whole matrix,
        the largest one in the decoder.
        """
        return ops.transpose(ops.cast(self.embeddings, dtype or self.compute_dtype))

    def call(self, inputs, reverse=False, transposed_embeddings=None):
        if reverse:
            if inputs.shape[-1] not in (None, self.d_model):
                raise ValueError(
                    f"SharedEmbedding(reverse=True) projects hidden states [..., d_model={self.d_model}], "
                    f"got shape {tuple(inputs.shape)}."
                )
            if transposed_embeddings is None:
                transposed_embeddings = self.transposed_embeddings(inputs.dtype)
            # One 2-D matmul over all positions: a `[batch, length, d_model]` operand makes
            # TensorFlow broadcast the kernel over the batch, and the kernel's gradient becomes
            # one `[d_model, vocab_size]` product per sentence, summed afterwards.
            shape = ops.shape(inputs)
            logits = ops.matmul(
                ops.reshape(inputs, (-1, self.d_model)), ops.cast(transposed_embeddings, inputs.dtype)
            )
            # Softmax and loss want float32 logits even under mixed precision.
            return ops.cast(ops.reshape(logits, tuple(shape[:-1]) + (self.vocab_size,)), "float32")
        self._check_ids(inputs)
        embedded = ops.take(self.embeddings, ops.cast(inputs, "int32"), axis=0)
        return embedded * ops.cast(math.sqrt(self.d_model), embedded.dtype)

    def _check_ids(self, ids):
        # compute_mask tells ids from hidden states by their dtype (it does not see `reverse`).
        if self.pad_id is not None and not keras.backend.is_int_dtype(ids.dtype):
            raise ValueError(
                f"SharedEmbedding(pad_id={self.pad_id}) marks padding in integer ids, got "
                f"{keras.backend.standardize_dtype(ids.dtype)} ids (keras.Input is float32 unless given a dtype)."
            )

    def compute_mask(self, inputs, previous_mask=None):
        """`inputs != pad_id` for ids; the hidden states' own mask for logits (`reverse=True`)."""
        if self.pad_id is None or not keras.backend.is_int_dtype(inputs.dtype):
            return previous_mask
        return ops.not_equal(inputs, self.pad_id)

    def compute_output_shape(self, inputs_shape):
        """The shape of embedded ids `inputs_shape` (`compute_output_spec` covers `reverse`)."""
        return tuple(inputs_shape) + (self.d_model,)

    def compute_output_spec(self, inputs, reverse=False, transposed_embeddings=None):
        if reverse:
            return keras.KerasTensor(tuple(inputs.shape[:-1]) + (self.vocab_size,), dtype="float32")
        self._check_ids(inputs)
        return keras.KerasTensor(self.compute_output_shape(inputs.shape), dtype=self.compute_dtype)

    def get_config(self):
        config = super().get_config()
        config.update({"vocab_size": self.vocab_size, "d_model": self.d_model, "pad_id": self.pad_id})
        return config
