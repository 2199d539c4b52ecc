"""Translating with a `Transformer` by beam search: `beam_search`, and the names every decoder shares.

`beam_search(model, source_ids, decoding)` runs the search of `keras_transformer.search_core`
over a `Transformer`: it runs the encoder once, projects the encoder memory once per
decoder layer (`init_cache`; the beams of a sentence share it, it is not tiled per
beam), and feeds only the newest token each step (`decode_step`). How it searches is a
`DecodingSettings` (beam size, length penalty, extra length, minimum length, early
stop; see `keras_transformer.decoding_settings`), the one object that the translator,
evaluation, the command lines and the export pass on.

The lengths, one name each:

* `max_extra_length` (a `DecodingSettings` field): each output has at most its source
  length (padding excluded, EOS included) + this many tokens.
* `max_output_length` (a `beam_search` argument): an optional cap on every output on
  top of that; the `translate_with_options` signature's `max_length` input
  (`keras_transformer.signatures`).
* `max_positions` (the model's): learned positional encodings cover this many
  positions; a longer source is refused, outputs are capped at it.
* `max_decode_length` (the search's): the length of its buffers, the batch's largest
  output limit.
* Sources are cut before they get here, at `max_source_length` tokens (`Translator`,
  `evaluation.translate`); `max_length` is the training length cap alone
  (`keras_transformer.data`).

This module re-exports `keras_transformer.decoding_settings` (`DecodingSettings`,
`MAX_BEAM_SIZE`, ...) and `keras_transformer.search_core` (`search`, `Hypotheses`,
`NEG_INF`, ...): `from keras_transformer.decoding import ...` reaches every decoding name.
"""

import dataclasses
import weakref

import tensorflow as tf

from keras_transformer.attention import MultiHeadAttention, compiling_with_xla
from keras_transformer.decoding_settings import (
    DEFAULT_MIN_LENGTH,
    DEFAULT_XLA_MAX_BATCH,
    EARLY_STOPPING,
    MAX_ALPHA,
    MAX_BEAM_SIZE,
    DecodingSettings,
    check_early_stopping,
)
from keras_transformer.search_core import (
    NEG_INF,
    BeamState,
    Hypotheses,
    SymbolsToLogitsFn,
    doubling_cache_lengths,
    expand_to_beams,
    expand_to_beams_nest,
    length_penalty,
    search,
)
from keras_transformer.tokenizer import BOS_ID, EOS_ID

__all__ = [
    "DEFAULT_MIN_LENGTH",
    "DEFAULT_XLA_MAX_BATCH",
    "EARLY_STOPPING",
    "MAX_ALPHA",
    "MAX_BEAM_SIZE",
    "NEG_INF",
    "BeamState",
    "DecodingSettings",
    "Hypotheses",
    "SymbolsToLogitsFn",
    "beam_search",
    "check_early_stopping",
    "doubling_cache_lengths",
    "expand_to_beams",
    "expand_to_beams_nest",
    "length_penalty",
    "search",
]


