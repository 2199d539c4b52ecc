"""Encoder and decoder layers (section 3.1) and the position-wise feed-forward network (3.3).

Each sub-layer is wrapped as in the paper, LayerNorm(x + Dropout(Sublayer(x)))
("post-LN"). `norm_first=True` gives the pre-LN variant
x + Dropout(Sublayer(LayerNorm(x))), which trains more stably in deep stacks
and needs a final LayerNorm after the stack (the `Encoder`/`Decoder` add it).
Two dropouts the paper does not have are there for small data, off by default:
on the attention weights and on the feed-forward network's inner activations
(tensor2tensor's attention and ReLU dropout).
"""

import keras
import tensorflow as tf
from keras import ops
from keras.src.backend import get_keras_mask  # how Keras's own layers read masks; no public API

from keras_transformer.attention import MultiHeadAttention, attention_init_argument, spec_like
from keras_transformer.dropout import Dropout
from keras_transformer.masks import intersect


def check_model_dims(d_model, num_heads, d_ff, dropout_rate, attention_dropout_rate=0.0, activation_dropout_rate=0.0):
    """Raises a clear error for dimensions and dropout rates the paper's architecture cannot use."""
    for name, value in (("d_model", d_model), ("num_heads", num_heads), ("d_ff", d_ff)):
        if not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name} must be a positive integer, got {value!r}.")
    if d_model % num_heads:
        raise ValueError(
            f"d_model ({d_model}) must be divisible by num_heads ({num_heads}): each head "
            "attends in d_model / num_heads dimensions."
        )
    check_rate("dropout_rate", dropout_rate)
    check_rate("attention_dropout_rate", attention_dropout_rate)
    check_rate("activation_dropout_rate", activation_dropout_rate)


def check_rate(name, rate):
    """Raises ValueError naming `name` unless the dropout rate `rate` is in [0, 1)."""
    if not 0.0 <= rate < 1.0:
        raise ValueError(f"{name} must be in [0, 1), got {rate!r}.")


def build_once(layer, *shapes):
    """Builds a sub-layer from `shapes` unless its own call built it already (a second build adds its weights again)."""
    if not layer.built:
        layer.build(*shapes)


def rowwise(layer, x):
    """`layer` applied to `x` `[batch, length, width]` viewed as a `[batch * length, width]` matrix.

    For layers that treat each position alone (LayerNorm, the feed-forward network)
    the result is the same. What changes is the gradient of their per-feature weights
    (gains, biases): a column sum of a matrix instead of a sum over the first two axes
    of a 3-D tensor, which XLA on CPUs splits into slow windowed partial sums
    (`wrapped_reduce-window` in `bench/profile_trace.py train --jit on`; see
    docs/performance.md). (The sub-layers' output biases are handled by
    `_ResidualBlock._residual`.)
    """
    shape = ops.shape(x)
    return ops.reshape(layer(ops.reshape(x, (-1, shape[-1]))), shape)


@keras.saving.register_keras_serializable(package="keras_transformer")
class LayerNormalization(keras.layers.LayerNormalization):
    """`keras.layers.LayerNormalization` over the last axis, with its gradient written out.

    The same layer (arguments, weights, float32 computation under mixed precision),
    with the gradient of y = gamma * x_hat + beta, x_hat = (x - mean) / sqrt(var + eps),
    in closed form (Ba et al., 2016):

        dx = (g - mean(g) - x_hat * mean(g * x_hat)) / sqrt(var + eps),  g = dy * gamma,
        d_gamma = sum(dy * x_hat),  d_beta = sum(dy)  (over all but the last axis).

    Autodiff through the moments takes about twice as many element-wise passes over the
    activations, and in graph mode each pass is a kernel of its own, so the closed form
    makes a graph-mode step faster; under XLA, which fuses either form, it makes no
    difference (see docs/performance.md). Other configurations (other axes, RMS scaling,
    no centre or no scale) use Keras's computation.

    Args:
        Those of `keras.layers.LayerNormalization` (`epsilon`, `axis`, initialisers, ...).

    Call arguments:
        inputs: A tensor of any shape; normalised over `axis` (default: the last).

    Returns:
        A tensor of the inputs' shape, in the layer's compute dtype.
    """

    def call(self, inputs):
        rank = len(inputs.shape)
        last_axis_only = [axis % rank for axis in self.axis] == [rank - 1]
        if not last_axis_only or self.rms_scaling or not (self.center and self.scale):
            return super().call(inputs)
        outputs = _layer_norm_last_axis(inputs, self.gamma, self.beta, self.epsilon)
        return ops.cast(outputs, self.compute_dtype)


