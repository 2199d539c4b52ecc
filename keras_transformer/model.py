"""Encoder and decoder stacks and the full encoder-decoder `Transformer` (section 3).

Data flow of `Transformer`:

    source ids -> SharedEmbedding * sqrt(d_model) + PositionalEncoding -> Dropout -> Encoder
    target ids -> SharedEmbedding * sqrt(d_model) + PositionalEncoding -> Dropout -> Decoder
    decoder output -> SharedEmbedding transposed -> float32 logits

For decoding, `encode` runs once per input, `init_cache` projects the encoder
memory once per layer, and `decode_step` feeds only the newest tokens.

Lengths: `max_positions` is how many positions learned positional encodings cover (a
config's key; configs saved before the rename call it `max_length`, which
`Transformer(**config)` and `from_config` still take); `init_cache(..., max_decode_length)`
makes decoding buffers of that many positions. Neither is the training length cap
(`max_length` of `keras_transformer.data`) or the cut of a translated source
(`max_source_length`).
"""

import keras
from keras import ops

from keras_transformer.attention import attention_init_argument, spec_like
from keras_transformer.blocks import (
    DecoderLayer,
    EncoderLayer,
    LayerNormalization,
    build_once,
    check_model_dims,
    rowwise,
)
from keras_transformer.dropout import Dropout
from keras_transformer.embeddings import PositionalEncoding, SharedEmbedding, max_positions_argument
from keras_transformer.recipes import get_preset