def beam_search(
    model,
    source_ids,
    decoding: DecodingSettings = DecodingSettings(),
    *,
    max_output_length=None,
    n_best=None,
    use_cache=True,
    eos_id=EOS_ID,
    bos_id=BOS_ID,
    jit_compile=False,
    output_kernel=None,
    beam_size=None,
    alpha=None,
    min_length=None,
) -> Hypotheses:
    """Translates a batch of source ids with a `Transformer` by beam search.

    Greedy decoding is `DecodingSettings(beam_size=1)`. Called eagerly, the search runs
    as a `tf.function` traced once per model and option set (kept while the model lives;
    scalar tensor options are read as Python values); inside a `tf.function` it adds its
    ops to the caller's graph.

    Args:
        model: A `keras_transformer.Transformer` (any dtype policy).
        source_ids: int `[batch, source_length]`, each row ending with EOS and padded
            with `model.pad_id` (as `keras_transformer.data.make_translation_dataset`
            makes them). With learned positional encodings, at most
            `model.max_positions` long (`Translator` cuts longer sources). A row of
            padding only has nothing to translate: it is not searched and gets no
            hypothesis (length 0, score `NEG_INF`), which lets a caller pad a batch to
            a size compiled before (`Translator` does, under XLA).
        decoding: The `DecodingSettings`: beam size, length penalty, extra length,
            minimum length and early stop.
        max_output_length: Optional cap on generated tokens (EOS included) for all
            rows, on top of their source length + `decoding.max_extra_length`; int or
            int32 scalar, at least 1 (a value known only when run is not checked). With
            learned positional encodings, outputs are also capped at `model.max_positions`.
        n_best: Hypotheses to return per row (`<= beam_size`); `None` returns only
            the best, without the `n_best` axis.
        use_cache: Feed only the newest token each step, reusing cached keys and
            values (`Transformer.decode_step`); `False` recomputes the whole prefix
            with `Transformer.decode` every step (same results, for comparison).
        eos_id: End-of-sequence id (benchmarks pass an id the model never emits to
            decode a fixed number of steps).
        bos_id: The start token the decoder was trained to begin with, never generated
            (as `model.pad_id`). Both default to `SubwordTokenizer`'s reserved ids.
        jit_compile: When called eagerly, compile the search with XLA (with an int
            beam size; compiled once per input shape).
        output_kernel: Optional `model.embedding.transposed_embeddings()` made ahead,
            `[d_model, vocab_size]`, for the cached search. Without it each search
            transposes the embedding matrix once; a model whose weights no longer
            change (a served one, see `Translator`) can keep the transpose instead.
        beam_size, alpha, min_length: This call's values of `decoding`'s fields, for
            values known only as tensors (a served request's options, see
            `Translator.translate_with_options`): int32/float32 scalars, or Python
            values (checked as `DecodingSettings` checks them). `None` keeps
            `decoding`'s. A tensor beam size whose value is known only when run makes
            the beams' shapes dynamic (graph mode, not XLA).

    Returns:
        `Hypotheses(tokens, lengths, scores)`: with `n_best=None`, `tokens` int32
        `[batch, length]` (no start token, never padding or the start token before EOS;
        EOS, then `model.pad_id` after it), `lengths`
        int32 `[batch]` (EOS included) and `scores` float32 `[batch]`, the summed
        log-probability divided by `((5 + lengths) / 6) ** alpha`. With `n_best`, each
        gets an `n_best` axis after the batch axis, best first. Pass `tokens` to
        `SubwordTokenizer.detokenize` to get text.

    Raises:
        ValueError: For sources longer than learned positional encodings cover, and
            options out of range. A source length known only when run (inside a
            `tf.function`) is checked then, in graph mode: an InvalidArgumentError;
            under XLA it is not checked.
        TypeError: If `decoding` is not a `DecodingSettings`.
    """
    if not isinstance(decoding, DecodingSettings):
        raise TypeError(
            f"decoding must be a DecodingSettings, got {decoding!r}: the beam size and length penalty are its "
            "fields, e.g. DecodingSettings(beam_size=1)."
        )
    overrides = dict(beam_size=beam_size, alpha=alpha, min_length=min_length)
    options = dict(
        max_output_length=max_output_length, n_best=n_best, use_cache=use_cache, eos_id=eos_id, bos_id=bos_id
    )
    if output_kernel is not None:
        _check_output_kernel(model, output_kernel)
    _check_source_length(model, source_ids)
    eager = tf.executing_eagerly()
    if eager:
        overrides = {name: _python_option(name, value) for name, value in overrides.items()}
        options = {name: _python_option(name, value) for name, value in options.items()}
    _check_max_output_length(options["max_output_length"])
    settings = _search_settings(decoding, overrides)
    if eager:
        search_fn = _traced_search(model, jit_compile, output_kernel is not None, **settings, **options)
        args = [tf.cast(source_ids, tf.int32)]
        if output_kernel is not None:
            args.append(tf.cast(output_kernel, model.embedding.compute_dtype))
        return search_fn(*args)
    return _search_transformer(model, source_ids, output_kernel=output_kernel, **settings, **options)