def _layer_norm_last_axis(x, gamma, beta, epsilon):
    """LayerNorm of `x` over its last axis in float32 (float64 for float64 `x`), with the closed-form gradient."""
    dtype = tf.float64 if x.dtype == tf.float64 else tf.float32

    @tf.custom_gradient
    def normalize(x, gamma, beta):
        x_wide = tf.cast(x, dtype)
        centered = x_wide - tf.reduce_mean(x_wide, axis=-1, keepdims=True)
        inv_std = tf.math.rsqrt(tf.reduce_mean(tf.square(centered), axis=-1, keepdims=True) + epsilon)
        x_hat = centered * inv_std

        def gradient(dy):
            dy = tf.cast(dy, dtype)
            g = dy * gamma
            mean_g = tf.reduce_mean(g, axis=-1, keepdims=True)
            mean_g_x_hat = tf.reduce_mean(g * x_hat, axis=-1, keepdims=True)
            dx = inv_std * (g - mean_g - x_hat * mean_g_x_hat)
            rows = tf.range(tf.rank(dy) - 1)
            return tf.cast(dx, x.dtype), tf.reduce_sum(dy * x_hat, axis=rows), tf.reduce_sum(dy, axis=rows)

        return x_hat * gamma + beta, gradient

    return normalize(x, tf.cast(gamma, dtype), tf.cast(beta, dtype))


@keras.saving.register_keras_serializable(package="keras_transformer")
class FeedForward(keras.layers.Layer):
    """FFN(x) = max(0, x W1 + b1) W2 + b2, applied to each position separately.

    Args:
        d_model: Input and output width.
        d_ff: Inner width.
        activation: Inner activation; the paper's is ReLU.
        dropout_rate: Dropout on the inner activations (tensor2tensor's "ReLU dropout");
            the paper has none, so the default is 0.
        **kwargs: Base `keras.layers.Layer` arguments.

    Call arguments:
        inputs: `[..., d_model]`, usually `[batch, length, d_model]`. A Keras mask
            on them (e.g. from `Embedding(mask_zero=True)`) is passed on to the output.
        training: Whether dropout is active.

    Returns:
        `[..., d_model]`, with the Keras mask of `inputs`.
    """

    def __init__(self, d_model, d_ff, activation="relu", dropout_rate=0.0, **kwargs):
        super().__init__(**kwargs)
        check_rate("dropout_rate", dropout_rate)
        self.supports_masking = True  # position-wise: a padded position stays padding
        self.d_model = d_model
        self.d_ff = d_ff
        self.activation = activation
        self.dropout_rate = dropout_rate
        self.inner = keras.layers.Dense(d_ff, activation=activation, name="inner", dtype=self.dtype_policy)
        self.outer = keras.layers.Dense(d_model, name="outer", dtype=self.dtype_policy)
        self.dropout = Dropout(dropout_rate, dtype=self.dtype_policy)

    def build(self, inputs_shape):
        if inputs_shape[-1] != self.d_model:
            raise ValueError(
                f"FeedForward expects inputs of width d_model={self.d_model} (its output is added to them), "
                f"got shape {tuple(inputs_shape)}."
            )
        build_once(self.inner, inputs_shape)
        build_once(self.outer, tuple(inputs_shape[:-1]) + (self.d_ff,))
        self.built = True

    def call(self, inputs, training=None):
        return rowwise(lambda rows: self.outer(self.dropout(self.inner(rows), training=training)), inputs)

    def compute_output_shape(self, inputs_shape):
        return tuple(inputs_shape[:-1]) + (self.d_model,)

    def get_config(self):
        config = super().get_config()
        config.update(
            {
                "d_model": self.d_model,
                "d_ff": self.d_ff,
                "activation": self.activation,
                "dropout_rate": self.dropout_rate,
            }
        )
        return config


