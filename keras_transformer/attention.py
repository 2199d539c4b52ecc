"""Multi-head scaled dot-product attention (Vaswani et al., 2017, section 3.2).

    Attention(Q, K, V) = softmax(Q K^T / sqrt(d_k)) V
    MultiHead(Q, K, V) = Concat(head_1, ..., head_h) W_O,
    head_i = Attention(Q W_Q_i, K W_K_i, V W_V_i)

The weight layout (`query` kernel `[d_model, num_heads, key_dim]`, output kernel
`[num_heads, value_dim, d_model]`, with biases) is the one of
`keras.layers.MultiHeadAttention`, so weights move between the two unchanged.

What this layer adds to Keras's own is a cache for incremental decoding: the
keys and values of positions already decoded are kept in a fixed-size buffer
that is written in place (`cache_index`), so each decoding step projects only
the newest token and the buffer's shape never changes inside a
`tf.while_loop` or an XLA cluster.
"""

import math

import keras
from keras import ops

from keras_transformer.masks import MASK_ADDEND, causal_mask, check_attention_mask


@keras.saving.register_keras_serializable(package="keras_transformer")
class MultiHeadAttention(keras.layers.Layer):
    """Multi-head scaled dot-product attention with an incremental-decoding cache.

    Args:
        num_heads: Number of attention heads `h`.
        key_dim: Size of each head for queries and keys, `d_k`. Defaults to
            `d_model // num_heads`, the paper's choice; `d_model` (the query's
            last dimension) must then be divisible by `num_heads`.
        value_dim: Size of each head for values, `d_v`. Defaults to `key_dim`.
        output_dim: Size of the output. Defaults to the query's last dimension.
        dropout_rate: Dropout on the attention weights. The paper applies
            dropout only to sub-layer outputs, so the blocks pass 0.
        use_bias: Whether the projections have biases.
        kernel_initializer, bias_initializer: Initializers of the projections.
        **kwargs: Base `keras.layers.Layer` arguments (`name`, `dtype`, ...).

    Call arguments:
        query: Query sequence, `[batch, target_length, d_model]`.
        value: Value sequence, `[batch, source_length, dim]`.
        key: Key sequence; defaults to `value`.
        attention_mask: Boolean (or 0/1) mask broadcastable to
            `[batch, num_heads, target_length, source_length]`, of rank 3
            (`[batch, target_length or 1, source_length]`) or rank 4; `True`
            means "may attend". A padding mask is `[batch, 1, source_length]`.
        use_causal_mask: Whether query position `i` may attend only to key
            positions `<= i` (positions count from `cache_index` when decoding
            with a cache).
        return_attention_scores: Whether to also return the attention weights,
            `[batch, num_heads, target_length, source_length]`, in float32.
        training: Whether dropout is active.
        cache: Optional dict with `"key"` `[batch, max_length, num_heads, key_dim]`
            and `"value"` `[batch, max_length, num_heads, value_dim]`. With
            `cache_index`, the keys and values of `value`/`key` are written into
            the cache at `cache_index` and attention runs over the whole cache
            (self-attention while decoding). Without `cache_index`, the cached
            keys and values are used as they are and `value`/`key` are ignored
            (encoder-decoder attention, whose memory is fixed; see
            `project_key_value`).
        cache_index: Scalar int position at which `value`'s first token is
            written into the cache.

    Returns:
        `output` `[batch, target_length, output_dim]`; followed by the attention
        scores if `return_attention_scores`, and by the updated cache if a
        cache was given, in that order.
    """

    def __init__(
        self,
        num_heads,
        key_dim=None,
        value_dim=None,
        output_dim=None,
        dropout_rate=0.0,
        use_bias=True,
        kernel_initializer="glorot_uniform",
        bias_initializer="zeros",
        **kwargs,
    ):
        super().__init__(**kwargs)
        if not isinstance(num_heads, int) or num_heads <= 0:
            raise ValueError(f"num_heads must be a positive integer, got {num_heads!r}.")
        for name, dim in (("key_dim", key_dim), ("value_dim", value_dim), ("output_dim", output_dim)):
            if dim is not None and (not isinstance(dim, int) or dim <= 0):
                raise ValueError(f"{name} must be a positive integer or None, got {dim!r}.")
        if not 0.0 <= dropout_rate < 1.0:
            raise ValueError(f"dropout_rate must be in [0, 1), got {dropout_rate!r}.")
        self.num_heads = num_heads
        self.key_dim = key_dim
        self.value_dim = value_dim
        self.output_dim = output_dim
        self.dropout_rate = dropout_rate
        self.use_bias = use_bias
        self.kernel_initializer = keras.initializers.get(kernel_initializer)
        self.bias_initializer = keras.initializers.get(bias_initializer)
        self.dropout = keras.layers.Dropout(dropout_rate, dtype=self.dtype_policy)

    def build(self, query_shape, value_shape=None, key_shape=None):
        d_model = query_shape[-1]
        value_shape = query_shape if value_shape is None else value_shape
        key_shape = value_shape if key_shape is None else key_shape
        if self.key_dim is None:
            if d_model % self.num_heads:
                raise ValueError(
                    f"d_model ({d_model}, the query's last dimension) must be divisible by "
                    f"num_heads ({self.num_heads}) when key_dim is not given."
                )
            self._key_dim = d_model // self.num_heads
        else:
            self._key_dim = self.key_dim
        self._value_dim = self.value_dim or self._key_dim
        self._output_dim = self.output_dim or d_model
        self.query_kernel, self.query_bias = self._add_projection("query", d_model, self._key_dim)
        self.key_kernel, self.key_bias = self._add_projection("key", key_shape[-1], self._key_dim)
        self.value_kernel, self.value_bias = self._add_projection(
            "value", value_shape[-1], self._value_dim
        )
        self.output_kernel = self.add_weight(
            name="output_kernel",
            shape=(self.num_heads, self._value_dim, self._output_dim),
            initializer=self.kernel_initializer,
        )
        self.output_bias = (
            self.add_weight(name="output_bias", shape=(self._output_dim,), initializer=self.bias_initializer)
            if self.use_bias
            else None
        )
        self.built = True

    def _add_projection(self, name, input_dim, head_dim):
        kernel = self.add_weight(
            name=f"{name}_kernel",
            shape=(input_dim, self.num_heads, head_dim),
            initializer=self.kernel_initializer,
        )
        bias = None
        if self.use_bias:
            bias = self.add_weight(
                name=f"{name}_bias", shape=(self.num_heads, head_dim), initializer=self.bias_initializer
            )
        return kernel, bias

    @staticmethod
    def _project(x, kernel, bias):
        projected = ops.einsum("btd,dnh->btnh", x, kernel)
        return projected if bias is None else projected + bias

    def project_key_value(self, value, key=None):
        """Projects a fixed memory (the encoder output) into per-head keys and values.

        The result is the `cache` to pass, without `cache_index`, at every
        decoding step, so the encoder-decoder attention projects the memory once.

        Args:
            value: `[batch, source_length, dim]`.
            key: Defaults to `value`.

        Returns:
            Dict with `"key"` `[batch, source_length, num_heads, key_dim]` and
            `"value"` `[batch, source_length, num_heads, value_dim]`.
        """
        key = value if key is None else key
        return {
            "key": self._project(key, self.key_kernel, self.key_bias),
            "value": self._project(value, self.value_kernel, self.value_bias),
        }

    def call(
        self,
        query,
        value,
        key=None,
        attention_mask=None,
        use_causal_mask=False,
        return_attention_scores=False,
        training=None,
        cache=None,
        cache_index=None,
    ):
        if cache_index is not None and cache is None:
            raise ValueError("cache_index was given without a cache.")
        check_attention_mask(attention_mask)
        query_heads = self._project(query, self.query_kernel, self.query_bias)
        if cache is not None and cache_index is None:
            key_heads, value_heads = cache["key"], cache["value"]
        else:
            projected = self.project_key_value(value, key)
            key_heads, value_heads = projected["key"], projected["value"]
            if cache is not None:
                start = [0, cache_index, 0, 0]
                key_heads = ops.slice_update(cache["key"], start, ops.cast(key_heads, cache["key"].dtype))
                value_heads = ops.slice_update(
                    cache["value"], start, ops.cast(value_heads, cache["value"].dtype)
                )
                cache = {"key": key_heads, "value": value_heads}

        mask = attention_mask
        if use_causal_mask:
            query_offset = 0 if cache_index is None else cache_index
            causal = causal_mask(ops.shape(query)[1], ops.shape(key_heads)[1], query_offset)
            mask = causal if mask is None else ops.logical_and(ops.cast(mask, "bool"), causal)

        output, scores = self._attend(query_heads, key_heads, value_heads, mask, training)
        outputs = (output,)
        if return_attention_scores:
            outputs += (scores,)
        if cache is not None:
            outputs += (cache,)
        return outputs[0] if len(outputs) == 1 else outputs

    def _attend(self, query_heads, key_heads, value_heads, mask, training):
        """softmax(Q K^T / sqrt(d_k) + mask) V, per head, softmax in float32."""
        query_heads = query_heads * ops.cast(1.0 / math.sqrt(self._key_dim), query_heads.dtype)
        logits = ops.einsum("btnh,bsnh->bnts", query_heads, key_heads)
        # float32 softmax: under float16 the large negative addend and the
        # exponentials would overflow; bfloat16 would lose the small weights.
        logits = ops.cast(logits, "float32")
        if mask is not None:
            mask = ops.cast(mask, "float32")
            if len(mask.shape) == 3:
                mask = ops.expand_dims(mask, axis=1)  # broadcast over heads
            logits = logits + (1.0 - mask) * MASK_ADDEND
        scores = ops.softmax(logits, axis=-1)
        weights = self.dropout(ops.cast(scores, value_heads.dtype), training=training)
        context = ops.einsum("bnts,bsnh->btnh", weights, value_heads)
        output = ops.einsum("btnh,nhd->btd", context, self.output_kernel)
        if self.output_bias is not None:
            output = output + self.output_bias
        return output, scores

    def compute_output_shape(self, query_shape, value_shape=None, key_shape=None):
        return tuple(query_shape[:-1]) + (self.output_dim or query_shape[-1],)

    def get_config(self):
        config = super().get_config()
        config.update(
            {
                "num_heads": self.num_heads,
                "key_dim": self.key_dim,
                "value_dim": self.value_dim,
                "output_dim": self.output_dim,
                "dropout_rate": self.dropout_rate,
                "use_bias": self.use_bias,
                "kernel_initializer": keras.initializers.serialize(self.kernel_initializer),
                "bias_initializer": keras.initializers.serialize(self.bias_initializer),
            }
        )
        return config