def _search_settings(decoding, overrides):
    """`decoding`'s fields as search arguments, with the overrides given (not `None`).

    Python values go through `DecodingSettings.replace`, which checks them; tensors are
    taken as they are.
    """
    given = {name: value for name, value in overrides.items() if value is not None}
    tensors = {name: value for name, value in given.items() if isinstance(value, tf.Tensor)}
    python = {name: value for name, value in given.items() if name not in tensors}
    return {**dataclasses.asdict(decoding.replace(**python)), **tensors}


def _check_max_output_length(max_output_length):
    """A Python cap below 1 (an eager tensor's is one by now) would still let every row generate one token."""
    if isinstance(max_output_length, int) and max_output_length < 1:
        raise ValueError(f"max_output_length must be at least 1 (None: no cap), got {max_output_length}.")


def _check_source_length(model, source_ids):
    """A source past learned positions fails in the encoder, or under XLA reads the last position silently."""
    length = tf.TensorShape(getattr(source_ids, "shape", None)).with_rank(2)[1]
    if model.learned_positions and length is not None and length > model.max_positions:
        raise ValueError(
            f"source_ids are {length} tokens long, but the model's learned positional encodings cover "
            f"{model.max_positions}: cut the sources to that length (as Translator does)."
        )


def _checked_source_length_when_run(model, source_ids):
    """`source_ids`, after a run-time check of a length unknown when tracing (`_check_source_length`).

    Graph mode only: XLA ignores the check (its lookup then reads the last position).
    """
    if not model.learned_positions or source_ids.shape[1] is not None:
        return source_ids
    length = tf.shape(source_ids)[1]
    check = tf.debugging.Assert(
        length <= model.max_positions,
        ["source_ids are", length, f"tokens long, but the model's learned positional encodings cover "
         f"{model.max_positions}: cut the sources to that length (as Translator does)."],
    )
    with tf.control_dependencies([check]):
        return tf.identity(source_ids)


