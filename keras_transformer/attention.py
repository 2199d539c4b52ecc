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
`tf.while_loop` or an XLA cluster (between loops, `extend_cache` grows it as the
output grows). Cached keys and values are head-major,
`[batch, num_heads, length, head_dim]`, the layout the attention matmuls read,
so a decoding step does not transpose the whole cache. A fixed memory's keys
(`project_key_value`) are kept transposed, `[batch, num_heads, head_dim, length]`:
a decoding step multiplies its few queries by them as they are, which XLA on CPUs
runs about twice as fast as a product with the transpose of `[..., length, head_dim]`.
"""

import math
import random

import keras
import tensorflow as tf
from keras import ops

from keras_transformer.dropout import Dropout
from keras_transformer.masks import MASKED_LOGIT, causal_mask, check_attention_mask, intersect, written_mask


def _joined(tensors, axis):
    """`tensors` concatenated along `axis` (a single tensor as it is)."""
    return tensors[0] if len(tensors) == 1 else ops.concatenate(tensors, axis=axis)


def _as_matrix(initializer, input_rank):
    """`initializer` drawn over the 2-D matrix that a multi-axis kernel stands for.

    A `[d_model, heads, head_dim]` kernel is the paper's `[d_model, heads * head_dim]`
    matrix (and `[heads, head_dim, d_model]` the output's `[heads * head_dim, d_model]`):
    drawn as that matrix, Glorot's fans are the matrix's, as with
    `keras.layers.MultiHeadAttention`, where Keras would take a 3-D shape for a
    convolution kernel (fans several times too large). Any initializer, the user's
    included, sees the matrix, so an orthogonal one gives an orthogonal matrix.

    Args:
        initializer: A Keras initializer (or a callable of `shape, dtype`).
        input_rank: How many leading axes of the kernel are its input axes.
    """

    def initialize(shape, dtype=None):
        matrix = (math.prod(shape[:input_rank]), math.prod(shape[input_rank:]))
        return ops.reshape(initializer(matrix, dtype=dtype), shape)

    return initialize


def _drawn_apart(initializer, index):
    """A copy of `initializer` for the layer's `index`-th weight of its kind.

    A Keras 3 initializer made without a seed fixes one when it is made, so a single
    instance draws the same values for every weight: the query, key, value and output
    kernels would start out equal. As in `keras.layers.MultiHeadAttention`, each weight
    gets a copy made from the config (a new seed when it has none); a seeded one's copies
    get `seed + index`, so that a seed makes the kernels reproducible, not equal. One
    seeded with a `SeedGenerator`, whose state moves on with every draw, is kept.
    """
    if not isinstance(initializer, keras.initializers.Initializer):
        return initializer  # a plain callable of `(shape, dtype)` draws as it likes
    config = initializer.get_config()
    seed = config.get("seed")
    if seed is not None and not isinstance(seed, int):
        return initializer
    if seed is not None:
        config["seed"] = seed + index
    return initializer.__class__.from_config(config)


ATTENTION_INITS = ("independent", "tied", "mimetic")

# Trockman and Kolter's (2023) scales: each head's query-key product near 0.7 Z + 0.7 I, the
# value-output product near 0.4 Z - 0.4 I.
_MIMETIC_SCALE_SHIFT = {"query": (0.7, 0.7), "key": (0.7, 0.7), "value": (0.4, -0.4), "output": (0.4, -0.4)}


def attention_init_argument(attention_init, kwargs):
    """`attention_init`, or what `tied_attention_init` said, taken out of `kwargs` (configs saved before the rename).

    Raises:
        ValueError: If both are given, or `attention_init` is none of `ATTENTION_INITS`.
    """
    if "tied_attention_init" in kwargs:
        if attention_init != "independent":
            raise ValueError("Give attention_init or its old form tied_attention_init, not both.")
        attention_init = "tied" if kwargs.pop("tied_attention_init") else "independent"
    if attention_init not in ATTENTION_INITS:
        raise ValueError(f"attention_init must be one of {', '.join(ATTENTION_INITS)}; got {attention_init!r}.")
    return attention_init


@keras.saving.register_keras_serializable(package="keras_transformer")
class MimeticInitializer(keras.initializers.Initializer):
    """One kernel of an attention layer's mimetic initialisation (Trockman and Kolter, 2023).

    In trained attention layers, the product of the query and key kernels is close to a
    positive multiple of the identity (a query attends to keys like itself: at first, its
    own position), and that of the value and output kernels to a negative one. This draws
    `scale * Z + shift * I` (`Z` uniform with variance 1 / size) for each of `heads` groups
    of the kernel's columns, and gives the role's factor of its best approximation of the
    group's rank, `U √S` or `V √S` from its singular value decomposition: the query and
    value kernels take `U √S`, the key kernel `V √S` and the output kernel its transpose.
    Two initializers with one seed draw one matrix, so the kernels of a query-key (or
    value-output) pair made with the same seed are its two factors.

    Args:
        role: "query", "key", "value" or "output": the kernel it draws.
        heads: How many independent draws the columns split into: the number of heads for
            the query and key kernels (a product per head), 1 for the value and output
            kernels (their product spans the heads).
        seed: An int, the same for both kernels of a pair.

    Call arguments:
        shape: The kernel as a matrix (see `_as_matrix`): `[size, heads * width]`, or
            `[heads * width, size]` for the output kernel, with `width <= size`.
    """

    def __init__(self, role, heads=1, seed=None):
        if role not in _MIMETIC_SCALE_SHIFT:
            raise ValueError(f"role must be one of {', '.join(_MIMETIC_SCALE_SHIFT)}; got {role!r}.")
        self.role, self.heads, self.seed = role, heads, seed

    def __call__(self, shape, dtype=None):
        size, columns = (shape[1], shape[0]) if self.role == "output" else shape
        width = columns // self.heads
        if width * self.heads != columns or width > size:
            raise ValueError(
                f"A mimetic {self.role} kernel of shape {tuple(shape)} needs {self.heads} head(s) of at most "
                f"{size} columns each."
            )
        scale, shift = _MIMETIC_SCALE_SHIFT[self.role]
        limit = math.sqrt(3.0 / size)
        noise = keras.random.uniform((self.heads, size, size), -limit, limit, seed=self.seed)
        left, singular, right_t = ops.svd(scale * noise + shift * ops.eye(size))
        vectors = left if self.role in ("query", "value") else ops.swapaxes(right_t, 1, 2)
        factor = vectors[:, :, :width] * ops.sqrt(singular[:, None, :width])  # [heads, size, width]
        factor = ops.reshape(ops.transpose(factor, (1, 0, 2)), (size, columns))
        return ops.cast(ops.transpose(factor) if self.role == "output" else factor, dtype or "float32")

    def get_config(self):
        return {"role": self.role, "heads": self.heads, "seed": self.seed}


def check_cache_room(cache, cache_index, new_length):
    """Raises unless `new_length` tokens written at `cache_index` fit in the cache.

    A dynamic-update-slice (`write_cache` under XLA) clamps a write that runs past the
    end, so an overflow would silently overwrite the last slots. Known in Python
    (eagerly, or static values), it is a ValueError now; otherwise the returned graph
    assertion fails when run (XLA drops assertions: the beam search sizes its caches
    itself).

    Returns:
        `None`, or the assertion op to run before the write.
    """
    room = cache["key"].shape[2]
    static_index, static_length = tf.get_static_value(cache_index), tf.get_static_value(new_length)
    message = "the decoding cache is too short: make it longer (empty_cache, extend_cache)"
    if room is not None and static_index is not None and static_length is not None:
        if not 0 <= static_index <= room - static_length:
            raise ValueError(
                f"Cannot write {static_length} token(s) at position {static_index} of a decoding cache "
                f"of {room} positions: {message}."
            )
        return None
    end = tf.cast(cache_index, tf.int32) + tf.cast(new_length, tf.int32)
    return tf.debugging.assert_less_equal(end, tf.shape(cache["key"])[2], message=message)


def check_memory_rows(query_rows, memory_rows):
    """Raises ValueError unless a fixed memory's rows divide the query's, when both are known in Python.

    Each memory row serves `query_rows / memory_rows` consecutive query rows (a
    sentence's beams). With other counts the reshape that groups them would still
    succeed whenever the query's positions divide evenly, mixing positions of
    different rows: a silent wrong answer. Unknown counts (graph-mode decoding, whose
    rows change) are the beam search's to keep right.
    """
    if query_rows is not None and memory_rows is not None and query_rows % memory_rows:
        raise ValueError(
            f"A query of {query_rows} rows cannot attend to a fixed memory of {memory_rows} rows: each memory "
            "row serves the same number of consecutive query rows (e.g. a sentence's beams)."
        )


def compiling_with_xla():
    """Whether the ops being made are for an XLA computation (`tf.function(jit_compile=True)`)."""
    from tensorflow.python.ops import control_flow_util  # What tf.while_loop itself asks.

    return control_flow_util.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph())


def write_cache(buffer, index, values):
    """`buffer` `[batch, heads, length, depth]` with `values` written at position `index` of its length.

    Under XLA, a dynamic-update-slice (in place). Outside XLA, TensorFlow would run that
    op by compiling it with XLA on demand, which TF Serving refuses unless started with
    `--xla_cpu_compilation_enabled=true`; a strided-slice update is a plain CPU kernel.
    """
    values = ops.cast(values, buffer.dtype)
    if compiling_with_xla():
        return ops.slice_update(buffer, [0, 0, index, 0], values)
    index = tf.cast(index, tf.int32)
    return tf.raw_ops.TensorStridedSliceUpdate(
        input=buffer,
        begin=tf.stack([0, 0, index, 0]),
        end=tf.stack([0, 0, index + tf.shape(values)[2], 0]),
        strides=tf.ones([4], tf.int32),
        value=values,
        begin_mask=0b1011,  # Whole batch, heads and depth: only the length axis is sliced.
        end_mask=0b1011,
    )


def spec_like(structure):
    """`KerasTensor`s of the shapes and dtypes of a nest of tensors (a cache)."""
    return keras.tree.map_structure(lambda x: keras.KerasTensor(x.shape, dtype=x.dtype), structure)


def _ungroup_scores(scores, query_length):
    """Scores `[rows, heads, g * length, keys]` of grouped queries as `[rows * g, heads, length, keys]`."""
    rows, heads, _, keys = (ops.shape(scores)[i] for i in range(4))
    grouped = ops.reshape(scores, (rows, heads, -1, query_length, keys))
    return ops.reshape(ops.transpose(grouped, (0, 2, 1, 3, 4)), (-1, heads, query_length, keys))


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
        dropout_rate: Dropout on the attention weights; defaults to 0. The paper
            applies dropout only to sub-layer outputs, so the blocks leave it at 0.
        use_bias: Whether the projections have biases.
        kernel_initializer, bias_initializer: Initializers of the projections. The
            kernel initializer draws each kernel as the 2-D matrix it stands for
            (`[d_model, num_heads * key_dim]`, and `[num_heads * value_dim, output_dim]`
            for the output), so Glorot's fans are the paper's and Keras's.
        attention_init: How the query, key, value and output kernels start.
            "independent" (default): each its own draw of `kernel_initializer`, as in
            the paper and `keras.layers.MultiHeadAttention`. "mimetic": Trockman and
            Kolter's (2023) initialisation (`MimeticInitializer`), which makes each
            query attend mostly to its own position at first and subtract a part of
            itself through the values, as trained layers do; short runs on small
            data learn faster. It needs keys of the query's width and values of the
            output's. "tied": one seed for the four, so that kernels of one shape
            start out equal, as this layer's first versions did by accident: a crude
            form of "mimetic", kept to reproduce runs of that time.
        kernel_regularizer, bias_regularizer, kernel_constraint, bias_constraint:
            Regularizers and constraints of the projections' kernels and biases, as
            in `keras.layers.MultiHeadAttention`.
        activity_regularizer: Penalizes, as in `keras.layers.MultiHeadAttention`,
            the outputs of the four projections made in a call (the queries, keys,
            values and output; not the attention scores or a cache), each divided
            by the batch size.
        dropout, output_shape, seed, attention_axes, flash_attention: Keyword
            arguments of `keras.layers.MultiHeadAttention`, so that code written for
            it runs with this layer (pass the arguments after `key_dim` by keyword:
            Keras's fourth positional argument is `dropout`, this layer's
            `output_dim`). `dropout` is `dropout_rate`, `output_shape` is `output_dim`
            given as an int or a 1-tuple (the output is one vector per position),
            and `seed` seeds the attention dropout. Giving an argument under both
            names is an error. Attention runs over the sequence axis only
            (`attention_axes` `None`), without a flash-attention kernel
            (`flash_attention` `None` or `False`).
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
            `[batch, num_heads, target_length, source_length]`, in float32 (float64 in a float64 layer).
        training: Whether dropout is active.
        cache: Optional dict with `"key"` `[batch, num_heads, max_decode_length, key_dim]`
            and `"value"` `[batch, num_heads, max_decode_length, value_dim]` (see
            `empty_cache`), or a projected memory (`project_key_value`). With
            `cache_index`, the keys and values of `value`/`key` are written into
            the cache at `cache_index` and attention runs over the cache's positions
            up to the newest token (self-attention while decoding). Without
            `cache_index`, the cached keys and values are used as they are and
            `value`/`key` are ignored (encoder-decoder attention, whose memory is
            fixed; see `project_key_value`). A fixed memory may have fewer rows
            than `query`, `rows` where `query` has `rows * g`: query rows
            `i * g .. i * g + g - 1` attend to memory row `i` (the beams of one
            sentence share its encoder memory), and `attention_mask` then has the
            memory's rows.
        cache_index: Scalar int position at which `value`'s first token is
            written into the cache.
        query_mask, value_mask, key_mask: Keras masks `[batch, length]` (`True` for
            real tokens), which Keras fills in from the inputs' masks (e.g. from
            `Embedding(mask_zero=True)`), as for `keras.layers.MultiHeadAttention`:
            `value_mask` and `key_mask` hide padded keys, together with
            `attention_mask`. The output keeps the query's Keras mask. Unlike Keras's
            layer, this one does not also mask out the rows of padded queries
            (`query_mask` is accepted and left unused): they attend to the real keys
            (the outputs at real positions are the same). `value_mask` and `key_mask`
            are ignored with a fixed-memory cache, like `value` and `key`, and not
            allowed with `cache_index`.

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
        dropout_rate=None,
        use_bias=True,
        kernel_initializer="glorot_uniform",
        bias_initializer="zeros",
        *,
        attention_init="independent",
        kernel_regularizer=None,
        bias_regularizer=None,
        kernel_constraint=None,
        bias_constraint=None,
        dropout=None,
        output_shape=None,
        seed=None,
        attention_axes=None,
        flash_attention=None,
        **kwargs,
    ):
        attention_init = attention_init_argument(attention_init, kwargs)
        # Not the base layer's, which would penalize every output of `call` (the scores, the
        # cache): as in Keras's layer, the four projections' outputs (`_regularize_activity`).
        activity_regularizer = keras.regularizers.get(kwargs.pop("activity_regularizer", None))
        super().__init__(**kwargs)
        self._activity_regularizer = activity_regularizer
        if attention_axes is not None:
            raise ValueError(
                f"attention_axes must be None: this layer attends over the sequence axis only, got {attention_axes!r}."
            )
        if flash_attention:
            raise ValueError("flash_attention must be None or False: this layer has no flash-attention kernel.")
        # Keras's names: each is resolved to ours, and named in errors as the caller named it.
        rate_name, dim_name = "dropout_rate", "output_dim"
        if dropout is not None:
            if dropout_rate is not None:
                raise ValueError(
                    f"Give dropout_rate or dropout (Keras's name for it), not both; got {dropout_rate!r} and "
                    f"{dropout!r}."
                )
            dropout_rate, rate_name = dropout, "dropout"
        if output_shape is not None:
            if output_dim is not None:
                raise ValueError(
                    f"Give output_dim or output_shape (Keras's name for it), not both; got {output_dim!r} and "
                    f"{output_shape!r}."
                )
            if isinstance(output_shape, (tuple, list)) and len(output_shape) == 1:
                output_shape = output_shape[0]
            elif not isinstance(output_shape, int):
                raise ValueError(
                    "output_shape must be an int or a 1-tuple: this layer projects each position to one vector "
                    f"of output_dim features. Got {output_shape!r}."
                )
            output_dim, dim_name = output_shape, "output_shape"
        dropout_rate = 0.0 if dropout_rate is None else dropout_rate
        if not isinstance(num_heads, int) or num_heads <= 0:
            raise ValueError(f"num_heads must be a positive integer, got {num_heads!r}.")
        for name, dim in (("key_dim", key_dim), ("value_dim", value_dim), (dim_name, output_dim)):
            if dim is not None and (not isinstance(dim, int) or dim <= 0):
                raise ValueError(f"{name} must be a positive integer or None, got {dim!r}.")
        if not 0.0 <= dropout_rate < 1.0:
            raise ValueError(f"{rate_name} must be in [0, 1), got {dropout_rate!r}.")
        self.num_heads = num_heads
        self.key_dim = key_dim
        self.value_dim = value_dim
        self.output_dim = output_dim
        self.dropout_rate = dropout_rate
        self.use_bias = use_bias
        self.kernel_initializer = keras.initializers.get(kernel_initializer)
        self.bias_initializer = keras.initializers.get(bias_initializer)
        self.kernel_regularizer = keras.regularizers.get(kernel_regularizer)
        self.bias_regularizer = keras.regularizers.get(bias_regularizer)
        self.kernel_constraint = keras.constraints.get(kernel_constraint)
        self.bias_constraint = keras.constraints.get(bias_constraint)
        self.attention_init = attention_init
        self.seed = seed
        self.dropout = Dropout(dropout_rate, seed=seed, dtype=self.dtype_policy)
        self.supports_masking = True  # reads the Keras masks of values and keys; the output keeps the query's

    def build(self, query_shape, value_shape=None, key_shape=None):
        d_model = query_shape[-1]
        value_shape = query_shape if value_shape is None else value_shape
        key_shape = value_shape if key_shape is None else key_shape
        for name, shape in (("query", query_shape), ("value", value_shape), ("key", key_shape)):
            if len(shape) != 3 or shape[-1] is None:
                raise ValueError(
                    f"MultiHeadAttention expects {name} of shape [batch, length, features] with known "
                    f"features, got {tuple(shape)}."
                )
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
        if self.attention_init == "mimetic":  # only then: other modes draw as they always have
            if key_shape[-1] != d_model or value_shape[-1] != self._output_dim:
                raise ValueError(
                    'attention_init="mimetic" needs keys as wide as queries and values as wide as the output; got '
                    f"{key_shape[-1]} and {d_model}, {value_shape[-1]} and {self._output_dim}."
                )
            # The query and key kernels share a seed, as do the value and output kernels.
            self._pair_seeds = {role: self._pair_seed(index) for role, index in (("query", 0), ("value", 2))}
        self.query_kernel, self.query_bias = self._add_projection("query", 0, d_model, self._key_dim)
        self.key_kernel, self.key_bias = self._add_projection("key", 1, key_shape[-1], self._key_dim)
        self.value_kernel, self.value_bias = self._add_projection(
            "value", 2, value_shape[-1], self._value_dim
        )
        self.output_kernel = self._add_kernel(
            "output_kernel", 3, (self.num_heads, self._value_dim, self._output_dim), input_rank=2
        )
        self.output_bias = self._add_bias("output_bias", 3, (self._output_dim,)) if self.use_bias else None
        self.built = True

    def _add_projection(self, name, index, input_dim, head_dim):
        kernel = self._add_kernel(f"{name}_kernel", index, (input_dim, self.num_heads, head_dim), input_rank=1)
        bias = self._add_bias(f"{name}_bias", index, (self.num_heads, head_dim)) if self.use_bias else None
        return kernel, bias

    def _own_initializer(self, initializer, index):
        """The initializer of the layer's `index`-th weight of its kind (see `attention_init`)."""
        return initializer if self.attention_init == "tied" else _drawn_apart(initializer, index)

    def _pair_seed(self, index):
        """The seed of a mimetic pair of kernels: the kernel initializer's seed plus `index`, else a new one."""
        initializer = self.kernel_initializer
        seed = initializer.get_config().get("seed") if isinstance(initializer, keras.initializers.Initializer) else None
        if isinstance(seed, int):
            return seed + index
        return random.randint(1, 10**9)  # seeded by keras.utils.set_random_seed, as Keras's default seeds are

    def _kernel_initializer(self, index):
        if self.attention_init != "mimetic":
            return self._own_initializer(self.kernel_initializer, index)
        role = ("query", "key", "value", "output")[index]
        return MimeticInitializer(
            role,
            heads=self.num_heads if index < 2 else 1,
            seed=self._pair_seeds["query" if index < 2 else "value"],
        )

    def _add_kernel(self, name, index, shape, input_rank):
        """A kernel whose first `input_rank` axes are its input axes (see `_as_matrix`)."""
        return self.add_weight(
            name=name,
            shape=shape,
            initializer=_as_matrix(self._kernel_initializer(index), input_rank=input_rank),
            regularizer=self.kernel_regularizer,
            constraint=self.kernel_constraint,
        )

    def _add_bias(self, name, index, shape):
        return self.add_weight(
            name=name,
            shape=shape,
            initializer=self._own_initializer(self.bias_initializer, index),
            regularizer=self.bias_regularizer,
            constraint=self.bias_constraint,
        )

    @staticmethod
    def _project(x, kernel, bias):
        """`x` `[batch, length, dim]` times `kernel` `[dim, heads, head_dim]`, as one 2-D matmul,
        returned head-major: `[batch, heads, length, head_dim]`.

        Not `einsum("btd,dnh->btnh")`: TensorFlow runs that as a batched matmul that
        broadcasts the kernel over the batch, and its kernel gradient is then a batch
        of per-sentence products summed afterwards, the largest item of a training step's
        profile (see docs/performance.md). Flattening batch and length gives a single
        matmul forward and backward.
        """
        return MultiHeadAttention._project_many(x, [kernel], [bias])[0]

    @staticmethod
    def _project_many(x, kernels, biases):
        """`_project` for several kernels reading the same `x`, in one matmul.

        Self-attention projects one sequence into queries, keys and values: one
        `[batch * length, dim] x [dim, 3 * heads * head_dim]` product instead of three
        (bigger matrices run closer to the machine's peak, and backward gets one
        input gradient instead of three to add up).
        """
        batch, length = ops.shape(x)[0], ops.shape(x)[1]
        dim = kernels[0].shape[0]
        joint_kernel = _joined([ops.reshape(kernel, (dim, -1)) for kernel in kernels], axis=1)
        flat = ops.matmul(ops.reshape(x, (-1, dim)), joint_kernel)
        if biases[0] is not None:
            # One bias add on the joint product, not one per projection, and on a
            # matrix: its gradient is one column sum of a `[tokens, width]` matrix,
            # which XLA on CPUs computes faster than a sum over the first two axes
            # of a `[batch, length, width]` tensor (see `blocks.rowwise`).
            flat = flat + _joined([ops.reshape(b, (-1,)) for b in biases], axis=0)
        pieces = [flat]
        if len(kernels) > 1:
            widths = [k.shape[1] * k.shape[2] for k in kernels]
            pieces = ops.split(flat, [sum(widths[: i + 1]) for i in range(len(widths) - 1)], axis=1)
        projected = []
        for piece, kernel in zip(pieces, kernels, strict=True):
            _, heads, head_dim = kernel.shape
            heads_last = ops.reshape(piece, (batch, length, heads, head_dim))
            projected.append(ops.transpose(heads_last, (0, 2, 1, 3)))
        return projected

    def empty_cache(self, batch_size, max_decode_length, dtype=None):
        """A zeroed self-attention cache for outputs of up to `max_decode_length` tokens.

        Args:
            batch_size: Rows (int or scalar tensor).
            max_decode_length: Positions in the buffer.
            dtype: Defaults to the layer's compute dtype.

        Returns:
            Dict with `"key"` `[batch_size, num_heads, max_decode_length, key_dim]` and `"value"`
            `[batch_size, num_heads, max_decode_length, value_dim]`.
        """
        self._check_built("empty_cache")
        dtype = dtype or self.compute_dtype
        return {
            "key": ops.zeros((batch_size, self.num_heads, max_decode_length, self._key_dim), dtype=dtype),
            "value": ops.zeros((batch_size, self.num_heads, max_decode_length, self._value_dim), dtype=dtype),
        }

    @staticmethod
    def extend_cache(cache, max_decode_length):
        """A self-attention cache grown to `max_decode_length` positions, the new ones zeroed.

        Decoding can start with a short buffer and grow it as the output grows, so
        that each step attends over (and a beam search reorders) a buffer of about
        the output's length instead of the longest allowed.

        Args:
            cache: Dict with `"key"` and `"value"` `[batch, num_heads, length, dim]`
                (from `empty_cache`, filled in by decoding).
            max_decode_length: New buffer length (int or scalar tensor), `>= length`.

        Returns:
            The cache with `max_decode_length` positions, its first `length` unchanged.
        """

        def extend(buffer):
            grow_by = max_decode_length - ops.shape(buffer)[2]
            return ops.pad(buffer, [[0, 0], [0, 0], [0, grow_by], [0, 0]])

        return {"key": extend(cache["key"]), "value": extend(cache["value"])}

    def project_key_value(self, value, key=None):
        """Projects a fixed memory (the encoder output) into per-head keys and values.

        The result is the `cache` to pass, without `cache_index`, at every
        decoding step, so the encoder-decoder attention projects the memory once.

        Args:
            value: `[batch, source_length, dim]`.
            key: Defaults to `value`.

        Returns:
            Dict with `"transposed_key"` `[batch, num_heads, key_dim, source_length]`
            (see the module docstring) and `"value"` `[batch, num_heads, source_length,
            value_dim]`, in the layer's compute dtype.
        """
        self._check_built("project_key_value")
        keys, values = self._project_memory(value, key)
        return {"transposed_key": ops.swapaxes(keys, -1, -2), "value": values}

    def _check_built(self, method):
        if not self.built:  # Else an AttributeError on a weight: the head sizes come from the query's width.
            raise ValueError(
                f"MultiHeadAttention.{method} needs a built layer: call it, or build(query_shape, value_shape), first."
            )

    def _project_memory(self, value, key=None):
        """Head-major keys and values of `value` (and `key`), in the compute dtype."""
        # Called outside `__call__` (by `init_cache`), where Keras does not cast the
        # weights to the compute dtype: cast here, or a mixed-precision cache would be
        # float32 and every decoding step would attend in float32.
        dtype = self.compute_dtype

        def cast(weight):
            return None if weight is None else ops.cast(weight, dtype)

        value = ops.cast(value, dtype)
        key_kernel, value_kernel = cast(self.key_kernel), cast(self.value_kernel)
        key_bias, value_bias = cast(self.key_bias), cast(self.value_bias)
        if key is None:  # one memory: keys and values in one matmul
            keys, values = self._project_many(value, [key_kernel, value_kernel], [key_bias, value_bias])
        else:
            keys = self._project(ops.cast(key, dtype), key_kernel, key_bias)
            values = self._project(value, value_kernel, value_bias)
        return keys, values

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
        query_mask=None,
        value_mask=None,
        key_mask=None,
    ):
        if cache_index is not None and cache is None:
            raise ValueError("cache_index was given without a cache.")
        check_attention_mask(attention_mask)
        if cache is not None and (value_mask is not None or key_mask is not None):
            if cache_index is not None:
                raise ValueError(
                    "Keras masks of value/key cover the new tokens only, not the cache's positions; "
                    "decode with attention_mask over the cache instead."
                )
            value_mask = key_mask = None  # a fixed memory ignores value and key, and so their masks
        query_shape = ops.shape(query)
        fixed_memory = cache is not None and cache_index is None  # already projected: keys and values as given
        if fixed_memory:
            transposed_keys, value_heads = cache["transposed_key"], cache["value"]
            check_memory_rows(query.shape[0], value_heads.shape[0])
            # Queries sharing a memory row attend as one longer query sequence of that
            # row: the same matmuls, without a copy of the memory per query row.
            query = ops.reshape(query, (ops.shape(value_heads)[0], -1, query.shape[-1]))
            query_heads = self._project(query, self.query_kernel, self.query_bias)
            self._regularize_activity(query_shape[0], query_heads)
        else:
            if value is query and key is None:  # self-attention
                kernels = [self.query_kernel, self.key_kernel, self.value_kernel]
                biases = [self.query_bias, self.key_bias, self.value_bias]
                if cache is None:  # a whole sequence: Q, K and V in one matmul
                    query_heads, key_heads, value_heads = self._project_many(query, kernels, biases)
                else:
                    # Decoding: one token's three products are tiny, and a joined
                    # kernel would be rebuilt every step.
                    query_heads, key_heads, value_heads = (
                        self._project(query, kernel, bias) for kernel, bias in zip(kernels, biases, strict=True)
                    )
            else:
                query_heads = self._project(query, self.query_kernel, self.query_bias)
                key_heads, value_heads = self._project_memory(value, key)
            self._regularize_activity(query_shape[0], query_heads, key_heads, value_heads)
            if cache is not None:
                fits = check_cache_room(cache, cache_index, query_shape[1])
                if fits is not None:
                    with tf.control_dependencies([fits]):
                        key_heads = tf.identity(key_heads)
                key_heads = write_cache(cache["key"], cache_index, key_heads)
                value_heads = write_cache(cache["value"], cache_index, value_heads)
                cache = {"key": key_heads, "value": value_heads}
            transposed_keys = ops.swapaxes(key_heads, -1, -2)

        visible = None
        query_length, key_length = query_shape[1], ops.shape(value_heads)[2]
        if use_causal_mask:
            query_offset = 0 if cache_index is None else cache_index
            visible = causal_mask(query_length, key_length, query_offset)
        elif cache_index is not None:
            # The buffer's slots after the newest token hold no key yet (the causal
            # mask hides them too).
            visible = written_mask(key_length, cache_index + query_length)
        # Keras masks `[batch, key_length]` hide padded keys from every query.
        key_padding = [ops.expand_dims(m, axis=1) for m in (value_mask, key_mask) if m is not None]
        mask = intersect(attention_mask, *key_padding, visible)

        output, scores = self._attend(query_heads, transposed_keys, value_heads, mask, training)
        if fixed_memory:
            output = ops.reshape(output, (query_shape[0], query_shape[1], output.shape[-1]))
        self._regularize_activity(query_shape[0], output)
        outputs = (output,)
        if return_attention_scores:
            outputs += (_ungroup_scores(scores, query_shape[1]) if fixed_memory else scores,)
        if cache is not None:
            outputs += (cache,)
        return outputs[0] if len(outputs) == 1 else outputs

    def _attend(self, query_heads, transposed_keys, value_heads, mask, training):
        """softmax(Q K^T / sqrt(d_k) + mask) V, per head, softmax in float32 (float64 in a float64 layer).

        Queries and values are `[batch, heads, length, head_dim]`, keys transposed
        (`[batch, heads, head_dim, length]`): both products are batched matmuls over
        `(batch, heads)` of their inputs as they are.
        """
        query_heads = query_heads * ops.cast(1.0 / math.sqrt(self._key_dim), query_heads.dtype)
        logits = ops.matmul(query_heads, transposed_keys)
        # float32 softmax (float64 in a float64 layer): under float16 the large negative
        # addend and the exponentials would overflow; bfloat16 would lose the small weights.
        logits = ops.cast(logits, self._softmax_dtype)
        if mask is not None:
            mask = ops.cast(mask, "bool")
            if len(mask.shape) == 3:
                mask = ops.expand_dims(mask, axis=1)  # broadcast over heads
            # A select, not `logits + (1 - mask) * -1e9`: oneDNN's graph rewrite fuses
            # such an add into the Q K^T matmul, and that fused kernel is far slower with
            # a broadcast mask of a growing length, as in the uncached decoder (see docs/performance.md).
            logits = ops.where(mask, logits, MASKED_LOGIT)
        # Over a single key the softmax is 1 (keras.ops.softmax warns about that axis).
        scores = ops.ones_like(logits) if logits.shape[-1] == 1 else ops.softmax(logits, axis=-1)
        weights = self.dropout(ops.cast(scores, value_heads.dtype), training=training)
        context = ops.matmul(weights, value_heads)
        return self._merge_heads(context), scores

    def _regularize_activity(self, batch_size, *activations):
        """The activity regularizer's penalty of each of `activations`, over the batch's rows, as Keras adds it."""
        if self._activity_regularizer is None:
            return
        for activation in activations:
            penalty = self._activity_regularizer(activation)
            self.add_loss(ops.divide_no_nan(penalty, ops.cast(batch_size, penalty.dtype)))

    @property
    def _softmax_dtype(self):
        return "float64" if self.compute_dtype == "float64" else "float32"

    def _merge_heads(self, context):
        """`context` `[batch, heads, length, value_dim]` times the output kernel, plus the output
        bias, as one 2-D matmul (for the reason given in `_project`) and a bias add on its rows,
        which oneDNN fuses into the matmul in graph mode. (Under XLA the bias gradient is a
        column sum only if the caller also keeps the result 2-D: XLA folds reshapes into
        the sum; see `blocks._ResidualBlock._residual`.)"""
        context = ops.transpose(context, (0, 2, 1, 3))
        batch, length = ops.shape(context)[0], ops.shape(context)[1]
        heads, value_dim, output_dim = self.output_kernel.shape
        flat = ops.matmul(
            ops.reshape(context, (-1, heads * value_dim)),
            ops.reshape(self.output_kernel, (heads * value_dim, output_dim)),
        )
        if self.output_bias is not None:
            flat = flat + self.output_bias
        return ops.reshape(flat, (batch, length, output_dim))

    def compute_output_shape(self, query_shape, value_shape=None, key_shape=None):
        return tuple(query_shape[:-1]) + (self.output_dim or query_shape[-1],)

    def compute_output_spec(
        self,
        query,
        value=None,
        key=None,
        attention_mask=None,
        use_causal_mask=False,
        return_attention_scores=False,
        training=None,
        cache=None,
        cache_index=None,
        query_mask=None,
        value_mask=None,
        key_mask=None,
    ):
        """What `call` returns, as `KerasTensor`s (Keras functional models): the output,
        then the scores and the cache if `call` returns them."""
        outputs = (keras.KerasTensor(self.compute_output_shape(query.shape), dtype=self.compute_dtype),)
        if return_attention_scores:
            if cache is not None:
                key_length = cache["value"].shape[2]
            else:
                key_length = (key if key is not None else value).shape[1]
            scores_shape = (query.shape[0], self.num_heads, query.shape[1], key_length)
            outputs += (keras.KerasTensor(scores_shape, dtype=self._softmax_dtype),)
        if cache is not None:
            outputs += (spec_like(cache),)
        return outputs[0] if len(outputs) == 1 else outputs

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
                "attention_init": self.attention_init,
                "kernel_initializer": keras.initializers.serialize(self.kernel_initializer),
                "bias_initializer": keras.initializers.serialize(self.bias_initializer),
                "kernel_regularizer": keras.regularizers.serialize(self.kernel_regularizer),
                "bias_regularizer": keras.regularizers.serialize(self.bias_regularizer),
                "activity_regularizer": keras.regularizers.serialize(self._activity_regularizer),
                "kernel_constraint": keras.constraints.serialize(self.kernel_constraint),
                "bias_constraint": keras.constraints.serialize(self.bias_constraint),
                "seed": self.seed,
            }
        )
        return config