class _ResidualBlock(keras.layers.Layer):
    """Shared pieces of the encoder and decoder layers: sizes, residual wrapping, config."""

    def __init__(
        self,
        d_model,
        num_heads,
        d_ff,
        dropout_rate=0.1,
        norm_first=False,
        layer_norm_epsilon=1e-6,
        activation="relu",
        attention_init="independent",
        attention_dropout_rate=0.0,
        activation_dropout_rate=0.0,
        **kwargs,
    ):
        attention_init = attention_init_argument(attention_init, kwargs)
        super().__init__(**kwargs)
        check_model_dims(d_model, num_heads, d_ff, dropout_rate, attention_dropout_rate, activation_dropout_rate)
        self.d_model = d_model
        self.num_heads = num_heads
        self.d_ff = d_ff
        self.dropout_rate = dropout_rate
        self.norm_first = norm_first
        self.layer_norm_epsilon = layer_norm_epsilon
        self.activation = activation
        self.attention_init = attention_init
        self.attention_dropout_rate = attention_dropout_rate
        self.activation_dropout_rate = activation_dropout_rate
        self.feed_forward = FeedForward(
            d_model, d_ff, activation, activation_dropout_rate, name="feed_forward", dtype=self.dtype_policy
        )

    def _attention(self, name):
        return MultiHeadAttention(
            self.num_heads,
            dropout_rate=self.attention_dropout_rate,
            attention_init=self.attention_init,
            name=name,
            dtype=self.dtype_policy,
        )

    def _norm_and_dropout(self, name):
        norm = LayerNormalization(
            epsilon=self.layer_norm_epsilon, name=f"{name}_norm", dtype=self.dtype_policy
        )
        dropout = Dropout(self.dropout_rate, dtype=self.dtype_policy)
        return norm, dropout

    def _feed_forward(self, training):
        return lambda x: self.feed_forward(x, training=training)

    def _check_inputs(self, inputs_shape):
        if len(inputs_shape) != 3 or inputs_shape[-1] != self.d_model:
            raise ValueError(
                f"{self.__class__.__name__} expects inputs of shape [batch, length, d_model={self.d_model}], "
                f"got {tuple(inputs_shape)}."
            )

    def _residual(self, x, sublayer, norm, dropout, training):
        """Post-LN: norm(x + dropout(sublayer(x))); pre-LN: x + dropout(sublayer(norm(x))).

        Only `sublayer` sees `[batch, length, d_model]`; the sum, dropout and norm work
        on the `[tokens, d_model]` view (as in `rowwise`), and so does the gradient of
        the sub-layer's output bias: a column sum of the dropout's gradient. With the
        dropout on the 3-D tensor, XLA on CPUs folds the reshapes into that sum and
        makes it a windowed sum over two axes, several times slower than a column sum
        (see docs/performance.md).
        """
        shape = ops.shape(x)
        x_rows = ops.reshape(x, (-1, self.d_model))

        def sublayer_rows(inputs):
            return ops.reshape(sublayer(inputs), (-1, self.d_model))

        if self.norm_first:
            out = x_rows + dropout(sublayer_rows(ops.reshape(norm(x_rows), shape)), training=training)
        else:
            out = norm(x_rows + dropout(sublayer_rows(x), training=training))
        return ops.reshape(out, shape)

    def compute_output_shape(self, inputs_shape, *args, **kwargs):
        return tuple(inputs_shape)

    def get_config(self):
        config = super().get_config()
        config.update(
            {
                "d_model": self.d_model,
                "num_heads": self.num_heads,
                "d_ff": self.d_ff,
                "dropout_rate": self.dropout_rate,
                "norm_first": self.norm_first,
                "layer_norm_epsilon": self.layer_norm_epsilon,
                "activation": self.activation,
                "attention_init": self.attention_init,
                "attention_dropout_rate": self.attention_dropout_rate,
                "activation_dropout_rate": self.activation_dropout_rate,
            }
        )
        return config