def _search_transformer(
    model,
    source_ids,
    *,
    beam_size,
    alpha,
    max_extra_length,
    max_output_length,
    n_best,
    use_cache,
    eos_id,
    bos_id,
    early_stopping,
    min_length,
    output_kernel=None,
):
    source_ids = _checked_source_length_when_run(model, tf.cast(source_ids, tf.int32))
    encoder_outputs, source_mask = model.encode(source_ids, training=False)
    source_lengths = tf.reduce_sum(tf.cast(source_mask, tf.int32), axis=1)
    buffer_length = tf.shape(source_ids)[1] + max_extra_length
    row_max_lengths = source_lengths + max_extra_length
    caps = [] if max_output_length is None else [max_output_length]
    if model.learned_positions:
        caps.append(model.max_positions)
    for cap in caps:
        buffer_length = tf.minimum(buffer_length, cap)
        row_max_lengths = tf.minimum(row_max_lengths, cap)
    buffer_length = tf.maximum(buffer_length, 1)
    # A row of padding only is done before the first step (see `beam_search`).
    row_max_lengths = tf.where(source_lengths > 0, tf.maximum(row_max_lengths, 1), 0)

    if use_cache:
        # The self-attention buffers grow with the output (see doubling_cache_lengths). Under
        # XLA every row of a batch pays for the longest buffer, so it starts smaller there;
        # graph mode's single sentences were slower that way (docs/performance.md).
        first, doublings = (8, 3) if compiling_with_xla() else (16, 2)
        cache_lengths = doubling_cache_lengths(buffer_length, first, doublings)
        layer_caches = model.init_cache(encoder_outputs, cache_lengths[0])
        # Per row, never reordered with the beams: the projected encoder memory and its
        # mask, which the row's beams share (`decode_step`).
        row_state = {"memory": [layer["cross"] for layer in layer_caches], "source_mask": source_mask}
        initial_cache = [layer["self"] for layer in layer_caches]
        if output_kernel is None:
            output_kernel = model.embedding.transposed_embeddings()

        def symbols_to_logits_fn(ids, step, self_caches, row_state):
            newest = ids[:, step][:, None]
            caches = [
                {"self": own, "cross": cross}
                for own, cross in zip(self_caches, row_state["memory"], strict=True)
            ]
            logits, caches = model.decode_step(
                newest, caches, step, row_state["source_mask"], output_kernel=output_kernel
            )
            return logits[:, -1], [layer["self"] for layer in caches]

        def extend_cache_fn(self_caches, length):
            return [MultiHeadAttention.extend_cache(cache, length) for cache in self_caches]

    else:
        row_state = {"encoder_outputs": encoder_outputs, "source_mask": source_mask}
        initial_cache = ()
        cache_lengths = extend_cache_fn = None

        def symbols_to_logits_fn(ids, step, no_cache, row_state):
            per_beam = expand_to_beams_nest(row_state, beam_size)
            logits = model.decode(
                ids[:, : step + 1], per_beam["encoder_outputs"], per_beam["source_mask"], training=False
            )
            return logits[:, -1], no_cache

    initial_ids = tf.fill([tf.shape(source_ids)[0]], bos_id)
    return search(
        symbols_to_logits_fn,
        initial_ids,
        initial_cache,
        buffer_length,
        eos_id=eos_id,
        beam_size=beam_size,
        alpha=alpha,
        row_max_lengths=row_max_lengths,
        n_best=n_best,
        pad_id=model.pad_id,
        never_emit_ids=(model.pad_id, bos_id),
        cache_lengths=cache_lengths,
        extend_cache_fn=extend_cache_fn,
        early_stopping=early_stopping,
        min_length=min_length,
        row_state=row_state,
    )


def _output_kernel_spec(model):
    """The `tf.TensorSpec` of `model.embedding.transposed_embeddings()`."""
    embedding = model.embedding
    return tf.TensorSpec([embedding.d_model, embedding.vocab_size], embedding.compute_dtype)


def _check_output_kernel(model, output_kernel):
    """Raises a ValueError unless `output_kernel` has the transposed embeddings' shape."""
    expected = tuple(_output_kernel_spec(model).shape)
    if tuple(output_kernel.shape) != expected:
        raise ValueError(
            f"output_kernel must be the transposed embeddings, shape {expected}; "
            f"got shape {tuple(output_kernel.shape)}."
        )


def _python_option(name, value):
    """`value` as a Python value (the traced searches are keyed by their options)."""
    if not isinstance(value, tf.Tensor):
        return value
    if value.shape.rank != 0:
        raise ValueError(f"beam_search option {name} must be a scalar, got shape {tuple(value.shape)}.")
    return value.numpy().item()


# model -> {(jit_compile, with_output_kernel, options): tf.function}; entries go
# when the model does.
_TRACED_SEARCHES = weakref.WeakKeyDictionary()


def _traced_search(model, jit_compile, with_output_kernel, **options):
    """The `tf.function` running `_search_transformer` for `model` and `options`, traced once.

    With `with_output_kernel`, it takes the output kernel as a second argument.
    """
    functions = _TRACED_SEARCHES.setdefault(model, {})
    key = (jit_compile, with_output_kernel, tuple(sorted(options.items())))
    if key not in functions:
        model_ref = weakref.ref(model)  # the function must not keep the model alive
        signature = [tf.TensorSpec([None, None], tf.int32)]
        if with_output_kernel:
            signature.append(_output_kernel_spec(model))

        def run(source_ids, output_kernel=None):
            return _search_transformer(
                model_ref(), source_ids, output_kernel=output_kernel, **options
            )

        functions[key] = tf.function(
            run, input_signature=signature, jit_compile=jit_compile, autograph=False
        )
    return functions[key]