class _Stack(keras.layers.Layer):
    """N identical layers, plus the final LayerNorm that pre-LN stacks need."""

    layer_class = None

    def __init__(
        self,
        num_layers,
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
        self.supports_masking = True  # the blocks read the Keras mask of the inputs; the output keeps it
        if not isinstance(num_layers, int) or num_layers <= 0:
            raise ValueError(f"num_layers must be a positive integer, got {num_layers!r}.")
        check_model_dims(d_model, num_heads, d_ff, dropout_rate, attention_dropout_rate, activation_dropout_rate)
        self.num_layers = num_layers
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
        # One attribute per layer, not a list: TensorFlow checkpoints (tf.train.Checkpoint)
        # do not see layers that Keras 3 holds in Python lists.
        for i in range(num_layers):
            block = self.layer_class(
                d_model,
                num_heads,
                d_ff,
                dropout_rate=dropout_rate,
                norm_first=norm_first,
                layer_norm_epsilon=layer_norm_epsilon,
                activation=activation,
                attention_init=attention_init,
                attention_dropout_rate=attention_dropout_rate,
                activation_dropout_rate=activation_dropout_rate,
                name=f"layer_{i}",
                dtype=self.dtype_policy,
            )
            setattr(self, f"layer_{i}", block)
        self.final_norm = None
        if norm_first:
            self.final_norm = LayerNormalization(
                epsilon=layer_norm_epsilon, name="final_norm", dtype=self.dtype_policy
            )

    @property
    def blocks(self):
        """The `num_layers` layers, bottom first."""
        return [getattr(self, f"layer_{i}") for i in range(self.num_layers)]

    def _build_final_norm(self, inputs_shape):
        if self.final_norm is not None:
            build_once(self.final_norm, inputs_shape)
        self.built = True

    def _finish(self, x):
        return x if self.final_norm is None else rowwise(self.final_norm, x)

    def compute_output_shape(self, inputs_shape, *args, **kwargs):
        return tuple(inputs_shape)

    def get_config(self):
        config = super().get_config()
        config.update(
            {
                "num_layers": self.num_layers,
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


@keras.saving.register_keras_serializable(package="keras_transformer")
class Encoder(_Stack):
    """A stack of `num_layers` `EncoderLayer`s.

    Args: `num_layers` and the `EncoderLayer` arguments.

    Call arguments:
        inputs: Embedded source `[batch, source_length, d_model]`.
        padding_mask: Boolean `[batch, source_length]`, `True` for real tokens.
        training: Whether dropout is active.

    Returns:
        `[batch, source_length, d_model]`.
    """

    layer_class = EncoderLayer

    def build(self, inputs_shape, padding_mask_shape=None):
        for layer in self.blocks:
            build_once(layer, inputs_shape)
        self._build_final_norm(inputs_shape)

    def call(self, inputs, padding_mask=None, training=None):
        x = inputs
        for layer in self.blocks:
            x = layer(x, padding_mask=padding_mask, training=training)
        return self._finish(x)


@keras.saving.register_keras_serializable(package="keras_transformer")
class Decoder(_Stack):
    """A stack of `num_layers` `DecoderLayer`s.

    Args: `num_layers` and the `DecoderLayer` arguments.

    Call arguments:
        inputs: Embedded target `[batch, target_length, d_model]`.
        encoder_outputs: `[batch, source_length, d_model]` (unused with a cache).
        encoder_padding_mask: Boolean `[batch, source_length]`.
        training: Whether dropout is active.
        cache: List of per-layer caches from `init_cache`, for incremental decoding.
        cache_index: Position of `inputs`' first token.

    Returns:
        `[batch, target_length, d_model]`, and the updated cache list if a cache was given.
    """

    layer_class = DecoderLayer

    def build(self, inputs_shape, encoder_outputs_shape=None, encoder_padding_mask_shape=None):
        for layer in self.blocks:
            build_once(layer, inputs_shape, encoder_outputs_shape)
        self._build_final_norm(inputs_shape)

    def init_cache(self, encoder_outputs, max_decode_length):
        """Per-layer caches: empty self-attention buffers of `max_decode_length`, projected encoder memory."""
        if not self.built:  # A new stack decodes first: its shapes are known here.
            self.build((None, None, self.d_model), tuple(encoder_outputs.shape))
        return [layer.init_cache(encoder_outputs, max_decode_length) for layer in self.blocks]

    def call(
        self,
        inputs,
        encoder_outputs=None,
        encoder_padding_mask=None,
        training=None,
        cache=None,
        cache_index=None,
    ):
        x = inputs
        new_cache = []
        for i, layer in enumerate(self.blocks):
            if cache is None:
                x = layer(x, encoder_outputs, encoder_padding_mask, training=training)
            else:
                x, layer_cache = layer(
                    x,
                    encoder_outputs,
                    encoder_padding_mask,
                    training=training,
                    cache=cache[i],
                    cache_index=cache_index,
                )
                new_cache.append(layer_cache)
        x = self._finish(x)
        return x if cache is None else (x, new_cache)

    def compute_output_spec(
        self, inputs, encoder_outputs=None, encoder_padding_mask=None, training=None, cache=None, cache_index=None
    ):
        output = keras.KerasTensor(inputs.shape, dtype=self.compute_dtype)
        return output if cache is None else (output, spec_like(cache))


def _describe(inputs):
    if isinstance(inputs, (tuple, list)):
        return f"a {type(inputs).__name__} of {len(inputs)}"
    return f"a {type(inputs).__name__}"


@keras.saving.register_keras_serializable(package="keras_transformer")
class Transformer(keras.Model):
    """The encoder-decoder Transformer with a shared, tied embedding.

    Args:
        vocab_size: Size of the shared source/target vocabulary.
        num_layers: `N`, layers in each of the encoder and decoder.
        d_model: Model width.
        num_heads: Attention heads `h`.
        d_ff: Feed-forward inner width.
        dropout_rate: `P_drop`, on embeddings + encodings and sub-layer outputs.
        norm_first: Pre-LN instead of the paper's post-LN.
        learned_positions: Learned instead of sinusoidal positional encodings.
        max_positions: Longest sequence covered by learned positional encodings
            (default 1024). `max_length`, its name in configs saved before, is taken too.
        layer_norm_epsilon: LayerNorm epsilon.
        pad_id: Token id of padding, hidden from attention.
        attention_init: How each attention layer's kernels start: "independent" (the
            paper's), "mimetic" (each query attends to its own position at first) or
            "tied" (see `MultiHeadAttention`). `tied_attention_init`, its form in
            configs saved before, is taken too.
        attention_dropout_rate: Dropout on the attention weights (the paper: none, 0).
        activation_dropout_rate: Dropout on the feed-forward networks' inner activations
            (the paper: none, 0).
        **kwargs: Base `keras.Model` arguments (`name`, `dtype`, ...).

    Call arguments:
        inputs: Tuple `(source_ids, decoder_input_ids)`, int `[batch, length]`;
            the decoder input is the target shifted right behind the start token.
        training: Whether dropout is active.

    Returns:
        float32 logits `[batch, target_length, vocab_size]`.
    """

    def __init__(
        self,
        vocab_size,
        num_layers=6,
        d_model=512,
        num_heads=8,
        d_ff=2048,
        dropout_rate=0.1,
        norm_first=False,
        learned_positions=False,
        max_positions=None,
        layer_norm_epsilon=1e-6,
        pad_id=0,
        attention_init="independent",
        attention_dropout_rate=0.0,
        activation_dropout_rate=0.0,
        **kwargs,
    ):
        max_positions = max_positions_argument(max_positions, kwargs)
        attention_init = attention_init_argument(attention_init, kwargs)
        super().__init__(**kwargs)
        check_model_dims(d_model, num_heads, d_ff, dropout_rate, attention_dropout_rate, activation_dropout_rate)
        self.vocab_size = vocab_size
        self.num_layers = num_layers
        self.d_model = d_model
        self.num_heads = num_heads
        self.d_ff = d_ff
        self.dropout_rate = dropout_rate
        self.norm_first = norm_first
        self.learned_positions = learned_positions
        self.max_positions = max_positions
        self.layer_norm_epsilon = layer_norm_epsilon
        self.pad_id = pad_id
        self.attention_init = attention_init
        self.attention_dropout_rate = attention_dropout_rate
        self.activation_dropout_rate = activation_dropout_rate

        policy = self.dtype_policy
        self.embedding = SharedEmbedding(vocab_size, d_model, name="shared_embedding", dtype=policy)
        if not isinstance(pad_id, int) or not 0 <= pad_id < vocab_size:  # SharedEmbedding checked vocab_size.
            raise ValueError(f"pad_id must be a token id in [0, {vocab_size}) (padding, hidden from attention), "
                             f"got {pad_id!r}.")
        self.positional_encoding = PositionalEncoding(
            learned=learned_positions, max_positions=max_positions, name="positional_encoding", dtype=policy
        )
        self.embedding_dropout = Dropout(dropout_rate, dtype=policy)
        stack_args = dict(
            num_layers=num_layers,
            d_model=d_model,
            num_heads=num_heads,
            d_ff=d_ff,
            dropout_rate=dropout_rate,
            norm_first=norm_first,
            layer_norm_epsilon=layer_norm_epsilon,
            attention_init=attention_init,
            attention_dropout_rate=attention_dropout_rate,
            activation_dropout_rate=activation_dropout_rate,
            dtype=policy,
        )
        self.encoder = Encoder(name="encoder", **stack_args)
        self.decoder = Decoder(name="decoder", **stack_args)

    @classmethod
    def from_preset(cls, preset, vocab_size, **overrides):
        """Builds a model of a named size ("tiny", "small", "base", "big", ...); see `keras_transformer.recipes`."""
        config = get_preset(preset)
        config.update(overrides)
        return cls(vocab_size=vocab_size, **config)

    def build(self, inputs_shape=None):
        batch = None
        d_model_shape = (batch, None, self.d_model)
        build_once(self.embedding)
        build_once(self.positional_encoding, d_model_shape)
        build_once(self.encoder, d_model_shape)
        build_once(self.decoder, d_model_shape, d_model_shape)
        self.built = True

    def _embed(self, token_ids, training, start_index=0):
        x = self.embedding(token_ids)
        x = self.positional_encoding(x, start_index=start_index)
        return self.embedding_dropout(x, training=training)

    def encode(self, source_ids, training=None):
        """Runs the encoder once.

        Returns:
            `(encoder_outputs [batch, source_length, d_model], source_padding_mask [batch, source_length])`.
        """
        if not self.built:  # All of it, not only what encoding calls: decoding steps follow.
            self.build()
        source_mask = ops.not_equal(source_ids, self.pad_id)
        encoder_outputs = self.encoder(self._embed(source_ids, training), padding_mask=source_mask, training=training)
        return encoder_outputs, source_mask

    def decode(self, decoder_input_ids, encoder_outputs, source_padding_mask, training=None):
        """Logits for every position of `decoder_input_ids`, recomputing the whole prefix."""
        x = self._embed(decoder_input_ids, training)
        x = self.decoder(x, encoder_outputs, source_padding_mask, training=training)
        return self.embedding(x, reverse=True)

    def init_cache(self, encoder_outputs, max_decode_length):
        """Decoding cache for outputs of up to `max_decode_length` tokens (one entry per decoder layer)."""
        return self.decoder.init_cache(encoder_outputs, max_decode_length)

    def decode_step(self, token_ids, cache, cache_index, source_padding_mask, output_kernel=None):
        """Logits for the newest tokens only, reusing the cached keys and values.

        Args:
            token_ids: `[batch, new_length]` ids at positions
                `cache_index .. cache_index + new_length - 1` (usually one token).
            cache: From `init_cache` or the previous step. Its self-attention
                buffers have `batch` rows; its encoder memory may have fewer, `rows`
                where `batch = rows * g`: `token_ids` rows `i * g .. i * g + g - 1`
                (a sentence's beams) read memory row `i`.
            cache_index: Scalar int position of `token_ids[:, 0]`.
            source_padding_mask: From `encode`, with the memory's rows.
            output_kernel: Optional `self.embedding.transposed_embeddings()`, computed
                once per search instead of once per step.

        Returns:
            `(logits [batch, new_length, vocab_size] float32, updated cache)`.
        """
        x = self._embed(token_ids, training=False, start_index=cache_index)
        x, cache = self.decoder(
            x, None, source_padding_mask, training=False, cache=cache, cache_index=cache_index
        )
        return self.embedding(x, reverse=True, transposed_embeddings=output_kernel), cache

    def call(self, inputs, training=None):
        if not isinstance(inputs, (tuple, list)) or len(inputs) != 2:
            raise ValueError(
                "Transformer expects inputs (source_ids, decoder_input_ids), two int tensors "
                f"[batch, length]; got {_describe(inputs)}."
            )
        source_ids, decoder_input_ids = inputs
        for name, ids in (("source_ids", source_ids), ("decoder_input_ids", decoder_input_ids)):
            if len(ids.shape) != 2:
                raise ValueError(f"{name} must be [batch, length] token ids, got shape {tuple(ids.shape)}.")
        encoder_outputs, source_mask = self.encode(source_ids, training=training)
        return self.decode(decoder_input_ids, encoder_outputs, source_mask, training=training)

    def get_config(self):
        return {
            **super().get_config(),
            "vocab_size": self.vocab_size,
            "num_layers": self.num_layers,
            "d_model": self.d_model,
            "num_heads": self.num_heads,
            "d_ff": self.d_ff,
            "dropout_rate": self.dropout_rate,
            "norm_first": self.norm_first,
            "learned_positions": self.learned_positions,
            "max_positions": self.max_positions,
            "layer_norm_epsilon": self.layer_norm_epsilon,
            "pad_id": self.pad_id,
            "attention_init": self.attention_init,
            "attention_dropout_rate": self.attention_dropout_rate,
            "activation_dropout_rate": self.activation_dropout_rate,
        }