def _as_attention_mask(padding_mask):
    """Accepts a `[batch, key_length]` padding mask and returns it as `[batch, 1, key_length]`."""
    if padding_mask is None:
        return None
    if len(padding_mask.shape) == 2:
        return ops.expand_dims(ops.cast(padding_mask, "bool"), axis=1)
    return padding_mask


@keras.saving.register_keras_serializable(package="keras_transformer")
class EncoderLayer(_ResidualBlock):
    """Self-attention followed by a position-wise feed-forward network.

    Args:
        d_model: Model width.
        num_heads: Attention heads; must divide `d_model`.
        d_ff: Inner width of the feed-forward network.
        dropout_rate: Dropout on each sub-layer's output (paper: 0.1).
        norm_first: Pre-LN instead of the paper's post-LN.
        layer_norm_epsilon: LayerNorm epsilon.
        activation: Feed-forward activation (paper: ReLU).
        attention_init: How the attention's kernels start: "independent", "mimetic" or
            "tied" (see `MultiHeadAttention`).
        attention_dropout_rate: Dropout on the attention weights (the paper: none, 0).
        activation_dropout_rate: Dropout on the feed-forward network's inner activations
            (the paper: none, 0).
        **kwargs: Base `keras.layers.Layer` arguments.

    Call arguments:
        inputs: `[batch, length, d_model]`.
        padding_mask: Boolean `[batch, length]` (`True` for real tokens) or an
            attention mask of rank 3/4. A Keras mask of `inputs` (e.g. from
            `Embedding(mask_zero=True)`) hides padding as well: a key either mask
            hides is hidden.
        training: Whether dropout is active.
        return_attention_scores: Also return the self-attention weights.

    Returns:
        `[batch, length, d_model]`, and the attention weights if asked for.
    """

    def __init__(self, d_model, num_heads, d_ff, **kwargs):
        super().__init__(d_model, num_heads, d_ff, **kwargs)
        self.supports_masking = True
        self.self_attention = self._attention("self_attention")
        self.self_attention_norm, self.self_attention_dropout = self._norm_and_dropout("self_attention")
        self.feed_forward_norm, self.feed_forward_dropout = self._norm_and_dropout("feed_forward")

    def build(self, inputs_shape, padding_mask_shape=None):
        self._check_inputs(inputs_shape)
        build_once(self.self_attention, inputs_shape, inputs_shape)
        build_once(self.feed_forward, inputs_shape)
        build_once(self.self_attention_norm, inputs_shape)
        build_once(self.feed_forward_norm, inputs_shape)
        self.built = True

    def call(
        self, inputs, padding_mask=None, training=None, return_attention_scores=False, mask=None, inputs_mask=None
    ):
        # Keras passes the Keras mask of `inputs` as `mask`, or as `inputs_mask` when
        # `padding_mask` is a tensor too. Applied here, not left to the mask travelling with
        # the sub-layer's input: pre-LN normalises that input first, which drops the mask.
        keras_mask = mask if mask is not None else inputs_mask
        attention_mask = intersect(_as_attention_mask(padding_mask), _as_attention_mask(keras_mask))
        scores = None

        def self_attend(x):
            nonlocal scores
            output, scores = self.self_attention(
                x, x, attention_mask=attention_mask, return_attention_scores=True, training=training
            )
            return output

        x = self._residual(inputs, self_attend, self.self_attention_norm, self.self_attention_dropout, training)
        x = self._residual(x, self._feed_forward(training), self.feed_forward_norm, self.feed_forward_dropout, training)
        return (x, scores) if return_attention_scores else x

    def compute_output_spec(
        self, inputs, padding_mask=None, training=None, return_attention_scores=False, mask=None, inputs_mask=None
    ):
        output = keras.KerasTensor(inputs.shape, dtype=self.compute_dtype)
        if not return_attention_scores:
            return output
        _, scores = self.self_attention.compute_output_spec(inputs, inputs, return_attention_scores=True)
        return output, scores


@keras.saving.register_keras_serializable(package="keras_transformer")
class DecoderLayer(_ResidualBlock):
    """Masked self-attention, encoder-decoder attention, then a feed-forward network.

    Args: as `EncoderLayer`.

    Call arguments:
        inputs: Decoder sequence `[batch, target_length, d_model]`. Its Keras mask
            (e.g. from `Embedding(mask_zero=True)`), if any, hides target padding
            from the self-attention; not with a cache.
        encoder_outputs: `[batch, source_length, d_model]`. Not used when
            `cache` holds the projected encoder memory.
        encoder_padding_mask: Boolean `[batch, source_length]` (or rank 3/4),
            hiding source padding from the encoder-decoder attention. A Keras mask
            on `encoder_outputs` (e.g. from an `EncoderLayer` over
            `Embedding(mask_zero=True)`) hides it as well; with a cache, the one
            `encoder_outputs` had when given to `init_cache` does (the cache keeps it).
        training: Whether dropout is active.
        cache: For incremental decoding, a dict `{"self": {"key", "value"},
            "cross": {"transposed_key", "value"}}` as made by `init_cache` (`"cross"` also
            holds `"mask"` when the encoder outputs had a Keras mask). `"cross"`
            may have fewer rows than `inputs` (`rows` where `inputs` has
            `rows * g`): the beams of a sentence share its memory, see
            `MultiHeadAttention`'s `cache`; `encoder_padding_mask` then has the
            memory's rows.
        cache_index: Position of `inputs`' first token in the output sequence.
        return_attention_scores: Also return `(self_scores, cross_scores)`.

    Returns:
        `[batch, target_length, d_model]`; then the attention weights if asked
        for; then the updated cache if one was given.
    """

    def __init__(self, d_model, num_heads, d_ff, **kwargs):
        super().__init__(d_model, num_heads, d_ff, **kwargs)
        self.supports_masking = True  # the output keeps the Keras mask of `inputs`
        self.self_attention = self._attention("self_attention")
        self.cross_attention = self._attention("cross_attention")
        self.self_attention_norm, self.self_attention_dropout = self._norm_and_dropout("self_attention")
        self.cross_attention_norm, self.cross_attention_dropout = self._norm_and_dropout("cross_attention")
        self.feed_forward_norm, self.feed_forward_dropout = self._norm_and_dropout("feed_forward")

    def build(self, inputs_shape, encoder_outputs_shape=None, encoder_padding_mask_shape=None):
        self._check_inputs(inputs_shape)
        encoder_outputs_shape = encoder_outputs_shape or inputs_shape
        build_once(self.self_attention, inputs_shape, inputs_shape)
        build_once(self.cross_attention, inputs_shape, encoder_outputs_shape)
        build_once(self.feed_forward, inputs_shape)
        for norm in (self.self_attention_norm, self.cross_attention_norm, self.feed_forward_norm):
            build_once(norm, inputs_shape)
        self.built = True

    def init_cache(self, encoder_outputs, max_decode_length):
        """An empty self-attention cache of `max_decode_length` positions and the projected encoder memory.

        Args:
            encoder_outputs: `[batch, source_length, d_model]`. Their Keras mask, if
                any, is kept with the memory as `"mask"`: cached steps hide the
                source padding it marks, as the uncached call does.
            max_decode_length: Positions of the self-attention buffer.

        Returns:
            `{"self": {"key", "value"}, "cross": {"transposed_key", "value"}}` (see
            `MultiHeadAttention.project_key_value`), plus
            `"cross"`'s boolean `"mask"` `[batch, source_length]` if the encoder
            outputs had a Keras mask.
        """
        if not self.built:  # A new layer decodes first: its shapes are known here.
            self.build((None, None, self.d_model), tuple(encoder_outputs.shape))
        batch_size = ops.shape(encoder_outputs)[0]
        memory = self.cross_attention.project_key_value(encoder_outputs)
        # Decoding steps see the memory only through the cache: its padding must travel with it.
        source_mask = get_keras_mask(encoder_outputs)
        if source_mask is not None:
            memory["mask"] = ops.cast(source_mask, "bool")
        return {"self": self.self_attention.empty_cache(batch_size, max_decode_length), "cross": memory}

    def call(
        self,
        inputs,
        encoder_outputs=None,
        encoder_padding_mask=None,
        training=None,
        cache=None,
        cache_index=None,
        return_attention_scores=False,
        inputs_mask=None,
    ):
        if cache is None and encoder_outputs is None:
            raise ValueError("DecoderLayer needs encoder_outputs (or a cache holding the encoder memory).")
        if (cache is None) != (cache_index is None):
            raise ValueError("cache and cache_index go together: give both or neither.")
        if cache is not None and inputs_mask is not None:
            raise ValueError(
                "The Keras mask of inputs covers the new tokens only, not the cache's positions; "
                "decode without Keras masks."
            )
        # Keras passes the Keras mask of `inputs` as `inputs_mask`; applied here as in
        # `EncoderLayer`, as pre-LN's normalised input carries no mask.
        target_mask = _as_attention_mask(inputs_mask)
        # With a cache: the projected memory, and the padding `init_cache` kept with it.
        memory = memory_mask = None
        if cache is not None:
            memory = {"transposed_key": cache["cross"]["transposed_key"], "value": cache["cross"]["value"]}
            memory_mask = cache["cross"].get("mask")
        cross_mask = intersect(_as_attention_mask(encoder_padding_mask), _as_attention_mask(memory_mask))
        scores = {}
        new_cache = {}

        def self_attend(x):
            outputs = self.self_attention(
                x,
                x,
                attention_mask=target_mask,
                use_causal_mask=True,
                return_attention_scores=True,
                training=training,
                cache=None if cache is None else cache["self"],
                cache_index=cache_index,
            )
            scores["self"] = outputs[1]
            if cache is not None:
                new_cache["self"] = outputs[2]
            return outputs[0]

        def cross_attend(x):
            outputs = self.cross_attention(
                x,
                encoder_outputs if encoder_outputs is not None else x,
                attention_mask=cross_mask,
                return_attention_scores=True,
                training=training,
                cache=memory,
            )
            scores["cross"] = outputs[1]
            return outputs[0]

        x = self._residual(inputs, self_attend, self.self_attention_norm, self.self_attention_dropout, training)
        x = self._residual(x, cross_attend, self.cross_attention_norm, self.cross_attention_dropout, training)
        x = self._residual(x, self._feed_forward(training), self.feed_forward_norm, self.feed_forward_dropout, training)
        outputs = (x,)
        if return_attention_scores:
            outputs += ((scores["self"], scores["cross"]),)
        if cache is not None:
            new_cache["cross"] = cache["cross"]
            outputs += (new_cache,)
        return outputs[0] if len(outputs) == 1 else outputs

    def compute_output_spec(
        self,
        inputs,
        encoder_outputs=None,
        encoder_padding_mask=None,
        training=None,
        cache=None,
        cache_index=None,
        return_attention_scores=False,
        inputs_mask=None,
    ):
        outputs = (keras.KerasTensor(inputs.shape, dtype=self.compute_dtype),)
        if return_attention_scores:
            self_scores = self.self_attention.compute_output_spec(
                inputs, inputs, return_attention_scores=True, cache=None if cache is None else cache["self"]
            )[1]
            cross_scores = self.cross_attention.compute_output_spec(
                inputs,
                encoder_outputs,
                return_attention_scores=True,
                cache=None if cache is None else cache["cross"],
            )[1]
            outputs += ((self_scores, cross_scores),)
        if cache is not None:
            outputs += (spec_like(cache),)
        return outputs[0] if len(outputs) == 1 else outputs
